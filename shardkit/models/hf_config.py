"""Hugging Face ``config.json`` <-> :class:`~shardkit.models.GPTConfig`, where nothing is guessed.

Every key of a ``config.json`` is one of three things:

- **read**: it sets a GPTConfig field, and a value shardkit cannot compute is refused by name
  (``hidden_act="relu"``, ``rope_type="yarn"``);
- **harmless**: it cannot change what the model computes from these weights (token ids, cache
  and dtype hints, the version that wrote the file);
- anything else is **refused** with its name: an unknown key may change the math, and a
  silently wrong logit is worse than an error.

Both spellings of the rotary settings are read: transformers 5's ``rope_parameters`` (for
Gemma 3 one entry per attention kind) and transformers 4's top-level ``rope_theta`` /
``rope_scaling`` (/ ``rope_local_base_freq``); a file with both must agree.

Families and what each adds to Llama's decoder:

=============  ===========================================================================
llama          Llama 2/3.x: ``llama3`` or ``linear`` rotary scaling, explicit ``head_dim``
mistral        sliding window on every layer (when set)
mixtral        Mistral with top-k experts, routed with no token dropped
qwen2          q/k/v biases; sliding window from ``max_window_layers`` (when used)
qwen3          per-head q/k RMSNorm, explicit ``head_dim``, no biases
gemma2         GeGLU, ``(1 + w)`` norms, post-norms, sqrt(dim)-scaled embeddings, scores and
               logits soft-capped, alternating sliding/full layers, ``query_pre_attn_scalar``
gemma3_text    Gemma 2 without soft caps, plus q/k norms and a rotary base per attention kind
qwen3_moe      Qwen3 with top-k experts (``moe_intermediate_size``), normalised or not; dense
               layers by ``mlp_only_layers`` / ``decoder_sparse_step``
gpt_oss        attention sinks, biases on q/k/v/o, router and experts, alternating sliding and
               full layers, a clamped SwiGLU (``swiglu_limit``), yarn
deepseek_v3    multi-head latent attention (low-rank q and kv, decoupled interleaved rotary
               dims), sigmoid scores with a correction bias, group-limited top-k, a routed
               scaling factor, shared experts, the first ``first_k_dense_replace`` layers
               dense, yarn with ``mscale_all_dim`` (Kimi K2 is this architecture)
=============  ===========================================================================
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from shardkit.core.errors import ModelError, short_repr
from shardkit.models.gpt import GPTConfig
from shardkit.models.layers.latent_attention import LatentConfig
from shardkit.models.rope import ROPE_TYPES, RopeScaling, yarn_mscale
from shardkit.parallel.experts import Router

# Keys that cannot change the numbers computed from the weights.
HARMLESS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "cache_implementation",
        "initializer_range",  # only draws weights a checkpoint replaces
        "_name_or_path",
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "tokenizer_class",
        "id2label",
        "label2id",
        "pretraining_tp",  # splits Llama's matmuls into slices; the same sums
    }
)

_COMMON = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "attention_dropout",
        "hidden_act",
        "head_dim",
    }
)
_WINDOWED = frozenset({"sliding_window"})
_QWEN = _WINDOWED | {"use_sliding_window", "max_window_layers", "layer_types", "use_mrope"}
_GEMMA = _WINDOWED | {
    "hidden_activation",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "layer_types",
    "attention_bias",
    "use_bidirectional_attention",
}
FAMILIES: dict[str, tuple[str, frozenset[str]]] = {
    # model_type: (architecture, the keys read beyond the common ones)
    "llama": ("LlamaForCausalLM", frozenset({"attention_bias", "mlp_bias"})),
    "mistral": ("MistralForCausalLM", _WINDOWED),
    "mixtral": (
        "MixtralForCausalLM",
        _WINDOWED
        | {
            "num_local_experts",
            "num_experts_per_tok",
            "router_aux_loss_coef",
            "router_jitter_noise",
            "output_router_logits",
        },
    ),
    "qwen2": ("Qwen2ForCausalLM", _QWEN),
    "qwen3": ("Qwen3ForCausalLM", _QWEN | {"attention_bias"}),
    "gemma2": ("Gemma2ForCausalLM", _GEMMA),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        _GEMMA | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        _QWEN
        | {"attention_bias", "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob"}
        | {"num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"},
    ),
    "gpt_oss": (
        "GptOssForCausalLM",
        _WINDOWED
        | {"layer_types", "attention_bias", "num_local_experts", "num_experts_per_tok", "experts_per_token"}
        | {"router_aux_loss_coef", "output_router_logits", "swiglu_limit", "swiglu_alpha", "initial_context_length"}
        | {"quantization_config"},
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        frozenset({"attention_bias", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_head_dim"})
        | {"qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave", "moe_intermediate_size"}
        | {"n_routed_experts", "num_local_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group"}
        | {"norm_topk_prob", "routed_scaling_factor", "scoring_func", "topk_method", "moe_layer_freq"}
        | {"num_nextn_predict_layers", "output_router_logits", "aux_loss_alpha", "seq_aux", "ep_size"}
        | {"quantization_config"},
    ),
}
# Keys whose absence would leave transformers to fill in a family default that is not the plain
# one shardkit would assume: required rather than guessed.
REQUIRED: dict[str, tuple[str, ...]] = {
    "llama": (),
    "mistral": ("num_key_value_heads", "sliding_window"),
    "mixtral": ("num_key_value_heads", "rope", "num_local_experts", "num_experts_per_tok"),
    "qwen2": ("num_key_value_heads",),
    "qwen3": ("num_key_value_heads", "head_dim"),
    "gemma2": (
        "num_key_value_heads",
        "head_dim",
        "query_pre_attn_scalar",
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
    ),
    "gemma3_text": ("num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window"),
    "qwen3_moe": ("num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts_per_tok"),
    "gpt_oss": ("num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window"),
    "deepseek_v3": (
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "first_k_dense_replace",
    ),
}
# model_type values the Hub gives a family's architecture under another name.
ALIASES = {"kimi_k2": "deepseek_v3"}  # moonshotai/Kimi-K2-*: DeepseekV3ForCausalLM with its own model_type
_NOT_SUPPORTED = {
    "gemma": "Gemma 1 (no reference checkpoint to check it against yet); Gemma 2 and 3 are supported",
    "gemma3": "the multimodal Gemma 3 wrapper (vision tower, text_config); import its text model's "
    "checkpoint (model_type gemma3_text)",
}
_ROPE_KEYS = frozenset(
    {
        "rope_theta",
        "rope_type",
        "type",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    }
)
_YARN_KEYS = frozenset({"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor"})
# GPTConfig fields that say how to train or compile, not what the model computes.
TRAINING_FIELDS = frozenset(
    {"dropout", "dtype", "param_dtype", "scan_layers", "scan_unroll", "remat", "attention", "max_seq"}
    | {"capacity_factor", "aux_loss_weight"}
)


def _refuse(kind: str, key: str, value: Any, why: str) -> ModelError:
    return ModelError(f"config.json ({kind}) has {key}={short_repr(value)}, which shardkit cannot import: {why}.")


def check_keys(hf: Mapping[str, Any]) -> str:
    """The checkpoint's family (``model_type``); raises on a family or key shardkit does not know.

    Example:
      >>> check_keys({"model_type": "qwen3", "vocab_size": 8}), check_keys({"model_type": "kimi_k2"})
      ('qwen3', 'deepseek_v3')
    """
    given = hf.get("model_type")
    kind = ALIASES.get(given, given) if isinstance(given, str) else given
    if kind in _NOT_SUPPORTED:
        raise ModelError(f"config.json has model_type={kind!r}: shardkit does not import {_NOT_SUPPORTED[kind]}.")
    if kind not in FAMILIES:
        raise ModelError(
            f"config.json has model_type={short_repr(kind)}; shardkit imports {', '.join(FAMILIES)} "
            "(or load it into your own model with shardkit.models.hf_mapping)."
        )
    known = HARMLESS | _COMMON | FAMILIES[kind][1]
    if given in ALIASES:  # where the Hub's own code for it lies: the alias's architecture, named
        known |= {"auto_map"}
    unknown = sorted(set(hf) - known)
    if unknown:
        raise ModelError(
            f"config.json ({kind}) has {', '.join(f'{k}={short_repr(hf[k])}' for k in unknown)}: "
            f"{'a key' if len(unknown) == 1 else 'keys'} shardkit does not know, which may change what the model "
            "computes, so it refuses rather than guess. If you know the key changes nothing, remove it from "
            "config.json; otherwise this checkpoint needs support in shardkit.models.hf_config."
        )
    return str(kind)


def _rope_entry(kind: str, where: str, entry: Any) -> tuple[float | None, RopeScaling | None]:
    if entry is None:
        return None, None
    if not isinstance(entry, Mapping):
        raise _refuse(kind, where, entry, "expected a mapping of rotary settings")
    yarn = entry.get("rope_type", entry.get("type")) == "yarn"
    extra = sorted(set(entry) - _ROPE_KEYS - {"partial_rotary_factor"} - (_YARN_KEYS if yarn else set()))
    if extra:
        raise _refuse(kind, where, entry, f"it has rotary settings shardkit does not know: {extra}")
    if float(entry.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(kind, where, entry, "partial rotary embeddings are not implemented")
    rope_type = entry.get("rope_type", entry.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _refuse(kind, where, entry, f"rope_type {rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
    theta = float(entry["rope_theta"]) if "rope_theta" in entry else None
    if rope_type == "default":
        return theta, None
    if "factor" not in entry:
        raise _refuse(kind, where, entry, f"rope_type {rope_type!r} needs a factor")
    fields: dict[str, Any] = {"factor": float(entry["factor"])}
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in entry:
                raise _refuse(kind, where, entry, f"llama3 scaling needs {key}")
        fields.update(
            low_freq_factor=float(entry["low_freq_factor"]),
            high_freq_factor=float(entry["high_freq_factor"]),
            original_max_seq=int(entry["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        if "original_max_position_embeddings" not in entry:
            raise _refuse(kind, where, entry, "yarn scaling needs original_max_position_embeddings")
        fields.update(
            original_max_seq=int(entry["original_max_position_embeddings"]),
            beta_fast=float(entry.get("beta_fast") or 32.0),
            beta_slow=float(entry.get("beta_slow") or 1.0),
            mscale=float(entry.get("mscale") or 0.0),
            mscale_all_dim=float(entry.get("mscale_all_dim") or 0.0),
            truncate=bool(entry.get("truncate", True)),
            attention_factor=float(entry.get("attention_factor") or 0.0),
        )
    return theta, RopeScaling(rope_type, **fields)


def _rope(kind: str, hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None, float | None]:
    """``(theta, scaling, local theta)`` from either spelling; a file with both must agree."""
    theta4, scaling4 = hf.get("rope_theta"), _rope_entry(kind, "rope_scaling", hf.get("rope_scaling"))[1]
    local4 = hf.get("rope_local_base_freq")
    params = hf.get("rope_parameters")
    if params is None:
        theta = float(theta4) if theta4 is not None else 10000.0
        local = float(local4) if local4 is not None else (10000.0 if kind == "gemma3_text" else None)
        return theta, scaling4, local
    if kind == "gemma3_text" and isinstance(params, Mapping) and "full_attention" in params:
        extra = sorted(set(params) - {"full_attention", "sliding_attention"})
        if extra:
            raise _refuse(kind, "rope_parameters", params, f"unknown attention kinds {extra}")
        theta5, scaling5 = _rope_entry(kind, "rope_parameters.full_attention", params["full_attention"])
        local5, local_scaling = _rope_entry(kind, "rope_parameters.sliding_attention", params.get("sliding_attention"))
        if local_scaling is not None:
            raise _refuse(kind, "rope_parameters.sliding_attention", params["sliding_attention"], "it must be unscaled")
    else:
        theta5, scaling5 = _rope_entry(kind, "rope_parameters", params)
        local5 = None
    theta = theta5 if theta5 is not None else 10000.0
    local = local5 if local5 is not None else (10000.0 if kind == "gemma3_text" else None)
    for key, old, new in (("rope_theta", theta4, theta), ("rope_local_base_freq", local4, local)):
        if old is not None and float(old) != new:
            raise _refuse(kind, key, old, f"rope_parameters says {new}; the two spellings must agree")
    if hf.get("rope_scaling") is not None and scaling4 != scaling5:
        raise _refuse(kind, "rope_scaling", hf["rope_scaling"], "it disagrees with rope_parameters")
    return theta, scaling5, local


def _layer_types(kind: str, hf: Mapping[str, Any], layers: int, window: int | None) -> tuple[str, ...]:
    """Per layer ``"full"`` or ``"sliding"``, from ``layer_types`` or the family's own rule."""
    given = hf.get("layer_types")
    if given is not None:
        names = {"full_attention": "full", "sliding_attention": "sliding"}
        if not isinstance(given, list) or len(given) != layers or any(t not in names for t in given):
            raise _refuse(kind, "layer_types", given, f"expected {layers} of full_attention / sliding_attention")
        types = tuple(names[t] for t in given)
    elif window is None:
        types = ("full",) * layers
    elif kind == "gemma2":  # transformers 4: even layers slide
        types = tuple("sliding" if (i + 1) % 2 else "full" for i in range(layers))
    elif kind == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
        types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))
    elif kind in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(hf.get("max_window_layers", layers))
        types = tuple("sliding" if i >= first else "full" for i in range(layers))
    else:  # mistral, mixtral: every layer
        types = ("sliding",) * layers
    if "sliding" in types and window is None:
        raise _refuse(kind, "layer_types", given, "sliding layers need a sliding_window")
    return types


