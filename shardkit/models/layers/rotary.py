"""Rotary position embeddings applied to queries and keys (the frequencies: :mod:`shardkit.models.rope`).

Example:
  >>> import jax.numpy as jnp
  >>> rotary(jnp.ones((1, 3, 2, 8)), 10000.0).shape
  (1, 3, 2, 8)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.models.rope import RopeScaling, angles, inverse_frequencies, yarn_attention_factor


def rotary(
    x: jax.Array, theta: float, scaling: RopeScaling | None = None, positions: jax.Array | None = None
) -> jax.Array:
    """Rotary position embedding of ``x`` (B, T, heads, K) in the rotate-half layout (the two
    halves of each head rotate together), by position along T, or by ``positions`` (B, T) when
    given (rows of a batched KV-cache decode, each at its own offset)."""
    inv_freq = inverse_frequencies(x.shape[-1], theta, scaling)
    factor = yarn_attention_factor(scaling)  # yarn scales the rotated vectors (1.0 otherwise)
    if positions is None:
        cos, sin = angles(x.shape[1], inv_freq)  # (1, T, 1, K/2) each
        return _rotate(x, cos * np.float32(factor), sin * np.float32(factor))
    a = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, K/2)
    return _rotate(x, jnp.cos(a)[:, :, None, :] * factor, jnp.sin(a)[:, :, None, :] * factor)


def _rotate(x: jax.Array, cos: Any, sin: Any) -> jax.Array:
    # The angles depend only on static shapes: computed in NumPy, they enter the program as
    # constants. Traced, XLA evaluated cos and sin inside every fusion that reads them, forward
    # and backward (on CPU the fused QKV output's gradient took 8 ms per layer, 3 ms after).
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # (B, T, heads, K/2) each
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def layer_rotary(x: jax.Array, cfg: Any, sliding: bool | jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """:func:`rotary` with the base of this layer's kind: a sliding-window layer of a model with
    ``rope_local_theta`` (Gemma 3) uses that base, unscaled; ``sliding`` may be traced (a scanned
    stack of mixed layers), then both rotations are computed and the layer's flag picks one."""
    if cfg.rope_local_theta is None:
        return rotary(x, cfg.rope_theta, cfg.rope_scaling, positions)
    if isinstance(sliding, bool):
        if sliding:
            return rotary(x, cfg.rope_local_theta, None, positions)
        return rotary(x, cfg.rope_theta, cfg.rope_scaling, positions)
    if positions is not None:
        local, full = (
            rotary(x, cfg.rope_local_theta, None, positions),
            rotary(x, cfg.rope_theta, cfg.rope_scaling, positions),
        )
        return jnp.where(sliding, local, full)
    t, k = x.shape[1], x.shape[-1]
    factor = np.float32(yarn_attention_factor(cfg.rope_scaling))
    cos_g, sin_g = (a * factor for a in angles(t, inverse_frequencies(k, cfg.rope_theta, cfg.rope_scaling)))
    cos_l, sin_l = angles(t, inverse_frequencies(k, cfg.rope_local_theta))
    return _rotate(x, jnp.where(sliding, cos_l, cos_g), jnp.where(sliding, sin_l, sin_g))
