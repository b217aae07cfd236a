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
import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from shardkit import hlo
from shardkit.errors import AnalysisError
from shardkit.mesh import Layout
from shardkit.model import Model, model_facts
from shardkit.precision import Precision
from shardkit.rules import Rules, entry_axes


class CompiledStep(Protocol):
    """What a report reads of a compiled train step (``shardkit.Trainer`` is one); declared here
    so that the analysis layer never imports the training layer (docs/architecture.md)."""

    mesh: Mesh
    model: Model
    layout: Layout
    rules: Rules
    precision: Precision
    microbatches: int
    param_specs: Any
    state_shardings: Any

    def compile(self, batch: Mapping[str, Any]) -> jax.stages.Compiled: ...

    def abstract_state(self, seed: int = 0) -> Any: ...

    def batch_specs(self, batch: Mapping[str, Any]) -> dict[str, PartitionSpec]: ...

    def sharding_table(self) -> list[dict[str, Any]]: ...


# Path components of an HLO op_name that are JAX plumbing rather than the user's code.
_PLUMBING = {"while", "body", "closed_call", "checkpoint", "remat", "rematted_computation", "cond", ""}
_WRAPPER = re.compile(r"\b(?:jvp|transpose|jit|remat|checkpoint|vmap|pjit)\(([^()]*)\)")


def source_op(op_name: str) -> tuple[str, str]:
    """``(op, direction)`` of an HLO op_name, e.g. ``("layer/attn/out_proj/dot_general", "forward")``.

    Example:
      >>> source_op("jit(step)/transpose(jvp())/while/body/closed_call/layer/mlp/down_proj/dot_general")
      ('layer/mlp/down_proj/dot_general', 'backward')
    """
    # XLA joins the op_names of collectives it combined with ":" (and a parenthesised prefix).
    combined = op_name.split(":")
    first = combined[0]
    direction = "backward" if "transpose(" in first else "forward"
    body = re.sub(r"^jit\([^()]*\)/", "", first)
    while _WRAPPER.search(body):
        body = _WRAPPER.sub(r"\1", body)
    parts = [p.strip("()") for p in body.split("/")]
    op = "/".join(p for p in parts if p not in _PLUMBING) or "(unnamed)"
    if len(combined) > 1:
        op += f" (+{len(combined) - 1} combined)"
    return op, direction


