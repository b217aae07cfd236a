"""Gradient accumulation: ``K`` microbatches per step, their gradients summed in fp32.

Two ways to sum, one result:

- **per microbatch** (:func:`accumulated_grads`): each microbatch's gradient is reduced over the
  devices that split the rows, then added. GSPMD cannot carry an unreduced partial sum through a
  loop, so this moves the gradient bytes ``K`` times per step.
- **once** (:func:`once_reduced_grads`): every device sums the gradients of its own rows over the
  ``K`` microbatches and the devices reduce once, after the loop (what ``no_sync`` does in
  PyTorch DDP). The model is vmapped over each device's block of rows with the devices' mesh axes
  as ``spmd_axis_name``, so the per-device gradients are an ordinary array split over those
  axes, ``(n, *param)``, and no reduction is needed until the sum.

Both give the loss and gradient of the whole batch. Each microbatch's mean is weighted by the
count its loss averaged over where counts differ between microbatches (a batch with
``loss_mask`` or ``segments``: prompts and padding score nothing), so that K microbatches give the
token-weighted mean of one pass, not the mean of K means; otherwise every microbatch weighs the
same. Reducing once splits each microbatch further, into each device's rows, which is the same
mean when the loss is a mean over rows (shardkit's losses are) and the model treats rows
independently; dropout drawn
with :func:`shardkit.models.dropout.dropout` keeps its bits row for row. :func:`choose` decides: see
``REDUCE_GRADIENTS``: ``auto`` reduces once where that costs no memory (no row axis splits the
parameters) and keeps the result, ``once`` always (an error where it cannot), ``per_microbatch``
inside the loop.

Without microbatches XLA's one pass reduces each gradient once, except a parameter the model
reads twice (a tied embedding table, a table shared by encoder and decoder): XLA reduces each
use's part before adding them. There the step reduces once after each device sums its rows'
gradients (:func:`once_reduced_grads` without a loop), where that costs no memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.analysis.report_data import GRADIENT_REDUCTION_SCOPE
from shardkit.core.config import REDUCE_GRADIENTS
from shardkit.core.errors import InputError, LayoutError, ModelError
from shardkit.core.partition import axes_taken, named, without_axes
from shardkit.core.precision import Precision
from shardkit.core.rules import entry_axes
from shardkit.core.sharding import ShardingPlan
from shardkit.models.model import Model, Params
from shardkit.parallel.embedding_gradients import Tables
from shardkit.parallel.experts import load_apart
from shardkit.parallel.input_gradients import reduce_input_gradients_once
from shardkit.parallel.schedule import Schedule
from shardkit.training.losses import Batch, LossFn, scored_dtype
from shardkit.training.steps import (
    GradsFn,
    GradsOut,
    counts_differ,
    pipelined_grads,
    plain_grads,
    reduce_row_sums,
    split_microbatches,
)

# Primitives that draw random bits. shardkit's dropout draws inside a custom_vmap_call, which
# the search does not enter: its bits survive the vmap over rows.
_RANDOM = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


@dataclasses.dataclass
class Accumulation:
    """How a step with microbatches reduces its gradients.

    Attributes:
      requested: one of ``REDUCE_GRADIENTS``.
      reduces: ``"once"`` or ``"per_microbatch"``; decided when the step is first traced (None
        before), as two reasons need the model's traced program.
      reason: why gradients are reduced per microbatch ("" when once).
    """

    requested: str
    reduces: str | None = None
    reason: str = ""


def reduced_as_megatron(grads_fn: GradsFn, plan: ShardingPlan, tables: bool = True) -> GradsFn:
    """``grads_fn`` with its backward pass rewritten where XLA would reduce more than the layout
    needs (``shardkit.parallel.input_gradients``): the input gradient of separate projections of
    one input reduced once over ``tensor``, and (``tables``) each embedding table's gradient
    reduced onto its shards where the batch's row axes both split the table and do not (XLA
    all-reduces the whole table there). Unchanged where neither applies, and under explicit axes
    (their sharding is in the types, which the rewrite does not follow)."""
    size = dict(plan.mesh.shape).get("tensor", 1)
    rows = _row_axes(plan)
    # Under expert and tensor axes the experts' rows may split over tensor (the placement's
    # cheaper use of it), a split XLA carries back to the embedding's gradient.
    beyond_rows = size > 1 and plan.layout.size("expert") > 1
    tables_apply = tables and (len(rows) > 1 or beyond_rows)
    if plan.layout.explicit or (size == 1 and not tables_apply):
        return grads_fn
    specs = plan.param_specs
    splits = jax.tree.map(
        lambda spec, x: tensor_blocks(spec, len(x.shape), size) if size > 1 else None,
        specs,
        plan.abstract_params,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )
    in_params = lambda tree: lambda params, *rest: (tree, *([None] * len(rest)))
    return reduce_input_gradients_once(
        grads_fn, in_params(splits), Tables(plan.mesh, rows, in_params(specs), beyond_rows) if tables_apply else None
    )


def tensor_blocks(spec: PartitionSpec, ndim: int, size: int) -> tuple[int, ...] | None:
    """Per dimension, into how many contiguous blocks ``tensor`` splits it: ``size`` where
    ``tensor`` leads the dimension's mesh axes, 1 where it is absent; None (not rewritten) where it
    follows another axis, its blocks then interleaved.

    Example:
      >>> tensor_blocks(PartitionSpec("fsdp", ("tensor", "data")), 2, 4)
      (1, 4)
    """
    blocks = []
    for entry in (*spec, *([None] * (ndim - len(spec)))):
        axes = entry_axes(entry)
        if "tensor" in axes[1:]:
            return None
        blocks.append(size if axes[:1] == ("tensor",) else 1)
    return tuple(blocks)


def accumulated_grads(grads_fn: GradsFn, microbatches: int, plan: ShardingPlan) -> GradsFn:
    """Mean loss and gradients over ``microbatches`` slices of the batch, one at a time, each
    reduced over the devices (microbatch ``i`` draws dropout bits from ``fold_in(key, i)``).

    The sums are placed where the step's gradients go (``plan.grad_specs``): under ZeRO-2 split
    over ``data``, so each microbatch's gradients are reduce-scattered onto the sums' shards and no
    device holds whole fp32 sums.
    """
    if microbatches == 1:
        return grads_fn
    shardings = named(plan.grad_specs, plan.mesh)

    def grads(params: Params, model_state: Any, batch: Batch, key: jax.Array) -> GradsOut:
        micro = split_microbatches(batch, microbatches, plan)
        zeros = plan.constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), shardings)
        weighted = counts_differ(batch)

        def body(carry: tuple[Any, ...], xs: tuple[Batch, jax.Array]) -> tuple[tuple[Any, ...], Any]:
            grad_sum, loss_sum, count_sum, state = carry
            mb, i = xs
            # Running statistics are updated microbatch after microbatch, as K forward passes would.
            value, count, g, state, sums = grads_fn(params, state, mb, jax.random.fold_in(key, i))
            w = count.astype(jnp.float32) if weighted else 1.0
            grad_sum = plan.constrain(jax.tree.map(lambda a, b: a + w * b.astype(jnp.float32), grad_sum, g), shardings)
            return (grad_sum, loss_sum + w * value, count_sum + count, state), sums

        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), scored_dtype(batch)), model_state)
        (grad_sum, loss_sum, count, state), sums = jax.lax.scan(body, init, (micro, jnp.arange(microbatches)))
        total = jnp.maximum(count.astype(jnp.float32), 1.0) if weighted else microbatches
        return loss_sum / total, count, jax.tree.map(lambda g: g / total, grad_sum), state, _summed(sums)

    return grads


def once_reduced_grads(
    grads_fn: GradsFn, microbatches: int, plan: ShardingPlan, axes: tuple[str, ...], by_shard_map: bool = False
) -> GradsFn:
    """Like :func:`accumulated_grads`, but reduced over the row ``axes`` once, after the loop.

    Microbatch ``(B/K, ...)`` is viewed as ``(n, B/(K n), ...)`` (``n`` devices split the rows
    over ``axes``; each keeps its own block, no data moves) and ``grads_fn`` is vmapped over the
    blocks with ``spmd_axis_name=axes``. The ``(n, *param)`` gradient sums stay split over
    ``axes`` through the loop: whole parameters' worth of fp32 on every device. After the loop
    they are reduced to ``plan.grad_specs`` (under ZeRO-2 a reduce-scatter over ``data``).

    ``by_shard_map`` runs each device's block in a ``jax.shard_map`` manual over ``axes`` alone
    (the other mesh axes left to the partitioner) instead of the vmap: for a model that
    convolves, whose weight gradient vmapped over blocks XLA computes by gathering the rows.
    """
    mesh = plan.mesh
    n = math.prod(mesh.shape[a] for a in axes)
    sums_at = jax.tree.map(
        lambda s: NamedSharding(mesh, PartitionSpec(axes, *without_axes(s, axes))),
        plan.param_specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    per_device = (
        _each_device_by_shard_map(grads_fn, plan, axes)
        if by_shard_map
        else jax.vmap(grads_fn, in_axes=(None, None, 0, None), out_axes=(0, 0, 0, None, 0), spmd_axis_name=axes)
    )

    def one_pass(params: Params, batch: Batch, key: jax.Array) -> GradsOut:
        """One microbatch: each device's gradient in the parameters' dtype, reduced once."""
        specs = plan.batch_specs(batch)
        blocked = {
            name: plan.constrain(
                x.reshape(n, x.shape[0] // n, *x.shape[1:]),
                NamedSharding(mesh, PartitionSpec(axes, None, *tuple(specs[name])[1:])),
            )
            for name, x in batch.items()
        }
        with axes_taken(axes):
            value, count, g, _, sums = per_device(params, None, blocked, key)
        if counts_differ(batch):  # each device block's mean weighs what it scored
            total = jnp.maximum(count.sum().astype(jnp.float32), 1.0)
            w = count.astype(jnp.float32) / total
            g = jax.tree.map(lambda b: (w.reshape(n, *([1] * (b.ndim - 1))) * b).astype(b.dtype), g)
            value, scale = (w * value).sum(), 1.0
        else:
            value, scale = value.mean(), 1.0 / n
        g = plan.constrain(g, sums_at)
        with jax.named_scope(GRADIENT_REDUCTION_SCOPE):  # the report counts it as backward traffic
            reduced = jax.tree.map(
                lambda g, spec: reduce_row_sums(g, spec, plan, axes) * jnp.asarray(scale, g.dtype),
                g,
                plan.grad_specs,
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
        return value, count.sum(), reduced, None, _summed(sums)

    def grads(params: Params, model_state: Any, batch: Batch, key: jax.Array) -> GradsOut:
        if microbatches == 1:
            value, count, reduced, _, sums = one_pass(params, batch, key)
            return value, count, reduced, model_state, sums
        specs = plan.batch_specs(batch)

        def blocks(name: str, x: jax.Array) -> jax.Array:  # (K, B/K, ...) -> (K, n, B/(K n), ...)
            y = x.reshape(microbatches, n, x.shape[1] // n, *x.shape[2:])
            return plan.constrain(y, NamedSharding(mesh, PartitionSpec(None, axes, None, *tuple(specs[name])[1:])))

        micro = {name: blocks(name, x) for name, x in split_microbatches(batch, microbatches, plan).items()}
        zeros = plan.constrain(jax.tree.map(lambda p: jnp.zeros((n, *p.shape), jnp.float32), params), sums_at)
        weighted = counts_differ(batch)

        def body(carry: tuple[Any, Any, Any], xs: tuple[Batch, jax.Array]) -> tuple[tuple[Any, Any, Any], Any]:
            grad_sum, loss_sum, count_sum = carry
            mb, i = xs
            with axes_taken(axes):
                value, count, g, _, sums = per_device(params, None, mb, jax.random.fold_in(key, i))
            if weighted:  # each device block's mean weighs what it scored: (n,) weights
                w = count.astype(jnp.float32)
                scale = lambda b: w.reshape(n, *([1] * (b.ndim - 1))) * b.astype(jnp.float32)
                grad_sum = jax.tree.map(lambda a, b: a + scale(b), grad_sum, g)
                loss_sum = loss_sum + (w * value).sum()
            else:
                grad_sum = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grad_sum, g)
                loss_sum = loss_sum + value.mean()
            return (plan.constrain(grad_sum, sums_at), loss_sum, count_sum + count.sum()), _summed(sums)

        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), scored_dtype(batch)))
        (grad_sum, loss_sum, count), sums = jax.lax.scan(body, init, (micro, jnp.arange(microbatches)))
        total = jnp.maximum(count.astype(jnp.float32), 1.0) if weighted else microbatches * n
        with jax.named_scope(GRADIENT_REDUCTION_SCOPE):  # the report counts it as backward traffic
            reduced = jax.tree.map(
                lambda g, spec: reduce_row_sums(g, spec, plan, axes) / total,
                grad_sum,
                plan.grad_specs,
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
        loss = loss_sum / total if weighted else loss_sum / microbatches
        return loss, count, reduced, model_state, _summed(sums)  # choose() keeps models with state away

    return grads


def _summed(stacked: Any) -> Any:
    """Sums reported per microbatch or per device block (stacked on a leading axis), added up."""
    return jax.tree.map(lambda x: x.sum(0), stacked)


def _each_device_by_shard_map(grads_fn: GradsFn, plan: ShardingPlan, axes: tuple[str, ...]) -> GradsFn:
    """``grads_fn`` on each device's block of rows (inputs ``(n, rows, ...)`` split over
    ``axes``), its outputs stacked ``(n, ...)``: a ``shard_map`` manual over ``axes`` only, so
    the model inside sees its own rows, and tensor or sequence splits stay the partitioner's."""
    rows = PartitionSpec(axes)

    def own_block(params: Params, model_state: Any, blocked: Batch, key: jax.Array) -> Any:
        value, count, g, state, sums = grads_fn(params, model_state, jax.tree.map(lambda x: x[0], blocked), key)
        stacked = lambda tree: jax.tree.map(lambda x: x[None], tree)
        return value[None], count[None], stacked(g), state, stacked(sums)

    return jax.shard_map(
        own_block,
        mesh=plan.mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), rows, PartitionSpec()),
        out_specs=(rows, rows, rows, PartitionSpec(), rows),
        axis_names=set(axes),
        check_vma=False,
    )


