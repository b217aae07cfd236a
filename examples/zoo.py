"""A zoo of models written the way people outside shardkit write them, each in its own style:

- ``gemma_style``: NNX, ``nnx.Einsum`` projections as Flax's Gemma example writes them, one
  stacked k/v kernel ``(2, K, D, H)``, grouped-query attention by reshaping the queries to
  ``(B, T, K, G, H)``, per-head q/k RMSNorm, ``nnx.Linear`` gate/up/down;
- ``linen_lm``: Linen, ``nn.DenseGeneral`` q/k/v kernels ``(embed, heads, kv)`` and
  ``nn.with_logical_partitioning`` (``byo_models.LinenLM``);
- ``llama_style``: NNX, ``nnx.Linear`` q/k/v/o, grouped-query attention by ``jnp.repeat``, RoPE;
- ``encoder_decoder``: NNX, an encoder and a decoder with cross-attention;
- ``vit``: NNX, a patch convolution and a transformer encoder, a classification loss;
- ``user_moe``: NNX, a decoder whose MLP is a top-2 mixture of experts with GShard's einsum
  dispatch (capacity per row);
- ``linen_moe``: Linen, the ``linen_lm`` whose MLP is a top-2 mixture of experts as small
  research code writes it: every expert runs every token, gates weigh the outputs
  (``byo_models.LinenTopTwoExperts``);
- ``sorted_moe``: NNX, dropless top-2 experts: (token, choice) pairs sorted by expert, grouped
  matmuls by ``jax.lax.ragged_dot`` (``SortedExperts``);
- ``shared_expert_moe``: NNX, DeepSeek-style sigmoid scores, routed experts reached by a one-hot
  einsum, and a shared expert every token passes through (``SharedAndRoutedExperts``);
- ``looped_moe``: NNX, top-2 experts in a Python loop over the stacked expert weights, every
  expert on every token, gates zero where not chosen (``LoopedExperts``);
- ``rolled_moe``: NNX, the same loop as ``jax.lax.fori_loop``, ``w[e]`` read at the loop's
  counter (``RolledLoopExperts``);
- ``linen_scanned_moe``: Linen, ``linen_moe``'s experts as a ``jax.lax.scan`` over the stacked
  expert weights and the gates' columns (``byo_models.LinenTopTwoExperts``, ``expert_style="scan"``);
- ``linen_sorted_moe``: Linen, ``linen_moe``'s experts dropless: the batch's pairs sorted by
  expert, ``jax.lax.ragged_dot``, scattered back (``expert_style="sorted"``);
- ``cnn_batchnorm``: NNX, residual convolutions with ``nnx.BatchNorm``.

Nothing here imports shardkit. Each :class:`ZooEntry` gives the module's constructor, a batch
of real-looking data, the loss as ``(forward, batch) -> (mean loss, count)`` and whether the
model is a language model (whose bound counts layers of ``(batch, seq, dim)`` activations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from byo_models import LinenLM, LMConfig, rope
from flax import nnx

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = 256, 64, 4, 2, 16, 256, 2


def names(*axes: str | None):
    """Flax's own sharding metadata: logical names on a Lecun-normal init."""
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)


def linear(din: int, dout: int, axes: tuple[str | None, str | None], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=False, kernel_init=names(*axes), rngs=rngs)


