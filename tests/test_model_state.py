"""Models written as Flax's own examples write them, beyond parameters: NNX modules that keep
their dropout streams (``nnx.Dropout(rate, rngs=rngs)``) train under every layout with the bits
of an independent one-device loop; ``train`` flags reach ``__call__`` by keyword; unset
``deterministic`` flags train and evaluate as ``model.train()``/``model.eval()`` would (running
statistics, BatchNorm's, are tested in test_batch_stats.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import shardkit as sk
from shardkit.core.errors import ModelError
from shardkit.models.nnx_adapter import stream_values

RATE, LR, STEPS = 0.3, 0.05, 3


class TutorialMLP(nnx.Module):
    """As Flax's NNX basics write a model: dropout streams kept in the module, no ``rngs`` in
    ``__call__``, no sharding metadata, no shardkit calls."""

    def __init__(self, rngs: nnx.Rngs, rate: float = RATE):
        self.linear1 = nnx.Linear(16, 64, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate, rngs=rngs)
        self.linear2 = nnx.Linear(64, 64, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate, rngs=rngs)
        self.out = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x):
        x = self.dropout1(nnx.relu(self.linear1(x)))
        return self.out(self.dropout2(nnx.relu(self.linear2(x))))


def squared_error(forward, batch):
    err = (forward(batch["x"])[:, 0] - batch["y"]) ** 2
    return err.mean(), jnp.asarray(err.shape[0], jnp.int32)


def regression_batches():
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.normal(size=(16,)).astype(np.float32)}
        for _ in range(STEPS)
    ]


def one_device_reference(batches, seed=0):
    """Plain Flax NNX + optax on one device, from the documented seeds: parameters from
    ``split(key(seed))[0]``, step ``s`` keyed ``fold_in(split(key(seed))[1], s)``, dropout stream
    ``i`` (by path) keyed ``fold_in(step_key, i)`` with a count of 0."""
    init_key, rng = jax.random.split(jax.random.key(seed))
    with jax.default_device(jax.devices()[0]):
        model = TutorialMLP(nnx.Rngs(init_key))
        optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
        losses = []
        for s, batch in enumerate(batches):
            step_key = jax.random.fold_in(rng, s)
            for i, dropout in enumerate((model.dropout1, model.dropout2)):
                dropout.rngs.key.set_value(jax.random.fold_in(step_key, i))
                dropout.rngs.count.set_value(jnp.zeros((), jnp.uint32))

            def loss_fn(m, batch=batch):
                err = (m(jnp.asarray(batch["x"]))[:, 0] - batch["y"]) ** 2
                return err.mean()

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            losses.append(float(loss))
        return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.filterwarnings("ignore:TutorialMLP names no parameter")  # tensor=2 has nothing to split
@pytest.mark.parametrize("layout", ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2"])
def test_stored_dropout_streams_draw_the_one_device_bits_under_every_layout(layout):
    batches = regression_batches()
    want_losses, want_params = one_device_reference(batches)
    trainer = sk.Trainer(sk.from_nnx(TutorialMLP), optax.sgd(LR), layout, loss=squared_error)
    state = trainer.init(0)
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, trainer.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got = jax.device_get(state.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want_params)
    # Dropout is on while training (a step's loss is not the evaluation's) and off when evaluated:
    # the same as the model built without dropout.
    batch = trainer.shard_batch(batches[0])
    without_dropout = sk.from_nnx(lambda rngs: TutorialMLP(rngs, rate=0.0))
    undropped = sk.Trainer(without_dropout, optax.sgd(LR), layout, loss=squared_error)
    evaluated = float(trainer.evaluate(state, batch)["loss"])
    assert evaluated == pytest.approx(float(undropped.evaluate(state.params, batch)["loss"]), rel=1e-6)
    assert abs(float(trainer.step(state, batch)[1]["loss"]) - evaluated) > 1e-3 * evaluated


def test_each_stored_stream_draws_its_own_bits_from_the_call_key():
    model = sk.from_nnx(TutorialMLP)
    params = model.init(jax.random.key(0))
    x = jnp.ones((4, 16))
    first = model.apply(params, x, jax.random.key(1))
    assert not np.allclose(first, model.apply(params, x, jax.random.key(2)))  # another key, other bits
    np.testing.assert_array_equal(first, model.apply(params, x, jax.random.key(1)))  # not stateful
    abstract = nnx.eval_shape(lambda: TutorialMLP(nnx.Rngs(0)))
    streams = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(abstract, nnx.RngState)))[0]
    values = stream_values(streams, jax.random.key(1))
    keys = [jax.random.key_data(values[f"dropout{i}"]["rngs"]["key"]) for i in (1, 2)]
    assert not np.array_equal(keys[0], keys[1])


def test_a_linen_model_that_only_sows_intermediates_is_accepted():
    class Sowing(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8)(x)
            self.sow("intermediates", "hidden", h)
            return nn.Dense(1)(h)

    model = sk.from_linen(Sowing(), jnp.zeros((2, 4)))
    assert model.state_init is None  # appended to at each call: not state
    params = model.init(jax.random.key(0))
    assert model.apply(params, jnp.ones((2, 4)), None).shape == (2, 1)


def test_stored_streams_with_pipeline_stages_are_refused():
    with pytest.raises(ModelError, match="(?s)stores RNG streams.*rngs=rngs"):
        sk.from_nnx(TutorialMLP, stacked_layers="layers")


class FlaggedLinenLM(nn.Module):
    """As Flax's Linen examples write a model that trains and evaluates: a required ``train``
    flag that turns dropout on."""

    @nn.compact
    def __call__(self, tokens, train: bool):
        x = nn.Embed(256, 32)(tokens)
        h = nn.Dropout(RATE, deterministic=not train)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))
        return nn.Dense(256)(x + nn.Dense(32)(h))


def test_a_linen_train_flag_is_passed_by_keyword_in_steps_and_evaluation():
    flags = {"train_kwargs": {"train": True}, "eval_kwargs": {"train": False}}
    model = sk.from_linen(FlaggedLinenLM(), jnp.zeros((2, 16), jnp.int32), **flags)
    batch = sk.TextDataset.builtin().batch(0, batch_size=16, seq_len=16)
    losses = {}
    for layout in ("data=8", "fsdp=8"):
        trainer = sk.Trainer(model, optax.sgd(0.0), layout)
        state = trainer.init(0)
        sharded = trainer.shard_batch(batch)
        evaluated = float(trainer.evaluate(state, sharded)["loss"])
        params = jax.device_get(state.params)  # before the step, which donates the state
        losses[layout] = (float(trainer.step(state, sharded)[1]["loss"]), evaluated)
    assert losses["data=8"] == pytest.approx(losses["fsdp=8"], rel=1e-5)
    # Evaluation is the plain Flax call with train=False on one device; the step's dropout differs.
    tokens = jnp.asarray(batch["tokens"])
    logits = FlaggedLinenLM().apply({"params": params}, tokens[:, :-1], train=False)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    step_loss, eval_loss = losses["fsdp=8"]
    assert eval_loss == pytest.approx(float(want), rel=1e-5)
    assert abs(step_loss - eval_loss) > 1e-3


def test_call_arguments_given_wrongly_are_refused_with_the_fix():
    example = jnp.zeros((2, 16), jnp.int32)
    with pytest.raises(ModelError, match=r"(?s)missing 1 required positional argument: 'train'.*train_kwargs="):
        sk.from_linen(FlaggedLinenLM(), example)
    with pytest.raises(ModelError, match="takes one example input.*got 2.*train_kwargs"):
        sk.from_linen(FlaggedLinenLM(), example, False)
    with pytest.raises(ModelError, match="train_kwargs for FlaggedLinenLM must map argument names"):
        sk.from_linen(FlaggedLinenLM(), example, train_kwargs=True)
    with pytest.raises(ModelError, match="eval_kwargs for TutorialMLP must map argument names"):
        sk.from_nnx(TutorialMLP, eval_kwargs=[("train", False)])


def test_an_nnx_model_taking_rngs_evaluates_with_dropout_off():
    class TakesRngs(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(16, 1, rngs=rngs)
            self.dropout = nnx.Dropout(0.5)

        def __call__(self, x, rngs=None):
            return self.linear(self.dropout(x, rngs=rngs))

    model = sk.from_nnx(TakesRngs)
    params = model.init(jax.random.key(0))
    x = jnp.ones((4, 16))
    plain = x @ params["linear"]["kernel"] + params["linear"]["bias"]
    np.testing.assert_allclose(model.apply(params, x, None), plain, rtol=1e-6)
    assert not np.allclose(model.apply(params, x, jax.random.key(1)), plain)


def test_a_training_step_sets_unset_deterministic_flags_and_keeps_explicit_ones():
    """As ``model.train()`` before a loop: nnx.MultiHeadAttention with dropout and no
    ``deterministic`` would refuse to run; a dropout switched off by its author stays off."""

    class Unset(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, dropout_rate=0.5, decode=False, rngs=rngs)

        def __call__(self, x):
            return self.attn(x)

    class SwitchedOff(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(8, 8, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, deterministic=True, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    x = jnp.ones((2, 4, 8))
    unset = sk.from_nnx(Unset)
    params = unset.init(jax.random.key(0))
    assert not np.allclose(unset.apply(params, x, jax.random.key(1)), unset.apply(params, x, None))
    off = sk.from_nnx(SwitchedOff)
    params = off.init(jax.random.key(0))
    np.testing.assert_array_equal(off.apply(params, x, jax.random.key(1)), off.apply(params, x, None))


class LinenNoise(nn.Module):
    """Noise injection as Linen models write it: a stream of their own name."""

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(32)(x)
        if train:
            h = h + jax.random.normal(self.make_rng("noise"), h.shape)
        return nn.Dense(1)(nn.relu(h))


class NNXNoise(nnx.Module):
    """The same in NNX: ``rngs.noise()`` from the ``rngs`` passed to ``__call__``."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden, self.out = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        h = self.hidden(x)
        if rngs is not None:
            h = h + jax.random.normal(rngs.noise(), h.shape)
        return self.out(nnx.relu(h))


