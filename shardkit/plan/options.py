"""The planner's vocabulary: what a user asks for (:class:`PlanOptions`), one ranked answer
(:class:`Plan`), and a plan stopped by Ctrl-C (:class:`PlanInterrupted`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardkit.config import PlanOptions  # noqa: F401  (declared with the other configs; its home here)


@dataclasses.dataclass
class Plan:
    """One layout: the remat and microbatches that first fit, and its predictions.

    ``compiled``: whether the predictions come from a compiled step; a layout pruned by the
    analytic estimate has only ``estimated_*`` figures and ``fits`` says what the estimate says.
    """

    layout: str
    microbatches: int
    remat: str
    fits: bool
    memory_per_device: float
    bytes_by_axes: dict[str, float]
    # Predictions from the compiled step: None for a plan that was not compiled.
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    predicted_step_seconds: float | None = None  # compute then communication, no overlap
    predicted_step_seconds_overlap: float | None = None  # perfect overlap: the larger of the two
    predicted_mfu: float | None = None
    note: str = ""
    schedule: str | None = None
    compiled: bool = True
    estimated_step_seconds: float | None = None
    estimated_memory: float | None = None

    def cli_flags(self) -> str:
        flags = f"--layout {self.layout} --microbatches {self.microbatches} --remat {self.remat}"
        return flags + (f" --schedule {self.schedule}" if self.schedule else "")


class PlanInterrupted(KeyboardInterrupt):
    """Ctrl-C during a plan; ``result`` holds the plans compiled so far."""

    def __init__(self, result: dict[str, Any]):
        super().__init__("plan interrupted")
        self.result = result


def size_text(nbytes: float) -> str:
    """Bytes as GB, or MB below one GB (small models on small budgets in tests and notebooks)."""
    return f"{nbytes / 1e9:.1f} GB" if abs(nbytes) >= 1e9 else f"{nbytes / 1e6:.1f} MB"