# Operations the partitioner runs on the whole batch, whatever the rows' split: XLA's TopK custom
# call has no sharding rule, so its operand is gathered over the batch axes (a mixture of
# experts' router: every token's expert scores, at every layer).
_GATHERS_ROWS = frozenset({"top_k"})

# Operations whose rows XLA gathers when each device's block is vmapped over: those above, and a
# convolution's weight gradient (a ViT with 2 microbatches moved 1.87x its bound under data=8).
_GATHERS_ROWS_UNDER_VMAP = _GATHERS_ROWS | {"conv_general_dilated"}


def _primitives(jaxpr: Any) -> frozenset[str]:
    """The names of the operations anywhere in a traced loss (none when there is no trace)."""
    return frozenset() if jaxpr is None else frozenset(eqn.primitive.name for eqn in _equations(jaxpr.jaxpr))


def choose(
    model: Model,
    loss: LossFn,
    precision: Precision,
    microbatches: int,
    plan: ShardingPlan,
    reduce: str,
    schedule: Schedule | None = None,
) -> tuple[GradsFn, Accumulation]:
    """The gradient strategy for ``microbatches`` per step, and how it reduces.

    With a pipeline ``schedule`` the microbatches are the schedule's, and reducing once happens
    after the schedule instead of in every backward slot (with one microbatch too: each stage's
    backward slot would reduce the shared parameters' gradients, in lock step, on every stage).

    Raises:
      InputError: ``reduce`` is not one of ``REDUCE_GRADIENTS``.
      LayoutError: ``reduce="once"`` on a layout where it cannot be done (raised here, before
        anything is traced); a reason found in the traced model raises ``ModelError`` then.
    """
    if reduce not in REDUCE_GRADIENTS:
        raise InputError(f"reduce_gradients={reduce!r}: choose one of {', '.join(REDUCE_GRADIENTS)}.")
    if schedule is not None:
        microbatches = schedule.microbatches

    def reducing(axes: tuple[str, ...], by_shard_map: bool = False) -> GradsFn:
        """Gradients reduced once over ``axes``, or per microbatch when ``axes`` is empty."""
        if schedule is not None:
            return pipelined_grads(model, loss, precision, schedule, plan, axes)
        plain = plain_grads(model, loss, precision)
        if microbatches == 1:
            return reduced_as_megatron(plain, plan)
        if axes:  # each device's rows' blocks apart, reduced after the loop: no reduction inside
            megatron = reduced_as_megatron(plain, plan, tables=False)
            return once_reduced_grads(megatron, microbatches, plan, axes, by_shard_map)
        return accumulated_grads(reduced_as_megatron(plain, plan), microbatches, plan)

    if microbatches == 1 and schedule is None:  # no loop: the step's one gradient is reduced once
        return _one_pass(model, loss, precision, plan, reduce, reducing(())), Accumulation(reduce, "once")
    info = Accumulation(reduce)
    axes = _row_axes(plan)
    held = _model_reason(model)
    if held and reduce == "once":
        raise ModelError(f"reduce_gradients='once': {held}. Fix: use reduce_gradients='auto'.")
    reason = held or _layout_reason(plan, axes, reduce)
    if reduce == "once" and reason:
        raise LayoutError(
            f"reduce_gradients='once' with layout {plan.layout.spec()}: {reason}. "
            "Fix: use reduce_gradients='auto' (or 'per_microbatch'), or change the layout."
        )
    if reason or reduce == "per_microbatch":
        info.reduces, info.reason = "per_microbatch", reason or "asked for"
        return reducing(()), info
    per_microbatch, once = reducing(()), reducing(axes)
    # Where a vmap over row blocks would gather the rows, the blocks go by shard_map: each device
    # holds its own rows only.
    once_by_shard_map = reducing(axes, by_shard_map=True) if schedule is None else once

    def grads(params: Params, model_state: Any, batch: Batch, key: jax.Array) -> GradsOut:
        jaxpr, found = _trace(model, loss, precision, plan, params, batch, key, microbatches, axes)
        reduced_once = once_by_shard_map if _primitives(jaxpr) & _GATHERS_ROWS_UNDER_VMAP else once
        if found and reduce == "once":
            raise ModelError(
                f"reduce_gradients='once' with model {model.name}: {found}. Fix: draw dropout with "
                "shardkit.models.dropout.dropout (sk.dropout), or use reduce_gradients='auto'."
            )
        info.reduces, info.reason = ("per_microbatch", found) if found else ("once", "")
        return (per_microbatch if found else reduced_once)(params, model_state, batch, key)

    return grads, info


