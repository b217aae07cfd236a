"""Sharded training: a thin wrapper that compiles the init and the step of a sharding plan.

Data flow (docs/architecture.md): model + optimizer + layout + rules + precision ->
:class:`shardkit.core.sharding.ShardingPlan` (every sharding, a plain value) -> a gradient strategy
and :func:`shardkit.training.steps.make_step` (pure functions) -> ``jit(init, out_shardings)`` creates the
state already sharded, ``jit(step, in/out shardings, donate)`` is the whole step, in which XLA
emits the collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.analysis.hlo import largest_array_bytes
from shardkit.analysis.report import Report, build_report
from shardkit.core.config import check_fsdp_min_size
from shardkit.core.errors import InputError, LayoutError, ModelError, short_repr
from shardkit.core.inputs import check_host_batch, check_sequence_length, vocab_size
from shardkit.core.mesh import Layout, as_layout
from shardkit.core.partition import named, path_str, use_sharding
from shardkit.core.precision import Precision, as_precision
from shardkit.core.rules import RulesLike, as_rules, default_rules, tensor_sequence_parallel
from shardkit.core.sharding import ShardingPlan, plan_sharding, rows_only_expert_note, unnamed_model_note
from shardkit.core.state import TrainState, master_copy, update_target
from shardkit.models.model import Model, with_frozen_base
from shardkit.parallel.schedule import Schedule
from shardkit.runtime.host_allocator import keep_heaps, temp_heap_options
from shardkit.runtime.xla_flags import step_compiler_options
from shardkit.training.accumulation import choose
from shardkit.training.losses import LossFn, cross_entropy, like, mse_loss, next_token_loss
from shardkit.training.steps import (
    NonFiniteError,
    experts_placed,
    gather_as_bits,
    halted,
    make_eval,
    make_step,
    pipeline_schedule,
)

__all__ = [
    "NonFiniteError",
    "TrainState",
    "Trainer",
    "cross_entropy",
    "like",
    "mse_loss",
    "next_token_loss",
]

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
        (``[("batch", "data"), ("mlp", "tensor"), ...]``); default :func:`shardkit.default_rules`,
        with the experts of a mixture of experts split over ``tensor`` where the layout has no
        ``expert`` axis (:func:`shardkit.core.rules.experts_over_tensor`). Rules you give are
        kept as given.
      loss: ``(forward, batch) -> (loss, count)``; default next-token cross-entropy.
      batch_axes: logical names per batch entry, e.g. ``{"tokens": ("batch", None)}``; by default
        the first dimension of every entry is ``batch`` and the rest unsharded.
      allow_replicate: replicate parameter dimensions that do not divide their mesh axes instead
        of raising; :attr:`fallbacks` lists them.
      precision: ``"fp32"``, ``"bf16"`` (fp32 parameters, bf16 compute) or ``"bf16-master"``
        (bf16 parameters, fp32 master weights); see :mod:`shardkit.core.precision`.
      nonfinite: what to do when a step's loss, gradients or updated parameters hold NaN/Inf:
        ``"skip"`` (default) leaves the state as it was and reports ``metrics["finite"] == False``;
        ``"halt"`` does the same and raises :class:`NonFiniteError` naming the step and the first
        non-finite parameter; None applies the step whatever it holds.
      max_skips: under ``"skip"``, this many skipped steps in a row raise :class:`NonFiniteError`
        (a diverging run must not look successful); 0 never escalates.
      sequence_parallel: Megatron sequence parallelism on the ``tensor`` axis
        (:func:`shardkit.core.rules.tensor_sequence_parallel`).
      microbatches: split each batch into this many microbatches and accumulate their
        gradients inside the compiled step (``lax.scan``): the same update as the whole batch in
        one pass, with the activations of one microbatch alive at a time. With a ``stage`` axis
        these are the microbatches that flow through the pipeline.
      schedule: pipeline schedule when the layout has ``stage`` > 1: ``"1f1b"`` (default) or
        ``"gpipe"`` (see :mod:`shardkit.parallel.schedule`). The model must say how it splits
        into stages (:class:`shardkit.models.model.Stages`; GPT does).
      virtual_stages: interleaved stages: each device holds this many chunks of the layers and
        microbatches go round the stages as often, cutting the bubble by as much (microbatches
        must then be a multiple of ``stage``; chunks are regrouped by device each step, an
        all-to-all of the layer parameters and of their gradients over ``stage``).
      devices: the devices to use (default: all of ``jax.devices()``).
      zero: ZeRO stage over the ``data`` axis, with the parameters whole on every device: 1 shards
        the optimizer state (and master weights) over it, 2 the gradients too (reduce-scattered,
        not all-reduced); 0 is off. ZeRO-3 is the layout's ``fsdp`` axis.
      fsdp_min_size: which parameters stay whole on every device under ``fsdp`` rather than being
        gathered and reduce-scattered one by one (DeepSpeed's ``param_persistence_threshold``):
        None (default) keeps vectors per layer whole (norm scales, biases) and splits every
        matrix; N keeps parameters of fewer than N elements per layer whole; 0 splits all.
      reduce_gradients: with ``microbatches > 1``, when the devices reduce the gradients:
        ``"once"`` per step after the loop or the pipeline's schedule (each device sums its own
        rows' gradients first), ``"per_microbatch"`` inside the loop (in each backward slot), or
        ``"auto"`` (default): once where that costs no memory (no batch axis splits the
        parameters) and the model allows it, per microbatch otherwise. ``trainer.accumulation``
        says which was used, and why (see :mod:`shardkit.training.accumulation`). Without
        microbatches, ``"auto"`` and ``"once"`` also reduce once where the model reads a
        parameter twice (a tied embedding table: XLA would reduce each use's gradient part);
        ``"per_microbatch"`` keeps XLA's one pass.
      place_experts: keep each matmul of an expert weight (a parameter dimension named
        ``experts``) on the ``expert`` axis, so tokens travel to their experts rather than the
        weights to the tokens, and read grouped matmuls' weights gathered from the row axes
        (:mod:`shardkit.parallel.expert_placement`). Only shardings change; False compiles the
        model as XLA's partitioner alone would (to compare).

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
        nonfinite: str | None = "skip",
        max_skips: int = 10,
        sequence_parallel: bool = False,
        schedule: str | None = None,
        virtual_stages: int = 1,
        devices: Sequence[jax.Device] | None = None,
        zero: int = 0,
        fsdp_min_size: int | None = None,
        reduce_gradients: str = "auto",
        place_experts: bool = True,
    ) -> None:
        if not isinstance(optimizer, optax.GradientTransformation):
            raise ModelError(NOT_AN_OPTIMIZER.format(got=short_repr(optimizer)))
        if not isinstance(model, Model):
            raise ModelError(
                f"model must be a shardkit Model, got {type(model).__name__}. Wrap a Flax model with "
                "sk.from_nnx(lambda rngs: MyModel(..., rngs=rngs)) or sk.from_linen(module, example_input)."
            )
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise InputError(f"microbatches must be a positive integer, got {microbatches!r}.")
        if nonfinite is not None and nonfinite not in NONFINITE_POLICIES:
            raise InputError(f"nonfinite={nonfinite!r}: choose 'skip', 'halt' or None.")
        if not isinstance(max_skips, int) or isinstance(max_skips, bool) or max_skips < 0:
            raise InputError(f"max_skips={max_skips!r}: give a count >= 0 (0: never escalate).")
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise InputError("devices=[]: give at least one device (default: all of jax.devices()).")
        if zero not in (0, 1, 2):
            raise InputError(
                f"zero={zero!r}: ZeRO stage 1 shards the optimizer state over the data axis, 2 the gradients too "
                "(0: off). Stage 3 is the fsdp axis of the layout (e.g. 'fsdp=8')."
            )
        check_fsdp_min_size(fsdp_min_size)
        if model.trainable is not None:  # adapters on a frozen base: no gradient, no optimizer state for it
            labels = jax.tree.map(lambda train: "train" if train else "frozen", model.trainable_mask())
            if "train" not in jax.tree.leaves(labels):
                raise ModelError(f"Model {model.name} marks no parameter trainable; nothing would train.")
            optimizer = optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)
            model = with_frozen_base(model)
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.precision, self.microbatches, self.nonfinite = as_precision(precision), microbatches, nonfinite
        self.max_skips, self.skipped_in_a_row = max_skips, 0
        self.layout = as_layout(layout).resolve(len(devices))
        self.schedule: Schedule | None = pipeline_schedule(model, self.layout, schedule, virtual_stages, microbatches)
        own_rules = rules is not None
        rules = default_rules() if rules is None else as_rules(rules)
        if sequence_parallel:
            rules = rules + tensor_sequence_parallel()
        self.plan: ShardingPlan = plan_sharding(
            model,
            optimizer,
            self.layout,
            rules=rules,
            precision=self.precision,
            batch_axes=batch_axes,
            allow_replicate=allow_replicate,
            devices=devices,
            zero=zero,
            fsdp_min_size=fsdp_min_size,
            experts_over_tensor=not own_rules,
        )
        if zero and self.layout.size("data") == 1:
            raise LayoutError(
                f"zero={zero} shards the optimizer state over the data axis, but layout {self.layout.spec()} has "
                "data=1. Fix: add a data axis (e.g. 'data=8'), or use fsdp for ZeRO-3."
            )
        for note in (unnamed_model_note, rows_only_expert_note):
            said = note(model, dict(self.plan.mesh.shape))
            if said is not None:
                warnings.warn(said, stacklevel=2)
        self.mesh, self.rules = self.plan.mesh, self.plan.rules
        self.abstract_params, self.param_specs = self.plan.abstract_params, self.plan.param_specs
        self.state_specs, self.state_shardings = self.plan.state_specs, self.plan.state_shardings
        self.update_specs = self.plan.update_specs
        self.fallbacks = list(self.plan.fallbacks)
        self.vocab = vocab_size(self.abstract_params, model.axes)
        # Evaluation runs the same placed forward pass as the step (experts computed where they live).
        self._placed_model = experts_placed(model, self.plan) if place_experts else model
        grads, self.accumulation = choose(
            self._placed_model,
            loss,
            self.precision,
            microbatches,
            self.plan,
            reduce_gradients,
            self.schedule,
        )
        grads_to = params_to = None
        if zero >= 2:
            grad_shardings = named(self.plan.grad_specs, self.mesh)
            grads_to = lambda g: self.plan.constrain(g, grad_shardings)
        if zero:
            params_to = functools.partial(gather_as_bits, plan=self.plan)
        self._step_fn = make_step(grads, optimizer, self.precision, nonfinite, grads_to, params_to, model.after_update)
        self._compiled: dict[Any, jax.stages.Compiled] = {}
        self._init = jax.jit(self._init_fn, static_argnums=0, out_shardings=self.state_shardings)

    # -- state --------------------------------------------------------------------------------
    def _init_fn(self, seed: int) -> TrainState:
        init_key, _ = jax.random.split(jax.random.key(seed))
        with use_sharding(self.mesh, self.rules):
            created = self.model.init(init_key)
        return self._state_of(created, seed)

    def _state_of(self, created: Any, seed: int) -> TrainState:
        init_key, rng = jax.random.split(jax.random.key(seed))
        stored, master = self.precision.cast_for_storage(created), None
        if self.precision.master is not None:  # frozen parameters (a LoRA base) get none
            trainable = self.model.trainable_mask() if self.model.trainable is not None else None
            master = master_copy(created, self.precision.master, trainable)
        model_state = None
        if self.model.state_init is not None:
            with use_sharding(self.mesh, self.rules):
                model_state = self.model.state_init(init_key)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=stored,
            opt_state=self.optimizer.init(update_target(stored, master)),
            rng=jax.random.key_data(rng),
            master=master,
            model_state=model_state,
        )

    def init(self, seed: int = 0, params: Any = None) -> TrainState:
        """Create the train state, every array born with its sharding (no full copy anywhere).

        Args:
          seed: the initialisation and dropout seed.
          params: start from these parameters (a pretrained model's, say) instead of the model's
            initialisers; a tree shaped like the model's, placed as ``state_shardings.params``
            (:func:`shardkit.models.hf.load_params` builds one). The optimizer starts fresh.
        """
        if params is None:
            with self._mesh_context():
                return self._init(seed)
        check_params_like(params, self.model.abstract_params())
        with self._mesh_context():
            start = jax.jit(self._state_of, static_argnums=1, out_shardings=self.state_shardings)
            return start(params, seed)

    def lower_init(self, seed: int = 0) -> jax.stages.Lowered:
        """The sharded init, lowered (``.compile().memory_analysis()`` shows what it holds)."""
        with self._mesh_context():
            return self._init.lower(seed)

    def _mesh_context(self) -> contextlib.AbstractContextManager[Any]:
        """JAX's mesh context for Explicit axes (sharding in types needs it to read bare
        ``PartitionSpec``s while tracing); Auto meshes are named explicitly everywhere."""
        return jax.set_mesh(self.mesh) if self.layout.explicit else contextlib.nullcontext()

    def abstract_state(self, seed: int = 0) -> TrainState:
        """The train state as ``ShapeDtypeStruct`` with shardings: for AOT compiles, allocates nothing."""
        with self._mesh_context():
            shapes = jax.eval_shape(self._init_fn, seed)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    # -- batches ------------------------------------------------------------------------------
    def batch_specs(self, batch: Mapping[str, Any]) -> dict[str, PartitionSpec]:
        """PartitionSpec of each batch entry (see :meth:`ShardingPlan.batch_specs`)."""
        return self.plan.batch_specs(batch)

    def local_rows(self, batch_size: int) -> slice:
        """The rows of a global batch that this process's devices hold (contiguous)."""
        return self.plan.local_rows(batch_size)

    def shard_batch(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Host-local arrays of one process -> global arrays sharded over the mesh.

        In a single process the local batch is the global batch. With several processes each
        passes its own slice (``jax.make_array_from_process_local_data``). The host arrays are
        checked first (:func:`shardkit.core.inputs.check_host_batch`): token ids within the model's
        vocabulary, no NaN in floating-point entries, a 2-D ``tokens`` for the default loss.
        """
        check_host_batch(
            batch, vocab=self.vocab, needs_tokens=self.loss is next_token_loss, max_seq=self.model.info.get("max_seq")
        )
        n = jax.process_count()
        shapes = {
            k: jax.ShapeDtypeStruct((v.shape[0] * n, *v.shape[1:]) if v.ndim else (), v.dtype) for k, v in batch.items()
        }
        specs = self.batch_specs(shapes)
        return {
            name: jax.make_array_from_process_local_data(NamedSharding(self.mesh, specs[name]), value)
            for name, value in batch.items()
        }

    # -- the step -----------------------------------------------------------------------------
    def lower(self, batch: Mapping[str, Any]) -> jax.stages.Lowered:
        """The train step traced and lowered for batches shaped like ``batch`` (not compiled).

        Its ``as_text()`` is the program before the backend's own rewrites (a CPU, say, turns
        bf16 matmuls into f32 ones; the lowered program shows what was asked for).
        """
        self.plan.check_microbatches(batch, self.microbatches)
        batch_shardings = {k: NamedSharding(self.mesh, s) for k, s in self.batch_specs(batch).items()}
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
                raise LayoutError(
                    f"Model {self.model.name} shards by type (jax.sharding.reshard or out_sharding= with a bare "
                    f"PartitionSpec), which needs Explicit mesh axes, but layout {self.layout.spec()} has Auto axes. "
                    "Fix: mark the layout's axes explicit, e.g. 'fsdp=4:explicit,tensor=2'."
                ) from e

    @property
    def compiler_options(self) -> dict[str, str | bool]:
        """The XLA options the train step (and evaluation) compile with: on the CPU, XLA's
        memory-minimizing scheduler for layers that are not run in a loop
        (:attr:`loops_over_layers`), no loop-invariant code motion for a scanned layer stack
        computed in bf16, and no combined all-reduces where the gradients are reduced to shards
        (:func:`shardkit.runtime.xla_flags.step_compiler_options`); otherwise none."""
        platform = self.mesh.devices.flat[0].platform
        half = jnp.dtype(self.precision.compute).itemsize == 2
        return step_compiler_options(platform, self.loops_over_layers, half, self.plan.splits_gradients)

    @property
    def loops_over_layers(self) -> bool:
        """Whether the step runs its layers in a loop: the parameters are stacked over ``layers``
        and the model does not unroll that stack (``model.info["unrolled_layers"]``, which
        ``GPTConfig(scan_unroll=True)`` sets and a model of your own may pass to
        ``sk.from_nnx(..., info=...)``; a pipeline's schedule runs its stages' layers in its
        own loops). Parameters stacked but unrolled compile as unstacked layers do: under
        ``fsdp=8`` the benchmark's GPT with ``scan_unroll=True`` needs 39.2 MB of temporaries
        so, 55.9 MB with the options of a loop."""
        unrolled = bool(self.model.info.get("unrolled_layers")) and self.schedule is None
        return self.plan.stacks_layers and not unrolled

    def compile(self, batch: Mapping[str, Any]) -> jax.stages.Compiled:
        """Compile (once per batch shape) the train step for batches shaped like ``batch``. On the
        CPU, a step whose temporaries are large is compiled a second time, with them in heaps that
        glibc keeps between steps (:func:`shardkit.runtime.host_allocator.temp_heap_options`,
        :func:`~shardkit.runtime.host_allocator.keep_heaps`: a setting of the whole process).

        ``batch`` may hold arrays or ``jax.ShapeDtypeStruct``: nothing is allocated.
        """
        key = _batch_key(batch)
        if key not in self._compiled:
            if self.loss is next_token_loss and "tokens" in batch:  # arrays that skipped shard_batch's checks
                check_sequence_length(tuple(batch["tokens"].shape), self.model.info.get("max_seq"))
            self._compiled[key] = self._compile_to_run(self.lower(batch))
        return self._compiled[key]

    def _compile_to_run(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """``lowered`` compiled with :attr:`compiler_options`; on the CPU, where the temporaries
        are large and made of arrays of at most 16 MiB, compiled again with them split into heaps
        that glibc keeps between steps (the same program: only its host memory is allocated
        differently; :func:`shardkit.runtime.host_allocator.temp_heap_options`). Where they are
        in glibc's heaps, split or small enough whole, glibc is asked to keep those heaps
        (:func:`shardkit.runtime.host_allocator.keep_heaps`)."""
        compiled = lowered.compile(compiler_options=self.compiler_options)
        memory = compiled.memory_analysis()  # None where a backend does not tell
        platform, temp = self.mesh.devices.flat[0].platform, memory.temp_size_in_bytes if memory else 0
        if not temp_heap_options(platform, temp, largest_array_bytes=0):  # not even without large arrays
            if platform == "cpu" and memory is not None:  # the temporaries fit in one of glibc's heaps
                keep_heaps()
            return compiled
        heaps = temp_heap_options(platform, temp, largest_array_bytes(compiled.as_text() or ""))
        if not heaps:
            return compiled
        keep_heaps()
        options: dict[str, Any] = {**self.compiler_options, **heaps}
        return lowered.compile(compiler_options=options)

    def evaluate(self, params: Any, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The loss of ``params`` (a state's ``.params``, or the state itself) on ``batch``: no
        dropout, no gradients, and a compiled program (once per batch shape) that holds no
        optimizer state. A model with running statistics (batch normalization) reads them from
        the state, so pass the state.

        Returns:
          ``{"loss": mean loss, "tokens": tokens scored}``.
        """
        model_state = None
        if isinstance(params, TrainState):
            params, model_state = params.params, params.model_state
        elif self.model.state_init is not None:
            raise InputError(
                f"Model {self.model.name} keeps running statistics, which evaluation reads from the train state. "
                "Fix: pass the state itself, trainer.evaluate(state, batch), not state.params."
            )
        key = ("evaluate", *_batch_key(batch))
        if key not in self._compiled:
            batch_shardings = {k: NamedSharding(self.mesh, s) for k, s in self.batch_specs(batch).items()}
            shardings = self.state_shardings
            jitted = jax.jit(
                make_eval(self._placed_model, self.loss, self.precision),
                in_shardings=(shardings.params, shardings.model_state, batch_shardings),
                out_shardings=NamedSharding(self.mesh, PartitionSpec()),
            )
            abstract = {
                k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_shardings[k]) for k, v in batch.items()
            }
            state = self.abstract_state()
            with use_sharding(self.mesh, self.rules), self._mesh_context():
                lowered = jitted.lower(state.params, state.model_state, abstract)
                self._compiled[key] = self._compile_to_run(lowered)
        loss, count = self._compiled[key](params, model_state, batch)
        return {"loss": loss, "tokens": count}

    def step(self, state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step. ``state`` is donated: use the returned state from here on.

        Args:
          state: from :meth:`init` or a previous step.
          batch: global arrays from :meth:`shard_batch` (e.g. ``{"tokens": (B, T + 1) int32}``).

        Returns:
          ``(new_state, {"loss", "grad_norm", "tokens"})`` (plus ``finite``, ``finite_grads`` and ``finite_params``
          with a ``nonfinite`` policy).

        Raises:
          NonFiniteError: under ``nonfinite="halt"``, for a step with NaN/Inf; under ``"skip"``,
            for the ``max_skips``-th skipped step in a row. Its ``.state`` is the last good state.
        """
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
            raise InputError(
                "This train state was donated to an earlier step (its buffers now hold the next state). "
                "Fix: continue from the state that step returned: state, metrics = trainer.step(state, batch)."
            )
        self._check_state_layout(state)
        new_state, metrics = self.compile(batch)(state, batch)
        if self.nonfinite is None:
            return new_state, metrics
        if bool(metrics["finite"]):  # waits for the step: the guard decides before the next one
            self.skipped_in_a_row = 0
        elif self.nonfinite == "halt":
            raise halted(new_state, metrics)
        else:
            self.skipped_in_a_row += 1
            if self.max_skips and self.skipped_in_a_row >= self.max_skips:
                raise halted(new_state, metrics, in_a_row=self.skipped_in_a_row)
        return new_state, metrics

    def _check_state_layout(self, state: TrainState) -> None:
        """Refuse a state laid out for another trainer (JAX would fail with a list of mismatches)."""
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        expected = jax.tree.leaves(self.state_shardings)
        if len(flat) != len(expected):
            raise InputError(
                f"This state has {len(flat)} arrays, this trainer's {len(expected)}: it belongs to another model or "
                "optimizer. Fix: use the state from this trainer's init(), restore(), or step()."
            )
        for (path, leaf), sharding in zip(flat, expected, strict=True):
            have = getattr(leaf, "sharding", None)
            if isinstance(leaf, jax.Array) and have is not None and not have.is_equivalent_to(sharding, leaf.ndim):
                raise LayoutError(
                    f"The state's {path_str(path)} is laid out as {short_repr(have)}, not as this trainer's layout "
                    f"{self.layout.spec()} expects. Fix: move it with jax.device_put(state, trainer.state_shardings), "
                    "or restore a checkpoint into this trainer."
                )

    # -- explaining ---------------------------------------------------------------------------
    def report(self, batch: Mapping[str, Any], dry_run: bool = False) -> Report:
        """What the compiled step does per device: collectives, memory, FLOPs, lower bound.

        ``batch`` may be abstract (``jax.ShapeDtypeStruct``); see :class:`shardkit.analysis.report.Report`.
        ``dry_run``: the step will not run here, so it compiles without the CPU backend's code
        optimization (the same buffers and collectives, a faster compile; the program is not
        kept for :meth:`step`).
        """
        start = time.perf_counter()
        fresh = dry_run or _batch_key(batch) not in self._compiled
        # build_report compiles (through self.compile, or once with XLA's partitioner dump on CPU
        # when bf16 is in play), so the time of a fresh report is its compile's, plus the reading.
        report = build_report(self, dict(batch), dry_run=dry_run)
        return dataclasses.replace(report, compile_seconds=time.perf_counter() - start if fresh else None)

    def sharding_table(self) -> list[dict[str, Any]]:
        """One row per parameter: path, shape, logical axes, spec and per-device shard shape."""
        return self.plan.table()

    def format_sharding_table(self) -> str:
        """The parameter table as aligned text (scaling-book notation in the spec column)."""
        return self.plan.format_table()


def _batch_key(batch: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()))


def check_params_like(params: Any, expected: Any) -> None:
    """``params`` has the model's tree, shapes and dtypes (else an InputError naming the first
    difference), so a wrong checkpoint is refused before anything is compiled."""
    got = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(expected)[0]}
    if got.keys() != want.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        raise InputError(
            f"init(params=...): the tree differs from the model's: missing {missing[:3]}, unexpected {extra[:3]}."
        )
    for name, x in got.items():
        w = want[name]
        if tuple(x.shape) != tuple(w.shape) or jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
            raise InputError(
                f"init(params=...): {name} is {x.dtype}{list(x.shape)}; the model's is {w.dtype}{list(w.shape)}."
            )
