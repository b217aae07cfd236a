"""Several real processes on jax.distributed (gloo between CPU processes), started by `shardkit launch`."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import TEST_XLA_FLAGS

from shardkit.core.errors import ShardkitError
from shardkit.runtime import distributed

WORKER = str(pathlib.Path(__file__).parent / "mp_worker.py")
HYBRID = "data=2,fsdp=2,tensor=2,across_hosts=data"
ENV = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}


def launched(mode, layout, *extra, nproc=2, timeout=600):
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "launch",
        "--nproc",
        str(nproc),
        "--devices-per-proc",
        str(8 // nproc),
        "--",
        sys.executable,
        WORKER,
        mode,
        layout,
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, result_of(proc.stdout)


def single(mode, layout, *extra):
    proc = subprocess.run(
        [sys.executable, WORKER, mode, layout, *extra], capture_output=True, text=True, timeout=600, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result_of(proc.stdout)


def result_of(stdout):
    for line in stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise AssertionError(f"no RESULT line in:\n{stdout[-3000:]}")


@pytest.fixture(scope="module")
def one_process():
    return single("train10", "data=2,fsdp=2,tensor=2")


@pytest.fixture(scope="module")
def one_process_losses(one_process):
    return one_process["losses"]


@pytest.mark.slow
def test_two_processes_train_like_one(one_process):
    out, result = launched("twice", HYBRID)
    assert result["processes"] == 2
    # Each process read only its own rows of every batch.
    assert result["rows"] == [0, 4] and "[rank 1] rank 1 rows 4:8" in out
    np.testing.assert_allclose(result["losses"], one_process["losses"], rtol=2e-5)
    # Sampling gathers the parameters into each process: both continue the prompt alike, as one process does.
    assert f"[rank 1] rank 1 sample {result['sample']}" in out
    assert result["sample"] == one_process["sample"] and len(result["sample"]) == 20


@pytest.mark.slow
def test_checkpoint_from_two_processes_restores_in_one_and_back(tmp_path, one_process_losses):
    launched("save5", HYBRID, str(tmp_path / "a"))
    resumed = single("resume5", "fsdp=4,tensor=2", str(tmp_path / "a"))["losses"]
    np.testing.assert_allclose(resumed, one_process_losses[5:], rtol=2e-5)
    single("save5", "fsdp=8", str(tmp_path / "b"))
    _, result = launched("resume5", HYBRID, str(tmp_path / "b"))
    np.testing.assert_allclose(result["losses"], one_process_losses[5:], rtol=2e-5)


@pytest.mark.slow
def test_report_marks_collectives_that_cross_hosts():
    _, result = launched("report", HYBRID)
    crossing = {(kind, tuple(axes)) for kind, axes, crosses in result["collectives"] if crosses}
    inside = {(kind, tuple(axes)) for kind, axes, crosses in result["collectives"] if not crosses}
    assert crossing and all("data" in axes for _, axes in crossing)
    assert ("all-reduce", ("tensor",)) in inside and ("all-gather", ("fsdp",)) in inside


@pytest.mark.slow
def test_killing_one_process_stops_the_others_quickly(tmp_path):
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardkit.cli",
            "launch",
            "--nproc",
            "2",
            "--devices-per-proc",
            "4",
            "--",
            sys.executable,
            WORKER,
            "hang",
            HYBRID,
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp_path / "pid1").exists():
        time.sleep(0.1)
    time.sleep(2)  # both are training
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    killed = time.time()
    code = launcher.wait(timeout=60)
    assert time.time() - killed < 30
    assert code == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL" in launcher.stderr.read()
    pid0 = int((tmp_path / "pid0").read_text())
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


def test_launch_exits_with_the_failing_code():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkit.cli",
            "launch",
            "--nproc",
            "3",
            "--",
            sys.executable,
            "-c",
            "import os, sys, time\nrank = int(os.environ['SHARDKIT_PROCESS_ID'])\nprint('hello from', rank)\n"
            "sys.exit(7) if rank == 2 else time.sleep(120)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert proc.returncode == 7
    assert "[rank 2] hello from 2" in proc.stdout and "[rank 0] hello from 0" in proc.stdout


def test_detect_from_environments():
    assert distributed.detect({}) is None
    spec = distributed.detect(
        {
            "SHARDKIT_COORDINATOR": "h:1",
            "SHARDKIT_NUM_PROCESSES": "4",
            "SHARDKIT_PROCESS_ID": "3",
            "SHARDKIT_LOCAL_DEVICES": "2",
        }
    )
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.local_devices) == ("h:1", 4, 3, 2)
    spec = distributed.detect({"JAX_COORDINATOR_ADDRESS": "h:2", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert (spec.source, spec.coordinator, spec.process_id) == ("JAX_* variables", "h:2", 1)
    spec = distributed.detect({"SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "node[1-2]"})
    assert (spec.source, spec.num_processes, spec.process_id, spec.coordinator) == ("SLURM", 16, 5, None)
    spec = distributed.detect({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "2"})
    assert (spec.source, spec.num_processes, spec.process_id) == ("Open MPI", 8, 2)
    with pytest.raises(ShardkitError, match="must be an integer"):
        distributed.detect({"SHARDKIT_NUM_PROCESSES": "two"})


def test_unreachable_coordinator_gives_a_clear_error_in_bounded_time():
    from shardkit.runtime.launch import free_port

    code = (
        "import shardkit as sk\nfrom shardkit.runtime import distributed\n"
        "try:\n    distributed.initialize(timeout_s=3)\n"
        "except sk.ShardkitError as e:\n    print('ERR', e)\n"
    )
    env = {
        **ENV,
        "SHARDKIT_COORDINATOR": f"127.0.0.1:{free_port()}",
        "SHARDKIT_NUM_PROCESSES": "2",
        "SHARDKIT_PROCESS_ID": "1",
    }
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert time.time() - start < 30
    assert "could not reach the coordinator" in proc.stdout and "start process 0" in proc.stdout, proc.stderr


def test_single_process_initialize_is_a_no_op(monkeypatch):
    for name in ("SHARDKIT_NUM_PROCESSES", "JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is None


@pytest.mark.slow
def test_shardkit_train_under_two_processes_behaves_as_one_program(tmp_path):
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkit.cli",
            "launch",
            "--nproc",
            "2",
            "--devices-per-proc",
            "4",
            "--",
            sys.executable,
            "-m",
            "shardkit.cli",
            "train",
            "--model",
            "tiny",
            "--steps",
            "6",
            "--batch",
            "8",
            "--seq",
            "32",
            "--layout",
            HYBRID,
            "--json-log",
            str(log),
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "3",
            "--sample-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    ours = [line for line in proc.stdout.splitlines() if "Gloo" not in line and "peer ranks" not in line]
    assert any(line.startswith("[rank 0] shardkit: 8 cpu device(s)") for line in ours)
    assert any(line.startswith("[rank 0] sample:") for line in ours)
    assert not [line for line in ours if line.startswith("[rank 1]") and line.strip() != "[rank 1]"]
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    from shardkit.training.checkpoint import Checkpointer

    assert Checkpointer(ckpt).steps() == [3, 6]
