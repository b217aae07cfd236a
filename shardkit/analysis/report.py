"""Report: what the compiler did with a plan, next to what the layout should cost at best.

For a compiled train step it lists every collective (kind, count per step, bytes, the mesh
axes it runs over, the user op it comes from), per-device memory (parameters, optimizer
state, batch, temporaries, outputs, aliasing), matmul FLOPs, and the analytic lower bound of
the layout (the reference formulas below) with the measured/bound ratios.

Bytes moved per device use ring algorithms on ``n`` devices for an array of ``S`` bytes:
all-reduce ``2(n-1)/n*S``; all-gather, reduce-scatter, all-to-all ``(n-1)/n*S``;
collective-permute ``S``.
"""

from __future__ import annotations

import collections
import math
import re
import tempfile
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from shardkit.analysis import hlo, hlo_uses, mixtures, partitioned
from shardkit.analysis.report_data import CollectiveStat, Memory, Report, moved_bytes, source_op
from shardkit.core.errors import AnalysisError
from shardkit.core.mesh import Layout
from shardkit.core.precision import Precision
from shardkit.core.rules import Rules, entry_axes
from shardkit.core.sharding import rows_only_expert_note, unnamed_model_note
from shardkit.models.model import Model, model_facts
from shardkit.parallel.expert_tensor import experts_under_tensor
from shardkit.runtime.xla_flags import DRY_RUN_OPTIONS


class CompiledStep(Protocol):
    """What a report reads of a compiled train step (``shardkit.Trainer`` is one); declared here
    so that the analysis layer never imports the training layer (docs/architecture.md)."""

    mesh: Mesh
    model: Model
    loss: Any  # (forward, batch) -> (mean loss, count): traced to find the model's mixtures of experts
    layout: Layout
    rules: Rules
    precision: Precision
    microbatches: int
    accumulation: Any  # how microbatches' gradients are reduced (shardkit.training.accumulation.Accumulation)
    param_specs: Any
    update_specs: Any  # where the optimizer's copies live (param_specs, plus data under ZeRO)
    state_shardings: Any

    @property
    def compiler_options(self) -> dict[str, str | bool]: ...  # the XLA options its step compiles with

    def compile(self, batch: Mapping[str, Any]) -> jax.stages.Compiled: ...

    def lower(self, batch: Mapping[str, Any]) -> jax.stages.Lowered: ...

    def abstract_state(self, seed: int = 0) -> Any: ...

    def batch_specs(self, batch: Mapping[str, Any]) -> dict[str, PartitionSpec]: ...

    def sharding_table(self) -> list[dict[str, Any]]: ...


# Path components of an HLO op_name that are JAX plumbing rather than the user's code.
def collective_stats(
    text: str,
    mesh: jax.sharding.Mesh,
    param_specs: Any = None,
    param_shapes: Any = None,
    partitioned_text: str | None = None,
) -> list[CollectiveStat]:
    """Aggregate the compiled module's collectives by (kind, mesh axes, op, direction).

    With the parameters' specs and shapes, a backward all-reduce over mesh axes that shard
    parameters, on an array shaped like a gradient before that sharding, whose result is then
    sliced per device (or stored per layer, to be sliced after the layer scan) is reported as
    the reduce-scatter it stands for; so is any all-reduce whose result is used only through
    per-device slices, one part in its group's size (an activation's, under sequence
    parallelism). With the module as the SPMD partitioner left it (``partitioned_text``), bytes
    are counted at the dtypes it chose.
    """
    program = hlo.parse(text)
    found = hlo.collectives(program)
    if partitioned_text is not None:
        found = partitioned.at_partitioner_dtypes(found, partitioned_text)
    reading = _ScatterReading(program, dict(mesh.shape), param_specs, param_shapes)
    host_of = [d.process_index for d in mesh.devices.flat]
    groups: dict[tuple[Any, ...], list[tuple[int, int]]] = collections.defaultdict(list)
    for c in found:
        axes = hlo.mesh_axes_of(c.groups, mesh)
        n = c.group_size or 1
        op, direction = source_op(c.op_name, [math.prod(shape) for shape in c.shapes])
        kind, lowered = reading.kind_of(c, tuple(axes), direction, n)
        payload = c.payload_bytes * (n if c.kind == "reduce-scatter" else 1)
        crosses = any(len({host_of[i] for i in g if i < len(host_of)}) > 1 for g in c.groups)
        groups[(kind, axes, op, direction, n, lowered, crosses, c.asynchronous)].append((c.executions, payload))
    return _aggregated(groups)


