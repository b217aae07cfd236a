"""Ring attention: causal attention with the sequence split over the ``sequence`` mesh axis.

Each device holds one contiguous block of queries, keys and values. Keys and values travel
around the ring (``ppermute``) one block per step; each device folds every block into a
numerically stable online softmax (running max, running sum, running output), so no device ever
holds the whole sequence, the full score matrix, or more than two key/value blocks. Exact:
the same numbers as plain attention, to floating-point rounding (Liu et al. 2023, blockwise
parallel transformers / ring attention).

The island is a ``jax.shard_map`` over the whole mesh: batch and heads stay sharded as the
rules say (data/fsdp, tensor), only the ``sequence`` axis is handled by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shardkit.core.errors import LayoutError
from shardkit.core.rules import Rules, entry_axes, resolve


def _ring_body(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, size: int) -> jax.Array:
    """Per-device block: q (b, t, H, d), k/v (b, t, N, d) -> out (b, t, H, d)."""
    b, t, h, d = q.shape
    n_kv = k.shape[2]
    g = h // n_kv
    me = jax.lax.axis_index(axis)
    qg = (q.astype(jnp.float32) * d**-0.5).reshape(b, t, n_kv, g, d)  # head h -> kv head h // g
    q_pos = me * t + jnp.arange(t)  # global positions of this block's queries

    # Recompute each step's scores in the backward pass instead of storing all of them: the
    # memory of one (t x t) block per device, as flash attention does within a device.
    @jax.checkpoint
    def step(carry, s):
        out, run_max, run_sum, k_blk, v_blk = carry
        src = (me - s) % size  # the block of keys/values held at this step
        k_pos = src * t + jnp.arange(t)
        allowed = k_pos[None, :] <= q_pos[:, None]  # (t, t) causal mask across blocks
        scores = jnp.einsum("btngd,bsnd->bngts", qg, k_blk.astype(jnp.float32))
        scores = jnp.where(allowed, scores, -jnp.inf)
        new_max = jnp.maximum(run_max, scores.max(axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with no key yet
        probs = jnp.where(allowed, jnp.exp(scores - safe_max[..., None]), 0.0)
        rescale = jnp.where(jnp.isfinite(run_max), jnp.exp(run_max - safe_max), 0.0)
        run_sum = run_sum * rescale + probs.sum(axis=-1)
        out = out * rescale[..., None] + jnp.einsum("bngts,bsnd->bngtd", probs, v_blk.astype(jnp.float32))
        perm = [(i, (i + 1) % size) for i in range(size)]
        k_blk, v_blk = jax.lax.ppermute((k_blk, v_blk), axis, perm)
        return (out, new_max, run_sum, k_blk, v_blk), None

    init = (
        jnp.zeros((b, n_kv, g, t, d), jnp.float32),
        jnp.full((b, n_kv, g, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, n_kv, g, t), jnp.float32),
        k,
        v,
    )
    (out, _, run_sum, _, _), _ = jax.lax.scan(step, init, jnp.arange(size))
    out = out / run_sum[..., None]  # every query sees at least itself: run_sum > 0
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def ring_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh, rules: Rules, axis: str = "sequence"
) -> jax.Array:
    """Causal grouped-KV attention with the sequence sharded over ``axis``.

    Args:
      q: queries (B, T, H, K), logical ``("batch", "seq", "heads", "kv")``.
      k, v: keys and values (B, T, N, K), logical ``("batch", "seq", "kv_heads", "kv")``; N divides H.
      mesh: the device mesh; ``axis`` must be one of its axes.
      rules: the logical-to-mesh rules (they decide how batch and heads are sharded).
      axis: the mesh axis the sequence is split over.

    Returns:
      (B, T, H, K), sharded like ``q``.

    Example:
      >>> out = ring_attention(q, k, v, mesh, sk.default_rules())   # doctest: +SKIP
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
    body = jax.shard_map(
        lambda a, b, c: _ring_body(a, b, c, axis, size),
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec),
        out_specs=q_spec,
        check_vma=False,
    )
    return body(q, k, v)
