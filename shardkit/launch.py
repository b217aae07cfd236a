"""``shardkit launch``: start P processes of one program on this machine, as a cluster would.

Each process gets the variables :func:`shardkit.distributed.initialize` reads (coordinator on
a free local port, process count, rank, simulated devices per process), its output is prefixed
with its rank, and when one process fails the others are stopped at once and the launcher
exits with the failing code: no hung jobs. JAX's own runtime does the rest; this only starts
processes, the way ``srun`` or ``mpirun`` would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from shardkit.errors import ShardkitError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(rank: int, stream: object, out: object) -> None:
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        out.write(f"[rank {rank}] {line}")  # type: ignore[attr-defined]
        out.flush()  # type: ignore[attr-defined]


def launch(
    command: Sequence[str],
    nproc: int,
    devices_per_proc: int | None = None,
    *,
    grace_s: float = 5.0,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``command`` in ``nproc`` processes; return 0, or the exit code of the first to fail
    (128 + N for a process killed by signal N).

    Args:
      command: the program and its arguments, e.g. ``["shardkit", "train", "--layout", ...]``.
      nproc: number of processes.
      devices_per_proc: simulated CPU devices per process (sets ``SHARDKIT_LOCAL_DEVICES``).
      grace_s: seconds the others get to stop after one failed, before SIGKILL.
      env: extra environment variables for every process.
    """
    if not command:
        raise ShardkitError("shardkit launch needs a command after `--`, e.g. `-- shardkit train --layout data=2`.")
    if nproc < 1:
        raise ShardkitError(f"--nproc {nproc}: launch at least one process.")
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    pumps = []
    for rank in range(nproc):
        child_env = {
            **os.environ,
            **(env or {}),
            "SHARDKIT_COORDINATOR": f"127.0.0.1:{port}",
            "SHARDKIT_NUM_PROCESSES": str(nproc),
            "SHARDKIT_PROCESS_ID": str(rank),
            "PYTHONUNBUFFERED": "1",
        }
        if devices_per_proc:
            child_env["SHARDKIT_LOCAL_DEVICES"] = str(devices_per_proc)
            child_env["JAX_PLATFORMS"] = "cpu"
        p = subprocess.Popen(
            list(command),
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: stopping it stops its children too
        )
        procs.append(p)
        t = threading.Thread(target=_pump, args=(rank, p.stdout, sys.stdout), daemon=True)
        t.start()
        pumps.append(t)

    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        failed = (-1, 130)
    if failed is not None:
        rank, code = failed
        if rank >= 0:
            sys.stderr.write(f"shardkit launch: rank {rank} exited with code {code}; stopping the other ranks\n")
        _stop(procs, grace_s)
    for t in pumps:
        t.join(timeout=2)
    if failed is None:
        return 0
    code = failed[1]
    return 128 - code if code < 0 else code  # killed by signal N: exit 128 + N, as shells do


def _stop(procs: list[subprocess.Popen[str]], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.01))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
