"""Hugging Face checkpoints (``config.json`` + ``*.safetensors``) in and out of shardkit's GPT.

Llama (2, 3.x), Mistral, Mixtral, Qwen2/2.5, Qwen3 and Gemma 2/3 checkpoints map onto
:class:`~shardkit.models.GPT` tensor by tensor (the config side is :mod:`shardkit.models.hf_config`):

============================================  =================================================
Hugging Face (``model.layers.{i}.`` ...)       GPT (stacked over layers when ``scan_layers``)
============================================  =================================================
``self_attn.{q,k,v}_proj.weight`` (out, in)    ``blocks/attn/wqkv`` (D, N, G+2, K): per kv head,
                                               its G query heads, its key, its value
``self_attn.{q,k,v}_proj.bias`` (Qwen2)        ``blocks/attn/bqkv`` (N, G+2, K)
``self_attn.{q,k}_norm`` (Qwen3, Gemma 3)      ``blocks/attn/{q,k}_norm/scale`` (K,)
``self_attn.o_proj.weight`` (D, H*K)           ``blocks/attn/wo`` (H, K, D)
``mlp.{gate,up}_proj.weight`` (F, D)           ``blocks/mlp/w_gate_up`` (D, 2, F)
``mlp.down_proj.weight`` (D, F)                ``blocks/mlp/w_down`` (F, D)
``block_sparse_moe.gate`` (E, D) (Mixtral)     ``blocks/mlp/router`` (D, E)
``block_sparse_moe.experts.{e}.w1/w3/w2``      ``blocks/mlp/w_gate_up`` (E, D, 2, F), ``w_down`` (E, F, D)
``input_layernorm``                            ``blocks/attn_norm/scale``
``post_attention_layernorm``                   ``blocks/mlp_norm/scale``; Gemma: ``blocks/post_attn_norm``
``pre_/post_feedforward_layernorm`` (Gemma)    ``blocks/mlp_norm`` / ``blocks/post_mlp_norm``
``model.embed_tokens`` / ``model.norm``        ``embed`` / ``final_norm/scale``
``lm_head.weight`` (V, D), absent if tied      ``lm_head`` (D, V), absent if ``tie_embeddings``
============================================  =================================================

Query head ``h`` uses kv head ``h // G`` in both (Hugging Face's ``repeat_kv``). Hugging Face
stores q and k in the rotate-half layout (the two halves of each head rotate together), which is
what :func:`shardkit.models.layers.rotary.rotary` computes, so no row permutation is needed.

Each GPT parameter is a *view* of checkpoint tensors (:mod:`shardkit.models.hf_views`): a
reshape of each tensor dimension into factors, a transpose, concatenations and a stack over
layers. A view reads any slice of the GPT array by reading the matching block of the tensors
(safetensors' lazy slices), so
:func:`load_params` builds every array with ``jax.make_array_from_callback`` and a process reads
only what its own devices hold. :func:`save_pretrained` runs the views backwards.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from shardkit.core.errors import CheckpointError
from shardkit.models.gpt import GPTConfig
from shardkit.models.hf_config import FAMILIES, gpt_config, hf_config
from shardkit.models.hf_views import path_key, views

__all__ = [
    "CONFIG",
    "INDEX",
    "SUPPORTED",
    "Tensors",
    "gpt_config",
    "hf_config",
    "load_params",
    "save_pretrained",
    "write_checkpoint",
]

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older Llama exports saved
SUPPORTED = tuple(FAMILIES)
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' codes of the dtypes a parameter can be read from


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# -- reading tensors ---------------------------------------------------------------------------


def _opened(path: pathlib.Path, safe_open: Any) -> Any:
    """``safe_open(path)``, or a :class:`CheckpointError` naming the file when it is not a whole
    safetensors file (a truncated download, an interrupted copy)."""
    try:
        return safe_open(path, "np")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a broken file
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}); it may be truncated: download or copy it again."
        ) from e


class Tensors:
    """The tensors of a checkpoint directory (one ``model.safetensors`` or an index of shards),
    opened lazily: :meth:`read` reads one block of one tensor."""

    def __init__(self, directory: str | os.PathLike[str]):
        from safetensors import safe_open  # imported here: the package imports without it

        self.directory = pathlib.Path(directory)
        index = self.directory / INDEX
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not an index of shards (JSON with a weight_map): {e}.") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory} holds no *.safetensors file (nor {INDEX}).")
        absent = [file for file in files if not (self.directory / file).is_file()]
        if absent:
            names = sorted(name for name, file in weight_map.items() if file in absent)
            raise CheckpointError(
                f"{self.directory / INDEX} names {len(absent)} file(s) that are missing: {absent[:3]} "
                f"(holding {len(names)} tensors, e.g. {names[:2]}). Download the whole checkpoint again."
            )
        handles = {file: _opened(self.directory / file, safe_open) for file in files}  # one memory map per file
        if not index.exists():
            weight_map = {name: file for file, handle in handles.items() for name in handle.keys()}  # noqa: SIM118 -- a safe_open handle is not iterable
        self._files = {name: handles[file] for name, file in weight_map.items()}
        self._file_names = dict(weight_map)
        self.names = frozenset(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype code (``F32``, ``BF16`` ...)."""
        return str(self._files[name].get_slice(name).get_dtype())

    def read(self, name: str, block: tuple[slice, ...]) -> np.ndarray:
        """One block of one tensor; a :class:`CheckpointError` naming the file and the tensor if it
        holds NaN or Inf (a weight that would make every loss NaN, found before any step)."""
        values = np.asarray(self._files[name].get_slice(name)[block])
        finite = np.isfinite(values) if np.issubdtype(values.dtype, np.floating) else None
        if finite is not None and not finite.all():
            bad = int(finite.size - finite.sum())
            raise CheckpointError(
                f"{self.directory / self._file_names[name]}: tensor {name} holds {bad} NaN or Inf value(s) (in the "
                "block read here); the checkpoint was corrupted or trained into overflow. Download or export it again."
            )
        return values


