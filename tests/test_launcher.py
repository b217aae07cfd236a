"""`shardkit launch` leaves no process behind and names the rank at fault: real processes,
real signals, the process table, and JAX's own coordinator."""

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import TEST_XLA_FLAGS

WORKER = str(pathlib.Path(__file__).parent / "launch_worker.py")
ENV = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, "SHARDKIT_HEARTBEAT_S": "3"}


def start(*args, nproc=2, extra=()):
    return subprocess.Popen(
        [sys.executable, "-m", "shardkit.cli", "launch", "--nproc", str(nproc), *extra, "--", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def pids_from(launcher, count):
    """Read the launcher's output until ``count`` ranks printed their pids: {rank: [pids]}."""
    found = {}
    deadline = time.time() + 120
    while len(found) < count and time.time() < deadline:
        line = launcher.stdout.readline()
        match = re.match(r"\[rank (\d+)\] pid (\d+)(?: child (\d+))?", line)
        if match:
            found[int(match.group(1))] = [int(x) for x in match.groups()[1:] if x]
    assert len(found) == count, f"only {found} started"
    return found


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too, once its parent reaps it
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def processes_with(marker):
    """PIDs whose command line holds ``marker``, from the process table."""
    pids = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return [p for p in pids if p != os.getpid() and alive(p)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_launcher_stops_every_worker_and_their_children(signum):
    marker = f"launch-test-child-{signum}"
    launcher = start(sys.executable, WORKER, "sleep", marker)
    pids = pids_from(launcher, 2)
    everyone = [p for group in pids.values() for p in group]
    assert all(alive(p) for p in everyone)
    launcher.send_signal(signum)
    assert launcher.wait(timeout=30) == 128 + signum
    assert f"received {signal.Signals(signum).name}; passing it to every rank" in launcher.stderr.read()
    time.sleep(0.2)
    assert not [p for p in everyone if alive(p)]
    assert not processes_with(marker)


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period():
    launcher = start(sys.executable, WORKER, "stubborn", "launch-test-stubborn", extra=("--grace", "1"))
    pids = pids_from(launcher, 2)
    launcher.send_signal(signal.SIGTERM)
    start_wait = time.time()
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.time() - start_wait < 10
    time.sleep(0.2)
    assert not [p for group in pids.values() for p in group if alive(p)]


def test_a_stalled_rank_is_named_not_the_healthy_one():
    launcher = start(sys.executable, WORKER, "sync", extra=("--devices-per-proc", "1"))
    pids = pids_from(launcher, 2)
    time.sleep(1)  # synchronising
    os.kill(pids[1][0], signal.SIGSTOP)
    code = launcher.wait(timeout=120)
    stderr = launcher.stderr.read()
    assert code != 0
    assert "rank 1 is stalled: stopped (process state T" in stderr, stderr
    assert "rank 0 failed because of it, not on its own" in stderr
    time.sleep(0.2)
    assert not alive(pids[1][0]) and not alive(pids[0][0])


def test_two_processes_with_one_process_id_are_named():
    # Rank 2 claims id 1 as well: JAX's coordinator refuses it and stops the job.
    script = 'if [ "$SHARDKIT_PROCESS_ID" = 2 ]; then export SHARDKIT_PROCESS_ID=1; fi; exec "$0" "$@"'
    launcher = start("sh", "-c", script, sys.executable, WORKER, "sync", nproc=3, extra=("--devices-per-proc", "1"))
    code = launcher.wait(timeout=180)
    stderr = launcher.stderr.read()
    assert code != 0
    assert "two processes registered under one process id" in stderr, stderr


def test_a_busy_coordinator_port_is_named():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        launcher = start(sys.executable, WORKER, "join", extra=("--port", str(port), "--devices-per-proc", "1"))
        start_wait = time.time()
        code = launcher.wait(timeout=120)
        out = launcher.stdout.read()
    assert code == 2 and time.time() - start_wait < 60
    assert f"Coordinator port {port} is already in use on this host" in out


def test_process_counts_that_disagree_are_caught_through_the_coordinator():
    port = str(_free_port())
    common = {**ENV, "SHARDKIT_COORDINATOR": f"127.0.0.1:{port}", "SHARDKIT_LOCAL_DEVICES": "1", "JAX_PLATFORMS": "cpu"}
    first = subprocess.Popen(
        [sys.executable, WORKER, "join"],
        env={**common, "SHARDKIT_NUM_PROCESSES": "2", "SHARDKIT_PROCESS_ID": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    second = subprocess.Popen(
        [sys.executable, WORKER, "join"],
        env={**common, "SHARDKIT_NUM_PROCESSES": "3", "SHARDKIT_PROCESS_ID": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The refusal comes at start-up; the processes then wait on each other at exit (JAX's shutdown
    # barrier), so read the error line and stop both rather than wait for that.
    deadline, error = time.time() + 120, ""
    while time.time() < deadline and "shardkit: error" not in error:
        error += second.stderr.readline()
    for proc in (first, second):
        proc.kill()
        proc.wait(timeout=60)
    assert "started as process 1 of 3" in error and "runs a job of 2 processes" in error


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unknown_command_is_refused_before_anything_starts():
    result = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "launch", "--nproc", "2", "--", "no-such-command-xyz"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "command 'no-such-command-xyz' not found on PATH" in result.stderr


def test_two_nodes_join_one_job_and_devices_follow_the_layout():
    """Two launchers, as on two nodes (torchrun's grammar), one job of 4 processes; devices per
    process from the command's --layout; no Gloo chatter."""
    coordinator = f"127.0.0.1:{_free_port()}"
    nodes = [
        start(
            sys.executable,
            WORKER,
            "init",
            "--layout",
            "data=2,fsdp=4",
            extra=("--nnodes", "2", "--node-rank", str(rank), "--coordinator", coordinator)
            + (("--verbose",) if rank == 1 else ()),
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    stdout = outputs[0][0] + outputs[1][0]
    for rank in range(4):
        assert f"[rank {rank}] pid" in stdout and f"process {rank} of 4, 2 local of 8 devices" in stdout, stdout
    assert "[Gloo]" not in outputs[0][0] and "[Gloo]" in outputs[1][0]  # node 1 asked for --verbose
    assert "2 simulated CPU devices per process (from --layout)" in outputs[0][1]


def test_several_nodes_need_a_coordinator():
    result = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "launch", "--nproc", "2", "--nnodes", "2", "--", sys.executable, "-V"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert result.returncode == 2 and "needs the same --coordinator host:port" in result.stderr


def test_interleaved_pieces_of_gloos_message_are_dropped_and_the_rest_kept():
    import collections
    import io

    from shardkit.runtime.launch import _pump

    # Two collective groups connecting at once: Gloo's unbuffered pieces of two messages interleave.
    raw = (
        "step 1 loss 5.0\n"
        "[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : "
        "3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
        "1\n"
        "42\n"
        "sample:\n"
    )
    out, tail = io.StringIO(), collections.deque(maxlen=10)
    _pump(1, io.StringIO(raw), out, tail, verbose=False)
    # A number the program prints itself (after a line of its own) stays.
    assert out.getvalue() == "[rank 1] step 1 loss 5.0\n[rank 1] 42\n[rank 1] sample:\n"
    loud = io.StringIO()
    _pump(1, io.StringIO(raw), loud, tail, verbose=True)
    assert loud.getvalue().count("[rank 1]") == 5