def _window(kind: str, hf: Mapping[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if kind in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        return None
    return int(window) if window is not None else None


# config.json's numbers by the JSON type transformers reads them as (a string is refused, not parsed).
INTEGER_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "num_experts",
    "experts_per_token",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "qk_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
    "moe_layer_freq",
)
FLOAT_KEYS = (
    "rms_norm_eps",
    "rope_theta",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "router_aux_loss_coef",
    "attention_dropout",
    "router_jitter_noise",
    "query_pre_attn_scalar",
    "routed_scaling_factor",
    "swiglu_limit",
    "swiglu_alpha",
)


def _check_types(kind: str, hf: Mapping[str, Any]) -> None:
    """Numbers written as numbers: ``"rms_norm_eps": "1e-6"`` is refused by name, not read."""
    for key in INTEGER_KEYS + FLOAT_KEYS:
        value = hf.get(key)
        if value is None:
            continue
        kinds = (int,) if key in INTEGER_KEYS else (int, float)
        if not isinstance(value, kinds) or isinstance(value, bool):
            want = "an integer" if key in INTEGER_KEYS else "a number"
            raise ModelError(
                f"config.json ({kind}): {key} is {value!r} ({type(value).__name__}); transformers reads {want} "
                f"there. Write it as {want} in config.json."
            )


def _check_values(kind: str, hf: Mapping[str, Any]) -> None:
    """Read keys whose value shardkit cannot compute."""
    _check_types(kind, hf)
    gemma = kind.startswith("gemma")
    activations = ("gelu_pytorch_tanh",) if gemma else ("silu", "swish")
    for key in ("hidden_activation", "hidden_act") if gemma else ("hidden_act",):
        value = hf.get(key)
        if value is not None and value not in activations:
            raise _refuse(kind, key, value, f"the {kind} MLP shardkit computes is gated by {activations[0]}")
        if value is not None and gemma:
            break  # hidden_activation wins over hidden_act, as in transformers
    _check_mixture(kind, hf)
    refusals = {
        "attention_bias": (
            bool(hf.get("attention_bias")) and kind != "gpt_oss",
            "the output projection would need a bias",
        ),
        "mlp_bias": (bool(hf.get("mlp_bias")), "GPT's MLP has no biases"),
        "attention_dropout": (float(hf.get("attention_dropout") or 0.0) != 0.0, "GPT has no attention dropout"),
        "use_mrope": (bool(hf.get("use_mrope")), "multimodal rotary sections are not implemented"),
        "router_jitter_noise": (float(hf.get("router_jitter_noise") or 0.0) != 0.0, "routing noise is not implemented"),
        "use_bidirectional_attention": (bool(hf.get("use_bidirectional_attention")), "GPT's attention is causal"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise _refuse(kind, key, hf.get(key), why)


# What the families' mixtures compute, by the keys that choose it (anything else is refused by name).
SCORING_FUNCS = ("sigmoid",)  # deepseek_v3: sigmoid scores, chosen with e_score_correction_bias
TOPK_METHODS = ("noaux_tc",)  # deepseek_v3: group-limited top-k on the corrected scores


def _check_mixture(kind: str, hf: Mapping[str, Any]) -> None:
    """The keys of a mixture of experts whose values shardkit does not compute, refused by name."""
    quantized = hf.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, Mapping) else quantized
        raise _refuse(
            kind,
            "quantization_config",
            quantized,
            f"its weights are stored quantized ({method}); shardkit reads floating-point weights. Dequantize them "
            "first (transformers: load with the quantizer's dequantize option, e.g. Mxfp4Config(dequantize=True) "
            "for gpt-oss, then save_pretrained), and drop quantization_config",
        )
    choices = {"scoring_func": SCORING_FUNCS, "topk_method": TOPK_METHODS}
    for key, known in choices.items():
        if key in hf and hf[key] not in known:
            raise _refuse(kind, key, hf[key], f"shardkit computes {key} {' or '.join(map(repr, known))}")
    if kind == "deepseek_v3" and int(hf.get("moe_layer_freq", 1)) != 1:
        raise _refuse(kind, "moe_layer_freq", hf["moe_layer_freq"], "every layer after the dense ones must be routed")
    pairs = (("num_experts", "num_local_experts"), ("experts_per_token", "num_experts_per_tok"))
    for a, b in pairs:
        if a in hf and b in hf and hf[a] != hf[b]:
            raise _refuse(kind, a, hf[a], f"{b}={hf[b]} says otherwise; the two spellings must agree")
    if kind == "deepseek_v3":
        rope, nope = hf.get("qk_rope_head_dim"), hf.get("qk_nope_head_dim")
        for key, want in (("qk_head_dim", (rope or 0) + (nope or 0)), ("head_dim", rope)):
            if hf.get(key) is not None and hf[key] != want:
                why = f"DeepSeek-V3's is {want} (from qk_rope_head_dim and qk_nope_head_dim)"
                raise _refuse(kind, key, hf[key], why)


def _mixture_fields(kind: str, hf: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """The GPTConfig fields of a qwen3_moe, gpt_oss or deepseek_v3 checkpoint beyond the decoder's."""
    aux = float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0
    if kind == "qwen3_moe":
        experts = int(hf.get("num_experts", hf.get("num_local_experts", 128)))
        step, only = int(hf.get("decoder_sparse_step", 1)), hf.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(not isinstance(i, int) for i in only):
            raise _refuse(kind, "mlp_only_layers", only, "expected a list of layer numbers")
        dense = tuple(i for i in range(layers) if i in only or not experts or (i + 1) % step)
        return dict(
            n_experts=experts,
            top_k=int(hf["num_experts_per_tok"]),
            moe_mlp_dim=int(hf["moe_intermediate_size"]),
            dense_layers=dense,
            router=Router(normalize=bool(hf.get("norm_topk_prob", False))),
            moe_dropless=True,
            aux_loss_weight=aux,
        )
    if kind == "gpt_oss":
        return dict(
            n_experts=int(hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            router=Router(logit_bias=True),
            expert_bias=True,
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            qkv_bias=bool(hf.get("attention_bias", True)),
            attn_out_bias=bool(hf.get("attention_bias", True)),
            attn_sinks=True,
            moe_dropless=True,
            aux_loss_weight=aux,
        )
    # deepseek_v3
    first_dense = int(hf["first_k_dense_replace"])
    groups = (int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1))
    return dict(
        n_experts=int(hf.get("n_routed_experts", hf.get("num_local_experts", 256))),
        top_k=int(hf["num_experts_per_tok"]),
        moe_mlp_dim=int(hf["moe_intermediate_size"]),
        dense_layers=tuple(range(min(first_dense, layers))),
        shared_experts=int(hf.get("n_shared_experts") or 0),
        router=Router(
            score="sigmoid",
            normalize=bool(hf.get("norm_topk_prob", True)),
            scale=float(hf.get("routed_scaling_factor", 1.0)),
            groups=groups,
            score_bias=True,
        ),
        latent=LatentConfig(
            kv_rank=int(hf["kv_lora_rank"]),
            q_rank=int(hf.get("q_lora_rank") or 0),
            rope_dim=int(hf["qk_rope_head_dim"]),
            nope_dim=int(hf["qk_nope_head_dim"]),
            v_dim=int(hf["v_head_dim"]),
            interleaved=bool(hf.get("rope_interleave", True)),
        ),
        moe_dropless=True,
        aux_loss_weight=0.0,  # DeepSeek-V3 balances by its correction bias, not a loss
    )


def _latent_query_scale(hf: Mapping[str, Any], scaling: RopeScaling | None) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times yarn's ``mscale(factor, mscale_all_dim)``
    squared (its non-rotary dimensions are scaled too)."""
    scale = float(int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])) ** -0.5
    if scaling is not None and scaling.kind != "default" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def gpt_config(hf: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` that computes what transformers computes for this ``config.json``.

    Args:
      hf: the parsed ``config.json`` of a family in :data:`FAMILIES`, in transformers 4 or 5
        spelling.
      **overrides: GPTConfig fields that say how to train (``param_dtype``, ``scan_layers``,
        ``dropout`` ...).

    Returns:
      The GPTConfig. Raises :class:`~shardkit.core.errors.ModelError` naming the key for anything it
      cannot compute exactly.

    Example:
      >>> gpt_config({"model_type": "llama", "vocab_size": 512, "hidden_size": 64,
      ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      ...     "num_key_value_heads": 2}).n_kv_heads
      2
    """
    kind = check_keys(hf)
    _check_values(kind, hf)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise ModelError(f"config.json ({kind}) lacks {key}, which sets the shape of the model.")
    for key in REQUIRED[kind]:
        present = ("rope_theta" in hf or "rope_parameters" in hf) if key == "rope" else key in hf
        if not present:
            raise ModelError(
                f"config.json ({kind}) lacks {'rope_theta' if key == 'rope' else key}: transformers would fill in "
                f"its {kind} default, which shardkit does not guess. Add the key with the checkpoint's value."
            )
    heads, layers = int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    theta, scaling, local_theta = _rope(kind, hf)
    window = _window(kind, hf)
    types = _layer_types(kind, hf, layers, window)
    gemma = kind.startswith("gemma")
    fields: dict[str, Any] = dict(
        vocab=int(hf["vocab_size"]),
        dim=int(hf["hidden_size"]),
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        mlp_dim=int(hf["intermediate_size"]),
        max_seq=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta if kind == "gemma3_text" else None,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=kind == "qwen2",
        attn_head_dim=int(hf["head_dim"]) if hf.get("head_dim") is not None else None,
        qk_norm=kind in ("qwen3", "gemma3_text", "qwen3_moe"),
        sliding_window=window if "sliding" in types else None,
        layer_types=types if len(set(types)) > 1 else (),
    )
    if gemma:
        scalar = hf.get("query_pre_attn_scalar")
        fields.update(
            norm_offset=1.0,
            post_norms=True,
            mlp_activation="gelu_tanh",
            embed_scale=True,
            query_scale=float(scalar) ** -0.5 if scalar is not None else None,
            attn_softcap=_optional_float(hf.get("attn_logit_softcapping")),
            final_softcap=_optional_float(hf.get("final_logit_softcapping")),
        )
    if kind in ("qwen3_moe", "gpt_oss", "deepseek_v3"):
        fields.update(_mixture_fields(kind, hf, layers))
        dense = fields.get("dense_layers", ())
        if dense and dense != tuple(range(len(dense))):
            # Dense layers between expert ones: no scanned stacks. scan_layers=True (the command's
            # default) means "scan where the layers are alike", so it does not override this.
            fields["scan_layers"] = False
            if overrides.get("scan_layers") is True:
                overrides = {k: v for k, v in overrides.items() if k != "scan_layers"}
    if kind == "deepseek_v3":
        latent = fields["latent"]
        fields.update(attn_head_dim=latent.qk_dim, query_scale=_latent_query_scale(hf, scaling))
    if kind == "mixtral":
        fields.update(
            n_experts=int(hf.get("num_local_experts", 8)),
            top_k=int(hf.get("num_experts_per_tok", 2)),
            moe_dropless=True,
            aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0,
        )
    try:
        return GPTConfig(**{**fields, **overrides})
    except ModelError as e:  # said in config.json's words: the keys the user can see and fix
        raise ModelError(in_config_words(str(e), set(overrides))) from e


# GPTConfig's fields, as config.json names them (what an error about a checkpoint's config says).
CONFIG_KEYS = {
    "vocab": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "mlp_dim": "intermediate_size",
    "max_seq": "max_position_embeddings",
    "attn_head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "sliding_window": "sliding_window",
    "top_k": "num_experts_per_tok",
    "n_experts": "num_local_experts",
}


def in_config_words(message: str, overridden: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """A GPTConfig error about a checkpoint, with each field named by its ``config.json`` key
    (``n_layers=-2`` -> ``num_hidden_layers=-2``); fields the caller overrode keep their names.

    Example:
      >>> in_config_words("GPTConfig: n_layers=-2 must be a positive integer.")
      'config.json: num_hidden_layers=-2 must be a positive integer.'
    """
    for field, key in CONFIG_KEYS.items():
        if field not in overridden:
            message = re.sub(rf"\b{field}=", f"{key}=", message)
    return message.replace("GPTConfig:", "config.json:", 1)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def math_of(cfg: GPTConfig) -> dict[str, Any]:
    """The fields of ``cfg`` that decide what it computes (not how it trains or compiles)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in TRAINING_FIELDS}
    fields["attn_head_dim"] = cfg.head_dim  # derived or explicit: the same model
    fields["layer_types"] = cfg.sliding_layers if cfg.sliding_window is not None else ()
    return fields


def family_of(cfg: GPTConfig) -> str:
    """The Hugging Face family whose config expresses ``cfg`` (checked by :func:`hf_config`)."""
    if cfg.latent is not None:
        return "deepseek_v3"
    if cfg.attn_sinks:
        return "gpt_oss"
    if cfg.n_experts and cfg.qk_norm:
        return "qwen3_moe"
    if cfg.n_experts:
        return "mixtral"
    if cfg.post_norms:
        return "gemma3_text" if cfg.rope_local_theta is not None or cfg.qk_norm else "gemma2"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def _rope_scaling_dict(scaling: RopeScaling | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    out: dict[str, Any] = {"rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind == "llama3":
        out.update(
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_seq,
        )
    if scaling.kind == "yarn":
        out.update(
            original_max_position_embeddings=scaling.original_max_seq,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            truncate=scaling.truncate,
            **{k: getattr(scaling, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(scaling, k)},
        )
    return out


def _mixture_config(kind: str, cfg: GPTConfig) -> dict[str, Any]:
    """The keys of a qwen3_moe, gpt_oss or deepseek_v3 ``config.json`` that say what ``cfg``'s
    experts (and latent attention) compute."""
    common = dict(num_experts_per_tok=cfg.top_k, output_router_logits=cfg.aux_loss_weight > 0)
    if kind == "qwen3_moe":
        return dict(
            common,
            num_experts=cfg.n_experts,
            moe_intermediate_size=cfg.expert_dim,
            norm_topk_prob=cfg.router.normalize,
            decoder_sparse_step=1,
            mlp_only_layers=list(cfg.dense_layers),
            router_aux_loss_coef=cfg.aux_loss_weight,
        )
    if kind == "gpt_oss":
        return dict(
            common,
            num_local_experts=cfg.n_experts,
            attention_bias=cfg.qkv_bias,
            swiglu_limit=cfg.swiglu_limit,
            swiglu_alpha=cfg.swiglu_alpha,
            router_aux_loss_coef=cfg.aux_loss_weight,
        )
    lat = cfg.latent
    assert lat is not None
    return dict(
        common,
        head_dim=lat.rope_dim,
        kv_lora_rank=lat.kv_rank,
        q_lora_rank=lat.q_rank or None,
        qk_rope_head_dim=lat.rope_dim,
        qk_nope_head_dim=lat.nope_dim,
        v_head_dim=lat.v_dim,
        rope_interleave=lat.interleaved,
        moe_intermediate_size=cfg.expert_dim,
        n_routed_experts=cfg.n_experts,
        n_shared_experts=cfg.shared_experts,
        n_group=cfg.router.groups[0],
        topk_group=cfg.router.groups[1],
        norm_topk_prob=cfg.router.normalize,
        routed_scaling_factor=cfg.router.scale,
        first_k_dense_replace=len(cfg.dense_layers),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )


def new_config(cfg: GPTConfig, dtype: str) -> dict[str, Any]:
    """A ``config.json`` for ``cfg`` in transformers 4's spelling (top-level ``rope_theta`` and
    ``rope_scaling``), which transformers 4 and 5 both read."""
    kind = family_of(cfg)
    out: dict[str, Any] = {
        "architectures": [FAMILIES[kind][0]],
        "model_type": kind,
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling_dict(cfg.rope_scaling),
        "torch_dtype": dtype,
    }
    kinds = ["sliding_attention" if s else "full_attention" for s in cfg.sliding_layers]
    if kind.startswith("gemma"):
        scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim**-0.5
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=round(scale**-2, 6),
            attn_logit_softcapping=cfg.attn_softcap,
            final_logit_softcapping=cfg.final_softcap,
            sliding_window=cfg.sliding_window,
            layer_types=kinds,
        )
        if kind == "gemma3_text":
            out["rope_local_base_freq"] = cfg.rope_local_theta
    else:
        out["hidden_act"] = "silu"
    if kind in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    if kind in ("qwen3_moe", "gpt_oss", "deepseek_v3"):
        out.update(_mixture_config(kind, cfg))
    if kind == "gpt_oss":
        out.update(sliding_window=cfg.sliding_window, layer_types=kinds)
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(
            use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window, layer_types=kinds
        )
    if kind == "mixtral":
        out.update(
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            output_router_logits=cfg.aux_loss_weight > 0,
            router_aux_loss_coef=cfg.aux_loss_weight,
        )
    return out


def hf_config(cfg: GPTConfig, base: Mapping[str, Any] | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``cfg``: the imported checkpoint's own ``base`` unchanged (but for the
    dtype) when it still describes ``cfg``, else a new one; either way checked by reading it back.

    Args:
      cfg: the GPT's config.
      base: the ``config.json`` it was imported from, if any.
      dtype: the dtype of the tensors written (default ``cfg.param_dtype``).

    Returns:
      The config. Raises :class:`~shardkit.core.errors.ModelError` where no family expresses ``cfg``
      (a mixture of experts that drops tokens, say).
    """
    dtype = dtype or cfg.param_dtype
    if base is not None and math_of(gpt_config(base)) == math_of(cfg):
        out = dict(base)
        out["dtype" if "dtype" in out and "torch_dtype" not in out else "torch_dtype"] = dtype
        return out
    out = new_config(cfg, dtype)
    if base is not None:  # keep the token ids and other harmless keys of the original
        out.update({k: v for k, v in base.items() if k in HARMLESS and k not in ("architectures", "model_type")})
        out["torch_dtype"] = dtype
    back = gpt_config(out)
    if math_of(back) != math_of(cfg):
        differ = sorted(k for k, v in math_of(cfg).items() if math_of(back)[k] != v)
        raise ModelError(
            f"No Hugging Face family computes this GPTConfig (as {family_of(cfg)}, these would differ: {differ}). "
            "A mixture of experts exports as Mixtral only with moe_dropless=True."
        )
    return out
