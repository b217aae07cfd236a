"""``shardkit launch``: start P processes of one program on this machine, as a cluster would.

Each process gets the variables :func:`shardkit.runtime.distributed.initialize` reads (coordinator on
a free local port, process count, rank, simulated devices per process), its output is prefixed
with its rank, and when one process fails the others are stopped at once and the launcher
exits with the failing code: no hung jobs. JAX's own runtime does the rest; this only starts
processes, the way ``srun`` or ``mpirun`` would.

Nothing is left behind: SIGTERM, SIGINT and SIGHUP to the launcher (what ``timeout``, SLURM,
Kubernetes and Ctrl-C send) go to every worker's process group, which gets ``grace_s`` seconds
to exit before SIGKILL. When a worker fails, the launcher names the cause: the signal that
killed it, a rank that is stopped (``SIGSTOP``, a debugger) or that JAX's coordinator reports
as no longer sending heartbeats, or two processes registered under one process id.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from shardkit.core.errors import ClusterError
from shardkit.runtime.host_allocator import with_huge_pages

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_TAIL_LINES = 200  # lines of each rank's output kept to explain a failure


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_gloo_chatter(line: str, after_chatter: bool) -> bool:
    """Whether ``line`` is (a piece of) Gloo's connection message, printed once per CPU collective group.

    Gloo writes "[Gloo] Rank R is connected to N peer ranks. Expected number of connected peer
    ranks is : N" in several unbuffered pieces; groups that connect at once interleave them, so a
    line may hold the middle of one message, or only its last number (dropped only right after a
    line of Gloo's text).
    """
    if "[Gloo]" in line or "peer ranks" in line:
        return True
    return after_chatter and line.strip().isdigit()


def _pump(rank: int, stream: TextIO, out: TextIO, tail: collections.deque[str], verbose: bool) -> None:
    after_chatter = False  # the previous line held Gloo's text
    for line in iter(stream.readline, ""):
        tail.append(line)
        if not verbose:
            drop = _is_gloo_chatter(line, after_chatter)
            after_chatter = drop and not line.strip().isdigit()
            if drop:
                continue
        out.write(f"[rank {rank}] {line}")
        out.flush()


def has_accelerator() -> bool:
    """Whether this machine shows a GPU or TPU device file (cheap: no JAX import)."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel[0-9]*") or os.path.exists("/dev/kfd"))


def devices_from_layout(command: Sequence[str], processes: int) -> int | None:
    """Simulated CPU devices per process for a command that gives ``--layout`` with fixed sizes,
    so the job has exactly the layout's devices; None when it cannot tell (no layout, or a -1).

    Example:
      >>> devices_from_layout(["shardkit", "train", "--layout", "data=2,fsdp=4"], 2)
      4
    """
    from shardkit.core.mesh import Layout

    text = None
    for i, arg in enumerate(command):
        if arg == "--layout" and i + 1 < len(command):
            text = command[i + 1]
        elif arg.startswith("--layout="):
            text = arg.split("=", 1)[1]
    if text is None:
        return None
    layout = Layout.parse(text)
    if any(size == -1 for _, size in layout.sizes):
        return None
    if layout.num_devices % processes:
        raise ClusterError(
            f"Layout {text} has {layout.num_devices} devices: they do not split over {processes} processes. "
            "Fix: a process count that divides it, or --devices-per-proc."
        )
    return layout.num_devices // processes


def _check_command(command: Sequence[str]) -> None:
    if not command:
        raise ClusterError("shardkit launch needs a command after `--`, e.g. `-- shardkit train --layout data=2`.")
    program = command[0]
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise ClusterError(f"shardkit launch: {program} is not an executable file. Fix: check the path.")
    elif shutil.which(program) is None:
        raise ClusterError(
            f"shardkit launch: command {program!r} not found on PATH. Fix: check the spelling, or give its full "
            "path (e.g. `-- python train.py`)."
        )


