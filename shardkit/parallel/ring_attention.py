"""Ring attention: causal attention with the sequence split over the ``sequence`` mesh axis.

Each device holds one contiguous block of queries, keys and values. Keys and values (and their
documents, for packed rows) travel around the ring (``ppermute``) one block per step. At each
step the device runs the blocked kernel of :mod:`shardkit.parallel.attention` on its queries
against the block it holds, at their true positions, and merges the result into its running
output by the two log-sum-exps. No device ever holds the whole sequence, or more than one tile of
scores, so every mask the kernel serves (windows, soft caps, segments, sinks, a query scale)
trains under ``sequence`` too. Exact: the same numbers as plain attention, to floating-point
rounding (Liu et al. 2023, blockwise parallel transformers / ring attention).

The island is a ``jax.shard_map`` over the whole mesh: batch and heads stay sharded as the
rules say (data/fsdp, tensor), only the ``sequence`` axis is handled by hand.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shardkit.core.errors import LayoutError
from shardkit.core.rules import Rules, entry_axes, resolve
from shardkit.parallel.attention import blocked_backward, blocked_forward, no_cotangent


def merged(out: jax.Array, lse: jax.Array, more: jax.Array, more_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two attentions of the same queries over disjoint keys, ``(B, T, H, Kv)`` and their
    log-sum-exps ``(B, T, H)``, as one over all the keys (a query that saw none stays 0)."""
    total = jnp.logaddexp(lse, more_lse)
    seen = jnp.isfinite(total)
    weight = lambda x: jnp.where(seen, jnp.exp(x - jnp.where(seen, total, 0.0)), 0.0)[..., None]
    return out * weight(lse) + more * weight(more_lse), total


def _ring_body(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None,
    window: jax.Array | None,
    sinks: jax.Array | None,
    ring: _Ring,
) -> jax.Array:
    """Per-device block: q (b, t, H, K), k/v (b, t, N, K) -> out (b, t, H, Kv)."""
    out, lse = _ring_lse(ring, q, k, v, segments, window)
    if sinks is not None:  # the sink joins each softmax once, after every block
        sink = jnp.broadcast_to(sinks.astype(jnp.float32), lse.shape)
        out, _ = merged(out, lse, jnp.zeros_like(out), sink)
    return out.astype(q.dtype)


