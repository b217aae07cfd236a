"""Host memory of CPU steps: keep each step's temporary buffers out of fresh kernel pages.

XLA:CPU allocates each execution's temporary buffer (every intermediate of the step: 212 MB per
device for the 4.3M-parameter GPT of ``benchmarks/cpu_vs_pytorch.py``) with ``posix_memalign``
and frees it when the step ends. glibc serves a request over 32 MiB (its largest mmap
threshold) with a fresh ``mmap`` and returns it with ``munmap``, so the kernel faults in and
zeroes every 4 KB page again on the next step: 103,700 page faults a step for that GPT on 2
simulated devices, about a sixth of its time. PyTorch's many smaller tensors stay under the
threshold, where glibc keeps freed memory for reuse.

Two remedies, both automatic:

- **Temporaries in heaps of at most 16 MiB, kept** (:func:`temp_heap_options` and
  :func:`keep_heaps`, in the process, for every script and notebook). XLA's option
  ``xla_multiheap_size_constraint_per_heap`` splits the temporary buffer into heaps of at most
  that size, each under glibc's threshold, so glibc serves them from its own heaps (8,000-16,000
  faults a step for that GPT, and the step 13-19% faster); asked with ``mallopt`` not to trim or
  unmap those heaps when they are free, it faults in none of them again after the first steps
  (a few hundred faults a step, 3-7% faster again). A buffer larger than a heap would get a
  heap of its own and share its memory with no other (a 4-layer gpt2-small under ``fsdp=8``:
  637 MB of temporaries became 1,080 MB), so a program holding an array over 16 MiB keeps XLA's
  single heap; one whose temporaries fit under the threshold whole needs no split, only the
  kept heaps. The :class:`~shardkit.Trainer` compiles a step it splits twice.
- **Huge pages** (:func:`with_huge_pages`, for the processes shardkit starts). glibc's tunable
  ``glibc.malloc.hugetlb=1`` makes it ask for transparent huge pages
  (``madvise(MADV_HUGEPAGE)``) on what it maps: about 1,000 faults a step, and the memory still
  goes back to the kernel on free. Tunables are read when a process starts, so the ``shardkit``
  command restarts itself once with it (:func:`restart_with_huge_pages`), and the launcher, the
  benchmarks and the tests pass it on. It covers the programs the heaps cannot: those with
  large arrays.

Asking glibc instead to put every buffer, however large, in one heap (``mallopt``: one arena, no
``mmap``, no trimming) avoided the faults too, but fragmented: ``fsdp=8`` on a 4-layer
gpt2-small grew to 20 GB resident over 12 steps against 7 GB. :func:`keep_heaps` leaves buffers
of 32 MiB or more to ``mmap`` and the arenas as they are: the same gpt2-small stays at 7.0-7.2 GB
with it.

``SHARDKIT_HOST_ALLOCATOR`` chooses: ``auto`` (the default: the heaps on the CPU, and huge pages
when JAX can only compute on the CPU and the kernel gives huge pages on request),
``huge_pages`` (also with an accelerator installed) or ``system`` (neither: XLA's single heap,
glibc's settings and the environment as they are).

Example:
  >>> with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, mode="huge_pages")["GLIBC_TUNABLES"]
  'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1'
  >>> temp_heap_options("cpu", temp_bytes=212 * 2**20, largest_array_bytes=16 * 2**20, environ={})
  {'xla_multiheap_size_constraint_per_heap': 16777216}
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pathlib
import platform as platform_module
import sys
from collections.abc import Mapping

from shardkit.core.errors import InputError

ENV = "SHARDKIT_HOST_ALLOCATOR"
MODES = ("auto", "huge_pages", "system")
TUNABLE = "glibc.malloc.hugetlb=1"
_HUGETLB = "glibc.malloc.hugetlb="
THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


# glibc maps anything over its mmap threshold afresh and unmaps it on free; the threshold
# follows the largest buffer freed so far, up to this (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit).
GLIBC_REUSE_LIMIT = 32 * 2**20
# Half of it: the heaps stay under the threshold with their headers, and a heap is a fifth of
# the GPT's temporaries or less. 16 MiB ran 376-382 ms a step there, 4 and 8 MiB 410-413 (more
# heaps, more faults), 24 and 30 MiB 405-427.
HEAP_LIMIT = 16 * 2**20
HEAP_OPTION = "xla_multiheap_size_constraint_per_heap"
# mallopt's parameters (glibc's malloc.h) and what keep_heaps sets them to: the mmap threshold
# fixed at its largest (setting the pad turns its adjustment off), and a pad larger than a
# thread's heap (64 MiB), so that no heap is trimmed or unmapped when its top is free.
M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3
TOP_PAD = 64 * 2**20
_heaps_kept = False


def requested_mode(environ: Mapping[str, str] = os.environ) -> str:
    """The mode ``SHARDKIT_HOST_ALLOCATOR`` asks for (``auto`` when unset).

    Raises:
      InputError: the variable holds something else.
    """
    mode = environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise InputError(
            f"{ENV}={environ[ENV]!r}: choose one of {', '.join(MODES)} (auto splits a CPU step's temporaries into "
            "heaps glibc keeps, and asks for huge pages when JAX can only compute on the CPU; system does neither)."
        )
    return mode


def jax_is_cpu_only(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether JAX, once started, can only compute on the CPU: ``JAX_PLATFORMS=cpu``, or no GPU or
    TPU plugin installed. Reads package metadata only; JAX is not imported."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms == ["cpu"]
    if importlib.metadata.entry_points(group="jax_plugins"):  # PJRT plugins: jax-cuda*-plugin, ...
        return False
    return not any(importlib.util.find_spec(name) is not None for name in ("jax_plugins", "libtpu"))


def huge_pages_on_request() -> bool:
    """Whether this kernel gives transparent huge pages to memory that asks (``madvise``), and only
    to that: where it gives them to all memory (``always``) or none, the tunable changes nothing."""
    try:
        return "[madvise]" in THP_SETTING.read_text()
    except OSError:  # not Linux, or no transparent huge pages
        return False


def with_huge_pages(environ: Mapping[str, str] = os.environ, mode: str | None = None) -> dict[str, str]:
    """A copy of ``environ`` in which a process started with it maps its large host buffers in huge
    pages, as ``mode`` asks (None reads ``SHARDKIT_HOST_ALLOCATOR`` from ``environ``).

    Raises:
      InputError: ``mode`` (or the variable) is not one of ``MODES``.
    """
    env = dict(environ)
    mode = requested_mode(env) if mode is None else mode
    if mode not in MODES:
        raise InputError(f"with_huge_pages(mode={mode!r}): choose one of {', '.join(MODES)}.")
    if mode == "system" or (mode == "auto" and not (jax_is_cpu_only(env) and huge_pages_on_request())):
        return env
    tunables = _tunables(env)
    if not any(t.startswith(_HUGETLB) for t in tunables):  # the user's own value stands
        env["GLIBC_TUNABLES"] = ":".join([*tunables, TUNABLE])
    return env


def without_huge_pages(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` without any ``glibc.malloc.hugetlb`` tunable: glibc's defaults (the
    comparison the benchmarks make)."""
    env = dict(environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in _tunables(env) if not t.startswith(_HUGETLB))
    return env


