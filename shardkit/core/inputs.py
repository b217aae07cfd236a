"""Host-side checks of a batch before it is sharded: cheap (one min/max per entry), and they name
the bad values, where a bad batch inside the compiled step would only turn the loss into NaN or
silently read a clamped embedding row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from shardkit.core.errors import InputError

# Entries holding vocabulary ids (not "labels": -100 is a common ignore index there).
TOKEN_KEYS = ("tokens", "input_ids", "targets")


def vocab_size(abstract_params: Any, axes: Any) -> int | None:
    """The size of the first parameter dimension named ``vocab`` (the embedding table's rows), or None.

    Example:
      >>> import shardkit as sk
      >>> model = sk.models.GPTConfig.preset("tiny").model()
      >>> vocab_size(model.abstract_params(), model.axes)
      256
    """
    from shardkit.core.partition import Axes

    shapes = jax.tree.leaves(abstract_params)
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, Axes))
    for leaf, ax in zip(shapes, names, strict=False):
        for size, name in zip(leaf.shape, ax.names or ()):
            if name == "vocab":
                return int(size)
    return None


def check_sequence_length(tokens_shape: tuple[int, ...], max_seq: int | None) -> None:
    """``(batch, seq + 1)`` tokens fit a model of ``max_seq`` positions (None: any length)."""
    if max_seq is not None and len(tokens_shape) == 2 and tokens_shape[1] - 1 > max_seq:
        raise InputError(
            f"batch['tokens'] holds sequences of {tokens_shape[1] - 1} tokens (+1 target); the model takes at "
            f"most max_seq={max_seq}. Fix: a shorter sequence, or a model with a larger max_seq."
        )


def check_host_batch(
    batch: Mapping[str, Any], *, vocab: int | None, needs_tokens: bool, max_seq: int | None = None
) -> None:
    """Refuse a batch that would train on garbage, naming the entry and the values.

    Args:
      batch: host arrays of one process, e.g. ``{"tokens": (B, T + 1) int32}``.
      vocab: the model's vocabulary size (token ids must lie in ``[0, vocab)``), or None if unknown.
      needs_tokens: the loss reads ``batch["tokens"]`` as ``(B, T + 1)`` integer ids (shardkit's
        default next-token loss).
      max_seq: the longest sequence the model takes (its positions), or None if unbounded.

    Raises:
      ShardkitError: not a dict of arrays, a missing, non-integer or 1-D ``tokens``, token ids out
        of range, or NaN/Inf in a floating-point entry.
    """
    if not isinstance(batch, Mapping) or not batch:
        raise InputError(f"A batch is a non-empty dict of arrays, e.g. {{'tokens': ids}}, got {type(batch).__name__}.")
    if needs_tokens:
        if "tokens" not in batch:
            raise InputError(
                f"The default loss (next-token cross-entropy) reads batch['tokens'], but the batch has "
                f"{sorted(batch)}. Fix: name the token ids 'tokens', or pass loss= that reads your entries."
            )
        tokens = batch["tokens"]
        if np.ndim(tokens) != 2 or np.shape(tokens)[1] < 2:
            raise InputError(
                f"batch['tokens'] must be (batch, seq + 1) token ids, got shape {np.shape(tokens)}. "
                "Fix: stack sequences into a 2-D array with one extra token per row (the last target)."
            )
        check_sequence_length(np.shape(tokens), max_seq)
        for name in ("segments", "loss_mask"):  # per token, read beside the ids (packed rows, prompts)
            if name in batch and np.shape(batch[name]) != np.shape(tokens):
                raise InputError(
                    f"batch[{name!r}] has shape {np.shape(batch[name])}; it gives one value per token, shaped as "
                    f"batch['tokens'] {np.shape(tokens)}."
                )
        if "segments" in batch:
            segments = np.asarray(batch["segments"])
            if not np.issubdtype(segments.dtype, np.integer) or (segments.size and segments.min() < 0):
                raise InputError(
                    f"batch['segments'] must hold integers >= 0 (0: padding, 1..k: the document of each token), "
                    f"got {segments.dtype} values from {segments.min() if segments.size else '-'}."
                )
        if "loss_mask" in batch:
            weights = np.asarray(batch["loss_mask"])
            if weights.dtype == np.bool_ or weights.size == 0:
                pass
            elif not np.issubdtype(weights.dtype, np.number) or weights.min() < 0:
                raise InputError(
                    f"batch['loss_mask'] must hold weights >= 0 (0: not scored, 1: scored, or a fraction), got "
                    f"{weights.dtype} values from {weights.min()}. Fix: build it with np.float32 or np.int32 weights."
                )
    for name, value in batch.items():
        dtype = getattr(value, "dtype", None)
        if dtype is None:
            raise InputError(f"batch[{name!r}] is a {type(value).__name__}, not an array. Fix: use np.asarray.")
        dtype = np.dtype(dtype)
        if name in TOKEN_KEYS or (needs_tokens and name == "tokens"):
            if not np.issubdtype(dtype, np.integer):
                raise InputError(
                    f"batch[{name!r}] holds {dtype} values; token ids must be integers. "
                    f"Fix: convert with .astype(np.int32)."
                )
            if np.size(value):
                low, high = int(np.min(value)), int(np.max(value))
                if low < 0 or (vocab is not None and high >= vocab):
                    raise InputError(
                        f"batch[{name!r}] holds token ids from {low} to {high}, outside the model's vocabulary "
                        f"[0, {vocab if vocab is not None else '?'}). An embedding lookup would read a clamped "
                        "row and train on garbage. Fix: check the tokenizer's vocabulary size against the model's."
                    )
        elif np.issubdtype(dtype, np.floating) and np.size(value) and not np.all(np.isfinite(np.asarray(value))):
            raise InputError(
                f"batch[{name!r}] holds NaN or Inf values ({int(np.sum(~np.isfinite(np.asarray(value))))} of "
                f"{np.size(value)}). Fix: clean the data before training."
            )
