"""Collective bytes at the dtype XLA's SPMD partitioner chose.

XLA's CPU compiler cannot reduce or gather bf16: after partitioning, its passes
(``all-reduce-promotion``, ``float-normalization-bf16``) rewrite those collectives in f32, so
the compiled program moves twice the bytes a GPU's would. The module as the partitioner left it
still says bf16. :func:`dump_options` asks XLA to write that module during a compile (about
7 MB of files for a small model, in a directory the caller deletes), :func:`read` finds it, and
:func:`at_partitioner_dtypes` counts each compiled collective's elements at the size the
partitioner gave them.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Iterable

from shardkit import hlo

_PASS = "spmd-partitioning"


def dump_options(directory: str | pathlib.Path) -> dict[str, str | bool]:
    """Compiler options that write the module after SPMD partitioning into ``directory``."""
    return {"xla_dump_to": str(directory), "xla_dump_hlo_pass_re": _PASS, "xla_dump_hlo_as_text": True}


def read(directory: str | pathlib.Path) -> str | None:
    """The text of the train step's module after SPMD partitioning, from a dump (None if absent)."""
    found = sorted(pathlib.Path(directory).glob(f"*jit_step*after_{_PASS}*.txt"))
    return found[-1].read_text() if found else None


def element_sizes(partitioned: str) -> dict[tuple[str, tuple[int, ...]], set[float]]:
    """``(kind, dims) -> {bytes per element}`` of every collective result array in ``partitioned``."""
    sizes: dict[tuple[str, tuple[int, ...]], set[float]] = {}
    for c in hlo.collectives(partitioned):
        for dtype, dims in _arrays(c.line, c.kind):
            sizes.setdefault((c.kind, dims), set()).add(hlo.element_bytes(dtype))
    return sizes


def at_partitioner_dtypes(collectives: Iterable[hlo.Collective], partitioned: str) -> list[hlo.Collective]:
    """``collectives`` with each result array counted at the partitioner's element size where it
    chose a smaller one for every array of that kind and shape (bf16 promoted to f32 on CPU)."""
    sizes = element_sizes(partitioned)
    out = []
    for c in collectives:
        payload = 0.0
        for dtype, dims in _arrays(c.line, c.kind):
            compiled = hlo.element_bytes(dtype)
            chosen = sizes.get((c.kind, dims))
            size = max(chosen) if chosen and max(chosen) < compiled else compiled
            payload += size * math.prod(dims)
        out.append(dataclasses.replace(c, payload_bytes=int(payload)))
    return out


def _arrays(line: str, kind: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of a collective's result arrays, from its instruction text."""
    m = hlo.INSTRUCTION.match(line)
    return hlo.result_arrays(m["shape"], kind, bool(m["start"])) if m else []
