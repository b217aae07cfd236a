"""The train step as small pure functions: gradient strategies and the update.

A gradient strategy is a function ``(params, model_state, batch, key) -> (loss, count, grads,
model_state, sums)`` (``model_state``: running statistics, None for most models; ``sums``: a
dict of what the model reports beside its loss, added over microbatches and devices, such as a
mixture of experts' routed tokens; empty for most models):

- :func:`plain_grads`: one pass over the whole batch;
- ``shardkit.training.accumulation``: ``K`` microbatches in a ``lax.scan``, gradients summed in fp32;
- :func:`pipelined_grads`: microbatches through pipeline stages (``shardkit.parallel.pipeline``).

:func:`make_step` turns a strategy, an optimizer and a precision policy into
``step(state, batch) -> (state, metrics)``, with the non-finite guard. ``shardkit.Trainer``
jits that step with the shardings of a :class:`shardkit.core.sharding.ShardingPlan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.analysis.mixtures import expert_dims, parameter_leaves
from shardkit.analysis.report_data import GRADIENT_REDUCTION_SCOPE
from shardkit.core.errors import LayoutError, PipelineError, ShardkitError
from shardkit.core.mesh import Layout
from shardkit.core.partition import path_str, without_axes
from shardkit.core.precision import Precision
from shardkit.core.rules import entry_axes
from shardkit.core.sharding import ShardingPlan
from shardkit.core.state import TrainState, frozen_in, next_master, update_target
from shardkit.models.model import Model, Params, apply_model
from shardkit.parallel.expert_placement import place_experts
from shardkit.parallel.experts import load_apart
from shardkit.parallel.pipeline import pipeline_value_and_grad
from shardkit.parallel.schedule import Schedule, make_schedule
from shardkit.training.losses import Batch, LossFn, scored_dtype

GradsOut = tuple[jax.Array, jax.Array, Params, Any, dict[str, jax.Array]]
GradsFn = Callable[[Params, Any, Batch, jax.Array], GradsOut]
StepFn = Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]
_KEY = "__dropout_key__"  # microbatch entry carrying each microbatch's key into the pipeline


class NonFiniteError(ShardkitError):
    """A step produced a NaN/Inf loss or gradient and the policy was ``halt``.

    Attributes:
      state: the train state as it was before the step (nothing was applied).
      step: the number of the step that failed (1-based: ``state.step + 1``).
      parameter: path of the first parameter whose gradient (or, failing that, whose update)
        was not finite, or None.
    """

    def __init__(self, message: str, state: TrainState, step: int, parameter: str | None):
        super().__init__(message)
        self.state, self.step, self.parameter = state, step, parameter


def pipeline_schedule(
    model: Model, layout: Layout, name: str | None, virtual_stages: int, microbatches: int
) -> Schedule | None:
    """The pipeline schedule when ``layout`` has stages (None otherwise); every misfit of the model,
    the layout and the schedule is reported here, before anything is traced."""
    p = layout.size("stage")
    if p == 1:
        if name is not None or virtual_stages != 1:
            raise PipelineError(
                f"schedule={name!r}, virtual_stages={virtual_stages} need pipeline stages, but layout "
                f"{layout.spec()} has stage=1. Fix: add stage=N to the layout, or drop them."
            )
        return None
    stages = model.stages
    if model.state_init is not None:
        raise PipelineError(
            f"Layout {layout.spec()} pipelines model {model.name}, which keeps running statistics (batch "
            "normalization): a stage cannot update them for the microbatches of another. Fix: drop stage from the "
            "layout, or normalize without running statistics (LayerNorm, RMSNorm)."
        )
    if model.after_update is not None:
        raise PipelineError(
            f"Layout {layout.spec()} pipelines model {model.name}, which moves parameters after each step from its "
            "forward pass's counts (a router's balance_rate), which a pipeline's stages do not gather. Fix: drop stage "
            "from the layout, or set Router(balance_rate=0)."
        )
    if stages is None:
        raise PipelineError(
            f"Layout {layout.spec()} pipelines the model over {p} stages, but model {model.name} "
            "does not say how it splits into stages. Fix: build it with sk.from_nnx(..., stacked_layers=...) "
            "(GPTConfig(scan_layers=True).model() does), or drop stage from the layout."
        )
    chunks = p * virtual_stages if isinstance(virtual_stages, int) and virtual_stages > 0 else p
    if stages.n_layers % chunks:
        divisors = [d for d in range(1, stages.n_layers + 1) if stages.n_layers % d == 0]
        raise PipelineError(
            f"Model {model.name} has {stages.n_layers} layers: they do not divide into stage={p} "
            f"stages x virtual_stages={virtual_stages}. Fix: make stage x virtual_stages one of {divisors}, "
            f"or use a layer count that is a multiple of {chunks}."
        )
    for axis in ("sequence", "expert"):
        if layout.size(axis) > 1:
            raise LayoutError(
                f"Layout {layout.spec()} combines stage with {axis}>1, which shardkit does not "
                f"pipeline yet. Fix: use stage with data, fsdp and tensor only, or drop stage."
            )
    return make_schedule(name or "1f1b", p, microbatches, virtual_stages)


def halted(state: TrainState, metrics: dict[str, jax.Array], in_a_row: int = 0) -> NonFiniteError:
    """The error of a step the guard refused (``halt``, or the ``in_a_row``-th skip in a row under
    ``skip``): the step, the loss, the first parameter whose gradient was not finite, and the state
    as it was before the step."""
    step = int(state.step) + 1
    if in_a_row:
        lead = (
            f"{in_a_row} steps in a row were not finite and were skipped (the state stayed at step "
            f"{step - 1}): the run is diverging. Last attempt"
        )
    else:
        lead = f"Step {step}"
    bad = [path_str(p) for p, ok in jax.tree_util.tree_flatten_with_path(metrics["finite_grads"])[0] if not ok]
    updated = [path_str(p) for p, ok in jax.tree_util.tree_flatten_with_path(metrics["finite_params"])[0] if not ok]
    return NonFiniteError(
        f"{lead}: loss {float(metrics['loss'])}"
        + (f", first non-finite gradient: {bad[0]} ({len(bad)} parameters in all)" if bad else "")
        + (f", first parameter the update made non-finite: {updated[0]}" if updated and not bad else "")
        + ". The step was not applied; the state in this error (.state) is the one before it. "
        "Lower the learning rate, check the batch for bad values, or "
        + ("raise max_skips." if in_a_row else "use nonfinite='skip' to skip such steps."),
        state,
        step,
        bad[0] if bad else (updated[0] if updated else None),
    )


def plain_grads(model: Model, loss: LossFn, precision: Precision) -> GradsFn:
    """Loss, count, gradients and updated model state of one (micro)batch; the forward runs in
    the compute dtype."""

    def grads(params: Params, model_state: Any, batch: Batch, key: jax.Array) -> GradsOut:
        def loss_of(p: Params) -> tuple[jax.Array, tuple[jax.Array, Any, dict[str, jax.Array]]]:
            compute_params = precision.cast_for_compute(p)
            held = {"state": model_state, "sums": {}}  # what the (last) forward call left

            def forward(inputs: Any) -> Any:
                outputs, held["state"] = apply_model(model, compute_params, model_state, inputs, key)
                outputs, held["sums"] = load_apart(outputs)
                return outputs

            value, count = loss(forward, batch)
            return value, (count, held["state"], held["sums"])

        (value, (count, new_state, sums)), g = jax.value_and_grad(loss_of, has_aux=True)(params)
        return value, count, g, new_state, sums

    return grads


def load_metrics(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A step's metrics of where a mixture of experts sent its tokens: the (token, choice) pairs
    the least and the most loaded expert got (over layers and experts) and the fraction dropped."""
    if "expert_tokens" not in sums:
        return {}
    return {
        "expert_tokens_min": sums["expert_tokens"].min(),
        "expert_tokens_max": sums["expert_tokens"].max(),
        "dropped_fraction": sums["expert_dropped"] / jnp.maximum(sums["expert_pairs"], 1.0),
    }


