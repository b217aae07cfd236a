"""The report's values: a compiled step's collectives (:class:`CollectiveStat`), memory per
device (:class:`Memory`) and the whole :class:`Report` with its table and JSON form, plus the
ring formulas for bytes moved. :mod:`shardkit.analysis.report` builds them from a compiled program.

Bytes moved per device use ring algorithms on ``n`` devices for an array of ``S`` bytes:
all-reduce ``2(n-1)/n*S``; all-gather, reduce-scatter, all-to-all ``(n-1)/n*S``;
collective-permute ``S``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

_PLUMBING = {"while", "body", "closed_call", "checkpoint", "remat", "rematted_computation", "cond", ""}
_WRAPPER = re.compile(r"\b(?:jvp|transpose|jit|remat|checkpoint|vmap|pjit)\(([^()]*)\)")


# Named scope of the gradients' reduction after an accumulation loop (shardkit.training.accumulation):
# gradient traffic, though outside any transpose.
GRADIENT_REDUCTION_SCOPE = "reduce_gradients"


def source_op(op_name: str, sizes: Sequence[int] = ()) -> tuple[str, str]:
    """``(op, direction)`` of an HLO op_name, e.g. ``("layer/attn/out_proj/dot_general", "forward")``.

    A combined op (XLA's combiners join several collectives' op_names) goes the way most of its
    bytes go and is named after its largest part, given the parts' ``sizes`` (elements, one per
    part, in the op_name's order); without them, the way most of its parts go (a tie the way
    the first goes), named after the first of those.

    Example:
      >>> source_op("jit(step)/transpose(jvp())/while/body/closed_call/layer/mlp/down_proj/dot_general")
      ('layer/mlp/down_proj/dot_general', 'backward')
      >>> source_op("jit(step)/(while/body/reduce_sum:reduce_gradients/reduce_sum:reduce_gradients/reduce_sum)")
      ('reduce_gradients/reduce_sum (+2 combined)', 'backward')
      >>> source_op("jit(step)/transpose(jvp())/layer/(attn/reduce_sum:mlp/down_proj/dot_general)")
      ('layer/attn/reduce_sum (+1 combined)', 'backward')
      >>> source_op("jit(step)/(transpose(jvp(l))/q/dot_general:jvp()/reduce_sum:jvp()/reduce_sum)", [4096, 16, 16])
      ('l/q/dot_general (+2 combined)', 'backward')
    """
    combined = _combined_parts(op_name)
    directions = [_direction(part) for part in combined]
    if len(sizes) == len(combined) > 1:
        # A 2 MB input gradient combined with a dozen 4-byte norm sums is the input gradient.
        weight = {d: sum(n for n, x in zip(sizes, directions, strict=True) if x == d) for d in directions}
        direction = max(weight, key=lambda d: (weight[d], d == directions[0]))
        named = max(
            (part for part, d in zip(combined, directions, strict=True) if d == direction),
            key=lambda part: sizes[combined.index(part)],
        )
    else:
        backward = directions.count("backward")
        direction = (
            "backward"
            if 2 * backward > len(combined) or (2 * backward == len(combined) and directions[0] == "backward")
            else "forward"
        )
        named = combined[directions.index(direction)]
    body = re.sub(r"^jit\([^()]*\)/", "", named)
    while _WRAPPER.search(body):
        body = _WRAPPER.sub(r"\1", body)
    parts = [p.strip("()") for p in body.split("/")]
    op = "/".join(p for p in parts if p not in _PLUMBING) or "(unnamed)"
    if len(combined) > 1:
        op += f" (+{len(combined) - 1} combined)"
    return op, direction


def _combined_parts(op_name: str) -> list[str]:
    """The op_names of the collectives XLA combined into one: it writes their common prefix once,
    then the rest of each, joined by ":" in parentheses (``p/(a:b)`` is ``p/a`` and ``p/b``)."""
    if ":" not in op_name:
        return [op_name]
    start = op_name.find("/(")
    if start >= 0 and op_name.endswith(")") and ":" in op_name[start:]:
        prefix = op_name[: start + 1]
        return [prefix + part for part in op_name[start + 2 : -1].split(":")]
    return op_name.split(":")


def _direction(op_name: str) -> str:
    """``"backward"`` for an op of the transposed program or of the gradients' reduction."""
    scope = re.search(rf"(^|[/(]){GRADIENT_REDUCTION_SCOPE}/", op_name)
    return "backward" if "transpose(" in op_name or scope else "forward"


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
      asynchronous: compiled as a start/done pair, so it can overlap compute (GPU backends with
        :mod:`shardkit.runtime.xla_flags`; the CPU backend runs every collective synchronously).
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
    asynchronous: bool = False


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


