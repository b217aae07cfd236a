"""Dropout whose bits depend on the key and each element's place in the whole batch, never on
the layout or on how the step splits the rows.

Threefry is partitionable, so one draw over the global shape gives the same bits on any mesh.
What a plain ``jax.random.bernoulli`` does not survive is a ``vmap`` over blocks of rows: each
block would draw the same bits for its own rows. shardkit vmaps the model over each device's rows
when gradient accumulation reduces once (``shardkit.training.accumulation.once_reduced_grads``); :func:`dropout`
carries a batching rule that draws for the concatenated rows instead, so the vmapped step sees
the bits of the whole microbatch, row for row.

Models that draw their own bits (``nnx.Dropout``, ``jax.random`` in ``__call__``) still train
exactly: shardkit sees the draws in the traced program and then reduces per microbatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _draw(key: jax.Array, keep: jax.Array, like: jax.Array) -> jax.Array:
    return jax.random.bernoulli(key, keep, like.shape)


_keep = jax.custom_batching.custom_vmap(_draw)


@_keep.def_vmap
def _keep_rows(
    axis_size: int, in_batched: list[bool], key: jax.Array, keep: jax.Array, like: jax.Array
) -> tuple[jax.Array, bool]:
    key_batched, keep_batched, _ = in_batched
    if key_batched or keep_batched:  # a key per element (a vmap over keys): one draw each
        keys = key if key_batched else jnp.broadcast_to(key, (axis_size, *key.shape))
        keeps = keep if keep_batched else jnp.broadcast_to(keep, (axis_size,))
        rows_like = like if in_batched[2] else jnp.broadcast_to(like, (axis_size, *like.shape))
        return jax.vmap(_draw)(keys, keeps, rows_like), True
    # A vmap over blocks of rows: the bits of the blocks laid end to end.
    whole = jax.random.bernoulli(key, keep, (axis_size * like.shape[1], *like.shape[2:]))
    return whole.reshape(like.shape), True


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Zero each element of ``x`` with probability ``rate`` and scale the rest by ``1/(1-rate)``.

    Args:
      x: activations, ``(B, ...)``: dimension 0 is the batch rows.
      rate: the drop probability, in ``[0, 1)``.
      key: a JAX PRNG key; None (evaluation) or ``rate == 0`` returns ``x`` unchanged.

    Returns:
      An array shaped and typed like ``x``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.ones((4, 3))
      >>> y = dropout(x, 0.5, jax.random.key(0))
      >>> sorted(set(y.ravel().tolist())) in ([0.0, 2.0], [2.0], [0.0])
      True
      >>> halves = jax.vmap(lambda h: dropout(h, 0.5, jax.random.key(0)))(x.reshape(2, 2, 3))
      >>> bool((halves.reshape(4, 3) == y).all())  # blocks of rows draw the bits of the whole
      True
    """
    if key is None or rate == 0.0:
        return x
    keep = _keep(key, jnp.asarray(1.0 - rate, jnp.float32), jax.lax.stop_gradient(x))
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
