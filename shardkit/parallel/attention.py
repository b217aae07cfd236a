"""Attention at memory linear in the sequence: flash attention's recurrences, written in JAX.

The forward pass walks the keys a block at a time for each block of queries, keeping a running
maximum, sum and output per query, and saves only the output and each query's log-sum-exp. The
backward pass recomputes each block's scores from those (Dao 2022, 2023). Neither ever holds more
than one ``(block_q x block_k)`` tile of scores per head, so the temporaries grow with the
sequence, not with its square.

Blocks that the mask hides entirely are never visited: the loops over key blocks start and stop
where the causal mask and the window allow (about half the tiles of causal attention at long
sequences, and all but ``window / block + 1`` per row of blocks of a sliding window).

One kernel serves every attention shardkit computes: causal or not (cross-attention), grouped kv
heads, sliding windows (a traced window too, for scanned layers that alternate), soft-capped
scores, sinks (a per-head logit that joins every softmax, gpt-oss), packed documents
(segments), values wider or narrower than keys (latent attention), and queries that start after
the keys (a prompt's chunk after a cache). :func:`attention_with_lse` also returns the
log-sum-exp, differentiably, so ring attention merges its steps' blocks exactly.

Example:
  >>> q, kv = jnp.ones((1, 300, 4, 8)), jnp.ones((1, 300, 2, 8))
  >>> attention(q, kv, kv, implementation="blocked").shape
  (1, 300, 4, 8)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.core.errors import InputError

IMPLEMENTATIONS = ("blocked", "materialized")

# From this many queries the blocked kernel runs (implementation=None) on a backend other than a
# GPU: below it the whole score matrix is small and one fused matmul is quicker. XLA:CPU, one
# layer's forward and backward against jax.nn.dot_product_attention: 1.4x slower at 256 tokens,
# even at 384, 0.5-0.6x the time at 512, 0.35x at 4,096 (benchmarks/long_context.py).
BLOCKED_FROM = 512

_NO_POSITION = np.iinfo(np.int32).max // 2  # a window "wider than any sequence", safe from overflow


@dataclasses.dataclass(frozen=True)
class _Mask:
    """What decides which keys a query sees, besides segments and positions (static, hashable)."""

    causal: bool
    windowed: bool  # a window operand is given (it may be traced)
    softcap: float | None
    scale: float
    block_q: int
    block_k: int
    q_len: int  # real (unpadded) lengths
    k_len: int


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | jax.Array | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: jax.Array | None = None,
    segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
    q_offset: int | jax.Array = 0,
    implementation: str | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> jax.Array:
    """Scaled dot-product attention, shaped as ``jax.nn.dot_product_attention``, at memory
    linear in the sequence.

    Args:
      q: ``(B, T, H, K)`` queries.
      k: ``(B, S, N, K)`` keys; ``N`` divides ``H`` (query head ``h`` reads kv head ``h // (H/N)``).
      v: ``(B, S, N, Kv)`` values (``Kv`` may differ from ``K``: latent attention).
      causal: query ``i`` (at position ``q_offset + i``) sees keys at positions ``<= q_offset + i``.
        False: every key (cross-attention), subject to ``segments``.
      window: with ``causal``, a query also sees only itself and the ``window - 1`` keys before it.
        May be a traced int (a scanned layer that is sliding or not).
      softcap: scores ``-> softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
      scale: scores' scale; None: ``K ** -0.5``.
      sinks: ``(H,)`` logits that join each query's softmax with no value (gpt-oss): the weights
        of the keys then sum to less than 1.
      segments: ``(B, T)`` int, the document of each query; a query sees keys of its own
        document only (packed rows).
      kv_segments: ``(B, S)``, the keys' documents; None: ``segments`` (self-attention).
      q_offset: the first query's position relative to the first key (a chunk of a prompt after
        ``q_offset`` tokens already in ``k``).
      implementation: ``"blocked"`` (this module's kernel), ``"materialized"`` (the whole score
        matrix, for reference and for short sequences), or None: blocked on GPUs, elsewhere
        from :data:`BLOCKED_FROM` queries (materialized below, where one fused matmul is quicker).
      block_q, block_k: queries and keys per tile.

    Returns:
      ``(B, T, H, Kv)`` in ``q``'s dtype; softmax in float32. A query that sees no key gives 0.

    Example:
      >>> q, k, v = jnp.ones((2, 512, 8, 16)), jnp.ones((2, 512, 2, 16)), jnp.ones((2, 512, 2, 16))
      >>> attention(q, k, v, window=128, softcap=50.0).shape
      (2, 512, 8, 16)
    """
    out, _ = attention_with_lse(
        q,
        k,
        v,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        sinks=sinks,
        segments=segments,
        kv_segments=kv_segments,
        q_offset=q_offset,
        implementation=implementation,
        block_q=block_q,
        block_k=block_k,
    )
    return out


def attention_with_lse(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | jax.Array | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: jax.Array | None = None,
    segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
    q_offset: int | jax.Array = 0,
    k_offset: int | jax.Array = 0,
    implementation: str | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """:func:`attention`, and each query's log-sum-exp of its scores (sinks included).

    Both are differentiable: ring attention merges blocks of keys by their log-sum-exps.

    Args:
      q, k, v, causal, window, softcap, scale, sinks, segments, kv_segments, q_offset,
      implementation, block_q, block_k: as :func:`attention`.
      k_offset: the first key's position (queries at ``q_offset ..``, keys at ``k_offset ..``:
        the blocks of a ring).

    Returns:
      ``(out (B, T, H, Kv), lse (B, T, H) float32)``; a query that sees no key: 0 and ``-inf``.

    Example:
      >>> q = jnp.ones((1, 64, 2, 8))
      >>> out, lse = attention_with_lse(q, q, q, implementation="blocked", block_q=16, block_k=16)
      >>> lse.shape
      (1, 64, 2)
    """
    _check(q, k, v, causal, window, softcap, scale, sinks, segments, kv_segments, implementation, block_q, block_k)
    if segments is not None and kv_segments is None:
        kv_segments = segments
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if implementation is None:
        on_gpu = jax.default_backend() == "gpu"
        implementation = "blocked" if on_gpu or q.shape[1] >= BLOCKED_FROM else "materialized"
    positions = (jnp.asarray(q_offset, jnp.int32), jnp.asarray(k_offset, jnp.int32))
    win = None if window is None else jnp.asarray(window, jnp.int32)
    if implementation == "materialized":
        return _materialized(q, k, v, causal, win, softcap, scale, sinks, segments, kv_segments, *positions)
    mask, tiles = _tiled(
        q, k, v, causal, win, softcap, scale, sinks, segments, kv_segments, positions, block_q, block_k
    )
    return _untiled(*_blocked(mask, *tiles), q.shape, v.shape[-1])


def blocked_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset: jax.Array, k_offset: jax.Array, **masks: Any
) -> tuple[jax.Array, jax.Array]:
    """The blocked kernel's forward pass alone, not differentiable: ``(out (B, T, H, Kv), lse
    (B, T, H))`` of :func:`attention_with_lse` for a caller that writes its own backward (ring
    attention, which keeps no residual per step).

    Args:
      q, k, v: as :func:`attention`.
      q_offset, k_offset: the first query's and key's positions.
      masks: ``causal``, ``window``, ``softcap``, ``scale`` (a float), ``segments``,
        ``kv_segments``, ``block_q``, ``block_k`` as :func:`attention` takes them (no sinks).

    Returns:
      the output and the log-sum-exp.
    """
    mask, tiles = _tiled_from(q, k, v, q_offset, k_offset, masks)
    return _untiled(*_blocked_forward(mask, *tiles), q.shape, v.shape[-1])


def blocked_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array,
    *,
    q_offset: jax.Array,
    k_offset: jax.Array,
    **masks: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients of ``q``, ``k`` and ``v`` for the keys ``k`` alone, given the output and
    log-sum-exp over *all* the keys the queries see (flash attention's backward with a global
    log-sum-exp: ring attention's step).

    Args:
      q, k, v, q_offset, k_offset, masks: as :func:`blocked_forward`.
      out: ``(B, T, H, Kv)``, lse: ``(B, T, H)``: the attention over every key block.
      d_out, d_lse: their cotangents.

    Returns:
      ``(dq, dk, dv)`` in the shapes and dtypes of ``q``, ``k``, ``v``.
    """
    mask, (qg, kp, vp, _, segs, positions, win) = _tiled_from(q, k, v, q_offset, k_offset, masks)
    b, t, h, _ = q.shape
    n, g, bq = k.shape[2], h // k.shape[2], mask.block_q
    grouped = lambda x: _padded(x.reshape(b, t, n, g, x.shape[-1]), bq)  # (B, Tp, N, G, .)
    per_head = lambda x, fill: _padded(x.transpose(0, 2, 1).reshape(b, n, g, t), bq, fill, axis=3)  # (B, N, G, Tp)
    d_q, d_k, d_v, _ = _blocked_backward(
        mask,
        qg,
        kp,
        vp,
        None,
        segs,
        positions,
        win,
        grouped(out),
        per_head(lse, -jnp.inf),
        grouped(d_out),
        per_head(d_lse, 0.0),
    )
    return d_q[:, :t].reshape(q.shape), d_k[:, : k.shape[1]], d_v[:, : k.shape[1]]


