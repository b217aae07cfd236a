"""An embedding table's gradient reduced onto its shards, once, as ZeRO and Megatron reduce it.

The backward pass of a lookup (``jnp.take``, ``table[ids]``, Flax's ``Embed``) scatters each
token's cotangent into a table of zeros. XLA partitions that scatter along the tokens: every
device adds its own tokens into a whole table, all-reduces the whole table over the batch axes
(``data`` and ``fsdp``), and only then slices it to the parameter's shard. Under
``data=2,fsdp=2,tensor=2`` a table split over ``tensor`` and ``fsdp`` thus moves 1.5x its size
where its bound is 0.5x.

:func:`table_gradient` computes the same sum in a ``shard_map`` over the whole mesh: each device
scatters its tokens, keeps the block of the table its non-batch axes own (``tensor`` on the
vocabulary), reduce-scatters over the batch axes that split the table (``fsdp``) and all-reduces
over those that do not (``data``): the bound's bytes. :mod:`shardkit.parallel.input_gradients`
applies it to each scatter into zeros whose shape is that of exactly one parameter.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import AxisType, PartitionSpec as P
  >>> from shardkit.parallel.input_gradients import reduce_input_gradients_once
  >>> mesh = jax.make_mesh((1, 1), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  >>> tables = Tables(mesh, ("data", "fsdp"), lambda table, ids: (P("fsdp", None), None))
  >>> grad = jax.grad(lambda table, ids: jnp.take(table, ids, axis=0).sum())
  >>> once = reduce_input_gradients_once(grad, lambda *args: (None, None), tables)
  >>> "shard_map" in str(jax.make_jaxpr(once)(jnp.zeros((4, 2)), jnp.array([[1, 3, 3]])))
  True
  >>> once(jnp.zeros((4, 2)), jnp.array([[1, 3, 3]]))[:, 0].tolist()
  [0.0, 1.0, 0.0, 2.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import JaxprEqn, Literal
from jax.sharding import Mesh, PartitionSpec

from shardkit.core.rules import entry_axes


@dataclass(frozen=True)
class Tables:
    """What the rewrite knows of the step: the mesh, the axes that split the batch's rows, and
    ``specs_of(*args)``, a tree like the step's arguments with each parameter's
    ``PartitionSpec`` (None elsewhere)."""

    mesh: Mesh
    row_axes: tuple[str, ...]
    specs_of: Callable[..., Any]
    # The tokens' cotangents may reach the lookup split over more than the row axes: under expert
    # and tensor axes the experts' rows split over tensor, and XLA carries that split back to the
    # embedding, where it then all-reduces the whole table over tensor and over the rows. A table
    # split by other axes only (its vocabulary over tensor) is then rewritten too: its rows'
    # cotangents gathered whole, each device's block kept, the block reduced over the rows.
    split_beyond_rows: bool = False

    def spec_for(self, eqn: JaxprEqn, zeros: JaxprEqn | None, spec: PartitionSpec) -> PartitionSpec | None:
        """``spec`` where ``eqn`` is the gradient of a lookup in a table sharded as ``spec`` that
        this rewrite computes: a scatter-add into zeros (``zeros``, the operand's producer), the
        tokens along the leading dimension of its indices and updates, the table split over some
        but not all of the batch's row axes and no dimension split by both row and other axes;
        else None."""
        if eqn.primitive.name != "scatter-add" or zeros is None or not _is_zeros(zeros) or not self.row_axes:
            return None
        rows = set(self.row_axes)
        entries = [set(entry_axes(e)) for e in spec]
        splitting = set().union(*entries) & rows
        # Where every row axis splits the table XLA moves the tokens' rows (all-to-all), which
        # is cheaper than the table while the tokens are fewer than its rows; where none does, the
        # all-reduce is the bound. One dimension split by row and other axes is not handled.
        if not splitting and not (self.split_beyond_rows and any(entries)):
            return None
        if splitting == rows or any(e & rows and e - rows for e in entries):
            return None
        numbers = eqn.params["dimension_numbers"]
        _, indices, updates = eqn.invars
        n_rows = math.prod(dict(self.mesh.shape)[a] for a in self.row_axes)
        if (
            len(spec) > len(var_shape(eqn.outvars[0]))
            or numbers.operand_batching_dims
            or 0 in numbers.update_window_dims
            or not var_shape(indices)
            or var_shape(indices)[0] != var_shape(updates)[0]
            or var_shape(indices)[0] % n_rows
        ):
            return None
        return spec


def var_shape(v: Any) -> tuple[int, ...]:
    """The shape of a jaxpr variable."""
    return tuple(v.aval.shape)


def var_dtype(v: Any) -> Any:
    """The dtype of a jaxpr variable."""
    return v.aval.dtype


def _is_zeros(eqn: JaxprEqn) -> bool:
    return (
        eqn.primitive.name == "broadcast_in_dim"
        and isinstance(eqn.invars[0], Literal)
        and not eqn.invars[0].val  # a literal 0 (or 0.0, or False)
    )


def table_gradient(eqn: JaxprEqn, spec: PartitionSpec, tables: Tables, indices: Any, updates: Any) -> jax.Array:
    """The scatter-add ``eqn`` into zeros, computed shard by shard and reduced onto ``spec``.

    Args:
      eqn: the ``scatter-add`` equation (its parameters say how indices and updates map).
      spec: the table's sharding (from :meth:`Tables.spec_for`).
      tables: the mesh and the batch's row axes.
      indices: ``(N, ...)`` token positions, N split over the row axes.
      updates: ``(N, ..., D)`` the tokens' cotangents.

    Returns:
      The table's gradient, shape and dtype of ``eqn``'s result, sharded as ``spec``.
    """
    shape, dtype = var_shape(eqn.outvars[0]), var_dtype(eqn.outvars[0])
    sizes = dict(tables.mesh.shape)
    rows = tables.row_axes
    params = eqn.primitive.get_bind_params(eqn.params)

    def local(idx: jax.Array, upd: jax.Array) -> jax.Array:
        g = eqn.primitive.bind(jnp.zeros(shape, dtype), idx, upd, **params)
        for k, entry in enumerate(spec):
            axes = entry_axes(entry)
            if axes and not set(axes) & set(rows):  # this device's block (the vocabulary over tensor)
                block = shape[k] // math.prod(sizes[a] for a in axes)
                g = lax.dynamic_slice_in_dim(g, _linear_index(axes, sizes) * block, block, axis=k)
        scattered: list[str] = []
        for k, entry in enumerate(spec):
            axes = entry_axes(entry)
            if axes and set(axes) <= set(rows):
                g = lax.psum_scatter(g, axes, scatter_dimension=k, tiled=True)
                scattered.extend(axes)
        rest = tuple(a for a in rows if a not in scattered)
        return lax.psum(g, rest) if rest else g

    row_spec = PartitionSpec(rows if len(rows) > 1 else rows[0])
    return jax.shard_map(local, mesh=tables.mesh, in_specs=(row_spec, row_spec), out_specs=spec, check_vma=False)(
        indices, updates
    )


def _linear_index(axes: Sequence[str], sizes: Mapping[str, int]) -> jax.Array:
    """This device's block along mesh ``axes`` taken together, the first the most significant."""
    index = jnp.zeros((), jnp.int32)
    for a in axes:
        index = index * sizes[a] + lax.axis_index(a)
    return index
