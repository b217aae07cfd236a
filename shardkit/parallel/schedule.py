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

With ``virtual_stages=v > 1`` (interleaved stages, Narayanan et al. 2021; "circular" in MaxText)
each device holds ``v`` chunks of ``L / (v p)`` layers, chunk ``c`` of device ``s`` being virtual
stage ``j = c p + s``, and a microbatch goes round the ring of devices ``v`` times. Microbatches
enter in groups of ``p``; a tick runs one chunk, ``1/v`` of a stage, and the bubble falls to
``(p - 1) / (v m + p - 1)``. Needs ``m`` divisible by ``p``.

A slot holds ``c m + i`` for chunk ``c`` of microbatch ``i`` (just ``i`` when ``v = 1``), or -1.

Example:
  >>> s = make_schedule("1f1b", stages=4, microbatches=8)
  >>> s.ticks, s.stash, round(s.bubble(), 3)
  (14, 7, 0.273)
  >>> round(make_schedule("1f1b", stages=4, microbatches=8, virtual_stages=2).bubble(), 3)
  0.158
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from shardkit.core.config import SCHEDULES
from shardkit.core.errors import PipelineError

IDLE = -1


@dataclasses.dataclass(frozen=True)
class Phase:
    """A run of ticks of one kind: ``"F"`` (forward slot), ``"B"`` (backward) or ``"FB"`` (both).

    ``forward`` and ``backward`` are ``(ticks, stages)`` int arrays: what each device runs in
    that slot at that tick (``chunk * m + microbatch``), or ``-1`` (idle).
    """

    kind: str
    forward: np.ndarray
    backward: np.ndarray

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A lock-step pipeline schedule for ``stages`` devices and ``microbatches`` microbatches.

    Attributes:
      name: ``"gpipe"`` or ``"1f1b"``.
      stages: ``p``, the devices along the stage axis.
      microbatches: ``m``.
      phases: the ticks, grouped into runs of one kind.
      stash: how many inputs of one chunk a device must keep at once (slot ``i % stash``).
      virtual_stages: ``v``, the chunks of layers on each device.
    """

    name: str
    stages: int
    microbatches: int
    phases: tuple[Phase, ...]
    stash: int
    virtual_stages: int = 1

    @property
    def ticks(self) -> int:
        return sum(ph.ticks for ph in self.phases)

    def rows(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """One ``(kind, forward (stages,), backward (stages,))`` per tick, in order."""
        return [(ph.kind, ph.forward[t], ph.backward[t]) for ph in self.phases for t in range(ph.ticks)]

    def bubble(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """Idle fraction of the step on every device, for the given costs of a whole stage.

        A tick lasts the cost of its slots (one chunk: ``1/v`` of a stage); a device is busy
        ``m * (forward + backward)`` of it.
        """
        total = sum(
            ph.ticks * (forward_cost * ("F" in ph.kind) + backward_cost * ("B" in ph.kind)) for ph in self.phases
        )
        return 1.0 - self.microbatches * self.virtual_stages * (forward_cost + backward_cost) / total

    def in_flight(self) -> np.ndarray:
        """``(ticks, stages)``: chunk inputs a device holds after each tick's forward slot."""
        held = np.zeros(self.stages, int)
        out = []
        for _, fwd, bwd in self.rows():
            held += fwd >= 0
            out.append(held.copy())
            held -= bwd >= 0
        return np.array(out)

    def check(self) -> None:
        """Raise if the table breaks a timing rule, runs a slot twice, or overflows the stash."""
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        fwd_tick = np.full((m, v * p), -1)  # [microbatch, virtual stage]
        bwd_tick = np.full((m, v * p), -1)
        for t, (_, fwd, bwd) in enumerate(self.rows()):
            for s in range(p):
                for table, q in ((fwd_tick, fwd[s]), (bwd_tick, bwd[s])):
                    if q >= 0:
                        i, j = q % m, (q // m) * p + s
                        if table[i, j] >= 0:
                            raise AssertionError(f"{self.name}: microbatch {i} runs twice on virtual stage {j}")
                        table[i, j] = t
        if (fwd_tick < 0).any() or (bwd_tick < 0).any():
            raise AssertionError(f"{self.name}: some microbatch misses a forward or backward slot")
        if (np.diff(fwd_tick, axis=1) != 1).any():
            raise AssertionError(f"{self.name}: a forward does not follow the previous stage's by one tick")
        if (np.diff(bwd_tick, axis=1) != -1).any():
            raise AssertionError(f"{self.name}: a backward does not follow the next stage's by one tick")
        if (bwd_tick[:, -1] < fwd_tick[:, -1]).any():
            raise AssertionError(f"{self.name}: a backward runs before its forward on the last stage")
        for j in range(v * p):  # slots are reused modulo `stash`: in flight must be consecutive and fit
            for i in range(m):
                later = [k for k in range(i + 1, m) if fwd_tick[k, j] <= bwd_tick[i, j]]
                if later and (later != list(range(i + 1, i + 1 + len(later))) or len(later) >= self.stash):
                    raise AssertionError(f"{self.name}: stash of {self.stash} overflows on virtual stage {j}")

    def format(self) -> str:
        """The table as text: one line per tick, one column per device (``F3``: forward of
        microbatch 3, ``B0``: backward of 0, ``F3.1``: of its chunk 1, ``.``: idle)."""
        m, v = self.microbatches, self.virtual_stages

        def name(kind: str, q: int) -> str:
            if q < 0:
                return ""
            return f"{kind}{q % m}" + (f".{q // m}" if v > 1 else "")

        lines = ["tick  " + "  ".join(f"stage {s:<3d}" for s in range(self.stages))]
        for t, (_, fwd, bwd) in enumerate(self.rows()):
            cells = []
            for s in range(self.stages):
                parts = [name("F", fwd[s]), name("B", bwd[s])]
                cells.append((" ".join(x for x in parts if x) or ".").ljust(9))
            lines.append((f"{t:4d}  " + "  ".join(cells)).rstrip())
        return "\n".join(lines)


def _build(
    name: str,
    p: int,
    m: int,
    v: int,
    fwd_at: Callable[[int, int], int],
    bwd_at: Callable[[int, int], int],
) -> Schedule:
    """A schedule from the tick of every (microbatch, virtual stage) forward and backward."""
    ticks = 1 + max(max(fwd_at(i, j), bwd_at(i, j)) for i in range(m) for j in range(v * p))
    fwd = np.full((ticks, p), IDLE)
    bwd = np.full((ticks, p), IDLE)
    for i in range(m):
        for j in range(v * p):
            for table, t in ((fwd, fwd_at(i, j)), (bwd, bwd_at(i, j))):
                if table[t, j % p] != IDLE:
                    raise AssertionError(f"{name}: two slots of one kind on device {j % p} at tick {t}")
                table[t, j % p] = (j // p) * m + i
    kinds = ["F" * bool((fwd[t] >= 0).any()) + "B" * bool((bwd[t] >= 0).any()) for t in range(ticks)]
    phases, start = [], 0
    for t in range(1, ticks + 1):
        if t == ticks or kinds[t] != kinds[start]:
            phases.append(Phase(kinds[start], fwd[start:t], bwd[start:t]))
            start = t
    # The most inputs of one chunk a device holds at once: that chunk's ring of slots.
    most = 0
    for j in range(v * p):
        # (tick, 0) is a forward filling a slot, (tick, 1) a backward freeing one, later in its tick.
        events = sorted([(fwd_at(i, j), 0) for i in range(m)] + [(bwd_at(i, j), 1) for i in range(m)])
        count = 0
        for _, frees in events:
            count += -1 if frees else 1
            most = max(most, count)
    schedule = Schedule(name, p, m, tuple(phases), most, v)
    schedule.check()
    return schedule


def make_schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The lock-step table of schedule ``name`` (``"gpipe"`` or ``"1f1b"``).

    Args:
      name: the schedule.
      stages: pipeline devices ``p`` (the ``stage`` mesh axis size), >= 1.
      microbatches: microbatches ``m`` per step, >= 1 (a multiple of ``p`` when ``v > 1``).
      virtual_stages: chunks of layers per device ``v`` (interleaved stages), >= 1.

    Returns:
      A checked :class:`Schedule`.

    Example:
      >>> print(make_schedule("gpipe", 2, 2).format().splitlines()[1])
         0  F0         .
    """
    if name not in SCHEDULES:
        raise PipelineError(f"Unknown pipeline schedule {name!r}. Choose one of: {', '.join(SCHEDULES)}.")
    for what, n in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise PipelineError(f"Pipeline {what} must be a positive integer, got {n!r}.")
    p, m, v = stages, microbatches, virtual_stages
    if v > 1 and m % p:
        raise PipelineError(
            f"Interleaved stages (virtual_stages={v}) send microbatches round the {p} stages in groups of {p}: "
            f"microbatches={m} must be a multiple of {p}."
        )

    def forward(i: int, j: int) -> int:
        # Group g of p microbatches takes v p ticks; chunk c of device s runs (i, j = c p + s) at
        # g v p + c p + (i mod p) + s: one forward per device per tick, one tick per hop.
        return (i // p) * v * p + (j // p) * p + i % p + j % p

    last = v * p - 1
    if name == "gpipe":
        end = forward(m - 1, last)  # every forward first, then the backwards in mirror order
        return _build(name, p, m, v, forward, lambda i, j: 2 * end + 1 - forward(i, j))
    # 1F1B: the backward starts on the last stage right after the forward, and climbs back.
    return _build(name, p, m, v, forward, lambda i, j: forward(i, last) + last - j)
