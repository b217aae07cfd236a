"""Read the collectives out of compiled HLO text, and tie each to mesh axes and a user op.

The compiled module prints each collective as one instruction, e.g.::

  %all-reduce.48 = f32[4,32,64]{2,1,0} all-reduce(%x), replica_groups=[2,4]<=[8], ...,
      metadata={op_name="jit(step)/.../bthk,hkd->btd/dot_general" ...}

Replica groups come in three spellings (explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` with an
optional transpose ``T(1,0)``, and Shardy's ``mesh['axis_0'=4,...] {'axis_0'}``); all are
expanded to lists of device ids, and the mesh axes a collective runs over are the axes along
which the devices of one group differ.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from shardkit.core.errors import AnalysisError

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\("
)
_ARRAY = re.compile(
    r"\b(?P<dtype>pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8\w*|bf16|f16|f32|f64|c64|c128)\[(?P<dims>[\d,]*)\]"
)
_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
# The instruction pattern, for modules read elsewhere (shardkit.analysis.partitioned).
INSTRUCTION = _INSTRUCTION
_OP_NAME = re.compile(r'op_name="(?P<op>[^"]*)"')
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*\{(?P<over>[^}]*)\}"
)
_SUB_AXIS = re.compile(r"'?(?P<name>[^':]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?$")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>(?:\{\d+,\d+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled module.

    Attributes:
      kind: one of ``COLLECTIVE_KINDS``.
      name: the HLO instruction name.
      payload_bytes: bytes of the result on one device.
      groups: device ids of each replica group (empty when the HLO gave none).
      op_name: the JAX op it comes from (HLO metadata), e.g. ``.../bthk,hkd->btd/dot_general``.
      line: the instruction text.
      executions: how many times one step runs it (trip counts of the while loops around it,
        e.g. the layer scan).
    """

    kind: str
    name: str
    payload_bytes: int
    groups: tuple[tuple[int, ...], ...]
    op_name: str
    line: str
    executions: int = 1
    shapes: tuple[tuple[int, ...], ...] = ()  # result array shape(s); several for a combined op
    asynchronous: bool = False  # a ``-start`` of a start/done pair: it may overlap compute

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 0


def element_bytes(dtype: str) -> float:
    """Bytes of one element of an HLO dtype (``bf16`` -> 2, ``f8e4m3fn`` -> 1, ``s4`` -> 0.5)."""
    return _BYTES.get(dtype.rstrip("0123456789fnuz") if dtype.startswith("f8") else dtype, 1)


def result_arrays(shape: str, kind: str, is_start: bool) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of each result array of a collective whose shape text is ``shape``."""
    arrays = [(m["dtype"], tuple(int(x) for x in m["dims"].split(",") if x)) for m in _ARRAY.finditer(shape)]
    if is_start and kind in ("all-gather", "collective-permute") and len(arrays) > 1:
        arrays = arrays[len(arrays) // 2 :]  # async start: (operands..., results...)
    return arrays


def _shape_bytes(shape: str, kind: str, is_start: bool) -> int:
    return int(sum(element_bytes(d) * math.prod(dims) for d, dims in result_arrays(shape, kind, is_start)))


def _iota(shape: Sequence[int], dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    if perm is not None:
        ids = ids.transpose(perm)
    return ids.reshape(shape)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _groups(line: str, kind: str) -> tuple[tuple[int, ...], ...]:
    if m := _MESH_GROUPS.search(line):
        sizes = [int(p.split("=")[1]) for p in m["axes"].split(",") if "=" in p]
        names = [p.split("=")[0].strip().strip("'") for p in m["axes"].split(",") if "=" in p]
        if m["ids"]:
            im = re.match(r"\[(?P<shape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?", m["ids"].strip())
            if im is None:
                raise HloFormatError(f"Cannot read the device ids of a Shardy mesh: {m['ids']!r}")
            ids = _iota([math.prod(sizes)], _ints(im["shape"]), _ints(im["perm"]) if im["perm"] else None)
        else:
            ids = np.arange(math.prod(sizes))
        # Each group varies the named axes, or a sub-axis: 'x':(p)s is the size-s factor of x
        # after its first p (x = p x s x the rest, major to minor).
        refs = []
        for entry in (a.strip() for a in m["over"].split(",") if a.strip()):
            ref = _SUB_AXIS.match(entry)
            if ref is None or ref["name"] not in names:
                raise HloFormatError(f"Cannot read a Shardy replica group's axis: {entry!r}")
            refs.append((names.index(ref["name"]), int(ref["pre"]) if ref["pre"] else None, ref["size"]))
        factors: list[int] = []
        position: dict[tuple[int, int | None], int] = {}
        for i, size in enumerate(sizes):
            subs = [(pre, int(sub)) for j, pre, sub in refs if j == i and pre is not None]
            if len(subs) > 1:
                raise HloFormatError(f"Cannot read a replica group over two parts of one axis: {m['over']!r}")
            if subs:
                ((pre, sub),) = subs
                position[(i, pre)] = len(factors) + 1
                factors += [pre, sub, size // (pre * sub)]
            else:
                position[(i, None)] = len(factors)
                factors.append(size)
        ids = ids.reshape(factors)
        over = [position[(i, pre)] for i, pre, _ in refs]
        rest = [k for k in range(len(factors)) if k not in over]
        grouped = ids.transpose(rest + over).reshape(-1, math.prod(factors[k] for k in over) if over else 1)
        return tuple(tuple(int(x) for x in g) for g in grouped)
    if m := _IOTA_GROUPS.search(line):
        return tuple(
            tuple(int(x) for x in g)
            for g in _iota(_ints(m["shape"]), _ints(m["dims"]), _ints(m["perm"]) if m["perm"] else None)
        )
    if m := _EXPLICIT_GROUPS.search(line):
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", m["groups"]))
    if kind == "collective-permute" and (m := _PAIRS.search(line)):
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{([\d,\s]*)\}", m["pairs"]))
    return ()


_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*?body=%(?P<body>[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CALLS = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%(?P<callee>[\w.\-]+)")


def _executions(lines: Sequence[str]) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation."""
    callers: dict[str, list[tuple[str, int]]] = {}
    entry, current = "", ""
    for line in lines:
        if m := _COMPUTATION.match(line):
            current = m["name"]
            if m["entry"]:
                entry = current
            continue
        # Substring tests first: the regexes would scan every instruction's line (a 70B step's
        # module has ~30,000), and few lines call anything.
        if "while(" in line and (m := _WHILE.search(line)):
            trip = _TRIP.search(line)
            callers.setdefault(m["body"], []).append((current, int(trip["n"]) if trip else 1))
        if "=%" in line:
            for m in _CALLS.finditer(line):
                callers.setdefault(m["callee"], []).append((current, 1))
    memo: dict[str, int] = {entry: 1}

    def runs(name: str, seen: frozenset[str] = frozenset()) -> int:
        if name not in memo:
            memo[name] = sum(runs(c, seen | {name}) * n for c, n in callers.get(name, []) if c not in seen) or 1
        return memo[name]

    return {name: runs(name) for name in {*callers, entry}}


