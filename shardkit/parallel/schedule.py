"""Pipeline schedules: which stage runs which microbatch, forward or backward, at each tick.

A schedule is a static table computed in Python before anything is traced. The pipeline runs
in lock step: at every tick each stage has a forward slot, a backward slot, or both (the tick's
*kind*, the same for all stages), and fills each slot with a microbatch or leaves it idle (a
bubble). Between ticks activations move one stage down the pipeline and gradients one stage up.

Timing rules every schedule obeys (checked by :meth:`Schedule.check`): the forward of
microbatch ``i`` on stage ``s`` runs one tick after it ran on stage ``s - 1``; its backward on
stage ``s`` runs one tick after it ran on stage ``s + 1``; on the last stage the backward may
share the forward's tick (the forward slot runs first).

- ``gpipe`` (Huang et al. 2019): all forwards, then all backwards; ``2(m + p - 1)`` ticks of one
  slot each; every stage holds the inputs of all ``m`` microbatches.
- ``1f1b`` (PipeDream-flush, Narayanan et al. 2021): ``p - 1`` forward-only ticks, ``m`` ticks of
  one forward and one backward, ``p - 1`` backward-only ticks; the same time as GPipe, but a
  microbatch's backward follows its forward as soon as possible, so stage ``s`` holds at most
  ``2(p - s) - 1`` microbatches, however large ``m`` is. (Asynchronous 1F1B holds ``p - s``: there a
  hop between stages costs half a forward-plus-backward, here a lock-step tick.)

Both have the bubble ``(p - 1) / (m + p - 1)`` of the step for any forward and backward costs.

Example:
  >>> s = make_schedule("1f1b", stages=4, microbatches=8)
  >>> s.ticks, s.stash, round(s.bubble(), 3)
  (14, 7, 0.273)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from shardkit.errors import ShardkitError

SCHEDULES = ("gpipe", "1f1b")
IDLE = -1


@dataclasses.dataclass(frozen=True)
class Phase:
    """A run of ticks of one kind: ``"F"`` (forward slot), ``"B"`` (backward) or ``"FB"`` (both).

    ``forward`` and ``backward`` are ``(ticks, stages)`` int arrays: the microbatch each stage
    runs in that slot at that tick, or ``-1`` (idle).
    """

    kind: str
    forward: np.ndarray
    backward: np.ndarray

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A lock-step pipeline schedule for ``stages`` stages and ``microbatches`` microbatches.

    Attributes:
      name: ``"gpipe"`` or ``"1f1b"``.
      stages: ``p``.
      microbatches: ``m``.
      phases: the ticks, grouped into runs of one kind.
      stash: how many microbatch inputs a stage must keep at once (the most in flight on any stage).
    """

    name: str
    stages: int
    microbatches: int
    phases: tuple[Phase, ...]
    stash: int

    @property
    def ticks(self) -> int:
        return sum(ph.ticks for ph in self.phases)

    def rows(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """One ``(kind, forward (stages,), backward (stages,))`` per tick, in order."""
        return [(ph.kind, ph.forward[t], ph.backward[t]) for ph in self.phases for t in range(ph.ticks)]

    def bubble(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """Idle fraction of the step on every stage, for the given slot costs.

        A tick lasts the cost of its slots; a stage is busy ``m * (forward + backward)`` of it.
        """
        total = sum(
            ph.ticks * (forward_cost * ("F" in ph.kind) + backward_cost * ("B" in ph.kind)) for ph in self.phases
        )
        return 1.0 - self.microbatches * (forward_cost + backward_cost) / total

    def in_flight(self) -> np.ndarray:
        """``(ticks, stages)``: microbatches whose input a stage holds after each tick's forward slot."""
        held = np.zeros(self.stages, int)
        out = []
        for _, fwd, bwd in self.rows():
            held += fwd >= 0
            out.append(held.copy())
            held -= bwd >= 0
        return np.array(out)

    def check(self) -> None:
        """Raise if the table breaks a timing rule, runs a slot twice, or overflows the stash."""
        p, m = self.stages, self.microbatches
        fwd_tick = np.full((m, p), -1)
        bwd_tick = np.full((m, p), -1)
        for t, (_, fwd, bwd) in enumerate(self.rows()):
            for s in range(p):
                for table, i in ((fwd_tick, fwd[s]), (bwd_tick, bwd[s])):
                    if i >= 0:
                        if table[i, s] >= 0:
                            raise AssertionError(f"{self.name}: microbatch {i} runs twice on stage {s}")
                        table[i, s] = t
        if (fwd_tick < 0).any() or (bwd_tick < 0).any():
            raise AssertionError(f"{self.name}: some microbatch misses a forward or backward slot")
        if (np.diff(fwd_tick, axis=1) != 1).any():
            raise AssertionError(f"{self.name}: a forward does not follow the previous stage's by one tick")
        if (np.diff(bwd_tick, axis=1) != -1).any():
            raise AssertionError(f"{self.name}: a backward does not follow the next stage's by one tick")
        if (bwd_tick[:, -1] < fwd_tick[:, -1]).any():
            raise AssertionError(f"{self.name}: a backward runs before its forward on the last stage")
        for s in range(p):  # slots are reused modulo `stash`: in flight must be consecutive and fit
            for i in range(m):
                later = [j for j in range(i + 1, m) if fwd_tick[j, s] <= bwd_tick[i, s]]
                if later and (later != list(range(i + 1, i + 1 + len(later))) or len(later) >= self.stash):
                    raise AssertionError(f"{self.name}: stash of {self.stash} overflows on stage {s}")

    def format(self) -> str:
        """The table as text: one line per tick, one column per stage (``F3``: forward of
        microbatch 3, ``B0``: backward of 0, ``.``: idle)."""
        lines = ["tick  " + "  ".join(f"stage {s:<3d}" for s in range(self.stages))]
        for t, (_, fwd, bwd) in enumerate(self.rows()):
            cells = []
            for s in range(self.stages):
                parts = [f"F{fwd[s]}" if fwd[s] >= 0 else "", f"B{bwd[s]}" if bwd[s] >= 0 else ""]
                cells.append((" ".join(x for x in parts if x) or ".").ljust(9))
            lines.append((f"{t:4d}  " + "  ".join(cells)).rstrip())
        return "\n".join(lines)


def _build(
    name: str,
    p: int,
    m: int,
    fwd_at: Callable[[int, int], int],
    bwd_at: Callable[[int, int], int],
) -> Schedule:
    """A schedule from the tick of every (microbatch, stage) forward and backward."""
    ticks = 1 + max(max(fwd_at(i, s), bwd_at(i, s)) for i in range(m) for s in range(p))
    fwd = np.full((ticks, p), IDLE)
    bwd = np.full((ticks, p), IDLE)
    for i in range(m):
        for s in range(p):
            fwd[fwd_at(i, s), s] = i
            bwd[bwd_at(i, s), s] = i
    kinds = ["F" * bool((fwd[t] >= 0).any()) + "B" * bool((bwd[t] >= 0).any()) for t in range(ticks)]
    phases, start = [], 0
    for t in range(1, ticks + 1):
        if t == ticks or kinds[t] != kinds[start]:
            phases.append(Phase(kinds[start], fwd[start:t], bwd[start:t]))
            start = t
    held = np.zeros(p, int)
    most = 0
    for t in range(ticks):
        held += fwd[t] >= 0
        most = max(most, int(held.max()))
        held -= bwd[t] >= 0
    schedule = Schedule(name, p, m, tuple(phases), most)
    schedule.check()
    return schedule


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The lock-step table of schedule ``name`` (``"gpipe"`` or ``"1f1b"``).

    Args:
      name: the schedule.
      stages: pipeline stages ``p`` (the ``stage`` mesh axis size), >= 1.
      microbatches: microbatches ``m`` per step, >= 1.

    Returns:
      A checked :class:`Schedule`.

    Example:
      >>> print(make_schedule("gpipe", 2, 2).format().splitlines()[1])
         0  F0         .
    """
    if name not in SCHEDULES:
        raise ShardkitError(f"Unknown pipeline schedule {name!r}. Choose one of: {', '.join(SCHEDULES)}.")
    for what, n in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ShardkitError(f"Pipeline {what} must be a positive integer, got {n!r}.")
    p, m = stages, microbatches
    if name == "gpipe":
        return _build(name, p, m, lambda i, s: i + s, lambda i, s: (m + p - 1) + i + (p - 1 - s))
    return _build(name, p, m, lambda i, s: i + s, lambda i, s: i + 2 * (p - 1) - s)
