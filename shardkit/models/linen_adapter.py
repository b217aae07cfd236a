"""The Linen adapter: a Flax Linen module and an example input as a
:class:`~shardkit.models.model.Model`.

:func:`from_linen` traces the module once (:class:`LinenTrace`: its collections after ``init``
and after one training call, the named axes and RNG streams it turns out to need) and builds the
model's functions from it (:class:`LinenCall`): parameters unboxed from ``init``, collections a
training call writes back kept as the model's state, submodule calls bounded
(:mod:`shardkit.models.boundaries`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import errors as flax_errors
from flax import linen as nn

from shardkit.core.errors import ModelError
from shardkit.core.partition import linen_axes
from shardkit.models.boundaries import batch_in_flight, constrain_outputs, linen_boundaries
from shardkit.models.model import Model, Params, call_kwargs, leaf_paths, refusing_apply, with_axis_names

LINEN_EVAL_WRITES = """\
Model {name} writes its state {collections} when evaluated: {error}
Fix: give the flag that makes it read its running statistics, as eval_kwargs={{'train': False}}
(and train_kwargs={{'train': True}}), with your argument's name.
"""


def from_linen(
    module: nn.Module,
    *example_inputs: Any,
    name: str | None = None,
    info: Mapping[str, Any] | None = None,
    boundaries: bool = True,
    train_kwargs: Mapping[str, Any] | None = None,
    eval_kwargs: Mapping[str, Any] | None = None,
) -> Model:
    """Wrap a Flax Linen module.

    Shardings come from its boxes: ``nn.with_logical_partitioning`` names resolve through the
    rules; ``nn.with_partitioning`` names mesh axes, used as such.

    Args:
      module: the Linen module.
      example_inputs: one input for ``module.init``, shaped like what the loss passes to the
        model (shapes only matter; e.g. ``jnp.zeros((2, 16))``).
      name: shown in tables.
      info: facts reports use (see :class:`Model`); inferred from the parameters when absent.
      boundaries: constrain every submodule's batched outputs (:mod:`shardkit.models.boundaries`).
      train_kwargs: keyword arguments of ``__call__`` in a training step (and at ``init``), for a
        module written as ``__call__(self, x, train: bool)``: ``{"train": True}``.
      eval_kwargs: the same when evaluating (no dropout key): ``{"train": False}``.

    Collections a training call reads and writes back (``nn.BatchNorm``'s ``batch_stats``) are the
    model's state (:attr:`Model.state_init`): a training step applies the module with them
    mutable and keeps what it wrote; evaluation reads them (give ``eval_kwargs`` that make the
    module use its running averages, else evaluating raises ``ModelError``). Collections it only
    appends to (``sow``) are dropped. Named axes a module written for ``pmap`` reduces over
    (``nn.BatchNorm(axis_name="batch")``) are bound to axes of size 1 (:func:`with_axis_names`),
    and RNG streams besides ``dropout`` (``self.make_rng("noise")``) are keyed from the step's key
    (:func:`linen_rngs`); both are found by tracing ``init`` and one training call here.

    Example:
      >>> import flax.linen as nn, jax.numpy as jnp
      >>> model = from_linen(nn.Dense(4), jnp.zeros((1, 8)))
    """
    label = name or type(module).__name__
    training, evaluating = call_kwargs(label, train_kwargs, eval_kwargs)
    if len(example_inputs) != 1:
        raise ModelError(
            f"from_linen({label}, ...) takes one example input, shaped like what the loss passes to the model; got "
            f"{len(example_inputs)}. Fix: give other arguments of __call__ by keyword, as train_kwargs={{'train': "
            "True}, eval_kwargs={'train': False}."
        )
    calls = LinenCall(module, example_inputs[0], label, boundaries, training, evaluating)
    traced = LinenTrace.of(calls)
    names = traced.axis_names
    init = with_axis_names(lambda key: nn.meta.unbox(calls.init_all(key)["params"]), names)
    apply = with_axis_names(lambda params, inputs, key: calls({"params": params}, inputs, key, ()), names)
    axes, facts = linen_axes(traced.variables["params"]), dict(info or {})
    if not traced.kept:
        return Model(init, apply, axes, label, facts, axis_names=names)
    state_init = with_axis_names(lambda key: calls.state_init(key, traced.kept), names)
    state_apply = with_axis_names(lambda *args: calls.state_apply(traced.kept, *args), names)
    refusing = refusing_apply(label)
    return Model(init, refusing, axes, label, facts, state_init=state_init, state_apply=state_apply, axis_names=names)


@dataclasses.dataclass(eq=False)  # hashed by identity: its methods are traced functions
class LinenCall:
    """Calls of the module from pure values. ``example``: the input ``init`` takes; ``streams``:
    the RNG streams it draws besides ``dropout`` (found by :class:`LinenTrace`, set once before
    any real call)."""

    module: nn.Module
    example: Any
    label: str
    boundaries: bool
    training: dict[str, Any]
    evaluating: dict[str, Any]
    streams: tuple[str, ...] = ()

    def init_all(self, key: jax.Array) -> Any:
        """Every collection of ``module.init``, boxed."""
        return self.module.init({"params": key, **linen_rngs(key, self.streams)}, self.example, **self.training)

    def __call__(self, variables: Any, inputs: Any, key: jax.Array | None, mutable: Sequence[str]) -> Any:
        """``module.apply`` in train mode with a key, eval mode without; ``mutable`` collections
        come back with the outputs."""
        rngs = None if key is None else linen_rngs(key, self.streams)
        kwargs = self.evaluating if key is None else self.training
        if not self.boundaries:
            return self.module.apply(variables, inputs, rngs=rngs, mutable=list(mutable) or False, **kwargs)
        with batch_in_flight(inputs), linen_boundaries():
            out = self.module.apply(variables, inputs, rngs=rngs, mutable=list(mutable) or False, **kwargs)
            if mutable:
                return constrain_outputs(out[0], (inputs,)), out[1]
            return constrain_outputs(out, (inputs,))

    def state_init(self, key: jax.Array, kept: Sequence[str]) -> Any:
        """The kept collections of ``init``, unboxed."""
        made = self.init_all(key)
        return {c: nn.meta.unbox(made[c]) for c in kept}

    def state_apply(
        self, kept: Sequence[str], params: Params, state: Any, inputs: Any, key: jax.Array | None
    ) -> tuple[Any, Any]:
        """``Model.state_apply``: a training call writes the kept collections back; an evaluating
        one must only read them."""
        if key is not None:
            outputs, updated = self({"params": params, **state}, inputs, key, kept)
            return outputs, {c: updated[c] for c in kept}
        try:
            return self({"params": params, **state}, inputs, None, ()), state
        except flax_errors.ModifyScopeVariableError as e:
            raise ModelError(LINEN_EVAL_WRITES.format(name=self.label, collections=list(kept), error=e)) from None


@dataclasses.dataclass(frozen=True)
class LinenTrace:
    """What one abstract ``init`` and one abstract training call show of a Linen module.

    Attributes:
      variables: every collection's shapes after ``init``.
      axis_names: the named axes its modules reduce over (``nn.BatchNorm(axis_name=...)``).
      kept: the collections a training call reads and writes back in the same structure (the
        model's state); those it only appends to (``sow``) are left out.
    """

    variables: Any
    axis_names: tuple[str, ...]
    kept: tuple[str, ...]

    @classmethod
    def of(cls, calls: LinenCall) -> LinenTrace:
        """Trace ``calls.module`` on its example; sets ``calls.streams`` to the RNG streams it needs."""
        seen: dict[str, Any] = {}

        def trace(names: Sequence[str], rng_names: Sequence[str]) -> None:
            # A training call may write every collection; Flax's BatchNorm reaches its axis_name
            # only when applied, not at init, so the call always runs.
            calls.streams, key = tuple(rng_names), jax.random.key(0)
            seen["variables"] = variables = jax.eval_shape(with_axis_names(calls.init_all, names), key)
            others = sorted(set(variables) - {"params"})
            out = jax.eval_shape(with_axis_names(lambda v: calls(v, calls.example, key, others), names), variables)
            seen["updated"] = out[1] if others else {}

        try:
            names, calls.streams = names_needed(trace, calls.label)
        except TypeError as e:
            if "argument" not in str(e):
                raise
            raise ModelError(
                f"{calls.label}.init with the example input failed: {e}. Fix: pass the other arguments of __call__ "
                "as train_kwargs={'train': True}, eval_kwargs={'train': False} (your names and values)."
            ) from e
        variables, updated = seen["variables"], seen["updated"]
        written_back = [c for c in sorted(updated) if c in variables]
        kept = tuple(c for c in written_back if leaf_paths(updated[c]) == leaf_paths(variables[c]))
        return cls(variables, names, kept)


_UNBOUND_AXIS = re.compile(r"unbound axis name: ([^\s.,;]+)")
_MISSING_RNG = re.compile(r'needs PRNG for "([^"]+)"')


def names_needed(
    trace: Callable[[Sequence[str], Sequence[str]], Any], label: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The named axes and the RNG streams ``trace(axis_names, rng_names)`` needs: it is run with
    none, then with each name its errors report missing added (an unbound axis ``NameError``,
    Flax's ``InvalidRngError``), until it traces. A Linen module shows both only when it runs
    (``BatchNorm(axis_name=...)``, ``self.make_rng("noise")``).

    Returns:
      ``(axis_names, rng_names)``, each in the order found.
    """
    axes: list[str] = []
    rngs: list[str] = []
    for _ in range(16):
        try:
            trace(tuple(axes), tuple(rngs))
            return tuple(axes), tuple(rngs)
        except (NameError, flax_errors.InvalidRngError) as e:
            pattern, found_in = (_UNBOUND_AXIS, axes) if isinstance(e, NameError) else (_MISSING_RNG, rngs)
            found = pattern.search(str(e))
            if found is None or found.group(1) in found_in:
                raise
            found_in.append(found.group(1))
    raise ModelError(
        f"Model {label} needs more than 16 named axes and RNG streams ({axes}, {rngs}); shardkit provides up to 16."
    )


def linen_rngs(key: jax.Array, names: Sequence[str]) -> dict[str, jax.Array]:
    """The RNG streams of a Linen call: ``dropout`` is the step's key, and each other stream the
    module asks for (``self.make_rng("noise")``) is ``fold_in(key, i + 1)``, ``i`` its place in
    ``names``.

    Example:
      >>> import jax
      >>> sorted(linen_rngs(jax.random.key(0), ["noise"]))
      ['dropout', 'noise']
    """
    return {"dropout": key, **{name: jax.random.fold_in(key, i + 1) for i, name in enumerate(names)}}