def moved_bytes(kind: str, full_bytes: float, n: int) -> float:
    """Bytes one device sends for a ring collective over ``n`` devices on ``full_bytes``."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * full_bytes
    if kind == "collective-permute":
        return float(full_bytes)
    return (n - 1) / n * full_bytes


@dataclasses.dataclass(frozen=True)
class CollectiveStat:
    """Collectives of one kind, over the same mesh axes, from the same op, in one step.

    Attributes:
      kind: all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute.
      axes: mesh axes the collective runs over.
      op: the user op it comes from (named scopes and JAX op), e.g. ``layer/attn/out_proj/...``.
      direction: ``forward`` or ``backward`` (from the op's transpose marker).
      count: executions per step (loop trip counts included).
      group_size: devices per replica group.
      payload_bytes: bytes of the full array per execution (for a reduce-scatter: its input).
      moved_bytes: bytes sent per device per step (ring formula x count).
      lowered_as: how the backend spelled it, when different from ``kind``.
      crosses_hosts: its replica groups hold devices of several processes (the slow network).
    """

    kind: str
    axes: tuple[str, ...]
    op: str
    direction: str
    count: int
    group_size: int
    payload_bytes: int
    moved_bytes: float
    lowered_as: str = ""
    crosses_hosts: bool = False


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device. ``total`` = arguments + outputs - aliased + temporaries."""

    params: int
    optimizer: int
    master: int
    batch: int
    arguments: int
    outputs: int
    alias: int
    temp: int
    generated_code: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.alias + self.temp

    def to_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclasses.dataclass(frozen=True)
class Report:
    """What one compiled train step does, per device, and how far from the layout's bound."""

    backend: str
    devices: int
    layout: str
    precision: str
    microbatches: int
    parameters: int
    collectives: tuple[CollectiveStat, ...]
    memory: Memory
    flops_per_device: float
    model_flops_per_step: float | None
    lower_bound: dict[str, float]
    compile_seconds: float | None = None

    @property
    def moved_bytes(self) -> float:
        return sum(c.moved_bytes for c in self.collectives)

    def bytes_by_axes(self) -> dict[str, float]:
        """Bytes moved per device per step, by the mesh axes collectives run over."""
        out: dict[str, float] = collections.defaultdict(float)
        for c in self.collectives:
            out["+".join(c.axes) or "-"] += c.moved_bytes
        return dict(out)

    @property
    def ratios(self) -> dict[str, float]:
        """Measured / lower bound, for bytes moved and for model-state memory."""
        bound_bytes = self.lower_bound["bytes_per_device"]
        state = self.memory.params + self.memory.optimizer + self.memory.master
        return {
            "bytes": self.moved_bytes / bound_bytes if bound_bytes else (0.0 if not self.moved_bytes else math.inf),
            "memory": state / self.lower_bound["state_memory_per_device"],
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "devices": self.devices,
            "layout": self.layout,
            "precision": self.precision,
            "microbatches": self.microbatches,
            "parameters": self.parameters,
            # "bytes": moved per device per step (= moved_bytes), the figure tables show.
            "collectives": [{**dataclasses.asdict(c), "bytes": c.moved_bytes} for c in self.collectives],
            "bytes_by_axes": self.bytes_by_axes(),
            "memory": self.memory.to_dict(),
            "flops_per_device": self.flops_per_device,
            "model_flops_per_step": self.model_flops_per_step,
            "lower_bound": self.lower_bound,
            "ratios": self.ratios,
            "compile_seconds": self.compile_seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        """Rebuild a report from :meth:`to_dict` output (e.g. a dry run in a subprocess)."""
        memory = {k: v for k, v in d["memory"].items() if k != "total"}
        return cls(
            backend=d["backend"],
            devices=d["devices"],
            layout=d["layout"],
            precision=d["precision"],
            microbatches=d["microbatches"],
            parameters=d["parameters"],
            collectives=tuple(
                CollectiveStat(**{k: v for k, v in c.items() if k != "bytes"} | {"axes": tuple(c["axes"])})
                for c in d["collectives"]
            ),
            memory=Memory(**memory),
            flops_per_device=d["flops_per_device"],
            model_flops_per_step=d["model_flops_per_step"],
            lower_bound=d["lower_bound"],
            compile_seconds=d.get("compile_seconds"),
        )

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def table(self) -> str:
        """The report as text: collectives, memory, FLOPs and the bound."""
        lines = [
            f"{self.layout} on {self.devices} {self.backend} device(s), precision {self.precision}, "
            f"microbatches {self.microbatches}, {self.parameters:,} parameters",
            "",
            f"{'collective':16s} {'axes':16s} {'dir':4s} {'count':>5s} {'MB moved':>10s}  op",
        ]
        for c in sorted(self.collectives, key=lambda c: -c.moved_bytes):
            kind = c.kind + ("*" if c.lowered_as else "")
            axes = ("+".join(c.axes) or "-") + (" [hosts]" if c.crosses_hosts else "")
            lines.append(f"{kind:16s} {axes:16s} {c.direction[:3]:4s} {c.count:5d} {c.moved_bytes / 1e6:10.3f}  {c.op}")
        if any(c.lowered_as for c in self.collectives):
            lines.append(f"* lowered on {self.backend} as all-reduce + dynamic-slice; GPU backends emit reduce-scatter")
        m = self.memory
        lines += [
            "",
            "memory per device (MB): "
            + ", ".join(
                f"{k} {v / 1e6:.2f}"
                for k, v in [
                    ("params", m.params),
                    ("optimizer", m.optimizer),
                    ("master", m.master),
                    ("batch", m.batch),
                    ("temp", m.temp),
                    ("outputs", m.outputs),
                    ("aliased", m.alias),
                    ("total", m.total),
                ]
            ),
            f"matmul FLOPs per device per step: {self.flops_per_device:.4g}",
            f"lower bound: {self.lower_bound['bytes_per_device'] / 1e6:.3f} MB moved, "
            f"{self.lower_bound['state_memory_per_device'] / 1e6:.3f} MB model state per device; "
            f"measured/bound: bytes {self.ratios['bytes']:.2f}, memory {self.ratios['memory']:.2f}",
        ]
        return "\n".join(lines)


def collective_stats(
    text: str, mesh: jax.sharding.Mesh, param_specs: Any = None, param_shapes: Any = None
) -> list[CollectiveStat]:
    """Aggregate the compiled module's collectives by (kind, mesh axes, op, direction).

    With the parameters' specs and shapes, a backward all-reduce over mesh axes that shard
    parameters, on an array shaped like a gradient before that sharding, whose result is then
    sliced per device (or stored per layer, to be sliced after the layer scan) is reported as
    the reduce-scatter it stands for.
    """
    sliced, stacked = hlo.sliced_results(text)
    mesh_shape = dict(mesh.shape)
    host_of = [d.process_index for d in mesh.devices.flat]
    specs = (
        jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) if param_specs else []
    )
    shapes = [tuple(x.shape) for x in jax.tree.leaves(param_shapes)] if param_shapes else []
    param_axes = {a for spec in specs for entry in spec for a in entry_axes(entry)}

    @functools.cache
    def gradient_shapes(axes: tuple[str, ...]) -> frozenset[tuple[int, ...]]:
        """Local gradient shapes while still whole along ``axes`` (and per layer, without dim 0)."""
        out = set()
        for spec, shape in zip(specs, shapes, strict=True):
            entries = tuple(spec) + (None,) * (len(shape) - len(spec))
            local = tuple(
                d // math.prod(mesh_shape[a] for a in entry_axes(e) if a not in axes)
                for d, e in zip(shape, entries, strict=True)
            )
            out.update({local, local[1:]})
        return frozenset(out)

    groups: dict[tuple[Any, ...], list[Any]] = collections.defaultdict(list)
    for c in hlo.collectives(text):
        axes = hlo.mesh_axes_of(c.groups, mesh)
        n = c.group_size or 1
        op, direction = source_op(c.op_name)
        kind, lowered = c.kind, ""
        if (
            c.kind == "all-reduce"
            and direction == "backward"
            and axes
            and set(axes) <= param_axes
            and (c.name in sliced or c.name in stacked)
            and any(shape in gradient_shapes(tuple(axes)) for shape in c.shapes)
        ):
            kind, lowered = "reduce-scatter", "all-reduce+dynamic-slice"
        payload = c.payload_bytes * (n if c.kind == "reduce-scatter" else 1)
        crosses = any(len({host_of[i] for i in g if i < len(host_of)}) > 1 for g in c.groups)
        groups[(kind, axes, op, direction, n, lowered, crosses)].append((c.executions, payload))
    stats = []
    for (kind, axes, op, direction, n, lowered, crosses), items in groups.items():
        count = sum(e for e, _ in items)
        total = sum(e * p for e, p in items)
        stats.append(
            CollectiveStat(
                kind,
                axes,
                op,
                direction,
                count,
                n,
                total // max(count, 1),
                moved_bytes(kind, total, n),
                lowered,
                crosses,
            )
        )
    return sorted(stats, key=lambda c: (c.kind, c.axes, c.op))


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
) -> dict[str, float]:
    """The least a layout must move and hold per device (ring collectives, ZeRO, Megatron).

    Args:
      layout_shape: mesh axis sizes.
      param_bytes: bytes of all parameters in the dtype they are communicated in.
      state_bytes: bytes of the whole model state (params, optimizer state, master copy).
      layers: transformer layers (for the tensor-parallel term).
      activation_bytes: bytes of one layer's ``(batch, seq, hidden)`` activation of one
        tensor-parallel group (global batch / (data x fsdp)).

    Returns:
      ``{"bytes_per_device", "state_memory_per_device", plus each term}``.
    """
    d, f, t = layout_shape.get("data", 1), layout_shape.get("fsdp", 1), layout_shape.get("tensor", 1)
    n = math.prod(layout_shape.values())
    per_tensor_shard = param_bytes / t
    terms = {
        # ZeRO-3: gather the parameters for the forward and again for the backward, reduce-scatter grads.
        "fsdp": 3 * moved_bytes("all-gather", per_tensor_shard, f),
        # Data parallelism: all-reduce the (fsdp- and tensor-sharded) gradients.
        "data": moved_bytes("all-reduce", per_tensor_shard / f, d),
        # Megatron: 2 all-reduces forward and 2 backward per layer of (b, s, h) activations.
        "tensor": 4 * layers * moved_bytes("all-reduce", activation_bytes, t),
    }
    return {
        "bytes_per_device": sum(terms.values()),
        "state_memory_per_device": state_bytes / n,
        **{f"bytes_{k}": v for k, v in terms.items()},
    }


