"""A small MLP with logical axis names: the simplest model to shard.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> MLP(MLPConfig(), rngs=nnx.Rngs(0))(jnp.zeros((4, 32))).shape
  (4, 32)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.core.partition import constrain, logical


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    dim: int = 32
    hidden: int = 128
    n_layers: int = 2


class MLP(nnx.Module):
    """Residual MLP ``(B, D) -> (B, D)``: ``n_layers`` blocks of D -> hidden -> D."""

    def __init__(self, cfg: MLPConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.List(
            [
                nnx.Param(logical(init, ("embed", "mlp"))(rngs.params(), (cfg.dim, cfg.hidden)))
                for _ in range(cfg.n_layers)
            ]
        )
        self.w_out = nnx.List(
            [
                nnx.Param(logical(init, ("mlp", "embed"))(rngs.params(), (cfg.hidden, cfg.dim)))
                for _ in range(cfg.n_layers)
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x, ("batch", "embed"))  # (B, D)
        for w_in, w_out in zip(self.w_in, self.w_out):
            h = constrain(jnp.tanh(x @ w_in[...]), ("batch", "mlp"))  # (B, F)
            x = x + h @ w_out[...]  # (B, D)
        return x
