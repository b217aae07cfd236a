"""A grouped matmul, ``rows (M, K) x weights (G, K, N)`` with consecutive rows in each group, at
memory linear in the rows on every backend.

``jax.lax.ragged_dot`` is the grouped matmul GPUs and TPUs run natively. Elsewhere (XLA:CPU) JAX
expands it into every group's dense matmul of every row, masked: ``G x M x N`` numbers (measured,
jax 0.10.2: 34x the output's bytes of temporaries with 32 groups). A dry run on CPU devices of
a model with many experts a device then reports hundreds of times the memory a GPU needs, and
CPU training computes every expert on every row. :func:`grouped_matmul` runs ``ragged_dot``
where it is native or the groups are few, and else pads each group to whole blocks of rows and
scans the blocks, each block one matmul with its group's weight: ``M + G x block`` rows of
work and memory.

Example:
  >>> import jax.numpy as jnp
  >>> rows, w = jnp.ones((6, 2)), jnp.stack([jnp.eye(2), 2 * jnp.eye(2), 3 * jnp.eye(2)])
  >>> blocked_matmul(rows, w, jnp.array([1, 3, 2]), block=2)[:, 0].tolist()  # rows 0 | 1-3 | 4-5
  [1.0, 2.0, 2.0, 2.0, 3.0, 3.0]
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

# Groups up to which the dense expansion (G x the output) costs less than blocks' padding and scan.
FEW_GROUPS = 4
NATIVE = frozenset({"gpu", "cuda", "rocm", "tpu"})
_AS_NATIVE = contextvars.ContextVar("grouped_matmul_as_native", default=False)


@contextlib.contextmanager
def traced_as_native() -> Iterator[None]:
    """Trace grouped matmuls as ``ragged_dot`` whatever the backend: for an analysis of the traced
    program (the rows a mixture's experts compute), which the blocks' padding would overstate."""
    token = _AS_NATIVE.set(True)
    try:
        yield
    finally:
        _AS_NATIVE.reset(token)


def grouped_matmul(rows: jax.Array, weights: jax.Array, sizes: jax.Array, platform: str | None = None) -> jax.Array:
    """``rows (M, K)``, the first ``sizes[0]`` for group 0, the next ``sizes[1]`` for group 1, ...
    (rows past ``sum(sizes)`` belong to none), times their group's ``weights (G, K, N)``.

    Args:
      rows: ``(M, K)`` grouped rows.
      weights: ``(G, K, N)``.
      sizes: ``(G,)`` int rows per group, ``sum(sizes) <= M``.
      platform: the devices' platform (default: JAX's default backend).

    Returns:
      ``(M, N)``: each row times its group's weight; rows of no group are 0.
    """
    platform = platform or jax.default_backend()
    if platform in NATIVE or weights.shape[0] <= FEW_GROUPS or _AS_NATIVE.get():
        return jax.lax.ragged_dot(rows, weights, sizes)
    return blocked_matmul(rows, weights, sizes)


def _block_for(rows: int, groups: int) -> int:
    """Rows a block: a power of two near a quarter of a group's even share, 8 to 512."""
    share = max(1, rows // (4 * groups))
    return int(min(512, max(8, 1 << (share.bit_length() - 1))))


def blocked_matmul(rows: jax.Array, weights: jax.Array, sizes: jax.Array, block: int | None = None) -> jax.Array:
    """:func:`grouped_matmul` by blocks: each group's rows padded to whole blocks of ``block``
    rows, one matmul a block in a scan (the same result as ``jax.lax.ragged_dot``)."""
    m, k = rows.shape
    g, _, n = weights.shape
    block = block or _block_for(m, g)
    n_blocks = -(-m // block) + g  # each group wastes less than one block
    blocks_per_group = -(-sizes // block)  # (G,)
    padded_start = (jnp.cumsum(blocks_per_group) - blocks_per_group) * block  # (G,)
    start = jnp.cumsum(sizes) - sizes  # (G,)
    # Padded slot p of group q holds row start[q] + (p - padded_start[q]), if inside the group.
    slot = jnp.arange(n_blocks * block)
    group = jnp.clip(jnp.searchsorted(padded_start, slot, side="right") - 1, 0, g - 1)
    offset = slot - padded_start[group]
    inside = offset < sizes[group]
    source = jnp.where(inside, start[group] + offset, 0)
    padded = jnp.where(inside[:, None], rows[source], 0).reshape(n_blocks, block, k)
    block_group = group.reshape(n_blocks, block)[:, 0]

    def one_block(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        x, q = xs
        return None, x @ weights[q]

    _, out = jax.lax.scan(one_block, None, (padded, block_group))  # (n_blocks, block, N)
    out = out.reshape(n_blocks * block, n)
    # Row r of group q sits at padded slot padded_start[q] + (r - start[q]).
    row = jnp.arange(m)
    row_group = jnp.clip(jnp.searchsorted(start + sizes, row, side="right"), 0, g - 1)
    placed = padded_start[row_group] + row - start[row_group]
    grouped = row < jnp.sum(sizes)
    return jnp.where(grouped[:, None], out[jnp.clip(placed, 0, n_blocks * block - 1)], 0).astype(out.dtype)
