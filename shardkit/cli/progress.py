"""Honest progress for the main job: what it is doing (compiling, training, sampling), smoothed
speed that leaves the compile out, elapsed time and ETA."""

from __future__ import annotations

import collections
import sys
import time
from typing import TextIO


def clock(seconds: float) -> str:
    """``75.2`` -> ``'1:15'``; ``3725`` -> ``'1:02:05'``.

    Example:
      >>> clock(75.2), clock(3725)
      ('1:15', '1:02:05')
    """
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """A one-line progress bar on a terminal, a line every tenth of the run elsewhere.

    The first step of a run includes the compile: it is reported as the compile time and left out
    of the speed, which is the mean of the last ``window`` steps.

    Args:
      total: the step the run ends at.
      tokens_per_step: global batch x sequence length.
      first: the step the run starts from (after a resume).
      out: where the lines go.
      window: steps in the speed's moving mean.

    Example:
      >>> import io
      >>> p = Progress(total=3, tokens_per_step=100, out=io.StringIO())
      >>> p.note("compiling the train step")
      >>> for step, seconds in [(1, 2.0), (2, 0.1), (3, 0.1)]:
      ...     p.update(step, loss=1.0, seconds=seconds)
      >>> "1,000 tok/s" in p.out.getvalue() and "compiled in 2.0 s" in p.out.getvalue()
      True
    """

    def __init__(
        self, total: int, tokens_per_step: int, *, first: int = 0, out: TextIO | None = None, window: int = 20
    ) -> None:
        out = sys.stderr if out is None else out  # the stream of the moment, not of the import
        self.total, self.tokens_per_step, self.first, self.out = total, tokens_per_step, first, out
        self.tty = out.isatty()
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.started = time.perf_counter()
        self.compile_s: float | None = None

    def note(self, what: str) -> None:
        """A line saying what the job is about to do (e.g. "compiling the train step")."""
        self.out.write(f"{what}...\n")
        self.out.flush()

    def step_seconds(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None

    def update(self, step: int, loss: float, seconds: float) -> None:
        """Report step ``step`` (1-based), which took ``seconds`` (the first one: with the compile)."""
        if self.compile_s is None:
            self.compile_s = seconds
            self.out.write(f"compiled in {seconds:.1f} s (step {step}, compile included)\n")
        else:
            self.recent.append(seconds)
        per_step = self.step_seconds()
        elapsed = time.perf_counter() - self.started
        width = 30
        done = int(width * step / self.total)
        line = f"step {step:>5}/{self.total} [{'#' * done}{'.' * (width - done)}] loss {loss:7.4f}"
        if per_step:
            line += (
                f" | {self.tokens_per_step / per_step:,.0f} tok/s | {per_step * 1e3:,.0f} ms/step"
                f" | elapsed {clock(elapsed)} | eta {clock(per_step * (self.total - step))}"
            )
        if self.tty:
            self.out.write("\r" + line + ("\n" if step == self.total else ""))
        elif step in (self.first + 1, self.first + 2, self.total) or step % max(self.total // 10, 1) == 0:
            self.out.write(line + "\n")
        self.out.flush()
