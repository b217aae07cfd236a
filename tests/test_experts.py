"""Mixture of experts: routing with capacity, equality to one device, all-to-all dispatch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpt_reference, run_trainer

import shardkit as sk
from shardkit.models import GPTConfig
from shardkit.parallel import route, top_k_by_rows

CFG = GPTConfig.preset("tiny", n_experts=4, top_k=2, capacity_factor=1.0)
DATA = sk.TextDataset.builtin()
BATCHES = [DATA.batch(step, batch_size=8, seq_len=32) for step in range(5)]


def test_route_keeps_first_choices_within_capacity():
    # 3 tokens, 2 experts, everyone prefers expert 0; capacity 1: only token 0 gets expert 0.
    logits = jnp.array([[[5.0, 0.0], [5.0, 0.0], [5.0, 0.0]]])
    dispatch, combine, aux = route(logits, top_k=1, capacity=1)
    assert dispatch.shape == (1, 3, 2, 1)
    np.testing.assert_array_equal(dispatch[0, :, 0, 0], [1, 0, 0])  # tokens 1, 2 dropped from expert 0
    np.testing.assert_allclose(combine[0, 0, 0, 0], 1.0)  # top-1 gate renormalised to 1
    assert float(aux) == pytest.approx(2 * float(jax.nn.softmax(jnp.array([5.0, 0.0]))[0]), rel=1e-5)


def test_route_second_choices_fill_after_first_choices():
    logits = jnp.array([[[3.0, 2.0, 0.0], [3.0, 0.0, 2.0]]])  # both prefer expert 0
    dispatch, combine, _ = route(logits, top_k=2, capacity=2)
    assert dispatch[0, 0, 0].sum() == 1 and dispatch[0, 1, 0].sum() == 1  # both fit in expert 0
    assert dispatch[0, 0, 1].sum() == 1 and dispatch[0, 1, 2].sum() == 1  # and their second choices
    np.testing.assert_allclose(combine.sum(axis=(2, 3)), 1.0, rtol=1e-6)  # gates renormalised over k


def test_balanced_router_has_unit_load_balancing_loss():
    _, _, aux = route(jnp.zeros((2, 8, 4)), top_k=1, capacity=8)
    # top_k breaks ties to expert 0, so the first-choice fraction is one-hot: E * 1 * 1/E.
    assert float(aux) == pytest.approx(1.0)


def test_top_k_by_rows_equals_lax_top_k_ties_included():
    x = jax.random.randint(jax.random.key(0), (3, 50, 8), 0, 4).astype(jnp.float32)  # many ties
    for k in (1, 2, 8):
        values, indices = top_k_by_rows(x, k)
        expected_values, expected_indices = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(values, expected_values)
        np.testing.assert_array_equal(indices, expected_indices)


@pytest.fixture(scope="module")
def reference():
    return gpt_reference(CFG, optax.adamw(3e-3), BATCHES)[0]


@pytest.mark.parametrize(
    "layout", ["expert=4,data=2", "expert=2,fsdp=2,tensor=2", "expert=4,fsdp=2", "data=4,tensor=2"]
)
def test_moe_gpt_matches_single_device(layout, reference):
    trainer = sk.Trainer(CFG.model(), optax.adamw(3e-3), layout)
    losses, _ = run_trainer(trainer, BATCHES)
    np.testing.assert_allclose(losses, reference, rtol=2e-5)


@pytest.mark.parametrize("dispatch", ["einsum", "sorted"])
def test_experts_are_sharded_and_tokens_travel_by_all_to_all(dispatch):
    cfg = dataclasses.replace(CFG, moe_dispatch=dispatch)
    trainer = sk.Trainer(cfg.model(), optax.adamw(3e-3), "expert=4,data=2")
    w = trainer.init(0).params["blocks"]["mlp"]["w_gate_up"]  # (L, E, D, 2, F)
    assert {s.data.shape for s in w.addressable_shards} == {(CFG.n_layers, 1, CFG.dim, 2, CFG.mlp_dim)}
    report = trainer.report({"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)})
    a2a = [c for c in report.collectives if c.kind == "all-to-all"]
    assert {c.axes for c in a2a} == {("expert",)}
    # Per layer: tokens to experts and back, forward and backward: a device's row of 32 tokens at
    # 4 experts x 16 slots (capacity 1.0 x 32 x 2 / 4), 64 features, fp32. Sorted, each
    # destination also learns how many of its rows are for each of its experts: (4, 1) int32.
    # (XLA may combine the exchanges into fewer all-to-alls: their bytes are what is fixed.)
    slots = 1 * 4 * 16 * CFG.dim * 4
    counts = 4 * 1 * 4 if dispatch == "sorted" else 0
    assert sum(c.count * c.payload_bytes for c in a2a) == CFG.n_layers * (4 * slots + counts)


@pytest.mark.parametrize("dropless", [False, True])
def test_without_an_expert_axis_the_experts_split_over_tensor(dropless):
    # Each device computes whole experts on the tokens routed to them: the only reduction over
    # tensor in a layer's experts is the combine's, at the tokens' size (the hidden units split
    # instead would leave partial sums of the (E, B, C, D) buffers to all-reduce, forward and back).
    cfg = GPTConfig.preset("tiny", n_experts=4, top_k=2, capacity_factor=1.0, moe_dropless=dropless)
    trainer = sk.Trainer(cfg.model(), optax.adamw(3e-3), "data=4,tensor=2")
    w = trainer.init(0).params["blocks"]["mlp"]["w_gate_up"]  # (L, E, D, 2, F)
    assert {s.data.shape for s in w.addressable_shards} == {(cfg.n_layers, 2, cfg.dim, 2, cfg.mlp_dim)}
    report = trainer.report({"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)})
    mlp = [c for c in report.collectives if "/mlp/" in c.op and c.axes == ("tensor",)]
    activation = report.lower_bound["activation_bytes"]  # a router gradient may ride along (+3%)
    assert mlp and all(c.payload_bytes <= 1.05 * activation for c in mlp), report.table()
    assert not [e for e in report.beyond() if "outside the layers" in e.cause and "/mlp/" in e.op], report.extras()
    # The router's top k stays split by rows (lax.top_k's TopK custom call would gather it whole).
    assert not [c for c in report.collectives if "/router/" in c.op and c.kind == "all-gather"], report.table()
    own = sk.Trainer(cfg.model(), optax.adamw(3e-3), "data=4,tensor=2", rules=sk.default_rules())
    assert own.plan.param_specs["blocks"]["mlp"]["w_gate_up"][1] != "tensor"  # rules given are kept


def test_experts_that_do_not_divide_over_tensor_leave_it_to_the_hidden_units():
    cfg = GPTConfig.preset("tiny", n_experts=3, top_k=2)
    spec = sk.Trainer(cfg.model(), optax.adamw(3e-3), "data=4,tensor=2").plan.param_specs["blocks"]["mlp"]["w_gate_up"]
    assert spec[1] is None and "tensor" in tuple(spec)[2:], spec  # (L, E, D, 2, F): F over tensor, as before


def test_bad_expert_settings_are_refused():
    with pytest.raises(sk.errors.ShardkitError, match="top_k=3 experts per token out of n_experts=2"):
        GPTConfig.preset("tiny", n_experts=2, top_k=3)
    with pytest.raises(sk.errors.ShardkitError, match="capacity_factor=0"):
        GPTConfig.preset("tiny", n_experts=4, capacity_factor=0)
