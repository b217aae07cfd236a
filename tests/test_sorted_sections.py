"""A user's sort-and-``ragged_dot`` experts, proved row-wise from the traced program and run as
routed pairs: the same values and gradients as the program as written, computed independently
on one device, and only where every step of the proof holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from placement_checks import placed_as_written

from shardkit.parallel.expert_placement import place_experts
from shardkit.parallel.sorted_sections import find_sections

E, D, F = 4, 8, 16


def params(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "bias": jax.random.normal(k[0], (2 * F,)),
        "router": jax.random.normal(k[1], (D, E)),
        "w_in": jax.random.normal(k[2], (E, D, 2 * F)) / 3,
        "w_out": jax.random.normal(k[3], (E, F, D)) / 4,
    }


EXPERT_DIMS = {2: 0, 3: 0}  # leaves in tree order: bias, router, w_in, w_out


def sorted_mixture(top_k=2, keys_of=None, between=None, put_back=None, read_back=None):
    """MegaBlocks-style experts on ``(B, T, D)`` tokens; the hooks change one step of it."""

    def moe(p, x):
        b, t, d = x.shape
        gates, index = jax.lax.top_k(jax.nn.softmax(x @ p["router"], axis=-1), top_k)
        flat = index.reshape(-1) if keys_of is None else keys_of(x, index)
        order = jnp.argsort(flat, stable=True)
        rows = x.reshape(b * t, d)[order // top_k]
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        h = (jax.lax.ragged_dot(rows, p["w_in"], sizes) + p["bias"]).reshape(-1, 2, F)  # gate and up units
        h = jax.nn.silu(h[:, 0]) * h[:, 1]
        h = h if between is None else between(h)
        out = jax.lax.ragged_dot(h, p["w_out"], sizes)
        if read_back is not None:
            unsorted = read_back(out, order).reshape(b, t, top_k, d)
        else:
            at = order if put_back is None else put_back(order)
            unsorted = jnp.zeros_like(out).at[at].set(out).reshape(b, t, top_k, d)
        return jnp.einsum("btkd,btk->btd", unsorted, gates)

    return moe


def tokens(seed=1):
    return jax.random.normal(jax.random.key(seed), (8, 6, D))


def sections_of(moe):
    closed = jax.make_jaxpr(moe)(params(), tokens())
    leaves = closed.jaxpr.invars
    return find_sections(closed.jaxpr, {leaves[i]: d for i, d in EXPERT_DIMS.items()})


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def check_placed_equals_written(moe, mesh):
    return placed_as_written(moe, params(), tokens(), EXPERT_DIMS, mesh, atol=1e-4)


def test_a_sorted_mixture_runs_as_routed_pairs_with_the_values_as_written(mesh):
    (section,) = sections_of(sorted_mixture()).values()
    assert (section.n_experts, section.k, section.m) == (E, 2, 8 * 6 * 2)  # pairs of (token, top-2 choice)
    moved = check_placed_equals_written(sorted_mixture(), mesh)
    # One device's 6 tokens x min(top-2, 1 expert a device) rows to each of 4 devices, the counts,
    # the outputs back; the backward pass sends the rows' and the outputs' gradients.
    all_to_alls = [c for c in moved if c.kind == "all-to-all"]
    assert sum(c.executions * c.payload_bytes for c in all_to_alls) == 4 * (4 * 6 * D * 4) + 4 * 4
    # No expert's matrix moves, and each device reduces only its own experts' gradients (over data).
    assert not [c for c in moved if c.kind in ("all-gather", "collective-permute") and c.payload_bytes >= D * F * 4]
    assert max(c.payload_bytes for c in moved if c.kind == "all-reduce") < E * D * 3 * F * 4, moved


def test_top_1_keys_of_an_argmax_run_as_pairs_on_their_own(mesh):
    top_1 = lambda x, index: jnp.argmax(x @ params()["router"], axis=-1).reshape(-1)
    moe = sorted_mixture(top_k=1, keys_of=top_1)
    (section,) = sections_of(moe).values()
    assert section.k == 1 and section.choices is None
    assert [c for c in check_placed_equals_written(moe, mesh) if c.kind == "all-to-all"]


@pytest.mark.parametrize(
    "change",
    [
        {"between": lambda h: jnp.cumsum(h, axis=0)},  # mixes rows: the sort's order matters
        {"between": lambda h: h - h.mean(0)},  # a reduction over every routed row
        {"keys_of": lambda x, index: (x.sum(-1, keepdims=True) > 0).astype(jnp.int32).repeat(2, -1).reshape(-1)},
        {"put_back": lambda order: (order + 1) % order.shape[0]},  # scattered elsewhere than read
    ],
    ids=["cumsum over rows", "mean over rows", "keys of no router", "shifted scatter"],
)
def test_a_section_that_is_not_provably_row_wise_runs_as_written(change, mesh):
    moe = sorted_mixture(**change)
    assert sections_of(moe) == {}
    assert not [c for c in check_placed_equals_written(moe, mesh) if c.kind == "all-to-all"]


def test_a_section_inside_a_rematerialised_layer_is_found_there(mesh):
    # nnx.remat / jax.checkpoint put the layer in an inner program: the placement re-traces it
    # with the section rewritten inside, and the backward pass recomputes the routed pairs.
    moved = check_placed_equals_written(jax.checkpoint(sorted_mixture()), mesh)
    assert [c for c in moved if c.kind == "all-to-all"]


def test_a_section_read_back_by_the_inverse_permutation_is_found_too(mesh):
    # MaxText's unsort: jnp.take(out, jnp.argsort(order), axis=0) rather than a scatter.
    unsort = lambda out, order: jnp.take(out, jnp.argsort(order), axis=0)
    (section,) = sections_of(sorted_mixture(read_back=unsort)).values()
    assert section.k == 2
    assert [c for c in check_placed_equals_written(sorted_mixture(read_back=unsort), mesh) if c.kind == "all-to-all"]


def test_each_layers_section_is_found_though_jax_traces_their_helpers_once():
    # Two layers call jnp.argsort, floor_divide, clip alike: JAX hands both the same traced
    # helper, whose values must not be confused between the layers.
    moe = sorted_mixture()
    assert len(sections_of(lambda p, x: moe(p, moe(p, x)))) == 2


def test_a_section_in_a_scanned_stack_of_layers_is_found_in_the_scan_body(mesh):
    # Layers stacked (L, E, ...) and scanned: the body reads each layer's experts without the
    # leading dimension, and the placement re-traces it with the section rewritten inside.
    moe = sorted_mixture()

    def stacked(p, x):
        layers = {k: v for k, v in p.items() if k != "router"}
        return jax.lax.scan(lambda h, w: (moe({**w, "router": p["router"]}, h), None), x, layers)[0]

    two = {k: (jnp.stack([v, v * 0.5]) if k != "router" else v) for k, v in params().items()}
    placed = place_experts(stacked, {2: 1, 3: 1}, mesh, token_axes=("data", "expert"))  # bias, router, w_in, w_out
    x = tokens()
    with jax.default_device(jax.devices()[0]):
        expected = stacked(two, x)
    np.testing.assert_allclose(jax.jit(placed)(two, x), expected, rtol=1e-5, atol=1e-5)
    assert "all-to-all" in jax.jit(placed).lower(two, x).compile().as_text()
