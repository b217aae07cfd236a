"""Mixtures of experts as a traced program shows them, and the least expert parallelism moves.

A model's experts are the parameters with a dimension named ``experts`` (or Linen's and NNX's
``expert``). What the experts compute is read from the traced forward pass, not from the model's
names: every matmul that reads an expert weight (through casts, reshapes and slices, inside
jit, remat, scan and shard_map) counts the token-expert pairs it computes, ``FLOPs / (2 x one
expert's weight)``, whatever its form:

- GShard einsum dispatch ``(E, G, C, D) x (E, D, F)``: the expert dimension is a batch dimension
  of the matmul; ``E x G x C`` slots (capacity included);
- a dense mixture ``(B, T, D) x (E, D, F) -> (B, T, E, F)``: the expert dimension is a free
  dimension of the weight, every expert computes every token;
- sorted tokens and ``jax.lax.ragged_dot``: one row per routed token;
- a loop over stacked expert weights, ``w[e]``: one matmul per expert, summed.

:func:`expert_traffic` turns those facts into the bound's ``expert`` term (GShard, Lepikhin et
al. 2020; DeepSpeed-MoE; Megatron-Core's all-to-all dispatcher): each routed layer sends each
device's routed tokens to their experts and back, forward and backward, four all-to-alls of
``(n-1)/n`` of them; a dense mixture, where every expert sees every token of its group's rows,
gathers the rows and reduce-scatters the outputs over ``expert`` in each direction.

Example:
  >>> layer = MixtureLayer("blocks/mlp", experts=8, slots=2048 * 2.5, dim=64, style="routed", count=2)
  >>> expert_traffic([layer], rows_split=8, expert_axis=4, itemsize=4)  # 4 x 2 layers x 3/4 x 640 x 64 x 4
  983040.0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from shardkit.analysis.report_data import moved_bytes
from shardkit.core.partition import Axes, path_str
from shardkit.core.rules import entry_axes
from shardkit.core.sharding import EXPERT_NAMES
from shardkit.models.model import apply_model
from shardkit.parallel.expert_tensor import dispatch_bytes
from shardkit.parallel.experts import load_apart
from shardkit.parallel.grouped_matmul import traced_as_native

# Operations that pass (part of) a weight on as the same numbers: a matmul on their output reads the weight.
_VIEWS = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "broadcast_in_dim",
        "sharding_constraint",
        "slice",
        "dynamic_slice",
        "gather",
        "reduce_precision",
        "optimization_barrier",
    }
)
_MATMULS = frozenset({"dot_general", "ragged_dot_general"})


@dataclasses.dataclass(frozen=True)
class MixtureLayer:
    """One mixture of experts in a model's forward pass.

    Attributes:
      path: the module path its expert weights share (``blocks/mlp``).
      experts: ``E``, the experts it holds.
      slots: token-expert pairs its experts compute in one call on the traced batch (capacity
        padding included): ``tokens x top_k x capacity factor`` for routed dispatch, ``tokens x E``
        for a dense mixture.
      dim: features of each token an expert reads (the model dimension).
      style: ``"routed"`` (each token goes to some experts: einsum dispatch, sorted tokens, a
        loop over experts on gathered tokens) or ``"dense"`` (every expert runs every token).
      count: how many times it runs a step (a scanned stack's length).
    """

    path: str
    experts: int
    slots: float
    dim: int
    style: str
    count: int = 1


def expert_weights(names_by_leaf: Sequence[tuple[str, tuple[int, ...], tuple[Any, ...] | None]]) -> dict[int, int]:
    """``{leaf index: E}`` for the parameters with an experts dimension.

    Args:
      names_by_leaf: ``(path, shape, logical names or None)`` of each parameter leaf, in tree order.
    """
    return {i: names_by_leaf[i][1][d] for i, d in expert_dims(names_by_leaf).items()}


def expert_dims(names_by_leaf: Sequence[tuple[str, tuple[int, ...], tuple[Any, ...] | None]]) -> dict[int, int]:
    """``{leaf index: dimension}`` of the parameters with an experts dimension: which one it is."""
    found = {}
    for i, (_, _, names) in enumerate(names_by_leaf):
        for d, name in enumerate(names or ()):
            if isinstance(name, str) and name in EXPERT_NAMES:
                found[i] = d
                break
    return found


def mixture_layers(
    closed_jaxpr: Any, leaves: Sequence[tuple[str, tuple[int, ...], tuple[Any, ...] | None]]
) -> list[MixtureLayer]:
    """The mixtures of experts a traced forward pass computes.

    Args:
      closed_jaxpr: the traced program; its first ``len(leaves)`` inputs are the parameters.
      leaves: ``(path, shape, logical names)`` of each parameter, as :func:`expert_weights` takes.

    Returns:
      One :class:`MixtureLayer` per module whose expert weights are read by a matmul, in order.
    """
    experts = expert_weights(leaves)
    if not experts:
        return []
    jaxpr = closed_jaxpr.jaxpr
    origin = {var: i for i, var in enumerate(jaxpr.invars[: len(leaves)]) if i in experts}
    uses: dict[int, list[tuple[float, str, int, int]]] = {}
    for leaf, flops, kind, count, dim in _matmuls(jaxpr, origin, 1):
        uses.setdefault(leaf, []).append((flops, kind, count, dim))
    by_module: dict[str, MixtureLayer] = {}
    for leaf, found in uses.items():
        path, shape, names = leaves[leaf]
        e = experts[leaf]
        stacked = math.prod(s for s, n in zip(shape, names or ()) if n == "layers")
        one_expert = math.prod(shape) / (e * stacked)
        count = found[0][2]
        slots = sum(flops * c for flops, _, c, _ in found) / (2 * one_expert * count)
        style = "dense" if any(kind == "dense" for _, kind, _, _ in found) else "routed"
        module = path.rsplit("/", 1)[0] if "/" in path else ""
        layer = MixtureLayer(module, e, slots, found[0][3], style, count)
        # The module's first weight read (its input projection) stands for the module.
        by_module.setdefault(module, layer)
    return list(by_module.values())


def _matmuls(
    jaxpr: Any, origin: dict[Any, int], count: int, hidden: frozenset = frozenset()
) -> Iterator[tuple[int, float, str, int, int]]:
    """``(leaf, FLOPs, "dense"|"routed", times run, features read)`` of each matmul reading an
    expert weight, in program order, through views and into called programs.

    A matmul whose tokens are the hidden units of an earlier one (its output, through views and
    elementwise operations: the activation, a gated unit's product) is that mixture's later
    projection, on the same devices: it moves no tokens of its own and is not yielded. Its
    module need not be the first's (Flax's ``nn.vmap`` over an MLP names each projection apart).
    """
    origin, carried, widened = dict(origin), set(hidden), set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        sources = [origin.get(v) if not _is_literal(v) else None for v in eqn.invars]
        if name == "broadcast_in_dim" and len(eqn.invars[0].aval.shape) < len(eqn.outvars[0].aval.shape):
            widened.add(eqn.outvars[0])
        if name in _VIEWS and sources and sources[0] is not None:
            origin[eqn.outvars[0]] = sources[0]
            continue
        if name in _MATMULS:
            for position, leaf in enumerate(sources[:2]):
                if leaf is not None and sources[1 - position] is None:
                    if eqn.invars[1 - position] not in carried:
                        yield leaf, _flops(eqn), _kind(eqn, position), count, _features(eqn, 1 - position)
                        carried.add(eqn.outvars[0])
                    break
            continue
        if _carries_hidden(eqn, carried, widened):
            carried.update(eqn.outvars)
        for inner, mapping, times in _called_programs(eqn):
            inner_origin = {inner.invars[j]: leaf for i, j in mapping if (leaf := sources[i]) is not None}
            inner_hidden = frozenset(
                inner.invars[j] for i, j in mapping if not _is_literal(eqn.invars[i]) and eqn.invars[i] in carried
            )
            if inner_origin:
                yield from _matmuls(inner, inner_origin, count * times, inner_hidden)


def _carries_hidden(eqn: Any, hidden: set, widened: set) -> bool:
    """Whether ``eqn`` hands an expert matmul's hidden units on: a view of them, or an
    elementwise operation whose one output has their shape and whose other operands of that
    shape are hidden units too or ``widened``: broadcasts of smaller arrays (a bias). A sum
    with anything else (the residual stream) ends them, so the next layer's mixture is its own."""
    read = [v for v in eqn.invars if not _is_literal(v) and v in hidden]
    if not read or len(eqn.outvars) != 1:
        return False
    if eqn.primitive.name in _VIEWS:
        return True
    shape = eqn.outvars[0].aval.shape
    others = [v for v in eqn.invars if not _is_literal(v) and v not in hidden and v.aval.shape == shape]
    return all(v.aval.shape == shape for v in read) and all(v in widened for v in others)


def _is_literal(v: Any) -> bool:
    return not hasattr(v, "count") and hasattr(v, "val")


def _called_programs(eqn: Any) -> Iterator[tuple[Any, list[tuple[int, int]], int]]:
    """``(program, [(operand index, program input index)], times it runs)`` of each program an
    equation calls with its operands."""
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        inner = params["jaxpr"].jaxpr
        yield inner, [(i, i) for i in range(len(eqn.invars))], int(params["length"])
    elif name == "while":
        body = params["body_jaxpr"].jaxpr
        c = params["cond_nconsts"]
        yield body, [(c + i, i) for i in range(len(eqn.invars) - c)], 1
    elif name == "cond":
        for branch in params["branches"]:
            yield branch.jaxpr, [(i + 1, i) for i in range(len(eqn.invars) - 1)], 1
    else:
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            inner = params.get(key)
            if inner is None:
                continue
            inner = getattr(inner, "jaxpr", inner)
            if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
                yield inner, [(i, i) for i in range(len(eqn.invars))], 1
                return


def _flops(eqn: Any) -> float:
    """Multiply-adds x 2 of a matmul: each output element sums its contracted dimensions (a
    ragged matmul's rows each meet one group's weight)."""
    out = math.prod(eqn.outvars[0].aval.shape)
    lhs = eqn.invars[0].aval.shape
    return 2.0 * out * math.prod(lhs[d] for d in _contracted(eqn)[0])


def _contracted(eqn: Any) -> tuple[Sequence[int], Sequence[int]]:
    """The contracted dimensions of a matmul's two operands."""
    if eqn.primitive.name == "ragged_dot_general":
        return eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[0]
    return eqn.params["dimension_numbers"][0]


def _kind(eqn: Any, weight: int) -> str:
    """``"dense"`` where the weight keeps a dimension that is neither contracted nor shared with
    the tokens' operand (a batch dimension): every expert of it meets every token."""
    if eqn.primitive.name == "ragged_dot_general":
        return "routed"
    (contract, batch) = eqn.params["dimension_numbers"]
    shape = eqn.invars[weight].aval.shape
    tied = set(contract[weight]) | set(batch[weight])
    free = [shape[d] for d in range(len(shape)) if d not in tied]
    # A weight of one expert (sliced out of the stack) has one free dimension: its outputs.
    return "dense" if len(free) >= 2 and not batch[weight] else "routed"


def _features(eqn: Any, tokens: int) -> int:
    """The features of each token a matmul contracts (the model dimension, for an input projection)."""
    contract = _contracted(eqn)
    shape = eqn.invars[tokens].aval.shape
    return int(math.prod(shape[d] for d in contract[tokens]))


def expert_traffic(
    layers: Iterable[MixtureLayer], rows_split: int, expert_axis: int, itemsize: int, top_k: int = 0, tokens: int = 0
) -> float:
    """Bytes one device moves at least over the ``expert`` axis in one step.

    Args:
      layers: the mixtures (:func:`mixture_layers`); ``slots`` are of the whole traced batch.
      rows_split: devices the batch's rows are split over (``data x fsdp x expert``).
      expert_axis: ``n``, the size of the ``expert`` mesh axis.
      itemsize: bytes of an activation element.
      top_k: experts per token of a dropless dispatch (0 otherwise): one padded to every token
        of its group is bounded by the tokens it routes, ``tokens x top_k``.
      tokens: tokens of the traced batch (with ``top_k``).

    Returns:
      Routed: ``4 x (n-1)/n x slots / rows_split x dim x itemsize`` per layer and call (dispatch
      and combine, forward and backward). Dense: ``4 x (n-1)/n x (tokens of an expert group) x
      dim x itemsize`` (the rows gathered and the outputs reduce-scattered, each way).
    """
    total = 0.0
    for layer in layers:
        if layer.style == "dense":
            group = layer.slots / layer.experts / max(rows_split // expert_axis, 1)
            total += layer.count * 4 * moved_bytes("all-gather", group * layer.dim * itemsize, expert_axis)
            continue
        routed = layer.slots
        if top_k and tokens and layer.slots >= layer.experts * tokens:
            routed = tokens * top_k
        total += layer.count * dispatch_bytes(routed / rows_split * layer.dim * itemsize, expert_axis)
    return total


def parameter_leaves(model: Any, abstract: Any = None) -> list[tuple[str, tuple[int, ...], tuple[Any, ...] | None]]:
    """``(path, shape, logical names)`` of a shardkit model's parameter leaves, in tree order
    (``abstract``: its parameters' shapes, where the caller has them already)."""
    abstract = model.abstract_params() if abstract is None else abstract
    shapes = jax.tree_util.tree_flatten_with_path(abstract)[0]
    axes = jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, Axes))
    return [
        (path_str(p), tuple(leaf.shape), tuple(ax.names) if ax.names else None)
        for (p, leaf), ax in zip(shapes, axes, strict=True)
    ]


