"""The gated MLP (SwiGLU, GeGLU): gate and up projections fused in one weight.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from shardkit.models.gpt import GPTConfig
  >>> SwiGLU(GPTConfig.preset("tiny"), nnx.Rngs(0))(jnp.ones((1, 4, 64))).shape
  (1, 4, 64)
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.core.partition import constrain
from shardkit.models.layers.adapters import adapters, low_rank
from shardkit.models.layers.matmul import gathered_along_seq, token_matmul, unsplit
from shardkit.models.layers.norms import param

if TYPE_CHECKING:
    from shardkit.models.gpt import GPTConfig

MLP_ACTIVATIONS: dict[str, Any] = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # Hugging Face's gelu_pytorch_tanh
}


class SwiGLU(nnx.Module):
    """Gated MLP (SwiGLU, or GeGLU with ``mlp_activation="gelu_tanh"``); gate and up projections
    fused in one (D, 2, F) weight (one backward all-reduce)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs, hidden: int | None = None):
        d, f, p = cfg.dim, hidden or cfg.mlp_dim, cfg.param_dtype
        gate_up_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
        self.w_gate_up = param(rngs, gate_up_init, (d, 2, f), ("embed", None, "mlp"), p)
        self.w_down = param(rngs, nnx.initializers.lecun_normal(), (f, d), ("mlp", "embed"), p)
        self.activation = MLP_ACTIVATIONS[cfg.mlp_activation]
        embed, units = ((d,), ("embed",)), ((f,), ("mlp",))
        adapters(self, cfg, rngs, "gate_proj", embed, units)
        adapters(self, cfg, rngs, "up_proj", embed, units)
        adapters(self, cfg, rngs, "down_proj", units, embed)
        self.cfg = cfg

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("gate_up_proj"):
            x = gathered_along_seq(x)
            w = self.w_gate_up[...].astype(x.dtype)
            flat = unsplit("seq", "mlp")
            gate_up = token_matmul(x, w, 1) if flat else jnp.einsum("btd,dcf->btcf", x, w)  # (B, T, 2, F)
            gate_up = constrain(gate_up, ("batch", "seq", None, "mlp"))
        gate, up = gate_up[:, :, 0], gate_up[:, :, 1]  # (B, T, F) each
        if self.cfg.lora is not None:
            deltas = [low_rank(self, self.cfg, short, x, "btd,dr->btr") for short in ("gate", "up")]
            gate, up = (y if delta is None else y + delta for y, delta in zip((gate, up), deltas, strict=True))
        h = self.activation(gate) * up  # (B, T, F)
        h = constrain(h, ("batch", "seq", "mlp"))
        with jax.named_scope("down_proj"):
            if unsplit("seq"):
                y = token_matmul(h, self.w_down[...].astype(x.dtype), 1)  # (B, T, D)
            else:
                y = h @ self.w_down[...].astype(x.dtype)
            delta = low_rank(self, self.cfg, "down", h, "btf,fr->btr")
            return y if delta is None else y + delta