_ANY_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+(?P<opcode>[a-z][\w\-]*)\(")
_REFERENCE = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a compiled module.

    Attributes:
      name: its HLO name (``all-reduce.48``).
      computation: the computation it belongs to.
      shape: its result shape text (``f32[4,32]{1,0}``, or a tuple of them).
      opcode: ``dot``, ``all-reduce``, ``custom-call``, ``while``, ...
      references: names it refers to after the ``=``: operands and called computations.
      line: the instruction's text.
    """

    name: str
    computation: str
    shape: str
    opcode: str
    references: tuple[str, ...]
    line: str


@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled module, parsed once: its instructions in order, and how many times each
    computation runs per execution of the entry computation (loop trip counts multiplied out)."""

    instructions: tuple[Instruction, ...]
    executions: dict[str, int]
    computations: int

    def runs(self, instruction: Instruction) -> int:
        """How many times one execution of the module runs ``instruction``."""
        return self.executions.get(instruction.computation, 1)


@functools.lru_cache(maxsize=8)
def parse(hlo_text: str) -> Program:
    """The typed view of ``compiled.as_text()`` that every figure of the report is read from.

    Raises:
      HloFormatError: text in which neither a computation nor an instruction is recognised.
    """
    lines = hlo_text.splitlines()
    instructions, current, computations = [], "", 0
    for line in lines:
        if c := _COMPUTATION.match(line):
            current, computations = c["name"], computations + 1
            continue
        if m := _ANY_INSTRUCTION.match(line):
            refs = tuple(_REFERENCE.findall(line[m.end("shape") :]))
            instructions.append(Instruction(m["name"], current, m["shape"], m["opcode"], refs, line))
    if any(line.strip() for line in lines) and not computations and not instructions:
        raise HloFormatError("No HLO computation found in the text: is it compiled.as_text() of an XLA module?")
    return Program(tuple(instructions), _executions(lines), computations)


def _program(hlo: str | Program) -> Program:
    return hlo if isinstance(hlo, Program) else parse(hlo)


def collectives(hlo: str | Program) -> list[Collective]:
    """Every collective instruction of a compiled module (its text, ``compiled.as_text()``, or
    its :func:`parse`-d program)."""
    program = _program(hlo)
    out = []
    for ins in program.instructions:
        m = _INSTRUCTION.match(ins.line) if ins.opcode.removesuffix("-start") in COLLECTIVE_KINDS else None
        if not m:
            continue
        kind = m["kind"]
        op = _OP_NAME.search(ins.line)
        out.append(
            Collective(
                kind=kind,
                name=m["name"],
                payload_bytes=_shape_bytes(m["shape"], kind, bool(m["start"])),
                groups=_groups(ins.line, kind),
                op_name=op["op"] if op else "",
                line=ins.line.strip(),
                executions=program.runs(ins),
                shapes=tuple(tuple(int(x) for x in a["dims"].split(",") if x) for a in _ARRAY.finditer(m["shape"])),
                asynchronous=bool(m["start"]),
            )
        )
    return out


# GPU backends rewrite matmuls into library calls: cuBLAS (``__cublas$gemm``, ``__cublas$lt$matmul``)
# and hipBLAS; their dimension numbers sit in the backend config.
_GEMM_TARGET = re.compile(
    r'custom_call_target="(?:__cublas\$gemm|__cublas\$lt\$matmul\w*|__hipblas\$gemm\w*|__hipblaslt\$\w*)"'
)
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(x) for x in m["dims"].split(",") if x] if m else []


