"""The input gradient of separate projections of one input is reduced once over ``tensor``
(shardkit.parallel.input_gradients): the same numbers as JAX's own gradient, one product where
there were several, and in the compiled step Megatron's one all-reduce per block."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from byo_models import GemmaLM, LinenLM, LMConfig
from helpers import assert_adam_params_close, run_trainer
from jax.sharding import AxisType, PartitionSpec

import shardkit as sk
from shardkit.analysis.report import collective_stats
from shardkit.parallel.embedding_gradients import Tables
from shardkit.parallel.input_gradients import reduce_input_gradients_once
from shardkit.training.accumulation import tensor_blocks

KEY = jax.random.PRNGKey(0)


def block(w, x):
    """Three projections of one input (q, k, v as Linen writes them), an einsum with two contracted
    dimensions among them, and a residual: the input's cotangent is a sum of four terms."""
    q = jnp.einsum("bd,dnh->bnh", x, w["q"])
    k = x @ w["k"]
    v = x @ w["v"]
    return x + jnp.tanh(q).sum(-1) @ w["back"] + jnp.sin(k) * jnp.cos(v)


def params(d=8, n=4, h=2):
    ks = jax.random.split(KEY, 5)
    return {
        "q": jax.random.normal(ks[0], (d, n, h)),
        "k": jax.random.normal(ks[1], (d, d)),
        "v": jax.random.normal(ks[2], (d, d)),
        "back": jax.random.normal(ks[3], (n, d)),
    }


# Output features split in 2 (q on its heads); "back" contracts its split dimension in the
# forward pass, not the input's gradient.
SPLITS = {"q": (1, 2, 1), "k": (1, 2), "v": (1, 2), "back": (2, 1)}


def dots(fn, *args):
    """dot_general equations in the traced program, inner programs included."""
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_a_sum_of_projections_becomes_one_product_with_the_same_value():
    w, x = params(), jax.random.normal(KEY, (3, 8))
    grad = jax.grad(lambda w, x: block(w, x).sum(), argnums=1)
    once = reduce_input_gradients_once(grad, lambda w, x: (SPLITS, None))
    np.testing.assert_allclose(once(w, x), grad(w, x), rtol=1e-5, atol=1e-5)
    # q, k and v's input gradients: three products became one.
    assert dots(once, w, x) == dots(grad, w, x) - 2


