"""Several processes, one program: JAX's multi-controller runtime (``jax.distributed``).

Each process runs the same script; ``initialize`` connects it to the others through JAX's
coordinator (NCCL between GPUs, gloo between CPU processes). Where the process count, rank and
coordinator come from, in order:

1. explicit arguments;
2. shardkit's launcher variables ``SHARDKIT_COORDINATOR``, ``SHARDKIT_NUM_PROCESSES``,
   ``SHARDKIT_PROCESS_ID`` (and ``SHARDKIT_LOCAL_DEVICES`` for simulated CPU devices);
3. JAX's own ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
   in a Kubernetes Indexed Job (or a JobSet) the rank, when not given, is the pod's
   ``JOB_COMPLETION_INDEX`` (plus ``JOB_INDEX`` times the pods per job under a JobSet), which the
   Job controller sets (``docs/kubernetes.md`` has a manifest);
4. a SLURM job step or an Open MPI launch: JAX's own cluster detection fills everything in.

Example (one line per process; ``shardkit launch`` does this for you)::

    SHARDKIT_COORDINATOR=127.0.0.1:12355 SHARDKIT_NUM_PROCESSES=2 SHARDKIT_PROCESS_ID=0 \
        python train.py
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Mapping

import jax
from jax._src import distributed as jax_distributed
from jax._src import xla_bridge

from shardkit.core.errors import ClusterError


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits: ``source`` names where the values came from."""

    source: str
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    local_devices: int | None = None


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ClusterError(f"Environment variable {name}={value!r} must be an integer.") from None


def detect(env: Mapping[str, str] | None = None) -> ClusterSpec | None:
    """The cluster this process was launched into, or None for a single process."""
    env = os.environ if env is None else env
    for prefix in ("SHARDKIT", "JAX"):
        count = _int(env, f"{prefix}_NUM_PROCESSES")
        if count is not None:
            rank, source = _int(env, f"{prefix}_PROCESS_ID"), f"{prefix}_* variables"
            if rank is None and _int(env, "JOB_COMPLETION_INDEX") is not None:
                rank, source = _kubernetes_rank(env, count), f"Kubernetes Indexed Job, {prefix}_* variables"
            return ClusterSpec(
                source=source,
                coordinator=env.get(f"{prefix}_COORDINATOR") or env.get(f"{prefix}_COORDINATOR_ADDRESS"),
                num_processes=count,
                process_id=rank,
                local_devices=_int(env, "SHARDKIT_LOCAL_DEVICES"),
            )
    tasks = _int(env, "SLURM_NTASKS")
    if tasks is not None and env.get("SLURM_STEP_NODELIST") and tasks > 1:
        return ClusterSpec("SLURM", None, tasks, _int(env, "SLURM_PROCID"))
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    if world is not None and world > 1:
        return ClusterSpec("Open MPI", None, world, _int(env, "OMPI_COMM_WORLD_RANK"))
    return None


def _kubernetes_rank(env: Mapping[str, str], count: int) -> int | None:
    """The rank of a pod of an Indexed Job: its completion index; under a JobSet of several
    replicated jobs, ``JOB_INDEX`` x (pods per job) + the completion index, where the pods per job
    come from ``SHARDKIT_PODS_PER_JOB`` (default: all processes in one job)."""
    index = _int(env, "JOB_COMPLETION_INDEX")
    job = _int(env, "JOB_INDEX") or 0
    per_job = _int(env, "SHARDKIT_PODS_PER_JOB") or count
    return None if index is None else job * per_job + index


UNREACHABLE = """\
Process {pid} of {n} could not reach the coordinator at {address} within {timeout} s ({error}).
Fix: start process 0 (it hosts the coordinator) and check that {address} is reachable from this
host (address, port, firewall); on SLURM use `srun`, not plain `python`, so every task starts.
"""


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_devices: int | None = None,
    timeout_s: int = 120,
    heartbeat_timeout_s: int = 30,
) -> ClusterSpec | None:
    """Join the other processes of this job (a no-op for a single process; safe to call twice).

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator.
      num_processes: how many processes the job has.
      process_id: this process's rank, 0-based.
      local_devices: simulated CPU devices in this process (CPU only).
      timeout_s: give up after this many seconds without the coordinator.
      heartbeat_timeout_s: the runtime stops every process this long after one stops answering
        (``SHARDKIT_HEARTBEAT_S`` overrides it).

    Returns:
      What was detected and used, or None when this is a single process.

    Raises:
      ShardkitError: JAX already started its backend, inconsistent values, or the
        coordinator could not be reached in time.
    """
    heartbeat_timeout_s = _int(os.environ, "SHARDKIT_HEARTBEAT_S") or heartbeat_timeout_s
    spec = _cluster_of(coordinator_address, num_processes, process_id, local_devices)
    if spec is None or spec.num_processes == 1:
        return None
    if jax_distributed.global_state.client is not None:  # already joined: the second call is harmless
        if jax.process_count() != spec.num_processes or (
            spec.process_id is not None and jax.process_index() != spec.process_id
        ):
            raise ClusterError(
                f"jax.distributed is already initialised as process {jax.process_index()} of "
                f"{jax.process_count()}, not {spec.process_id} of {spec.num_processes}. Call initialize once."
            )
        return spec
    _join(spec, timeout_s, heartbeat_timeout_s)
    return spec


