"""A grouped matmul, ``rows (M, K) x weights (G, K, N)`` with consecutive rows in each group, at
memory linear in the rows on every backend.

``jax.lax.ragged_dot`` is the grouped matmul GPUs and TPUs run natively. Elsewhere (XLA:CPU) JAX
expands it into every group's dense matmul of every row, masked: ``G x M x N`` numbers (measured,
jax 0.10.2: 34x the output's bytes of temporaries with 32 groups). A dry run on CPU devices of
a model with many experts a device then reports hundreds of times the memory a GPU needs, and
CPU training computes every expert on every row. :func:`grouped_matmul` runs ``ragged_dot``
where it is native or there is one group, and else pads each group to whole blocks of rows and
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
import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from shardkit.core.partition import varying_axes, varying_over

# Groups up to which JAX's dense expansion (G x the output) is used: one, a plain matmul. At four
# it held 2.8x the blocks' temporaries (DeepSeek-V3 under expert=64, 4 experts a device: 584 GB
# against 207 GB a device in a 131,072-device dry run, measured).
FEW_GROUPS = 1
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
    rows, one matmul a block in a scan (the same result as ``jax.lax.ragged_dot``).

    Its gradient is its own (a ``custom_vjp``): the rows' is the same blocked product with the
    weights transposed, the weights' a scan adding each block's ``x^T dy`` into its group's.
    Differentiating the scan instead would keep each block's weight as a residual: ``n_blocks``
    copies of one expert's matrix (18.8 GB a device for a DeepSeek-V3 layer, measured).
    """
    m, _ = rows.shape
    g = weights.shape[0]
    return _blocked(rows, weights, sizes, block or _block_for(m, g))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked(rows: jax.Array, weights: jax.Array, sizes: jax.Array, block: int) -> jax.Array:
    return _blocked_product(rows, weights, sizes, block)


def _blocked_fwd(
    rows: jax.Array, weights: jax.Array, sizes: jax.Array, block: int
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    return _blocked_product(rows, weights, sizes, block), (rows, weights, sizes)


def _blocked_bwd(
    block: int, residuals: tuple[jax.Array, jax.Array, jax.Array], d_out: jax.Array
) -> tuple[jax.Array, jax.Array, None]:
    rows, weights, sizes = residuals
    d_rows = _blocked_product(d_out, weights.swapaxes(1, 2), sizes, block)
    layout = _BlockLayout.of(rows.shape[0], weights.shape[0], sizes, block)
    x_blocks = layout.pad(rows)  # (n_blocks, block, K)
    dy_blocks = layout.pad(d_out)  # (n_blocks, block, N)

    def add_block(acc: jax.Array, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        x, dy, q = xs
        return acc.at[q].add((x.T @ dy).astype(acc.dtype)), None

    zeros = _varying_like(jnp.zeros(weights.shape, jnp.promote_types(weights.dtype, jnp.float32)), x_blocks, dy_blocks)
    d_weights, _ = jax.lax.scan(add_block, zeros, (x_blocks, dy_blocks, layout.block_group))
    return d_rows.astype(rows.dtype), d_weights.astype(weights.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def _varying_like(init: jax.Array, *others: jax.Array) -> jax.Array:
    """``init`` typed as differing between devices wherever ``others`` are (inside a
    ``shard_map``, a scan's carry must keep one type, and the blocks' sums vary as the rows do)."""
    return varying_over(init, frozenset().union(*(varying_axes(x) for x in others)))


@dataclasses.dataclass(frozen=True)
class _BlockLayout:
    """Where each group's rows sit when every group is padded to whole blocks: padded slot ``p``
    of group ``q`` holds row ``start[q] + (p - padded_start[q])`` when inside the group."""

    m: int
    n_blocks: int
    block: int
    padded_start: jax.Array  # (G,) each group's first padded slot
    start: jax.Array  # (G,) each group's first row
    sizes: jax.Array  # (G,)
    source: jax.Array  # (n_blocks * block,) the row each padded slot reads (0 outside a group)
    inside: jax.Array  # (n_blocks * block,) whether the slot holds a row
    block_group: jax.Array  # (n_blocks,) each block's group

    @classmethod
    def of(cls, m: int, g: int, sizes: jax.Array, block: int) -> _BlockLayout:
        n_blocks = -(-m // block) + g  # each group wastes less than one block
        blocks_per_group = -(-sizes // block)  # (G,)
        padded_start = (jnp.cumsum(blocks_per_group) - blocks_per_group) * block
        start = jnp.cumsum(sizes) - sizes
        slot = jnp.arange(n_blocks * block)
        group = jnp.clip(jnp.searchsorted(padded_start, slot, side="right") - 1, 0, g - 1)
        offset = slot - padded_start[group]
        inside = offset < sizes[group]
        source = jnp.where(inside, start[group] + offset, 0)
        block_group = group.reshape(n_blocks, block)[:, 0]
        return cls(m, n_blocks, block, padded_start, start, sizes, source, inside, block_group)

    def pad(self, rows: jax.Array) -> jax.Array:
        """``(M, K) -> (n_blocks, block, K)``: each group's rows at its padded slots, zeros elsewhere."""
        padded = jnp.where(self.inside[:, None], rows[self.source], 0)
        return padded.reshape(self.n_blocks, self.block, rows.shape[1])

    def unpad(self, out: jax.Array) -> jax.Array:
        """``(n_blocks, block, N) -> (M, N)``: each row's result from its padded slot (0 past the groups)."""
        g = self.sizes.shape[0]
        out = out.reshape(self.n_blocks * self.block, out.shape[-1])
        row = jnp.arange(self.m)
        row_group = jnp.clip(jnp.searchsorted(self.start + self.sizes, row, side="right"), 0, g - 1)
        placed = self.padded_start[row_group] + row - self.start[row_group]
        grouped = row < jnp.sum(self.sizes)
        return jnp.where(grouped[:, None], out[jnp.clip(placed, 0, self.n_blocks * self.block - 1)], 0)


def _blocked_product(rows: jax.Array, weights: jax.Array, sizes: jax.Array, block: int) -> jax.Array:
    """The blocked grouped matmul itself: pad, one matmul a block in a scan, unpad."""
    layout = _BlockLayout.of(rows.shape[0], weights.shape[0], sizes, block)

    def one_block(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        x, q = xs
        return None, x @ weights[q]

    _, out = jax.lax.scan(one_block, None, (layout.pad(rows), layout.block_group))  # (n_blocks, block, N)
    return layout.unpad(out).astype(out.dtype)