def scores_mask(t: int, s: int, causal: bool) -> jax.Array:
    return jnp.tril(jnp.ones((t, s), bool)) if causal else jnp.ones((t, s), bool)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """``q (B, T, N, H)``, ``k, v (B, S, N, H)`` -> ``(B, T, N, H)``."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    scores = jnp.where(scores_mask(q.shape[1], k.shape[1], causal), scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


def next_token(forward: Callable[[Any], jax.Array], batch: dict) -> tuple[jax.Array, jax.Array]:
    tokens = batch["tokens"]
    losses = optax.softmax_cross_entropy_with_integer_labels(forward(tokens[:, :-1]), tokens[:, 1:])
    return losses.mean(), jnp.asarray(losses.size, jnp.int32)


# -- Gemma-style -------------------------------------------------------------------------------


class GemmaStyleAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.q_einsum = nnx.Einsum(
            "BTD,NDH->BTNH", (HEADS, DIM, HEAD_DIM), kernel_init=names("heads", "embed", "kv"), rngs=rngs
        )
        self.kv_einsum = nnx.Einsum(
            "BSD,CKDH->CBSKH",
            (2, KV_HEADS, DIM, HEAD_DIM),
            kernel_init=names(None, "kv_heads", "embed", "kv"),
            rngs=rngs,
        )
        self.attn_vec_einsum = nnx.Einsum(
            "BTNH,NHD->BTD", (HEADS, HEAD_DIM, DIM), kernel_init=names("heads", "kv", "embed"), rngs=rngs
        )
        self.q_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs)
        self.k_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        q = rope(self.q_norm(self.q_einsum(x)), positions)
        k, v = self.kv_einsum(x)
        k = rope(self.k_norm(k), positions)
        b, t, n, h = q.shape
        groups = n // k.shape[2]
        q = q.reshape(b, t, k.shape[2], groups, h)  # grouped-query attention without repeating k/v
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k) * h**-0.5
        logits = jnp.where(scores_mask(t, t, True)[:, None, None, :], logits, jnp.finfo(logits.dtype).min)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", jax.nn.softmax(logits, axis=-1), v)
        return self.attn_vec_einsum(encoded.reshape(b, t, n, h))


class GemmaStyleMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.gate_proj = linear(DIM, MLP, ("embed", "mlp"), rngs)
        self.up_proj = linear(DIM, MLP, ("embed", "mlp"), rngs)
        self.down_proj = linear(MLP, DIM, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.gelu(self.gate_proj(x)) * self.up_proj(x))


class GemmaStyleBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.pre_attention_norm, self.pre_ffw_norm = nnx.RMSNorm(DIM, rngs=rngs), nnx.RMSNorm(DIM, rngs=rngs)
        self.attn, self.mlp = GemmaStyleAttention(rngs), GemmaStyleMLP(rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attn(self.pre_attention_norm(x), positions)
        return x + self.mlp(self.pre_ffw_norm(x))


def table(rngs: nnx.Rngs) -> nnx.Embed:
    """A token embedding split by vocabulary and model dimension."""
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
    return nnx.Embed(VOCAB, DIM, embedding_init=init, rngs=rngs)


class GemmaStyleLM(nnx.Module):
    """Tokens ``(B, T)`` -> logits ``(B, T, V)``, tied embedding."""

    def __init__(self, rngs: nnx.Rngs):
        self.embedder = table(rngs)
        self.blocks = nnx.List([GemmaStyleBlock(rngs) for _ in range(LAYERS)])
        self.final_norm = nnx.RMSNorm(DIM, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embedder(tokens) * jnp.sqrt(DIM).astype(jnp.float32)
        for block in self.blocks:
            x = block(x, positions)
        return self.embedder.attend(self.final_norm(x))


# -- Llama-style -------------------------------------------------------------------------------


class LlamaAttention(nnx.Module):
    """``nnx.Linear`` projections; ``kv_heads`` < ``heads`` repeats k/v (``jnp.repeat``)."""

    def __init__(self, rngs: nnx.Rngs, kv_heads: int = KV_HEADS, causal: bool = True, use_rope: bool = True):
        self.q_proj = linear(DIM, HEADS * HEAD_DIM, ("embed", "heads"), rngs)
        self.k_proj = linear(DIM, kv_heads * HEAD_DIM, ("embed", "kv_heads"), rngs)
        self.v_proj = linear(DIM, kv_heads * HEAD_DIM, ("embed", "kv_heads"), rngs)
        self.o_proj = linear(HEADS * HEAD_DIM, DIM, ("heads", "embed"), rngs)
        self.kv_heads, self.causal, self.use_rope = kv_heads, causal, use_rope

    def __call__(self, x: jax.Array, context: jax.Array | None = None) -> jax.Array:
        context = x if context is None else context
        b, t, s = x.shape[0], x.shape[1], context.shape[1]
        q = self.q_proj(x).reshape(b, t, HEADS, HEAD_DIM)
        k = self.k_proj(context).reshape(b, s, self.kv_heads, HEAD_DIM)
        v = self.v_proj(context).reshape(b, s, self.kv_heads, HEAD_DIM)
        if self.use_rope:
            q = rope(q, jnp.broadcast_to(jnp.arange(t), (b, t)))
            k = rope(k, jnp.broadcast_to(jnp.arange(s), (b, s)))
        k, v = (jnp.repeat(a, HEADS // self.kv_heads, axis=2) for a in (k, v))
        return self.o_proj(attend(q, k, v, self.causal).reshape(b, t, HEADS * HEAD_DIM))


class SwiGLU(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.gate = linear(DIM, MLP, ("embed", "mlp"), rngs)
        self.up = linear(DIM, MLP, ("embed", "mlp"), rngs)
        self.down = linear(MLP, DIM, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, mlp: nnx.Module | None = None):
        self.input_layernorm = nnx.RMSNorm(DIM, rngs=rngs)
        self.self_attn = LlamaAttention(rngs)
        self.post_attention_layernorm = nnx.RMSNorm(DIM, rngs=rngs)
        self.mlp = SwiGLU(rngs) if mlp is None else mlp

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStyleLM(nnx.Module):
    """Tokens ``(B, T)`` -> logits ``(B, T, V)``, untied head."""

    def __init__(self, rngs: nnx.Rngs, mlp: Callable[[nnx.Rngs], nnx.Module] | None = None):
        self.embed_tokens = table(rngs)
        self.layers = nnx.List([LlamaBlock(rngs, None if mlp is None else mlp(rngs)) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.lm_head = linear(DIM, VOCAB, ("embed", "vocab"), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# -- A mixture of experts written by a user ----------------------------------------------------


class Top2Experts(nnx.Module):
    """GShard's top-2 routing with einsum dispatch: each row sends each expert at most
    ``capacity`` tokens (``dispatch (B, T, E, C)``), the experts run as batched matmuls.
    ``gates_first`` folds the gates into the choices before the combine's einsum (two operands,
    not three), as the report's fix for its reduction over ``tensor`` says."""

    def __init__(self, rngs: nnx.Rngs, experts: int = 4, capacity_factor: float = 2.0, gates_first: bool = False):
        self.router = linear(DIM, experts, ("embed", None), rngs)
        self.w_in = nnx.Param(names("expert", "embed", "mlp")(rngs.params(), (experts, DIM, MLP)))
        self.w_out = nnx.Param(names("expert", "mlp", "embed")(rngs.params(), (experts, MLP, DIM)))
        self.experts, self.capacity_factor, self.gates_first = experts, capacity_factor, gates_first

    def __call__(self, x: jax.Array) -> jax.Array:
        e, t = self.experts, x.shape[1]
        capacity = int(np.ceil(2 * t * self.capacity_factor / e))
        probs = jax.nn.softmax(self.router(x), axis=-1)  # (B, T, E)
        gates, index = jax.lax.top_k(probs, 2)  # (B, T, 2)
        gates = gates / gates.sum(-1, keepdims=True)
        choice = jax.nn.one_hot(index, e, dtype=x.dtype)  # (B, T, 2, E)
        # A token's slot in its expert's queue: first choices of the row first, then second choices.
        queue = jnp.cumsum(choice.transpose(0, 2, 1, 3).reshape(x.shape[0], 2 * t, e), axis=1) - 1
        slot = (queue.reshape(x.shape[0], 2, t, e).transpose(0, 2, 1, 3) * choice).sum(-1)  # (B, T, 2)
        kept = choice * (slot < capacity)[..., None]
        where = jax.nn.one_hot(slot.astype(jnp.int32), capacity, dtype=x.dtype)  # (B, T, 2, C)
        dispatch = jnp.einsum("btke,btkc->btec", kept, where)
        if self.gates_first:
            combine = jnp.einsum("btke,btkc->btec", kept * gates[..., None], where)
        else:
            combine = jnp.einsum("btke,btkc,btk->btec", kept, where, gates)
        expert_in = jnp.einsum("btec,btd->becd", dispatch, x)
        hidden = jax.nn.gelu(jnp.einsum("becd,edf->becf", expert_in, self.w_in[...]))
        expert_out = jnp.einsum("becf,efd->becd", hidden, self.w_out[...])
        return jnp.einsum("btec,becd->btd", combine, expert_out)


