"""Hugging Face checkpoints into *your own* Flax model, and back, with a small declarative mapping.

A mapping says, for each of your parameters (its path, ``/``-joined, with ``{i}`` for a layer
number), which checkpoint tensor(s) it is and how: an einops-style pattern splits tensor
dimensions into named factors and orders them as your parameter's dimensions; :func:`concat`
joins tensors along a dimension, :func:`stack` on a new leading one. The mapping compiles to the
same views the GPT import uses (:mod:`shardkit.models.hf_views`), so each parameter is born
sharded and each process reads only the blocks of the tensors its own devices hold.

Example (two rules of ``examples/byo_models.py``'s ``GemmaLM``; the whole mapping is in
``docs/guides/checkpoints-and-hugging-face.md``, "Into your own model")::

    from shardkit.models.hf_mapping import Mapping, stack, tensor

    mapping = Mapping({
        "layers/{i}/attn/q/kernel": tensor("model.layers.{i}.self_attn.q_proj.weight", "(n h) d -> d n h", h=16),
        "final_norm/scale": "model.norm.weight",
        ...  # one rule per parameter
    })
    params = mapping.load("checkpoint/", trainer)      # born sharded, as trainer.init expects
    state = trainer.init(0, params=params)
    mapping.save(state.params, "tuned/", config=...)   # the same tensors, names and shapes back

A layer stack that is one stacked parameter (``nnx.vmap``, ``nn.scan``) maps with
``stacked="i"``: the parameter's leading dimension enumerates ``{i}``
(``Mapping({...}, stacked="i")``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Mapping as MappingABC
from typing import Any

import jax
import numpy as np

from shardkit.core.errors import CheckpointError, ModelError
from shardkit.models import hf
from shardkit.models.hf_views import Concat, Source, Stack, path_key

Part = Any  # TensorSpec | ConcatSpec | StackSpec | str


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: ``name`` (may hold ``{i}``), an einops-style ``pattern`` and the
    sizes of factors the shapes do not fix."""

    name: str
    pattern: str | None = None
    sizes: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class ConcatSpec:
    parts: tuple[Part, ...]
    axis: int


@dataclasses.dataclass(frozen=True)
class StackSpec:
    parts: tuple[Part, ...]


def tensor(name: str, pattern: str | None = None, **sizes: int) -> TensorSpec:
    """Checkpoint tensor ``name`` as (part of) a parameter.

    Args:
      name: the tensor's name; ``{i}`` is the layer number of the parameter's path.
      pattern: ``"(n h) d -> d n h"``: the left side names the tensor's dimensions, a group
        splitting one into factors (row-major, as ``reshape``); the right side orders the
        factors as the parameter's dimensions. None: the tensor as it is.
      **sizes: factor sizes; at most one unknown factor per group, found from the shapes.

    Example:
      >>> tensor("model.layers.{i}.self_attn.q_proj.weight", "(n h) d -> d n h", h=16).sizes
      (('h', 16),)
    """
    return TensorSpec(name, pattern, tuple(sorted(sizes.items())))


def concat(*parts: Part, axis: int) -> ConcatSpec:
    """Parts joined along the parameter's dimension ``axis`` (a fused gate/up weight, say)."""
    return ConcatSpec(tuple(parts), axis)


def stack(*parts: Part) -> StackSpec:
    """Parts stacked on a new leading dimension (Flax's ``(2, D, K, H)`` key/value kernel, say)."""
    return StackSpec(tuple(parts))


_TOKEN = re.compile(r"\(([^()]*)\)|(\S+)")


def _parse(pattern: str) -> tuple[list[list[str]], list[str]]:
    if pattern.count("->") != 1:
        raise ModelError(
            f"Pattern {pattern!r} needs one '->': tensor dimensions on the left, the parameter's on the right."
        )
    left, right = pattern.split("->")
    groups = [m.group(1).split() if m.group(1) is not None else [m.group(2)] for m in _TOKEN.finditer(left)]
    order = right.split()
    flat = [n for g in groups for n in g]
    if sorted(flat) != sorted(order) or len(set(flat)) != len(flat):
        raise ModelError(
            f"Pattern {pattern!r}: the right side must order exactly the left side's factors {flat}, each once."
        )
    return groups, order


def _source(spec: TensorSpec, name: str, shape: tuple[int | None, ...], tensor_shape: tuple[int, ...] | None) -> Source:
    """The view of one tensor as a parameter (part) of ``shape`` (None where unknown)."""
    if spec.pattern is None:
        dims = tensor_shape if tensor_shape is not None else shape
        if any(d is None for d in dims):
            raise ModelError(f"{name}: give a pattern with sizes; its shape is not known here.")
        return Source(name, tuple((int(d),) for d in dims), tuple(range(len(dims))))  # type: ignore[arg-type]
    groups, order = _parse(spec.pattern)
    if len(order) != len(shape):
        raise ModelError(
            f"{name}: pattern {spec.pattern!r} makes {len(order)} dimensions; the parameter has {len(shape)}."
        )
    if tensor_shape is not None and len(groups) != len(tensor_shape):
        raise ModelError(
            f"{name}: pattern {spec.pattern!r} names {len(groups)} dimensions; the tensor has {len(tensor_shape)}."
        )
    sizes = dict(spec.sizes)
    sizes.update({n: int(d) for n, d in zip(order, shape, strict=True) if d is not None and n not in sizes})
    for j, group in enumerate(groups):
        unknown = [n for n in group if n not in sizes]
        if len(unknown) == 1 and tensor_shape is not None:
            known = int(np.prod([sizes[n] for n in group if n in sizes]))
            sizes[unknown[0]] = tensor_shape[j] // known
        elif unknown:
            raise ModelError(f"{name}: give the size of {unknown} in pattern {spec.pattern!r} (e.g. {unknown[0]}=16).")
    flat = [n for g in groups for n in g]
    return Source(name, tuple(tuple(sizes[n] for n in g) for g in groups), tuple(flat.index(n) for n in order))