class HloFormatError(AnalysisError):
    """The compiled program's text is not in a form this parser recognises (so its figures would
    be wrong, not zero)."""


def dot_flops(hlo: str | Program) -> float:
    """FLOPs of every matmul one execution of the module runs on one device.

    ``2 * prod(result dims) * prod(contracted dims)`` per ``dot`` and per GPU library matmul
    (``__cublas$gemm`` and kin, whose dimension numbers are in the backend config), times the
    trip counts of the loops around it. XLA's own ``cost_analysis()`` counts a while-loop body
    once, which undercounts a scanned layer stack by the number of layers; this does not.

    Raises:
      HloFormatError: when the text has matmuls or loops but none is understood (a changed
        text format), instead of returning a silent 0 or counting loops once.
    """
    program = _program(hlo)
    shapes: dict[tuple[str, str], list[int]] = {}
    total, matmuls, unread = 0.0, 0, 0
    for ins in program.instructions:
        shapes[ins.computation, ins.name] = _dims(ins.shape)
        library = ins.opcode == "custom-call" and ("__cublas" in ins.line or "__hipblas" in ins.line)
        if ins.opcode != "dot" and not library:
            continue
        contracting = (_CONTRACTING if ins.opcode == "dot" else _GEMM_CONTRACTING).search(ins.line)
        lhs = shapes.get((ins.computation, ins.references[0])) if ins.references else None
        if lhs is None or contracting is None or (library and not _GEMM_TARGET.search(ins.line)):
            unread += 1
            continue
        k = math.prod(lhs[int(i.strip().strip('"'))] for i in contracting["dims"].split(",") if i.strip())
        total += 2.0 * math.prod(_dims(ins.shape)) * k * program.runs(ins)
        matmuls += 1
    text = hlo if isinstance(hlo, str) else ""
    if not matmuls and (unread or " dot(" in text or "__cublas" in text or "__hipblas" in text):
        raise HloFormatError("The program has matmuls, but none could be read (has XLA's HLO text format changed?).")
    loops = [i for i in program.instructions if i.opcode == "while"]
    if (loops or " while(" in text) and not any(_TRIP.search(i.line) for i in loops):
        raise HloFormatError("The program has loops, but no trip count could be read: loop bodies would count once.")
    return total


def mesh_axes_of(groups: Sequence[Sequence[int]], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which the devices of a replica group differ (in mesh order).

    Device ids in HLO replica groups index ``mesh.devices`` in flat order, as the compiled
    module's device assignment does for a jit over that mesh.
    """
    if not groups:
        return ()
    coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), axis=1)
    varying: set[int] = set()
    for group in groups:
        g = coords[list(group)]
        varying.update(int(i) for i in np.nonzero((g != g[0]).any(axis=0))[0])
    return tuple(mesh.axis_names[i] for i in sorted(varying))


def count(hlo: str | Program) -> dict[str, int]:
    """Number of collectives of each kind run by one step (loop trip counts included)."""
    found = collectives(hlo)
    return {k: sum(c.executions for c in found if c.kind == k) for k in COLLECTIVE_KINDS}


def largest_array_bytes(hlo: str | Program) -> int:
    """Bytes of the largest array any instruction of a compiled module produces on one device
    (each element of a tuple counted alone; 0 for a module without arrays). An upper bound on
    its largest buffer: instructions inside fusions are counted too, though they get none.

    Example:
      >>> largest_array_bytes("ENTRY %main {\\n  %p = f32[256,128]{1,0} parameter(0)\\n}")
      131072
    """
    sizes = (
        element_bytes(m["dtype"]) * math.prod(int(x) for x in m["dims"].split(",") if x)
        for instruction in _program(hlo).instructions
        for m in _ARRAY.finditer(instruction.shape)
    )
    return int(max(sizes, default=0))


# For the readers of instructions' uses (shardkit.analysis.hlo_uses).
CALLS, as_program, array_dims = _CALLS, _program, _dims
