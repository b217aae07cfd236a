"""LoRA adapters in peft's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

peft names an adapter's tensors after the module it wraps, ``base_model.model.`` + the Hugging
Face name (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` of shape
``(r, in)``, ``...lora_B.weight`` of ``(out, r)``); :func:`adapter_views` maps each to shardkit's
GPT adapter (:mod:`shardkit.models.lora`) with the same views the base weights use
(:mod:`shardkit.models.hf_views`), so an adapter is read straight into its shards.

:func:`read_lora` reads ``adapter_config.json`` into a :class:`LoRA`: ``r``, ``lora_alpha``,
``target_modules`` and ``lora_dropout`` are used; ``rank_pattern``/``alpha_pattern`` may only
repeat the global values; every other key must hold its default (null, false, empty) or a value
that changes nothing, else it is refused by name (DoRA, rsLoRA, biases, modules_to_save ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from shardkit.core.errors import CheckpointError
from shardkit.models.gpt import GPTConfig
from shardkit.models.hf_views import Source, Stack, path_key
from shardkit.models.lora import TARGETS, LoRA

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."

# Keys whose value changes nothing here, whatever it is.
_INFORMATIONAL = {
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "task_type",
    "peft_version",
    "auto_mapping",
    "init_lora_weights",
    "megatron_core",
    "qalora_group_size",
    "peft_type",
}
# Keys read into the LoRA.
_READ = {"r", "lora_alpha", "target_modules", "lora_dropout", "rank_pattern", "alpha_pattern"}
# Keys with a meaning shardkit does not implement: refused unless they hold this value.
_DEFAULTS: dict[str, Any] = {"bias": "none", "fan_in_fan_out": False, "lora_bias": False}


def read_lora(directory: str | os.PathLike[str]) -> LoRA:
    """The :class:`LoRA` an adapter directory's ``adapter_config.json`` describes.

    Raises:
      CheckpointError: no config, not JSON, not a LoRA, or a key shardkit cannot honour (named).
    """
    from shardkit.models.hf import read_settings

    path = pathlib.Path(directory) / CONFIG
    config = read_settings(path, "pass the directory peft's save_pretrained wrote")
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config['peft_type']!r}; shardkit reads LoRA adapters only.")
    for key, value in config.items():
        if key in _INFORMATIONAL or key in _READ:
            continue
        if key in _DEFAULTS:
            if value != _DEFAULTS[key]:
                raise CheckpointError(f"{path}: {key}={value!r} is not supported (shardkit reads {_DEFAULTS[key]!r}).")
        elif value not in (None, False, {}, [], ""):
            raise CheckpointError(
                f"{path}: {key}={value!r} is not supported (QLoRA, DoRA, rsLoRA and other variants are refused "
                "by name; plain LoRA has it null or false)."
            )
    r, alpha = config.get("r"), config.get("lora_alpha")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets in TARGETS else None
    if not isinstance(targets, list):
        raise CheckpointError(
            f"{path}: target_modules={config.get('target_modules')!r}; shardkit reads a list of {list(TARGETS)}."
        )
    for key, base in (("rank_pattern", r), ("alpha_pattern", alpha)):
        different = {k: v for k, v in (config.get(key) or {}).items() if v != base}
        if different:
            raise CheckpointError(f"{path}: {key}={different} gives some modules their own value; not supported.")
    try:
        return LoRA(rank=r, alpha=alpha, targets=tuple(targets), dropout=float(config.get("lora_dropout") or 0.0))  # type: ignore[arg-type]  # checked by LoRA
    except Exception as e:
        raise CheckpointError(f"{path}: {e}") from e


def adapter_views(cfg: GPTConfig) -> dict[tuple[str | int, ...], Any]:
    """Every adapter parameter's path -> its view of peft's tensors (``cfg.lora`` must be set)."""
    assert cfg.lora is not None
    d, f, n, k, r = cfg.dim, cfg.mlp_dim, cfg.n_kv_heads, cfg.head_dim, cfg.lora.rank
    g, h = cfg.n_heads // n, cfg.n_heads

    def layer(i: int) -> dict[tuple[str, ...], Source]:
        pre = f"{PREFIX}model.layers.{i}."
        module = {
            t: pre + ("mlp." if t in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + t for t in TARGETS
        }
        a_in = {"o_proj": ((h, k), (1, 2, 0)), "down_proj": ((f,), (1, 0))}  # the rest read the model dimension
        b_out = {
            "q_proj": ((n, g, k), (3, 0, 1, 2)),
            "k_proj": ((n, k), (2, 0, 1)),
            "v_proj": ((n, k), (2, 0, 1)),
            "gate_proj": ((f,), (1, 0)),
            "up_proj": ((f,), (1, 0)),
        }
        out: dict[tuple[str, ...], Source] = {}
        for target in cfg.lora.targets:  # type: ignore[union-attr]
            owner, short = ("mlp" if target in ("gate_proj", "up_proj", "down_proj") else "attn"), TARGETS[target]
            in_factors, a_perm = a_in.get(target, ((d,), (1, 0)))
            out_factors, b_perm = b_out.get(target, ((d,), (1, 0)))
            out[(owner, f"lora_{short}_a")] = Source(module[target] + ".lora_A.weight", ((r,), in_factors), a_perm)
            out[(owner, f"lora_{short}_b")] = Source(module[target] + ".lora_B.weight", (out_factors, (r,)), b_perm)
        return out

    views: dict[tuple[str | int, ...], Any] = {}
    for name, layers in cfg.layer_stacks():
        per_layer = [layer(i) for i in layers]
        for path in per_layer[0]:
            if cfg.scan_layers:
                views[(name, *path)] = Stack(tuple(one[path] for one in per_layer))
            else:
                views.update({(name, i, *path): one[path] for i, one in zip(layers, per_layer, strict=True)})
    return views


def check_adapter(tensors: Any, views: Mapping[Any, Any], base: str | os.PathLike[str]) -> None:
    """The adapter's tensors are exactly those its config implies for this base, with their
    shapes; else a :class:`CheckpointError` naming the first that is not (an adapter trained
    on another base)."""
    needed = {name: shape for view in views.values() for name, shape in view.sources().items()}
    missing = sorted(set(needed) - tensors.names)
    if missing:
        raise CheckpointError(
            f"{tensors.directory} lacks {len(missing)} tensors its {CONFIG} implies for {base}, e.g. {missing[:2]}: "
            "an adapter of another base model (other layer count or names)."
        )
    for name, shape in needed.items():
        if tensors.shape(name) != shape:
            raise CheckpointError(
                f"{name} in {tensors.directory} has shape {tensors.shape(name)}; {base} with r from {CONFIG} "
                f"implies {shape}: an adapter of another base model."
            )
    extra = sorted(tensors.names - set(needed))
    if extra:
        raise CheckpointError(
            f"{tensors.directory} has {len(extra)} tensors its target_modules do not explain for {base}, e.g. "
            f"{extra[:2]}: an adapter of another base model (more layers, other modules)."
        )


def load_with_adapters(
    base: str | os.PathLike[str],
    cfg: GPTConfig,
    model: Any,
    shardings: Any,
    seed: int = 0,
    adapter: str | os.PathLike[str] | None = None,
    drop_mtp: bool = False,
) -> Any:
    """A GPT's parameters, each born sharded: the base from its Hugging Face checkpoint, the
    adapters (``cfg.lora``) from ``adapter`` (peft's directory) or new (A drawn from ``seed``,
    B zero: the model starts as the base computes).

    Args:
      base: the base checkpoint's directory.
      cfg: the GPT config, with ``lora`` when it has adapters.
      model: ``cfg.model()`` (its ``init`` draws new adapters).
      shardings: the parameters' shardings (``trainer.state_shardings.params``).
      seed: as :meth:`shardkit.Trainer.init` takes it.
      adapter: peft's adapter directory, or None.
      drop_mtp: leave out DeepSeek-V3's multi-token-prediction layers (:func:`shardkit.models.hf.load_params`).
    """
    from shardkit.models import hf

    base_shardings, adapter_shardings = split_adapters(shardings)
    if adapter is not None:  # refused before a weight is read: the adapter fits this base or says why not
        views, tensors = adapter_views(cfg), hf.Tensors(adapter)
        check_adapter(tensors, views, base)
    params = hf.load_params(base, dataclasses.replace(cfg, lora=None), base_shardings, drop_mtp)
    if cfg.lora is None:
        return params
    if adapter is not None:
        dtype = np.dtype(cfg.param_dtype)
        new = hf.read_sharded(tensors, views, adapter_shardings, lambda _: dtype)
    else:
        init = jax.jit(lambda key: split_adapters(model.init(key))[1], out_shardings=adapter_shardings)
        new = init(jax.random.split(jax.random.key(seed))[0])  # the key Trainer.init draws parameters from
    return join_adapters(params, new)


def split_adapters(tree: Any) -> tuple[Any, Any]:
    """A parameter tree (nested dicts) as ``(base, adapters)``: the ``lora_*`` leaves apart."""
    if not isinstance(tree, Mapping):
        return tree, None
    base, adapters = {}, {}
    for key, value in tree.items():
        if isinstance(key, str) and key.startswith("lora_"):
            adapters[key] = value
            continue
        b, a = split_adapters(value)
        base[key] = b
        if a:
            adapters[key] = a
    return base, adapters


def join_adapters(base: Any, adapters: Any) -> Any:
    """The inverse of :func:`split_adapters`."""
    if not adapters:
        return base
    out = dict(base)
    for key, value in adapters.items():
        out[key] = join_adapters(base[key], value) if key in base else value
    return out


def write_adapter(
    params: Any, cfg: GPTConfig, directory: str | os.PathLike[str], base: str | None = None
) -> pathlib.Path:
    """Write the adapters in ``params`` as peft saves them, atomically, into a new directory.

    Args:
      params: the GPT's parameters with adapters (``state.params``).
      cfg: their GPTConfig (``cfg.lora`` set).
      directory: where to write; must not exist yet.
      base: ``base_model_name_or_path`` to record (the base checkpoint's directory).
    """
    from safetensors.numpy import save_file

    from shardkit.models.hf import _host_arrays

    if cfg.lora is None:
        raise CheckpointError("adapter_only=True: this model has no LoRA adapters to write.")
    target = pathlib.Path(directory)
    if target.exists():
        raise CheckpointError(f"{target} exists; an adapter is written into a new directory.")
    host = _host_arrays(split_adapters(params)[1])
    if jax.process_index() != 0:
        return target
    flat = {path_key(p): a for p, a in jax.tree_util.tree_flatten_with_path(host)[0]}
    tensors: dict[str, np.ndarray] = {}
    for path, view in adapter_views(cfg).items():
        tensors.update(view.write(flat[path]))
    lora = cfg.lora
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(staging / WEIGHTS), {"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(config, indent=2))
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def merged(params: Any, cfg: GPTConfig) -> tuple[Any, GPTConfig]:
    """``params`` with each adapter folded into its base weight (``W + (alpha / r) A B``), and the
    config without LoRA: what a checkpoint of merged weights holds."""
    if cfg.lora is None:
        return params, cfg
    base, adapters = split_adapters(params)
    scale, lead = cfg.lora.scale, 1 if cfg.scan_layers else 0  # a leading layers dimension is batched

    def delta(owner: dict, short: str) -> Any:
        a, b = owner[f"lora_{short}_a"], owner[f"lora_{short}_b"]
        # A ([L], in..., r), B ([L], r, out...) -> ([L], in..., out...)
        a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])
        b2 = b.reshape(*b.shape[: lead + 1], -1)
        full = jax.numpy.einsum("...ir,...ro->...io", a2, b2) * scale
        return full.reshape(*a.shape[:-1], *b.shape[lead + 1 :])

    def fold(block_base: dict, block_adapters: dict) -> dict:
        out = {**block_base, "attn": dict(block_base["attn"]), "mlp": dict(block_base["mlp"])}
        attn, mlp = block_adapters.get("attn", {}), block_adapters.get("mlp", {})
        g = cfg.n_heads // cfg.n_kv_heads
        if attn:
            w = out["attn"]["wqkv"]  # (..., D, N, G + 2, K)
            for short, cols in (("q", slice(0, g)), ("k", slice(g, g + 1)), ("v", slice(g + 1, g + 2))):
                if f"lora_{short}_a" in attn:
                    d = delta(attn, short)  # (..., D, N, G, K) or (..., D, N, K)
                    d = d if short == "q" else d[..., None, :]
                    w = w.at[..., cols, :].add(d.astype(w.dtype))
            out["attn"]["wqkv"] = w
            if "lora_o_a" in attn:
                out["attn"]["wo"] = out["attn"]["wo"] + delta(attn, "o").astype(out["attn"]["wo"].dtype)
        if mlp:
            w = out["mlp"]["w_gate_up"]  # (..., D, 2, F)
            for short, col in (("gate", 0), ("up", 1)):
                if f"lora_{short}_a" in mlp:
                    w = w.at[..., col, :].add(delta(mlp, short).astype(w.dtype))
            out["mlp"]["w_gate_up"] = w
            if "lora_down_a" in mlp:
                out["mlp"]["w_down"] = out["mlp"]["w_down"] + delta(mlp, "down").astype(out["mlp"]["w_down"].dtype)
        return out

    out = dict(base)
    for name, _ in cfg.layer_stacks():
        blocks = base[name]
        if cfg.scan_layers:
            out[name] = fold(blocks, adapters.get(name, {}))
        else:
            out[name] = {i: fold(blocks[i], adapters.get(name, {}).get(i, {})) for i in blocks}
    return out, dataclasses.replace(cfg, lora=None)
