"""Packed rows: several documents in one row that never see each other.

A batch may carry ``"segments"``, int32 shaped as ``"tokens"``: 0 marks padding, 1..k the
document each token belongs to within its row (``[1, 1, 1, 2, 2, 0]``). The loss
(:func:`shardkit.training.losses.next_token_loss`) opens :func:`packed_rows` around the model's
forward with the inputs' segments; shardkit's GPT then lets a token attend within its own
document only and restarts the rotary positions at each document (:func:`positions_in_rows`),
so a packed row computes what its documents compute one by one. The segments travel by a
context variable, read at trace time, so the model's call signature stays ``model(tokens)``.

Example:
  >>> import numpy as np
  >>> positions_in_rows(np.array([[1, 1, 1, 2, 2, 0]])).tolist()
  [[0, 1, 2, 0, 1, 0]]
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_SEGMENTS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("shardkit_segments", default=None)


@contextlib.contextmanager
def packed_rows(segments: jax.Array | None) -> Iterator[None]:
    """Within this context the model's rows are packed as ``segments`` ``(B, T)`` says (None: not)."""
    token = _SEGMENTS.set(segments)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def current_segments() -> jax.Array | None:
    """The segments of the rows in flight ``(B, T)``, or None for rows of one document each."""
    return _SEGMENTS.get()


def positions_in_rows(segments: jax.Array) -> jax.Array:
    """``(B, T)`` each token's position within its document (0 at each document's first token;
    padding counts on from the last document, harmlessly: it is never scored)."""
    segments = jnp.asarray(segments)
    t = jnp.arange(segments.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return (t - first).astype(jnp.int32)


def same_document(query: jax.Array, key: jax.Array) -> jax.Array:
    """``(B, T, S)``: query token ``t`` and key token ``s`` are in one document (padding, 0,
    sees padding, so its softmax stays finite; it is never scored)."""
    return query[:, :, None] == key[:, None, :]