def build_report(trainer: CompiledStep, batch: dict[str, Any], compile_seconds: float | None = None) -> Report:
    """The report of ``trainer``'s step compiled for batches shaped like ``batch``."""
    compiled = trainer.compile(batch)
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    if text is None or mem is None:
        raise AnalysisError("The compiled step has no HLO text or memory analysis on this backend; nothing to report.")
    abstract = trainer.abstract_state()
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
    seq = (shape[1] - 1 if "tokens" in batch else shape[1]) if len(shape) >= 2 else 1
    layers = int(info.get("layers", 0))
    # One layer's (b, s, h) activation of one tensor-parallel group, summed over microbatches.
    per_group_rows = rows / (layout_shape.get("data", 1) * layout_shape.get("fsdp", 1))
    activation = per_group_rows * seq * info.get("dim", 0) * np.dtype(trainer.precision.compute).itemsize
    bound = lower_bound(layout_shape, param_bytes, state_bytes, layers=layers, activation_bytes=activation)
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
        collectives=tuple(collective_stats(text, trainer.mesh, trainer.param_specs, abstract.params)),
        memory=memory,
        flops_per_device=hlo.dot_flops(text),
        model_flops_per_step=model_flops,
        lower_bound=bound,
        compile_seconds=compile_seconds,
    )


def sharding_warnings(trainer: CompiledStep, top: int = 3, min_fraction: float = 0.01) -> list[str]:
    """Warnings a user should see before a long run.

    - the largest parameters left fully replicated on a mesh of several devices (each at least
      ``min_fraction`` of all parameter bytes);
    - rules whose mesh axes are larger than 1 here but that shard no parameter;
    - the model's own notes (e.g. regex rules of :func:`shardkit.annotate` that matched nothing).
    """
    warnings = list(trainer.model.notes)
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
    for name, axes in trainer.rules.rules:
        live = [a for a in axes if mesh_shape.get(a, 1) > 1]
        if live and name not in used and name not in ("batch", "seq"):
            warnings.append(
                f"rule {name} -> {'+'.join(axes)} matches no parameter, so mesh axes "
                f"{', '.join(f'{a}={mesh_shape[a]}' for a in live)} shard no weights of {trainer.model.name}."
            )
    return warnings
