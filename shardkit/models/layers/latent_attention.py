"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values from one compressed
latent per token, rotary position in a few decoupled dimensions shared by every head.

Per token: ``c = norm(x W_kv_a[:, :R])`` (the latent, ``R = kv_rank``) and one rotary key
``k_r = rope(x W_kv_a[:, R:])`` of ``rope_dim``; each head's key is ``[c W_kv_b^k, k_r]`` and its
value ``c W_kv_b^v``. Queries go through their own low-rank bottleneck ``norm(x W_q_a) W_q_b``
(or ``x W_q`` where ``q_rank`` is 0) and split the same way into ``nope_dim`` + ``rope_dim``.

A KV cache keeps ``c`` and ``k_r``, ``R + rope_dim`` numbers a token and layer (DeepSeek-V3:
576, where grouped attention of its 128 heads would keep 2 x 128 x 192); a decode step expands
the cached latents to keys and values of every head.

Under tensor parallelism the heads split (``W_q_b``, ``W_kv_b``, ``W_o`` over ``heads``) and the
down-projections to the latents stay whole, so every device computes the same latents once.

Shapes: B batch, T tokens, D embed, H heads, R kv_rank, Q q_rank, C cache slots.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from shardkit.models.gpt import GPTConfig
  >>> latent = LatentConfig(kv_rank=16, q_rank=24, rope_dim=8, nope_dim=16, v_dim=16)
  >>> cfg = GPTConfig(dim=64, n_heads=4, n_kv_heads=4, latent=latent)
  >>> LatentAttention(cfg, nnx.Rngs(0))(jnp.ones((1, 5, 64))).shape
  (1, 5, 64)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.core.errors import ModelError
from shardkit.core.partition import constrain
from shardkit.models.layers.adapters import adapters
from shardkit.models.layers.attention import Attention
from shardkit.models.layers.matmul import gathered_along_seq
from shardkit.models.layers.norms import RMSNorm, param
from shardkit.models.layers.rotary import rotary
from shardkit.models.segments import current_segments, positions_in_rows

if TYPE_CHECKING:
    from shardkit.models.gpt import GPTConfig


@dataclasses.dataclass(frozen=True)
class LatentConfig:
    """The sizes of multi-head latent attention (Hugging Face's names in brackets).

    Attributes:
      kv_rank: the keys' and values' latent per token (``kv_lora_rank``).
      q_rank: the queries' bottleneck (``q_lora_rank``); 0: queries projected directly.
      rope_dim: each head's rotary dimensions, the rotary key shared by all heads (``qk_rope_head_dim``).
      nope_dim: each head's key and query dimensions without position (``qk_nope_head_dim``).
      v_dim: each head's value size (``v_head_dim``).
      interleaved: the rotary dimensions rotate in adjacent pairs (``rope_interleave``), not halves.
    """

    kv_rank: int
    q_rank: int = 0
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128
    interleaved: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_rank", "rope_dim", "nope_dim", "v_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"LatentConfig: {name}={value!r} must be a positive integer.")
        if not isinstance(self.q_rank, int) or self.q_rank < 0:
            raise ModelError(f"LatentConfig: q_rank={self.q_rank!r} must be 0 (direct queries) or a positive integer.")
        if self.rope_dim % 2:
            raise ModelError(f"LatentConfig: rope_dim={self.rope_dim} must be even (rotary pairs).")

    @property
    def qk_dim(self) -> int:
        """Each head's query and key size: ``nope_dim + rope_dim``."""
        return self.nope_dim + self.rope_dim

    @property
    def cached_per_token(self) -> int:
        """Numbers a KV cache keeps per token and layer: ``kv_rank + rope_dim``."""
        return self.kv_rank + self.rope_dim

    def num_params(self, dim: int, heads: int) -> int:
        """This attention's parameter count (norms included)."""
        direct = dim * heads * self.qk_dim
        q = direct if not self.q_rank else dim * self.q_rank + self.q_rank + self.q_rank * heads * self.qk_dim
        kv = dim * (self.kv_rank + self.rope_dim) + self.kv_rank + self.kv_rank * heads * (self.nope_dim + self.v_dim)
        return q + kv + heads * self.v_dim * dim


