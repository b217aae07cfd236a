"""Orbax's and tensorstore's noise after a failed background save, silenced so the user sees one
error naming the cause (:meth:`shardkit.training.checkpoint.Checkpointer.save` raises it) instead of a
traceback per writer thread. Importing this module installs the log filters."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

TMP_MARK = ".orbax-checkpoint-tmp"


class _QuietOrbaxErrors(logging.Filter):
    """Drops orbax's ERROR logs of a failed background save: :meth:`Checkpointer.save` and
    :meth:`Checkpointer.wait` raise one error naming the cause instead of a traceback per thread."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


logging.getLogger("absl").addFilter(_QuietOrbaxErrors())


class _QuietAbandonedWrites(logging.Filter):
    """Drops asyncio's "Task/Future exception was never retrieved" for the pending writes of a
    failed save (orbax's write tasks into a checkpoint's temporary directory, garbage-collected
    after the save failed and was reported once); any other unretrieved task is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("exception was never retrieved" in text and TMP_MARK in text)


logging.getLogger("asyncio").addFilter(_QuietAbandonedWrites())


def quiet_closed_loops(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable-exception hook that drops the "Event loop is closed" errors tensorstore's
    callbacks raise after orbax closed the event loop of a failed save (one per pending write)."""

    def quiet(unraisable: Any) -> None:
        value = getattr(unraisable, "exc_value", None)
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        hook(unraisable)

    quiet.shardkit_quiet = True  # type: ignore[attr-defined]
    return quiet