def make_eval(model: Model, loss: LossFn, precision: Precision) -> Callable[[Params, Any, Batch], tuple[Any, Any]]:
    """``evaluate(params, model_state, batch) -> (mean loss, count)``: the forward in the compute
    dtype, without dropout, gradients or optimizer state (a held-out loss), reading the running
    statistics in ``model_state`` (None for a model without)."""

    def evaluate(params: Params, model_state: Any, batch: Batch) -> tuple[Any, Any]:
        compute_params = precision.cast_for_compute(params)
        return loss(
            lambda inputs: load_apart(apply_model(model, compute_params, model_state, inputs, None)[0])[0], batch
        )

    return evaluate


def counts_differ(batch: Batch) -> bool:
    """Whether microbatches of ``batch`` may score different numbers of tokens: it carries a
    ``loss_mask`` (prompts score nothing) or ``segments`` (padding scores nothing). Their means
    are then weighted by their counts, so that ``K`` microbatches give the loss of one pass
    over the batch; otherwise every microbatch scores alike and weighs ``1 / K``."""
    return "loss_mask" in batch or "segments" in batch


def split_microbatches(batch: Batch, k: int, plan: ShardingPlan) -> dict[str, jax.Array]:
    """``(B, ...) -> (K, B/K, ...)`` for every entry, microbatch ``i`` taking every K-th row from
    ``i``: each device keeps its own rows and no data moves; the rows stay sharded like the batch."""
    batch_specs = plan.batch_specs(batch)

    def split(name: str, x: jax.Array) -> jax.Array:
        micro = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        return plan.constrain(micro, NamedSharding(plan.mesh, PartitionSpec(None, *batch_specs[name])))

    return {name: split(name, x) for name, x in batch.items()}