# -- in ----------------------------------------------------------------------------------------


def check_tensors(tensors: Tensors, cfg: GPTConfig, drop_mtp: bool = False) -> None:
    """Every tensor the config needs is there with its shape, and nothing unexplained is left over
    (``drop_mtp``: but for the layers past the last, DeepSeek-V3's multi-token prediction)."""
    needed = {name: shape for view in views(cfg).values() for name, shape in view.sources().items()}
    missing = sorted(set(needed) - tensors.names)
    if missing:
        raise CheckpointError(
            f"{tensors.directory} lacks {len(missing)} tensors its config.json implies, e.g. {missing[:3]}."
        )
    for name, shape in needed.items():
        if name in _VOCAB_TABLES and tensors.shape(name) != shape and tensors.shape(name)[1:] == shape[1:]:
            raise CheckpointError(
                f"{tensors.directory}: {name} has {tensors.shape(name)[0]} rows (tokens) but config.json's vocab_size "
                f"is {cfg.vocab}; they must be equal. Fix vocab_size in config.json to the table's rows (a resized "
                "embedding saved without its config), or export the checkpoint again."
            )
        if tensors.shape(name) != shape:
            raise CheckpointError(f"{name} has shape {tensors.shape(name)}; config.json implies {shape}.")
    check_dtypes(tensors, needed)
    extra = sorted(n for n in tensors.names - set(needed) if not n.endswith(_IGNORED_SUFFIXES))
    predicting = [n for n in extra if _layer_of(n) >= cfg.n_layers]
    if predicting and not drop_mtp:
        layers = sorted({_layer_of(n) for n in predicting})
        raise CheckpointError(
            f"{tensors.directory} has {len(predicting)} tensors of layer(s) {layers} past its {cfg.n_layers} "
            f"decoder layers, e.g. {predicting[:2]}: the multi-token-prediction module DeepSeek-V3 ships "
            "(num_nextn_predict_layers). shardkit trains next-token prediction only; import without it with "
            "drop_mtp=True (sk.from_pretrained(..., drop_mtp=True))."
        )
    extra = [n for n in extra if n not in predicting]
    if extra:
        raise CheckpointError(
            f"{tensors.directory} has {len(extra)} tensors GPT has no place for, e.g. {extra[:3]} "
            "(a bias or layer this architecture does not have)."
        )


_VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def _layer_of(name: str) -> int:
    """The layer number of a ``model.layers.{i}.`` tensor name, else -1."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return -1


def check_dtypes(tensors: Tensors, names: Any) -> None:
    """Every tensor in ``names`` is stored as a floating-point dtype a parameter can be read from."""
    for name in names:
        if tensors.dtype(name) not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{name} is stored as {tensors.dtype(name)}; shardkit reads floating-point weights "
                f"({', '.join(FLOAT_DTYPES)}). A quantized checkpoint needs dequantizing first."
            )


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's ``config.json`` (a :class:`CheckpointError` naming what is wrong with it)."""
    return read_settings(pathlib.Path(directory) / CONFIG, "pass a Hugging Face model directory")


def read_settings(path: pathlib.Path, where: str) -> dict[str, Any]:
    """A JSON object of settings from ``path``; a :class:`CheckpointError` when it is missing
    (``where``: what to pass instead), not JSON, or not an object."""
    if not path.is_file():
        raise CheckpointError(f"{path.parent} has no {path.name}: {where}.")
    try:
        settings = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}): it was not written whole; write or "
            "download it again."
        ) from e
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path} holds a JSON {type(settings).__name__}, not an object of settings.")
    return settings


