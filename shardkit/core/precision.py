"""Mixed-precision policies: which dtype the parameters are stored in, computed in, and updated in.

=============  ==============  =============  =================================================
policy         stored params   compute        optimizer updates
=============  ==============  =============  =================================================
``fp32``       float32         float32        the float32 params
``bf16``       float32         bfloat16       the float32 params (params cast for the forward)
``bf16-master`` bfloat16       bfloat16       a float32 master copy; params = master in bf16
=============  ==============  =============  =================================================

``bf16-master`` is the layout of ZeRO's mixed-precision Adam: 2 bytes of bf16 parameters,
2 of bf16 gradients, 12 of fp32 master weights and moments per parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from shardkit.core.errors import InputError


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy.

    Attributes:
      name: the policy's name.
      compute: dtype of the forward and backward pass (floating parameters are cast to it).
      params: dtype the parameters are stored in.
      master: dtype of the master copy the optimizer updates, or None to update ``params``.
    """

    name: str
    compute: Any
    params: Any
    master: Any | None = None

    def cast_for_compute(self, params: Any) -> Any:
        """Floating parameters in the compute dtype (integers untouched)."""
        return _cast(params, self.compute)

    def optimizer_copy(self, params: Any) -> Any:
        """What the optimizer updates: the master copy, or the parameters as stored."""
        if self.master is not None:
            return jax.tree.map(lambda x: x.astype(self.master), params)
        return self.cast_for_storage(params)

    def cast_for_storage(self, params: Any) -> Any:
        return _cast(params, self.params)

    @property
    def update_dtype(self) -> Any:
        """The dtype the optimizer updates in (and keeps its moments in): the master copy's or the
        stored parameters'."""
        return self.master if self.master is not None else self.params

    def state_bytes_per_param(self, optimizer_bytes: float) -> float:
        """Bytes of model state per parameter: stored parameters, the master copy if any, and the
        optimizer's ``optimizer_bytes`` (see :func:`shardkit.analysis.estimate.optimizer_bytes_per_param`).

        Example:
          >>> POLICIES["bf16-master"].state_bytes_per_param(8.0)  # ZeRO's 2 + 4 + 8 for Adam
          14.0
        """
        master = jnp.dtype(self.master).itemsize if self.master is not None else 0
        return float(jnp.dtype(self.params).itemsize + master + optimizer_bytes)

    @property
    def grad_bytes_per_param(self) -> int:
        """Bytes of a parameter's gradient: gradients come in the stored parameters' dtype."""
        return jnp.dtype(self.params).itemsize


def _cast(tree: Any, dtype: Any) -> Any:
    def one(x: Any) -> Any:
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    return jax.tree.map(one, tree)


POLICIES: dict[str, Precision] = {
    "fp32": Precision("fp32", jnp.float32, jnp.float32),
    "bf16": Precision("bf16", jnp.bfloat16, jnp.float32),
    "bf16-master": Precision("bf16-master", jnp.bfloat16, jnp.bfloat16, master=jnp.float32),
}


def as_precision(policy: str | Precision) -> Precision:
    """A policy by name (``fp32``, ``bf16``, ``bf16-master``) or as given."""
    if isinstance(policy, Precision):
        return policy
    if policy not in POLICIES:
        raise InputError(f"Unknown precision {policy!r}; choose one of {', '.join(POLICIES)}.")
    return POLICIES[policy]
