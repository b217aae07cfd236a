"""One writer per checkpoint directory: a lock file naming the host and the process that holds it.

Two runs writing one directory destroy each other's checkpoints (each deletes what the other
wrote as "old"); the lock turns that into an error at start-up that says who holds it. A lock
left by a process that no longer exists on this host is stale and taken over with a warning.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import socket
import time
import warnings

from shardkit.core.errors import CheckpointError

LOCK_NAME = ".shardkit.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class DirectoryLock:
    """An exclusive lock on ``directory`` held by this process (re-entrant within it).

    Example:
      >>> import tempfile
      >>> lock = DirectoryLock(pathlib.Path(tempfile.mkdtemp()))
      >>> lock.acquire(); lock.held
      True
      >>> lock.release(); lock.held
      False
    """

    def __init__(self, directory: pathlib.Path) -> None:
        self.path = directory / LOCK_NAME
        self.held = False

    def _owner(self) -> dict[str, object] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def acquire(self) -> None:
        """Take the lock, or raise naming the process that holds it."""
        if self.held:
            return
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is None:  # being written this instant, or garbage: look again once
                    time.sleep(0.05)
                    owner = self._owner() or {}
                host, pid = owner.get("host"), owner.get("pid")
                if host == me["host"] and pid == me["pid"]:
                    self.held = True
                    return
                if host == me["host"] and isinstance(pid, int) and not _alive(pid):
                    warnings.warn(
                        f"Taking over the stale lock {self.path}: process {pid} on {host} no longer exists.",
                        stacklevel=3,
                    )
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
                    continue
                raise CheckpointError(
                    f"Checkpoint directory {self.path.parent} is in use by PID {pid} on host {host} "
                    f"(since {owner.get('since', '?')}): two runs in one directory overwrite each other's "
                    f"checkpoints. Fix: stop that run, or use another --checkpoint-dir; if that process is gone "
                    f"(another host cannot be checked from here), delete {self.path}."
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            atexit.register(self.release)  # a run that ends in an error still lets the next one in
            return
        raise CheckpointError(f"Could not take the lock {self.path}; another process keeps recreating it.")

    def release(self) -> None:
        atexit.unregister(self.release)
        if self.held:
            owner = self._owner() or {}
            if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            self.held = False
