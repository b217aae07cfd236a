"""Annotations -> PartitionSpec and NamedSharding trees, and ``constrain`` for activations.

Three sources of logical axis names give one result:

- Flax NNX variable metadata: shardkit's own logical names, written with :func:`logical` under
  a key of shardkit's, and Flax's ``out_sharding`` (``nnx.with_partitioning``);
- Flax Linen boxes: ``nn.LogicallyPartitioned`` (``nn.with_logical_partitioning``) and
  ``nn.Partitioned`` (``nn.with_partitioning``);
- regex rules on parameter paths, for models that carry no annotations at all.

Flax's own names (``out_sharding``, ``nn.Partitioned``) mean mesh axes in Flax: a name that is an
axis of the mesh pins that axis; any other name is a logical name and resolves through the rules
(so a model annotated for Flax's ``logical_axis_rules`` works with those rules passed to the
trainer). shardkit's names are always logical, and strict: a name without a rule is an error.

Each becomes a tree of :class:`Axes` with the parameters' structure, and :func:`specs_for`
resolves it with the one resolver in :mod:`shardkit.core.rules`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.core.errors import RuleError, short_repr
from shardkit.core.rules import Fallback, Rules, check_spec, resolve

# flax 0.12.4+ calls its key 'out_sharding' (earlier: 'sharding_names', 'sharding'); it holds
# mesh axes. shardkit's logical names go under the same key, because flax's transforms
# (nnx.vmap/scan with transform_metadata) insert the stacked axis there, but with a marker of
# shardkit's own, so they are never confused with Flax's mesh axes.
_FLAX_NAMES_KEY = "out_sharding"
_SHARDKIT_MARKER = "shardkit_logical"

FlaxName = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Axes:
    """Logical names of one array's dimensions (a pytree leaf). ``names=None``: replicated.

    ``spec`` instead of names pins an explicit ``PartitionSpec`` (from a regex rule).
    ``flax=True``: the names come from Flax's own metadata, where a name that is a mesh axis
    means that axis (an entry may be a tuple of mesh axes).
    """

    names: tuple[FlaxName, ...] | None = None
    spec: PartitionSpec | None = None
    flax: bool = False

    def __str__(self) -> str:
        if self.spec is not None:
            return str(self.spec)
        if self.names is None:
            return "()"
        return "(" + ", ".join("+".join(n) if isinstance(n, tuple) else str(n) for n in self.names) + ")"


def _is_axes(x: Any) -> bool:
    return isinstance(x, Axes)


def annotates_any(axes: Any) -> bool:
    """Whether a tree of :class:`Axes` names the axes of at least one parameter."""
    return any(a.names is not None or a.spec is not None for a in jax.tree.leaves(axes, is_leaf=_is_axes))


def logical(init: Callable[..., jax.Array], names: Sequence[str | None]) -> Callable[..., jax.Array]:
    """Wrap a Flax NNX initializer so the variable it creates carries logical axis names.

    Args:
      init: an initializer ``(key, shape, dtype) -> array``.
      names: one logical axis name (or None) per dimension, e.g. ``("embed", "mlp")``.

    Returns:
      An initializer to pass as ``kernel_init=`` (or to call in your own ``nnx.Param``).

    Example:
      >>> from flax import nnx
      >>> layer = nnx.Linear(8, 32, rngs=nnx.Rngs(0),
      ...     kernel_init=logical(nnx.initializers.lecun_normal(), ("embed", "mlp")))
    """
    # eager_sharding=False: flax would otherwise read the logical names as mesh axes at creation.
    metadata: dict[str, Any] = {_FLAX_NAMES_KEY: tuple(names), _SHARDKIT_MARKER: True, "eager_sharding": False}
    return nnx.with_metadata(init, **metadata)


def nnx_axes(state: Any) -> Any:
    """Names of every variable in an NNX ``State``: shardkit's (:func:`logical`) or Flax's."""

    def names_of(v: Any) -> Axes:
        if isinstance(v, nnx.Variable):
            meta = v.get_metadata()
            if meta.get(_FLAX_NAMES_KEY):
                return Axes(_flax_names(meta[_FLAX_NAMES_KEY]), flax=not meta.get(_SHARDKIT_MARKER, False))
        return Axes()

    return jax.tree.map(names_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _flax_names(names: Any) -> tuple[FlaxName, ...]:
    """Flax's per-dimension entries (a tuple or a ``PartitionSpec``) as a tuple of names."""
    return tuple(tuple(n) if isinstance(n, list | tuple) else n for n in names)


