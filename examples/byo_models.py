"""Models written the way people outside shardkit write them: no ``sk.constrain``, Flax's own
sharding metadata (or none at all), several positional arguments, grouped-query attention; NNX
and Linen.

Nothing here imports shardkit: these are the "your model, not ours" of the tests, notebook 06
and ``benchmarks/any_model.py``; ``byo_factories.py`` wraps them for shardkit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 256
    layers: int = 2
    remat: bool = False  # recompute each layer in the backward pass (nnx.remat, nn.remat)
    # What the recomputation may keep (a jax.checkpoint_policies entry; None: nothing). With
    # dots_saveable only the matmuls' inputs that are not matmul outputs are recomputed: under
    # FSDP that is the gathered weights, gathered again in the backward pass as ZeRO-3 does.
    remat_policy: Any = None
    experts: int = 0  # > 0: each block's MLP is a top-2 mixture of this many experts (Linen)
    # How the mixture is written: "dense" (einsums, every expert on every token), "scan" (a
    # jax.lax.scan over the experts' weights) or "sorted" (the batch's pairs sorted by expert,
    # jax.lax.ragged_dot, scattered back).
    expert_style: str = "dense"


def causal_attention(q, k, v):
    """``q (B, T, N, H)``, ``k, v (B, T, K, H)`` with ``N`` a multiple of ``K`` -> ``(B, T, N, H)``."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


def rope(x, positions):
    """Rotary position embedding, half-split convention; ``x (B, T, N, H)``, ``positions (B, T)``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10_000 ** (jnp.arange(half) / half))
    angle = positions[..., None, None] * freq  # (B, T, 1, H/2)
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


# ---------------------------------------------------------------------------------------------
# NNX, Gemma-style: einsum kernels with logical names through nnx.with_partitioning.


class GemmaAttention(nnx.Module):
    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.q = nnx.Einsum(
            "BTD,DNH->BTNH",
            (cfg.dim, cfg.heads, cfg.head_dim),
            kernel_init=nnx.with_partitioning(init, ("embed", "heads", "kv")),
            rngs=rngs,
        )
        self.kv = nnx.Einsum(
            "BTD,CDKH->CBTKH",
            (2, cfg.dim, cfg.kv_heads, cfg.head_dim),
            kernel_init=nnx.with_partitioning(init, (None, "embed", "kv_heads", "kv")),
            rngs=rngs,
        )
        self.out = nnx.Einsum(
            "BTNH,NHD->BTD",
            (cfg.heads, cfg.head_dim, cfg.dim),
            kernel_init=nnx.with_partitioning(init, ("heads", "kv", "embed")),
            rngs=rngs,
        )

    def __call__(self, x, positions):
        q = rope(self.q(x), positions)
        k, v = self.kv(x)
        return self.out(causal_attention(q, rope(k, positions), v))


class GemmaMLP(nnx.Module):
    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.gate = nnx.Linear(
            cfg.dim, cfg.mlp, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
        )
        self.up = nnx.Linear(
            cfg.dim, cfg.mlp, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
        )
        self.down = nnx.Linear(
            cfg.mlp, cfg.dim, use_bias=False, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs
        )

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.gate(x)) * self.up(x))


class GemmaBlock(nnx.Module):
    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        norm = nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",))
        self.pre_attn = nnx.RMSNorm(cfg.dim, scale_init=norm, rngs=rngs)
        self.attn = GemmaAttention(cfg, rngs=rngs)
        self.pre_mlp = nnx.RMSNorm(cfg.dim, scale_init=norm, rngs=rngs)
        self.mlp = GemmaMLP(cfg, rngs=rngs)

    def __call__(self, x, positions):
        x = x + self.attn(self.pre_attn(x), positions)
        return x + self.mlp(self.pre_mlp(x))


class GemmaLM(nnx.Module):
    """A decoder LM in the shape of Flax's Gemma example: tokens ``(B, T)`` -> logits ``(B, T, V)``."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(
            cfg.vocab,
            cfg.dim,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed")),
            rngs=rngs,
        )
        self.layers = nnx.List([GemmaBlock(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.remat, self.remat_policy = cfg.remat, cfg.remat_policy
        self.final_norm = nnx.RMSNorm(
            cfg.dim, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)), rngs=rngs
        )

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens) * jnp.sqrt(self.embed.features).astype(jnp.float32)
        call = lambda layer, x: layer(x, positions)
        block = nnx.remat(call, policy=self.remat_policy) if self.remat else call
        for layer in self.layers:
            x = block(layer, x)
        return self.embed.attend(self.final_norm(x))  # tied embedding


# ---------------------------------------------------------------------------------------------
# NNX with no metadata at all: Flax's built-in layers as their docs use them.


