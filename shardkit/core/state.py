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
        policy (the optimizer updates it; ``params`` is its bf16 image), else None.
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