def _cluster_of(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None, local_devices: int | None
) -> ClusterSpec | None:
    """The job this process belongs to: from the arguments when given, else from the launcher's
    environment; None when nothing says there are other processes."""
    spec = detect()
    if coordinator_address or num_processes or process_id is not None:
        spec = ClusterSpec("arguments", coordinator_address, num_processes, process_id, local_devices)
    elif spec is not None and local_devices is not None:
        spec = dataclasses.replace(spec, local_devices=local_devices)
    n, rank = (spec.num_processes, spec.process_id) if spec is not None else (None, None)
    if n is not None and rank is not None and not 0 <= rank < n:
        raise ClusterError(f"Process id {rank} is outside 0..{n - 1}.")
    return spec


def _join(spec: ClusterSpec, timeout_s: int, heartbeat_timeout_s: int) -> None:
    """Start JAX's multi-controller runtime for ``spec``, with errors a user can read."""
    if xla_bridge.backends_are_initialized():
        raise ClusterError(
            "shardkit.runtime.distributed.initialize() must run before JAX starts its backend (before any array or "
            "jax.devices()). Call it first thing in the script."
        )
    if spec.coordinator and spec.process_id == 0:
        _check_port_free(spec.coordinator)
    if spec.coordinator and spec.process_id not in (0, None):
        # JAX aborts the whole process when the coordinator never answers; probe it first so
        # the user gets an error they can read.
        _wait_for_coordinator(spec, timeout_s)
    # Only CPU collectives read this: gloo lets CPU processes all-reduce across processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if spec.local_devices:
        jax.config.update("jax_num_cpu_devices", spec.local_devices)
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            initialization_timeout=timeout_s,
            # A dead peer is noticed within this many seconds (JAX's default is 100).
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except Exception as e:  # JAX raises several types for the same failure
        raise ClusterError(
            UNREACHABLE.format(
                pid=spec.process_id,
                n=spec.num_processes,
                address=spec.coordinator,
                timeout=timeout_s,
                error=str(e).splitlines()[0][:200],
            )
        ) from e
    if spec.num_processes is not None and jax.process_count() != spec.num_processes:
        # The coordinator (process 0) decides the job's size; a process told another count
        # would split batches and checkpoints wrongly.
        raise ClusterError(
            f"This process was started as process {spec.process_id} of {spec.num_processes} ({spec.source}), but "
            f"the coordinator at {spec.coordinator} runs a job of {jax.process_count()} processes. Fix: start every "
            "process with the same process count."
        )


def _check_port_free(address: str) -> None:
    """Process 0 hosts the coordinator: a port already taken would fail deep inside JAX."""
    _, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ClusterError(f"Coordinator address {address!r} must be host:port, e.g. 10.0.0.1:12355.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", int(port)))
        except OSError as e:
            raise ClusterError(
                f"Coordinator port {port} is already in use on this host ({e.strerror}): process 0 hosts the "
                f"coordinator there. Fix: choose a free port (shardkit launch --port, or SHARDKIT_COORDINATOR="
                f"host:PORT), or stop the job that holds it."
            ) from None


def _wait_for_coordinator(spec: ClusterSpec, timeout_s: float) -> None:
    host, _, port = (spec.coordinator or "").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"Coordinator address {spec.coordinator!r} must be host:port, e.g. 10.0.0.1:12355.")
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise ClusterError(
        UNREACHABLE.format(
            pid=spec.process_id, n=spec.num_processes, address=spec.coordinator, timeout=timeout_s, error=last
        )
    )


def is_primary() -> bool:
    """True on the process that prints and writes logs (process 0)."""
    return jax.process_index() == 0
