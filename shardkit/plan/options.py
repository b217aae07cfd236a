"""The planner's vocabulary: what a user asks for (:class:`PlanOptions`), one ranked answer
(:class:`Plan`), and a plan stopped by Ctrl-C (:class:`PlanInterrupted`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from shardkit.core.config import PlanOptions  # noqa: F401  (declared with the other configs; its home here)


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
    zero: int = 0  # ZeRO stage over the data axis

    def cli_flags(self) -> str:
        flags = f"--layout {self.layout} --microbatches {self.microbatches} --remat {self.remat}"
        return (
            flags
            + (f" --schedule {self.schedule}" if self.schedule else "")
            + (f" --zero {self.zero}" if self.zero else "")
        )


@dataclasses.dataclass(frozen=True)
class PlanResult(Mapping[str, Any]):
    """The planner's answer: the question, the ranked :class:`Plan` rows and the best one.

    Typed attributes for code; it also reads as the JSON-shaped mapping that ``shardkit plan
    --json`` prints (``result["best"]``, ``result["plans"][0]["layout"]``), via :meth:`to_dict`.

    Attributes:
      best: the layout of the fastest compiled plan that fits, or None when none fits.
      best_flags: the complete ``shardkit train`` flags of the best plan, or None.
      plans: every layout searched, ranked (compiled ones first, by predicted step time).
      memory_budget: bytes per device a plan may use (the device's memory times the headroom).
      searched, compiled: layouts enumerated, and compiled.
      seconds: the search's wall time; interrupted: stopped by Ctrl-C (a partial table).
    """

    model: str
    devices: int
    hardware: str
    batch: int
    seq: int
    precision: str
    memory_budget: float
    searched: int
    compiled: int
    interrupted: bool
    seconds: float
    best: str | None
    best_flags: str | None
    plans: tuple[Plan, ...]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (plans as dicts)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "plans": [dataclasses.asdict(p) for p in self.plans]}

    def __getitem__(self, key: str) -> Any:
        if key == "plans":
            return [dataclasses.asdict(p) for p in self.plans]
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


class PlanInterrupted(KeyboardInterrupt):
    """Ctrl-C during a plan; ``result`` holds the plans compiled so far."""

    def __init__(self, result: PlanResult):
        super().__init__("plan interrupted")
        self.result = result


def size_text(nbytes: float) -> str:
    """Bytes as GB, or MB below one GB (small models on small budgets in tests and notebooks)."""
    return f"{nbytes / 1e9:.1f} GB" if abs(nbytes) >= 1e9 else f"{nbytes / 1e6:.1f} MB"