def test_products_inside_remat_and_scan_are_rewritten():
    stacked = jax.tree.map(lambda *p: jnp.stack(p), params(), params())
    splits = {k: (1, *s) for k, s in SPLITS.items()}  # a leading, whole layers dimension

    def loss(w, x):
        body = jax.checkpoint(lambda x, w: (block(w, x), None))
        return jax.lax.scan(body, x, w)[0].sum()

    x = jax.random.normal(KEY, (3, 8))
    grad = jax.grad(loss, argnums=(0, 1))
    once = reduce_input_gradients_once(grad, lambda w, x: (splits, None))
    for got, want in zip(jax.tree.leaves(once(stacked, x)), jax.tree.leaves(grad(stacked, x)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert dots(once, stacked, x) == dots(grad, stacked, x) - 2
    # Under jit as well (the step's own trace).
    np.testing.assert_allclose(jax.jit(once)(stacked, x)[1], grad(stacked, x)[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "splits",
    [
        None,  # nothing known about the weights
        {"q": (1, 1, 1), "k": (1, 1), "v": (1, 1), "back": (1, 1)},  # nothing split
        {"q": (2, 1, 1), "k": (2, 1), "v": (2, 1), "back": (1, 1)},  # split on the input's features: no sum to reduce
    ],
)
def test_weights_not_split_on_their_output_features_are_left_alone(splits):
    w, x = params(), jax.random.normal(KEY, (3, 8))
    grad = jax.grad(lambda w, x: block(w, x).sum(), argnums=1)
    once = reduce_input_gradients_once(grad, lambda w, x: (splits, None))
    assert dots(once, w, x) == dots(grad, w, x)
    np.testing.assert_allclose(once(w, x), grad(w, x), rtol=1e-6)


def test_tensor_blocks_reads_where_tensor_leads():
    assert tensor_blocks(PartitionSpec("fsdp", "tensor"), 2, 4) == (1, 4)
    assert tensor_blocks(PartitionSpec(("tensor", "fsdp")), 3, 2) == (2, 1, 1)
    # tensor after another axis: its blocks are interleaved, the weight is left as it is.
    assert tensor_blocks(PartitionSpec(("fsdp", "tensor")), 2, 2) is None


CFG = LMConfig(dim=64, mlp=256, heads=8, kv_heads=8, head_dim=8, layers=2)
B, T = 16, 32
BATCH = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
MODELS = {
    "nnx-gemma": lambda: sk.from_nnx(lambda rngs: GemmaLM(CFG, rngs=rngs)),
    "linen-lm": lambda: sk.from_linen(LinenLM(CFG), jnp.zeros((2, T), jnp.int32)),
}


def ring_all_reduce(nbytes, n):
    return 2 * (n - 1) / n * nbytes


@pytest.mark.parametrize("kind", list(MODELS))
def test_tensor_parallel_user_models_reduce_megatrons_count(kind):
    # tensor=8 on models written without shardkit: per layer, one forward and one backward
    # all-reduce of the activation for attention and for the MLP (Megatron's 2 + 2), plus at most
    # the vocabulary-parallel embedding's and output layer's one each, as Megatron's own. Before,
    # each separate projection (q and kv, gate and up; query, key and value) reduced its own.
    report = sk.Trainer(MODELS[kind](), optax.adamw(1e-3), "tensor=8").report(BATCH)
    act = B * T * CFG.dim * 4
    big = [c for c in report.collectives if c.kind == "all-reduce" and c.payload_bytes >= act]
    assert all(c.axes == ("tensor",) for c in big), big
    assert 4 * CFG.layers <= sum(c.count for c in big) <= 4 * CFG.layers + 2, big
    # Named by the user's module, in the direction of their bytes (XLA combines one of them with
    # the loss's small sums).
    in_layers = [c for c in big if "layers/" in c.op or "block_" in c.op]
    for direction in ("forward", "backward"):
        assert sum(c.count for c in in_layers if c.direction == direction) == 2 * CFG.layers, in_layers
    bound = report.lower_bound["bytes_per_device"]  # the vocabulary is split over tensor: Megatron's + 2
    assert bound == pytest.approx((4 * CFG.layers + 2) * ring_all_reduce(act, 8))
    assert report.moved_bytes <= bound * 1.01
    assert not [e for e in report.extras() if "separate projections" in e], report.extras()


# The size of benchmarks/any_model.py: at dim 64 and 32 tokens the embedding gradient's
# all-reduce (the table whole, report.extras() names it) outweighs the layers' activations.
WIDE = LMConfig(dim=256, mlp=1024, heads=8, kv_heads=2, head_dim=32, layers=4)
WIDE_MODELS = {
    "nnx-gemma": lambda: sk.from_nnx(lambda rngs: GemmaLM(WIDE, rngs=rngs)),
    "linen-lm": lambda: sk.from_linen(LinenLM(WIDE), jnp.zeros((2, 128), jnp.int32)),
}


@pytest.mark.parametrize("kind", list(WIDE_MODELS))
def test_hybrid_layout_on_user_models_within_five_percent_of_its_bound(kind):
    trainer = sk.Trainer(WIDE_MODELS[kind](), optax.adamw(1e-3), "data=2,fsdp=2,tensor=2")
    report = trainer.report({"tokens": jax.ShapeDtypeStruct((16, 129), jnp.int32)})
    assert report.ratios["bytes"] <= 1.05, (report.ratios, report.extras())
    act = 16 // 4 * 128 * WIDE.dim * 4
    backward = [
        c
        for c in report.collectives
        if c.kind == "all-reduce" and c.axes == ("tensor",) and c.direction == "backward" and c.payload_bytes >= act
    ]
    # One per attention block and one per MLP (and the output layer's, where the head is split).
    assert 2 * WIDE.layers <= sum(c.count for c in backward) <= 2 * WIDE.layers + 1, backward
    assert not [e for e in report.extras() if "separate projections" in e], report.extras()


def test_an_embedding_gradient_is_reduced_onto_its_shards():
    # A lookup's gradient under data=2,fsdp=2,tensor=2, the table's vocabulary over tensor and its
    # features over fsdp: the same values as JAX's own, and in the compiled program a
    # reduce-scatter over fsdp and an all-reduce over data of the shard, no whole table reduced.
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    spec, rows = PartitionSpec("tensor", "fsdp"), ("data", "fsdp")
    table = jax.random.normal(KEY, (64, 32))
    ids = jax.random.randint(KEY, (16, 8), 0, 64)
    ct = jax.random.normal(jax.random.PRNGKey(1), (16, 8, 32))

    def grad(table, ids, ct):
        return jax.grad(lambda t: (jnp.take(t, ids, axis=0) * ct).sum())(table)

    tables = Tables(mesh, rows, lambda table, ids, ct: (spec, None, None))
    once = reduce_input_gradients_once(grad, lambda *args: (None, None, None), tables)
    shard = lambda s: jax.sharding.NamedSharding(mesh, s)
    in_shardings = (shard(spec), shard(PartitionSpec(rows)), shard(PartitionSpec(rows)))
    compiled = {
        name: jax.jit(fn, in_shardings=in_shardings, out_shardings=shard(spec)).lower(table, ids, ct).compile()
        for name, fn in (("xla", grad), ("once", once))
    }
    np.testing.assert_allclose(compiled["once"](table, ids, ct), grad(table, ids, ct), rtol=1e-5, atol=1e-5)
    stats = {name: collective_stats(c.as_text(), mesh) for name, c in compiled.items()}
    whole = [c for c in stats["xla"] if c.kind == "all-reduce" and set(c.axes) == set(rows)]
    # What XLA does: the vocabulary's tensor shard, whole along the features, reduced over both.
    assert whole and whole[0].payload_bytes == table.nbytes // 2
    kinds = {(c.kind, c.axes, c.payload_bytes) for c in stats["once"]}
    assert kinds == {("reduce-scatter", ("fsdp",), table.nbytes // 2), ("all-reduce", ("data",), table.nbytes // 4)}


def test_a_table_split_by_batch_and_other_axes_on_one_dimension_is_left_to_xla():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    table, ids = jnp.ones((64, 32)), jnp.zeros((16, 8), jnp.int32)
    grad = jax.grad(lambda t, ids: jnp.take(t, ids, axis=0).sum())
    for spec in (PartitionSpec(("tensor", "fsdp")), PartitionSpec("tensor")):  # mixed; no batch axis
        tables = Tables(mesh, ("data", "fsdp"), lambda t, ids, spec=spec: (spec, None))
        once = reduce_input_gradients_once(grad, lambda *args: (None, None), tables)
        assert "shard_map" not in str(jax.make_jaxpr(once)(table, ids))


def test_a_table_split_over_tensor_alone_reaches_its_shard_when_the_tokens_arrive_split_over_tensor():
    # tensor=2,expert=4 where the experts' rows split over tensor: the tokens' cotangents reach the
    # lookup split over expert and tensor. XLA then all-reduces the whole table over tensor and
    # expert; rewritten, the cotangents are gathered over tensor and only each device's
    # vocabulary block is reduced over expert.
    mesh = jax.make_mesh((2, 4), ("tensor", "expert"), axis_types=(AxisType.Auto,) * 2)
    spec, rows = PartitionSpec("tensor", None), ("expert",)
    table = jax.random.normal(KEY, (64, 32))
    ids = jax.random.randint(KEY, (16, 8), 0, 64)
    ct = jax.random.normal(jax.random.PRNGKey(1), (16, 8, 32))

    def grad(table, ids, ct):
        return jax.grad(lambda t: (jnp.take(t, ids, axis=0) * ct).sum())(table)

    tables = Tables(mesh, rows, lambda table, ids, ct: (spec, None, None), split_beyond_rows=True)
    once = reduce_input_gradients_once(grad, lambda *args: (None, None, None), tables)
    shard = lambda s: jax.sharding.NamedSharding(mesh, s)
    tokens = shard(PartitionSpec(("expert", "tensor")))
    in_shardings = (shard(spec), tokens, tokens)
    compiled = {
        name: jax.jit(fn, in_shardings=in_shardings, out_shardings=shard(spec)).lower(table, ids, ct).compile()
        for name, fn in (("xla", grad), ("once", once))
    }
    np.testing.assert_allclose(compiled["once"](table, ids, ct), grad(table, ids, ct), rtol=1e-5, atol=1e-5)
    stats = {name: collective_stats(c.as_text(), mesh) for name, c in compiled.items()}
    reduced = {name: [(c.axes, c.payload_bytes) for c in s if c.kind == "all-reduce"] for name, s in stats.items()}
    assert any("tensor" in axes and size == table.nbytes for axes, size in reduced["xla"]), reduced["xla"]
    assert reduced["once"] == [(("expert",), table.nbytes // 2)], reduced["once"]
    moved = {name: sum(c.moved_bytes for c in s) for name, s in stats.items()}
    assert moved["once"] < 0.6 * moved["xla"], moved


@pytest.mark.parametrize("layout", ["data=2,fsdp=4", "data=2,fsdp=2,tensor=2"])
def test_rewritten_steps_train_as_one_device_does(layout):
    # Both rewrites in the step (the table's gradient under data=2,fsdp=4; that and the
    # projections' under the hybrid), against plain flax + optax on one device.
    from test_any_model import BATCHES, nnx_model, single_device_reference

    ref_losses, ref_params = single_device_reference("nnx-gemma")
    losses, params = run_trainer(sk.Trainer(nnx_model(), optax.adamw(3e-3), layout), BATCHES)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_adam_params_close(params, ref_params, lr=3e-3, steps=len(BATCHES))