def gather_as_bits(params: Params, plan: ShardingPlan, frozen: Params | None = None) -> Params:
    """ZeRO's all-gather of the updated parameters, from the optimizer's shards
    (``plan.update_specs``) to where they are stored (``plan.param_specs``), moving 16-bit floats
    as their bits (``uint16``).

    The values and the bytes moved are the same. The reason is XLA:CPU, which promotes a bf16
    all-gather to f32 after partitioning: every parameter would be gathered whole in f32, twice
    the bytes of the parameters, in the step's temporary memory, where a GPU gathers bf16 (on an
    8-layer GPT under ZeRO-2, 1.0 byte a parameter of temporary memory more). Integers are never
    promoted. Wider dtypes are gathered as they are. Where ``frozen`` (a tree of bools) is True
    the parameter never left its place (no master copy, no update) and is returned as it is.

    Example:
      >>> import optax, shardkit as sk
      >>> from shardkit.models import GPTConfig
      >>> trainer = sk.Trainer(GPTConfig.preset("tiny").model(), optax.adam(1e-3), "data=8", zero=1)
      >>> params = jax.tree.map(lambda x: jnp.ones(x.shape, jnp.bfloat16), trainer.abstract_params)
      >>> jax.jit(gather_as_bits, static_argnums=1)(params, trainer.plan)["embed"].dtype
      dtype(bfloat16)
    """
    mesh = plan.mesh

    def gather(spec: PartitionSpec, whole: PartitionSpec, x: jax.Array) -> jax.Array:
        if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
            return plan.constrain(x, NamedSharding(mesh, whole))
        bits = plan.constrain(jax.lax.bitcast_convert_type(x, jnp.uint16), NamedSharding(mesh, spec))
        bits = plan.constrain(bits, NamedSharding(mesh, whole))
        return jax.lax.bitcast_convert_type(bits, x.dtype)

    is_spec = lambda x: isinstance(x, PartitionSpec)
    frozen = jax.tree.map(lambda _: False, params) if frozen is None else frozen
    return jax.tree.map(
        lambda spec, whole, x, kept: x if kept else gather(spec, whole, x),
        plan.update_specs,
        plan.param_specs,
        params,
        frozen,
        is_leaf=is_spec,
    )


