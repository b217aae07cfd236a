"""The Kubernetes path: the Indexed Job of docs/kubernetes.md, its pods started here as local
processes with the variables the Job controller sets (``JOB_COMPLETION_INDEX``, the pod's
``HOSTNAME``), join one jax.distributed job with the ranks Kubernetes gave them."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import yaml

from shardkit.core.errors import ClusterError
from shardkit.runtime import distributed

ROOT = pathlib.Path(__file__).parent.parent
WORKER = str(ROOT / "tests" / "launch_worker.py")
DOC = (ROOT / "docs" / "kubernetes.md").read_text()


def manifest():
    """The Job of the doc's YAML block: its pod count and its container's environment."""
    (block,) = re.findall(r"```yaml\n(.*?)```", DOC, re.S)
    (job,) = [d for d in yaml.safe_load_all(block) if d["kind"] == "Job"]
    assert job["spec"]["completionMode"] == "Indexed"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    return job["metadata"]["name"], job["spec"]["completions"], env


def pod_env(index: int, job: str, env: dict[str, str]) -> dict[str, str]:
    """What a pod of the Indexed Job sees: the manifest's variables and the controller's."""
    return {**env, "JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{job}-{index}"}


def test_the_manifest_gives_each_pod_its_rank_and_the_coordinator():
    job, pods, env = manifest()
    for index in range(pods):
        spec = distributed.detect(pod_env(index, job, env))
        assert spec.process_id == index and spec.num_processes == pods, spec
        assert spec.coordinator.startswith(f"{job}-0.")  # pod 0 hosts the coordinator
        assert "Kubernetes" in spec.source


def test_a_jobset_of_several_jobs_numbers_its_pods_across_jobs():
    env = {"SHARDKIT_NUM_PROCESSES": "4", "SHARDKIT_PODS_PER_JOB": "2", "SHARDKIT_COORDINATOR": "x-0-0.x:1"}
    ranks = [
        distributed.detect({**env, "JOB_INDEX": str(j), "JOB_COMPLETION_INDEX": str(i)}).process_id
        for j in range(2)
        for i in range(2)
    ]
    assert ranks == [0, 1, 2, 3]


def test_an_index_beyond_the_process_count_is_refused(monkeypatch):
    monkeypatch.setenv("SHARDKIT_NUM_PROCESSES", "4")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "4")
    with pytest.raises(ClusterError, match="outside 0..3"):
        distributed.initialize()


@pytest.mark.slow
def test_the_pods_of_the_manifest_join_one_job_as_local_processes():
    job, pods, env = manifest()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    # Only the coordinator's host changes: the Service's DNS name resolves inside the cluster.
    env = {**env, "SHARDKIT_COORDINATOR": f"127.0.0.1:{port}", "SHARDKIT_LOCAL_DEVICES": "1"}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDKIT_", "XLA_FLAGS"))}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "join"],
            env={**base, **pod_env(i, job, env), "JAX_PLATFORMS": "cpu"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(pods)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err[-2000:]
        assert f"process {i} of {pods}, 1 local of {pods} devices" in out, out
