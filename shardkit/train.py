"""Sharded training: the train state, its sharded init, and one compiled train step.

Data flow (docs/architecture.md): model axes + rules + mesh -> PartitionSpec trees for the parameters,
the optimizer state (moments follow their parameter, counters replicated) and the batch ->
``jit(init, out_shardings)`` creates everything already sharded -> ``jit(step, in/out
shardings, donate)`` is the whole step, in which XLA emits the collectives.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.errors import ShardkitError, short_repr
from shardkit.mesh import Layout, as_layout
from shardkit.model import Model, Params
from shardkit.parallel.pipeline import pipeline_value_and_grad
from shardkit.parallel.schedule import Schedule, make_schedule
from shardkit.partition import Axes, named, path_str, specs_for, use_sharding
from shardkit.precision import Precision, as_precision
from shardkit.report import Report, build_report
from shardkit.rules import (
    Fallback,
    RulesLike,
    as_rules,
    default_rules,
    entry_axes,
    resolve,
    tensor_sequence_parallel,
)

Batch = Mapping[str, jax.Array]
_KEY = "__dropout_key__"  # microbatch entry carrying each microbatch's key into the pipeline
# loss(forward, batch) -> (scalar loss, number of tokens/examples it averaged over)
LossFn = Callable[[Callable[[Any], Any], Batch], tuple[jax.Array, jax.Array]]


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

    Seeds: ``init(seed)`` splits ``jax.random.key(seed)`` in two; the first creates the
    parameters, the second is ``rng``.
    """

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    rng: jax.Array
    master: Params | None = None


