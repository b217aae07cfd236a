"""Sampling: one compiled loop whose tokens equal a token-by-token loop in Python over the model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.models.generate import _continue, _sampling_placement, generate

WINDOW = 8


@pytest.fixture(scope="module")
def tiny():
    model = sk.models.GPTConfig.preset("tiny").model()
    return model, jax.device_put(model.init(jax.random.key(0)), jax.devices()[0])


def reference(model, params, prompt, num_tokens, window, temperature, seed):
    """The definition, one forward per token: the last ``window`` tokens, left-aligned, zero-padded."""
    apply = jax.jit(lambda p, x: model.apply(p, x, None))
    tokens, key = list(prompt), jax.random.key(seed)
    for _ in range(num_tokens):
        context = tokens[-window:]
        padded = np.zeros((1, window), np.int32)
        padded[0, : len(context)] = context
        logits = apply(params, jnp.asarray(padded))[0, len(context) - 1]
        if temperature == 0:
            tokens.append(int(jnp.argmax(logits)))
        else:
            key, sub = jax.random.split(key)
            tokens.append(int(jax.random.categorical(sub, logits.astype(jnp.float32) / temperature)))
    return tokens


@pytest.mark.parametrize("prompt", [[5], [1, 2, 3], list(range(1, 12))], ids=["one", "three", "past-window"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_loop_equals_one_forward_per_token(tiny, prompt, temperature):
    model, params = tiny
    # 12 new tokens cross the window: the context slides after WINDOW tokens exist.
    got = generate(model, params, np.array(prompt), 12, WINDOW, temperature=temperature, seed=3)
    want = reference(model, params, prompt, 12, WINDOW, temperature, seed=3)
    assert got.tolist() == want
    assert got.dtype == np.int32


def test_a_sharded_model_samples_what_one_device_samples(tiny):
    model, params = tiny
    trainer = sk.Trainer(model, optax.sgd(0.1), "data=2,fsdp=2,tensor=2")
    sharded = jax.device_put(params, trainer.state_shardings.params)
    assert len(jax.tree.leaves(sharded)[0].sharding.device_set) == 8
    got = generate(model, sharded, np.array([1, 2]), 10, WINDOW, temperature=0.8, seed=1)
    assert got.tolist() == generate(model, params, np.array([1, 2]), 10, WINDOW, temperature=0.8, seed=1).tolist()


def test_simulated_devices_sample_from_one_device_without_collectives(tiny):
    model, params = tiny
    trainer = sk.Trainer(model, optax.sgd(0.1), "fsdp=4,tensor=2")
    sharded = jax.device_put(params, trainer.state_shardings.params)
    placed = _sampling_placement(sharded)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(placed)} == {1}
    args = (jnp.zeros(16, jnp.int32), jnp.int32(1), jax.random.key(0), jnp.float32(1.0))
    options = dict(num_tokens=4, window=WINDOW, greedy=False)
    text = _continue.lower(model, placed, *args, **options).compile().as_text()
    assert sum(hlo.count(text).values()) == 0, "sampling from one device should need no collectives"
    assert "while" in text, "the tokens should come from one loop in the program"
    # Without the placement, the training layout's program gathers and reduces at every layer.
    assert sum(hlo.count(_continue.lower(model, sharded, *args, **options).compile().as_text()).values()) > 0


def test_zero_new_tokens_return_the_prompt(tiny):
    model, params = tiny
    assert generate(model, params, np.array([4, 5]), 0, WINDOW).tolist() == [4, 5]


@pytest.mark.parametrize(
    "prompt, num_tokens, window",
    [([], 5, WINDOW), ([1], -1, WINDOW), ([1], 5, 0)],
    ids=["empty-prompt", "negative-count", "no-window"],
)
def test_bad_sampling_requests_name_the_fix(tiny, prompt, num_tokens, window):
    model, params = tiny
    with pytest.raises(sk.errors.InputError, match="at least 1 token"):
        generate(model, params, np.array(prompt, np.int32), num_tokens, window)


@pytest.mark.parametrize("factory", ["gemma_lm", "linen_lm"])
def test_models_written_without_shardkit_sample_as_the_reference_does(factory):
    """An NNX and a Linen LM with Flax's own metadata, trained layout fsdp=8: the loop's tokens are
    the token-by-token reference's, and the program it compiles for them needs no collective."""
    import byo_factories

    model = getattr(byo_factories, factory)()
    trainer = sk.Trainer(model, optax.sgd(0.1), "fsdp=8")
    sharded = trainer.init(0).params
    assert max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded)) == 8
    one_device = jax.device_put(sharded, jax.devices()[0])
    got = generate(model, sharded, np.array([3, 1]), 10, WINDOW, temperature=0.8, seed=2)
    assert got.tolist() == reference(model, one_device, [3, 1], 10, WINDOW, 0.8, seed=2)
    args = (jnp.zeros(16, jnp.int32), jnp.int32(2), jax.random.key(0), jnp.float32(1.0))
    text = _continue.lower(model, _sampling_placement(sharded), *args, num_tokens=4, window=WINDOW, greedy=False)
    assert sum(hlo.count(text.compile().as_text()).values()) == 0
