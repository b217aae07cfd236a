"""Parameters with logical axis names, and the RMSNorm every decoder here uses.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> RMSNorm(4, 1e-6, "float32", nnx.Rngs(0))(jnp.ones((1, 2, 4))).shape
  (1, 2, 4)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.core.partition import logical


def param(rngs: nnx.Rngs, init: Any, shape: tuple[int, ...], names: tuple[str | None, ...], dtype: str) -> nnx.Param:
    """A parameter of ``shape`` drawn by ``init`` from the ``params`` stream, its dimensions named
    ``names`` (logical axes), held in ``dtype``."""
    return nnx.Param(logical(init, names)(rngs.params(), shape, jnp.dtype(dtype)))


class RMSNorm(nnx.Module):
    """RMSNorm over the last dimension, times ``offset + scale`` (``offset`` 1: Gemma's, whose
    scale starts at 0)."""

    def __init__(
        self, dim: int, eps: float, param_dtype: str, rngs: nnx.Rngs, offset: float = 0.0, axis: str | None = "embed"
    ):
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.scale = param(rngs, init, (dim,), (axis,), param_dtype)
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)  # (B, T, D)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (normed * (self.offset + scale if self.offset else scale)).astype(x.dtype)
