"""Accumulation, precision, remat, layout-independent randomness and the non-finite guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import CORE_LAYOUTS, assert_adam_params_close, assert_trees_close, run_trainer

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.models import GPT, GPTConfig
from shardkit.training.train import NonFiniteError

DATA = sk.TextDataset.builtin()
BATCHES = [DATA.batch(step, batch_size=16, seq_len=32) for step in range(8)]


def trainer(layout="data=2,fsdp=2,tensor=2", cfg=None, **kwargs):
    cfg = cfg or GPTConfig.preset("tiny")
    return sk.Trainer(cfg.model(), optax.adamw(3e-3), layout, **kwargs)


def test_microbatches_equal_the_whole_batch():
    # SGD: the parameters move by the accumulated gradients themselves, so an elementwise check
    # is machine-independent (Adam would amplify rounding in near-zero gradients; see helpers).
    sgd = GPTConfig.preset("tiny").model()
    whole_losses, whole = run_trainer(sk.Trainer(sgd, optax.sgd(0.3), "data=2,fsdp=2,tensor=2"), BATCHES)
    micro = sk.Trainer(sgd, optax.sgd(0.3), "data=2,fsdp=2,tensor=2", microbatches=4)
    micro_losses, micro_params = run_trainer(micro, BATCHES)
    np.testing.assert_allclose(micro_losses, whole_losses, rtol=1e-5)
    assert_trees_close(micro_params, whole, rtol=1e-4, atol=1e-6)
    adam_whole, adam_params = run_trainer(trainer(), BATCHES)
    adam_micro, adam_micro_params = run_trainer(trainer(microbatches=4), BATCHES)
    np.testing.assert_allclose(adam_micro, adam_whole, rtol=1e-5)
    assert_adam_params_close(adam_micro_params, adam_params, lr=3e-3, steps=len(BATCHES))


def test_microbatches_must_divide_the_batch():
    t = trainer("data=8", microbatches=3)
    with pytest.raises(sk.ShardkitError, match="multiple of 24"):
        t.step(t.init(0), t.shard_batch(BATCHES[0]))


def dot_operand_types(lowered_text):
    """Operand element types of each matmul in a lowered (StableHLO) program."""
    import re

    return [
        frozenset(re.findall(r"tensor<[^>]*x(\w+)>", line.split("->")[0]))
        for line in lowered_text.splitlines()
        if "stablehlo.dot_general" in line
    ]


def test_bf16_policy_really_computes_in_bf16_and_tracks_fp32():
    batch = {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}
    fp32, bf16 = trainer(), trainer(precision="bf16")
    assert set(dot_operand_types(fp32.lower(batch).as_text())) == {frozenset({"f32"})}
    dots = dot_operand_types(bf16.lower(batch).as_text())
    # Every projection and its gradients multiply bf16 by bf16; only a few attention-backward
    # matmuls see an fp32 operand (softmax statistics kept in fp32).
    assert sum(d == {"bf16"} for d in dots) >= 0.8 * len(dots)
    # The compiled program keeps activations in bf16 (the CPU backend upcasts inside its matmuls).
    assert "bf16[" in bf16.compile(batch).as_text() and "bf16[" not in fp32.compile(batch).as_text()
    ref, _ = run_trainer(fp32, BATCHES)
    got, params = run_trainer(bf16, BATCHES)
    assert jax.tree.leaves(params)[0].dtype == jnp.float32  # parameters stay fp32
    np.testing.assert_allclose(got, ref, rtol=2e-2)


def test_bf16_master_policy_keeps_bf16_params_and_fp32_master():
    t = trainer(precision="bf16-master")
    state = t.init(0)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.master)} == {jnp.dtype(jnp.float32)}
    assert state.master["lm_head"].sharding == state.params["lm_head"].sharding
    ref, _ = run_trainer(trainer(), BATCHES)
    got, _ = run_trainer(t, BATCHES)
    np.testing.assert_allclose(got, ref, rtol=3e-2)
    # bf16 params are the master weights rounded: the update went to the master copy.
    final = t.init(0)
    for b in BATCHES:
        final, _ = t.step(final, t.shard_batch(b))
    np.testing.assert_array_equal(
        np.asarray(final.params["lm_head"]), np.asarray(final.master["lm_head"].astype(jnp.bfloat16))
    )


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_leaves_the_numbers_unchanged(remat):
    ref, ref_params = run_trainer(trainer(), BATCHES[:4])
    got, params = run_trainer(trainer(cfg=GPTConfig.preset("tiny", remat=remat)), BATCHES[:4])
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert_adam_params_close(params, ref_params, lr=3e-3, steps=4, rtol=1e-4, atol=1e-5)


DROPOUT = GPTConfig.preset("tiny", dropout=0.1)


@pytest.fixture(scope="module")
def dropout_reference():
    """Single device, plain jax: dropout keys derived as TrainState documents them."""
    graphdef = nnx.graphdef(GPT(DROPOUT, rngs=nnx.Rngs(0)))
    init_key, rng = jax.random.split(jax.random.key(0))
    params = nnx.to_pure_dict(nnx.state(GPT(DROPOUT, rngs=nnx.Rngs(init_key)), nnx.Param))
    tx = optax.adamw(3e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, tokens, i):
        key = jax.random.fold_in(rng, i)

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1], rngs=nnx.Rngs(dropout=key))
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, loss

    losses = []
    for i, b in enumerate(BATCHES[:5]):
        params, opt, loss = step(params, opt, b["tokens"], i)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("layout,n", CORE_LAYOUTS)
def test_dropout_bits_do_not_depend_on_the_layout(layout, n, dropout_reference):
    t = sk.Trainer(DROPOUT.model(), optax.adamw(3e-3), layout, devices=jax.devices()[:n])
    losses, _ = run_trainer(t, BATCHES[:5])
    np.testing.assert_allclose(losses, dropout_reference, rtol=2e-5)


@pytest.mark.slow
def test_dropout_is_on_and_follows_the_seed():
    no_dropout, _ = run_trainer(trainer(), BATCHES[:3])
    seed0, _ = run_trainer(trainer(cfg=DROPOUT), BATCHES[:3], seed=0)
    again, _ = run_trainer(trainer(cfg=DROPOUT), BATCHES[:3], seed=0)
    assert seed0 == again
    assert seed0[0] != no_dropout[0]


def poisoned(t, batch):
    """A batch that yields a NaN loss on the device. shard_batch refuses out-of-vocabulary ids on
    the host, so this places it directly, as a batch built on the device would arrive."""
    bad = {k: v.copy() for k, v in batch.items()}
    bad["tokens"][0, 5] = 10**6  # out of the vocabulary: the embedding lookup yields NaN
    specs = t.batch_specs(bad)
    return {k: jax.device_put(v, jax.sharding.NamedSharding(t.mesh, specs[k])) for k, v in bad.items()}


def test_nonfinite_skip_leaves_the_state_as_it_was():
    t = trainer(nonfinite="skip")
    state, _ = t.step(t.init(0), t.shard_batch(BATCHES[0]))
    before = jax.device_get(state)
    after, metrics = t.step(state, poisoned(t, BATCHES[1]))
    assert not bool(metrics["finite"])
    assert_trees_close(jax.device_get(after), before, rtol=0, atol=0)
    after, metrics = t.step(after, t.shard_batch(BATCHES[1]))
    assert bool(metrics["finite"]) and int(after.step) == 2


def test_nonfinite_halt_names_the_step_and_the_parameter():
    t = trainer(nonfinite="halt")
    state, _ = t.step(t.init(0), t.shard_batch(BATCHES[0]))
    before = jax.device_get(state)
    with pytest.raises(NonFiniteError, match=r"Step 2: loss nan, first non-finite gradient: \S+") as err:
        t.step(state, poisoned(t, BATCHES[1]))
    assert err.value.step == 2 and err.value.parameter
    assert_trees_close(jax.device_get(err.value.state), before, rtol=0, atol=0)


def test_the_guard_is_on_by_default_and_escalates_consecutive_skips():
    t = trainer()  # the API default: skip, escalating after max_skips in a row
    assert t.nonfinite == "skip" and t.max_skips == 10
    t = trainer(max_skips=3)
    state, _ = t.step(t.init(0), t.shard_batch(BATCHES[0]))
    good = jax.device_get(state)
    state, metrics = t.step(state, poisoned(t, BATCHES[1]))
    assert not bool(metrics["finite"])
    state, metrics = t.step(state, t.shard_batch(BATCHES[1]))  # a good step resets the count
    assert bool(metrics["finite"]) and t.skipped_in_a_row == 0
    good = jax.device_get(state)
    state, _ = t.step(state, poisoned(t, BATCHES[2]))
    state, _ = t.step(state, poisoned(t, BATCHES[3]))
    with pytest.raises(NonFiniteError, match=r"3 steps in a row were not finite .* stayed at step 2.*diverging") as err:
        t.step(state, poisoned(t, BATCHES[4]))
    assert_trees_close(jax.device_get(err.value.state), good, rtol=0, atol=0)


def test_max_skips_must_be_a_count():
    with pytest.raises(sk.ShardkitError, match="max_skips=-1"):
        trainer(max_skips=-1)


@pytest.mark.parametrize(
    "entry, match",
    [
        (np.full((16, 33), 256, np.int32), r"token ids from \d+ to 256, outside the model's vocabulary \[0, 256\)"),
        (np.full((16, 33), -1, np.int32), r"token ids from -1 to -1"),
        (np.zeros((16, 33), np.float32), "float32 values; token ids must be integers"),
        (np.zeros((16,), np.int32), r"must be \(batch, seq \+ 1\) token ids, got shape \(16,\)"),
    ],
)
def test_bad_token_batches_are_refused_on_the_host(entry, match):
    with pytest.raises(sk.ShardkitError, match=match):
        trainer("data=8").shard_batch({"tokens": entry})


def test_a_batch_without_tokens_or_with_nan_is_refused():
    t = trainer("data=8")
    with pytest.raises(sk.ShardkitError, match=r"reads batch\['tokens'\], but the batch has \['ids'\]"):
        t.shard_batch({"ids": BATCHES[0]["tokens"]})
    mse = sk.Trainer(GPTConfig.preset("tiny").model(), optax.sgd(0.1), "data=8", loss=sk.mse_loss)
    x = np.ones((8, 4), np.float32)
    x[3, 1] = np.nan
    with pytest.raises(sk.ShardkitError, match=r"batch\['x'\] holds NaN or Inf values \(1 of 32\)"):
        mse.shard_batch({"x": x, "y": np.ones((8, 4), np.float32)})


def test_nonfinite_policy_must_be_known():
    with pytest.raises(sk.ShardkitError, match="'skip', 'halt' or None"):
        trainer(nonfinite="ignore")


def test_guarded_step_still_counts_no_extra_collectives_over_tensor():
    batch = {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}
    plain = hlo.count(trainer("data=8", nonfinite=None).compile(batch).as_text())
    guarded = hlo.count(trainer("data=8", nonfinite="skip").compile(batch).as_text())
    assert guarded["all-gather"] == plain["all-gather"] == 0
