"""How the decoder's projections multiply: 2-D matmuls where nothing is split, and a weight
gradient written in the orientation XLA:CPU runs fastest; the gather a column-parallel
projection's input needs under sequence parallelism.

Example:
  >>> import jax.numpy as jnp
  >>> token_matmul(jnp.ones((2, 3, 4)), jnp.ones((4, 5)), 1).shape
  (2, 3, 5)
"""

from __future__ import annotations

import functools
import math

import jax

from shardkit.core.partition import constrain_to, current_rules, free_mesh_shape, without_axes
from shardkit.core.rules import resolve


def gathered_along_seq(x: jax.Array) -> jax.Array:
    """``(B, T, D)`` whole along the sequence over ``tensor`` (still split by the other rules).

    Under Megatron sequence parallelism a block's input arrives split along the sequence over
    ``tensor``; gathering it here, before the column-parallel projection, makes the gathered
    input what autodiff saves for the weight gradient, so the backward pass does not gather it
    again (Megatron's volume: one all-gather and one reduce-scatter per all-reduce of plain
    tensor parallelism). Without sequence parallelism this is the layer boundary's own split.
    """
    context = current_rules()
    if context is None:
        return x
    mesh, rules = context
    spec = resolve(("batch", "seq", "embed"), x.shape, rules, free_mesh_shape(mesh), what="activation")
    rest = without_axes(jax.sharding.PartitionSpec(*spec[1:]), ("tensor",))
    return constrain_to(x, jax.sharding.PartitionSpec(spec[0], *rest))


def unsplit(*names: str) -> bool:
    """Whether no logical name in ``names`` splits over devices in the sharding context in force
    (true outside any, and for axes a row vmap has taken)."""
    context = current_rules()
    if context is None:
        return True
    mesh, rules = context
    sizes, known = free_mesh_shape(mesh), dict(rules.rules)
    return all(sizes.get(axis, 1) == 1 for name in names for axis in known.get(name, ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rows_matmul(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """``x (N, K) @ w (K, M) -> (N, M)``, whose weight gradient's dot writes the narrower orientation.

    ``w`` may keep more dimensions, ``(*c, *out)``: its first ``contract`` (of product K) meet
    the columns of ``x`` and the rest (of product M) make the output's columns. It is saved for
    the backward pass as given, so a layer stack scanned over stacked weights reads them back
    from the stack instead of saving a reshaped copy of every layer's weights.

    The weight gradient contracts the N rows of ``x`` and of the output gradient (a dot neither
    of whose operands is in the layout XLA's CPU matmul library takes, so Eigen runs it). Eigen
    ran such a dot about 1.5x faster when its output has the fewer rows: ``(K, M)`` when
    ``K <= M``, else ``(M, K)`` and a transpose (``benchmarks/weight_grad_dot.py``). JAX's own
    derivative always writes ``(M, K)``, and under data parallelism the gradient's all-reduce
    keeps XLA from folding the transpose away. The values are the same.

    Example:
      >>> import jax.numpy as jnp
      >>> x, w = jnp.ones((4, 3)), jnp.ones((3, 2))
      >>> jax.grad(lambda w: rows_matmul(x, w).sum())(w).shape
      (3, 2)
    """
    return x @ _as_matrix(w, contract)


def _as_matrix(w: jax.Array, contract: int) -> jax.Array:
    return w.reshape(math.prod(w.shape[:contract]), -1)  # (K, M)


def _rows_matmul_fwd(x: jax.Array, w: jax.Array, contract: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return x @ _as_matrix(w, contract), (x, w)


def _rows_matmul_bwd(contract: int, saved: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = saved
    matrix = _as_matrix(w, contract)  # (K, M)
    rows = (((0,), (0,)), ((), ()))  # contract the N rows of both operands
    dx = jax.lax.dot_general(dy, matrix, (((1,), (1,)), ((), ())))  # (N, M) . (K, M) -> (N, K)
    narrow_first = matrix.shape[0] <= matrix.shape[1]  # the dot writes (K, M) directly, else (M, K) then .T
    dw = jax.lax.dot_general(x, dy, rows) if narrow_first else jax.lax.dot_general(dy, x, rows).T
    return dx.astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


rows_matmul.defvjp(_rows_matmul_fwd, _rows_matmul_bwd)


def token_matmul(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """``x (B, T, *c) @ w (*c, *out) -> (B, T, *out)`` as one 2-D matmul ``(B T, prod c) @ (prod c, prod out)``.

    The same product as the einsum; XLA's CPU matmuls run a 2-D product with one free dimension
    per side about 1.8x faster forward and backward than the multi-dimensional einsum (whose
    weight gradient contracts two token dimensions and transposes its operands). Merging the
    dimensions is free only when none of them is split over devices: callers check that first
    (:func:`unsplit`), and keep the einsum otherwise.

    Example:
      >>> import jax.numpy as jnp
      >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 2, 5))
      >>> token_matmul(x, w, 1).shape
      (2, 3, 2, 5)
    """
    b, t = x.shape[:2]
    inner = x.shape[2:]
    outer = w.shape[contract:]
    flat = rows_matmul(x.reshape(b * t, math.prod(inner)), w, contract)
    return flat.reshape(b, t, *outer)
