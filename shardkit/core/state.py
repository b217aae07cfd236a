"""The train state: everything a training run carries from step to step (a pytree)."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax

Params = Any


@flax.struct.dataclass
class TrainState:
    """Everything a training run carries from step to step (a pytree).

    Attributes:
      step: int32 scalar, the number of steps applied.
      params: the model parameters (nested dicts of arrays).
      opt_state: the optax state.
      rng: uint32 key data; step ``s`` draws dropout bits from ``fold_in(rng, s)``, so the bits
        depend on the seed and the step only, never on the layout or on restarts.
      master: float32 master copy of the parameters under the ``bf16-master`` precision
        policy (the optimizer updates it; ``params`` is its bf16 image), else None. A frozen
        parameter (LoRA's base) never updates and has no master: ``optax.MaskedNode`` in its
        place (:func:`master_copy`).
      model_state: the model's non-trainable state (``nnx.BatchNorm``'s running statistics,
        Linen's ``batch_stats``), updated by each step's forward pass; None for a model without.

    Seeds: ``init(seed)`` splits ``jax.random.key(seed)`` in two; the first creates the
    parameters, the second is ``rng``.
    """

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    rng: jax.Array
    master: Params | None = None
    model_state: Any = None


def _masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def master_copy(params: Params, dtype: Any, trainable: Any = None) -> Params:
    """The master copy of ``params`` in ``dtype``: ``optax.MaskedNode`` where ``trainable`` (a
    tree of bools shaped as ``params``; None: all train) is False, as a frozen parameter never
    updates (LoRA on an 8B base in bf16: 32 GB of fp32 master weights that would only be read).

    Example:
      >>> import jax.numpy as jnp
      >>> master_copy({"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)}, jnp.float32, {"a": True, "b": False})
      {'a': Array([1., 1.], dtype=float32), 'b': MaskedNode()}
    """
    if trainable is None:
        return jax.tree.map(lambda x: x.astype(dtype), params)
    return jax.tree.map(lambda x, t: x.astype(dtype) if t else optax.MaskedNode(), params, trainable)


def update_target(params: Params, master: Params | None) -> Params:
    """What the optimizer updates: the master copy, with the stored parameters where a frozen
    parameter has none (their updates are zero); ``params`` when there is no master."""
    if master is None:
        return params
    return jax.tree.map(lambda m, p: p if _masked(m) else m, master, params, is_leaf=_masked)


def frozen_in(master: Params) -> Params:
    """A tree of bools shaped as the parameters: which have no master copy (frozen)."""
    return jax.tree.map(_masked, master, is_leaf=_masked)


def next_master(master: Params, updated: Params) -> Params:
    """The master copy after a step: ``updated`` where a master exists, still masked elsewhere."""
    return jax.tree.map(lambda m, u: m if _masked(m) else u, master, updated, is_leaf=_masked)