def _group_states(pgid: int) -> set[str]:
    """The scheduler states (R, S, T, Z, ...) of the processes in process group ``pgid``."""
    states = set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = open(stat).read().rsplit(")", 1)[1].split()  # noqa: SIM115 -- one read
            if int(fields[2]) == pgid:
                states.add(fields[0])
    return states


def _signal_name(code: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return f"signal {-code}"


def _stalled(procs: list[subprocess.Popen[str]]) -> list[int]:
    """Ranks whose process group has a stopped process (state T)."""
    return [r for r, p in enumerate(procs) if p.poll() is None and "T" in _group_states(p.pid)]


def diagnose(failed_rank: int, code: int, stalled: list[int], tails: list[collections.deque[str]]) -> str:
    """One message for a failed job: which rank is at fault, and why, as far as can be seen.

    Args:
      failed_rank: the first rank that exited with an error.
      code: its exit status (negative: killed by that signal).
      stalled: ranks found stopped when it failed.
      tails: the last lines of every rank's output (JAX's coordinator logs there who it lost).
    """
    how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
    lines = [f"shardkit launch: rank {failed_rank} {how}"]
    if stalled:
        lines.append(
            f"rank {', '.join(map(str, stalled))} is stalled: stopped (process state T: SIGSTOP, a debugger or "
            f"job control), so it stopped answering; rank {failed_rank} failed because of it, not on its own"
        )
    text = "".join(line for tail in tails for line in tail)
    unhealthy = re.search(r"stopped sending heartbeats\):\s*([\d,\s]+)", text)
    if unhealthy and not stalled:
        ranks = ", ".join(unhealthy.group(1).split())
        lines.append(f"JAX's coordinator reports rank {ranks} as no longer sending heartbeats (stalled or dead)")
    if "incarnation" in text:  # JAX's coordinator words it several ways, depending on who connects first
        duplicate = re.search(r"(\d+) unexpectedly tried to connect", text)
        which = f" (id {duplicate.group(1)})" if duplicate else ""
        lines.append(
            f"two processes registered under one process id{which}: a duplicate SHARDKIT_PROCESS_ID or "
            "JAX_PROCESS_ID, or a process that restarted. Fix: give each process its own id in 0..N-1"
        )
    return "; ".join(lines) + "\n"


def _check_launch(command: Sequence[str], nproc: int, nnodes: int, node_rank: int, coordinator: str | None) -> None:
    """Refuse a launch that cannot work, before any process starts."""
    _check_command(command)
    if nproc < 1:
        raise ClusterError(f"--nproc {nproc}: launch at least one process.")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ClusterError(f"--node-rank {node_rank} of --nnodes {nnodes}: give 0 <= node rank < nodes >= 1.")
    if nnodes > 1 and not coordinator:
        raise ClusterError(
            f"--nnodes {nnodes}: every node needs the same --coordinator host:port (node 0's address), e.g. "
            "--coordinator 10.0.0.1:12355."
        )


def _start(
    command: Sequence[str], rank: int, env: dict[str, str], devices_per_proc: int | None, verbose: bool
) -> tuple[subprocess.Popen[str], collections.deque[str], threading.Thread]:
    """Start process ``rank`` (in the job's numbering) and the thread that prefixes its output;
    ``(process, the tail of its output, the thread)``."""
    child_env = {**os.environ, **env, "SHARDKIT_PROCESS_ID": str(rank), "PYTHONUNBUFFERED": "1"}
    if devices_per_proc:
        child_env["SHARDKIT_LOCAL_DEVICES"] = str(devices_per_proc)
        child_env["JAX_PLATFORMS"] = "cpu"
    child_env = with_huge_pages(child_env)  # CPU processes map their step buffers in huge pages
    p = subprocess.Popen(
        list(command),
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: stopping it stops its children too
    )
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    pump = threading.Thread(target=_pump, args=(rank, p.stdout, sys.stdout, tail, verbose), daemon=True)
    pump.start()
    return p, tail, pump


def launch(
    command: Sequence[str],
    nproc: int,
    devices_per_proc: int | None = None,
    *,
    port: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    grace_s: float = 10.0,
    verbose: bool = False,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``command`` in ``nproc`` processes; return 0, or the exit code of the first to fail
    (128 + N for a process killed by signal N, or for the launcher stopped by signal N).

    Args:
      command: the program and its arguments, e.g. ``["shardkit", "train", "--layout", ...]``.
      nproc: number of processes on this node.
      devices_per_proc: simulated CPU devices per process (sets ``SHARDKIT_LOCAL_DEVICES``); on a
        machine without GPU/TPU, derived from the command's ``--layout`` when not given.
      port: the coordinator's port on this machine (one node; default: a free one).
      nnodes, node_rank, coordinator: several nodes, as torchrun names them: run the launcher once
        per node with the same ``coordinator`` (``host:port`` of node 0, where process 0 runs);
        ranks are ``node_rank * nproc + local rank``.
      verbose: keep Gloo's connection messages in the output.
      grace_s: seconds the workers get to exit after a failure or a signal, before SIGKILL.
      env: extra environment variables for every process.

    Raises:
      ShardkitError: no command, an unknown command, or a bad process count; before any start.
    """
    _check_launch(command, nproc, nnodes, node_rank, coordinator)
    world = nnodes * nproc
    if devices_per_proc is None and not has_accelerator():
        devices_per_proc = devices_from_layout(command, world)
        if devices_per_proc:
            sys.stderr.write(f"shardkit launch: {devices_per_proc} simulated CPU devices per process (from --layout)\n")
    address = coordinator or f"127.0.0.1:{free_port() if port is None else port}"
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum)) for s in FORWARDED_SIGNALS}
    procs: list[subprocess.Popen[str]] = []
    tails: list[collections.deque[str]] = []
    pumps = []
    try:
        for rank in range(nproc):
            cluster = {"SHARDKIT_COORDINATOR": address, "SHARDKIT_NUM_PROCESSES": str(world)}
            p, tail, pump = _start(
                command, node_rank * nproc + rank, {**(env or {}), **cluster}, devices_per_proc, verbose
            )
            procs.append(p)
            tails.append(tail)
            pumps.append(pump)
        failure = _watch(procs, received, grace_s)
    finally:
        _stop(procs, grace_s, signal.SIGTERM)  # a no-op when all have exited
        for s, handler in previous.items():
            signal.signal(s, handler)
    for t in pumps:
        t.join(timeout=2)  # every line read: what the ranks said before they stopped explains it
    if failure is None:
        return 0
    rank, code, stalled = failure
    if rank >= 0:  # in the job's numbering: this node's ranks start at node_rank * nproc
        first = node_rank * nproc
        sys.stderr.write(diagnose(first + rank, code, [first + r for r in stalled], tails))
    return 128 - code if code < 0 else code  # killed by signal N: exit 128 + N, as shells do


def _watch(
    procs: list[subprocess.Popen[str]], received: list[int], grace_s: float
) -> tuple[int, int, list[int]] | None:
    """Wait for the job: None when every rank succeeded, else ``(rank, code, stalled ranks)``
    (rank -1 and code -N when the launcher was stopped by signal N)."""
    while True:
        if received:
            signum = received[0]
            sys.stderr.write(
                f"shardkit launch: received {signal.Signals(signum).name}; passing it to every rank "
                f"({grace_s:g} s to exit, then SIGKILL)\n"
            )
            _stop(procs, grace_s, signum)
            return -1, -signum, []
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            rank, code = bad[0]
            stalled = _stalled(procs)  # before stopping them: afterwards every rank is gone
            sys.stderr.write(f"shardkit launch: a rank failed (local rank {rank}); stopping the other ranks\n")
            _stop(procs, grace_s, signal.SIGTERM)
            return rank, code, stalled
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen[str]], grace_s: float, signum: int) -> None:
    """``signum`` to every rank's process group, ``grace_s`` to exit, then SIGKILL to whatever of
    the group is left (children included, even after the rank itself exited)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signum)
                os.killpg(p.pid, signal.SIGCONT)  # a stopped process cannot act on the signal
    deadline = time.time() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(deadline - time.time(), 0.01))
        while _group_states(p.pid) - {"Z"} and time.time() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