class Mapping:
    """Your model's parameters as Hugging Face checkpoint tensors (see the module docstring).

    Args:
      rules: parameter path (``/``-joined, ``{i}`` for a layer number) -> a tensor name, or
        :func:`tensor`, :func:`concat`, :func:`stack`.
      stacked: the placeholder whose values a stacked parameter's leading dimension enumerates.
      ignore: regular expressions of checkpoint tensors the model does not use.
    """

    def __init__(self, rules: MappingABC[str, Part], *, stacked: str | None = None, ignore: tuple[str, ...] = ()):
        self.rules = dict(rules)
        self.stacked = stacked
        self.ignore = tuple(re.compile(p) for p in ignore)
        self._patterns = [(re.compile(_path_regex(path) + "$"), part) for path, part in self.rules.items()]

    def _rule(self, path: str) -> tuple[dict[str, str], Part]:
        for regex, part in self._patterns:
            match = regex.match(path)
            if match:
                return match.groupdict(), part
        raise ModelError(
            f"Parameter {path!r} matches no rule of the mapping (rules: {list(self.rules)}). Add one for it."
        )

    def _view(self, part: Part, values: dict[str, str], shape: tuple[int | None, ...], tensors: Any) -> Any:
        if isinstance(part, str):
            part = TensorSpec(part)
        if isinstance(part, TensorSpec):
            name = part.name.format(**values)
            known = tensors.shape(name) if tensors is not None and name in tensors.names else None
            if tensors is not None and known is None:
                raise CheckpointError(f"{tensors.directory} lacks tensor {name!r}, which the mapping reads.")
            return _source(part, name, shape, known)
        if isinstance(part, StackSpec):
            return Stack(tuple(self._view(p, values, shape[1:], tensors) for p in part.parts))
        if isinstance(part, ConcatSpec):
            partial = tuple(None if d == part.axis else s for d, s in enumerate(shape))
            return Concat(tuple(self._view(p, values, partial, tensors) for p in part.parts), part.axis)
        raise ModelError(f"Mapping rule {part!r}: use a tensor name, tensor(), concat() or stack().")

    def views(self, abstract_params: Any, tensors: Any = None) -> dict[tuple[Any, ...], Any]:
        """Each parameter's path (as in the tree) -> its view of checkpoint tensors; each view's
        shape checked against the parameter's."""
        out: dict[tuple[Any, ...], Any] = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
            key = path_key(path)
            text = "/".join(str(k) for k in key)
            values, part = self._rule(text)
            shape = tuple(leaf.shape)
            if self.stacked and self.stacked not in values and self.stacked in _placeholders(_names(part)):
                view: Any = Stack(
                    tuple(
                        self._view(part, {**values, self.stacked: str(j)}, shape[1:], tensors) for j in range(shape[0])
                    )
                )
            else:
                view = self._view(part, values, shape, tensors)
            if tuple(view.shape) != shape:
                raise CheckpointError(
                    f"Parameter {text} has shape {shape}; the mapping reads {tuple(view.shape)} from "
                    f"{sorted(view.sources())[:3]}."
                )
            out[key] = view
        return out

    def load(self, directory: str | os.PathLike[str], trainer: Any) -> Any:
        """The checkpoint's tensors as ``trainer``'s parameters, each born sharded (for
        ``trainer.init(seed, params=...)``); every tensor used or ignored, none left over."""
        tensors = hf.Tensors(directory)
        abstract = trainer.abstract_params
        views = self.views(abstract, tensors)
        used = {n for v in views.values() for n in v.sources()}
        extra = sorted(n for n in tensors.names - used if not any(r.search(n) for r in self.ignore))
        if extra:
            raise CheckpointError(
                f"{tensors.directory} has {len(extra)} tensors the mapping does not read, e.g. {extra[:3]}; "
                "map them, or pass ignore=(regex, ...) if the model does not use them."
            )
        hf.check_dtypes(tensors, used)
        dtypes = {path_key(p): leaf.dtype for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
        return hf.read_sharded(tensors, views, trainer.state_shardings.params, dtypes.__getitem__)

    def save(
        self, params: Any, directory: str | os.PathLike[str], *, config: MappingABC[str, Any] | None = None
    ) -> pathlib.Path:
        """Write ``params`` as the checkpoint tensors the mapping names (atomically, into a new
        directory; process 0 writes), with ``config`` as its ``config.json`` (the dtype written
        set under ``torch_dtype``)."""
        views = self.views(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))

        def to_tensors(host: Any) -> dict[str, np.ndarray]:
            flat = {path_key(p): a for p, a in jax.tree_util.tree_flatten_with_path(host)[0]}
            tensors: dict[str, np.ndarray] = {}
            for key, view in views.items():
                tensors.update(view.write(flat[key]))
            return tensors

        return hf.write_checkpoint(
            params, directory, to_tensors, lambda dtype: {**(config or {}), "torch_dtype": dtype}
        )


def _names(part: Part) -> str:
    """Every tensor name template of a rule, joined (to find its placeholders)."""
    if isinstance(part, str):
        return part
    if isinstance(part, TensorSpec):
        return part.name
    return " ".join(_names(p) for p in part.parts)


def _placeholders(template: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", template)


def _path_regex(template: str) -> str:
    out, last = [], 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out.append(re.escape(template[last : m.start()]))
        out.append(f"(?P<{m.group(1)}>\\d+)")
        last = m.end()
    out.append(re.escape(template[last:]))
    return "".join(out)
