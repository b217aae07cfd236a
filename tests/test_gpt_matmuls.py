"""The GPT's projections as 2-D matmuls: the same products as its einsums, taken only where no
device split runs through the dimensions they merge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
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
