"""A Python loop over the experts, matched copy by copy in the traced program and computed as one
stacked mixture: the same values and gradients as the loop as written (computed on one device),
and only where every copy is the same computation on its own expert."""

import jax
import jax.numpy as jnp
import pytest
from placement_checks import placed_as_written, rerolled_in_scanned_layers, shapes

from shardkit.parallel.expert_loops import find_loops

E, D, F = 4, 8, 64
EXPERT_DIMS = {2: 0, 3: 0}  # leaves in tree order: router, shared, w_in, w_out


def params(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "router": jax.random.normal(k[0], (D, E)),
        "shared": jax.random.normal(k[1], (D, D)) / 3,
        "w_in": jax.random.normal(k[2], (E, D, F)) / 3,
        "w_out": jax.random.normal(k[3], (E, F, D)) / 4,
    }


def looped(experts=range(E), unit=lambda e: jax.nn.gelu, init=False):
    """Top-2 experts as a loop: each expert on every token, weighed by its gate (0 if not chosen)."""

    def moe(p, x):
        top, index = jax.lax.top_k(jax.nn.softmax(x @ p["router"], axis=-1), 2)
        gates = (jax.nn.one_hot(index, E) * (top / top.sum(-1, keepdims=True))[..., None]).sum(2)
        out = x @ p["shared"] if init else jnp.zeros_like(x)
        for e in experts:
            out = out + (unit(e)(x @ p["w_in"][e]) @ p["w_out"][e]) * gates[..., e : e + 1]
        return out

    return moe


def tokens():
    return jax.random.normal(jax.random.key(1), (8, 6, D))


def loops_of(moe):
    closed = jax.make_jaxpr(moe)(params(), tokens())
    leaves = closed.jaxpr.invars
    return find_loops(closed.jaxpr, {leaves[i]: d for i, d in EXPERT_DIMS.items()})


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def placed_collectives(moe, mesh):
    return placed_as_written(moe, params(), tokens(), EXPERT_DIMS, mesh, atol=1e-5)


@pytest.mark.parametrize("init", [False, True], ids=["from zeros", "onto a shared expert"])
def test_a_loop_over_the_experts_runs_stacked_with_the_values_as_written(init, mesh):
    moe = looped(init=init)
    (loop,) = loops_of(moe).values()
    assert loop.experts == E and loop.init is not None  # zeros, or the shared expert's output
    assert len(loop.stacked) == 3  # w_in[e], w_out[e] and the gates' column e
    assert_experts_stay(placed_collectives(moe, mesh))


def assert_experts_stay(moved):
    """No expert's matrix moves between devices, and no device reduces every expert's gradient:
    each device's gradients are its own experts' (a loop left as written sends each w[e] around and
    all-reduces all E experts' gradients)."""
    assert not [c for c in moved if c.kind in ("all-gather", "collective-permute") and c.payload_bytes >= D * F * 4]
    assert max(c.payload_bytes for c in moved if c.kind == "all-reduce") < E * D * F * 4, moved


@pytest.mark.parametrize(
    "change",
    [
        {"experts": range(E - 1)},  # the last expert left out: not the stacked weights
        {"unit": lambda e: jnp.tanh if e == 2 else jax.nn.gelu},  # one copy computes something else
    ],
    ids=["three of four experts", "a copy that differs"],
)
def test_a_loop_whose_copies_are_not_one_computation_runs_as_written(change, mesh):
    moe = looped(**change)
    assert loops_of(moe) == {}
    placed_collectives(moe, mesh)


def test_a_loop_inside_a_rematerialised_layer_is_re_rolled_there(mesh):
    assert_experts_stay(placed_collectives(jax.checkpoint(looped()), mesh))


def test_a_loop_in_a_scanned_stack_of_layers_is_re_rolled_in_the_scan_body(mesh):
    body = rerolled_in_scanned_layers(looped(), params(), tokens(), mesh)
    # The re-rolled body holds a matmul of the whole stack of experts (the copies' own are dead).
    stacked_matmuls = [e for e in body.eqns if e.primitive.name == "dot_general" and (E, D, F) in shapes(e)]
    assert stacked_matmuls, body
