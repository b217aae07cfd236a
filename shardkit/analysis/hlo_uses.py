"""Who uses a compiled collective's result, and how: the patterns by which the CPU backend spells
a reduce-scatter (an all-reduce whose result each device only slices).

On CPU a reduce-scatter is lowered as an all-reduce followed by a dynamic-slice by partition-id;
inside a layer scan the slice happens after the loop, on the stacked gradient; and XLA often
fuses the slice into whatever consumes it. :func:`sliced_results` finds all three, so that the
report can name the collective it stands for.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Callable

from shardkit.analysis.hlo import CALLS, Instruction, Program, array_dims, as_program


def sliced_results(hlo: str | Program) -> tuple[set[str], set[str], dict[str, int]]:
    """Instructions some result (tuple element) of which feeds a per-device slice; those whose
    results are written into a per-layer slot of a stacked buffer (a scanned layer); and the
    all-reduces whose every use is a per-device slice, with the number of parts each is cut into.

    On CPU a reduce-scatter is lowered as an all-reduce followed by a dynamic-slice by
    partition-id; inside a layer scan the slice happens after the loop, on the stacked gradient.
    An all-reduce used only through per-device slices of one part in its group size is a
    reduce-scatter whatever it reduces (an activation's, under sequence parallelism).
    """
    program = as_program(hlo)
    users: dict[str, list[Instruction]] = collections.defaultdict(list)
    bodies: dict[str, list[Instruction]] = collections.defaultdict(list)
    elements: dict[str, str] = {}
    for ins in program.instructions:
        bodies[ins.computation].append(ins)
        if ins.opcode == "get-tuple-element":
            elements[ins.name] = ins.references[0] if ins.references else ""
        for used in ins.references:
            users[used].append(ins)

    def through_converts(found: list[Instruction]) -> list[Instruction]:
        """The users, and the users of those that only convert the dtype (on CPU the reduced
        gradient is converted back to bf16 before it is sliced into its stacked slot)."""
        out, todo = [], list(found)
        while todo:
            u = todo.pop()
            out.append(u)
            if u.opcode == "convert" or (u.opcode == "fusion" and u.name.startswith("wrapped_convert")):
                todo.extend(users.get(u.name, []))
        return out

    def sources_with_a_user(test: Callable[[Instruction], bool]) -> set[str]:
        return {
            elements.get(name, name) for name, found in users.items() if any(test(u) for u in through_converts(found))
        }

    # A per-device slice of the reduced result, even if the full result also feeds something
    # (CPU computes the gradient norm from it), marks the reduce-scatter pattern.
    # The text of the user, not its opcode: on CPU the slice is often inside a fusion whose name
    # or called computation says so.
    per_device = lambda u: "partition-id" in u.line or "dynamic-slice" in u.line
    sliced = sources_with_a_user(per_device)
    stacked = sources_with_a_user(lambda u: "dynamic-update-slice" in u.line)
    program_shapes = {ins.name: ins.shape for ins in program.instructions}

    def share(u: Instruction, name: str) -> int:
        """Into how many parts ``u`` cuts ``name`` to take one (0: ``u`` uses it whole)."""
        whole = math.prod(array_dims(program_shapes[name]))
        if u.opcode == "dynamic-slice" and u.references[:1] == (name,):
            return whole // max(math.prod(array_dims(u.shape)), 1)
        callee = CALLS.search(u.line)
        operands = [r for r in u.references if r not in bodies]
        if u.opcode != "fusion" or callee is None or name not in operands:
            return 0
        part = _sliced_parameter(bodies[callee["callee"]], operands.index(name))
        return whole // part if part else 0

    reduced = [ins.name for ins in program.instructions if ins.opcode == "all-reduce" and not ins.shape.startswith("(")]
    shares = {name: min(share(u, name) for u in users[name]) for name in reduced if users.get(name)}
    return sliced, stacked, {name: parts for name, parts in shares.items() if parts > 1}


_PARAMETER = re.compile(r"\bparameter\((?P<index>\d+)\)")
# Operations that pass an operand through element by element (or only reshape it).
_ELEMENTWISE = frozenset(
    {"bitcast", "reshape", "copy", "transpose", "convert", "select", "add", "subtract", "multiply", "divide"}
    | {"maximum", "minimum", "negate", "abs", "exponential", "log", "compare", "and", "or", "not", "clamp"}
)


def _sliced_parameter(body: list[Instruction], index: int) -> int:
    """Elements of the largest per-device ``dynamic-slice`` through which a fused computation
    uses its parameter ``index`` (after element-by-element operations); 0 if it uses it whole."""
    held: set[str] = set()
    part = 0
    for ins in body:
        m = _PARAMETER.search(ins.line) if ins.opcode == "parameter" else None
        if m and int(m["index"]) == index:
            held.add(ins.name)
            continue
        if not held.intersection(ins.references):
            continue
        if ins.opcode == "dynamic-slice" and ins.references[0] in held:
            part = max(part, math.prod(array_dims(ins.shape)))
        elif ins.opcode in _ELEMENTWISE:
            held.add(ins.name)
        else:  # used whole: a reduction, a matmul, ...
            return 0
        if ins.line.lstrip().startswith("ROOT") and ins.name in held:
            return 0
    return part
