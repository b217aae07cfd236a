"""The parts of the step, each testable alone: the sharding plan (a value), gradient strategies
(one signature) and the update."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import shardkit as sk
from shardkit.core.precision import as_precision
from shardkit.core.rules import default_rules
from shardkit.core.sharding import ShardingPlan, plan_sharding
from shardkit.training.accumulation import accumulated_grads
from shardkit.training.steps import make_step, plain_grads

CFG = sk.models.GPTConfig.preset("tiny")
TOKENS = sk.TextDataset.builtin().batch(0, batch_size=16, seq_len=32)["tokens"]


def plan(layout="data=2,fsdp=2,tensor=2", precision="fp32"):
    return plan_sharding(
        CFG.model(), optax.adamw(1e-3), layout, rules=default_rules(), precision=as_precision(precision)
    )


def test_the_sharding_plan_is_a_plain_value_that_agrees_with_the_trainer():
    p = plan()
    assert isinstance(p, ShardingPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.rules = default_rules()  # a value: decided once, never mutated
    trainer = sk.Trainer(CFG.model(), optax.adamw(1e-3), "data=2,fsdp=2,tensor=2")
    assert p.param_specs == trainer.param_specs and p.table() == trainer.sharding_table()
    # Adam's moments follow their parameter; its counter is replicated; no master copy in fp32.
    adam = p.state_specs.opt_state[0]
    assert adam.mu == p.param_specs and adam.count == jax.sharding.PartitionSpec()
    assert p.state_specs.master is None and plan(precision="bf16-master").state_specs.master == p.param_specs
    assert p.batch_specs({"tokens": TOKENS}) == {"tokens": jax.sharding.PartitionSpec(("data", "fsdp"), None)}
    assert p.local_rows(16) == slice(0, 16)  # one process holds every row


def test_gradient_strategies_share_one_signature_and_agree():
    p = plan()
    model = CFG.model()
    params = model.init(jax.random.key(0))
    batch = {"tokens": jnp.asarray(TOKENS)}
    key = jax.random.key(1)
    plain = plain_grads(model, sk.next_token_loss, as_precision("fp32"))
    accumulated = accumulated_grads(plain, 4, p)
    with sk.use_sharding(p.mesh, p.rules):
        loss_1, count_1, g_1, state_1, sums_1 = jax.jit(plain)(params, None, batch, key)
        loss_4, count_4, g_4, state_4, sums_4 = jax.jit(accumulated)(params, None, batch, key)
    assert state_1 is None and state_4 is None  # a model without running statistics
    assert sums_1 == sums_4 == {}  # nor a mixture of experts' load
    assert int(count_1) == int(count_4) == 16 * 32
    np.testing.assert_allclose(float(loss_4), float(loss_1), rtol=1e-5)
    assert_trees_close(g_4, g_1, rtol=1e-4, atol=1e-6)


def test_make_step_applies_the_optimizer_and_the_guard_refuses_nan():
    model = CFG.model()
    params = model.init(jax.random.key(0))
    tx = optax.sgd(0.1)
    state = sk.TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), jax.random.key_data(jax.random.key(1)))
    step = make_step(plain_grads(model, sk.next_token_loss, as_precision("fp32")), tx, as_precision("fp32"), "skip")
    new, metrics = jax.jit(step)(state, {"tokens": jnp.asarray(TOKENS)})
    assert bool(metrics["finite"]) and int(new.step) == 1
    _, _, grads, _, _ = plain_grads(model, sk.next_token_loss, as_precision("fp32"))(
        params, None, {"tokens": jnp.asarray(TOKENS)}, jax.random.fold_in(jax.random.key(1), 0)
    )
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)  # SGD by hand
    assert_trees_close(new.params, want, rtol=1e-5, atol=1e-6)
    bad = jnp.asarray(TOKENS).at[0, 3].set(10**6)  # out of the vocabulary: NaN
    same, metrics = jax.jit(step)(state, {"tokens": bad})
    assert not bool(metrics["finite"])
    assert_trees_close(same.params, params, rtol=0, atol=0)


def test_the_guard_refuses_an_update_that_overflows_though_gradients_are_finite():
    # Every setting finite, the update not: sign(g) * 3e38 * 2 overflows float32.
    overflowing = optax.chain(optax.scale_by_sign(), optax.scale(-3e38), optax.scale(2.0))
    trainer = sk.Trainer(CFG.model(), overflowing, "data=8", nonfinite="halt")
    state = trainer.init(0)
    before = jax.device_get(state.params)
    with pytest.raises(sk.NonFiniteError, match="first parameter the update made non-finite") as err:
        trainer.step(state, trainer.shard_batch({"tokens": TOKENS}))
    assert err.value.parameter and err.value.step == 1
    assert_trees_close(jax.device_get(err.value.state.params), before, rtol=0, atol=0)
