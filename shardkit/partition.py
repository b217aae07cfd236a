"""Annotations -> PartitionSpec and NamedSharding trees, and ``constrain`` for activations.

Three sources of logical axis names give one result:

- Flax NNX variable metadata, written with :func:`logical` (the only place shardkit touches
  flax's metadata key, which flax renamed twice);
- Flax Linen ``nn.Partitioned`` boxes (``nn.with_logical_partitioning``);
- regex rules on parameter paths, for models that carry no annotations at all.

Each becomes a tree of :class:`Axes` with the parameters' structure, and :func:`specs_for`
resolves it with the one resolver in :mod:`shardkit.rules`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.rules import Fallback, Rules, check_spec, resolve

# flax 0.12.4+ calls it 'out_sharding' (earlier: 'sharding_names', 'sharding').
_FLAX_NAMES_KEY = "out_sharding"


@dataclasses.dataclass(frozen=True)
class Axes:
    """Logical names of one array's dimensions (a pytree leaf). ``names=None``: replicated.

    ``spec`` instead of names pins an explicit ``PartitionSpec`` (from a regex rule).
    """

    names: tuple[str | None, ...] | None = None
    spec: PartitionSpec | None = None

    def __str__(self) -> str:
        if self.spec is not None:
            return str(self.spec)
        return "(" + ", ".join(str(n) for n in self.names) + ")" if self.names is not None else "()"


def _is_axes(x: Any) -> bool:
    return isinstance(x, Axes)


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
    # eager_sharding=False: flax would otherwise read logical names as mesh axes at creation.
    return nnx.with_metadata(init, **{_FLAX_NAMES_KEY: tuple(names), "eager_sharding": False})


def nnx_axes(state: Any) -> Any:
    """Logical names of every variable in an NNX ``State`` (from :func:`logical` metadata)."""

    def names_of(v: Any) -> Axes:
        if isinstance(v, nnx.Variable):
            names = v.get_metadata().get(_FLAX_NAMES_KEY)
            return Axes(tuple(names)) if names else Axes()
        return Axes()

    return jax.tree.map(names_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def linen_axes(boxed: Any) -> Any:
    """Logical names from Linen ``nn.Partitioned`` boxes; unboxed leaves are replicated."""

    def names_of(x: Any) -> Axes:
        if isinstance(x, nn.Partitioned):
            return Axes(tuple(x.names))
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


def regex_axes(params: Any, patterns: Sequence[RegexRule]) -> Any:
    """Logical names for parameters from regex rules on their ``/``-joined paths.

    The first rule whose regex ``re.search``-es the path wins. A rule maps to logical names
    (one per dimension), to a ``PartitionSpec`` pinned as is, or to ``None`` (replicated).

    Args:
      params: the parameter pytree (arrays or ShapeDtypeStructs).
      patterns: ``[(regex, names_or_spec_or_None), ...]``.

    Returns:
      A tree of :class:`Axes` with the structure of ``params``.

    Raises:
      ShardkitError: for a path that no rule matches, a bad regex, or a rule that matches
        nothing (a catch-all such as ``r".*"`` may match nothing).

    Example:
      >>> import jax.numpy as jnp
      >>> t = regex_axes({"dense": {"kernel": jnp.zeros((4, 8))}}, [(r"kernel$", ("embed", "mlp"))])
      >>> t["dense"]["kernel"].names
      ('embed', 'mlp')
    """
    compiled = []
    for pattern, target in patterns:
        try:
            compiled.append((re.compile(pattern), pattern, target))
        except re.error as e:
            raise ShardkitError(f"Regex rule {pattern!r} does not compile ({e}); fix the pattern.") from e
    used: set[str] = set()

    def names_for(path: tuple[Any, ...], leaf: Any) -> Axes:
        key = path_str(path)
        for regex, pattern, target in compiled:
            if regex.search(key):
                used.add(pattern)
                if target is None:
                    return Axes()
                if isinstance(target, PartitionSpec):
                    return Axes(spec=target)
                return Axes(tuple(target))
        listing = "\n".join(f"    ({p!r}, {t!r})" for _, p, t in compiled) or "    (none)"
        raise ShardkitError(NO_REGEX_MATCH.format(path=key, shape=tuple(leaf.shape), patterns=listing))

    out = jax.tree_util.tree_map_with_path(names_for, params)
    # A rule that matched nothing is a typo, except a catch-all (one that matches any path).
    unused = [p for regex, p, _ in compiled if p not in used and not regex.fullmatch("")]
    if unused:
        raise ShardkitError(
            f"Regex rule {unused[0]!r} matched no parameter. Parameter paths look like "
            f"{[path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0][:4]]}; "
            "fix the pattern or remove the rule."
        )
    return out


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
    mesh: Mesh,
    *,
    allow_replicate: bool = False,
    fallbacks: list[Fallback] | None = None,
) -> Any:
    """Resolve a tree of :class:`Axes` against the shapes of the same tree.

    Args:
      axes: tree of ``Axes`` (from :func:`nnx_axes`, :func:`linen_axes` or :func:`regex_axes`).
      shapes: matching tree of arrays or ``ShapeDtypeStruct``.
      rules: logical-to-mesh rules.
      mesh: the device mesh.
      allow_replicate: replicate non-dividing dimensions (recorded in ``fallbacks``).
      fallbacks: list to which replicated dimensions are appended.

    Returns:
      A tree of ``PartitionSpec`` with the structure of ``shapes``.
    """
    mesh_shape = dict(mesh.shape)

    def one(path: tuple[Any, ...], ax: Axes, leaf: Any) -> PartitionSpec:
        what = path_str(path) or "array"
        shape = tuple(getattr(leaf, "shape", ()))
        if ax.spec is not None:
            check_spec(ax.spec, shape, mesh_shape, what)
            return ax.spec
        return resolve(
            ax.names, shape, rules, mesh_shape, what=what, allow_replicate=allow_replicate, fallbacks=fallbacks
        )

    return jax.tree_util.tree_map_with_path(one, axes, shapes, is_leaf=_is_axes)


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
    return constrain_to(x, resolve(names, x.shape, ctx.rules, dict(ctx.mesh.shape), what="activation"))


def constrain_to(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """Constrain ``x`` to ``spec`` on the mesh in force (:func:`use_sharding`); unchanged outside it."""
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    sharding = NamedSharding(ctx.mesh, spec)
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.manual_axes:
        # Inside a shard_map island (a pipeline stage, say) the constraint names the mesh with
        # its manual axes marked as such; the spec never mentions them.
        sharding = NamedSharding(abstract, spec)
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)
