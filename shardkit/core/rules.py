"""Rules: which mesh axes each logical axis is sharded over, and the one resolver.

A ``Rules`` is an ordered map ``logical axis -> mesh axes``. Order is priority: when two
dimensions of one array want the same mesh axis, the one whose logical name comes first gets
it, and the other skips that axis. Presets are small ``Rules`` that compose with ``+``: a
logical name present in both gets the union of their mesh axes (FSDP + data parallelism shard
``batch`` over ``data`` and ``fsdp``).

The resolver semantics are the same for every source of annotations (NNX, Linen, regex) and
for parameters, optimizer state, batches and activations:

1. every logical name must be known to the rules (``None`` means "not sharded");
2. mesh axes of size 1 are dropped, and a mesh axis is used at most once per array;
3. a dimension must divide by the product of its mesh axes; otherwise it is an error, unless
   the caller passed ``allow_replicate=True``, in which case that dimension is replicated and
   the fallback is reported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from jax.sharding import PartitionSpec

from shardkit.core.errors import AnnotationError, LayoutError, RuleError, short_repr
from shardkit.core.mesh import MESH_AXES

# Logical axis names shardkit's models use, in default priority order.
LOGICAL_AXES: tuple[str, ...] = (
    "experts",  # before batch: expert buffers (experts, batch, ...) keep the expert axis for experts
    "batch",
    "layers",
    "vocab",
    "heads",
    "kv_heads",
    "mlp",
    "seq",
    "embed",
    "kv",
)

LogicalNames = Sequence[str | None]


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A dimension the resolver replicated because it did not divide its mesh axes."""

    what: str
    dim: int
    logical: str
    size: int
    mesh_axes: tuple[str, ...]
    shards: int

    def __str__(self) -> str:
        return (
            f"{self.what}: dim {self.dim} ({self.logical}={self.size}) does not divide over "
            f"{'x'.join(self.mesh_axes)}={self.shards}; replicated"
        )


@dataclasses.dataclass(frozen=True)
class Rules:
    """Ordered map from logical axis to mesh axes. Compose with ``+``.

    Example:
      >>> r = Rules.of(batch="data") + Rules.of(batch="fsdp", embed="fsdp")
      >>> r["batch"]
      ('data', 'fsdp')
    """

    rules: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def of(cls, **rules: str | Sequence[str] | None) -> Rules:
        """``Rules.of(batch=("data", "fsdp"), mlp="tensor", kv=None)``."""
        return cls(tuple((name, _as_axes(name, axes)) for name, axes in rules.items()))

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str | Sequence[str] | None]]) -> Rules:
        """Build from ``[(logical, mesh_axes), ...]``, joining repeated names."""
        out = cls()
        for name, axes in pairs:
            out = out + cls(((name, _as_axes(name, axes)),))
        return out

    def __add__(self, other: Rules) -> Rules:
        merged: dict[str, tuple[str, ...]] = dict(self.rules)
        for name, axes in other.rules:
            joined = merged.get(name, ()) + tuple(a for a in axes if a not in merged.get(name, ()))
            merged[name] = _canonical_order(joined)
        return Rules(tuple(merged.items()))

    def __getitem__(self, name: str) -> tuple[str, ...]:
        return dict(self.rules)[name]

    def __contains__(self, name: object) -> bool:
        return name in dict(self.rules)

    def __str__(self) -> str:
        return ", ".join(f"{n}->{'+'.join(a) if a else '-'}" for n, a in self.rules)


RulesLike = Rules | Iterable[tuple[str, str | Sequence[str] | None]]

NOT_RULES = """\
rules must be a shardkit Rules or Flax-style logical axis rules (a list of
(logical name, mesh axis or axes or None) pairs), got {got}.
Fix: sk.Rules.of(batch=("data", "fsdp"), mlp="tensor"), or
[("batch", ("data", "fsdp")), ("mlp", "tensor"), ("embed", None)].
"""