class _ScatterReading:
    """Which all-reduces of a compiled module stand for reduce-scatters (see :func:`collective_stats`):
    the CPU backend's spelling, an all-reduce whose result each device slices."""

    def __init__(self, program: Any, mesh_shape: dict[str, int], param_specs: Any, param_shapes: Any):
        self.sliced, self.stacked, self.only_sliced = hlo_uses.sliced_results(program)
        self.mesh_shape = mesh_shape
        is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
        self.specs = jax.tree.leaves(param_specs, is_leaf=is_spec) if param_specs else []
        self.shapes = [tuple(x.shape) for x in jax.tree.leaves(param_shapes)] if param_shapes else []
        self.param_axes = {a for spec in self.specs for entry in spec for a in entry_axes(entry)}
        self._gradient_shapes: dict[tuple[str, ...], frozenset[tuple[int, ...]]] = {}

    def kind_of(self, c: Any, axes: tuple[str, ...], direction: str, n: int) -> tuple[str, str]:
        """``(kind, lowered as)`` of one collective: ``("reduce-scatter", "all-reduce+dynamic-slice")``
        for an all-reduce that stands for one, its own kind otherwise."""
        if c.kind != "all-reduce" or not axes:
            return c.kind, ""
        if self.only_sliced.get(c.name) == n:
            return "reduce-scatter", "all-reduce+dynamic-slice"
        grads = self.gradient_shapes(axes)
        gradient_scatter = (
            direction == "backward"
            and set(axes) <= self.param_axes
            and (c.name in self.sliced or c.name in self.stacked)
            and any(shape in grads or _without_leading_ones(shape) in grads for shape in c.shapes)
        )
        return ("reduce-scatter", "all-reduce+dynamic-slice") if gradient_scatter else (c.kind, "")

    def gradient_shapes(self, axes: tuple[str, ...]) -> frozenset[tuple[int, ...]]:
        """Local gradient shapes, of the parameters some of ``axes`` split, while still whole
        along ``axes`` (and per layer, without dim 0), also as the matrices a layer may multiply
        by, either way round (its weight's leading dimensions merged, and its trailing ones: the
        gradient is reduced in that shape)."""
        if axes not in self._gradient_shapes:
            out = set()
            for spec, shape in zip(self.specs, self.shapes, strict=True):
                entries = tuple(spec) + (None,) * (len(shape) - len(spec))
                if not {a for e in entries for a in entry_axes(e)} & set(axes):
                    continue  # a parameter no axis of ``axes`` splits is all-reduced over them, not scattered
                local = tuple(
                    d // math.prod(self.mesh_shape[a] for a in entry_axes(e) if a not in axes)
                    for d, e in zip(shape, entries, strict=True)
                )
                for dims in (local, local[1:]):
                    out.add(dims)
                    for k in range(1, len(dims)):
                        rows, cols = math.prod(dims[:k]), math.prod(dims[k:])
                        out.update({(rows, cols), (cols, rows)})
            self._gradient_shapes[axes] = frozenset(out)
        return self._gradient_shapes[axes]


def _aggregated(groups: Mapping[tuple[Any, ...], list[tuple[int, int]]]) -> list[CollectiveStat]:
    """One :class:`CollectiveStat` per group of ``(executions, payload bytes)``, sorted."""
    stats = []
    for (kind, axes, op, direction, n, lowered, crosses, asynchronous), items in groups.items():
        count = sum(e for e, _ in items)
        total = sum(e * p for e, p in items)
        per_execution, moved = total // max(count, 1), moved_bytes(kind, total, n)
        stats.append(
            CollectiveStat(kind, axes, op, direction, count, n, per_execution, moved, lowered, crosses, asynchronous)
        )
    return sorted(stats, key=lambda c: (c.kind, c.axes, c.op))