def reduce_row_sums(sums: jax.Array, spec: PartitionSpec, plan: ShardingPlan, axes: tuple[str, ...]) -> jax.Array:
    """``(n, *param)`` per-device gradient parts, split over the row ``axes`` -> their sum, placed
    as ``spec``: first over the row axes that split the parameter (a reduce-scatter onto its
    shards), then over the rest (an all-reduce of the shard). The bytes of data parallelism
    plus ZeRO-3, not an all-reduce of the whole over every axis."""
    mesh = plan.mesh
    used = {a for entry in spec for a in entry_axes(entry)}
    first = [i for i, a in enumerate(axes) if a in used]
    rest = [i for i, a in enumerate(axes) if a not in used]
    per_axis = sums.reshape(*(mesh.shape[a] for a in axes), *sums.shape[1:])
    partial = per_axis.sum(tuple(first)) if first else per_axis
    kept = tuple(axes[i] for i in rest)
    inner = tuple(spec) + (None,) * (sums.ndim - 1 - len(spec))
    partial = plan.constrain(partial, NamedSharding(mesh, PartitionSpec(*kept, *inner)))
    return plan.constrain(partial.sum(tuple(range(len(rest)))), NamedSharding(mesh, spec))


def pipelined_grads(
    model: Model,
    loss: LossFn,
    precision: Precision,
    schedule: Schedule,
    plan: ShardingPlan,
    row_axes: tuple[str, ...] = (),
) -> GradsFn:
    """Mean loss and gradients over the microbatches, the layers pipelined over ``stage``.

    Microbatch ``i`` draws dropout bits from ``fold_in(key, i)``, as gradient accumulation
    does, so a pipelined step equals an accumulated one bit for bit in what it draws. With
    ``row_axes`` the gradients are reduced over those axes once, after the schedule, not in
    every backward slot (the stages' dropout must be :func:`shardkit.models.dropout.dropout`'s).
    """
    stages = model.stages
    assert stages is not None, "the trainer checks that the model has stages"
    p, m = schedule.stages * schedule.virtual_stages, schedule.microbatches  # p: virtual stages
    per_stage = stages.n_layers // p

    def grads(params: Params, model_state: Any, batch: Batch, key: jax.Array) -> GradsOut:
        micro = split_microbatches(batch, m, plan)
        micro[_KEY] = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(jnp.arange(m))
        layer_params = params[stages.layers]
        shared = {k: v for k, v in params.items() if k != stages.layers}

        def stage_loss(lp: Any, sp: Any, x_in: jax.Array, mb: Batch, stage: jax.Array, i: jax.Array) -> Any:
            mb = dict(mb)
            mb_key = jax.random.wrap_key_data(mb.pop(_KEY))
            full = precision.cast_for_compute({**sp, stages.layers: lp})
            held: dict[str, jax.Array] = {}

            def forward(inputs: Any) -> Any:
                x = jnp.where(stage == 0, stages.embed(full, inputs, mb_key), x_in)
                held["x"], held["aux"] = stages.body(full, x, mb_key, stage * per_stage)
                return stages.head(full, held["x"])

            value, count = loss(forward, mb)
            return held["x"], jnp.where(stage == p - 1, value, 0.0) + held["aux"], count

        def scored_counts(params: Params, micro: Batch) -> jax.Array:
            """``(m,)`` the count each microbatch's loss averages over, from the batch alone (the
            loss is given zero outputs of the model's shape; what it computes from them is dead)."""
            full = precision.cast_for_compute(params)
            first = {k: v[0] for k, v in micro.items() if k != _KEY}
            shapes: dict[str, Any] = {}

            def head_of(inputs: Any) -> Any:
                shapes["out"] = jax.eval_shape(lambda: stages.head(full, stages.embed(full, inputs, None)))
                return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["out"])

            jax.eval_shape(lambda mb: loss(head_of, mb), first)
            zeros = lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["out"])
            rest = {k: v for k, v in micro.items() if k != _KEY}
            return jax.vmap(lambda mb: loss(zeros, mb)[1])(rest)

        def entering(params: Params, mb: Batch) -> jax.Array:
            full, held = precision.cast_for_compute(params), {}

            def forward(inputs: Any) -> Any:
                held["x"] = stages.embed(full, inputs, None)
                return stages.head(full, held["x"])

            loss(forward, mb)
            return held["x"]

        first = {k: v[0] for k, v in micro.items() if k != _KEY}
        boundary = jax.eval_shape(entering, params, first)
        rows = {name: name != _KEY for name in micro}
        total = None
        if counts_differ(batch):  # each microbatch's loss weighs what it scores: the total first
            total = jnp.maximum(scored_counts(params, micro).sum().astype(jnp.float32), 1.0)
        value, count, g_layers, g_shared = pipeline_value_and_grad(
            stage_loss,
            layer_params,
            shared,
            micro,
            boundary,
            schedule,
            plan.mesh,
            row_axes=row_axes,
            micro_rows=rows,
            total_count=total,
            count_dtype=scored_dtype(batch),
        )
        grads = {**g_shared, stages.layers: g_layers}
        if row_axes:
            with jax.named_scope(GRADIENT_REDUCTION_SCOPE):  # the report counts it as backward traffic
                grads = jax.tree.map(
                    lambda g, spec: reduce_row_sums(g, spec, plan, row_axes),
                    grads,
                    plan.param_specs,
                    is_leaf=lambda x: isinstance(x, PartitionSpec),
                )
        return value, count, grads, model_state, {}  # pipeline_schedule refuses models with state

    return grads