def _one_pass(
    model: Model, loss: LossFn, precision: Precision, plan: ShardingPlan, reduce: str, plain: GradsFn
) -> GradsFn:
    """The gradients of a step without microbatches.

    XLA reduces each use's gradient of a parameter over the batch axes before it adds them: a
    parameter the model reads twice (an embedding table tied to the output layer, a table shared
    by an encoder and a decoder, a layer applied twice) has its gradient reduced twice. And some
    operations the partitioner runs on the whole batch, gathering the rows (:data:`_GATHERS_ROWS`).
    Where either holds, and reducing once after each device sums its own rows' gradients costs
    no memory (no batch axis splits the parameters), that is what the step does
    (:func:`once_reduced_grads` without a loop: each device's rows by ``shard_map`` where the
    model convolves or gathers rows, else by vmap); otherwise XLA's one pass.
    """
    axes = _row_axes(plan)
    if reduce == "per_microbatch" or _model_reason(model) or _layout_reason(plan, axes, "auto"):
        return plain
    megatron = reduced_as_megatron(plain_grads(model, loss, precision), plan, tables=False)
    once = once_reduced_grads(megatron, 1, plan, axes)
    own_rows = once_reduced_grads(megatron, 1, plan, axes, by_shard_map=True)

    def grads(params: Params, model_state: Any, batch: Batch, key: jax.Array) -> GradsOut:
        jaxpr, reason = _trace(model, loss, precision, plan, params, batch, key, 1, axes)
        if reason:
            return plain(params, model_state, batch, key)
        shared, ops = _reads_a_parameter_twice(jaxpr, len(jax.tree.leaves(params))), _primitives(jaxpr)
        if ops & _GATHERS_ROWS or (shared and ops & _GATHERS_ROWS_UNDER_VMAP):
            return own_rows(params, model_state, batch, key)
        return (once if shared else plain)(params, model_state, batch, key)

    return grads


