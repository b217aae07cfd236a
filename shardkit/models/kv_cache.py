"""What a model needs to continue token rows: a cache, and one forward pass over new tokens.

A :class:`Decoder` is the contract between a model and :mod:`shardkit.models.generate`. Rows of a
batch are right-padded prompts; each row's tokens sit at their own positions ``0, 1, ...``, so a
row's cache slot ``j`` holds the keys and values of its token at position ``j``. A forward over
``S`` new tokens at positions ``p .. p + S - 1`` of a row writes their slots and reads the slots
at or before each token: slots after it (the padding of a shorter prompt, or nothing yet) are
never read, and a decode step overwrites them before any later token can see them.

Two decoders exist: shardkit's GPT keeps keys and values (:meth:`shardkit.models.GPTConfig.decoder`,
one token's work per step), and any other model keeps its token rows and runs whole
(:func:`recompute_decoder`, the work of the whole row per step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Params = Any

# Logical names of one layer's keys or values (B, N, C, K): rows over the batch axes, kv heads over
# tensor. Heads before slots: attention's matmuls batch over heads (slots before heads cost a
# transposed copy of every layer's cache per token: decode 0.82 ms/token at 1,024 positions, 0.69
# after). One array per layer, not one stacked array: a decode step updates each in place and
# reads it where it lies, where slicing a stacked cache copied every layer's slots at every token.
KV_NAMES = ("batch", "kv_heads", None, None)

# A GPT's cache: per layer, keys and values (B, N, C, K).
LayerCaches = tuple[tuple[jax.Array, jax.Array], ...]


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static jit argument
class Decoder:
    """How a model continues rows of tokens.

    Attributes:
      empty: ``(batch, length) -> cache``, a pytree of zeros for ``batch`` rows of ``length``
        positions (traced inside the compiled prefill).
      names: logical axis names of each cache leaf (a tree matching ``empty``'s), so a generation
        layout splits the cache as it splits activations.
      forward: ``(params, cache, tokens (B, S), positions (B, S), last (B,)) -> (logits (B, V),
        cache)``: reads the new tokens, writes their slots, and returns the next-token logits
        after token ``last[b]`` of each row (float32).
      max_seq: the most positions a row may have (None: no limit known).
      kv_heads: the cache's kv heads, which a generation layout's ``tensor`` axis must divide
        (None: nothing split by heads).
      kind: ``"kv"`` (keys and values) or ``"tokens"`` (whole rows recomputed).
      prefill: ``forward`` for a cache known to be empty and rows starting at position 0 (a
        prompt's first pass): it may skip reading the cache (None: ``forward`` serves).
      step_params: ``params -> `` the form ``step`` reads, computed once before the decode loop
        (None: the parameters as they are).
      step: ``forward`` for one new token per row, reading ``step_params``'s form, with the next
        token's logits after it (``last`` is 0; None: ``forward`` serves).
    """

    empty: Callable[[int, int], Any]
    names: Any
    forward: Callable[[Params, Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]
    max_seq: int | None
    kv_heads: int | None
    kind: str = "kv"
    prefill: Callable[[Params, Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]] | None = None
    step_params: Callable[[Params], Any] | None = None
    step: Callable[[Any, Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]] | None = None


def write_rows(cache: jax.Array, new: jax.Array, start: jax.Array, axis: int = 0, slot_axis: int = 1) -> jax.Array:
    """``cache`` with ``new`` written at slots ``start[b] .. start[b] + S - 1`` of each row ``b``.

    Rows are dimension ``axis`` of both arrays and slots dimension ``slot_axis``: e.g. a GPT's
    keys ``cache (B, N, C, K)`` and ``new (B, N, S, K)`` with ``axis=0, slot_axis=2``.

    Example:
      >>> write_rows(jnp.zeros((2, 4), jnp.int32), jnp.ones((2, 2), jnp.int32), jnp.array([0, 2])).tolist()
      [[1, 1, 0, 0], [0, 0, 1, 1]]
    """
    inner = slot_axis - 1 if slot_axis > axis else slot_axis  # the slots' axis once vmap takes the rows'
    one = lambda row, value, at: jax.lax.dynamic_update_slice_in_dim(row, value, at, axis=inner)
    return jax.vmap(one, in_axes=(axis, axis, 0), out_axes=axis)(cache, new.astype(cache.dtype), start)


def write_layer(cache: tuple[jax.Array, jax.Array], new: tuple[jax.Array, jax.Array], start: jax.Array) -> Any:
    """One layer's keys and values ``(B, N, C, K)`` with the new tokens' ``(B, S, N, K)`` written
    at slots ``start[b] ..`` of each row ``b``.

    Example:
      >>> cache, new = (jnp.zeros((1, 2, 4, 3)),) * 2, (jnp.ones((1, 1, 2, 3)),) * 2
      >>> write_layer(cache, new, jnp.array([2]))[0][0, :, :, 0].tolist()
      [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    """
    return tuple(
        write_rows(c, jnp.swapaxes(n, 1, 2), start, axis=0, slot_axis=2) for c, n in zip(cache, new, strict=True)
    )


def after_reads(done: jax.Array, new: Any) -> Any:
    """``new`` (the new tokens' keys and values, ``(B, S, ...)`` leaves) unchanged, but computed
    from ``done`` ``(B, ...)``, a value that every read of the cache feeds (a step's last hidden
    states): the writes that follow then depend on the reads.

    Why: a decode loop carries the cache, and XLA updates a carried buffer in place only when the
    update is ordered after every read of the old contents by data. Unordered, it copied each
    layer's keys and values twice per token (the mini GPT at 1,088 slots: 0.21 ms a token, 0.15
    without the copies). ``jax.lax.optimization_barrier`` does not order them (tried). Each row
    adds ``0.0``, chosen by a comparison that is false for every float, NaN included, so the
    values are exactly the same.

    Example:
      >>> after_reads(jnp.array([[jnp.nan]]), (jnp.ones((1, 1, 2)),))[0].tolist()
      [[[1.0, 1.0]]]
    """
    first = done.reshape(done.shape[0], -1)[:, :1].astype(jnp.float32)  # (B, 1): the row's own
    zero = jnp.where(first > jnp.inf, first, 0.0)  # (B, 1), always 0.0
    return jax.tree.map(lambda a: a + zero.reshape(zero.shape + (1,) * (a.ndim - 2)).astype(a.dtype), new)


def pick_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x (B, S, ...)`` -> ``(B, 1, ...)``: element ``index[b]`` of each row.

    Example:
      >>> pick_rows(jnp.arange(6).reshape(2, 3), jnp.array([2, 0])).tolist()
      [[2], [3]]
    """
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)


def logits_of(outputs: Any) -> jax.Array:
    """The logits of a language model's outputs: the outputs themselves, or the first of a
    ``(logits, auxiliary loss)`` pair (a mixture of experts)."""
    return outputs[0] if isinstance(outputs, tuple) else outputs


def recompute_decoder(apply: Callable[[Params, jax.Array], Any], max_seq: int | None) -> Decoder:
    """A :class:`Decoder` for any model ``apply(params, tokens (B, T)) -> logits (B, T, V)`` (or
    ``(logits, aux)``): the cache is the token rows themselves, and each forward runs the model
    over every row whole (causal attention keeps the slots after a token from changing its
    logits). Its cost grows with the row's length; shardkit's GPT keeps keys and values instead.

    Example:
      >>> import shardkit as sk
      >>> model = sk.models.GPTConfig.preset("tiny").model()
      >>> dec = recompute_decoder(lambda p, x: model.apply(p, x, None), max_seq=128)
      >>> dec.kind
      'tokens'
    """

    def forward(params: Params, rows: jax.Array, tokens: jax.Array, positions: jax.Array, last: jax.Array):
        rows = write_rows(rows, tokens, positions[:, 0])  # (B, C)
        logits = logits_of(apply(params, rows))  # (B, C, V)
        return pick_rows(logits, jnp.take_along_axis(positions, last[:, None], 1)[:, 0])[:, 0].astype(jnp.float32), rows

    return Decoder(
        empty=lambda batch, length: jnp.zeros((batch, length), jnp.int32),
        names=("batch", None),
        forward=forward,
        max_seq=max_seq,
        kv_heads=None,
        kind="tokens",
    )