def test_rng_streams_of_any_name_draw_the_documented_bits_under_every_layout():
    """A stream besides dropout is keyed ``fold_in(step_key, 1)`` (Linen: the i-th other name
    ``fold_in(step_key, i + 1)``; NNX: the default stream), so a step draws the same bits under
    every layout, as a one-device call with those keys does."""
    batch = regression_batches()[0]
    init_key, rng = jax.random.split(jax.random.key(0))
    step_key = jax.random.fold_in(rng, 0)
    x = jnp.asarray(batch["x"])
    linen = sk.from_linen(LinenNoise(), jnp.zeros((1, 16)), train_kwargs={"train": True}, eval_kwargs={"train": False})
    params = linen.init(init_key)
    keys = {"dropout": step_key, "noise": jax.random.fold_in(step_key, 1)}
    want = {"linen": LinenNoise().apply({"params": params}, x, train=True, rngs=keys)}
    nnx_model = NNXNoise(nnx.Rngs(init_key))
    want["nnx"] = nnx_model(x, rngs=nnx.Rngs(jax.random.fold_in(step_key, 1), dropout=step_key))
    want = {k: float(jnp.mean((v[:, 0] - batch["y"]) ** 2)) for k, v in want.items()}
    assert want["linen"] != pytest.approx(
        float(jnp.mean((LinenNoise().apply({"params": params}, x, train=False)[:, 0] - batch["y"]) ** 2))
    )
    for name, model in (("linen", linen), ("nnx", sk.from_nnx(NNXNoise))):
        for layout in ("data=8", "fsdp=8"):
            trainer = sk.Trainer(model, optax.sgd(LR), layout, loss=squared_error)
            _, metrics = trainer.step(trainer.init(0), trainer.shard_batch(batch))
            assert float(metrics["loss"]) == pytest.approx(want[name], rel=1e-5), (name, layout)