# Operations that pass a parameter on unchanged in value (its reads are those of the result).
_VIEWS = frozenset({"convert_element_type", "copy", "copy_p", "sharding_constraint", "reshape", "squeeze"})


def _reads_a_parameter_twice(jaxpr: Any, n_params: int) -> bool:
    """Whether some parameter (the first ``n_params`` inputs of ``jaxpr``) is read by more than
    one operation: through views and into called programs (jit, remat, custom derivatives), a
    loop's constant counting as read on every iteration."""

    def reads(var: Any, program: Any) -> int:
        count = sum(1 for out in program.outvars if out is var)
        for eqn in program.eqns:
            for position, operand in enumerate(eqn.invars):
                if operand is not var:
                    continue
                name, inner = eqn.primitive.name, _called(eqn)
                if name in _VIEWS:
                    count += reads(eqn.outvars[0], program)
                elif inner is not None and len(inner.invars) == len(eqn.invars):
                    count += reads(inner.invars[position], inner)
                elif name == "scan" and position < eqn.params["num_consts"] and eqn.params["length"] > 1:
                    count += 2
                else:
                    count += 1
                if count > 1:
                    return count
        return count

    return any(reads(var, jaxpr.jaxpr) > 1 for var in jaxpr.jaxpr.invars[:n_params])


