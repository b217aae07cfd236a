"""LoRA adapters on a GPT layer's projections: where they are made, and what they add.

Each adapter is a pair ``lora_<t>_a`` (inputs..., r), ``lora_<t>_b`` (r, outputs...) on the module
that holds the projection, named with its base weight's logical axes (:mod:`shardkit.models.lora`).

Example:
  >>> ADAPTER_KEY.get() is None  # outside a layer's training call
  True
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.models.dropout import dropout
from shardkit.models.layers.norms import param
from shardkit.models.lora import TARGETS

if TYPE_CHECKING:
    from shardkit.models.gpt import GPTConfig

# The key of the adapters' dropout within a layer's training call (None: evaluating, or no LoRA).
ADAPTER_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("shardkit_lora_key", default=None)


def adapters(
    module: nnx.Module,
    cfg: GPTConfig,
    rngs: nnx.Rngs,
    target: str,
    inputs: tuple[tuple[int, ...], tuple[str | None, ...]],
    outputs: tuple[tuple[int, ...], tuple[str | None, ...]],
) -> None:
    """``lora_<t>_a`` (inputs..., r) and ``lora_<t>_b`` (r, outputs...) on ``module`` where
    ``cfg.lora`` targets ``target`` (``"q_proj"``): A uniform in +-1/sqrt(fan-in) as peft draws
    it, B zero; each named as its base weight's input and output dimensions."""
    if cfg.lora is None or target not in cfg.lora.targets:
        return
    short, r, (in_shape, in_names), (out_shape, out_names) = TARGETS[target], cfg.lora.rank, inputs, outputs
    fan_in = tuple(range(len(in_shape)))
    a_init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=fan_in, out_axis=len(in_shape))
    setattr(module, f"lora_{short}_a", param(rngs, a_init, (*in_shape, r), (*in_names, None), cfg.param_dtype))
    b_shape, b_names = (r, *out_shape), (None, *out_names)
    setattr(module, f"lora_{short}_b", param(rngs, nnx.initializers.zeros, b_shape, b_names, cfg.param_dtype))


def low_rank(module: nnx.Module, cfg: GPTConfig, short: str, x: jax.Array, spec: str) -> jax.Array | None:
    """``(alpha / r) (x A) B`` of the adapter ``short`` on ``module``, or None without one.
    ``spec``: the einsum of ``x`` with A to ``r`` (``"btd,dr->btr"``); B maps ``r`` to the
    output dimensions."""
    a = getattr(module, f"lora_{short}_a", None)
    if a is None or cfg.lora is None:
        return None
    b = getattr(module, f"lora_{short}_b")[...].astype(x.dtype)
    with jax.named_scope(f"lora_{short}"):
        key = ADAPTER_KEY.get()  # peft's lora_dropout: on the adapter's input, in training only
        if key is not None and cfg.lora.dropout:
            x = dropout(x, cfg.lora.dropout, jax.random.fold_in(key, list(TARGETS.values()).index(short)))
        xa = jnp.einsum(spec, x, a[...].astype(x.dtype))  # (B, T, r)
        return jnp.einsum("btr,r...->bt...", xa, b) * jnp.asarray(cfg.lora.scale, x.dtype)
