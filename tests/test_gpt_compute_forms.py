"""The GPT computed in the forms XLA's CPU runs fastest, with the same results: projections as
2-D matmuls (only where no device split runs through the dimensions they merge) and the layer
scan unrolled (the parameters still stacked)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
from shardkit.errors import ModelError
from shardkit.models import GPTConfig
from shardkit.models.gpt import token_matmul, unsplit


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
