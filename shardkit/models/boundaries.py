"""Module boundaries: shardings for the activations of models that name none.

A model written without :func:`shardkit.constrain` leaves XLA's partitioner to guess its
activations' shardings from the parameters'. Under FSDP the parameters' ``embed -> fsdp`` split
wins that guess and flows into the activations, so the batch is no longer split over ``fsdp``:
every matmul all-reduces activations instead of gathering weights (ZeRO-3 turns into a slow
tensor parallelism). MaxText avoids this by constraining activations at layer boundaries; Flax
Linen's ``nn.intercept_methods`` reaches every submodule call; shardkit does the same for NNX
and Linen, so an unmodified model gets ZeRO-3's all-gathers and reduce-scatters.

At every submodule call, each array output whose leading dimension is the batch is constrained:

- dimension 0 to the mesh axes of the logical ``batch`` (``data``, ``fsdp``, ``expert``); a mesh
  axis shards one dimension of an array at most, so the weights must now be gathered;
- an output shaped like one of the call's array arguments (a residual block, a norm, attention
  or MLP) may be a layer boundary: under sequence parallelism its dimension 1 is constrained to
  the mesh axes of ``seq`` (where Megatron's sequence parallelism splits activations);
- every other dimension is left to the partitioner (``UNCONSTRAINED``), boundary or not;
- on Explicit mesh axes nothing is constrained: there the model's types say where arrays live.

A boundary has one job: keep the batch split, so that FSDP's split of the parameters cannot leak
into the activations. It never says that a dimension is whole, because that would undo a split
the layout wants wherever an output merely looks like a layer's: per-head q/k norms, a query
reshaped for grouped attention, an MLP's product, a cross-attention's output. Replicating the
non-batch dimensions of such outputs all-gathered heads and MLP units over ``tensor`` (1.25x the
bound instead of 1.13x on a Gemma-style model under ``data=2,fsdp=2,tensor=2``); left
unconstrained they keep the split the parameters give them, and the partitioner places
Megatron's reductions where the matmuls need them. The batch axes already exclude every other
dimension from ``data`` and ``fsdp``, so nothing is lost under FSDP.

NNX submodule calls also open a ``jax.named_scope`` named by the module's path
(``layers/0/attn/q``), so reports name NNX ops the way they name Linen ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from shardkit.core.partition import constrain_to, current_rules, free_mesh_shape
from shardkit.core.rules import resolve

_PATHS: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("shardkit_nnx_paths", default=None)
_BATCH_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("shardkit_batch_rows", default=None)
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("shardkit_nnx_caller", default="")
_SUBCLASSES: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def boundary_spec(shape: Sequence[int], layer_boundary: bool) -> PartitionSpec | None:
    """The spec of one module output of ``shape`` under the rules in force, or None to leave it.

    Args:
      shape: the output's shape; dimension 0 is the batch when it equals the rows in flight.
      layer_boundary: whether the output is shaped like one of the module's inputs.

    Returns:
      ``PartitionSpec`` with the batch axes on dimension 0, the ``seq`` axes on dimension 1 of a
      layer boundary of rank >= 3 where the rules split ``seq`` (sequence parallelism), and
      ``UNCONSTRAINED`` everywhere else. None outside a sharding context, or for an output that
      is not batched.
    """
    ctx, rows = current_rules(), _BATCH_ROWS.get()
    if ctx is None or rows is None or not shape or shape[0] != rows:
        return None
    mesh, rules = ctx
    if AxisType.Explicit in mesh.axis_types:  # sharding in types: the model says where things go
        return None
    names = ("batch", "seq") if layer_boundary and len(shape) >= 3 else ("batch",)
    resolved = resolve(
        names, shape[: len(names)], rules, free_mesh_shape(mesh), what="activation", allow_replicate=True
    )
    free = PartitionSpec.UNCONSTRAINED
    batch, *seq = tuple(resolved) or (None,)
    rest = [entry if entry is not None else free for entry in seq]
    return PartitionSpec(batch, *rest, *[free] * (len(shape) - 1 - len(rest)))


def constrain_outputs(outputs: Any, args: Sequence[Any]) -> Any:
    """Constrain every batched array in ``outputs`` (see :func:`boundary_spec`)."""
    input_shapes = {tuple(a.shape) for a in jax.tree.leaves(args) if isinstance(a, jax.Array)}

    def one(y: Any) -> Any:
        if not isinstance(y, jax.Array):
            return y
        spec = boundary_spec(y.shape, tuple(y.shape) in input_shapes)
        return y if spec is None else constrain_to(y, spec)

    return jax.tree.map(one, outputs)


@contextlib.contextmanager
def batch_in_flight(inputs: Any) -> Iterator[None]:
    """Mark the leading dimension of ``inputs`` as the batch rows of the current call."""
    leaves = [x for x in jax.tree.leaves(inputs) if hasattr(x, "shape") and x.shape]
    token = _BATCH_ROWS.set(int(leaves[0].shape[0]) if leaves else None)
    try:
        yield
    finally:
        _BATCH_ROWS.reset(token)


# -- NNX ---------------------------------------------------------------------------------------


def _bounded_class(cls: type) -> type:
    """A subclass of an NNX module class whose ``__call__`` opens a named scope and constrains
    its outputs; made once per class (a new class per call would grow JAX's pytree registry)."""
    if cls not in _SUBCLASSES:
        original = cls.__call__

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            path = (_PATHS.get() or {}).get(id(self))
            if path is None:  # a copy made inside an NNX transform (nnx.scan, say): its caller named it
                return constrain_outputs(original(self, *args, **kwargs), args)
            outer = _CALLER.get()
            # Named scopes nest: open only the part of the path below the calling module.
            scope = path[len(outer) + 1 :] if outer and path.startswith(outer + "/") else path
            token = _CALLER.set(path)
            try:
                with jax.named_scope(scope):
                    out = original(self, *args, **kwargs)
            finally:
                _CALLER.reset(token)
            return constrain_outputs(out, args)

        _SUBCLASSES[cls] = type(cls)(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _SUBCLASSES[cls]


@contextlib.contextmanager
def nnx_boundaries(module: nnx.Module) -> Iterator[None]:
    """Within this context, calls of ``module``'s submodules are bounded (named and constrained).

    ``module`` must be a fresh instance (from ``nnx.merge``): its submodules' classes are swapped
    for bounded subclasses, which changes nothing else about them.
    """
    paths: dict[int, str] = {}
    for path, sub in nnx.iter_modules(module):
        if path and callable(sub):  # containers such as nnx.List are never called
            sub.__class__ = _bounded_class(type(sub))
            paths[id(sub)] = "/".join(str(p) for p in path)
    token = _PATHS.set(paths)
    try:
        yield
    finally:
        _PATHS.reset(token)


# -- Linen -------------------------------------------------------------------------------------


def _linen_interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
    out = next_fun(*args, **kwargs)
    if context.method_name != "__call__" or context.module.parent is None:
        return out
    return constrain_outputs(out, args)


def linen_boundaries() -> contextlib.AbstractContextManager[None]:
    """Within this context, every Linen submodule's ``__call__`` output is constrained."""
    return nn.intercept_methods(_linen_interceptor)