def _reduction_line(reduction: str) -> str:
    if reduction == "once":
        return "gradients reduced once per step, after the microbatches"
    return "gradients reduced " + reduction.replace("per_microbatch", "per microbatch", 1)


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
    # With microbatches: "once" (one reduction per step), or "per_microbatch: <why>".
    gradient_reduction: str = ""
    # Collective bytes counted at the SPMD partitioner's dtypes (bf16 that the CPU compiler
    # promoted to f32 counted as bf16: what a GPU moves).
    partitioner_dtypes: bool = False

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
            "gradient_reduction": self.gradient_reduction,
            "partitioner_dtypes": self.partitioner_dtypes,
            "extras": self.extras(),
            "beyond_the_bound": [e.to_dict() for e in self.beyond()],
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
            gradient_reduction=d.get("gradient_reduction", ""),
            partitioner_dtypes=d.get("partitioner_dtypes", False),
        )

    def beyond(self) -> list[Any]:
        """What the step moves beyond the layout's bound, collective by collective, with cause and
        fix (:func:`shardkit.analysis.extras.beyond_the_bound`): at least ``measured - bound`` bytes."""
        from shardkit.analysis.extras import beyond_the_bound

        activation = self.lower_bound.get("activation_bytes", 0.0) / max(self.microbatches, 1)
        return beyond_the_bound(self.collectives, self.lower_bound, activation)

    def extras(self) -> list[str]:
        """:meth:`beyond` as the sentences the table prints, each naming the user's op."""
        return [e.line() for e in self.beyond()]

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def table(self) -> str:
        """The report as text: collectives, memory, FLOPs and the bound."""
        lines = [
            f"{self.layout} on {self.devices} {self.backend} device(s), precision {self.precision}, "
            f"microbatches {self.microbatches}, {self.parameters:,} parameters",
            *([_reduction_line(self.gradient_reduction)] if self.gradient_reduction else []),
            "",
            f"{'collective':16s} {'axes':16s} {'dir':4s} {'count':>5s} {'MB moved':>10s}  op",
        ]
        for c in sorted(self.collectives, key=lambda c: -c.moved_bytes):
            kind = c.kind + ("*" if c.lowered_as else "") + (" (async)" if c.asynchronous else "")
            axes = ("+".join(c.axes) or "-") + (" [hosts]" if c.crosses_hosts else "")
            lines.append(f"{kind:16s} {axes:16s} {c.direction[:3]:4s} {c.count:5d} {c.moved_bytes / 1e6:10.3f}  {c.op}")
        if self.partitioner_dtypes:
            lines.append(
                f"bytes at the dtypes XLA's partitioner chose (the {self.backend} compiler runs bf16 "
                "collectives in f32)"
            )
        if any(c.lowered_as for c in self.collectives):
            lines.append(f"* lowered on {self.backend} as all-reduce + dynamic-slice; GPU backends emit reduce-scatter")
        overlapped = sum(c.count for c in self.collectives if c.asynchronous)
        lines.append(
            f"asynchronous (start/done, may overlap compute): {overlapped} of {sum(c.count for c in self.collectives)}"
        )
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
        lines += _beyond_lines(self.beyond(), self.moved_bytes - self.lower_bound["bytes_per_device"])
        return "\n".join(lines)


def _beyond_lines(named: Sequence[Any], excess: float, shown_share: float = 0.01) -> list[str]:
    """The table's "beyond the bound:" section: each collective named, those under
    ``shown_share`` of the excess folded into one line (the JSON form keeps every one)."""
    if not named:
        return []
    total = sum(e.moved_bytes for e in named)
    shown = [e for e in named if e.moved_bytes >= shown_share * max(excess, total)]
    lines = ["", f"beyond the bound: {total / 1e6:.3f} MB named, {max(excess, 0.0) / 1e6:.3f} MB over the bound"]
    lines += [f"- {e.line()}" for e in shown]
    rest = [e for e in named if e not in shown]
    if rest:
        ops = ", ".join(sorted({e.op for e in rest})[:4]) + (", ..." if len({e.op for e in rest}) > 4 else "")
        lines.append(f"- and {len(rest)} smaller ({sum(e.moved_bytes for e in rest) / 1e6:.3f} MB): {ops}")
    return lines
