"""Sample text from a trained language model (one compiled forward over a fixed window)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.model import Model, Params


@functools.partial(jax.jit, static_argnums=(0,))
def _next_token_logits(model: Model, params: Params, window: jax.Array, position: jax.Array) -> jax.Array:
    logits = model.apply(params, window, None)  # (1, T, V)
    return jax.lax.dynamic_index_in_dim(logits[0], position, keepdims=False)  # (V,)


def generate(
    model: Model,
    params: Params,
    prompt: np.ndarray,
    num_tokens: int,
    window: int,
    *,
    temperature: float = 0.8,
    seed: int = 0,
) -> np.ndarray:
    """Continue ``prompt`` by ``num_tokens`` tokens, sampling at ``temperature`` (0: greedy).

    The model always sees a ``(1, window)`` array (left-aligned, padded with zeros), so one
    compile serves every position; causal attention makes the padding after the current
    position irrelevant.

    Args:
      model: a shardkit Model whose ``apply`` maps tokens (1, T) to logits (1, T, V).
      params: its parameters (sharded or not).
      prompt: (P,) int tokens, P >= 1.
      num_tokens: how many tokens to add.
      window: context length the model sees.
      temperature: softmax temperature; 0 picks the most likely token.
      seed: sampling seed.

    Returns:
      (P + num_tokens,) int32 tokens.
    """
    tokens = list(np.asarray(prompt, dtype=np.int32))
    key = jax.random.key(seed)
    for _ in range(num_tokens):
        context = tokens[-window:]
        padded = np.zeros((1, window), np.int32)
        padded[0, : len(context)] = context
        logits = _next_token_logits(model, params, jnp.asarray(padded), jnp.int32(len(context) - 1))
        if temperature == 0:
            nxt = int(jnp.argmax(logits))
        else:
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, logits.astype(jnp.float32) / temperature))
        tokens.append(nxt)
    return np.asarray(tokens, np.int32)