def top_k_in(closed_jaxpr: Any) -> int:
    """The largest ``k`` of the ``jax.lax.top_k`` calls in a traced program (0 for none): a
    router's experts per token."""

    def walk(jaxpr: Any) -> Iterator[int]:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "top_k":
                yield int(eqn.params["k"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    return max(walk(closed_jaxpr.jaxpr), default=0)


def traced_forward(model: Any, loss: Any, batch: Any, abstract: Any = None) -> Any:
    """The forward loss of ``model`` on abstract ``batch`` as a closed jaxpr whose first inputs
    are the parameters' leaves (nothing is computed or allocated; ``abstract``: the parameters'
    shapes, where the caller has them)."""
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)

    def forward_loss(params: Any, rows: Any, state: Any) -> Any:
        return loss(lambda inputs: load_apart(apply_model(model, params, state, inputs, jax.random.key(0))[0])[0], rows)

    rows = jax.tree.map(shape, dict(batch))
    abstract = model.abstract_params() if abstract is None else abstract
    with traced_as_native():  # the rows the experts compute, not a CPU fallback's padded blocks
        return jax.make_jaxpr(forward_loss)(abstract, rows, model.abstract_model_state())


def bound_terms(
    model: Any,
    loss: Any,
    batch: Any,
    param_specs: Any,
    layout_shape: dict[str, int],
    itemsize: int,
    tokens: int = 0,
    held: Any = None,
) -> dict[str, float]:
    """The expert keywords of :func:`shardkit.analysis.report.lower_bound` for ``model``
    stepping on ``batch`` under ``layout_shape`` (all 0 for a model without experts).
    ``held``: the parameters as the state holds them (bf16 under a bf16 policy), whose bytes
    the bound counts; default the model's own.

    Returns:
      ``expert_param_bytes``, ``expert_whole_over_tensor_bytes``, ``expert_bytes`` (the
      dispatch and combine) and ``expert_calls`` (the mixtures' calls a step), the last two
      traced only where the layout has an ``expert`` axis.
    """
    abstract = model.abstract_params()
    leaves = parameter_leaves(model, abstract)
    experts = expert_weights(leaves)
    out = {"expert_param_bytes": 0.0, "expert_whole_over_tensor_bytes": 0.0, "expert_bytes": 0.0, "expert_calls": 0}
    if not experts:
        return out
    params = jax.tree.leaves(abstract if held is None else held)
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for i in experts:
        size = params[i].size * np.dtype(params[i].dtype).itemsize
        out["expert_param_bytes"] += size
        split = any("tensor" in entry_axes(entry) for entry in specs[i])
        if layout_shape.get("tensor", 1) > 1 and not split:  # as the bound counts the others
            out["expert_whole_over_tensor_bytes"] += size
    e = layout_shape.get("expert", 1)
    if e > 1:
        traced = traced_forward(model, loss, batch, abstract)
        rows_split = layout_shape.get("data", 1) * layout_shape.get("fsdp", 1) * e
        # A dropless dispatch pads each expert to every token of its group; its bound is what it routes.
        top_k = int(model.info.get("top_k", 0)) or top_k_in(traced) if model.info.get("moe_dropless") else 0
        layers = mixture_layers(traced, leaves)
        out["expert_bytes"] = expert_traffic(layers, rows_split, e, itemsize, top_k, tokens)
        out["expert_calls"] = sum(layer.count for layer in layers)
    return out