def _tiled_from(
    q: jax.Array, k: jax.Array, v: jax.Array, q_offset: Any, k_offset: Any, masks: dict[str, Any]
) -> tuple[_Mask, tuple[Any, ...]]:
    """:func:`_tiled` for :func:`blocked_forward`'s and :func:`blocked_backward`'s keywords."""
    segments = masks.get("segments")
    window = masks.get("window")
    return _tiled(
        q,
        k,
        v,
        masks.get("causal", True),
        None if window is None else jnp.asarray(window, jnp.int32),
        masks.get("softcap"),
        masks.get("scale") or q.shape[-1] ** -0.5,
        None,
        segments,
        masks.get("kv_segments", segments),
        (jnp.asarray(q_offset, jnp.int32), jnp.asarray(k_offset, jnp.int32)),
        masks.get("block_q", 128),
        masks.get("block_k", 128),
    )


def _tiled(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool,
    window: jax.Array | None,
    softcap: float | None,
    scale: float,
    sinks: jax.Array | None,
    segments: jax.Array | None,
    kv_segments: jax.Array | None,
    positions: tuple[jax.Array, jax.Array],
    block_q: int,
    block_k: int,
) -> tuple[_Mask, tuple[Any, ...]]:
    """The kernel's static mask and its operands: queries grouped by kv head ``(B, Tp, N, G, K)``,
    keys and values ``(B, Sp, N, .)``, each padded to whole blocks; sinks ``(N, G)``; segments
    padded with documents no real token has."""
    bq, bk = min(block_q, q.shape[1]), min(block_k, k.shape[1])
    mask = _Mask(causal, window is not None, softcap, scale, bq, bk, q.shape[1], k.shape[1])
    b, t, h, d = q.shape
    n = k.shape[2]
    qg = _padded(q.reshape(b, t, n, h // n, d), bq)
    segs = None
    if segments is not None:
        keys = segments if kv_segments is None else kv_segments
        segs = (_padded(segments.astype(jnp.int32), bq, -1), _padded(keys.astype(jnp.int32), bk, -2))
    win = window if window is not None else jnp.int32(_NO_POSITION)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(n, h // n)
    return mask, (qg, _padded(k, bk), _padded(v, bk), sink, segs, positions, win)


def _untiled(out: jax.Array, lse: jax.Array, q_shape: tuple[int, ...], dv: int) -> tuple[jax.Array, jax.Array]:
    """The kernel's ``(B, Tp, N, G, Kv)`` and ``(B, N, G, Tp)`` as ``(B, T, H, Kv)``, ``(B, T, H)``."""
    b, t, h, _ = q_shape
    return out[:, :t].reshape(b, t, h, dv), lse[..., :t].reshape(b, h, t).transpose(0, 2, 1)


def visited_blocks(
    t: int,
    s: int,
    *,
    causal: bool = True,
    window: int | None = None,
    q_offset: int = 0,
    block_q: int = 128,
    block_k: int = 128,
) -> int:
    """How many ``(block_q x block_k)`` tiles the blocked kernel scores for ``t`` queries and
    ``s`` keys (of ``ceil(t / block_q) * ceil(s / block_k)``): what the mask lets it skip.

    Example:
      >>> visited_blocks(1024, 1024), visited_blocks(1024, 1024, causal=False)
      (36, 64)
    """
    bq, bk = min(block_q, t), min(block_k, s)
    nq, nk = -(-t // bq), -(-s // bk)
    mask = _Mask(causal, window is not None, None, 1.0, bq, bk, t, s)
    win = np.int64(window if window is not None else _NO_POSITION)
    total = 0
    for i in range(nq):
        lo, hi = _key_blocks(mask, i, np.int64(q_offset), np.int64(0), win, nk, np)
        total += max(0, int(hi) - int(lo))
    return total


def _check(
    q: Any,
    k: Any,
    v: Any,
    causal: bool,
    window: Any,
    softcap: float | None,
    scale: float | None,
    sinks: Any,
    segments: Any,
    kv_segments: Any,
    implementation: str | None,
    block_q: int,
    block_k: int,
) -> None:
    """Every misuse refused before anything is traced, with the fix."""
    shapes = {"q": np.shape(q), "k": np.shape(k), "v": np.shape(v)}
    if any(len(shape) != 4 for shape in shapes.values()):
        raise InputError(
            f"attention: q {shapes['q']}, k {shapes['k']}, v {shapes['v']}: give (batch, sequence, heads, head_dim) "
            "arrays, as jax.nn.dot_product_attention takes."
        )
    (b, t, h, d), (bk_, s, n, dk), (bv, sv, nv, _) = shapes["q"], shapes["k"], shapes["v"]
    if not (b == bk_ == bv and s == sv and n == nv and d == dk):
        raise InputError(
            f"attention: q {shapes['q']}, k {shapes['k']}, v {shapes['v']} do not agree: q and k need the same batch "
            "and head_dim, k and v the same batch, sequence and heads."
        )
    if h % n:
        raise InputError(f"attention: {h} query heads do not divide into {n} kv heads; give kv heads that divide them.")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise InputError(f"attention: implementation={implementation!r}; choose one of {IMPLEMENTATIONS} or None.")
    if window is not None and not causal:
        raise InputError("attention: a window applies to causal attention; give causal=True or window=None.")
    if isinstance(window, (int, np.integer)) and window < 1:
        raise InputError(f"attention: window={window} must be a positive number of tokens (itself included).")
    for name, value in (("softcap", softcap), ("scale", scale)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise InputError(f"attention: {name}={value!r} must be a positive number (or None).")
    if sinks is not None and np.shape(sinks) != (h,):
        raise InputError(f"attention: sinks of shape {np.shape(sinks)}; give one logit per query head, ({h},).")
    if segments is not None and np.shape(segments) != (b, t):
        raise InputError(f"attention: segments of shape {np.shape(segments)}; give the queries' ({b}, {t}).")
    if kv_segments is not None and (segments is None or np.shape(kv_segments) != (b, s)):
        raise InputError(
            f"attention: kv_segments of shape {np.shape(kv_segments)} need segments too, and the keys' shape "
            f"({b}, {s})."
        )
    if segments is not None and kv_segments is None and s != t:
        raise InputError("attention: segments for queries and keys of different lengths; give kv_segments too.")
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or value < 1:
            raise InputError(f"attention: {name}={value!r} must be a positive int (128 is usual).")


def _padded(x: jax.Array, block: int, fill: float = 0, axis: int = 1) -> jax.Array:
    """``x`` padded along ``axis`` to a multiple of ``block`` (with ``fill``)."""
    extra = -x.shape[axis] % block
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=fill)


def _key_blocks(
    mask: _Mask, i: Any, q_start: Any, k_start: Any, window: Any, nk: int, xp: Any = jnp
) -> tuple[Any, Any]:
    """``[lo, hi)``: the key blocks that query block ``i`` may see (ints, traced or numpy)."""
    bq, bk = mask.block_q, mask.block_k
    lo, hi = 0, nk
    if mask.causal:  # the block's first key at or before the block's last query
        last_q = q_start + (i + 1) * bq - 1
        hi = xp.minimum(nk, xp.maximum(0, (last_q - k_start) // bk + 1))
        if mask.windowed:  # the block's last key inside the window of the block's first query
            first_q = q_start + i * bq
            lo = xp.maximum(0, _ceil_div(first_q - window + 2 - k_start, bk) - 1)
    return lo, hi


def _query_blocks(mask: _Mask, j: Any, q_start: Any, k_start: Any, window: Any, nq: int) -> tuple[Any, Any]:
    """``[lo, hi)``: the query blocks that may see key block ``j``."""
    bq, bk = mask.block_q, mask.block_k
    lo, hi = jnp.int32(0), jnp.int32(nq)
    if mask.causal:  # the query block's last query at or after the key block's first key
        first_k = k_start + j * bk
        lo = jnp.clip(_ceil_div(first_k - q_start + 1, bq) - 1, 0, nq)
        if mask.windowed:  # the query block's first query within the window of the key block's last key
            last_k = k_start + (j + 1) * bk - 1
            hi = jnp.clip((last_k + window - 1 - q_start) // bq + 1, 0, nq)
    return lo, hi


def _ceil_div(a: Any, b: int) -> Any:
    return -((-a) // b)


def _visible(
    mask: _Mask, q_pos: jax.Array, k_pos: jax.Array, q_seg: Any, k_seg: Any, window: jax.Array, k_index: jax.Array
) -> jax.Array:
    """``(B or 1, 1, 1, bq, bk)``: which scores of a tile count."""
    seen = (k_index < mask.k_len)[None, :]  # padding keys never
    if mask.causal:
        seen = seen & (k_pos[None, :] <= q_pos[:, None])
        if mask.windowed:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
    seen = seen[None, None, None]
    if q_seg is not None:
        seen = seen & (q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :])
    return seen


def _tile_scores(mask: _Mask, qb: jax.Array, kb: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Scaled (and capped) scores ``(B, N, G, bq, bk)`` float32, and ``tanh`` of the cap's
    argument for the backward pass (None without a cap)."""
    raw = jnp.einsum("bqngk,bsnk->bngqs", qb, kb, preferred_element_type=jnp.float32) * mask.scale
    if mask.softcap is None:
        return raw, None
    capped = jnp.tanh(raw / mask.softcap)
    return mask.softcap * capped, capped


def _blocked_forward(
    mask: _Mask,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array | None,
    segments: tuple[jax.Array, jax.Array] | None,
    positions: tuple[jax.Array, jax.Array],
    window: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``q (B, Tp, N, G, K)``, ``k (B, Sp, N, K)``, ``v (B, Sp, N, Kv)`` -> output
    ``(B, Tp, N, G, Kv)`` and log-sum-exp ``(B, N, G, Tp)``."""
    b, tp, n, g, _ = q.shape
    bq, bk = mask.block_q, mask.block_k
    nq, nk = tp // bq, k.shape[1] // bk
    dv = v.shape[-1]
    q_start, k_start = positions

    def one_query_block(_: None, i: jax.Array) -> tuple[None, tuple[jax.Array, jax.Array]]:
        qb = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, 1)
        q_pos = q_start + i * bq + jnp.arange(bq)
        q_seg = None if segments is None else jax.lax.dynamic_slice_in_dim(segments[0], i * bq, bq, 1)

        def one_key_block(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            run_max, run_sum, acc = carry
            kb, vb = (jax.lax.dynamic_slice_in_dim(x, j * bk, bk, 1) for x in (k, v))
            k_index = j * bk + jnp.arange(bk)
            k_seg = None if segments is None else jax.lax.dynamic_slice_in_dim(segments[1], j * bk, bk, 1)
            scores, _ = _tile_scores(mask, qb, kb)
            seen = _visible(mask, q_pos, k_start + k_index, q_seg, k_seg, window, k_index)
            scores = jnp.where(seen, scores, -jnp.inf)
            new_max = jnp.maximum(run_max, scores.max(-1))
            safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            probs = jnp.exp(scores - safe[..., None])  # 0 where not seen
            rescale = jnp.exp(run_max - safe)  # 0 while nothing was seen
            run_sum = run_sum * rescale + probs.sum(-1)
            pv = jnp.einsum("bngqs,bsnk->bngqk", probs.astype(v.dtype), vb, preferred_element_type=jnp.float32)
            return new_max, run_sum, acc * rescale[..., None] + pv

        if sinks is None:
            run_max = jnp.full((b, n, g, bq), -jnp.inf, jnp.float32)
            run_sum = jnp.zeros((b, n, g, bq), jnp.float32)
        else:  # the sink is one more score, with no value
            run_max = jnp.broadcast_to(sinks[None, :, :, None], (b, n, g, bq))
            run_sum = jnp.ones((b, n, g, bq), jnp.float32)
        acc = jnp.zeros((b, n, g, bq, dv), jnp.float32)
        lo, hi = _key_blocks(mask, i, q_start, k_start, window, nk)
        run_max, run_sum, acc = jax.lax.fori_loop(lo, hi, one_key_block, (run_max, run_sum, acc))
        seen_any = run_sum > 0
        out = jnp.where(seen_any[..., None], acc / jnp.where(seen_any, run_sum, 1.0)[..., None], 0.0)
        lse = jnp.where(seen_any, run_max + jnp.log(jnp.where(seen_any, run_sum, 1.0)), -jnp.inf)
        return None, (out.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse)

    _, (out, lse) = jax.lax.scan(one_query_block, None, jnp.arange(nq))  # (nq, B, bq, N, G, Kv), (nq, B, N, G, bq)
    out = out.transpose(1, 0, 2, 3, 4, 5).reshape(b, tp, n, g, dv)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, n, g, tp)
    return out, lse


def _blocked_backward(
    mask: _Mask,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array | None,
    segments: tuple[jax.Array, jax.Array] | None,
    positions: tuple[jax.Array, jax.Array],
    window: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The gradients of q, k, v and sinks, one key block at a time (its q blocks in an inner
    loop; dq accumulated in float32 across key blocks)."""
    b, tp, n, _, d = q.shape
    bq, bk = mask.block_q, mask.block_k
    nq, nk = tp // bq, k.shape[1] // bk
    q_start, k_start = positions
    # dS = P * (dP - delta): delta is each query's sum of dO * O, less the log-sum-exp's cotangent.
    delta = jnp.einsum("bqngk,bqngk->bngq", d_out.astype(jnp.float32), out.astype(jnp.float32)) - d_lse

    def one_key_block(d_q: jax.Array, j: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, j * bk, bk, 1) for x in (k, v))
        k_index = j * bk + jnp.arange(bk)
        k_seg = None if segments is None else jax.lax.dynamic_slice_in_dim(segments[1], j * bk, bk, 1)

        def one_query_block(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            d_k, d_v, d_q = carry
            qb, dob = (jax.lax.dynamic_slice_in_dim(x, i * bq, bq, 1) for x in (q, d_out))
            lse_b, delta_b = (jax.lax.dynamic_slice_in_dim(x, i * bq, bq, 3) for x in (lse, delta))
            q_pos = q_start + i * bq + jnp.arange(bq)
            q_seg = None if segments is None else jax.lax.dynamic_slice_in_dim(segments[0], i * bq, bq, 1)
            scores, capped = _tile_scores(mask, qb, kb)
            seen = _visible(mask, q_pos, k_start + k_index, q_seg, k_seg, window, k_index)
            seen = seen & jnp.isfinite(lse_b)[..., None]
            probs = jnp.where(seen, jnp.exp(scores - jnp.where(seen, lse_b[..., None], 0.0)), 0.0)
            d_v = d_v + jnp.einsum(
                "bngqs,bqngk->bsnk", probs.astype(dob.dtype), dob, preferred_element_type=jnp.float32
            )
            d_probs = jnp.einsum("bqngk,bsnk->bngqs", dob, vb, preferred_element_type=jnp.float32)
            d_scores = probs * (d_probs - delta_b[..., None])
            if capped is not None:
                d_scores = d_scores * (1.0 - capped * capped)
            d_scores = (d_scores * mask.scale).astype(q.dtype)
            d_q_b = jnp.einsum("bngqs,bsnk->bqngk", d_scores, kb, preferred_element_type=jnp.float32)
            d_q = jax.lax.dynamic_update_slice_in_dim(
                d_q, jax.lax.dynamic_slice_in_dim(d_q, i * bq, bq, 1) + d_q_b, i * bq, 1
            )
            d_k = d_k + jnp.einsum("bngqs,bqngk->bsnk", d_scores, qb, preferred_element_type=jnp.float32)
            return d_k, d_v, d_q

        lo, hi = _query_blocks(mask, j, q_start, k_start, window, nq)
        zeros_k = jnp.zeros((b, bk, n, d), jnp.float32)
        zeros_v = jnp.zeros((b, bk, n, v.shape[-1]), jnp.float32)
        d_k, d_v, d_q = jax.lax.fori_loop(lo, hi, one_query_block, (zeros_k, zeros_v, d_q))
        return d_q, (d_k.astype(k.dtype), d_v.astype(v.dtype))

    d_q, (d_k, d_v) = jax.lax.scan(one_key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(nk))
    d_k = d_k.transpose(1, 0, 2, 3, 4).reshape(k.shape)
    d_v = d_v.transpose(1, 0, 2, 3, 4).reshape(v.shape)
    d_sinks = None
    if sinks is not None:  # a sink is a key whose value is 0: dS = P_sink * (0 - delta)
        sink_probs = jnp.where(jnp.isfinite(lse), jnp.exp(sinks[None, :, :, None] - lse), 0.0)
        d_sinks = -(sink_probs * delta)[..., : mask.q_len].sum((0, 3))
    return d_q.astype(q.dtype), d_k, d_v, d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked(
    mask: _Mask,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array | None,
    segments: tuple[jax.Array, jax.Array] | None,
    positions: tuple[jax.Array, jax.Array],
    window: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    return _blocked_forward(mask, q, k, v, sinks, segments, positions, window)


def _blocked_fwd(
    mask: _Mask,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array | None,
    segments: tuple[jax.Array, jax.Array] | None,
    positions: tuple[jax.Array, jax.Array],
    window: jax.Array,
) -> tuple[tuple[jax.Array, jax.Array], tuple[Any, ...]]:
    out, lse = _blocked_forward(mask, q, k, v, sinks, segments, positions, window)
    return (out, lse), (q, k, v, sinks, segments, positions, window, out, lse)


def _blocked_bwd(mask: _Mask, saved: tuple[Any, ...], cotangents: tuple[jax.Array, jax.Array]) -> tuple[Any, ...]:
    q, k, v, sinks, segments, positions, window, out, lse = saved
    d_out, d_lse = cotangents
    d_q, d_k, d_v, d_sinks = _blocked_backward(
        mask, q, k, v, sinks, segments, positions, window, out, lse, d_out, d_lse
    )
    return d_q, d_k, d_v, d_sinks, no_cotangent(segments), no_cotangent(positions), no_cotangent(window)


def no_cotangent(operands: Any) -> Any:
    """The cotangents of integer operands (positions, windows, segments) for a ``custom_vjp``'s
    backward: float0 zeros of each leaf's shape (None stays None)."""
    return jax.tree.map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), operands)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def _materialized(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool,
    window: jax.Array | None,
    softcap: float | None,
    scale: float,
    sinks: jax.Array | None,
    segments: jax.Array | None,
    kv_segments: jax.Array | None,
    q_start: jax.Array,
    k_start: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The whole ``(T x S)`` score matrix per head: the same masks and float32 softmax."""
    b, t, h, d = q.shape
    s, n = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, n, h // n, d)
    scores = jnp.einsum("bqngk,bsnk->bngqs", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    q_pos, k_pos = q_start + jnp.arange(t), k_start + jnp.arange(s)
    seen = jnp.ones((t, s), bool)
    if causal:
        seen = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
    seen = seen[None, None, None]
    if segments is not None:
        keys = segments if kv_segments is None else kv_segments
        seen = seen & (segments[:, None, None, :, None] == keys[:, None, None, None, :])
    scores = jnp.where(seen, scores, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, n, h // n, 1, 1), (*scores.shape[:-1], 1))
        scores = jnp.concatenate([scores, sink], -1)
    top = jnp.max(scores, -1, keepdims=True)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    weights = jnp.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    lse = jnp.where(total[..., 0] > 0, jnp.log(jnp.where(total > 0, total, 1.0))[..., 0] + top[..., 0], -jnp.inf)
    weights = weights / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bngqs,bsnk->bqngk", weights[..., :s].astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype), lse.reshape(b, h, t).transpose(0, 2, 1)