def next_token_loss(forward: Callable[[jax.Array], jax.Array], batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    Args:
      forward: ``(B, T) int tokens -> (B, T, V) logits`` (or ``(logits, aux_loss)``, added).
      batch: ``{"tokens": (B, T + 1) int32}``.

    Returns:
      ``(loss, number of predicted tokens)``.
    """
    tokens = batch["tokens"]
    out = forward(tokens[:, :-1])  # (B, T, V), or (logits, auxiliary loss) for mixtures of experts
    logits, aux = out if isinstance(out, tuple) else (out, 0.0)
    targets = tokens[:, 1:]  # (B, T)
    return cross_entropy(logits, targets).mean() + aux, jnp.asarray(targets.size, jnp.int32)


def like(x: jax.Array, reference: jax.Array) -> jax.Array:
    """``x`` sharded as ``reference`` where sharding is in the types (Explicit mesh axes), so a
    loss can combine a model's output, split as the model chose, with the batch's targets, split
    as shardkit chose. Unchanged on Auto axes, where the partitioner reconciles them."""
    sharding = getattr(jax.typeof(reference), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
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
    """Mean squared error of ``forward(batch["x"])`` against ``batch["y"]``."""
    pred = forward(batch["x"])
    return jnp.mean((pred.astype(jnp.float32) - like(batch["y"], pred)) ** 2), jnp.asarray(
        batch["x"].shape[0], jnp.int32
    )


class NonFiniteError(ShardkitError):
    """A step produced a NaN/Inf loss or gradient and the policy was ``halt``.

    Attributes:
      state: the train state as it was before the step (nothing was applied).
      step: the number of the step that failed (1-based: ``state.step + 1``).
      parameter: path of the first parameter whose gradient was not finite, or None.
    """

    def __init__(self, message: str, state: TrainState, step: int, parameter: str | None):
        super().__init__(message)
        self.state, self.step, self.parameter = state, step, parameter


NONFINITE_POLICIES = ("skip", "halt")

NOT_AN_OPTIMIZER = """\
optimizer must be an optax.GradientTransformation, got {got}.
Fix: pass one, e.g. optax.adamw(3e-4) or optax.sgd(0.1, momentum=0.9).
"""


class Trainer:
    """Compiles sharded init and train step for a model, an optimizer and a layout.

    Args:
      model: a :class:`shardkit.Model` (``sk.from_nnx``, ``sk.from_linen``, ``sk.annotate``).
      optimizer: any optax ``GradientTransformation``.
      layout: mesh axis sizes, e.g. ``"data=2,fsdp=2,tensor=2"`` (``-1`` fills the rest).
      rules: logical-to-mesh rules, as ``Rules`` or Flax's ``logical_axis_rules`` pairs
        (``[("batch", "data"), ("mlp", "tensor"), ...]``); default :func:`shardkit.default_rules`.
      loss: ``(forward, batch) -> (loss, count)``; default next-token cross-entropy.
      batch_axes: logical names per batch entry, e.g. ``{"tokens": ("batch", None)}``; by default
        the first dimension of every entry is ``batch`` and the rest unsharded.
      allow_replicate: replicate parameter dimensions that do not divide their mesh axes instead
        of raising; :attr:`fallbacks` lists them.
      precision: ``"fp32"``, ``"bf16"`` (fp32 parameters, bf16 compute) or ``"bf16-master"``
        (bf16 parameters, fp32 master weights); see :mod:`shardkit.precision`.
      nonfinite: what to do when a step's loss or gradients hold NaN/Inf: ``"skip"`` leaves the
        state as it was and reports ``metrics["finite"] == False``; ``"halt"`` does the same and
        raises :class:`NonFiniteError` naming the step and the first non-finite parameter;
        None (default) applies the step whatever it holds.
      sequence_parallel: Megatron sequence parallelism on the ``tensor`` axis
        (:func:`shardkit.rules.tensor_sequence_parallel`).
      microbatches: split each batch into this many microbatches and accumulate their
        gradients inside the compiled step (``lax.scan``): the same update as the whole batch in
        one pass, with the activations of one microbatch alive at a time. With a ``stage`` axis
        these are the microbatches that flow through the pipeline.
      schedule: pipeline schedule when the layout has ``stage`` > 1: ``"1f1b"`` (default) or
        ``"gpipe"`` (see :mod:`shardkit.parallel.schedule`). The model must say how it splits
        into stages (:class:`shardkit.model.Stages`; GPT does).
      virtual_stages: interleaved stages: each device holds this many chunks of the layers and
        microbatches go round the stages as often, cutting the bubble by as much (microbatches
        must then be a multiple of ``stage``; chunks are regrouped by device each step, an
        all-to-all of the layer parameters and of their gradients over ``stage``).
      devices: the devices to use (default: all of ``jax.devices()``).

    Example:
      >>> import optax, shardkit as sk
      >>> cfg = sk.models.GPTConfig.preset("tiny")
      >>> trainer = sk.Trainer(sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs)),
      ...                      optax.adamw(1e-3), layout="data=2,fsdp=2,tensor=2")
      >>> state = trainer.init(seed=0)
      >>> batch = trainer.shard_batch({"tokens": jnp.zeros((8, 17), jnp.int32)})
      >>> state, metrics = trainer.step(state, batch)
    """

    def __init__(
        self,
        model: Model,
        optimizer: optax.GradientTransformation,
        layout: Layout | str | Mapping[str, int] = "data=-1",
        *,
        rules: RulesLike | None = None,
        loss: LossFn = next_token_loss,
        batch_axes: Mapping[str, Sequence[str | None]] | None = None,
        allow_replicate: bool = False,
        precision: str | Precision = "fp32",
        microbatches: int = 1,
        nonfinite: str | None = None,
        sequence_parallel: bool = False,
        schedule: str | None = None,
        virtual_stages: int = 1,
        devices: Sequence[jax.Device] | None = None,
    ) -> None:
        if not isinstance(optimizer, optax.GradientTransformation):
            raise ShardkitError(NOT_AN_OPTIMIZER.format(got=short_repr(optimizer)))
        if not isinstance(model, Model):
            raise ShardkitError(
                f"model must be a shardkit Model, got {type(model).__name__}. Wrap a Flax model with "
                "sk.from_nnx(lambda rngs: MyModel(..., rngs=rngs)) or sk.from_linen(module, example_input)."
            )
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ShardkitError(f"microbatches must be a positive integer, got {microbatches!r}.")
        if nonfinite is not None and nonfinite not in NONFINITE_POLICIES:
            raise ShardkitError(f"nonfinite={nonfinite!r}: choose 'skip', 'halt' or None.")
        devices = list(jax.devices() if devices is None else devices)
        self.nonfinite = nonfinite
        self.precision = as_precision(precision)
        self.microbatches = microbatches
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.layout = as_layout(layout).resolve(len(devices))
        self.mesh: Mesh = self.layout.make_mesh(devices)
        self.rules = default_rules(self.layout) if rules is None else as_rules(rules)
        if sequence_parallel:
            self.rules = self.rules + tensor_sequence_parallel()
        self.batch_axes = dict(batch_axes or {})
        self.fallbacks: list[Fallback] = []
        self.schedule: Schedule | None = self._pipeline_schedule(schedule, virtual_stages)

        self.abstract_params = abstract_params = model.abstract_params()  # eval_shape once
        self.param_specs = specs_for(
            model.axes,
            abstract_params,
            self.rules,
            self.mesh,
            allow_replicate=allow_replicate,
            fallbacks=self.fallbacks,
        )
        abstract_opt = jax.eval_shape(lambda p: optimizer.init(self._updated_copy(p)), abstract_params)
        opt_specs = _follow_params(abstract_opt, abstract_params, self.param_specs)
        replicated = PartitionSpec()
        self.state_specs = TrainState(
            step=replicated,
            params=self.param_specs,
            opt_state=opt_specs,
            rng=replicated,
            master=self.param_specs if self.precision.master is not None else None,
        )
        self.state_shardings: TrainState = named(self.state_specs, self.mesh)
        self._compiled: dict[Any, jax.stages.Compiled] = {}
        self._init = jax.jit(self._init_fn, static_argnums=0, out_shardings=self.state_shardings)

    def _pipeline_schedule(self, name: str | None, virtual_stages: int) -> Schedule | None:
        """The pipeline schedule when the layout has stages; every misfit is reported here,
        before anything is traced."""
        p = dict(self.mesh.shape).get("stage", 1)
        if p == 1:
            if name is not None or virtual_stages != 1:
                raise ShardkitError(
                    f"schedule={name!r}, virtual_stages={virtual_stages} need pipeline stages, but layout "
                    f"{self.layout.spec()} has stage=1. Fix: add stage=N to the layout, or drop them."
                )
            return None
        stages = self.model.stages
        if stages is None:
            raise ShardkitError(
                f"Layout {self.layout.spec()} pipelines the model over {p} stages, but model {self.model.name} "
                "does not say how it splits into stages. Fix: build it with sk.from_nnx(..., stacked_layers=...) "
                "(GPTConfig(scan_layers=True).model() does), or drop stage from the layout."
            )
        chunks = p * virtual_stages if isinstance(virtual_stages, int) and virtual_stages > 0 else p
        if stages.n_layers % chunks:
            divisors = [d for d in range(1, stages.n_layers + 1) if stages.n_layers % d == 0]
            raise ShardkitError(
                f"Model {self.model.name} has {stages.n_layers} layers: they do not divide into stage={p} "
                f"stages x virtual_stages={virtual_stages}. Fix: make stage x virtual_stages one of {divisors}, "
                f"or use a layer count that is a multiple of {chunks}."
            )
        for axis in ("sequence", "expert"):
            if dict(self.mesh.shape).get(axis, 1) > 1:
                raise ShardkitError(
                    f"Layout {self.layout.spec()} combines stage with {axis}>1, which shardkit does not "
                    f"pipeline yet. Fix: use stage with data, fsdp and tensor only, or drop stage."
                )
        return make_schedule(name or "1f1b", p, self.microbatches, virtual_stages)

    # -- state --------------------------------------------------------------------------------
    def _updated_copy(self, params: Params) -> Params:
        """What the optimizer updates: the fp32 master copy, or the parameters themselves."""
        if self.precision.master is not None:
            return jax.tree.map(lambda x: x.astype(self.precision.master), params)
        return self.precision.cast_for_storage(params)

    def _init_fn(self, seed: int) -> TrainState:
        key = jax.random.key(seed)
        init_key, rng = jax.random.split(key)
        with use_sharding(self.mesh, self.rules):
            created = self.model.init(init_key)
        updated = self._updated_copy(created)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=self.precision.cast_for_storage(created),
            opt_state=self.optimizer.init(updated),
            rng=jax.random.key_data(rng),
            master=updated if self.precision.master is not None else None,
        )

    def init(self, seed: int = 0) -> TrainState:
        """Create the train state, every array born with its sharding (no full copy anywhere)."""
        with self._mesh_context():
            return self._init(seed)

    def _mesh_context(self) -> contextlib.AbstractContextManager[Any]:
        """JAX's mesh context for Explicit axes (sharding in types needs it to read bare
        ``PartitionSpec``s while tracing); Auto meshes are named explicitly everywhere."""
        return jax.set_mesh(self.mesh) if self.layout.explicit else contextlib.nullcontext()

    def _constrain(self, tree: Any, shardings: Any) -> Any:
        """Pin ``tree`` to ``shardings`` inside the step: a constraint on Auto axes, a
        ``reshard`` on Explicit ones (whose types carry the sharding)."""
        if self.layout.explicit:
            return jax.sharding.reshard(tree, shardings)
        return jax.lax.with_sharding_constraint(tree, shardings)

    def abstract_state(self, seed: int = 0) -> TrainState:
        """The train state as ``ShapeDtypeStruct`` with shardings: for AOT compiles, allocates nothing."""
        with self._mesh_context():
            shapes = jax.eval_shape(self._init_fn, seed)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    # -- batches ------------------------------------------------------------------------------
    def batch_specs(self, batch: Mapping[str, Any]) -> dict[str, PartitionSpec]:
        """PartitionSpec of each batch entry, from ``batch_axes`` (default: dim 0 is ``batch``)."""
        mesh_shape = dict(self.mesh.shape)
        specs = {}
        for name, value in batch.items():
            shape = tuple(value.shape)
            names = self.batch_axes.get(name, ("batch",) + (None,) * (len(shape) - 1) if shape else None)
            specs[name] = resolve(names, shape, self.rules, mesh_shape, what=f"batch[{name!r}]")
        return specs

    def local_rows(self, batch_size: int) -> slice:
        """The rows of a global batch that this process's devices hold (contiguous).

        Each process reads only these rows of every global batch and :meth:`shard_batch`
        assembles the global arrays without moving data between hosts.
        """
        spec = self.batch_specs({"tokens": jax.ShapeDtypeStruct((batch_size, 1), jnp.int32)})["tokens"]
        sharding = NamedSharding(self.mesh, spec)
        starts_stops = {
            (idx[0].start or 0, batch_size if idx[0].stop is None else idx[0].stop)
            for idx in sharding.addressable_devices_indices_map((batch_size, 1)).values()
        }
        start, stop = min(a for a, _ in starts_stops), max(b for _, b in starts_stops)
        covered = sum(b - a for a, b in starts_stops)
        if covered != stop - start or (stop - start) * jax.process_count() != batch_size:
            raise ShardkitError(
                f"With layout {self.layout.spec()} this process's devices hold rows {sorted(starts_stops)} of the "
                f"batch, not one contiguous share of it. Put the axes that span hosts first in the batch axes "
                "(e.g. across_hosts=data)."
            )
        return slice(start, stop)

    def shard_batch(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Host-local arrays of one process -> global arrays sharded over the mesh.

        In a single process the local batch is the global batch. With several processes each
        passes its own slice (``jax.make_array_from_process_local_data``).
        """
        specs = self.batch_specs(_global_shapes(batch))
        return {
            name: jax.make_array_from_process_local_data(NamedSharding(self.mesh, specs[name]), value)
            for name, value in batch.items()
        }

    # -- the step -----------------------------------------------------------------------------
    def _grads(self, params: Params, batch: Batch, key: jax.Array) -> tuple[jax.Array, jax.Array, Params]:
        """Loss, count and gradients of one (micro)batch; the forward runs in the compute dtype."""

        def loss_of(p: Params) -> tuple[jax.Array, jax.Array]:
            compute_params = self.precision.cast_for_compute(p)
            return self.loss(lambda inputs: self.model.apply(compute_params, inputs, key), batch)

        (loss, count), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        return loss, count, grads

    def _microbatches(self, batch: Batch) -> dict[str, jax.Array]:
        """``(B, ...) -> (K, B/K, ...)`` for every entry, microbatch ``i`` taking every K-th row
        from ``i``: each device keeps its own rows and no data moves; the rows stay sharded like
        the batch."""
        k = self.microbatches
        batch_specs = self.batch_specs(batch)

        def split(name: str, x: jax.Array) -> jax.Array:
            micro = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
            spec = PartitionSpec(None, *batch_specs[name])
            return self._constrain(micro, NamedSharding(self.mesh, spec))

        return {name: split(name, x) for name, x in batch.items()}

    def _pipeline_grads(self, params: Params, batch: Batch, key: jax.Array) -> tuple[jax.Array, jax.Array, Params]:
        """Mean loss and gradients over the microbatches, the layers pipelined over ``stage``.

        Microbatch ``i`` draws dropout bits from ``fold_in(key, i)``, as gradient accumulation
        does, so a pipelined step equals an accumulated one bit for bit in what it draws.
        """
        stages, schedule = self.model.stages, self.schedule
        p, m = schedule.stages * schedule.virtual_stages, schedule.microbatches  # p: virtual stages
        per_stage = stages.n_layers // p
        micro = self._microbatches(batch)
        micro[_KEY] = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(jnp.arange(m))
        layer_params = params[stages.layers]
        shared = {k: v for k, v in params.items() if k != stages.layers}

        def stage_loss(lp: Any, sp: Any, x_in: jax.Array, mb: Batch, stage: jax.Array, i: jax.Array) -> Any:
            mb = dict(mb)
            mb_key = jax.random.wrap_key_data(mb.pop(_KEY))
            full = self.precision.cast_for_compute({**sp, stages.layers: lp})
            held: dict[str, jax.Array] = {}

            def forward(inputs: Any) -> Any:
                x = jnp.where(stage == 0, stages.embed(full, inputs, mb_key), x_in)
                held["x"], held["aux"] = stages.body(full, x, mb_key, stage * per_stage)
                return stages.head(full, held["x"])

            loss, count = self.loss(forward, mb)
            return held["x"], jnp.where(stage == p - 1, loss, 0.0) + held["aux"], count

        def entering(params: Params, mb: Batch) -> jax.Array:
            full, held = self.precision.cast_for_compute(params), {}

            def forward(inputs: Any) -> Any:
                held["x"] = stages.embed(full, inputs, None)
                return stages.head(full, held["x"])

            self.loss(forward, mb)
            return held["x"]

        first = {k: v[0] for k, v in micro.items() if k != _KEY}
        boundary = jax.eval_shape(entering, params, first)
        loss, count, g_layers, g_shared = pipeline_value_and_grad(
            stage_loss, layer_params, shared, micro, boundary, schedule, self.mesh
        )
        return loss, count, {**g_shared, stages.layers: g_layers}

    def _accumulated_grads(self, params: Params, batch: Batch, key: jax.Array) -> tuple[jax.Array, jax.Array, Params]:
        """Mean loss and gradients over ``microbatches`` slices of the batch, one at a time."""
        k = self.microbatches
        if self.schedule is not None:
            return self._pipeline_grads(params, batch, key)
        if k == 1:
            return self._grads(params, batch, key)
        micro = self._microbatches(batch)
        accumulate_shardings = self.state_shardings.params
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        zeros = self._constrain(zeros, accumulate_shardings)

        def body(carry: tuple[Any, Any, Any], xs: tuple[Batch, jax.Array]) -> tuple[tuple[Any, Any, Any], None]:
            grad_sum, loss_sum, count_sum = carry
            mb, i = xs
            loss, count, grads = self._grads(params, mb, jax.random.fold_in(key, i))
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            grad_sum = self._constrain(grad_sum, accumulate_shardings)
            return (grad_sum, loss_sum + loss, count_sum + count), None

        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        (grad_sum, loss_sum, count), _ = jax.lax.scan(body, init, (micro, jnp.arange(k)))
        return loss_sum / k, count, jax.tree.map(lambda g: g / k, grad_sum)

    def _step_fn(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        loss, count, grads = self._accumulated_grads(state.params, batch, key)
        target = state.master if state.master is not None else state.params
        grads = jax.tree.map(lambda g, t: g.astype(t.dtype), grads, target)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, target)
        updated = optax.apply_updates(target, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": count}
        if state.master is not None:
            new = state.replace(params=self.precision.cast_for_storage(updated), master=updated)
        else:
            new = state.replace(params=updated)
        new = new.replace(step=state.step + 1, opt_state=opt_state)
        if self.nonfinite is not None:
            finite_grads = jax.tree.map(lambda g: jnp.all(jnp.isfinite(g)), grads)
            finite = jnp.isfinite(loss) & jnp.all(jnp.stack(jax.tree.leaves(finite_grads)))
            new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)  # nothing applied
            metrics |= {"finite": finite, "finite_grads": finite_grads}
        return new, metrics

    def lower(self, batch: Mapping[str, Any]) -> jax.stages.Lowered:
        """The train step traced and lowered for batches shaped like ``batch`` (not compiled).

        Its ``as_text()`` is the program before the backend's own rewrites (a CPU, say, turns
        bf16 matmuls into f32 ones; the lowered program shows what was asked for).
        """
        self._check_microbatches(batch)
        batch_shardings = named(self.batch_specs(batch), self.mesh)
        abstract_batch = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_shardings[k]) for k, v in batch.items()
        }
        jitted = jax.jit(
            self._step_fn,
            in_shardings=(self.state_shardings, batch_shardings),
            out_shardings=(self.state_shardings, NamedSharding(self.mesh, PartitionSpec())),
            donate_argnums=0,
        )
        with use_sharding(self.mesh, self.rules), self._mesh_context():
            try:
                return jitted.lower(self.abstract_state(), abstract_batch)
            except ValueError as e:
                if self.layout.explicit or "mesh context" not in str(e):
                    raise
                raise ShardkitError(
                    f"Model {self.model.name} shards by type (jax.sharding.reshard or out_sharding= with a bare "
                    f"PartitionSpec), which needs Explicit mesh axes, but layout {self.layout.spec()} has Auto axes. "
                    "Fix: mark the layout's axes explicit, e.g. 'fsdp=4:explicit,tensor=2'."
                ) from e

    def compile(self, batch: Mapping[str, Any]) -> jax.stages.Compiled:
        """Compile (once per batch shape) the train step for batches shaped like ``batch``.

        ``batch`` may hold arrays or ``jax.ShapeDtypeStruct``: nothing is allocated.
        """
        key = _batch_key(batch)
        if key not in self._compiled:
            self._compiled[key] = self.lower(batch).compile()
        return self._compiled[key]

    def _check_microbatches(self, batch: Mapping[str, Any]) -> None:
        mesh_shape = dict(self.mesh.shape)
        for name, spec in self.batch_specs(batch).items():
            rows = batch[name].shape[0] if batch[name].shape else 0
            shards = math.prod(mesh_shape[a] for a in entry_axes(spec[0])) if len(spec) else 1
            if rows % (self.microbatches * shards):
                raise ShardkitError(
                    f"batch[{name!r}] has {rows} rows: with microbatches={self.microbatches} and the batch "
                    f"split over {shards} devices it needs a multiple of {self.microbatches * shards}. "
                    "Change the batch size or the number of microbatches."
                )

    def step(self, state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step. ``state`` is donated: use the returned state from here on.

        Args:
          state: from :meth:`init` or a previous step.
          batch: global arrays from :meth:`shard_batch` (e.g. ``{"tokens": (B, T + 1) int32}``).

        Returns:
          ``(new_state, {"loss", "grad_norm", "tokens"})`` (plus ``finite`` and ``finite_grads``
          with a ``nonfinite`` policy).

        Raises:
          NonFiniteError: under ``nonfinite="halt"``, for a step with NaN/Inf.
        """
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
            raise ShardkitError(
                "This train state was donated to an earlier step (its buffers now hold the next state). "
                "Fix: continue from the state that step returned: state, metrics = trainer.step(state, batch)."
            )
        new_state, metrics = self.compile(batch)(state, batch)
        if self.nonfinite == "halt" and not bool(metrics["finite"]):
            step = int(new_state.step) + 1
            bad = [path_str(p) for p, ok in jax.tree_util.tree_flatten_with_path(metrics["finite_grads"])[0] if not ok]
            loss = float(metrics["loss"])
            raise NonFiniteError(
                f"Step {step}: loss {loss}"
                + (f", first non-finite gradient: {bad[0]} ({len(bad)} parameters in all)" if bad else "")
                + ". The step was not applied; the state in this error (.state) is the one before it. "
                "Lower the learning rate, check the batch for bad values, or use nonfinite='skip' to "
                "skip such steps.",
                new_state,
                step,
                bad[0] if bad else None,
            )
        return new_state, metrics

    # -- explaining ---------------------------------------------------------------------------
    def report(self, batch: Mapping[str, Any]) -> Report:
        """What the compiled step does per device: collectives, memory, FLOPs, lower bound.

        ``batch`` may be abstract (``jax.ShapeDtypeStruct``); see :class:`shardkit.report.Report`.
        """
        start = time.perf_counter()
        fresh = _batch_key(batch) not in self._compiled
        self.compile(batch)
        return build_report(self, dict(batch), time.perf_counter() - start if fresh else None)

    def sharding_table(self) -> list[dict[str, Any]]:
        """One row per parameter: path, shape, logical axes, spec and per-device shard shape."""
        rows = []
        abstract = self.abstract_params
        flat_axes = dict(_flatten(self.model.axes, is_leaf=lambda x: isinstance(x, Axes)))
        flat_specs = dict(_flatten(self.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
        mesh_shape = dict(self.mesh.shape)
        for path, leaf in _flatten(abstract):
            spec = flat_specs[path]
            shard = tuple(
                dim // math.prod(mesh_shape[a] for a in entry_axes(entry))
                for dim, entry in zip(leaf.shape, tuple(spec) + (None,) * (len(leaf.shape) - len(spec)))
            )
            rows.append(
                {
                    "path": path,
                    "shape": tuple(leaf.shape),
                    "logical": str(flat_axes[path]),
                    "spec": _spec_str(spec, len(leaf.shape)),
                    "shard": shard,
                    "bytes_per_device": math.prod(shard) * jnp.dtype(leaf.dtype).itemsize,
                }
            )
        return rows

    def format_sharding_table(self) -> str:
        """The parameter table as aligned text (scaling-book notation in the spec column)."""
        rows = self.sharding_table()
        header = ("parameter", "shape", "logical axes", "spec", "per device")
        lines = [
            (r["path"], "x".join(map(str, r["shape"])), r["logical"], r["spec"], "x".join(map(str, r["shard"])))
            for r in rows
        ]
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
        out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
        return "\n".join(out)


def _batch_key(batch: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()))


def _spec_str(spec: PartitionSpec, ndim: int) -> str:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return "[" + ", ".join("+".join(entry_axes(e)) or "-" for e in entries) + "]"


def _flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    return [(path_str(p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def _global_shapes(batch: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """Global shape of a host-local batch: the batch dimension times the process count."""
    n = jax.process_count()
    return {
        k: jax.ShapeDtypeStruct((v.shape[0] * n, *v.shape[1:]) if v.ndim else (), v.dtype) for k, v in batch.items()
    }


def _follow_params(opt_state: Any, params: Any, param_specs: Any) -> Any:
    """Specs for an optax state: subtrees shaped like the params (moments) follow them; the rest
    (step counters, scalars) is replicated."""
    params_def = jax.tree.structure(params)

    def is_param_like(x: Any) -> bool:
        try:
            return jax.tree.structure(x) == params_def and jax.tree.all(
                jax.tree.map(lambda a, b: getattr(a, "shape", None) == b.shape, x, params)
            )
        except (ValueError, TypeError):
            return False

    return jax.tree.map(
        lambda sub: param_specs if is_param_like(sub) else jax.tree.map(lambda _: PartitionSpec(), sub),
        opt_state,
        is_leaf=is_param_like,
    )