def linen_axes(boxed: Any) -> Any:
    """Names from Linen boxes: logical (``nn.LogicallyPartitioned``) or Flax's mesh axes
    (``nn.Partitioned``); unboxed leaves are replicated."""

    def names_of(x: Any) -> Axes:
        if isinstance(x, nn.LogicallyPartitioned):
            return Axes(tuple(x.names))
        if isinstance(x, nn.Partitioned):
            return Axes(_flax_names(x.names), flax=True)
        return Axes()

    return jax.tree.map(names_of, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


RegexRule = tuple[str, Sequence[str | None] | PartitionSpec | None]

NO_REGEX_MATCH = """\
Parameter {path!r} (shape {shape}) matches none of the regex rules:
{patterns}
Every parameter needs a rule, so nothing is left unsharded by accident. Add a rule for it, or
end the list with a catch-all that replicates the rest:
    rules = [..., (r".*", None)]
"""


def _compiled_rules(patterns: Sequence[RegexRule] | Mapping[str, Any]) -> list[tuple[re.Pattern[str], str, Any]]:
    """``[(compiled regex, pattern, target)]``, refusing a rule that is not a pair or does not compile."""
    if isinstance(patterns, Mapping):  # {regex: names} reads as well as a list of pairs
        patterns = list(patterns.items())
    compiled = []
    for rule in patterns:
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise RuleError(
                f"Regex rule {short_repr(rule)} is not a (regex, names) pair, e.g. (r'mlp/.*/kernel$', "
                "('embed', 'mlp')); pass a list of such pairs or a dict {regex: names}."
            )
        pattern, target = rule
        try:
            compiled.append((re.compile(pattern), pattern, target))
        except re.error as e:
            raise RuleError(f"Regex rule {pattern!r} does not compile ({e}); fix the pattern.") from e
    return compiled


def _rule_axes(pattern: str, target: Any, key: str, shape: tuple[int, ...]) -> Axes:
    """The :class:`Axes` a matching rule gives the parameter ``key`` of ``shape``."""
    if target is None:
        return Axes()
    if isinstance(target, PartitionSpec):
        return Axes(spec=target)
    if len(tuple(target)) != len(shape):
        raise RuleError(
            f"Regex rule {pattern!r} gives {key} (shape {shape}) {len(tuple(target))} names "
            f"{tuple(target)}; it has {len(shape)} dimensions. Fix: one name per dimension (None for "
            "a dimension left whole), or a narrower pattern."
        )
    return Axes(tuple(target))


def regex_axes(
    params: Any,
    patterns: Sequence[RegexRule],
    own: Any = None,
    *,
    override: bool = True,
    strict: bool = False,
) -> tuple[Any, list[str]]:
    """Logical names for parameters from regex rules on their ``/``-joined paths.

    The first rule whose regex ``re.search``-es the path wins. A rule maps to logical names
    (one per dimension), to a ``PartitionSpec`` pinned as is, or to ``None`` (replicated).

    Args:
      params: the parameter pytree (arrays or ShapeDtypeStructs).
      patterns: ``[(regex, names_or_spec_or_None), ...]``.
      own: the model's own :class:`Axes` tree, kept where no rule applies (None: it has none).
        When it annotates no parameter at all, every parameter needs a rule.
      override: a matching rule replaces the model's own names; with False rules only fill
        parameters the model left unannotated.
      strict: a rule that matches no parameter is an error (else it is returned, for a warning).

    Returns:
      ``(axes, unused)``: a tree of :class:`Axes` with the structure of ``params``, and the
      patterns that matched no parameter.

    Raises:
      ShardkitError: for a parameter with neither its own names nor a matching rule, a bad
        regex, or (``strict``) a rule that matches nothing.

    Example:
      >>> import jax.numpy as jnp
      >>> t, unused = regex_axes({"dense": {"kernel": jnp.zeros((4, 8))}}, [(r"kernel$", ("embed", "mlp"))])
      >>> t["dense"]["kernel"].names
      ('embed', 'mlp')
    """
    compiled = _compiled_rules(patterns)
    used: set[str] = set()
    flat_own = jax.tree_util.tree_flatten_with_path(own, is_leaf=_is_axes)[0] if own is not None else []
    own_by_path = {path_str(p): a for p, a in flat_own}
    # A model that annotates some parameters leaves the others replicated on purpose (as Flax
    # reads it); one that annotates none relies on the rules for every parameter.
    model_annotates = annotates_any(list(own_by_path.values()))

    def names_for(path: tuple[Any, ...], leaf: Any) -> Axes:
        key = path_str(path)
        mine = own_by_path.get(key)
        annotated = mine is not None and (mine.names is not None or mine.spec is not None)
        for regex, pattern, target in compiled:
            if regex.search(key):
                used.add(pattern)
                if annotated and not override and mine is not None:
                    return mine
                return _rule_axes(pattern, target, key, tuple(leaf.shape))
        if model_annotates:
            return mine if mine is not None else Axes()
        listing = "\n".join(f"    ({p!r}, {t!r})" for _, p, t in compiled) or "    (none)"
        raise RuleError(NO_REGEX_MATCH.format(path=key, shape=tuple(leaf.shape), patterns=listing))

    out = jax.tree_util.tree_map_with_path(names_for, params)
    # A rule that matched nothing is a typo or a rule for another variant of the model; a
    # catch-all (one that matches any path) is neither.
    unused = [p for regex, p, _ in compiled if p not in used and not regex.fullmatch("")]
    if unused and strict:
        raise RuleError(
            f"Regex rule {unused[0]!r} matched no parameter. Parameter paths look like "
            f"{[path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0][:4]]}; "
            "fix the pattern, remove the rule, or pass strict=False to only warn."
        )
    return out, unused


def path_str(path: Sequence[Any]) -> str:
    """``('layers', 0, 'kernel')``-style key path as ``layers/0/kernel``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def specs_for(
    axes: Any,
    shapes: Any,
    rules: Rules,
    mesh: Mesh | Mapping[str, int],
    *,
    allow_replicate: bool = False,
    fallbacks: list[Fallback] | None = None,
) -> Any:
    """Resolve a tree of :class:`Axes` against the shapes of the same tree.

    Args:
      axes: tree of ``Axes`` (from :func:`nnx_axes`, :func:`linen_axes` or :func:`regex_axes`).
      shapes: matching tree of arrays or ``ShapeDtypeStruct``.
      rules: logical-to-mesh rules.
      mesh: the device mesh, or just its axis sizes (``{"fsdp": 8}``: resolution needs no devices).
      allow_replicate: replicate non-dividing dimensions (recorded in ``fallbacks``).
      fallbacks: list to which replicated dimensions are appended.

    Returns:
      A tree of ``PartitionSpec`` with the structure of ``shapes``.
    """
    mesh_shape = dict(mesh.shape if isinstance(mesh, Mesh) else mesh)

    def one(path: tuple[Any, ...], ax: Axes, leaf: Any) -> PartitionSpec:
        what = path_str(path) or "array"
        shape = tuple(getattr(leaf, "shape", ()))
        if ax.spec is not None:
            check_spec(ax.spec, shape, mesh_shape, what)
            return ax.spec
        names, extended = ax.names, rules
        if ax.flax and names is not None:
            names, extended = _mesh_names_as_rules(names, rules, mesh_shape)
        elif names is not None and "expert" in names and "expert" not in rules and "experts" in rules:
            # A logical 'expert' (a Linen model's own name for its experts' dimension) is shardkit's
            # 'experts', as Flax's mesh-axis name 'expert' is: NNX and Linen resolve alike.
            names = tuple("experts" if n == "expert" else n for n in names)
        return resolve(
            names,  # type: ignore[arg-type]  # Flax's grouped names are rules by now
            shape,
            extended,
            mesh_shape,
            what=what,
            allow_replicate=allow_replicate,
            fallbacks=fallbacks,
        )

    return jax.tree_util.tree_map_with_path(one, axes, shapes, is_leaf=_is_axes)


def _mesh_names_as_rules(
    names: tuple[FlaxName, ...], rules: Rules, mesh_shape: dict[str, int]
) -> tuple[tuple[str | None, ...], Rules]:
    """Flax's names as logical ones: a mesh axis (or a tuple of them) that the rules do not name
    becomes a rule to itself, after the rules (so rule names keep their priority). The
    ``expert`` mesh axis names a dimension of experts, so it resolves as ``experts`` does
    (:func:`~shardkit.core.rules.experts_over_tensor`)."""
    out: list[str | None] = []
    extra = Rules()
    for n in names:
        axes = n if isinstance(n, tuple) else (n,) if n is not None else ()
        if n == "expert" and "experts" in rules and "expert" in rules["experts"]:
            out.append("experts")  # the expert mesh axis names a dimension of experts: as shardkit's own
        elif n is None or (isinstance(n, str) and n in rules):
            out.append(n)
        elif all(a in mesh_shape for a in axes):
            label = "+".join(axes)
            extra = extra + Rules(((label, tuple(axes)),))
            out.append(label)
        else:
            out.append(n if isinstance(n, str) else "+".join(n))  # unknown: resolve() names the fix
    return tuple(out), rules + extra


def named(specs: Any, mesh: Mesh) -> Any:
    """Tree of ``PartitionSpec`` -> tree of ``NamedSharding`` on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


# ---------------------------------------------------------------------------------------------
# Activations: the rules and mesh in force, and constrain().


@dataclasses.dataclass(frozen=True)
class _Context:
    mesh: Mesh
    rules: Rules


_CURRENT: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("shardkit_context", default=None)
# Mesh axes an enclosing vmap over each device's rows has taken (``jax.vmap(spmd_axis_name=...)``
# puts them on the vmapped dimension): constraints inside must not name them again.
_TAKEN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("shardkit_taken_axes", default=())


@contextlib.contextmanager
def use_sharding(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Make ``mesh`` and ``rules`` the ones :func:`constrain` uses, inside and outside ``jit``.

    Only shardkit's own context is set: ``constrain`` builds explicit ``NamedSharding`` objects,
    so it does not depend on JAX's mesh context (which cannot be entered under ``jit``).

    Example:
      >>> import shardkit as sk
      >>> mesh = sk.Layout.parse("data=-1").make_mesh()
      >>> with sk.use_sharding(mesh, sk.default_rules()):
      ...     pass
    """
    token = _CURRENT.set(_Context(mesh, rules))
    try:
        yield
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def axes_taken(axes: Sequence[str]) -> Iterator[None]:
    """Within this context :func:`constrain` leaves ``axes`` out of every spec: an enclosing
    ``jax.vmap(..., spmd_axis_name=axes)`` over each device's rows already splits over them."""
    token = _TAKEN.set(tuple(axes))
    try:
        yield
    finally:
        _TAKEN.reset(token)


def free_mesh_shape(mesh: Mesh) -> dict[str, int]:
    """The mesh's axis sizes, those an enclosing row vmap has taken (:func:`axes_taken`) counted
    as 1: what an activation inside may still split over."""
    taken = _TAKEN.get()
    return {a: 1 if a in taken else size for a, size in mesh.shape.items()}


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes ``x`` is typed as differing over, inside a ``shard_map`` (empty
    outside one)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def varying_over(x: jax.Array, axes: Iterable[str]) -> jax.Array:
    """``x`` typed as differing over the manual mesh ``axes`` too, inside a ``shard_map`` (its
    gradient is then summed over those it did not differ over, where it is read)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def without_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
    """``spec`` with the mesh ``axes`` removed from every entry (an entry left empty is None)."""

    def keep(entry: Any) -> Any:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            return entry
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(keep(e) for e in spec))


def current_rules() -> tuple[Mesh, Rules] | None:
    """The ``(mesh, rules)`` set by :func:`use_sharding`, or None outside it."""
    ctx = _CURRENT.get()
    return None if ctx is None else (ctx.mesh, ctx.rules)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical names, inside or outside ``jit``.

    Inside :func:`use_sharding` it resolves ``names`` with the rules in force and applies
    ``jax.lax.with_sharding_constraint`` (under jit) or ``jax.device_put`` (eagerly). Outside any
    sharding context there is no mesh to shard over, so ``x`` is returned unchanged: this is what
    lets one model run both on one device and sharded.

    Args:
      x: an array, shape matching ``names``, e.g. ``(B, T, D)`` with ``("batch", "seq", "embed")``.
      names: one logical name (or None) per dimension.

    Returns:
      ``x`` with the resolved sharding.
    """
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    return constrain_to(x, resolve(names, x.shape, ctx.rules, free_mesh_shape(ctx.mesh), what="activation"))


def constrain_to(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """Constrain ``x`` to ``spec`` on the mesh in force (:func:`use_sharding`); unchanged outside it."""
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    taken = _TAKEN.get()
    if taken:
        spec = without_axes(spec, taken)
    sharding = NamedSharding(ctx.mesh, spec)
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.manual_axes:
        # Inside a shard_map island (a pipeline stage, say) the constraint names the mesh with
        # its manual axes marked as such; the spec never mentions them.
        sharding = NamedSharding(abstract, spec)
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)