def _called(eqn: Any) -> Any:
    """The program a call-like equation runs on its operands one to one (None for others)."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if inner is not None and eqn.primitive.name not in ("scan", "while", "cond"):
            return getattr(inner, "jaxpr", inner)
    return None


def _model_reason(model: Model) -> str:
    """Why the model, by what it is, must see each microbatch's rows together ("" if not)."""
    if model.state_init is not None:
        return (
            f"model {model.name} keeps running statistics (batch normalization), which must see each microbatch's "
            "rows together, not each device's"
        )
    if model.axis_names:
        return (
            f"model {model.name} reduces over the named axes {', '.join(model.axis_names)} (written for pmap), "
            "which a vmap over each device's rows would confine to those rows"
        )
    return ""


def _row_axes(plan: ShardingPlan) -> tuple[str, ...]:
    """The mesh axes (of more than one device) that the ``batch`` rule splits rows over."""
    rule = dict(plan.rules.rules).get("batch", ())
    return tuple(a for a in rule if plan.mesh.shape.get(a, 1) > 1)


def _layout_reason(plan: ShardingPlan, axes: tuple[str, ...], reduce: str) -> str:
    """Why this layout reduces per microbatch ("" if it need not)."""
    layout = plan.layout
    if layout.explicit:
        return "Explicit mesh axes put sharding in the types, which the vmap over rows does not follow"
    for axis in ("sequence", "expert"):
        if layout.size(axis) > 1:
            return f"{axis}={layout.size(axis)} splits more than the rows"
    if not axes:
        return "no mesh axis splits the rows, so there is nothing to reduce"
    splitting = sorted(
        {
            a
            for spec in jax.tree.leaves(plan.grad_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
            for entry in spec
            for a in entry_axes(entry)
            if a in axes
        }
    )
    if splitting and reduce == "auto":
        what = "gradients (ZeRO-2)" if plan.zero >= 2 else "parameters"
        return (
            f"the {what} are split over {'+'.join(splitting)}, so reducing once would keep whole fp32 "
            "gradients on every device through the loop (reduce_gradients='once' trades that memory for one "
            "reduce-scatter per step)"
        )
    return ""


def _trace(
    model: Model,
    loss: LossFn,
    precision: Precision,
    plan: ShardingPlan,
    params: Params,
    batch: Batch,
    key: jax.Array,
    microbatches: int,
    axes: tuple[str, ...],
) -> tuple[Any, str]:
    """The loss traced on one microbatch (a closed jaxpr whose first inputs are the parameters'
    leaves), and why the model must be reduced per microbatch ("" if not)."""
    split = lambda spec: tuple(a for a in entry_axes(spec[0]) if plan.mesh.shape[a] > 1) if len(spec) else ()
    if {split(spec) for spec in plan.batch_specs(batch).values()} != {axes}:
        return None, "the batch entries are not all split by rows over the batch axes"
    outputs: list[Any] = []

    def forward_loss(p: Params, mb: Batch, k: jax.Array) -> Any:
        compute = precision.cast_for_compute(p)

        def forward(inputs: Any) -> Any:
            out = model.apply(compute, inputs, k)
            outputs.append(out)
            return load_apart(out)[0]

        return loss(forward, mb)

    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    micro = {
        name: jax.ShapeDtypeStruct((x.shape[0] // microbatches, *x.shape[1:]), x.dtype) for name, x in batch.items()
    }
    jaxpr = jax.make_jaxpr(forward_loss)(jax.tree.map(shape, params), micro, shape(key))
    if outputs and isinstance(outputs[0], tuple):
        return jaxpr, (
            "the model returns an auxiliary loss (a mixture of experts' load balance), a statistic of the whole batch"
        )
    if any(eqn.primitive.name in _RANDOM for eqn in _equations(jaxpr.jaxpr)):
        return jaxpr, (
            "the model draws random bits itself (nnx.Dropout, jax.random), which a vmap over rows would repeat"
        )
    return jaxpr, ""


def _equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the programs inside it, except shardkit's dropout draws."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "custom_vmap_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)