def _without_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``(1, 1, 64, 32) -> (64, 32)``: a gradient still carrying the (here size-1) dimensions of
    the mesh axes it is yet to be reduced over (``shardkit.training.accumulation``)."""
    first = next((i for i, d in enumerate(shape) if d != 1), len(shape))
    return shape[first:]


def _bytes_per_device(abstract: Any, shardings: Any) -> int:
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
        total += math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return int(total)


def lower_bound(
    layout_shape: dict[str, int],
    param_bytes: float,
    state_bytes: float,
    *,
    layers: int = 0,
    activation_bytes: float = 0.0,
    vocab_parallel: bool = False,
    tensor_blocks: int = 0,
    whole_over_tensor_bytes: float = 0.0,
    expert_param_bytes: float = 0.0,
    expert_whole_over_tensor_bytes: float = 0.0,
    expert_bytes: float = 0.0,
    expert_calls: int = 0,
) -> dict[str, float]:
    """The least a layout must move and hold per device (ring collectives, ZeRO, Megatron, and a
    pipeline's sends between stages).

    Args:
      layout_shape: mesh axis sizes.
      param_bytes: bytes of all parameters in the dtype they are communicated in.
      state_bytes: bytes of the whole model state (params, optimizer state, master copy).
      layers: transformer layers (for the tensor-parallel term).
      activation_bytes: bytes of one layer's ``(batch, seq, hidden)`` activation of one
        tensor-parallel group (global batch / (data x fsdp)), summed over microbatches: also what
        crosses a stage boundary.
      vocab_parallel: a vocabulary is split over ``tensor`` (Megatron's vocabulary-parallel
        embedding and output layer): the lookup's output is all-reduced in the forward pass and
        the output layer's input gradient in the backward pass, one activation each.
      tensor_blocks: Megatron blocks (an attention, an MLP, a cross-attention: a matmul that
        contracts a dimension split over ``tensor`` back to the model dimension), each one
        all-reduce forward and one backward; 0 counts two per layer.
      whole_over_tensor_bytes: of ``param_bytes``, those of parameters no dimension of which is
        split over ``tensor`` (norm scales, a row-parallel layer's bias, a patch embedding, a
        position table, as Megatron keeps them): every tensor rank holds, gathers and reduces
        them whole.
      expert_param_bytes: of ``param_bytes``, those of the experts' own weights (a dimension
        named ``experts``), split over ``expert``: their gradients are reduced over the row axes
        that do not split them (``data``), every other parameter's over every axis that splits
        the rows (``data`` and ``expert``).
      expert_whole_over_tensor_bytes: of ``expert_param_bytes``, those not split over ``tensor``
        (counted in ``whole_over_tensor_bytes`` too).
      expert_bytes: the experts' dispatch and combine over ``expert``
        (:func:`shardkit.analysis.mixtures.expert_traffic`).
      expert_calls: the mixtures' calls a step (their layers). With ``tensor`` and ``expert``
        axes each call takes the cheaper use of ``tensor`` for its experts: hidden units split
        (counted among the Megatron blocks) or rows split
        (:func:`shardkit.parallel.expert_tensor.experts_under_tensor`).

    Returns:
      ``{"bytes_per_device", "state_memory_per_device", "activation_bytes", plus each term}``.
    """
    d, f, t = layout_shape.get("data", 1), layout_shape.get("fsdp", 1), layout_shape.get("tensor", 1)
    e = layout_shape.get("expert", 1)
    n = math.prod(layout_shape.values())
    shared_whole = whole_over_tensor_bytes - expert_whole_over_tensor_bytes
    shared = (param_bytes - expert_param_bytes - shared_whole) / t + shared_whole
    # The experts' weights: each device holds its experts' share (all of them without an expert axis).
    experts = ((expert_param_bytes - expert_whole_over_tensor_bytes) / t + expert_whole_over_tensor_bytes) / e
    terms = {
        # ZeRO-3: gather the parameters for the forward and again for the backward, reduce-scatter grads.
        "fsdp": 3 * moved_bytes("all-gather", shared + experts, f),
        # Data parallelism: all-reduce the (fsdp- and tensor-sharded) gradients over the axes that
        # split the rows and not the parameter: data and expert, but only data for the experts.
        "data": moved_bytes("all-reduce", shared / f, d * e) + moved_bytes("all-reduce", experts / f, d),
        # Megatron: 2 all-reduces forward and 2 backward per layer of (b, s, h) activations, and
        # one each for a vocabulary-parallel embedding (forward) and output layer (backward).
        "tensor": (2 * (tensor_blocks or 2 * layers) + 2 * vocab_parallel)
        * moved_bytes("all-reduce", activation_bytes, t),
        # Pipeline: each microbatch's boundary activation goes to the next stage, its gradient
        # comes back (collective-permutes; a lock-step schedule also sends in its bubbles).
        "stage": 2 * moved_bytes("collective-permute", activation_bytes, 2)
        if layout_shape.get("stage", 1) > 1
        else 0.0,
        # Expert parallelism: tokens to their experts and back (all-to-alls), or a dense mixture's
        # rows gathered and outputs reduce-scattered, forward and backward.
        "expert": expert_bytes if e > 1 else 0.0,
    }
    if e > 1 and t > 1 and expert_calls and expert_bytes:
        split = expert_param_bytes > expert_whole_over_tensor_bytes
        group_weights = expert_param_bytes / expert_calls / e
        call = experts_under_tensor(expert_bytes / expert_calls, activation_bytes, group_weights, t, split)
        as_megatron = 2 * moved_bytes("all-reduce", activation_bytes, t) if split else 0.0  # counted above
        terms["expert"] = expert_calls * call["expert"]
        terms["tensor"] = max(0.0, terms["tensor"] - expert_calls * as_megatron) + expert_calls * call["tensor"]
    return {
        "bytes_per_device": sum(terms.values()),
        "state_memory_per_device": state_bytes / n,
        "activation_bytes": activation_bytes,
        **{f"bytes_{k}": v for k, v in terms.items()},
    }


def _whole_over_tensor_bytes(params: list[Any], param_specs: Any) -> float:
    """Bytes of the parameters (leaves in tree order) whose spec splits no dimension over ``tensor``."""
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return float(
        sum(
            x.size * np.dtype(x.dtype).itemsize
            for x, spec in zip(params, specs, strict=True)
            if not any("tensor" in entry_axes(e) for e in spec)
        )
    )


def sequence_in_program(text: str, rows: float, dim: int) -> int:
    """The sequence length of a model's ``(rows, seq, dim)`` activations in a compiled module:
    the ``seq`` most arrays shaped so have (a ViT's patches, where its input is images); 1 for
    an MLP's ``(rows, dim)``; 0 for neither (a CNN's activations are 4-D).

    Example:
      >>> sequence_in_program("a = f32[4,16,64]{2,1,0} add(b, c)\\nd = f32[4,16,64] tanh(a)", 4, 64)
      16
      >>> sequence_in_program("a = f32[4,64]{1,0} add(b, c)", 4, 64)
      1
    """
    if not dim or rows != int(rows):
        return 0
    found = collections.Counter(
        int(s) for r, s, d in re.findall(r"\[(\d+),(\d+),(\d+)\]", text) if int(r) == rows and int(d) == dim
    )
    if found:
        return found.most_common(1)[0][0]
    return 1 if f"[{int(rows)},{dim}]" in text else 0


def tensor_blocks(table: list[dict[str, Any]]) -> int:
    """Megatron blocks in a sharding table: matrices whose last dimension is named ``embed`` and
    another is split over ``tensor`` (an attention's output projection, an MLP's down projection,
    experts' output weights), times the layers they stack (a leading ``layers`` dimension).

    Example:
      >>> out = {"logical": "(layers, heads, kv, embed)", "spec": "[-, tensor, -, -]", "shape": (4, 8, 16, 64)}
      >>> tensor_blocks([out, {"logical": "(vocab, embed)", "spec": "[tensor, -]", "shape": (256, 64)}])
      4
    """
    count = 0
    for row in table:
        names = [n.strip() for n in row["logical"].strip("()").split(",")]
        spec = [e.strip() for e in row["spec"].strip("[]").split(",")]
        if len(names) < 2 or names[-1] != "embed" or "vocab" in names or len(spec) != len(names):
            continue
        if any("tensor" in entry for entry in spec[:-1]):
            count += row["shape"][0] if names[0] == "layers" else 1
    return count


def build_report(
    trainer: CompiledStep, batch: dict[str, Any], compile_seconds: float | None = None, dry_run: bool = False
) -> Report:
    """The report of ``trainer``'s step compiled for batches shaped like ``batch``; ``dry_run``:
    a program that will not run, compiled without the backend's code optimization
    (:data:`shardkit.runtime.xla_flags.DRY_RUN_OPTIONS`)."""
    abstract = trainer.abstract_state()
    compiled, partitioned_text = _compiled(trainer, batch, abstract.params, dry_run)
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    if text is None or mem is None:
        raise AnalysisError("The compiled step has no HLO text or memory analysis on this backend; nothing to report.")
    shardings = trainer.state_shardings
    batch_shardings = {k: jax.sharding.NamedSharding(trainer.mesh, s) for k, s in trainer.batch_specs(batch).items()}
    memory = Memory(
        params=_bytes_per_device(abstract.params, shardings.params),
        optimizer=_bytes_per_device(abstract.opt_state, shardings.opt_state),
        master=_bytes_per_device(abstract.master, shardings.master) if abstract.master is not None else 0,
        batch=_bytes_per_device(dict(batch), batch_shardings),
        arguments=int(mem.argument_size_in_bytes),
        outputs=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes),
        temp=int(mem.temp_size_in_bytes),
        generated_code=int(mem.generated_code_size_in_bytes),
    )
    params = jax.tree.leaves(abstract.params)
    param_count = sum(x.size for x in params)
    param_bytes = sum(x.size * np.dtype(x.dtype).itemsize for x in params)
    state_bytes = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract) if x.ndim)
    info = model_facts(trainer.model)
    layout_shape = dict(trainer.mesh.shape)
    shape = next(iter(batch.values())).shape
    rows = shape[0]
    layers = int(info.get("layers", 0))
    # One layer's (b, s, h) activation of one tensor-parallel group, summed over microbatches.
    per_group_rows = rows / (layout_shape.get("data", 1) * layout_shape.get("fsdp", 1) * layout_shape.get("expert", 1))
    if "tokens" in batch:
        seq = shape[1] - 1 if len(shape) >= 2 else 1
    else:  # images, features: the positions the layers see are not the input's second dimension
        seq = sequence_in_program(text, per_group_rows / trainer.microbatches, int(info.get("dim", 0)))
        seq = seq or (shape[1] if len(shape) >= 2 else 1)
    activation = per_group_rows * seq * info.get("dim", 0) * np.dtype(trainer.precision.compute).itemsize
    table = trainer.sharding_table()
    vocab_parallel = layers > 0 and any("vocab" in row["logical"] and "tensor" in row["spec"] for row in table)
    experts = mixtures.bound_terms(
        trainer.model,
        trainer.loss,
        batch,
        trainer.param_specs,
        layout_shape,
        np.dtype(trainer.precision.compute).itemsize,
        tokens=int(rows * seq) if "tokens" in batch else 0,
        held=abstract.params,
    )
    expert_calls = int(experts.pop("expert_calls"))
    bound = lower_bound(
        layout_shape,
        param_bytes,
        state_bytes,
        layers=layers,
        activation_bytes=activation,
        vocab_parallel=vocab_parallel,
        tensor_blocks=tensor_blocks(table) if layers else 0,
        whole_over_tensor_bytes=_whole_over_tensor_bytes(params, trainer.param_specs)
        if layout_shape.get("tensor", 1) > 1
        else 0.0,
        expert_calls=expert_calls,
        **experts,
    )
    model_flops = None
    if (
        info.get("matmul_params") and "tokens" in batch
    ):  # a language model; PaLM's count: 6N per token for the matmuls + 12*L*h*s for attention
        model_flops = float(rows * seq * (6 * info["matmul_params"] + 12 * layers * info["dim"] * seq))
    return Report(
        backend=trainer.mesh.devices.flat[0].platform,
        devices=int(trainer.mesh.devices.size),
        layout=trainer.layout.spec(),
        precision=trainer.precision.name,
        microbatches=trainer.microbatches,
        parameters=int(param_count),
        # Gradients are reduced to where the optimizer's copies live: over data too under ZeRO.
        collectives=tuple(
            collective_stats(text, trainer.mesh, trainer.update_specs, abstract.params, partitioned_text)
        ),
        memory=memory,
        flops_per_device=hlo.dot_flops(text),
        model_flops_per_step=model_flops,
        lower_bound=bound,
        compile_seconds=compile_seconds,
        gradient_reduction=_gradient_reduction(trainer),
        partitioner_dtypes=partitioned_text is not None,
    )


def _compiled(
    trainer: CompiledStep, batch: dict[str, Any], params: Any, dry_run: bool = False
) -> tuple[jax.stages.Compiled, str | None]:
    """The compiled step, and on the CPU backend with bf16 in play (in the compute dtype or the
    ``params``) the module as the SPMD partitioner left it (``shardkit.analysis.partitioned``: the CPU
    compiler runs bf16 collectives in f32)."""
    bf16 = jnp.dtype(trainer.precision.compute) == jnp.bfloat16 or any(
        x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params)
    )
    cpu = trainer.mesh.devices.flat[0].platform == "cpu"
    options: dict[str, Any] = {**trainer.compiler_options, **(DRY_RUN_OPTIONS if dry_run and cpu else {})}
    if not cpu or not bf16:  # a dry run's program is not the one a step may run: not cached
        return (trainer.lower(batch).compile(compiler_options=options) if dry_run else trainer.compile(batch)), None
    with tempfile.TemporaryDirectory(prefix="shardkit-partitioned-") as directory, partitioned.uncached():
        compiled = trainer.lower(batch).compile(compiler_options={**options, **partitioned.dump_options(directory)})
        return compiled, partitioned.read(directory)


def _gradient_reduction(trainer: CompiledStep) -> str:
    """``"once"``, ``"per_microbatch: <why>"``, or "" without microbatches."""
    acc = trainer.accumulation
    if trainer.microbatches == 1 or acc.reduces is None:
        return ""
    return acc.reduces + (f": {acc.reason}" if acc.reason else "")


def sharding_warnings(trainer: CompiledStep, top: int = 3, min_fraction: float = 0.01) -> list[str]:
    """Warnings a user should see before a long run.

    - the largest parameters left fully replicated on a mesh of several devices (each at least
      ``min_fraction`` of all parameter bytes);
    - rules whose mesh axes are larger than 1 here but that shard no parameter;
    - the model's own notes (e.g. regex rules of :func:`shardkit.annotate` that matched nothing);
    - a ``tensor`` or ``expert`` axis under a model that names no parameter's axes;
    - an ``expert`` axis under a model without experts (it splits the rows only).
    """
    warnings = list(trainer.model.notes)
    for note in (unnamed_model_note, rows_only_expert_note):
        said = note(trainer.model, dict(trainer.mesh.shape))
        if said is not None:
            warnings.append(said)
    rows = trainer.sharding_table()
    total = sum(r["bytes_per_device"] * math.prod(r["shape"]) / max(math.prod(r["shard"]), 1) for r in rows)
    if trainer.mesh.devices.size > 1:
        replicated = [r for r in rows if r["shape"] and r["shard"] == r["shape"]]
        replicated.sort(key=lambda r: -r["bytes_per_device"])
        for r in replicated[:top]:
            if r["bytes_per_device"] >= min_fraction * total:
                warnings.append(
                    f"{r['path']} {'x'.join(map(str, r['shape']))} ({r['bytes_per_device'] / 1e6:.2f} MB) is "
                    f"replicated on all {trainer.mesh.devices.size} devices; its logical axes {r['logical']} "
                    "map to no mesh axis of this layout."
                )
    mesh_shape = dict(trainer.mesh.shape)
    used = {name for r in rows for name in re.findall(r"[A-Za-z_]+", r["logical"])}
    # Mesh axes that do split some parameter (by a rule, or by the fallback of a model that names none).
    splitting = {name for r in rows for name in re.findall(r"[A-Za-z_]+", r["spec"])}
    for name, axes in trainer.rules.rules:
        live = [a for a in axes if mesh_shape.get(a, 1) > 1]
        if live and name not in used and name not in ("batch", "seq") and not set(live) & splitting:
            warnings.append(
                f"rule {name} -> {'+'.join(axes)} matches no parameter, so mesh axes "
                f"{', '.join(f'{a}={mesh_shape[a]}' for a in live)} shard no weights of {trainer.model.name}."
            )
    return warnings