def as_rules(rules: RulesLike) -> Rules:
    """A ``Rules`` from itself or from Flax's ``logical_axis_rules`` format.

    Flax (T5X, MaxText) writes rules as ``[(logical, mesh_axes), ...]`` in priority order; a
    name given twice gets both entries' mesh axes.

    Example:
      >>> as_rules([("batch", "data"), ("batch", "fsdp"), ("mlp", "tensor"), ("embed", None)])["batch"]
      ('data', 'fsdp')
    """
    if isinstance(rules, Rules):
        return rules
    if isinstance(rules, str | bytes | Mapping) or not isinstance(rules, Iterable):
        raise RuleError(NOT_RULES.format(got=short_repr(rules)))
    pairs = list(rules)
    if not all(isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
        raise RuleError(NOT_RULES.format(got=short_repr(pairs)))
    return Rules.from_pairs(pairs)


def _as_axes(name: str, axes: str | Sequence[str] | None) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        axes = (axes,)
    axes = tuple(axes)
    if len(set(axes)) != len(axes):
        raise RuleError(
            f"Rule {name!r} -> {axes} names a mesh axis twice; a dimension can use each mesh axis "
            f"once. Write {name!r} -> {tuple(dict.fromkeys(axes))}."
        )
    return axes


def _canonical_order(axes: tuple[str, ...]) -> tuple[str, ...]:
    rank = {a: i for i, a in enumerate(MESH_AXES)}
    return tuple(sorted(axes, key=lambda a: rank.get(a, len(MESH_AXES))))


# Presets: each is the rule set of one kind of parallelism; a layout's rules are their sum.
def base() -> Rules:
    """Every standard logical axis, unsharded: the vocabulary the other presets extend."""
    return Rules(tuple((name, ()) for name in LOGICAL_AXES))


def data_parallel() -> Rules:
    """Batches split over ``data``; parameters replicated."""
    return Rules.of(batch="data")


def fsdp() -> Rules:
    """ZeRO-3: batches split over ``fsdp`` and parameters split on their ``embed`` dimension."""
    return Rules.of(batch="fsdp", embed="fsdp")


def tensor_parallel() -> Rules:
    """Megatron: attention heads, MLP hidden units and vocabulary split over ``tensor``."""
    return Rules.of(heads="tensor", kv_heads="tensor", mlp="tensor", vocab="tensor")


def sequence_parallel() -> Rules:
    """Activations split along the sequence over the ``sequence`` axis."""
    return Rules.of(seq="sequence")


def tensor_sequence_parallel() -> Rules:
    """Megatron sequence parallelism: between attention and MLP blocks (norms, dropout, residual),
    activations are split along the sequence over ``tensor``; inside the blocks heads and hidden
    units keep ``tensor`` (they come first in priority), so each tensor-parallel all-reduce
    becomes an all-gather plus a reduce-scatter."""
    return Rules.of(seq="tensor")


def expert_parallel() -> Rules:
    """Experts of a mixture-of-experts layer split over ``expert``; everywhere else the ``expert``
    axis splits the batch (so tokens travel to their experts with all-to-alls)."""
    return Rules.of(experts="expert", batch="expert")


def experts_over_tensor(rules: Rules, mesh_shape: Mapping[str, int]) -> Rules:
    """``rules`` with the ``experts`` dimension split over ``tensor`` too, where a layout has
    ``tensor`` but no ``expert`` axis (``experts`` comes first, so the MLP's hidden units then
    stay whole inside each expert).

    Why experts and not hidden units: a mixture of experts computes every expert on buffers of
    the tokens routed to it (``(experts, batch, capacity, embed)``: top-k times a capacity factor
    the size of the tokens). Splitting hidden units leaves a partial sum of those buffers, which
    is all-reduced at their size, forward and backward. Splitting experts keeps each expert whole
    on its device; the partial sum appears where the experts' outputs are combined back into
    tokens, at the tokens' size: one all-reduce, as for a Megatron MLP. The flops and bytes of
    parameters per device are the same either way. With an ``expert`` axis the experts are
    split over it (tokens travel by all-to-all) and this rule stays out.

    Example:
      >>> experts_over_tensor(default_rules(), {"data": 4, "tensor": 2})["experts"]
      ('tensor', 'expert')
      >>> experts_over_tensor(default_rules(), {"expert": 2, "tensor": 2})["experts"]
      ('expert',)
    """
    if mesh_shape.get("tensor", 1) == 1 or mesh_shape.get("expert", 1) > 1 or "experts" not in rules:
        return rules
    if "tensor" in rules["experts"]:
        return rules
    return rules + Rules.of(experts="tensor")


def pipeline_parallel() -> Rules:
    """The stacked ``layers`` dimension split over ``stage``."""
    return Rules.of(layers="stage")


def default_rules() -> Rules:
    """The rules shardkit uses unless told otherwise: all presets joined.

    Axes of size 1 drop out at resolution, so one rule set serves every layout.
    """
    return (
        base()
        + data_parallel()
        + fsdp()
        + tensor_parallel()
        + sequence_parallel()
        + expert_parallel()
        + pipeline_parallel()
    )


def resolve(
    names: LogicalNames | None,
    shape: Sequence[int],
    rules: Rules,
    mesh_shape: Mapping[str, int],
    *,
    what: str = "array",
    allow_replicate: bool = False,
    fallbacks: list[Fallback] | None = None,
) -> PartitionSpec:
    """Resolve the logical names of an array's dimensions into a ``PartitionSpec``.

    Args:
      names: one logical name (or ``None``) per dimension; ``None`` for a fully replicated array.
      shape: the array's global shape.
      rules: the logical-to-mesh rules.
      mesh_shape: mesh axis sizes, e.g. ``dict(mesh.shape)``.
      what: how to name the array in errors, e.g. its parameter path.
      allow_replicate: replicate a dimension that does not divide its mesh axes instead of
        raising; each such case is appended to ``fallbacks``.
      fallbacks: where to report replicated dimensions.

    Returns:
      A ``PartitionSpec`` with one entry per dimension.

    Example:
      >>> from shardkit.core.rules import default_rules
      >>> resolve(("embed", "mlp"), (64, 256), default_rules(), {"fsdp": 2, "tensor": 4})
      P('fsdp', 'tensor')
    """
    if names is None:
        return PartitionSpec()
    names = tuple(names)
    if len(names) != len(shape):
        raise AnnotationError(
            f"{what}: {len(names)} logical axis names {names} for an array of shape {tuple(shape)} "
            f"({len(shape)} dimensions). Give exactly one name (or None) per dimension."
        )
    known = dict(rules.rules)
    unknown = [n for n in names if n is not None and n not in known]
    if unknown:
        raise RuleError(
            f"{what}: logical axis {unknown[0]!r} (in {names}) has no rule. Known: "
            f"{', '.join(known)}. Add one, e.g. rules + sk.Rules.of({unknown[0]}='tensor'), or "
            f"Rules.of({unknown[0]}=None) to keep it unsharded."
        )
    missing_axes = sorted({a for n in names if n for a in known[n]} - set(mesh_shape))
    if missing_axes:
        raise RuleError(
            f"{what}: rules map {names} to mesh axis {missing_axes[0]!r}, which the mesh "
            f"{dict(mesh_shape)} does not have. Add it to the layout (e.g. "
            f"'{missing_axes[0]}=2') or change the rule."
        )
    priority = {n: i for i, n in enumerate(known)}
    named_dims = {d: n for d, n in enumerate(names) if n is not None}
    order = sorted(named_dims, key=lambda d: (priority[named_dims[d]], d))
    used: set[str] = set()
    entries: list[tuple[str, ...]] = [()] * len(names)
    for d in order:
        axes = tuple(a for a in known[named_dims[d]] if mesh_shape[a] > 1 and a not in used)
        shards = math.prod(mesh_shape[a] for a in axes)
        if shape[d] % shards:
            if not allow_replicate:
                raise LayoutError(
                    f"{what}: dimension {d} ({names[d]}={shape[d]}, shape {tuple(shape)}) does not "
                    f"divide over mesh axes {'x'.join(axes)}={shards}. Choose sizes that divide, "
                    f"change the layout, or pass allow_replicate=True to replicate such "
                    f"dimensions (reported)."
                )
            if fallbacks is not None:
                fallbacks.append(Fallback(what, d, named_dims[d], shape[d], axes, shards))
            continue
        entries[d] = axes
        used.update(axes)
    return PartitionSpec(*(_entry(e) for e in entries))


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def entry_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry: ``None`` -> (), ``"fsdp"`` -> ("fsdp",)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def check_spec(spec: PartitionSpec, shape: Sequence[int], mesh_shape: Mapping[str, int], what: str) -> None:
    """Validate a user-given ``PartitionSpec``: known axes, each used once, dimensions divide."""
    if len(spec) > len(shape):
        raise AnnotationError(
            f"{what}: PartitionSpec {spec} has {len(spec)} entries for shape {tuple(shape)}; give at "
            "most one entry per dimension."
        )
    seen: set[str] = set()
    for d, entry in enumerate(spec):
        axes = entry_axes(entry)
        for a in axes:
            if a not in mesh_shape:
                raise RuleError(
                    f"{what}: PartitionSpec {spec} uses mesh axis {a!r}, not in the mesh "
                    f"{dict(mesh_shape)}. Use one of {', '.join(mesh_shape)}."
                )
            if a in seen:
                raise RuleError(
                    f"{what}: PartitionSpec {spec} uses mesh axis {a!r} twice; each mesh axis can "
                    "shard only one dimension of an array. Remove one of them."
                )
            seen.add(a)
        shards = math.prod(mesh_shape[a] for a in axes)
        if shape[d] % shards:
            raise LayoutError(
                f"{what}: dimension {d} of shape {tuple(shape)} does not divide over {axes}={shards}. "
                "Change the spec or the layout."
            )