class PlainBlock(nnx.Module):
    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=cfg.heads, in_features=cfg.dim, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, cfg.mlp, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, cfg.dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class PlainLM(nnx.Module):
    """A decoder LM of ``nnx.Embed``, ``nnx.MultiHeadAttention``, ``nnx.Linear`` and
    ``nnx.LayerNorm`` with no partitioning metadata anywhere: tokens ``(B, T)`` -> logits ``(B, T, V)``."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.blocks = nnx.List([PlainBlock(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


# ---------------------------------------------------------------------------------------------
# NNX written for mesh axes: Flax's metadata names mesh axes directly (no logical names).


class MeshAxesMLP(nnx.Module):
    """A two-layer MLP whose kernels name *mesh* axes, as ``nnx.with_partitioning`` users write."""

    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            din,
            hidden,
            kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("tensor",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(hidden, dout, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


# ---------------------------------------------------------------------------------------------
# Linen, in the style of Flax's lm1b example: nn.with_logical_partitioning, nn.Dense, GQA.


class LinenAttention(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x, positions):
        cfg = self.cfg
        init = nn.initializers.lecun_normal()
        q = nn.DenseGeneral(
            (cfg.heads, cfg.head_dim),
            use_bias=False,
            name="query",
            kernel_init=nn.with_logical_partitioning(init, ("embed", "heads", "kv")),
        )(x)
        k = nn.DenseGeneral(
            (cfg.kv_heads, cfg.head_dim),
            use_bias=False,
            name="key",
            kernel_init=nn.with_logical_partitioning(init, ("embed", "kv_heads", "kv")),
        )(x)
        v = nn.DenseGeneral(
            (cfg.kv_heads, cfg.head_dim),
            use_bias=False,
            name="value",
            kernel_init=nn.with_logical_partitioning(init, ("embed", "kv_heads", "kv")),
        )(x)
        out = causal_attention(rope(q, positions), rope(k, positions), v)
        return nn.DenseGeneral(
            cfg.dim,
            axis=(-2, -1),
            use_bias=False,
            name="out",
            kernel_init=nn.with_logical_partitioning(init, ("heads", "kv", "embed")),
        )(out)


class LinenTopTwoExperts(nn.Module):
    """A top-2 mixture of experts as small research code writes it: every expert runs every
    token, and the gates (zero outside each token's two experts) weigh the outputs."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        cfg, init = self.cfg, nn.initializers.lecun_normal()
        router = nn.Dense(cfg.experts, use_bias=False, name="router")
        probs = jax.nn.softmax(router(x), axis=-1)  # (B, T, E)
        top, index = jax.lax.top_k(probs, 2)  # (B, T, 2)
        weights = top / top.sum(-1, keepdims=True)
        gates = (jax.nn.one_hot(index, cfg.experts, dtype=x.dtype) * weights[..., None]).sum(-2)  # (B, T, E)
        shape_in, shape_out = (cfg.experts, cfg.dim, cfg.mlp), (cfg.experts, cfg.mlp, cfg.dim)
        w_in = self.param("w_in", nn.with_logical_partitioning(init, ("expert", "embed", "mlp")), shape_in)
        w_out = self.param("w_out", nn.with_logical_partitioning(init, ("expert", "mlp", "embed")), shape_out)
        if cfg.expert_style == "scan":  # one expert a step: its weights and its gates' column scanned over
            step = lambda out, w: (out + (nn.silu(x @ w[0]) @ w[1]) * w[2][..., None], None)
            return jax.lax.scan(step, jnp.zeros_like(x), (w_in, w_out, jnp.moveaxis(gates, -1, 0)))[0]
        if cfg.expert_style == "sorted":  # dropless: each (token, choice) pair's rows grouped by expert
            b, t, d = x.shape
            flat = index.reshape(-1)
            order = jnp.argsort(flat, stable=True)
            rows = x.reshape(b * t, d)[order // 2]
            sizes = jnp.bincount(flat, length=cfg.experts).astype(jnp.int32)
            out = jax.lax.ragged_dot(nn.silu(jax.lax.ragged_dot(rows, w_in, sizes)), w_out, sizes)
            back = jnp.zeros_like(out).at[order].set(out).reshape(b, t, 2, d)
            return jnp.einsum("btkd,btk->btd", back, weights)
        h = nn.silu(jnp.einsum("btd,edf->btef", x, w_in))  # (B, T, E, F)
        return jnp.einsum("bted,bte->btd", jnp.einsum("btef,efd->bted", h, w_out), gates)


class LinenBlock(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x, positions):
        scale = nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",))
        x = x + LinenAttention(self.cfg, name="attention")(nn.RMSNorm(scale_init=scale)(x), positions)
        h = nn.RMSNorm(scale_init=scale)(x)
        if self.cfg.experts:
            return x + LinenTopTwoExperts(self.cfg, name="experts")(h)
        dense = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        h = nn.silu(nn.Dense(self.cfg.mlp, use_bias=False, kernel_init=dense, name="wi")(h))
        back = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        return x + nn.Dense(self.cfg.dim, use_bias=False, kernel_init=back, name="wo")(h)


class LinenLM(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        embed = nn.Embed(
            cfg.vocab,
            cfg.dim,
            name="embed",
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
        )
        x = embed(tokens)
        block = nn.remat(LinenBlock, policy=cfg.remat_policy) if cfg.remat else LinenBlock
        for i in range(cfg.layers):
            x = block(cfg, name=f"block_{i}")(x, positions)
        x = nn.RMSNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)))(x)
        return nn.Dense(
            cfg.vocab,
            use_bias=False,
            name="lm_head",
            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "vocab")),
        )(x)


# ---------------------------------------------------------------------------------------------
# NNX written for Explicit mesh axes (sharding in types), as Flax's explicit-sharding guide
# writes it: kernels name mesh axes, the forward says where it gathers and how outputs are split.


class ExplicitFSDPMLP(nnx.Module):
    """ZeRO-3 by hand: kernels live split over ``fsdp``; each use gathers its kernel
    (``reshard``) and the einsum says its output stays split over the batch axes."""

    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (din, hidden)), out_sharding=("fsdp", "tensor"))
        self.w_out = nnx.Param(init(rngs.params(), (hidden, dout)), out_sharding=("tensor", "fsdp"))

    def __call__(self, x):
        P = jax.sharding.PartitionSpec
        batch = ("data", "fsdp")
        w_in = jax.sharding.reshard(self.w_in[...], P(None, "tensor"))
        h = jax.nn.relu(jnp.einsum("bd,df->bf", x, w_in, out_sharding=P(batch, "tensor")))
        w_out = jax.sharding.reshard(self.w_out[...], P("tensor", None))
        return jnp.einsum("bf,fd->bd", h, w_out, out_sharding=P(batch, None))
