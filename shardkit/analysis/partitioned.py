"""Collective bytes at the dtype XLA's SPMD partitioner chose.

XLA's CPU compiler cannot reduce or gather bf16: after partitioning, its passes
(``all-reduce-promotion``, ``float-normalization-bf16``) rewrite those collectives in f32, so
the compiled program moves twice the bytes a GPU's would. The module as the partitioner left it
still says bf16. :func:`dump_options` asks XLA to write that module during a compile (about
7 MB of files for a small model, in a directory the caller deletes), :func:`read` finds it, and
:func:`at_partitioner_dtypes` counts each compiled collective's elements at the size the
partitioner gave them.

JAX's persistent compilation cache (``jax_compilation_cache_dir``, which many users set) leaves
the dump options out of its key: a program compiled before is loaded from the cache, nothing is
compiled and nothing is dumped. The dump compile therefore also sets a debug option that is in
the key and changes nothing but dumps (:data:`CACHE_MISS`), and runs under :func:`uncached`, so
it is neither read from nor written to that cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
from collections.abc import Iterable, Iterator

import jax

from shardkit.analysis import hlo

_PASS = "spmd-partitioning"

# In the persistent cache's key (unlike the xla_dump_to family) and about dumps only, so a
# compile that carries it never matches an entry written by an ordinary compile.
CACHE_MISS = {"xla_dump_large_constants": True}


def dump_options(directory: str | pathlib.Path) -> dict[str, str | bool]:
    """Compiler options that write the module after SPMD partitioning into ``directory``."""
    return {"xla_dump_to": str(directory), "xla_dump_hlo_pass_re": _PASS, "xla_dump_hlo_as_text": True, **CACHE_MISS}


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Within this context, compiles are not written to JAX's persistent compilation cache.

    A dump compile's entry would be found by the next dump compile of the same program, which
    would then load it and write no dump. JAX writes only compiles that took at least
    ``jax_persistent_cache_min_compile_time_secs``; this raises that threshold out of reach
    (a process-wide setting: another thread compiling meanwhile is not cached either).
    """
    if not jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]  # JAX registers its flags at run time
        yield
        return
    before = jax.config.jax_persistent_cache_min_compile_time_secs  # type: ignore[attr-defined]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


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
