"""A placed forward pass checked against the function as written: values and gradients against
one device's, on the inputs split as a step holds them; the compiled collectives returned."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.analysis import hlo
from shardkit.parallel.expert_placement import place_experts


def placed_as_written(moe, params, x, expert_dims, mesh, atol=1e-4):
    """``moe(params, x)`` placed on ``mesh`` (``data``, ``expert``): its values and gradients
    equal one device's; returns the collectives of its compiled gradient."""
    placed = place_experts(moe, expert_dims, mesh, token_axes=("data", "expert"))
    with jax.default_device(jax.devices()[0]):  # the reference: one device, as written
        expected = moe(params, x)
        expected_grads = jax.grad(lambda p, x: moe(p, x).sum(), argnums=(0, 1))(params, x)
    # The experts' weights split over expert, the tokens' rows over every axis, as a step holds them.
    split = lambda name: NamedSharding(mesh, PartitionSpec("expert") if name.startswith("w_") else PartitionSpec())
    params = {name: jax.device_put(value, split(name)) for name, value in params.items()}
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "expert"))))
    np.testing.assert_allclose(jax.jit(placed)(params, x), expected, rtol=1e-5, atol=1e-5)
    gradient = jax.jit(jax.grad(lambda p, x: placed(p, x).sum(), argnums=(0, 1)))
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
    jax.tree.map(close, gradient(params, x), expected_grads)
    return hlo.collectives(gradient.lower(params, x).compile().as_text())


def rerolled_in_scanned_layers(moe, params, x, mesh):
    """``moe`` as the body of a ``lax.scan`` over two layers of its ``w_*`` weights (experts on
    dimension 1), placed: its values equal one device's; returns the placed scan body's program."""

    def stacked(p, x):
        layers = {k: v for k, v in p.items() if k.startswith("w_")}
        shared = {k: v for k, v in p.items() if not k.startswith("w_")}
        return jax.lax.scan(lambda h, w: (moe({**w, **shared}, h), None), x, layers)[0]

    two = {k: (jnp.stack([v, v * 0.5]) if k.startswith("w_") else v) for k, v in params.items()}
    expert_dims = {i: 1 for i, k in enumerate(sorted(two)) if k.startswith("w_")}  # leaves in tree order
    placed = place_experts(stacked, expert_dims, mesh, token_axes=("data", "expert"))
    with jax.default_device(jax.devices()[0]):
        expected = stacked(two, x)
    np.testing.assert_allclose(jax.jit(placed)(two, x), expected, rtol=1e-5, atol=1e-5)
    (scan,) = [e for e in jax.make_jaxpr(placed)(two, x).jaxpr.eqns if e.primitive.name == "scan"]
    return scan.params["jaxpr"].jaxpr


def shapes(eqn):
    """The shapes of an equation's operands."""
    return [getattr(v.aval, "shape", ()) for v in eqn.invars]