class _Ring(NamedTuple):
    axis: str
    size: int
    softcap: float | None
    scale: float | None

    def masks(self, segments: jax.Array | None, kv_segments: jax.Array | None, window: jax.Array | None) -> dict:
        """The kernel's keywords for one step."""
        return dict(window=window, softcap=self.softcap, scale=self.scale, segments=segments, kv_segments=kv_segments)

    def passed_on(self, blocks: Any) -> Any:
        """``blocks`` sent one device along the ring."""
        perm = [(i, (i + 1) % self.size) for i in range(self.size)]
        return jax.lax.ppermute(blocks, self.axis, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_lse(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, window: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    return _ring_forward(ring, q, k, v, segments, window)


def _ring_forward(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, window: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Output ``(b, t, H, Kv)`` float32 and log-sum-exp ``(b, t, H)`` over every block of keys."""
    b, t, h, _ = q.shape
    me = jax.lax.axis_index(ring.axis)

    def step(carry: tuple[Any, ...], s: jax.Array) -> tuple[tuple[Any, ...], None]:
        out, lse, k_blk, v_blk, seg_blk = carry
        src = (me - s) % ring.size  # the block of keys/values held at this step
        more, more_lse = blocked_forward(
            q, k_blk, v_blk, q_offset=me * t, k_offset=src * t, **ring.masks(segments, seg_blk, window)
        )
        out, lse = merged(out, lse, more.astype(jnp.float32), more_lse)
        return (out, lse, *ring.passed_on((k_blk, v_blk, seg_blk))), None

    init = (jnp.zeros((b, t, h, v.shape[-1]), jnp.float32), jnp.full((b, t, h), -jnp.inf, jnp.float32), k, v, segments)
    (out, lse, *_), _ = jax.lax.scan(step, init, jnp.arange(ring.size))
    return out, lse


def _ring_fwd(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, window: jax.Array | None
) -> tuple[tuple[jax.Array, jax.Array], tuple[Any, ...]]:
    out, lse = _ring_forward(ring, q, k, v, segments, window)
    return (out, lse), (q, k, v, segments, window, out, lse)


def _ring_bwd(ring: _Ring, saved: tuple[Any, ...], cotangents: tuple[jax.Array, jax.Array]) -> tuple[Any, ...]:
    """The ring again: each key block travels with its gradients, which every device adds to; after
    ``size`` steps both are home. Memory: one block of keys per device, no residual per step."""
    q, k, v, segments, window, out, lse = saved
    d_out, d_lse = cotangents
    t = q.shape[1]
    me = jax.lax.axis_index(ring.axis)

    def step(carry: tuple[Any, ...], s: jax.Array) -> tuple[tuple[Any, ...], None]:
        d_q, k_blk, v_blk, seg_blk, d_k, d_v = carry
        src = (me - s) % ring.size
        dq_s, dk_s, dv_s = blocked_backward(
            q,
            k_blk,
            v_blk,
            out,
            lse,
            d_out,
            d_lse,
            q_offset=me * t,
            k_offset=src * t,
            **ring.masks(segments, seg_blk, window),
        )
        d_k, d_v = d_k + dk_s.astype(jnp.float32), d_v + dv_s.astype(jnp.float32)
        return (d_q + dq_s.astype(jnp.float32), *ring.passed_on((k_blk, v_blk, seg_blk, d_k, d_v))), None

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    init = (zeros(q), k, v, segments, zeros(k), zeros(v))
    (d_q, _, _, _, d_k, d_v), _ = jax.lax.scan(step, init, jnp.arange(ring.size))
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), no_cotangent(segments), no_cotangent(window)


_ring_lse.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mesh: Mesh,
    rules: Rules,
    axis: str = "sequence",
    *,
    window: int | jax.Array | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    segments: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-KV attention with the sequence sharded over ``axis``.

    Args:
      q: queries (B, T, H, K), logical ``("batch", "seq", "heads", "kv")``.
      k, v: keys and values (B, T, N, K), logical ``("batch", "seq", "kv_heads", "kv")``; N divides H.
      mesh: the device mesh; ``axis`` must be one of its axes.
      rules: the logical-to-mesh rules (they decide how batch and heads are sharded).
      axis: the mesh axis the sequence is split over.
      window, softcap, scale, sinks: as :func:`shardkit.parallel.attention.attention`.
      segments: (B, T) documents of packed rows, logical ``("batch", "seq")``.

    Returns:
      (B, T, H, K), sharded like ``q``.

    Example:
      >>> out = ring_attention(q, k, v, mesh, sk.default_rules(), softcap=50.0)   # doctest: +SKIP
    """
    mesh_shape = dict(mesh.shape)
    size = mesh_shape.get(axis, 1)
    q_spec = resolve(("batch", "seq", "heads", "kv"), q.shape, rules, mesh_shape, what="ring attention q")
    kv_spec = resolve(("batch", "seq", "kv_heads", "kv"), k.shape, rules, mesh_shape, what="ring attention k/v")
    if entry_axes(q_spec[1]) != (axis,) or entry_axes(kv_spec[1]) != (axis,):
        raise LayoutError(
            f"Ring attention needs the sequence dimension sharded over {axis!r} alone, but the rules give "
            f"q {q_spec} and k/v {kv_spec}. Map 'seq' to {axis!r} (sk.rules.sequence_parallel())."
        )
    q_spec = PartitionSpec(*(tuple(q_spec) + (None,) * (4 - len(q_spec))))
    kv_spec = PartitionSpec(*(tuple(kv_spec) + (None,) * (4 - len(kv_spec))))
    rows_spec = PartitionSpec(q_spec[0], q_spec[1])
    heads_spec = PartitionSpec(q_spec[2])
    window = None if window is None else jnp.asarray(window, jnp.int32)

    ring = _Ring(axis, size, softcap, scale)

    def body(q, k, v, segments, window, sinks):
        return _ring_body(q, k, v, segments, window, sinks, ring)

    island = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            q_spec,
            kv_spec,
            kv_spec,
            None if segments is None else rows_spec,
            None if window is None else PartitionSpec(),
            None if sinks is None else heads_spec,
        ),
        out_specs=q_spec,
        check_vma=False,
    )
    return island(q, k, v, segments, window, sinks)
