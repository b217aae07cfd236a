"""Mixture of experts: top-k routing, capacity with token dropping, load-balancing loss.

GShard-style dispatch: each sequence is a routing group; a one-hot dispatch tensor puts every
kept token into a slot of its experts' buffers, ``einsum`` gathers the buffers, the experts run,
and a weighted combine brings the outputs back. The expert buffers are constrained to be split
over the ``expert`` mesh axis while tokens are split over the batch axes (which include
``expert``), so XLA moves tokens to their experts and back with all-to-alls. Routing depends on
each sequence alone, so every layout routes (and drops) exactly the same tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from shardkit.core.partition import current_rules, logical
from shardkit.core.rules import resolve


def top_k_by_rows(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last dimension (the same values and indices, ties to the lower
    index), in a form whose rows stay where they are split.

    XLA turns ``lax.top_k`` into a ``TopK`` custom call that the SPMD partitioner does not split:
    a (B, T, E) router output split over ``data`` is gathered whole on every device (measured,
    jax 0.10.2: one all-gather per layer). A stable sort of the last dimension is split by rows.

    Args:
      x: ``(..., N)`` values.
      k: how many of the largest to keep, ``1 <= k <= N``.

    Returns:
      ``(values (..., k), indices (..., k))``, largest first.

    Example:
      >>> values, indices = top_k_by_rows(jnp.array([[1.0, 3.0, 3.0, 2.0]]), 2)
      >>> values.tolist(), indices.tolist()
      ([[3.0, 3.0]], [[1, 2]])
    """
    indices = jnp.argsort(-x, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(x, indices, axis=-1), indices


def route(logits: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing with a per-expert capacity, first choices first (later tokens are dropped).

    Args:
      logits: router logits (G, S, E) for G groups of S tokens.
      top_k: experts per token.
      capacity: slots per expert and group.

    Returns:
      ``(dispatch, combine, aux_loss)``: dispatch (G, S, E, C) in {0, 1}; combine (G, S, E, C),
      the gate weights of the kept assignments; the load-balancing loss (Switch/GShard form:
      E * sum_e fraction_of_first_choices_e * mean_router_probability_e, 1.0 when balanced).
    """
    g, s, e = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # (G, S, E)
    gates, experts = top_k_by_rows(probs, top_k)  # (G, S, k)
    gates = gates / gates.sum(axis=-1, keepdims=True)
    choice = jax.nn.one_hot(experts, e, dtype=jnp.int32)  # (G, S, k, E)
    # Slots are filled by all first choices (in token order), then all second choices, ...
    order = choice.transpose(0, 2, 1, 3).reshape(g, top_k * s, e)
    slot = (jnp.cumsum(order, axis=1) - 1).reshape(g, top_k, s, e).transpose(0, 2, 1, 3)  # (G, S, k, E)
    kept = choice * (slot < capacity)
    one_slot = jax.nn.one_hot(jnp.where(kept > 0, slot, -1), capacity, dtype=jnp.float32)  # (G, S, k, E, C)
    dispatch = one_slot.sum(axis=2)  # (G, S, E, C)
    combine = (one_slot * gates[..., None, None]).sum(axis=2)  # (G, S, E, C)
    first = jax.nn.one_hot(experts[..., 0], e, dtype=jnp.float32)  # (G, S, E)
    aux = e * jnp.sum(first.mean(axis=(0, 1)) * probs.mean(axis=(0, 1)))
    return dispatch, combine, aux


def exchange(buffers: jax.Array, to_experts: bool, axis: str = "expert") -> jax.Array:
    """Move expert buffers (E, G, C, D) between token-sharded and expert-sharded with one
    all-to-all over ``axis``: each device sends every expert's slots of its own tokens to the
    device that holds that expert (and the reverse for ``to_experts=False``).

    Outside a sharding context, or when the mesh has no ``axis``, the buffers are returned as they are.
    """
    context = current_rules()
    if context is None or dict(context[0].shape).get(axis, 1) == 1:
        return buffers
    mesh, rules = context
    mesh_shape = dict(mesh.shape)
    tokens = resolve((None, "batch", None, None), buffers.shape, rules, mesh_shape, what="expert buffers")
    experts = resolve(("experts", "batch", None, None), buffers.shape, rules, mesh_shape, what="expert buffers")
    token_spec = PartitionSpec(*(tuple(tokens) + (None,) * (4 - len(tokens))))
    expert_spec = PartitionSpec(*(tuple(experts) + (None,) * (4 - len(experts))))
    if to_experts:
        move = lambda b: jax.lax.all_to_all(b, axis, split_axis=0, concat_axis=1, tiled=True)
        in_spec, out_spec = token_spec, expert_spec
    else:
        move = lambda b: jax.lax.all_to_all(b, axis, split_axis=1, concat_axis=0, tiled=True)
        in_spec, out_spec = expert_spec, token_spec
    return jax.shard_map(move, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)(buffers)


class MoE(nnx.Module):
    """SwiGLU experts behind a top-k router. ``(B, T, D) -> ((B, T, D), load-balancing loss)``.

    ``dropless``: every expert has a slot for every token of its group (memory and FLOPs of
    ``E / top_k`` times the even share), so no token is dropped and the result is that of
    routing each token to its top-k experts with no capacity at all.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        capacity_factor: float,
        param_dtype: str,
        rngs: nnx.Rngs,
        dropless: bool = False,
    ):
        init, dt = nnx.initializers.lecun_normal(), jnp.dtype(param_dtype)
        self.router = nnx.Param(logical(init, ("embed", None))(rngs.params(), (dim, n_experts), dt))
        gate_up_init = nnx.initializers.lecun_normal(in_axis=1, out_axis=(2, 3), batch_axis=(0,))
        self.w_gate_up = nnx.Param(
            logical(gate_up_init, ("experts", "embed", None, "mlp"))(rngs.params(), (n_experts, dim, 2, hidden), dt)
        )
        down_init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.w_down = nnx.Param(
            logical(down_init, ("experts", "mlp", "embed"))(rngs.params(), (n_experts, hidden, dim), dt)
        )
        self.top_k, self.capacity_factor, self.n_experts = top_k, capacity_factor, n_experts
        self.dropless = dropless

    def capacity(self, tokens_per_group: int) -> int:
        """Slots per expert and group. Dropless: one per token of the group, since a token
        chooses an expert at most once, so no expert can overflow (Mixtral's routing, exactly)."""
        if self.dropless:
            return tokens_per_group
        return max(1, math.ceil(self.capacity_factor * tokens_per_group * self.top_k / self.n_experts))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = x.shape[1]
        with jax.named_scope("router"):
            logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # (B, T, E)
            dispatch, combine, aux = route(logits, self.top_k, self.capacity(t))
        with jax.named_scope("dispatch"):
            buffers = jnp.einsum("gsec,gsd->egcd", dispatch.astype(x.dtype), x)  # (E, B, C, D), local tokens
            buffers = exchange(buffers, to_experts=True)
        with jax.named_scope("experts"):
            h = jnp.einsum("egcd,edxf->egcxf", buffers, self.w_gate_up[...].astype(x.dtype))  # (E, B, C, 2, F)
            h = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]  # (E, B, C, F)
            out = jnp.einsum("egcf,efd->egcd", h, self.w_down[...].astype(x.dtype))  # (E, B, C, D)
            out = exchange(out, to_experts=False)
        with jax.named_scope("combine"):
            y = jnp.einsum("gsec,egcd->gsd", combine.astype(x.dtype), out)  # (B, T, D)
        return y, aux
