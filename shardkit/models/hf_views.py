"""Each GPT parameter as a *view* of Hugging Face checkpoint tensors (:mod:`shardkit.models.hf`).

A view is a reshape of each tensor dimension into factors, a transpose, concatenations (q/k/v
fused per KV group, gate/up fused) and a stack over layers. It reads any slice of the GPT array by
reading only the matching block of the tensors, and runs backwards to write them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from shardkit.models.gpt import GPTConfig


class BlockReader(Protocol):
    """Reads one block (basic slices) of one named tensor: :class:`shardkit.models.hf.Tensors`."""

    def read(self, name: str, block: tuple[slice, ...]) -> np.ndarray: ...


def _bounds(index: tuple[slice, ...], shape: Sequence[int]) -> list[tuple[int, int]]:
    return [sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True)]


class View(Protocol):
    shape: tuple[int, ...]

    def read(self, tensors: BlockReader, index: tuple[slice, ...]) -> np.ndarray: ...

    def write(self, array: np.ndarray) -> dict[str, np.ndarray]: ...

    def sources(self) -> dict[str, tuple[int, ...]]: ...


@dataclasses.dataclass(frozen=True)
class Source:
    """Tensor ``name`` with each of its dimensions split into ``factors``, the factors then
    transposed by ``perm`` (GPT dimension ``i`` is factor ``perm[i]``)."""

    name: str
    factors: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @property
    def flat(self) -> tuple[int, ...]:
        return tuple(f for group in self.factors for f in group)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.flat[p] for p in self.perm)

    def sources(self) -> dict[str, tuple[int, ...]]:
        return {self.name: tuple(math.prod(group) for group in self.factors)}

    def read(self, tensors: BlockReader, index: tuple[slice, ...]) -> np.ndarray:
        wanted = [(0, 0)] * len(self.flat)
        for gpt_dim, bound in enumerate(_bounds(index, self.shape)):
            wanted[self.perm[gpt_dim]] = bound
        block: list[slice] = []
        split: list[int] = []
        inner: list[slice] = []
        start = 0
        for group in self.factors:  # read whole rows of the leading factor's range, then slice
            (lo, hi), rest = wanted[start], math.prod(group[1:])
            block.append(slice(lo * rest, hi * rest))
            split.extend((hi - lo, *group[1:]))
            inner.append(slice(None))
            inner.extend(slice(a, b) for a, b in wanted[start + 1 : start + len(group)])
            start += len(group)
        data = tensors.read(self.name, tuple(block))
        return data.reshape(split)[tuple(inner)].transpose(self.perm)

    def write(self, array: np.ndarray) -> dict[str, np.ndarray]:
        back = np.argsort(self.perm)
        return {self.name: array.transpose(back).reshape(self.sources()[self.name])}


@dataclasses.dataclass(frozen=True)
class Concat:
    """Views joined along ``axis`` (query, key and value in one fused weight)."""

    parts: tuple[Any, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        return (*first[: self.axis], sum(p.shape[self.axis] for p in self.parts), *first[self.axis + 1 :])

    def sources(self) -> dict[str, tuple[int, ...]]:
        return {k: v for p in self.parts for k, v in p.sources().items()}

    def read(self, tensors: BlockReader, index: tuple[slice, ...]) -> np.ndarray:
        lo, hi = _bounds(index, self.shape)[self.axis]
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[self.axis]
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                sub = (*index[: self.axis], slice(a - offset, b - offset), *index[self.axis + 1 :])
                pieces.append(part.read(tensors, sub))
            offset += size
        return np.concatenate(pieces, axis=self.axis)

    def write(self, array: np.ndarray) -> dict[str, np.ndarray]:
        cuts = np.cumsum([p.shape[self.axis] for p in self.parts])[:-1]
        out: dict[str, np.ndarray] = {}
        for part, piece in zip(self.parts, np.split(array, cuts, axis=self.axis), strict=True):
            out.update(part.write(piece))
        return out


@dataclasses.dataclass(frozen=True)
class Stack:
    """One view per layer, stacked on a new leading axis (a scanned GPT's layers)."""

    parts: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    def sources(self) -> dict[str, tuple[int, ...]]:
        return {k: v for p in self.parts for k, v in p.sources().items()}

    def read(self, tensors: BlockReader, index: tuple[slice, ...]) -> np.ndarray:
        lo, hi = _bounds(index, self.shape)[0]
        return np.stack([self.parts[i].read(tensors, index[1:]) for i in range(lo, hi)])

    def write(self, array: np.ndarray) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for part, layer in zip(self.parts, array, strict=True):
            out.update(part.write(layer))
        return out


def _norm(name: str, size: int) -> Source:
    return Source(name, ((size,),), (0,))


def _experts(cfg: GPTConfig, moe: str) -> dict[tuple[str, ...], Any]:
    """Mixtral's ``block_sparse_moe``: a router (E, D) and per expert w1 (gate), w3 (up), w2 (down)."""
    d, f, e = cfg.dim, cfg.mlp_dim, cfg.n_experts
    expert = [f"{moe}experts.{j}." for j in range(e)]
    return {
        ("mlp", "router"): Source(moe + "gate.weight", ((e,), (d,)), (1, 0)),
        ("mlp", "w_gate_up"): Stack(
            tuple(
                Concat(
                    (
                        Source(x + "w1.weight", ((1, f), (d,)), (2, 0, 1)),
                        Source(x + "w3.weight", ((1, f), (d,)), (2, 0, 1)),
                    ),
                    axis=1,
                )
                for x in expert
            )
        ),
        ("mlp", "w_down"): Stack(tuple(Source(x + "w2.weight", ((d,), (f,)), (1, 0)) for x in expert)),
    }


def _dense_mlp(cfg: GPTConfig, mlp: str, f: int, into: str = "mlp") -> dict[tuple[str, ...], Any]:
    """``{gate,up,down}_proj`` of a dense gated MLP of width ``f`` as ``<into>/w_gate_up``, ``w_down``."""
    d = cfg.dim
    return {
        (into, "w_gate_up"): Concat(
            (
                Source(mlp + "gate_proj.weight", ((1, f), (d,)), (2, 0, 1)),
                Source(mlp + "up_proj.weight", ((1, f), (d,)), (2, 0, 1)),
            ),
            axis=1,
        ),
        (into, "w_down"): Source(mlp + "down_proj.weight", ((d,), (f,)), (1, 0)),
    }


def _per_expert(cfg: GPTConfig, mlp: str) -> dict[tuple[str, ...], Any]:
    """Qwen3-MoE's and DeepSeek-V3's Hub layout: a router ``gate`` (E, D) and each expert its own
    ``experts.{e}.{gate,up,down}_proj``; DeepSeek adds ``gate.e_score_correction_bias`` and
    ``shared_experts``."""
    d, f, e = cfg.dim, cfg.expert_dim, cfg.n_experts
    experts = [_dense_mlp(cfg, f"{mlp}experts.{j}.", f) for j in range(e)]
    views: dict[tuple[str, ...], Any] = {
        ("mlp", "router"): Source(mlp + "gate.weight", ((e,), (d,)), (1, 0)),
        ("mlp", "w_gate_up"): Stack(tuple(x[("mlp", "w_gate_up")] for x in experts)),
        ("mlp", "w_down"): Stack(tuple(x[("mlp", "w_down")] for x in experts)),
    }
    if cfg.router.score_bias:
        views[("mlp", "score_bias")] = _norm(mlp + "gate.e_score_correction_bias", e)
    if cfg.shared_experts:
        views.update(_dense_mlp(cfg, mlp + "shared_experts.", cfg.shared_experts * f, into="shared_mlp"))
    return views


def _fused_experts(cfg: GPTConfig, mlp: str) -> dict[tuple[str, ...], Any]:
    """gpt-oss's layout: a biased ``router``, and every expert in one tensor each, ``gate_up_proj``
    (E, D, 2F) with gate and up interleaved (column ``2f`` the gate, ``2f + 1`` the up), its bias
    (E, 2F), ``down_proj`` (E, F, D) and its bias (E, D)."""
    d, f, e = cfg.dim, cfg.expert_dim, cfg.n_experts
    x = mlp + "experts."
    return {
        ("mlp", "router"): Source(mlp + "router.weight", ((e,), (d,)), (1, 0)),
        ("mlp", "router_bias"): _norm(mlp + "router.bias", e),
        ("mlp", "w_gate_up"): Source(x + "gate_up_proj", ((e,), (d,), (f, 2)), (0, 1, 3, 2)),
        ("mlp", "b_gate_up"): Source(x + "gate_up_proj_bias", ((e,), (f, 2)), (0, 2, 1)),
        ("mlp", "w_down"): Source(x + "down_proj", ((e,), (f,), (d,)), (0, 1, 2)),
        ("mlp", "b_down"): Source(x + "down_proj_bias", ((e,), (d,)), (0, 1)),
    }


def _latent_attention(cfg: GPTConfig, attn: str) -> dict[tuple[str, ...], Any]:
    """DeepSeek-V3's ``q_a_proj``/``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``,
    ``kv_b_proj``, their norms and ``o_proj``, each a (heads x dims, inputs) matrix."""
    lat, d, h = cfg.latent, cfg.dim, cfg.n_heads
    assert lat is not None
    r, qk = lat.kv_rank, lat.qk_dim
    views: dict[tuple[str, ...], Any] = {
        ("attn", "wkv_a"): Source(attn + "kv_a_proj_with_mqa.weight", ((r + lat.rope_dim,), (d,)), (1, 0)),
        ("attn", "kv_norm", "scale"): _norm(attn + "kv_a_layernorm.weight", r),
        ("attn", "wkv_b"): Source(attn + "kv_b_proj.weight", ((h, lat.nope_dim + lat.v_dim), (r,)), (2, 0, 1)),
        ("attn", "wo"): Source(attn + "o_proj.weight", ((d,), (h, lat.v_dim)), (1, 2, 0)),
    }
    if lat.q_rank:
        views[("attn", "wq_a")] = Source(attn + "q_a_proj.weight", ((lat.q_rank,), (d,)), (1, 0))
        views[("attn", "q_norm", "scale")] = _norm(attn + "q_a_layernorm.weight", lat.q_rank)
        views[("attn", "wq_b")] = Source(attn + "q_b_proj.weight", ((h, qk), (lat.q_rank,)), (2, 0, 1))
    else:
        views[("attn", "wq")] = Source(attn + "q_proj.weight", ((h, qk), (d,)), (2, 0, 1))
    return views


def _layer_views(cfg: GPTConfig, i: int) -> dict[tuple[str, ...], Any]:
    """Layer ``i``'s parameters (paths within its block) as views of its tensors."""
    d, f, n, k = cfg.dim, cfg.mlp_dim, cfg.n_kv_heads, cfg.head_dim
    g, h = cfg.n_heads // n, cfg.n_heads
    pre = f"model.layers.{i}."
    attn, mlp = pre + "self_attn.", pre + "mlp."
    views: dict[tuple[str, ...], Any] = {("attn_norm", "scale"): _norm(pre + "input_layernorm.weight", d)}
    if cfg.latent is not None:
        views.update(_latent_attention(cfg, attn))
    else:
        # (heads out, D in) -> (D, N, G|1, K): factors [N, G, K], [D]; GPT order D, N, G, K.
        views[("attn", "wqkv")] = Concat(
            (
                Source(attn + "q_proj.weight", ((n, g, k), (d,)), (3, 0, 1, 2)),
                Source(attn + "k_proj.weight", ((n, 1, k), (d,)), (3, 0, 1, 2)),
                Source(attn + "v_proj.weight", ((n, 1, k), (d,)), (3, 0, 1, 2)),
            ),
            axis=2,
        )
        views[("attn", "wo")] = Source(attn + "o_proj.weight", ((d,), (h, k)), (1, 2, 0))
    if cfg.attn_out_bias:
        views[("attn", "bo")] = _norm(attn + "o_proj.bias", d)
    if cfg.attn_sinks:
        views[("attn", "sinks")] = _norm(attn + "sinks", h)
    if cfg.post_norms:  # Gemma 2/3: "post_attention_layernorm" is the attention's output norm
        views[("post_attn_norm", "scale")] = _norm(pre + "post_attention_layernorm.weight", d)
        views[("mlp_norm", "scale")] = _norm(pre + "pre_feedforward_layernorm.weight", d)
        views[("post_mlp_norm", "scale")] = _norm(pre + "post_feedforward_layernorm.weight", d)
    else:
        views[("mlp_norm", "scale")] = _norm(pre + "post_attention_layernorm.weight", d)
    if not cfg.routed(i):
        views.update(_dense_mlp(cfg, mlp, f))
    elif cfg.attn_sinks:  # gpt-oss
        views.update(_fused_experts(cfg, mlp))
    elif cfg.qk_norm or cfg.latent is not None:  # qwen3_moe, deepseek_v3
        views.update(_per_expert(cfg, mlp))
    else:
        views.update(_experts(cfg, pre + "block_sparse_moe."))
    if cfg.qkv_bias:
        views[("attn", "bqkv")] = Concat(
            tuple(Source(attn + f"{w}_proj.bias", ((n, m, k),), (0, 1, 2)) for w, m in (("q", g), ("k", 1), ("v", 1))),
            axis=1,
        )
    if cfg.qk_norm:
        views[("attn", "q_norm", "scale")] = _norm(attn + "q_norm.weight", k)
        views[("attn", "k_norm", "scale")] = _norm(attn + "k_norm.weight", k)
    return views


def views(cfg: GPTConfig) -> dict[tuple[str | int, ...], Any]:
    """Every GPT parameter's path (as in its parameter tree) -> its view of checkpoint tensors."""
    out: dict[tuple[str | int, ...], Any] = {
        ("embed",): Source("model.embed_tokens.weight", ((cfg.vocab,), (cfg.dim,)), (0, 1)),
        ("final_norm", "scale"): _norm("model.norm.weight", cfg.dim),
    }
    if not cfg.tie_embeddings:
        out[("lm_head",)] = Source("lm_head.weight", ((cfg.vocab,), (cfg.dim,)), (1, 0))
    if cfg.scan_layers:
        for name, layers in cfg.layer_stacks():
            per_layer = [_layer_views(cfg, i) for i in layers]
            for path in per_layer[0]:
                out[(name, *path)] = Stack(tuple(layer[path] for layer in per_layer))
    else:
        for i in range(cfg.n_layers):
            out.update({("blocks", i, *path): view for path, view in _layer_views(cfg, i).items()})
    return out


def path_key(path: Sequence[Any]) -> tuple[str | int, ...]:
    return tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)