def user_moe_lm(rngs: nnx.Rngs) -> LlamaStyleLM:
    return LlamaStyleLM(rngs, mlp=Top2Experts)


class StackedExperts(nnx.Module):
    """A router and the experts' weights stacked ``(E, D, F)`` and ``(E, F, D)``: what the
    styles below share; each computes the mixture its own way."""

    def __init__(self, rngs: nnx.Rngs, experts: int = 4, top_k: int = 2):
        self.router = linear(DIM, experts, ("embed", None), rngs)
        self.w_in = nnx.Param(names("expert", "embed", "mlp")(rngs.params(), (experts, DIM, MLP)))
        self.w_out = nnx.Param(names("expert", "mlp", "embed")(rngs.params(), (experts, MLP, DIM)))
        self.experts, self.top_k = experts, top_k


class SortedExperts(StackedExperts):
    """Dropless top-2 experts as MegaBlocks-style JAX code writes them: each (token, choice) pair
    sorted by expert, the experts run as grouped matmuls (``jax.lax.ragged_dot`` over the sorted
    rows, ``group_sizes`` tokens each), the outputs put back in token order and weighed."""

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        gates, index = jax.lax.top_k(jax.nn.softmax(self.router(x), axis=-1), self.top_k)  # (B, T, k)
        gates = gates / gates.sum(-1, keepdims=True)
        flat = index.reshape(-1)  # (B T k,) the expert of each (token, choice)
        order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
        rows = x.reshape(b * t, d)[order // self.top_k]  # (B T k, D)
        sizes = jnp.bincount(flat, length=self.experts).astype(jnp.int32)  # (E,)
        hidden = jax.nn.gelu(jax.lax.ragged_dot(rows, self.w_in[...], sizes))  # (B T k, F)
        out = jax.lax.ragged_dot(hidden, self.w_out[...], sizes)  # (B T k, D)
        unsorted = jnp.zeros_like(out).at[order].set(out).reshape(b, t, self.top_k, d)
        return jnp.einsum("btkd,btk->btd", unsorted, gates)


def sorted_moe_lm(rngs: nnx.Rngs) -> LlamaStyleLM:
    return LlamaStyleLM(rngs, mlp=SortedExperts)


class SharedAndRoutedExperts(nnx.Module):
    """DeepSeek-style: sigmoid scores, the top 2 normalised, routed experts reached by a one-hot
    einsum (every expert's buffer holds every token, zero where not routed), and a shared expert
    every token passes through."""

    def __init__(self, rngs: nnx.Rngs, experts: int = 4, top_k: int = 2):
        self.router = linear(DIM, experts, ("embed", None), rngs)
        self.w_in = nnx.Param(names("expert", "embed", "mlp")(rngs.params(), (experts, DIM, MLP // 2)))
        self.w_out = nnx.Param(names("expert", "mlp", "embed")(rngs.params(), (experts, MLP // 2, DIM)))
        self.shared = SwiGLU(rngs)
        self.experts, self.top_k = experts, top_k

    def __call__(self, x: jax.Array) -> jax.Array:
        scores = jax.nn.sigmoid(self.router(x))  # (B, T, E)
        top, index = jax.lax.top_k(scores, self.top_k)
        weights = top / top.sum(-1, keepdims=True)
        gates = jnp.einsum("btke,btk->bte", jax.nn.one_hot(index, self.experts, dtype=x.dtype), weights)
        routed = jnp.einsum("bte,btd->ebtd", (gates > 0).astype(x.dtype), x)  # (E, B, T, D)
        hidden = jax.nn.silu(jnp.einsum("ebtd,edf->ebtf", routed, self.w_in[...]))
        out = jnp.einsum("ebtf,efd->ebtd", hidden, self.w_out[...])
        return jnp.einsum("ebtd,bte->btd", out, gates) + self.shared(x)


def shared_expert_lm(rngs: nnx.Rngs) -> LlamaStyleLM:
    return LlamaStyleLM(rngs, mlp=SharedAndRoutedExperts)


class LoopedExperts(StackedExperts):
    """Top-2 experts as a first version often writes them: a Python loop over the stacked expert
    weights, each expert running every token, its output weighed by the token's gate for it (0
    where the expert was not chosen)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        top, index = jax.lax.top_k(jax.nn.softmax(self.router(x), axis=-1), self.top_k)  # (B, T, k)
        gates = (
            jax.nn.one_hot(index, self.experts, dtype=x.dtype) * (top / top.sum(-1, keepdims=True))[..., None]
        ).sum(2)
        out = jnp.zeros_like(x)
        for e in range(self.experts):
            hidden = jax.nn.gelu(x @ self.w_in[e])  # (B, T, F)
            out = out + (hidden @ self.w_out[e]) * gates[..., e : e + 1]
        return out


def looped_moe_lm(rngs: nnx.Rngs) -> LlamaStyleLM:
    return LlamaStyleLM(rngs, mlp=LoopedExperts)


class RolledLoopExperts(StackedExperts):
    """The loop above written to compile once, not once per expert: ``jax.lax.fori_loop`` over
    the experts, each step reading its expert's weights ``w[e]`` at the loop's counter."""

    def __call__(self, x: jax.Array) -> jax.Array:
        top, index = jax.lax.top_k(jax.nn.softmax(self.router(x), axis=-1), self.top_k)  # (B, T, k)
        gates = (
            jax.nn.one_hot(index, self.experts, dtype=x.dtype) * (top / top.sum(-1, keepdims=True))[..., None]
        ).sum(2)
        w_in, w_out = self.w_in[...], self.w_out[...]

        def expert(e: jax.Array, out: jax.Array) -> jax.Array:
            return out + (jax.nn.gelu(x @ w_in[e]) @ w_out[e]) * gates[..., e][..., None]

        return jax.lax.fori_loop(0, self.experts, expert, jnp.zeros_like(x))


def rolled_moe_lm(rngs: nnx.Rngs) -> LlamaStyleLM:
    return LlamaStyleLM(rngs, mlp=RolledLoopExperts)


# -- Encoder-decoder ---------------------------------------------------------------------------


class EncoderLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = LlamaAttention(rngs, kv_heads=HEADS, causal=False)
        self.mlp = SwiGLU(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecoderLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1, self.norm2, self.norm3 = (nnx.LayerNorm(DIM, rngs=rngs) for _ in range(3))
        self.self_attn = LlamaAttention(rngs, kv_heads=HEADS)
        self.cross_attn = LlamaAttention(rngs, kv_heads=HEADS, causal=False, use_rope=False)
        self.mlp = SwiGLU(rngs)

    def __call__(self, x: jax.Array, memory: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.norm1(x))
        x = x + self.cross_attn(self.norm2(x), memory)
        return x + self.mlp(self.norm3(x))


class EncoderDecoder(nnx.Module):
    """``(source (B, S), target (B, T))`` -> logits ``(B, T, V)``; one embedding for both sides."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = table(rngs)
        self.encoder = nnx.List([EncoderLayer(rngs) for _ in range(LAYERS)])
        self.decoder = nnx.List([DecoderLayer(rngs) for _ in range(LAYERS)])
        self.enc_norm, self.dec_norm = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        self.head = linear(DIM, VOCAB, ("embed", "vocab"), rngs)

    def __call__(self, inputs: tuple[jax.Array, jax.Array]) -> jax.Array:
        source, target = inputs
        memory = self.embed(source)
        for layer in self.encoder:
            memory = layer(memory)
        memory, x = self.enc_norm(memory), self.embed(target)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.head(self.dec_norm(x))


def translation(forward: Callable[[Any], jax.Array], batch: dict) -> tuple[jax.Array, jax.Array]:
    target = batch["target"]
    logits = forward((batch["source"], target[:, :-1]))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, target[:, 1:])
    return losses.mean(), jnp.asarray(losses.size, jnp.int32)


# -- ViT ---------------------------------------------------------------------------------------


class ViTBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = LlamaAttention(rngs, kv_heads=HEADS, causal=False, use_rope=False)
        self.fc1 = nnx.Linear(DIM, MLP, kernel_init=names("embed", "mlp"), rngs=rngs)
        self.fc2 = nnx.Linear(MLP, DIM, kernel_init=names("mlp", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class ViT(nnx.Module):
    """Images ``(B, 32, 32, 3)`` -> class logits ``(B, 10)``: 8x8 patches, a learned position
    embedding, mean pooling."""

    def __init__(self, rngs: nnx.Rngs, patch: int = 8, classes: int = 10):
        self.patches = nnx.Conv(
            3, DIM, (patch, patch), strides=(patch, patch), kernel_init=names(None, None, None, "embed"), rngs=rngs
        )
        self.position = nnx.Param(jax.random.normal(rngs.params(), (1, (32 // patch) ** 2, DIM)) * 0.02)
        self.blocks = nnx.List([ViTBlock(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, classes, kernel_init=names("embed", None), rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.patches(images)
        x = x.reshape(x.shape[0], -1, DIM) + self.position[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(axis=1))


def classification(forward: Callable[[Any], jax.Array], batch: dict) -> tuple[jax.Array, jax.Array]:
    losses = optax.softmax_cross_entropy_with_integer_labels(forward(batch["x"]), batch["y"])
    return losses.mean(), jnp.asarray(losses.shape[0], jnp.int32)


# -- CNN with BatchNorm ------------------------------------------------------------------------


class ResidualUnit(nnx.Module):
    def __init__(self, channels: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(channels, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(channels, momentum=0.9, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = nnx.relu(self.bn1(self.conv1(x)))
        return nnx.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(nnx.Module):
    """Images ``(B, 32, 32, 3)`` -> class logits ``(B, 10)``, no sharding metadata at all."""

    def __init__(self, rngs: nnx.Rngs, channels: int = 16):
        self.stem = nnx.Conv(3, channels, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(channels, momentum=0.9, rngs=rngs)
        self.units = nnx.List([ResidualUnit(channels, rngs) for _ in range(2)])
        self.head = nnx.Linear(channels, 10, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = nnx.relu(self.bn(self.stem(images)))
        for unit in self.units:
            x = unit(x)
        return self.head(x.mean(axis=(1, 2)))


# -- The zoo -----------------------------------------------------------------------------------


def token_batch(step: int, rows: int = 16, seq: int = 32) -> dict:
    """Byte-level rows of real text (this file's own source), one window per row and step."""
    with open(__file__, "rb") as f:
        data = np.frombuffer(f.read(), np.uint8).astype(np.int32)
    starts = (np.arange(rows) * 997 + step * 131) % (len(data) - seq - 1)
    return {"tokens": np.stack([data[s : s + seq + 1] for s in starts])}


def translation_batch(step: int, rows: int = 16, seq: int = 32) -> dict:
    """Copy-and-reverse pairs of text windows: the target is the source read backwards."""
    source = token_batch(step, rows, seq)["tokens"][:, :seq]
    return {"source": source, "target": np.concatenate([source[:, :1], source[:, ::-1]], axis=1)}


def image_batch(step: int, rows: int = 16) -> dict:
    rng = np.random.default_rng(step)
    return {
        "x": rng.normal(0.5, 1.0, size=(rows, 32, 32, 3)).astype(np.float32),
        "y": rng.integers(0, 10, rows).astype(np.int32),
    }


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    make: Callable[[nnx.Rngs], nnx.Module] | None  # None: a Linen module (``linen``)
    batch: Callable[[int], dict]
    loss: Callable[[Callable[[Any], jax.Array], dict], tuple[jax.Array, jax.Array]]
    language_model: bool
    linen: Any = None


LINEN_CONFIG = LMConfig(dim=DIM, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, mlp=MLP, layers=LAYERS)
LINEN_MOE_CONFIG = dataclasses.replace(LINEN_CONFIG, experts=4)
LINEN_SCANNED_MOE_CONFIG = dataclasses.replace(LINEN_MOE_CONFIG, expert_style="scan")
LINEN_SORTED_MOE_CONFIG = dataclasses.replace(LINEN_MOE_CONFIG, expert_style="sorted")
ZOO: dict[str, ZooEntry] = {
    "gemma_style": ZooEntry(GemmaStyleLM, token_batch, next_token, True),
    "linen_lm": ZooEntry(None, token_batch, next_token, True, linen=LinenLM(LINEN_CONFIG)),
    "llama_style": ZooEntry(LlamaStyleLM, token_batch, next_token, True),
    "encoder_decoder": ZooEntry(EncoderDecoder, translation_batch, translation, False),
    "vit": ZooEntry(ViT, image_batch, classification, False),
    "user_moe": ZooEntry(user_moe_lm, token_batch, next_token, True),
    "linen_moe": ZooEntry(None, token_batch, next_token, True, linen=LinenLM(LINEN_MOE_CONFIG)),
    "sorted_moe": ZooEntry(sorted_moe_lm, token_batch, next_token, True),
    "shared_expert_moe": ZooEntry(shared_expert_lm, token_batch, next_token, True),
    "looped_moe": ZooEntry(looped_moe_lm, token_batch, next_token, True),
    "rolled_moe": ZooEntry(rolled_moe_lm, token_batch, next_token, True),
    "linen_scanned_moe": ZooEntry(None, token_batch, next_token, True, linen=LinenLM(LINEN_SCANNED_MOE_CONFIG)),
    "linen_sorted_moe": ZooEntry(None, token_batch, next_token, True, linen=LinenLM(LINEN_SORTED_MOE_CONFIG)),
    "cnn_batchnorm": ZooEntry(SmallResNet, image_batch, classification, False),
}
