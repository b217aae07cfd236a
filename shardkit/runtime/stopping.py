"""A polite stop: SIGTERM (what ``timeout``, SLURM, Kubernetes and ``shardkit launch`` send) and
SIGINT (Ctrl-C) ask the main job to stop at the next step boundary, save, and say how to resume.
A second signal stops at once."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType

import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Collects stop signals while it is entered (main thread only; elsewhere it never asks to stop).

    Example:
      >>> with StopRequests() as stop:
      ...     for step in range(3):
      ...         if stop.requested():
      ...             break
      >>> stop.signal_name is None
      True
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received:  # asked twice: the user means now
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
        self.received.append(signum)

    def requested(self) -> bool:
        """Whether any process of the job was asked to stop; with several processes they agree
        (one tiny all-gather), so all stop after the same step and save together."""
        import jax

        mine = bool(self.received)
        if jax.process_count() == 1:
            return mine
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(mine))))

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.received[0]).name if self.received else None
