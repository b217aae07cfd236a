"""Dry runs past the CPU compiler's device limit: two smaller compiles and a fit in ``1/n``.

XLA's CPU backend compiles programs of at most 2048 partitions (beyond that it answers
"Multiprocess computations aren't implemented on the CPU backend"). A layout of more devices is
dry-run by compiling it twice with one batch axis (``fsdp`` or ``data``, the larger) made smaller,
``n1 < n2``, and the global batch made smaller with it, so that every device holds the rows it
holds in the full layout; the model and the other axes stay as given. Along that axis every
per-device figure of the report has the form ``a + b / n``:

- activations and the batch are the same on every device at every ``n`` (``a``);
- sharded state (parameters, gradients, optimizer state, under ``fsdp``) is ``b / n``;
- a ring collective over ``n`` devices moves ``(n - 1) / n`` of its payload, ``a + b / n``, and a
  collective over the other axes moves payloads that are ``b / n`` or constant;
- matmul FLOPs per device are the same at every ``n`` (they follow the rows).

Under ``data`` the two programs are the full layout's per-device program with smaller replica
groups, so memory and FLOPs come out exact. The two compiles fix ``a`` and ``b`` for every
number, and the full size is read off the fit; the model's FLOPs per step, a whole-batch figure,
scale with the batch instead. The result says so (``extrapolated``), and the structure of the
two programs (which collectives, how many) must agree, or the dry run refuses instead of
guessing. ``tests/test_extrapolate.py`` checks the fit against full compiles wherever those can
be made, and ``benchmarks/dryrun_extrapolate.py`` at sizes up to the limit.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from shardkit.core.errors import LayoutError
from shardkit.core.mesh import Layout

MAX_COMPILED_DEVICES = 2048  # XLA:CPU's limit on the partitions of one program
BATCH_AXES = ("fsdp", "data")  # axes whose size can shrink with the per-device shards kept in 1/n form
_WHOLE_BATCH = {"model_flops_per_step"}  # proportional to the global batch, so to n
_KEY_FIELDS = ("kind", "axes", "op", "direction", "lowered_as", "asynchronous", "crosses_hosts")
_FIXED = {"devices", "parameters", "microbatches", "count", "group_size"}  # not fitted


@dataclasses.dataclass(frozen=True)
class Shrink:
    """Compile ``axis`` at ``sizes[0]`` and ``sizes[1]`` instead of ``full``, each with the
    global batch of :meth:`batch`."""

    axis: str
    full: int
    sizes: tuple[int, int]

    def layout(self, layout: Layout, size: int) -> str:
        """``layout`` with ``axis`` resized to ``size``, as a layout string."""
        return re.sub(rf"\b{self.axis}=\d+", f"{self.axis}={size}", layout.spec())

    def batch(self, global_batch: int, size: int) -> int:
        """The global batch at ``axis=size`` that gives each device the rows it has at ``full``."""
        return global_batch * size // self.full


def shrink_plan(layout: Layout, limit: int = MAX_COMPILED_DEVICES) -> Shrink:
    """The axis to shrink and its two compiled sizes (halvings of it, both within ``limit`` devices).

    Raises:
      LayoutError: no batch axis halves enough for the rest of the layout to fit the limit.
    """
    sizes = dict(layout.sizes)
    total = layout.num_devices
    for axis in sorted((a for a in BATCH_AXES if sizes.get(a, 1) > 1), key=lambda a: -sizes[a]):
        rest = total // sizes[axis]
        n2 = sizes[axis]
        while n2 % 2 == 0 and n2 * rest > limit:
            n2 //= 2
        if n2 * rest <= limit and n2 % 2 == 0 and n2 // 2 >= 2:
            return Shrink(axis, sizes[axis], (n2 // 2, n2))
    raise LayoutError(
        f"Layout {layout.spec()} ({total:,} devices) cannot be dry-run: the CPU compiler takes at most {limit} "
        "devices, and a larger layout is extrapolated from two compiles with its fsdp or data axis halved, which "
        f"needs that axis to halve to at least 4 with the other axes within {limit // 2} devices. Fix: a layout "
        "with a larger fsdp or data axis (and smaller tensor/sequence/stage/expert axes)."
    )


def _fit(v1: float, v2: float, n1: int, n2: int, n: int) -> float:
    """``a + b / n`` through ``(n1, v1)`` and ``(n2, v2)``."""
    b = (v1 - v2) / (1 / n1 - 1 / n2)
    return v1 - b / n1 + b / n


def _key(c: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(tuple(c[k]) if isinstance(c[k], list) else c[k] for k in _KEY_FIELDS)


def extrapolate(small: dict[str, Any], large: dict[str, Any], shrink: Shrink, layout: Layout) -> dict[str, Any]:
    """The dry-run result of ``layout`` from those of the two smaller compiles.

    Args:
      small, large: dry-run results (``Report.to_dict()`` and extras) at ``shrink.sizes``, each
        compiled with the global batch ``shrink.batch(batch, size)``.
      shrink: the axis and sizes they were compiled at.
      layout: the full layout.

    Returns:
      A result shaped like theirs, for the full layout, with ``extrapolated`` saying how.
    """
    (n1, n2), n = shrink.sizes, shrink.full
    keys1 = sorted(map(_key, small["collectives"]))
    keys2 = sorted(map(_key, large["collectives"]))
    counts = {_key(c): c["count"] for c in small["collectives"]} == {_key(c): c["count"] for c in large["collectives"]}
    if keys1 != keys2 or not counts:
        raise LayoutError(
            f"Cannot extrapolate {layout.spec()}: the programs compiled with {shrink.axis}={n1} and {shrink.axis}={n2} "
            "differ in their collectives, so no fit in 1/n describes them. Dry-run a layout of at most "
            f"{MAX_COMPILED_DEVICES} devices instead."
        )

    def fitted(a: Any, b: Any, name: str) -> Any:
        if isinstance(a, dict):
            return {k: fitted(a[k], b[k], k) if k in b else a[k] for k in a}
        if isinstance(a, bool) or not isinstance(a, (int, float)) or name in _FIXED or a is None:
            return b
        if name in _WHOLE_BATCH:
            return b * n / n2
        value = _fit(float(a), float(b), n1, n2, n)
        return round(value) if isinstance(a, int) else value

    by_key = {_key(c): c for c in small["collectives"]}
    collectives = []
    for c in large["collectives"]:
        out = {k: fitted(by_key[_key(c)][k], v, k) for k, v in c.items()}
        if shrink.axis in c["axes"]:
            out["group_size"] = c["group_size"] * n // n2
        collectives.append(out)
    result = {k: fitted(small[k], v, k) if k not in ("collectives", "config") else v for k, v in large.items()}
    result["collectives"] = collectives
    result["devices"] = layout.num_devices
    result["layout"] = layout.spec()
    memory, bound = result["memory"], result["lower_bound"]
    moved = sum(c["moved_bytes"] for c in collectives)
    state = memory["params"] + memory["optimizer"] + memory["master"]
    result["ratios"] = {
        "bytes": moved / bound["bytes_per_device"] if bound["bytes_per_device"] else 0.0,
        "memory": state / bound["state_memory_per_device"],
    }
    result["compile_seconds"] = (small.get("compile_seconds") or 0.0) + (large.get("compile_seconds") or 0.0)
    result["peak_host_memory_bytes"] = max(
        small.get("peak_host_memory_bytes", 0), large.get("peak_host_memory_bytes", 0)
    )
    result["extrapolated"] = {
        "axis": shrink.axis,
        "from_layouts": [shrink.layout(layout, n1), shrink.layout(layout, n2)],
        "from_devices": [small["devices"], large["devices"]],
        "host_memory_bytes": [small.get("peak_host_memory_bytes", 0), large.get("peak_host_memory_bytes", 0)],
        "text": f"extrapolated from {small['devices']:,} and {large['devices']:,} devices "
        f"({shrink.axis}={n1} and {n2}, the same rows per device; every figure fitted as a + b/{shrink.axis})",
    }
    return result