def load_params(directory: str | os.PathLike[str], cfg: GPTConfig, shardings: Any, drop_mtp: bool = False) -> Any:
    """GPT parameters read from a checkpoint, each born sharded: a process reads only the
    blocks of the tensors its own devices hold.

    Args:
      directory: the Hugging Face model directory.
      cfg: the GPT config (from :func:`gpt_config` of its ``config.json``).
      shardings: a tree of ``jax.sharding.Sharding`` shaped like the GPT's parameters
        (``trainer.state_shardings.params``).
      drop_mtp: leave out the layers past ``cfg.n_layers`` (DeepSeek-V3's multi-token-prediction
        module); without it they are refused by name.

    Returns:
      The parameter tree, in ``cfg.param_dtype``.
    """
    tensors = Tensors(directory)
    check_tensors(tensors, cfg, drop_mtp)
    dtype = _numpy_dtype(cfg.param_dtype)
    return read_sharded(tensors, views(cfg), shardings, lambda _: dtype)


def read_sharded(tensors: Tensors, by_path: Mapping[Any, Any], shardings: Any, dtype_of: Callable[[Any], Any]) -> Any:
    """Each parameter built from its view's blocks with ``jax.make_array_from_callback``: a
    process reads only what its own devices hold.

    Args:
      tensors: the checkpoint's lazy reader.
      by_path: parameter path (``path_key``) -> its view of checkpoint tensors.
      shardings: the tree of parameter shardings.
      dtype_of: parameter path -> the dtype to hold it in.
    """

    def one(path: Any, sharding: jax.sharding.Sharding) -> jax.Array:
        key = path_key(path)
        view, dtype = by_path[key], dtype_of(key)
        return jax.make_array_from_callback(
            view.shape, sharding, lambda index: view.read(tensors, index).astype(dtype, copy=False)
        )

    return jax.tree_util.tree_map_with_path(one, shardings)


# -- out ---------------------------------------------------------------------------------------


def _host_arrays(params: Any) -> Any:
    """Each parameter as one host NumPy array (gathered across processes where needed)."""
    from jax.experimental import multihost_utils

    def one(x: jax.Array) -> np.ndarray:
        if getattr(x, "is_fully_addressable", True):
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, params)


def save_pretrained(
    params: Any,
    cfg: GPTConfig,
    directory: str | os.PathLike[str],
    *,
    base_config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> pathlib.Path:
    """Write ``params`` as a Hugging Face checkpoint other tools load.

    The directory is written whole or not at all (a temporary sibling renamed into place); on
    several processes all take part in gathering and process 0 writes.

    Args:
      params: the GPT's parameters (``state.params``).
      cfg: their GPTConfig.
      directory: where to write; must not exist yet.
      base_config: the imported checkpoint's ``config.json``, kept as it is when it still
        describes ``cfg`` (see :func:`shardkit.models.hf_config.hf_config`).
      max_shard_bytes: the largest ``.safetensors`` file; more make an index, as Hugging Face does.

    Returns:
      The directory.
    """
    hf_config(cfg, base_config)  # refused before anything is gathered or written

    def to_tensors(host: Any) -> dict[str, np.ndarray]:
        flat = {path_key(p): a for p, a in jax.tree_util.tree_flatten_with_path(host)[0]}
        tensors: dict[str, np.ndarray] = {}
        for path, view in views(cfg).items():
            tensors.update(view.write(flat[path]))
        return tensors

    return write_checkpoint(
        params, directory, to_tensors, lambda dtype: hf_config(cfg, base_config, dtype), max_shard_bytes
    )


def write_checkpoint(
    params: Any,
    directory: str | os.PathLike[str],
    to_tensors: Callable[[Any], dict[str, np.ndarray]],
    config: Callable[[str], Mapping[str, Any]],
    max_shard_bytes: int = 2 * 1024**3,
) -> pathlib.Path:
    """Gather ``params`` to host arrays, turn them into named tensors and write them (sharded into
    files past ``max_shard_bytes``, with an index) and ``config(dtype)`` as ``config.json``:
    atomically, into a new directory, by process 0."""
    from safetensors.numpy import save_file

    target = pathlib.Path(directory)
    if target.exists():
        raise CheckpointError(f"{target} exists; export writes a new directory (remove it or choose another).")
    host = _host_arrays(params)
    if jax.process_index() != 0:
        return target
    tensors = to_tensors(host)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        shards: list[dict[str, np.ndarray]] = [{}]
        for name in sorted(tensors):
            if shards[-1] and sum(a.nbytes for a in shards[-1].values()) + tensors[name].nbytes > max_shard_bytes:
                shards.append({})
            shards[-1][name] = np.ascontiguousarray(tensors[name])
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        for file, shard in zip(names, shards, strict=True):
            save_file(shard, str(staging / file), metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {t: file for file, shard in zip(names, shards, strict=True) for t in shard}
            total = sum(a.nbytes for a in tensors.values())
            (staging / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
        dtype = str(next(iter(tensors.values())).dtype)
        (staging / CONFIG).write_text(json.dumps(dict(config(dtype)), indent=2))
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
