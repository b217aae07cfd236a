"""The GPT computed in the forms XLA's CPU runs fastest, with the same results: projections as
2-D matmuls (only where no device split runs through the dimensions they merge) and the layer
scan unrolled (the parameters still stacked)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.core.errors import ModelError
from shardkit.models import GPTConfig
from shardkit.models.layers.matmul import rows_matmul, token_matmul, unsplit


@pytest.mark.parametrize(
    "spec,x_shape,w_shape,contract",
    [
        ("btd,dngk->btngk", (2, 5, 8), (8, 2, 3, 4), 1),  # fused QKV
        ("bthk,hkd->btd", (2, 5, 3, 4), (3, 4, 8), 2),  # output projection
        ("btd,dcf->btcf", (2, 5, 8), (8, 2, 6), 1),  # fused gate and up
    ],
)
def test_token_matmul_is_the_einsum(spec, x_shape, w_shape, contract):
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    np.testing.assert_allclose(token_matmul(x, w, contract), jnp.einsum(spec, x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_matmul_gradients_are_autodiffs(dtype):
    kx, kw, kd = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, (12, 8), dtype), jax.random.normal(kw, (8, 5), dtype)
    dy = jax.random.normal(kd, (12, 5), dtype)
    _, ours = jax.vjp(rows_matmul, x, w)
    _, plain = jax.vjp(lambda a, b: a @ b, x, w)
    for got, want in zip(ours(dy), plain(dy), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("w_shape,contract", [((8, 2, 3), 1), ((2, 4, 5), 2)])
def test_rows_matmul_of_a_weight_with_more_dimensions_is_the_flat_product(w_shape, contract):
    kx, kw, kd = jax.random.split(jax.random.key(2), 3)
    k = int(np.prod(w_shape[:contract]))
    x, w = jax.random.normal(kx, (12, k)), jax.random.normal(kw, w_shape)
    dy = jax.random.normal(kd, (12, int(np.prod(w_shape[contract:]))))
    out, ours = jax.vjp(lambda a, b: rows_matmul(a, b, contract), x, w)
    want, plain = jax.vjp(lambda a, b: a @ b.reshape(k, -1), x, w)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(ours(dy), plain(dy), strict=True):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_scanned_layer_stack_saves_no_reshaped_copy_of_its_weights():
    """The scan's forward loop stacks what the backward pass needs from each layer; the weights
    are read back from the parameters' own stack, not stacked again as 2-D copies."""
    cfg = GPTConfig.preset("tiny")  # wqkv (64, 4, 4, 8) and w_gate_up (64, 2, 128)
    trainer = sk.Trainer(cfg.model(), optax.sgd(0.1), "data=8")
    program = trainer.compile({"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)}).as_text()
    loops = [line for line in program.splitlines() if " while(" in line and '/while"' in line]
    forward = [line for line in loops if "transpose(" not in line]  # the backward's is transpose(jvp())
    assert len(loops) == 2 and len(forward) == 1, loops
    stacked = set(re.findall(r"f32\[\d+(?:,\d+)*\]", forward[0]))
    layers = cfg.n_layers
    assert f"f32[{layers},64,2,128]" in stacked  # the stacked parameter itself, carried through
    for reshaped in (f"f32[{layers},64,256]", f"f32[{layers},64,128]", f"f32[{layers},64,64]"):
        assert reshaped not in stacked, (reshaped, sorted(stacked))


@pytest.mark.parametrize("k,m", [(16, 48), (48, 16)])
def test_the_weight_gradients_dot_writes_the_narrower_orientation(k, m):
    """Under data parallelism (the gradient all-reduced between autodiff's dot and its transpose)
    the compiled weight gradient of ``x (N, K) @ w (K, M)`` is a dot with min(K, M) rows."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows, whole = jax.NamedSharding(mesh, jax.P("data")), jax.NamedSharding(mesh, jax.P())
    x, w, dy = jnp.ones((64, k)), jnp.ones((k, m)), jnp.ones((64, m))

    def dots(f):
        def weight_grad(x, w, dy):
            return jax.vjp(lambda w: f(x, w), w)[1](dy)[0]

        step = jax.jit(weight_grad, in_shardings=(rows, whole, rows), out_shardings=whole)
        program = hlo.parse(step.lower(x, w, dy).compile().as_text())
        return {ins.shape.split("{")[0] for ins in program.instructions if ins.opcode == "dot"}

    assert dots(lambda a, b: a @ b) == {f"f32[{m},{k}]"}  # autodiff alone: always (M, K)
    assert dots(rows_matmul) == {f"f32[{min(k, m)},{max(k, m)}]"}


@pytest.mark.parametrize(
    "layout,names,want",
    [
        ("data=8", ("seq", "kv_heads", "kv", "mlp"), True),
        ("fsdp=4,data=2", ("seq", "heads", "mlp"), True),  # fsdp splits the contracted embed dim only
        ("data=4,tensor=2", ("seq",), True),
        ("data=4,tensor=2", ("mlp",), False),
        ("data=4,tensor=2", ("kv_heads",), False),
        ("data=4,sequence=2", ("seq",), False),
    ],
)
def test_the_einsum_stays_where_a_merged_dimension_is_split(layout, names, want):
    mesh = sk.Layout.parse(layout).make_mesh()
    assert unsplit(*names)  # outside any sharding context: one device
    with sk.use_sharding(mesh, sk.default_rules()):
        assert unsplit(*names) is want


def test_an_unrolled_scan_is_the_scan_without_its_loop():
    tokens = jnp.asarray(sk.TextDataset.builtin().batch(0, batch_size=4, seq_len=32)["tokens"])
    programs, results = {}, {}
    for unroll in (1, True):  # True == 1 as a dict key: results are keyed by name
        model = GPTConfig.preset("tiny", n_layers=4, scan_unroll=unroll).model()
        params = model.init(jax.random.key(0))

        def loss(p, model=model):
            logits = model.apply(p, tokens[:, :-1], None)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

        step = jax.jit(jax.value_and_grad(loss))
        name = "unrolled" if unroll is True else "scanned"
        programs[name] = step.lower(params).as_text()  # StableHLO: the scan is a while loop there
        results[name] = step(params)
    assert programs["scanned"].count("stablehlo.while") == 2  # forward and backward
    assert "stablehlo.while" not in programs["unrolled"]
    np.testing.assert_allclose(results["unrolled"][0], results["scanned"][0], rtol=1e-6)
    unrolled, scanned = jax.tree.leaves(results["unrolled"][1]), jax.tree.leaves(results["scanned"][1])
    for got, want in zip(unrolled, scanned, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -2, False, 1.5])
def test_a_scan_unroll_that_is_not_a_layer_count_is_refused(bad):
    with pytest.raises(ModelError, match="scan_unroll"):
        GPTConfig(scan_unroll=bad)


@pytest.mark.parametrize("layers,unroll", [(4, 1), (4, 2), (4, True), (4, 4), (4, 6), (3, 2), (1, True), (2, True)])
def test_unrolled_layers_says_whether_the_lowered_stack_loops(layers, unroll):
    # Read against JAX's own lowering: a loop in the forward pass's StableHLO or none.
    cfg = GPTConfig.preset("tiny", n_layers=layers, scan_unroll=unroll)
    model = cfg.model()
    params = jax.eval_shape(model.init, jax.random.key(0))
    text = jax.jit(lambda p: model.apply(p, jnp.zeros((2, 8), jnp.int32), None)).lower(params).as_text()
    assert cfg.unrolled_layers is ("stablehlo.while" not in text)
    assert model.info["unrolled_layers"] is cfg.unrolled_layers
    assert GPTConfig.preset("tiny", scan_layers=False, scan_unroll=unroll).unrolled_layers is False


def test_an_unrolled_stack_compiles_as_unstacked_layers():
    # Parameters stacked, no loop: XLA:CPU's default schedule would gather every layer's weights
    # at the start of the step, as for unstacked layers (tests/test_any_model.py), so the step
    # takes their options, and needs fewer temporaries than with the options of a loop.
    batch = {"tokens": jax.ShapeDtypeStruct((16, 65), jnp.int32)}
    cfg = GPTConfig(vocab=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, mlp_dim=512, max_seq=64)
    scanned = sk.Trainer(cfg.model(), optax.adamw(1e-3), "fsdp=8")
    unrolled = sk.Trainer(dataclasses.replace(cfg, scan_unroll=True).model(), optax.adamw(1e-3), "fsdp=8")
    assert scanned.plan.stacks_layers and unrolled.plan.stacks_layers
    assert scanned.loops_over_layers and not unrolled.loops_over_layers
    assert scanned.compiler_options == {}
    assert unrolled.compiler_options == {
        "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
        "xla_disable_hlo_passes": "cpu-all-reduce-combiner",
    }
    lowered = unrolled.lower(batch)
    as_a_loop = lowered.compile(compiler_options={}).memory_analysis().temp_size_in_bytes
    chosen = lowered.compile(compiler_options=unrolled.compiler_options).memory_analysis().temp_size_in_bytes
    assert chosen < 0.85 * as_a_loop, (chosen, as_a_loop)