def all_finite(x: jax.Array) -> jax.Array:
    """Whether every element of ``x`` is finite, as a max-reduction of ``|x|`` (NaN propagates
    through ``max``, and ``inf`` is the max): XLA fuses it into one pass over ``x``, where
    ``all(isfinite(x))`` made XLA:CPU write a whole boolean mask of ``x`` first.

    Example:
      >>> all_finite(jnp.array([1.0, -2.0])), all_finite(jnp.array([1.0, jnp.nan]))
      (Array(True, dtype=bool), Array(False, dtype=bool))
    """
    return jnp.isfinite(jnp.max(jnp.abs(x))) if x.size else jnp.array(True)


def make_step(
    grads_fn: GradsFn,
    optimizer: optax.GradientTransformation,
    precision: Precision,
    nonfinite: str | None,
    grads_to: Callable[[Any], Any] | None = None,
    params_to: Callable[..., Any] | None = None,
    after_update: Callable[[Params, Mapping[str, jax.Array]], Params] | None = None,
) -> StepFn:
    """``step(state, batch) -> (state, metrics)``: gradients, the optimizer update (on the master
    copy under ``bf16-master``), and with a ``nonfinite`` policy the guard that leaves the state
    as it was when the loss, a gradient or an updated parameter is not finite.

    ``grads_to`` places the gradients before the update (ZeRO-2: split like the optimizer state,
    so they are reduce-scattered rather than all-reduced); ``params_to`` places the updated
    parameters (ZeRO: gathers them from the optimizer's shards, see :func:`gather_as_bits`).
    ``after_update`` moves parameters from the forward pass's sums after the update
    (:attr:`shardkit.models.model.Model.after_update`).

    Returns metrics ``loss``, ``grad_norm``, ``tokens`` (plus ``finite``, ``finite_grads`` and
    ``finite_params`` under a policy, and a mixture of experts' :func:`load_metrics`).
    """

    def moved(params: Params, sums: Mapping[str, jax.Array]) -> Params:
        return params if after_update is None else after_update(params, sums)

    def updated_state(state: TrainState, grads: Any, model_state: Any, sums: Mapping[str, jax.Array]) -> TrainState:
        target = update_target(state.params, state.master)
        updates, opt_state = optimizer.update(grads, state.opt_state, target)
        updated = moved(optax.apply_updates(target, updates), sums)
        if state.master is not None:
            # Under ZeRO the parameters are gathered from the new master by gathered() below,
            # the frozen ones (no master) from these.
            stored = moved(state.params, sums) if params_to is not None else precision.cast_for_storage(updated)
            new = dataclasses.replace(state, params=stored, master=next_master(state.master, updated))
        else:
            new = dataclasses.replace(state, params=updated)
        return dataclasses.replace(new, step=state.step + 1, opt_state=opt_state, model_state=model_state)

    def gathered(new: TrainState) -> TrainState:
        """The stored parameters from the new master, gathered from its shards (ZeRO). Outside
        the guard's conditional, so that the gather writes into the step's output; the master
        of a skipped step is the old one, and so are the parameters cast from it."""
        if params_to is None or new.master is None:
            return new
        stored = precision.cast_for_storage(update_target(new.params, new.master))
        return dataclasses.replace(new, params=params_to(stored, frozen=frozen_in(new.master)))

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        loss, count, grads, model_state, sums = grads_fn(state.params, state.model_state, batch, key)
        target = update_target(state.params, state.master)
        grads = jax.tree.map(lambda g, t: g.astype(t.dtype), grads, target)
        if grads_to is not None:
            grads = grads_to(grads)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": count, **load_metrics(sums)}
        if nonfinite is None:
            return gathered(updated_state(state, grads, model_state, sums)), metrics
        finite_grads = jax.tree.map(all_finite, grads)
        # The new parameters too: finite gradients can still give an overflowing update (a huge
        # learning rate, an optimizer dividing by a vanishing second moment). They are checked
        # on a first evaluation of the update that is only reduced to flags (a barrier keeps
        # XLA from merging it with the second); the second, applied only when all is finite,
        # is written in place. Selecting between the applied update and the old state instead
        # would hold every new array of the state whole beside the old one until the flags are
        # known: 10.7 bytes a parameter more on a scanned GPT under bf16-master (benchmarks/zero.py).
        probe, _ = optimizer.update(jax.lax.optimization_barrier(grads), state.opt_state, target)
        finite_params = jax.tree.map(all_finite, optax.apply_updates(target, probe))
        finite = (
            jnp.isfinite(loss)
            & jnp.all(jnp.stack(jax.tree.leaves(finite_grads)))
            & jnp.all(jnp.stack(jax.tree.leaves(finite_params)))
        )
        new = jax.lax.cond(
            finite,
            lambda: updated_state(state, grads, model_state, sums),
            lambda: state,  # nothing applied
        )
        metrics |= {"finite": finite, "finite_grads": finite_grads, "finite_params": finite_params}
        return gathered(new), metrics

    return step


