"""The sharding plan: every sharding decision of a training run, as one plain value.

:func:`plan_sharding` takes a model, an optimizer, a layout, rules and a precision policy and
returns a :class:`ShardingPlan`: the mesh, the ``PartitionSpec`` of every parameter and of the
whole train state (optimizer moments follow their parameter, counters are replicated), the
replicated fallbacks, and the specs of batches and the rows each process holds. Building it
compiles nothing; it can be printed, tested and handed to the step builder and to reports
(like haliax's ``ResourceMapping`` or optax's ``GradientTransformation``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.core.errors import LayoutError, ShardkitError
from shardkit.core.mesh import Layout, as_layout
from shardkit.core.partition import Axes, annotates_any, named, path_str, specs_for
from shardkit.core.precision import Precision
from shardkit.core.rules import Fallback, Rules, entry_axes, experts_over_tensor, resolve
from shardkit.core.state import TrainState

if TYPE_CHECKING:  # the model layer sits above this one; a plan only reads a model's shapes and names
    from shardkit.models.model import Model, Params


def _check_rows(name: str, rows: int, axes: list[str], mesh_shape: Mapping[str, int]) -> None:
    """Refuse a batch whose rows do not split over its batch axes, naming the nearest sizes that do."""
    split = math.prod(mesh_shape[a] for a in axes)
    if rows % split == 0:
        return
    below, above = rows // split * split, (rows // split + 1) * split
    sizes = f"{below} or {above}" if below else f"{above}"
    raise LayoutError(
        f"batch[{name!r}] has {rows} rows, which do not split over the {split} devices of its batch axes "
        f"({' x '.join(axes)}): use a multiple of {split}, e.g. {sizes} (--batch on the command line), or a layout "
        f"whose {' x '.join(axes)} divides {rows}."
    )


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingPlan:
    """Where every array of a training run lives.

    Attributes:
      layout: the resolved layout (no ``-1``).
      mesh: the device mesh.
      rules: the logical-to-mesh rules in force.
      batch_axes: logical names per batch entry (default: dimension 0 is ``batch``).
      abstract_params: the parameters' shapes and dtypes.
      param_axes: the parameters' logical names (:class:`shardkit.core.partition.Axes` tree).
      param_specs: ``PartitionSpec`` of every parameter.
      state_specs: ``PartitionSpec`` tree of the whole :class:`TrainState`.
      fallbacks: dimensions replicated because they did not divide (``allow_replicate``).
      zero: the ZeRO stage over the ``data`` axis: 0 (off), 1 (optimizer state and master
        weights sharded over it), 2 (gradients too). Stage 3 is the ``fsdp`` axis.
      update_specs: ``PartitionSpec`` of each parameter's optimizer-side copies (moments, master
        weights): the parameter's spec, plus the ``data`` axis on one dimension under ZeRO.

    Example:
      >>> import optax, shardkit as sk
      >>> from shardkit.core.precision import as_precision
      >>> model = sk.models.GPTConfig.preset("tiny").model()
      >>> adamw, fp32 = optax.adamw(1e-3), as_precision("fp32")
      >>> plan = plan_sharding(model, adamw, "fsdp=8", rules=sk.default_rules(), precision=fp32)
      >>> plan.param_specs["lm_head"]
      P('fsdp', None)
    """

    layout: Layout
    mesh: Mesh
    rules: Rules
    batch_axes: Mapping[str, Sequence[str | None]]
    abstract_params: Params
    param_axes: Any
    param_specs: Any
    state_specs: TrainState
    fallbacks: tuple[Fallback, ...] = ()
    zero: int = 0
    update_specs: Any = None

    @property
    def grad_specs(self) -> Any:
        """Where gradients are reduced to: whole over ``data`` (an all-reduce), or under ZeRO-2
        split like the optimizer state (a reduce-scatter)."""
        return self.update_specs if self.zero >= 2 else self.param_specs

    @property
    def splits_gradients(self) -> bool:
        """Whether the compiled step reduces some gradient to shards over a mesh axis that splits
        the batch: a reduce-scatter rather than an all-reduce. FSDP and ZeRO-2 ask for it; at
        ZeRO-1 XLA carries the optimizer state's split (``update_specs``) back into the gradients
        by itself, so the optimizer's specs decide."""
        mesh_shape = dict(self.mesh.shape)
        batch = {a for a in dict(self.rules.rules).get("batch", ()) if mesh_shape.get(a, 1) > 1}
        leaves = jax.tree.leaves(self.update_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        return bool(batch & {a for spec in leaves for entry in spec for a in entry_axes(entry)})

    @property
    def stacks_layers(self) -> bool:
        """Whether the parameters are stacked over a ``layers`` dimension (a scanned layer stack,
        whose loop gathers one layer per iteration whatever the schedule)."""
        axes = jax.tree.leaves(self.param_axes, is_leaf=lambda x: isinstance(x, Axes))
        return any(a.names is not None and "layers" in a.names for a in axes)

    @property
    def state_shardings(self) -> TrainState:
        """``NamedSharding`` tree of the train state."""
        return named(self.state_specs, self.mesh)

    def constrain(self, tree: Any, shardings: Any) -> Any:
        """Pin ``tree`` to ``shardings`` inside a traced step: a constraint on Auto axes, a
        ``reshard`` on Explicit ones (whose types carry the sharding)."""
        if self.layout.explicit:
            return jax.sharding.reshard(tree, shardings)
        return jax.lax.with_sharding_constraint(tree, shardings)

    def batch_specs(self, batch: Mapping[str, Any]) -> dict[str, PartitionSpec]:
        """PartitionSpec of each batch entry, from ``batch_axes`` (default: dim 0 is ``batch``)."""
        mesh_shape = dict(self.mesh.shape)
        specs = {}
        for name, value in batch.items():
            shape = tuple(value.shape)
            names = self.batch_axes.get(name, ("batch",) + (None,) * (len(shape) - 1) if shape else None)
            if shape and names and names[0] == "batch" and "batch" in self.rules:
                _check_rows(name, shape[0], [a for a in self.rules["batch"] if mesh_shape.get(a, 1) > 1], mesh_shape)
            specs[name] = resolve(names, shape, self.rules, mesh_shape, what=f"batch[{name!r}]")
        return specs

    def batch_shards(self, batch: Mapping[str, Any]) -> dict[str, int]:
        """How many devices split each batch entry's rows."""
        mesh_shape = dict(self.mesh.shape)
        return {
            name: math.prod(mesh_shape[a] for a in entry_axes(spec[0])) if len(spec) else 1
            for name, spec in self.batch_specs(batch).items()
        }

    def check_microbatches(self, batch: Mapping[str, Any], microbatches: int) -> None:
        """Refuse a batch whose rows do not split into ``microbatches`` on every device."""
        for name, shards in self.batch_shards(batch).items():
            rows = batch[name].shape[0] if batch[name].shape else 0
            if rows % (microbatches * shards):
                raise LayoutError(
                    f"batch[{name!r}] has {rows} rows: with microbatches={microbatches} and the batch "
                    f"split over {shards} devices it needs a multiple of {microbatches * shards}. "
                    "Change the batch size or the number of microbatches."
                )

    def local_rows(self, batch_size: int) -> slice:
        """The rows of a global batch that this process's devices hold (contiguous).

        Each process reads only these rows of every global batch, and the global arrays are
        assembled without moving data between hosts.
        """
        spec = self.batch_specs({"tokens": jax.ShapeDtypeStruct((batch_size, 1), jnp.int32)})["tokens"]
        sharding = NamedSharding(self.mesh, spec)
        starts_stops = {
            (idx[0].start or 0, batch_size if idx[0].stop is None else idx[0].stop)  # type: ignore[index]
            for idx in sharding.addressable_devices_indices_map((batch_size, 1)).values()
        }
        start, stop = min(a for a, _ in starts_stops), max(b for _, b in starts_stops)
        covered = sum(b - a for a, b in starts_stops)
        if covered != stop - start or (stop - start) * jax.process_count() != batch_size:
            raise LayoutError(
                f"With layout {self.layout.spec()} this process's devices hold rows {sorted(starts_stops)} of the "
                f"batch, not one contiguous share of it. Put the axes that span hosts first in the batch axes "
                "(e.g. across_hosts=data)."
            )
        return slice(start, stop)

    def table(self) -> list[dict[str, Any]]:
        """One row per parameter: path, shape, logical axes, spec and per-device shard shape."""
        rows = []
        flat_axes = dict(_flatten(self.param_axes, is_leaf=lambda x: isinstance(x, Axes)))
        flat_specs = dict(_flatten(self.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
        mesh_shape = dict(self.mesh.shape)
        for path, leaf in _flatten(self.abstract_params):
            spec = flat_specs[path]
            entries = tuple(spec) + (None,) * (len(leaf.shape) - len(spec))
            shard = tuple(dim // math.prod(mesh_shape[a] for a in entry_axes(e)) for dim, e in zip(leaf.shape, entries))
            rows.append(
                {
                    "path": path,
                    "shape": tuple(leaf.shape),
                    "logical": str(flat_axes[path]),
                    "spec": spec_str(spec, len(leaf.shape)),
                    "shard": shard,
                    "bytes_per_device": math.prod(shard) * jnp.dtype(leaf.dtype).itemsize,
                }
            )
        return rows

    def format_table(self) -> str:
        """The parameter table as aligned text (scaling-book notation in the spec column)."""
        rows = self.table()
        header = ("parameter", "shape", "logical axes", "spec", "per device")
        lines = [
            (r["path"], "x".join(map(str, r["shape"])), r["logical"], r["spec"], "x".join(map(str, r["shard"])))
            for r in rows
        ]
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
        out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
        return "\n".join(out)


def plan_sharding(
    model: Model,
    optimizer: optax.GradientTransformation,
    layout: Layout | str | Mapping[str, int],
    *,
    rules: Rules,
    precision: Precision,
    batch_axes: Mapping[str, Sequence[str | None]] | None = None,
    allow_replicate: bool = False,
    devices: Sequence[jax.Device] | None = None,
    zero: int = 0,
    fsdp_min_size: int | None = None,
    experts_over_tensor: bool = True,
) -> ShardingPlan:
    """Resolve where every parameter, optimizer state and batch array lives; compiles nothing.

    A model that names no parameter's axes is split over ``fsdp`` anyway
    (:func:`unnamed_fsdp_specs`): ZeRO-3 for any model, as PyTorch's FSDP gives.

    Args:
      model: the model (its parameters' logical names and shapes).
      optimizer: the optax transformation (its state's structure).
      layout: mesh axis sizes (``-1`` fills the devices).
      rules: logical-to-mesh rules.
      precision: the precision policy (it decides whether a master copy exists).
      batch_axes: logical names per batch entry.
      allow_replicate: replicate non-dividing parameter dimensions, listed in ``fallbacks``.
      devices: the devices of the mesh (default: all).
      zero: ZeRO stage 0, 1 or 2 over the ``data`` axis (see :class:`ShardingPlan`).
      fsdp_min_size: which parameters stay whole over ``fsdp`` (:func:`keep_vectors_whole`):
        None, vectors per layer (norm scales, biases); N, fewer than N elements per layer; 0, none.
      experts_over_tensor: split the experts of a mixture of experts over ``tensor`` where the
        layout has no ``expert`` axis and they divide
        (:func:`shardkit.core.rules.experts_over_tensor`); False keeps ``rules`` as given.

    Returns:
      The :class:`ShardingPlan`.
    """
    devices = list(jax.devices() if devices is None else devices)
    resolved = as_layout(layout).resolve(len(devices))
    mesh = resolved.make_mesh(devices)
    abstract_params = model.abstract_params()  # eval_shape once
    if experts_over_tensor:
        rules = _experts_over_tensor_where_they_divide(model, abstract_params, rules, mesh)
    fallbacks: list[Fallback] = []
    param_specs = specs_for(
        model.axes, abstract_params, rules, mesh, allow_replicate=allow_replicate, fallbacks=fallbacks
    )
    if not annotates_any(model.axes):
        # A model that names no parameter's axes still gets ZeRO-3 under fsdp, as PyTorch FSDP
        # shards any module.
        param_specs = unnamed_fsdp_specs(abstract_params, dict(mesh.shape))
    param_specs = keep_vectors_whole(param_specs, abstract_params, model.axes, fsdp_min_size)
    abstract_opt = jax.eval_shape(lambda p: optimizer.init(precision.optimizer_copy(p)), abstract_params)
    update_specs = zero_specs(param_specs, abstract_params, dict(mesh.shape)) if zero else param_specs
    replicated: Any = PartitionSpec()  # a leaf of the state's tree of specs
    state_specs = TrainState(
        step=replicated,
        params=param_specs,
        opt_state=follow_params(abstract_opt, abstract_params, update_specs),
        rng=replicated,
        master=_master_specs(model, update_specs) if precision.master is not None else None,
        # Running statistics are per channel (small) and every device's forward reads them whole.
        model_state=jax.tree.map(lambda _: replicated, model.abstract_model_state()),
    )
    return ShardingPlan(
        resolved,
        mesh,
        rules,
        dict(batch_axes or {}),
        abstract_params,
        model.axes,
        param_specs,
        state_specs,
        tuple(fallbacks),
        zero,
        update_specs,
    )


def _experts_over_tensor_where_they_divide(model: Model, abstract_params: Any, rules: Rules, mesh: Mesh) -> Rules:
    """:func:`~shardkit.core.rules.experts_over_tensor` where every parameter's experts divide
    over ``tensor`` (otherwise the hidden units keep it, as before)."""
    extended = experts_over_tensor(rules, dict(mesh.shape))
    if extended is rules:
        return rules
    try:
        specs_for(model.axes, abstract_params, extended, mesh)
    except ShardkitError:
        return rules
    return extended


def unnamed_fsdp_specs(abstract_params: Any, mesh_shape: Mapping[str, int]) -> Any:
    """Specs for a model that names no axes: each parameter split over ``fsdp`` on its largest
    dimension that the axis size divides (the first of equals), whole where none does.

    The largest rather than the first: a stack of layers (``nnx.vmap``, ``nn.scan``) keeps its
    layer dimension whole, so each step of a scan over it reads its own layer's shard.

    Example:
      >>> import jax
      >>> unnamed_fsdp_specs({"w": jax.ShapeDtypeStruct((8, 64, 256), "float32")}, {"fsdp": 8})
      {'w': P(None, None, 'fsdp')}
    """
    size = mesh_shape.get("fsdp", 1)

    def split(leaf: Any) -> PartitionSpec:
        dims = [d for d, n in enumerate(leaf.shape) if n % size == 0]
        if size == 1 or not dims:
            return PartitionSpec()
        d = max(dims, key=lambda d: (leaf.shape[d], -d))
        return PartitionSpec(*([None] * d), "fsdp", *([None] * (len(leaf.shape) - d - 1)))

    return jax.tree.map(split, abstract_params)


def keep_vectors_whole(
    param_specs: Any, abstract_params: Any, param_axes: Any, min_size: int | None = None, axis: str = "fsdp"
) -> Any:
    """Each parameter's spec without ``axis`` where the parameter is too small to be worth
    splitting over it: DeepSpeed ZeRO-3's ``param_persistence_threshold``.

    Under FSDP every split parameter is gathered before each use and its gradient reduce-scattered
    after: one collective each way per parameter per layer. A norm scale or a bias is a few KB,
    so those collectives cost their latency and nothing else, and a whole copy on every device
    costs little memory. ``min_size=None`` (the default) keeps every parameter whole that is a
    vector per layer: one dimension besides a stacked ``layers`` dimension (norm scales, biases),
    whatever the model's width, while every matrix is split. An int keeps whole the parameters
    of fewer than ``min_size`` elements per layer (DeepSpeed's rule); 0 splits everything.

    Args:
      param_specs: ``PartitionSpec`` of each parameter.
      abstract_params: the parameters' shapes (the same tree).
      param_axes: the parameters' logical names (:class:`shardkit.core.partition.Axes` tree), which
        say which dimension, if any, stacks layers.
      min_size: elements per layer under which a parameter stays whole; None: vectors stay whole.
      axis: the mesh axis to drop.

    Returns:
      The tree of specs, ``axis`` removed from the small parameters'.

    Example:
      >>> import jax
      >>> from shardkit.core.partition import Axes
      >>> specs = {"scale": PartitionSpec(None, "fsdp"), "w": PartitionSpec(None, "fsdp", None)}
      >>> shapes = {"scale": jax.ShapeDtypeStruct((4, 64), "float32"),
      ...           "w": jax.ShapeDtypeStruct((4, 64, 256), "float32")}
      >>> axes = {"scale": Axes(("layers", "embed")), "w": Axes(("layers", "embed", "mlp"))}
      >>> keep_vectors_whole(specs, shapes, axes)
      {'scale': P(None, None), 'w': P(None, 'fsdp', None)}
    """
    if min_size == 0:
        return param_specs

    def small(leaf: Any, ax: Axes) -> bool:
        names = ax.names or ()
        layer_dims = [d for d, name in enumerate(names) if name == "layers"]
        per_layer = [n for d, n in enumerate(leaf.shape) if d not in layer_dims]
        if min_size is None:
            return len(per_layer) <= 1
        return math.prod(per_layer) < min_size

    def one(spec: PartitionSpec, leaf: Any, ax: Axes) -> PartitionSpec:
        if not small(leaf, ax) or not any(axis in entry_axes(e) for e in spec):
            return spec
        return PartitionSpec(*(_without(entry, axis) for entry in spec))

    return jax.tree.map(one, param_specs, abstract_params, param_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _without(entry: Any, axis: str) -> Any:
    """A ``PartitionSpec`` entry without ``axis``: None, one name, or a tuple of names."""
    kept = tuple(a for a in entry_axes(entry) if a != axis)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def unnamed_model_note(model: Model, mesh_shape: Mapping[str, int]) -> str | None:
    """A warning for a layout that splits weights over axes a model without names cannot use."""
    idle = [f"{a}={mesh_shape[a]}" for a in ("tensor", "expert") if mesh_shape.get(a, 1) > 1]
    if not idle or annotates_any(model.axes):
        return None
    return (
        f"{model.name} names no parameter's axes, so nothing is split over {', '.join(idle)}: those devices repeat "
        "each other's work (its weights are split over fsdp only). Fix: name the axes (sk.annotate(model, "
        "[(r'up/kernel$', ('embed', 'mlp')), ...]) or Flax's with_partitioning), or leave "
        f"{' and '.join(a.split('=')[0] for a in idle)} out of the layout."
    )


# Logical names of an experts dimension: shardkit's, and Linen's / NNX's mesh-axis spelling.
EXPERT_NAMES = frozenset({"experts", "expert"})


def rows_only_expert_note(model: Model, mesh_shape: Mapping[str, int]) -> str | None:
    """A note for an ``expert`` axis under a model with no experts: accepted, as one more axis
    that splits the rows (the step is data parallelism over it), and said so."""
    e = mesh_shape.get("expert", 1)
    if e == 1 or not annotates_any(model.axes):
        return None
    leaves = jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, Axes))
    if any(name in EXPERT_NAMES for ax in leaves for name in (ax.names or ()) if isinstance(name, str)):
        return None
    return (
        f"expert={e} splits only the rows: {model.name} has no experts (no parameter dimension named 'experts'), "
        f"so the step runs as data={e} would. Fix: name the experts' dimension of its expert weights 'experts', "
        f"or write data={e}."
    )


def zero_specs(param_specs: Any, abstract_params: Any, mesh_shape: Mapping[str, int], axis: str = "data") -> Any:
    """Each parameter's spec with ``axis`` added to its first dimension that still divides (the
    ZeRO split of optimizer state); a parameter no dimension of which divides stays as it was.

    Example:
      >>> import jax
      >>> zero_specs({"w": PartitionSpec(None, "tensor")}, {"w": jax.ShapeDtypeStruct((8, 4), "float32")},
      ...            {"data": 4, "tensor": 2})
      {'w': P('data', 'tensor')}
    """
    size = mesh_shape.get(axis, 1)
    if size == 1:
        return param_specs

    def add(spec: PartitionSpec, leaf: Any) -> PartitionSpec:
        entries = list(spec) + [None] * (len(leaf.shape) - len(spec))
        if any(axis in entry_axes(e) for e in entries):
            return spec
        for d, entry in enumerate(entries):
            axes = entry_axes(entry)
            if leaf.shape[d] % (math.prod(mesh_shape[a] for a in axes) * size) == 0:
                entries[d] = (axis, *axes) if axes else axis
                return PartitionSpec(*entries)
        return spec

    return jax.tree.map(add, param_specs, abstract_params, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _master_specs(model: Model, update_specs: Any) -> Any:
    """Where the master copy lives: as the optimizer's copies, none for a frozen parameter
    (:func:`shardkit.core.state.master_copy`)."""
    if model.trainable is None:
        return update_specs
    is_spec = lambda x: isinstance(x, PartitionSpec)
    return jax.tree.map(
        lambda spec, t: spec if t else optax.MaskedNode(), update_specs, model.trainable_mask(), is_leaf=is_spec
    )


def follow_params(opt_state: Any, params: Any, param_specs: Any) -> Any:
    """Specs for an optax state: subtrees shaped like the params (moments) follow them; the rest
    (step counters, scalars) is replicated. A subtree with ``optax.MaskedNode`` where a frozen
    parameter would be (``optax.multi_transform``: LoRA's adapters on a frozen base) follows
    the params it holds."""
    params_def = jax.tree.structure(params)
    masked = lambda x: isinstance(x, optax.MaskedNode)

    def is_param_like(x: Any) -> bool:
        try:
            if jax.tree.structure(x, is_leaf=masked) != params_def:  # type: ignore[operator]
                return False
            return all(
                masked(a) or getattr(a, "shape", None) == b.shape
                for a, b in zip(jax.tree.leaves(x, is_leaf=masked), jax.tree.leaves(params), strict=True)
            )
        except (ValueError, TypeError):
            return False

    def follow(sub: Any) -> Any:
        leaves = jax.tree.leaves(sub, is_leaf=masked)
        specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        chosen = [a if masked(a) else spec for a, spec in zip(leaves, specs, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(sub, is_leaf=masked), chosen)

    return jax.tree.map(
        lambda sub: follow(sub) if is_param_like(sub) else jax.tree.map(lambda _: PartitionSpec(), sub),
        opt_state,
        is_leaf=is_param_like,
    )


def spec_str(spec: PartitionSpec, ndim: int) -> str:
    """``PartitionSpec('fsdp', None)`` as ``[fsdp, -]`` (scaling-book style)."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return "[" + ", ".join("+".join(entry_axes(e)) or "-" for e in entries) + "]"


def _flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    return [(path_str(p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]
