"""The sorted dispatch (tokens sorted by expert, grouped matmuls, one all-to-all each way): the
same outputs, drops and gradients as GShard's einsum dispatch on every layout, memory linear in
the sequence where the einsum's is quadratic, the GPT at its bound on the four expert layouts,
and the blocked grouped matmul against ``jax.lax.ragged_dot``."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_expert_parallel import layer_inputs, per_token_mixture

import shardkit as sk
from shardkit.core.errors import InputError, ModelError
from shardkit.models import GPTConfig
from shardkit.parallel.experts import moe_layer, route_tokens
from shardkit.parallel.grouped_matmul import blocked_matmul, grouped_matmul
from shardkit.parallel.sorted_experts import kept_by_capacity, slots_per_destination

LAYOUTS = ["expert=8", "data=2,expert=4", "tensor=2,expert=4", "data=2,fsdp=2,expert=2"]


def layer(experts=8, rows=8, tokens=6, dim=16, hidden=12):
    return layer_inputs(experts=experts, dim=dim, hidden=hidden, rows=rows, tokens=tokens)


def loss_and_grads(inputs, dispatch, **options):
    def loss(args):
        y, routing = moe_layer(*args, dispatch=dispatch, **options)
        return (y**2).sum(), routing.dropped

    (value, dropped), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(inputs)
    return value, dropped, grads


@pytest.mark.parametrize("options", [{"capacity_factor": 0.5}, {"capacity_factor": 1.0}, {"dropless": True}])
@pytest.mark.parametrize("layout", ["data=1", *LAYOUTS])
def test_sorted_computes_and_drops_what_the_einsum_dispatch_does_on_every_layout(layout, options):
    inputs = layer()
    value, dropped, grads = loss_and_grads(inputs, "einsum", top_k=2, **options)  # one device
    mesh = sk.Layout.parse(layout).make_mesh(jax.devices()[: sk.Layout.parse(layout).num_devices])
    with sk.use_sharding(mesh, sk.default_rules()):
        sorted_value, sorted_dropped, sorted_grads = loss_and_grads(inputs, "sorted", top_k=2, **options)
    np.testing.assert_allclose(sorted_value, value, rtol=1e-5)
    assert float(sorted_dropped) == pytest.approx(float(dropped))
    assert (float(dropped) > 0) == ("capacity_factor" in options)  # both capacities drop some here
    for ours, theirs in zip(jax.tree.leaves(sorted_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * float(jnp.abs(theirs).max()))


def test_sorted_dropless_is_each_token_through_its_top_k_experts():
    x, router, w_in, w_out = layer_inputs()
    y, routing = moe_layer(x, router, w_in, w_out, top_k=2, dropless=True, dispatch="sorted")
    np.testing.assert_allclose(y, per_token_mixture(x, router, w_in, w_out, 2), rtol=1e-4, atol=1e-5)
    assert routing.dispatch is None and int(routing.tokens_per_expert.sum()) == 2 * 6 * 2


def test_a_capacity_keeps_the_slots_gshards_routing_fills():
    logits = jax.random.normal(jax.random.key(3), (3, 20, 5))
    experts = jnp.argsort(-logits, axis=-1)[..., :2]
    for capacity in (1, 3, 8):
        routing = route_tokens(logits, 2, capacity)
        # The einsum's dispatch holds a (token, expert) pair where that choice found a slot.
        chosen = jax.nn.one_hot(experts, 5)  # (G, S, k, E)
        kept_there = (chosen * routing.dispatch.sum(-1)[:, :, None, :]).sum(-1) > 0
        np.testing.assert_array_equal(kept_by_capacity(experts, capacity), kept_there)


def test_destinations_have_room_for_every_pair_a_device_can_send_them():
    # Dropless: a token chooses an expert at most once, so min(k, E/n) of its pairs per device.
    assert slots_per_destination(2, 100, 8, 64, 16, None) == 2 * 100 * 4
    assert slots_per_destination(2, 100, 2, 64, 4, None) == 2 * 100 * 2
    # A capacity: the experts there times their slots in each row, ceil(1.25 x 100 x 2 / 64) = 4.
    assert slots_per_destination(2, 100, 2, 64, 4, 1.25) == 2 * 16 * 4


def temp_bytes(dispatch, tokens):
    x, router, w_in, w_out = layer(experts=8, rows=1, tokens=tokens, dim=32, hidden=32)
    fn = jax.jit(lambda *a: moe_layer(*a, top_k=2, dropless=True, dispatch=dispatch)[0])
    return fn.lower(x, router, w_in, w_out).compile().memory_analysis().temp_size_in_bytes


def test_dropless_sorted_memory_grows_with_the_sequence_where_the_einsums_grows_with_its_square():
    sorted_ratio = temp_bytes("sorted", 2048) / temp_bytes("sorted", 1024)
    einsum_ratio = temp_bytes("einsum", 2048) / temp_bytes("einsum", 1024)
    assert sorted_ratio < 2.5 and einsum_ratio > 3.5, (sorted_ratio, einsum_ratio)
    assert temp_bytes("sorted", 2048) * 20 < temp_bytes("einsum", 2048)


@pytest.mark.parametrize("dispatch", ["sorted", "einsum"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_gpt_is_at_its_bound_on_every_expert_layout(layout, dispatch):
    cfg = GPTConfig.preset("tiny-moe", n_experts=8 if layout == "expert=8" else 4, moe_dispatch=dispatch)
    r = sk.Trainer(cfg.model(), optax.adamw(1e-3), layout).report(
        {"tokens": jax.ShapeDtypeStruct((16, 129), jnp.int32)}
    )
    assert r.ratios["bytes"] <= 1.10, r.table()


@pytest.mark.parametrize("dispatch", ["sorted", "einsum"])
@pytest.mark.parametrize("rows, seq", [(16, 128), (8, 16)], ids=["many tokens", "few tokens"])
def test_under_tensor_the_gpt_splits_its_experts_rows_or_hidden_units_whichever_moves_less(rows, seq, dispatch):
    # tensor=2,expert=4, tiny-moe (an expert group's weights: 1 expert of 64 x 2 x 256 + 256 x 64
    # fp32, 196 KB). 16 rows of 128 tokens: a device's dispatch (4 destinations x 80 slots a row)
    # is worth halving, so each tensor rank sends its own rows (2 of its group's 4) and the weights
    # are gathered; 8 rows of 16 tokens: the weights cost more, so the hidden units stay split
    # and their partial sums are reduced over tensor at the tokens' size, once each way.
    # GShard's einsum dispatch runs in the same island: the same slots, no counts.
    cfg = GPTConfig.preset("tiny-moe", moe_dispatch=dispatch)
    r = sk.Trainer(cfg.model(), optax.adamw(1e-3), "tensor=2,expert=4").report(
        {"tokens": jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32)}
    )
    per_device_rows = rows // 4 // (2 if rows == 16 else 1)
    slots = per_device_rows * math.ceil(1.25 * seq * 2 / 4)  # a destination's: 1 expert there
    # Rows, 4 exchanges a layer, and the experts' counts, (4, 1) int32 forward (the report
    # averages a group's payloads to whole bytes: a few bytes off).
    moved = sum(c.count * c.payload_bytes for c in r.collectives if c.kind == "all-to-all")
    counts = cfg.n_layers * 16 if dispatch == "sorted" else 0
    assert moved == pytest.approx(4 * cfg.n_layers * 4 * slots * cfg.dim * 4 + counts, abs=8)
    reduced = [c for c in r.collectives if "/experts/" in c.op and c.axes == ("tensor",) and c.kind == "all-reduce"]
    if rows == 16:
        assert not reduced, r.table()
    else:
        tokens = rows // 4 * seq * cfg.dim * 4  # (XLA may fold a small reduction into one: a few KB more)
        assert sum(c.count for c in reduced) == 2 * cfg.n_layers
        assert all(tokens <= c.payload_bytes <= 1.05 * tokens for c in reduced), r.table()


@pytest.mark.parametrize("options", [{"capacity_factor": 1.0}, {"dropless": True}])
def test_under_tensor_the_einsum_dispatch_splits_its_rows_where_that_moves_less_and_computes_the_same(options):
    # 16 rows of 32 tokens, small experts (8 of 16 x 2 x 4 + 4 x 16): under tensor=2,expert=4 each
    # tensor rank dispatches its own 2 of its group's 4 rows, so the all-to-alls carry half the
    # slots the hidden units' split sends; the values and gradients are one device's.
    inputs = layer(experts=8, rows=16, tokens=32, dim=16, hidden=4)
    value, dropped, grads = loss_and_grads(inputs, "einsum", top_k=2, **options)  # one device
    mesh = sk.Layout.parse("tensor=2,expert=4").make_mesh(jax.devices())
    with sk.use_sharding(mesh, sk.default_rules()):
        split_value, split_dropped, split_grads = loss_and_grads(inputs, "einsum", top_k=2, **options)
        fn = jax.jit(lambda args: moe_layer(*args, top_k=2, dispatch="einsum", **options)[0])
        hlo = fn.lower(inputs).compile().as_text()
    np.testing.assert_allclose(split_value, value, rtol=1e-5)
    assert float(split_dropped) == pytest.approx(float(dropped))
    for ours, theirs in zip(jax.tree.leaves(split_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * float(jnp.abs(theirs).max()))
    # A device's buffers: every expert's slots of its rows, C = ceil(1.0 x 32 x 2 / 8) = 8 a row
    # (dropless: the row's 32 tokens), 2 rows here (4 with the hidden units split).
    slots = 8 if "capacity_factor" in options else 32
    exchanged = [line for line in hlo.splitlines() if " all-to-all(" in line]
    assert len(exchanged) == 2, exchanged  # forward: dispatch and combine
    for line in exchanged:  # its result: one array, or a tuple of the pieces sent each device
        shapes = re.findall(r"f32\[([\d,]+)\]", line.split(" all-to-all(")[0])
        assert sum(math.prod(map(int, shape.split(","))) for shape in shapes) == 8 * 2 * slots * 16, line


@pytest.mark.parametrize(
    ("rows", "groups", "sizes"), [(40, 6, [0, 7, 13, 0, 2, 9]), (17, 9, [1] * 9), (64, 5, [64, 0, 0, 0, 0])]
)
def test_blocks_compute_what_ragged_dot_does_with_its_gradients(rows, groups, sizes):
    k = jax.random.split(jax.random.key(rows), 2)
    x, w, sizes = jax.random.normal(k[0], (rows, 6)), jax.random.normal(k[1], (groups, 6, 5)), jnp.array(sizes)
    grouped = (jnp.arange(rows) < sizes.sum())[:, None]  # rows past the groups: none, 0
    ragged = lambda x, w: jnp.where(grouped, jax.lax.ragged_dot(x, w, sizes), 0)
    for block in (None, 4):
        blocked = lambda x, w, block=block: blocked_matmul(x, w, sizes, block=block)
        np.testing.assert_allclose(blocked(x, w), ragged(x, w), rtol=1e-5, atol=1e-5)
        for ours, theirs in zip(
            jax.grad(lambda *a, blocked=blocked: (blocked(*a) ** 2).sum(), (0, 1))(x, w),
            jax.grad(lambda *a: (ragged(*a) ** 2).sum(), (0, 1))(x, w),
            strict=True,
        ):
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_many_groups_on_cpu_take_blocks_at_memory_linear_in_the_rows():
    x, w, sizes = jnp.ones((4096, 64)), jnp.ones((32, 64, 64)), jnp.full((32,), 128)
    temp = lambda fn: jax.jit(fn).lower(x, w, sizes).compile().memory_analysis().temp_size_in_bytes
    out_bytes = 4096 * 64 * 4
    assert temp(lambda *a: grouped_matmul(*a, platform="cpu")) < 8 * out_bytes
    assert temp(jax.lax.ragged_dot) > 30 * out_bytes  # JAX's expansion: every group on every row


def test_the_blocks_gradient_holds_no_copy_of_a_weight_per_block():
    # 320 blocks of 8 rows over 64 groups: differentiating the scan would keep each block's
    # (256, 256) weight as a residual, 320 x 256 KB = 84 MB; the blocks' own gradient keeps the
    # inputs and adds into one (G, K, N) buffer.
    x, w, sizes = jnp.ones((2048, 256)), jnp.ones((64, 256, 256)), jnp.full((64,), 32)
    grads = jax.grad(lambda x, w: blocked_matmul(x, w, sizes, block=8).sum(), (0, 1))
    temp = jax.jit(grads).lower(x, w).compile().memory_analysis().temp_size_in_bytes
    assert temp < 3 * w.size * 4, temp / 1e6


def test_an_unknown_dispatch_is_refused_naming_the_choices():
    with pytest.raises(InputError, match="dispatch='gather'.*'einsum', 'sorted'"):
        moe_layer(*layer_inputs(), top_k=2, dispatch="gather")
    with pytest.raises(ModelError, match="moe_dispatch='gather'.*'einsum' or 'sorted'"):
        dataclasses.replace(GPTConfig.preset("tiny-moe"), moe_dispatch="gather")