class LatentAttention(Attention):
    """Multi-head latent attention with the grouped attention's masks, kernels and cache
    handling (:class:`~shardkit.models.layers.attention.Attention`): queries, keys and values
    come from latents; keys and values have one head per query head."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        lat = cfg.latent
        assert lat is not None
        d, h, p = cfg.dim, cfg.n_heads, cfg.param_dtype
        init = nnx.initializers.lecun_normal
        if lat.q_rank:
            self.wq_a = param(rngs, init(), (d, lat.q_rank), ("embed", None), p)
            self.q_norm = RMSNorm(lat.q_rank, cfg.norm_eps, p, rngs, axis=None)
            q_b_shape = (lat.q_rank, h, lat.qk_dim)
            # The latent rank is stored split over fsdp as the hidden size is ("embed": gathered
            # for the matmul, ZeRO-3); whole on every device, DeepSeek-V3's two up-projections
            # held 3x the rest of a device's parameters under fsdp=256.
            self.wq_b = param(rngs, init(in_axis=0, out_axis=(1, 2)), q_b_shape, ("embed", "heads", "kv"), p)
        else:
            self.wq = param(rngs, init(in_axis=0, out_axis=(1, 2)), (d, h, lat.qk_dim), ("embed", "heads", "kv"), p)
        self.wkv_a = param(rngs, init(), (d, lat.kv_rank + lat.rope_dim), ("embed", None), p)
        self.kv_norm = RMSNorm(lat.kv_rank, cfg.norm_eps, p, rngs, axis=None)
        kv_b_shape = (lat.kv_rank, h, lat.nope_dim + lat.v_dim)
        self.wkv_b = param(rngs, init(in_axis=0, out_axis=(1, 2)), kv_b_shape, ("embed", "heads", "kv"), p)
        self.wo = param(rngs, init(in_axis=(0, 1), out_axis=2), (h, lat.v_dim, d), ("heads", "kv", "embed"), p)
        adapters(self, cfg, rngs, "o_proj", ((h, lat.v_dim), ("heads", "kv")), ((d,), ("embed",)))
        self.groups = 1
        self.cfg = cfg

    def explicit(self, t: int) -> bool:
        """Always written out off the blocked kernel: values are narrower than keys, which
        ``jax.nn.dot_product_attention`` does not take."""
        return True

    def latents(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(B, T, D)`` -> queries ``(B, T, H, nope + rope)`` before the rotary embedding, the
        normed latents ``(B, T, R)`` and the rotary keys ``(B, T, 1, rope)`` before it."""
        lat = self.cfg.latent
        assert lat is not None
        with jax.named_scope("latents"):
            x = gathered_along_seq(x)
            dt = x.dtype
            if lat.q_rank:
                q = jnp.einsum("btq,qhk->bthk", self.q_norm(x @ self.wq_a[...].astype(dt)), self.wq_b[...].astype(dt))
            else:
                q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dt))
            kv = x @ self.wkv_a[...].astype(dt)  # (B, T, R + rope), whole on every device
        return q, self.kv_norm(kv[..., : lat.kv_rank]), kv[..., None, lat.kv_rank :]

    def rope(self, x: jax.Array, positions: jax.Array | None) -> jax.Array:
        """The rotary embedding of ``(B, T, n, rope)``; interleaved pairs are gathered into halves
        first (the same rotation of each pair, laid out as Hugging Face's interleaved form leaves it)."""
        lat, cfg = self.cfg.latent, self.cfg
        assert lat is not None
        if lat.interleaved:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rotary(x, cfg.rope_theta, cfg.rope_scaling, positions)

    def queries(self, q: jax.Array, positions: jax.Array | None) -> jax.Array:
        """Queries with their rotary dimensions embedded: ``(B, T, H, nope + rope)``."""
        lat = self.cfg.latent
        assert lat is not None
        return jnp.concatenate([q[..., : lat.nope_dim], self.rope(q[..., lat.nope_dim :], positions)], axis=-1)

    def expand(self, latents: jax.Array, rotary_keys: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Latents ``(B, S, R)`` and rotated keys ``(B, S, 1, rope)`` -> every head's keys
        ``(B, S, H, nope + rope)`` and values ``(B, S, H, v)``."""
        lat = self.cfg.latent
        assert lat is not None
        kv = jnp.einsum("bsr,rhk->bshk", latents, self.wkv_b[...].astype(latents.dtype))
        k_nope, v = kv[..., : lat.nope_dim], kv[..., lat.nope_dim :]
        shared = jnp.broadcast_to(rotary_keys.astype(k_nope.dtype), (*k_nope.shape[:3], lat.rope_dim))
        return jnp.concatenate([k_nope, shared], axis=-1), v

    def __call__(self, x: jax.Array, sliding: bool | jax.Array = False) -> jax.Array:
        q, latents, rotary_keys = self.latents(x)
        documents = current_segments()
        positions = None if documents is None else positions_in_rows(documents)
        q = constrain(self.queries(q, positions), ("batch", "seq", "heads", "kv"))
        k, v = self.expand(latents, self.rope(rotary_keys, positions))
        k, v = (constrain(a, ("batch", "seq", "heads", "kv")) for a in (k, v))
        with jax.named_scope("attention"):
            out = self.attend(q, k, v, sliding, documents)  # (B, T, H, v)
        return self.output(out)

    def decode(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: tuple[jax.Array, jax.Array],
        sliding: bool | jax.Array,
        fresh: bool = False,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of new tokens against a latent cache: ``cache`` holds latents ``(B, 1, C, R)``
        and rotated keys ``(B, 1, C, rope)``; returns the output ``(B, S, D)`` and the new tokens'
        ``(B, S, 1, R)`` and ``(B, S, 1, rope)`` for the caller to write."""
        q, latents, rotary_keys = self.latents(x)
        q, rotary_keys = self.queries(q, positions), self.rope(rotary_keys, positions)
        k, v = self.expand(latents, rotary_keys)
        cached = None
        if not fresh:
            keys, values = self.expand(cache[0][:, 0], jnp.swapaxes(cache[1], 1, 2))  # (B, C, H, .)
            cached = (jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2), positions)  # (B, H, C, .)
        out = self.attend_cached(q, k, v, cached, sliding)
        return self.output(out), (latents[:, :, None, :], rotary_keys.astype(latents.dtype))
