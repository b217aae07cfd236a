"""A loop over the experts written as ``jax.lax.fori_loop`` or ``jax.lax.scan``, proved a sum of
independent steps from the traced body and computed as one stacked mixture: the same values and
gradients as the loop as written (computed on one device), and only where the steps are independent."""

import jax
import jax.numpy as jnp
import pytest
from placement_checks import placed_as_written, rerolled_in_scanned_layers, shapes
from test_expert_loops import EXPERT_DIMS, E, assert_experts_stay, params, tokens

from shardkit.parallel.expert_scans import find_scans


def gates_of(p, x):
    """Top-2 gates ``(B, T, E)``: each token's softmax weights of its two experts, 0 elsewhere."""
    top, index = jax.lax.top_k(jax.nn.softmax(x @ p["router"], axis=-1), 2)
    return (jax.nn.one_hot(index, E) * (top / top.sum(-1, keepdims=True))[..., None]).sum(2)


def fori(p, x, first=0, index=lambda e: e, carry_in_term=False):
    """``fori_loop`` over the experts, ``w[e]`` read at the counter, onto a shared expert's output."""
    g = gates_of(p, x)

    def body(e, acc):
        w_in, w_out = p["w_in"][index(e)], p["w_out"][index(e)]
        h = x + 0.1 * acc if carry_in_term else x
        return acc + (jax.nn.gelu(h @ w_in) @ w_out) * g[..., e][..., None]

    return jax.lax.fori_loop(first, E, body, x @ p["shared"])


def scanned(p, x, per_expert_means=False):
    """``scan`` over the stacked weights and the gates' columns; optionally each expert's mean
    output as the scan's stacked outputs too."""
    g = gates_of(p, x)

    def body(acc, w):
        w_in, w_out, gate = w
        out = jax.nn.gelu(x @ w_in) @ w_out
        return acc + out * gate[..., None], out.mean() if per_expert_means else None

    total, means = jax.lax.scan(body, jnp.zeros_like(x), (p["w_in"], p["w_out"], jnp.moveaxis(g, -1, 0)))
    return total + means.sum() if per_expert_means else total


def scans_of(moe):
    closed = jax.make_jaxpr(moe)(params(), tokens())
    leaves = closed.jaxpr.invars
    return find_scans(closed.jaxpr, {leaves[i]: d for i, d in EXPERT_DIMS.items()})


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def placed_collectives(moe, mesh):
    return placed_as_written(moe, params(), tokens(), EXPERT_DIMS, mesh, atol=1e-5)


@pytest.mark.parametrize(
    "moe, stacked",
    [(fori, 3), (scanned, 3), (lambda p, x: scanned(p, x, per_expert_means=True), 3)],
    ids=["fori_loop reading w[e]", "scan over the weights", "scan with stacked outputs"],
)
def test_a_rolled_loop_over_the_experts_runs_stacked_with_the_values_as_written(moe, stacked, mesh):
    (loop,) = scans_of(moe).values()
    assert loop.experts == E and len(loop.stacked) == stacked  # w_in, w_out and the gates' column
    assert_experts_stay(placed_collectives(moe, mesh))


@pytest.mark.parametrize(
    "change",
    [
        {"first": 1},  # three of four experts
        {"index": lambda e: (e + 1) % E},  # the steps read the experts in another order
        {"carry_in_term": True},  # a step reads the sum so far: the steps depend on each other
    ],
    ids=["three of four experts", "another order", "a step reads the sum"],
)
def test_a_rolled_loop_that_is_not_a_sum_of_experts_runs_as_written(change, mesh):
    moe = lambda p, x: fori(p, x, **change)
    assert scans_of(moe) == {}
    placed_collectives(moe, mesh)


def test_a_rolled_loop_in_a_scanned_stack_of_layers_is_re_rolled_in_the_scan_body(mesh):
    body = rerolled_in_scanned_layers(fori, params(), tokens(), mesh)
    # The layer's loop over its experts is gone: its steps are one matmul of the whole stack.
    assert not [e for e in body.eqns if e.primitive.name == "scan"], body
    assert [e for e in body.eqns if e.primitive.name == "dot_general" and (E, 8, 64) in shapes(e)], body
