"""Grouped-KV causal attention (Llama, Qwen, Mistral, Gemma, gpt-oss): one fused QKV projection,
windows, soft caps, sinks, packed documents, a KV cache; and the explicit and blocked forms it
runs by config, mask and backend.

Shapes: B batch, T sequence, H query heads, N kv heads, G = H / N, K head dim, D embed.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from shardkit.models.gpt import GPTConfig
  >>> Attention(GPTConfig.preset("tiny"), nnx.Rngs(0))(jnp.ones((1, 4, 64))).shape
  (1, 4, 64)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardkit.core.partition import constrain, current_rules
from shardkit.models.layers.adapters import adapters, low_rank
from shardkit.models.layers.matmul import gathered_along_seq, token_matmul, unsplit
from shardkit.models.layers.norms import RMSNorm, param
from shardkit.models.layers.rotary import layer_rotary
from shardkit.models.segments import current_segments, positions_in_rows, same_document
from shardkit.parallel.attention import BLOCKED_FROM, attention
from shardkit.parallel.ring_attention import ring_attention

if TYPE_CHECKING:
    from shardkit.models.gpt import GPTConfig


def causal_attention_in_blocks(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    attend: Callable[[jax.Array, jax.Array, jax.Array, int], jax.Array] | None = None,
    block: int = 128,
) -> jax.Array:
    """Causal attention a block of queries at a time, each block against the keys up to its
    end: the scores above the diagonal's blocks are never formed.

    A prompt's first pass (no gradient). On XLA:CPU one layer of the mini GPT over 1,024 tokens
    took 31.7 ms whole and 5.9 ms in blocks of 128 (half the scores, and each block's fit in the
    processor's caches). Blocks grow past 128 so that no prompt takes more than 16 of them.

    Args:
      q: ``(B, T, H, K)``; k, v: ``(B, T, N, K)``, ``H`` a multiple of ``N``.
      attend: ``(queries (B, Tq, H, K), keys and values (B, S, N, K), first query's position)
        -> (B, Tq, H, K)``, the causal attention of one block (None:
        ``jax.nn.dot_product_attention`` with the causal mask).
      block: queries per block at least (the whole ``T`` when it is no longer).

    Returns:
      ``(B, T, H, K)``.

    Example:
      >>> q, kv = jnp.ones((1, 300, 4, 8)), jnp.ones((1, 300, 2, 8))
      >>> causal_attention_in_blocks(q, kv, kv).shape
      (1, 300, 4, 8)
    """
    attend = attend or _masked_dot_product_attention
    t = q.shape[1]
    block = max(block, -(-t // 16))
    starts = range(0, t, block)
    return jnp.concatenate([attend(q[:, s : s + block], k[:, : s + block], v[:, : s + block], s) for s in starts], 1)


def _masked_dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: int) -> jax.Array:
    """``jax.nn.dot_product_attention`` of queries at positions ``start ..`` against keys ``0 ..``."""
    if start == 0 and q.shape[1] == k.shape[1]:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    visible = np.arange(k.shape[1])[None, :] <= np.arange(start, start + q.shape[1])[:, None]  # (queries, keys)
    return jax.nn.dot_product_attention(q, k, v, mask=visible[None, None])


def explicit_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cfg: GPTConfig,
    sliding: bool | jax.Array,
    cached: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    documents: jax.Array | None = None,
    query_start: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-KV attention written out, for what ``jax.nn.dot_product_attention`` lacks:
    a query scale of the config's, soft-capped scores, a sliding window whose use may be a
    traced per-layer flag, and the keys of earlier tokens in a KV cache.

    Args:
      q: ``(B, T, H, K)``; query head ``h`` reads kv head ``h // (H / N)``.
      k, v: ``(B, S, N, K)``, the keys and values of positions ``0 .. S - 1``, ``S = query_start
        + T`` (the same tokens' when ``query_start`` is 0: each sees itself and those before).
      cfg: the scale, soft cap and window.
      sliding: whether this layer's window applies (a bool, or a traced scalar).
      cached: ``(keys, values, positions)`` of a KV cache (:mod:`shardkit.models.kv_cache`):
        ``(B, N, C, K)`` slots of each row's earlier tokens (slot ``j``: position ``j``), and the
        ``(B, T)`` positions of the T tokens, consecutive in a row. A token sees the slots before
        its row's first new position. The cache is read, not written: the caller writes the new
        tokens' slots once, after every layer (no copy of the cache per token).
      documents: ``(B, T)`` segments of packed rows (:mod:`shardkit.models.segments`): a token
        sees the tokens of its own document only.
      query_start: the first query's position (a block of a prompt's queries,
        :func:`causal_attention_in_blocks`); 0 with ``cached`` or ``documents``.
      sinks: ``(H,)`` logits that join each query's softmax with no value (gpt-oss), or None.

    Returns:
      ``(B, T, H, K)``; softmax in float32, as Hugging Face's eager attention computes it.
    """
    b, t, h, d = q.shape
    n, span = k.shape[2], k.shape[1]
    qg = q.reshape(b, t, n, h // n, d)  # (B, T, N, G, K)
    if cached is not None and t == 1:
        keys, values, positions = cached
        token = one_token_attention(qg[:, 0], k[:, 0], v[:, 0], keys, values, positions[:, 0], cfg, sliding, sinks)
        return token[:, None]
    queries, offsets = np.arange(query_start, query_start + t), np.arange(span)
    own = _allowed(_scores(qg, k, cfg), queries[:, None], offsets, cfg, sliding, span)  # (B, N, G, T, S)
    if documents is not None:
        own = jnp.where(same_document(documents, documents)[:, None, None], own, jnp.finfo(jnp.float32).min)
    if cached is None:
        weights = _softmax_with_sinks(own, sinks, n).astype(v.dtype)
        return jnp.einsum("bngts,bsnk->btngk", weights, v).reshape(b, t, h, v.shape[-1])
    keys, values, positions = cached
    c = keys.shape[2]
    query_pos = positions[:, None, None, :, None]  # (B, 1, 1, T, 1)
    slots = np.arange(c)
    visible = slots < query_pos[..., :1, :]  # the slots before the row's first new token
    earlier = _allowed(
        _scores(qg, keys, cfg, "bnsk"), query_pos, slots, cfg, sliding, c + t, visible
    )  # (B, N, G, T, C)
    scores = jnp.concatenate([earlier, own], axis=-1)  # (B, N, G, T, C+T)
    weights = _softmax_with_sinks(scores, sinks, n).astype(v.dtype)
    out = jnp.einsum("bngts,bnsk->btngk", weights[..., :c], values)
    out = out + jnp.einsum("bngts,bsnk->btngk", weights[..., c:], v)
    return out.reshape(b, t, h, v.shape[-1])


def one_token_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    position: jax.Array,
    cfg: GPTConfig,
    sliding: bool | jax.Array,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """:func:`explicit_attention` of one new token per row against a KV cache (a decode step).

    The same scores, masks and float32 softmax, written without the new tokens' axis: with it,
    XLA:CPU transposed each layer's scores and values around its matmuls (a decode step at 1,088
    cached positions of the ``mini`` GPT took 0.37 ms, 0.29 ms without).

    Args:
      q: ``(B, N, G, K)``, the token's queries grouped by kv head.
      k, v: ``(B, N, K)``, its own key and value (it sees itself).
      keys, values: ``(B, N, C, K)``, the cache; slot ``j`` holds position ``j``.
      position: ``(B,)`` int32, the token's position: it sees the slots before it.
      cfg: the scale, soft cap and window.
      sliding: whether this layer's window applies (a bool, or a traced scalar).
      sinks: ``(H,)`` sink logits (gpt-oss), or None.

    Returns:
      ``(B, H, K)`` with ``H = N * G``, in ``v``'s dtype.

    Example:
      >>> from shardkit.models.gpt import GPTConfig
      >>> cfg = GPTConfig.preset("tiny")
      >>> q, kv, cache = jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 4)), jnp.zeros((1, 2, 8, 4))
      >>> one_token_attention(q, kv, kv, cache, cache, jnp.array([0]), cfg, False).shape
      (1, 4, 4)
    """
    b, n, g, d = q.shape
    c = keys.shape[2]
    own = _scaled(jnp.einsum("bngk,bnk->bng", q, k), cfg, d)[..., None]  # (B, N, G, 1)
    query_pos, slots = position[:, None, None, None], np.arange(c)  # (B, 1, 1, 1), (C,)
    earlier = _scaled(jnp.einsum("bngk,bnsk->bngs", q, keys), cfg, d)  # (B, N, G, C)
    earlier = _allowed(earlier, query_pos, slots, cfg, sliding, c + 1, slots < query_pos)
    weights = _softmax_with_sinks(jnp.concatenate([earlier, own], axis=-1), sinks, n).astype(v.dtype)  # (B, N, G, C+1)
    out = jnp.einsum("bngs,bnsk->bngk", weights[..., :c], values) + weights[..., c:] * v[:, :, None]
    return out.reshape(b, n * g, v.shape[-1])


def _softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None, n: int) -> jax.Array:
    """The softmax of ``scores (B, N, G, ..., S)`` over keys, with each head's sink logit (head
    ``n * G + g``) in its denominator when ``sinks (H,)`` is given: weights summing to less than 1."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    g = scores.shape[2]
    extra = scores.ndim - 3
    sink = sinks.astype(jnp.float32).reshape(1, n, g, *(1,) * extra)
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def _scores(qg: jax.Array, k: jax.Array, cfg: GPTConfig, keys: str = "bsnk") -> jax.Array:
    """Scaled, soft-capped scores ``(B, N, G, T, S)`` in float32 of grouped queries against keys
    laid out as ``keys`` says (``bsnk``: tokens' keys; ``bnsk``: a cache's)."""
    return _scaled(jnp.einsum(f"btngk,{keys}->bngts", qg, k), cfg, qg.shape[-1])


def _scaled(scores: jax.Array, cfg: GPTConfig, head_dim: int) -> jax.Array:
    """Raw query-key products in float32, scaled by the config's query scale (or ``head_dim``'s
    inverse square root) and soft-capped where the config caps them."""
    scale = cfg.query_scale if cfg.query_scale is not None else head_dim**-0.5
    scores = scores.astype(jnp.float32) * scale
    if cfg.attn_softcap is not None:
        scores = cfg.attn_softcap * jnp.tanh(scores / cfg.attn_softcap)
    return scores


def _allowed(
    scores: jax.Array,
    query_pos: Any,
    key_pos: Any,
    cfg: GPTConfig,
    sliding: bool | jax.Array,
    span: int,
    visible: Any = True,
) -> jax.Array:
    """``scores`` with the keys a query may not see set to the float32 minimum: later keys, keys
    past the sliding window, and those not ``visible``. Positions broadcast: query rows
    ``(..., T, 1)`` against keys ``(S,)``; ``span``: how many positions the keys cover (a window
    at least as long changes nothing)."""
    allowed: Any = (key_pos <= query_pos) & visible
    if cfg.sliding_window is not None and cfg.sliding_window < span and sliding is not False:
        in_window = allowed & (key_pos > query_pos - cfg.sliding_window)
        allowed = in_window if sliding is True else jnp.where(sliding, in_window, allowed)
    return jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)


class Attention(nnx.Module):
    """Grouped-KV causal attention with one fused QKV projection.

    ``wqkv`` is (D, N, G + 2, K): for each kv head, its G query heads, its key and its value.
    One weight means one matmul, so under tensor parallelism the backward pass all-reduces
    the input gradient once (Megatron's count), not once per projection; sharding the kv-head
    dimension keeps whole groups on one device.
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, n, k, p = cfg.dim, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        self.groups = cfg.n_heads // cfg.n_kv_heads
        qkv_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2, 3))
        self.wqkv = param(rngs, qkv_init, (d, n, self.groups + 2, k), ("embed", "kv_heads", None, "kv"), p)
        if cfg.qkv_bias:
            self.bqkv = param(rngs, nnx.initializers.zeros, (n, self.groups + 2, k), ("kv_heads", None, "kv"), p)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(k, cfg.norm_eps, p, rngs, cfg.norm_offset, axis="kv")
            self.k_norm = RMSNorm(k, cfg.norm_eps, p, rngs, cfg.norm_offset, axis="kv")
        self.wo = param(
            rngs,
            nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=2),
            (cfg.n_heads, k, d),
            ("heads", "kv", "embed"),
            p,
        )
        if cfg.attn_out_bias:
            self.bo = param(rngs, nnx.initializers.zeros, (d,), ("embed",), p)
        if cfg.attn_sinks:
            self.sinks = param(rngs, nnx.initializers.zeros, (cfg.n_heads,), ("heads",), p)
        embed = ((d,), ("embed",))
        adapters(self, cfg, rngs, "q_proj", embed, ((n, self.groups, k), ("kv_heads", None, "kv")))
        adapters(self, cfg, rngs, "k_proj", embed, ((n, k), ("kv_heads", "kv")))
        adapters(self, cfg, rngs, "v_proj", embed, ((n, k), ("kv_heads", "kv")))
        adapters(self, cfg, rngs, "o_proj", ((cfg.n_heads, k), ("heads", "kv")), embed)
        self.cfg = cfg

    def blocked(self, t: int) -> bool:
        """Whether this config's attention over ``t`` tokens runs the blocked kernel
        (:mod:`shardkit.parallel.attention`) rather than the whole score matrix: as
        ``cfg.attention`` says; by default from :data:`BLOCKED_FROM` tokens off GPUs (on GPUs,
        wherever cuDNN does not serve the mask: see :meth:`attend`)."""
        if self.cfg.attention is not None:
            return self.cfg.attention == "blocked"
        on_gpu = jax.default_backend() == "gpu"
        return (on_gpu and (self.explicit(t) or current_segments() is not None)) or (not on_gpu and t >= BLOCKED_FROM)

    def window(self, sliding: bool | jax.Array, t: int) -> int | jax.Array | None:
        """This layer's window over ``t`` tokens for :func:`attention` (None: none; traced where
        ``sliding`` is: ``t`` keys, which hide nothing, when the layer is not sliding)."""
        w = self.cfg.sliding_window
        if w is None or w >= t or sliding is False:
            return None
        return w if sliding is True else jnp.where(sliding, w, t)

    def masks(self, sliding: bool | jax.Array, t: int, documents: jax.Array | None) -> dict[str, Any]:
        """This config's masks over ``t`` tokens as :func:`attention` and ring attention take
        them: the window, soft cap, scale and packed documents."""
        cfg = self.cfg
        masks = dict(
            window=self.window(sliding, t), softcap=cfg.attn_softcap, scale=cfg.query_scale, segments=documents
        )
        return {**masks, "sinks": self.sink_logits()} if cfg.attn_sinks else masks

    def sink_logits(self) -> jax.Array | None:
        """The ``(H,)`` sink logits in float32 (gpt-oss), or None."""
        return self.sinks[...].astype(jnp.float32) if self.cfg.attn_sinks else None

    def blocked_attention(
        self, q: jax.Array, k: jax.Array, v: jax.Array, sliding: bool | jax.Array, documents: jax.Array | None
    ) -> jax.Array:
        """The blocked kernel with this config's masks: ``(B, T, H, K)``."""
        return attention(q, k, v, implementation="blocked", **self.masks(sliding, q.shape[1], documents))

    def explicit(self, t: int) -> bool:
        """Whether this config needs :func:`explicit_attention` at sequence length ``t``."""
        cfg = self.cfg
        window = cfg.sliding_window is not None and cfg.sliding_window < t and any(cfg.sliding_layers)
        return window or cfg.attn_softcap is not None or cfg.query_scale is not None or cfg.attn_sinks

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(B, T, D)`` -> queries ``(B, T, H, K)``, keys and values ``(B, T, N, K)``, with the
        q/k norms applied and before the rotary embedding."""
        b, t, _ = x.shape
        g = self.groups
        with jax.named_scope("qkv_proj"):
            x = gathered_along_seq(x)
            w = self.wqkv[...].astype(x.dtype)
            flat = unsplit("seq", "kv_heads", "kv")
            qkv = token_matmul(x, w, 1) if flat else jnp.einsum("btd,dngk->btngk", x, w)  # (B, T, N, G+2, K)
            if self.cfg.qkv_bias:
                qkv = qkv + self.bqkv[...].astype(x.dtype)
            qkv = constrain(qkv, ("batch", "seq", "kv_heads", None, "kv"))  # heads split, not the sequence
        q, k, v = qkv[:, :, :, :g, :], qkv[:, :, :, g, :], qkv[:, :, :, g + 1, :]  # (B, T, N, G, K), (B, T, N, K)
        if self.cfg.lora is not None:  # adapters added before the norms, as on Hugging Face's projections
            deltas = [low_rank(self, self.cfg, short, x, "btd,dr->btr") for short in "qkv"]
            q, k, v = (y if delta is None else y + delta for y, delta in zip((q, k, v), deltas, strict=True))
        q = q.reshape(b, t, -1, qkv.shape[-1])  # (B, T, H, K), head h -> kv head h // G
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def output(self, out: jax.Array) -> jax.Array:
        """The attention's ``(B, T, H, K)`` result projected back to ``(B, T, D)``."""
        out = constrain(out, ("batch", "seq", "heads", "kv"))
        with jax.named_scope("out_proj"):
            w = self.wo[...].astype(out.dtype)
            flat = unsplit("seq", "heads", "kv")
            y = token_matmul(out, w, 2) if flat else jnp.einsum("bthk,hkd->btd", out, w)  # (B, T, D)
            if self.cfg.attn_out_bias:
                y = y + self.bo[...].astype(y.dtype)
            delta = low_rank(self, self.cfg, "o", out, "bthk,hkr->btr")
            return y if delta is None else y + delta

    def decode(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: tuple[jax.Array, jax.Array],
        sliding: bool | jax.Array,
        fresh: bool = False,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of new tokens against a KV cache (:mod:`shardkit.models.kv_cache`).

        Args:
          x: ``(B, S, D)``, the new tokens' normed activations.
          positions: ``(B, S)`` int32, their positions (consecutive within a row).
          cache: keys and values ``(B, N, C, K)`` each of the earlier tokens; slot ``j`` of a row
            is its position ``j``.
          sliding: whether this layer keeps to the sliding window.
          fresh: the cache is empty and every row starts at position 0 (a prompt's first pass):
            the new tokens attend to each other only, the cache's slots are not scored.

        Returns:
          ``((B, S, D), (keys, values))``: the output and the new tokens' keys and values
          ``(B, S, N, K)``, for the caller to write into the cache.
        """
        q, k, v = self.project(x)
        q = layer_rotary(q, self.cfg, sliding, positions)  # (B, S, H, K)
        k = layer_rotary(k, self.cfg, sliding, positions)  # (B, S, N, K)
        out = self.attend_cached(q, k, v, None if fresh else (*cache, positions), sliding)
        return self.output(out), (k, v)  # out: (B, S, H, K)

    def attend_cached(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        cached: tuple[jax.Array, jax.Array, jax.Array] | None,
        sliding: bool | jax.Array,
    ) -> jax.Array:
        """New tokens' queries ``(B, S, H, K)`` against their own keys and values ``(B, S, N, K)``
        and ``cached`` ``(keys (B, N, C, K), values, positions (B, S))``; None: a prompt's first
        pass, every row from position 0, the cache not read."""
        with jax.named_scope("attention"):
            if cached is None and self.blocked(q.shape[1]):  # a long prompt: linear memory, hidden blocks skipped
                return self.blocked_attention(q, k, v, sliding, None)
            if cached is None and not self.explicit(q.shape[1]):  # the training path's attention: rows start at 0
                return causal_attention_in_blocks(q, k, v)
            if cached is None:

                def attend(qb: jax.Array, kb: jax.Array, vb: jax.Array, start: int) -> jax.Array:
                    return explicit_attention(
                        qb, kb, vb, self.cfg, sliding, query_start=start, sinks=self.sink_logits()
                    )

                return causal_attention_in_blocks(q, k, v, attend)
            return explicit_attention(q, k, v, self.cfg, sliding, cached, sinks=self.sink_logits())

    def __call__(self, x: jax.Array, sliding: bool | jax.Array = False) -> jax.Array:
        q, k, v = self.project(x)
        documents = current_segments()  # packed rows: attention within a document, positions from its start
        positions = None if documents is None else positions_in_rows(documents)
        q = constrain(layer_rotary(q, self.cfg, sliding, positions), ("batch", "seq", "heads", "kv"))
        k = constrain(layer_rotary(k, self.cfg, sliding, positions), ("batch", "seq", "kv_heads", "kv"))
        with jax.named_scope("attention"):
            out = self.attend(q, k, v, sliding, documents)  # (B, T, H, K)
        return self.output(out)

    def attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, sliding: bool | jax.Array, documents: jax.Array | None
    ) -> jax.Array:
        """Training attention of queries ``(B, T, H, K)`` against keys and values ``(B, T, N, K)``
        by the path that serves this config, mask and backend (see ``GPTConfig.attention``)."""
        cfg, t = self.cfg, q.shape[1]
        context = current_rules()
        if context is not None and dict(context[0].shape).get("sequence", 1) > 1:
            # The sequence split over devices, each step the blocked kernel.
            return ring_attention(q, k, v, *context, **self.masks(sliding, t, documents))
        if self.blocked(t):
            return self.blocked_attention(q, k, v, sliding, documents)
        if self.explicit(t):
            return explicit_attention(q, k, v, cfg, sliding, documents=documents, sinks=self.sink_logits())
        if documents is not None:
            mask = same_document(documents, documents)[:, None]  # (B, 1, T, T), causal on top
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
        if cfg.attention is None and jax.default_backend() == "gpu":
            fused = _cudnn_attention(q, k, v)  # an array: tested against None, never for truth
            return fused if fused is not None else self.blocked_attention(q, k, v, sliding, None)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            implementation=cfg.attention,  # type: ignore[arg-type]  # checked in GPTConfig
        )


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array | None:
    """cuDNN's fused causal attention, or None where it does not serve these shapes, this dtype
    (it takes 16-bit floats) or this GPU."""
    try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    except (ValueError, NotImplementedError, RuntimeError, TypeError):
        return None