def experts_placed(model: Model, plan: ShardingPlan) -> Model:
    """``model`` whose forward pass keeps each expert matmul on the ``expert`` mesh axis and reads
    the weights of its grouped matmuls without the row axes' split
    (:mod:`shardkit.parallel.expert_placement`); ``model`` itself where neither applies (no
    experts, or no axis that splits them)."""
    specs = jax.tree.leaves(plan.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    rows = [a for a in dict(plan.rules.rules).get("batch", ()) if a != "expert"]
    dims, grouped = {}, {}
    over_tensor = ((i, [k for k, e in enumerate(spec) if "tensor" in entry_axes(e)]) for i, spec in enumerate(specs))
    tensor_dims = {i: split[0] for i, split in over_tensor if split}
    for i, d in expert_dims(parameter_leaves(model, plan.abstract_params)).items():
        entries = tuple(specs[i])
        if d < len(entries) and "expert" in entry_axes(entries[d]) and plan.layout.size("expert") > 1:
            dims[i] = d
        compute = without_axes(specs[i], rows)
        if tuple(compute) != entries:
            grouped[i] = compute
    if not dims and not grouped:
        return model
    tokens = dict(plan.rules.rules).get("batch", ())
    place = lambda fn: place_experts(
        fn, dims, plan.mesh, grouped_specs=grouped, token_axes=tokens, tensor_dims=tensor_dims if dims else None
    )
    state_apply = None if model.state_apply is None else place(model.state_apply)
    return dataclasses.replace(model, apply=place(model.apply), state_apply=state_apply)