def _tunables(environ: Mapping[str, str]) -> list[str]:
    """The ``name=value`` entries of ``GLIBC_TUNABLES``."""
    return [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]


def restart_with_huge_pages() -> None:
    """Restart this Python process with the same arguments and :func:`with_huge_pages`'s
    environment, when that adds the tunable; return otherwise. Call first thing, before any
    thread or file exists that the restart would lose (the ``shardkit`` command does)."""
    if not sys.platform.startswith("linux"):
        return
    env = with_huge_pages()
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def temp_heap_options(
    platform: str, temp_bytes: int, largest_array_bytes: int, environ: Mapping[str, str] = os.environ
) -> dict[str, int]:
    """The compiler option that splits a step's temporary buffer into heaps glibc keeps between
    steps (see the module's docstring), or ``{}`` where it would not pay: off the CPU, where the
    temporaries fit under glibc's threshold whole (``temp_bytes``), where an array is larger
    than a heap (``largest_array_bytes``, e.g. from
    :func:`shardkit.analysis.hlo.largest_array_bytes`), or under ``SHARDKIT_HOST_ALLOCATOR=system``.

    Raises:
      InputError: ``SHARDKIT_HOST_ALLOCATOR`` holds something else than one of ``MODES``.
    """
    if requested_mode(environ) == "system" or platform != "cpu":
        return {}
    if temp_bytes <= GLIBC_REUSE_LIMIT or largest_array_bytes > HEAP_LIMIT:
        return {}
    return {HEAP_OPTION: HEAP_LIMIT}


def keep_heaps(environ: Mapping[str, str] = os.environ) -> bool:
    """Ask glibc, in this process, to keep its heaps mapped when their top is free, so that a
    step's heaps of temporaries (:func:`temp_heap_options`) are not given back to the kernel
    between steps and faulted in again. Called by the :class:`~shardkit.Trainer` when it compiles
    a step with those heaps; idempotent.

    glibc unmaps a thread's heap (64 MiB) whose memory is all free, and trims the free top of a
    heap beyond its pad: on 2 simulated devices, the benchmark's GPT still took 8,000-16,000
    page faults a step from that. With the pad at 64 MiB (``mallopt(M_TOP_PAD)``) and the mmap
    threshold at its largest, 32 MiB (``M_MMAP_THRESHOLD``, which the pad would otherwise
    freeze where it stands), a step takes a few hundred. Memory a step freed stays resident for
    the next, as in XLA's own allocators on accelerators; buffers of 32 MiB or more are still
    mapped and unmapped each time. Nothing is changed off glibc, or under
    ``SHARDKIT_HOST_ALLOCATOR=system``.

    Returns:
      whether glibc now keeps its heaps (True also when an earlier call set it).

    Raises:
      InputError: ``SHARDKIT_HOST_ALLOCATOR`` holds something else than one of ``MODES``.

    Example:
      >>> keep_heaps({"SHARDKIT_HOST_ALLOCATOR": "system"})  # XLA's single heap, glibc's defaults
      False
    """
    global _heaps_kept
    if requested_mode(environ) == "system":
        return False
    if _heaps_kept:
        return True
    if not sys.platform.startswith("linux") or platform_module.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _heaps_kept = mallopt(M_MMAP_THRESHOLD, GLIBC_REUSE_LIMIT) == 1 and mallopt(M_TOP_PAD, TOP_PAD) == 1
    return _heaps_kept
