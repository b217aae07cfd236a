"""Losses: ``(forward, batch) -> (scalar loss, count)``, where ``forward`` runs the model.

The count is what the loss averaged over (tokens, examples); the step reports it. Both losses
work on Auto and Explicit mesh axes (:func:`like` reconciles a target with the model's output).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from shardkit.core.errors import InputError
from shardkit.models.segments import packed_rows

Batch = Mapping[str, jax.Array]
# loss(forward, batch) -> (scalar loss, number of tokens/examples it averaged over)
LossFn = Callable[[Callable[[Any], Any], Batch], tuple[jax.Array, jax.Array]]


def next_token_loss(forward: Callable[[jax.Array], jax.Array], batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``, over the
    predictions that count.

    Args:
      forward: ``(B, T) int tokens -> (B, T, V) logits`` (or ``(logits, aux_loss)``, added).
      batch: ``{"tokens": (B, T + 1) int32}``, and optionally, shaped as ``tokens``:
        ``"segments"`` (int: 0 padding, 1..k the document of each token in its row; packed rows
        attend within a document, :mod:`shardkit.models.segments`) and ``"loss_mask"`` (the
        weight of predicting each token: 0 for a prompt, 1 for a completion, or any weight >= 0).

    Returns:
      ``(loss, number of scored tokens)``: the loss is the weighted mean over the predictions
      whose target is not padding and lies in the same document as its input, times
      ``loss_mask`` of the target; the count is the sum of those weights (:func:`scored_dtype`).
    """
    tokens = batch["tokens"]
    segments, mask = batch.get("segments"), batch.get("loss_mask")
    with packed_rows(None if segments is None else segments[:, :-1]):
        out = forward(tokens[:, :-1])  # (B, T, V), or (logits, auxiliary loss) for mixtures of experts
    logits, aux = out if isinstance(out, tuple) else (out, 0.0)
    targets = tokens[:, 1:]  # (B, T)
    losses = cross_entropy(logits, targets)
    if segments is None and mask is None:
        return losses.mean() + aux, jnp.asarray(targets.size, jnp.int32)
    weight = jnp.ones(targets.shape, jnp.float32)
    if segments is not None:  # never across a document boundary, never a padding target
        weight = weight * ((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0))
    if mask is not None:
        weight = weight * mask[:, 1:].astype(jnp.float32)
    weight = like(weight, losses)
    scored = weight.sum()
    return (losses * weight).sum() / jnp.maximum(scored, 1.0) + aux, scored.astype(scored_dtype(batch))


def scored_dtype(batch: Batch) -> Any:
    """The dtype of the count a loss of ``batch`` averages over: float32 where a ``loss_mask``
    holds fractional weights (the count is their sum, which microbatches are weighted by), int32
    otherwise (a number of tokens, exact past float32's 2**24).

    Example:
      >>> import numpy as np
      >>> scored_dtype({"tokens": np.zeros((2, 5), np.int32), "loss_mask": np.full((2, 5), 0.5, np.float32)})
      <class 'jax.numpy.float32'>
    """
    mask = batch.get("loss_mask")
    return jnp.float32 if mask is not None and jnp.issubdtype(mask.dtype, jnp.floating) else jnp.int32


def like(x: jax.Array, reference: jax.Array) -> jax.Array:
    """``x`` sharded as ``reference`` where sharding is in the types (Explicit mesh axes), so a
    loss can combine a model's output, split as the model chose, with the batch's targets, split
    as shardkit chose. Unchanged on Auto axes, where the partitioner reconciles them."""
    sharding = getattr(jax.typeof(reference), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
        return x
    spec = tuple(sharding.spec) + (None,) * (reference.ndim - len(sharding.spec))
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*spec[: x.ndim]))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``(..., V)`` logits, ``(...)`` int targets -> ``(...)`` float32 cross-entropy.

    The target logit is picked with a compare-and-sum over the vocabulary, not a gather, so a
    vocabulary split over devices (tensor parallelism) needs only reductions. (A gather of
    vocab-sharded logits inside a pipeline stage with data and tensor axes aborts XLA's SPMD
    partitioner in jax 0.10.2.)
    """
    logits = logits.astype(jnp.float32)
    targets = like(targets, logits)
    vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(targets[..., None] == vocab, logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def mse_loss(forward: Callable[[jax.Array], jax.Array], batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Mean squared error of ``forward(batch["x"])`` against ``batch["y"]``.

    Args:
      forward: ``x -> prediction``, shaped as ``y``.
      batch: ``{"x": (B, ...) inputs, "y": (B, ...) targets}``.

    Returns:
      ``(loss, number of examples B)``.

    Raises:
      InputError: ``x`` does not fit the model, or the prediction and ``y`` differ in shape
        (broadcasting them would average the wrong pairs), naming the shapes; raised while the
        step is traced, before any compile.
    """
    x, y = batch["x"], batch["y"]
    try:
        pred = forward(x)
    except (TypeError, ValueError) as e:  # jax's shape errors, where the model meets x
        raise InputError(
            f"mse_loss: the model does not take batch['x'] of shape {tuple(x.shape)} ({e}). Fix: x shaped as the "
            "model's input, rows first."
        ) from e
    if tuple(pred.shape) != tuple(y.shape):
        raise InputError(
            f"mse_loss: the model's prediction for batch['x'] {tuple(x.shape)} has shape {tuple(pred.shape)}, "
            f"batch['y'] has shape {tuple(y.shape)}; they would broadcast, pairing the wrong values. Fix: y shaped "
            f"as the prediction (e.g. y.reshape({', '.join(map(str, pred.shape))}))."
        )
    return jnp.mean((pred.astype(jnp.float32) - like(y, pred)) ** 2), jnp.asarray(x.shape[0], jnp.int32)
