"""The planner's compiles: in this process, or in worker processes of N simulated devices.

``python -m shardkit.plan.workers DEVICES`` is one worker: it starts JAX once with ``DEVICES``
simulated CPU devices, then reads one job per line on stdin, ``{"configs": [DryRunConfig fields,
...], "budget": bytes}``, compiles the configurations in order until one fits the budget, and
answers one line on stdout for each, ``{"result": report dict}``, then ``{"end": true}`` (with
``"error"`` when a configuration failed to compile). A job stopped part way (the planner's time
limit) keeps the settings it compiled. The planner keeps a few alive so that each compile pays for
JAX's start-up only once per process, and kills them when it ends, Ctrl-C included.

Past the CPU compiler's 2048 devices no process can hold the mesh: each configuration is then
dry-run as ``shardkit dryrun`` does it, extrapolated from two smaller compiles in subprocesses
(:mod:`shardkit.analysis.extrapolate`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
from jax._src import xla_bridge

from shardkit.analysis.extrapolate import MAX_COMPILED_DEVICES
from shardkit.core.errors import ClusterError, ModelError, ShardkitError
from shardkit.models.model_source import factory_ref, is_factory_ref
from shardkit.plan.dryrun import DryRunConfig, _in_process, can_run_here, dryrun
from shardkit.plan.search import Candidate, ModelFacts


class Workers:
    """A few worker processes (this module's :func:`main`) with ``devices`` simulated devices each."""

    def __init__(self, count: int, devices: int):
        path = os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)
        flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
        self.logs = [tempfile.TemporaryFile("w+") for _ in range(count)]  # noqa: SIM115 - closed in close_logs()
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "shardkit.plan.workers", str(devices)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
            for log in self.logs
        ]
        self.idle: list[int] = list(range(count))
        self.lock = threading.Lock()

    def run(self, configs: list[DryRunConfig], budget: float, results: list[dict[str, Any]]) -> str:
        """Compile ``configs`` in order on an idle worker until one fits, each report appended to
        ``results`` as it arrives; the error of one that failed ("" if none)."""
        with self.lock:
            i = self.idle.pop()
        proc, log = self.procs[i], self.logs[i]
        assert proc.stdin is not None and proc.stdout is not None
        reply: dict[str, Any] = {}
        try:
            proc.stdin.write(json.dumps({"configs": [dataclasses.asdict(c) for c in configs], "budget": budget}) + "\n")
            proc.stdin.flush()
            while "end" not in reply:
                line = proc.stdout.readline()
                if not line:
                    break
                reply = json.loads(line)
                if "result" in reply:
                    results.append(reply["result"])
        except (BrokenPipeError, OSError):
            pass
        if "end" not in reply:
            log.seek(0)
            raise ClusterError(f"A planner worker process ended unexpectedly:\n{log.read()[-2000:]}")
        with self.lock:
            self.idle.append(i)
        return str(reply.get("error", ""))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def close_logs(self) -> None:
        for log in self.logs:
            log.close()


def compile_candidates(
    jobs: list[Candidate],
    facts: ModelFacts,
    devices: int,
    budget: float,
    workers: int | None,
    done: Callable[[Candidate], None],
    skip: Callable[[Candidate], bool] = lambda _: False,
    deadline: float | None = None,
) -> None:
    """Compile each job's configurations (until one fits), here or in worker processes, in the
    order given; a job that ``skip`` refuses when its turn comes is not compiled (its
    ``skipped`` is set) and ``done`` is not called for it. Past ``deadline`` (a
    ``time.perf_counter()`` value) no compile starts and the worker processes are stopped: a job
    they held counts the settings it compiled (``done`` is called if there is one), and jobs not
    started are left without ``done``."""
    pending = [j for j in jobs if j.configs]
    if not pending:
        return
    importable = facts.model is None or is_factory_ref(pending[0].configs[0].model)
    if devices > MAX_COMPILED_DEVICES:  # dry runs extrapolated from two compiles in subprocesses
        if not importable:
            raise ModelError(
                f"Past {MAX_COMPILED_DEVICES} devices the planner compiles in subprocesses, which import the model "
                f"by name, and model {pending[0].configs[0].model} has none. Fix: pass the name of its factory, "
                "'package.module:function', defined at the top level of an importable module."
            )
        _one_by_one(pending, dryrun, budget, done, skip, deadline)
        return
    here = can_run_here(devices)
    if workers is None:
        started = xla_bridge.backends_are_initialized()
        workers = 1 if here and started else min(len(os.sched_getaffinity(0)), len(pending))
    if (here and workers == 1) or not importable:
        if not here:  # a factory only this process knows: say how to make it importable
            factory_ref(facts.model)  # type: ignore[arg-type]
        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", devices)
        model = facts.model
        factory = (lambda: model) if model is not None else None
        _one_by_one(pending, lambda cfg: _in_process(cfg, factory), budget, done, skip, deadline)
        return
    pool = Workers(min(workers, len(pending)), devices)
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=len(pool.procs))
    queue, lock, stopped = iter(pending), threading.Lock(), threading.Event()

    def serve_queue() -> None:
        """One worker's turn: the next job not skipped, until none is left (``done`` under the
        lock, so that each answer is known before the next job is taken or skipped)."""
        while not _past(deadline):
            with lock:
                job = next((j for j in queue if not _skipped(j, skip)), None)
            if job is None:
                return
            try:
                error = pool.run(job.configs, budget, job.results)
            except ClusterError:
                if not stopped.is_set():
                    raise
                with lock:  # its worker was stopped at the time limit: what it compiled counts
                    if job.results:
                        done(job)
                return
            with lock:
                job.error = error
                done(job)

    try:
        futures = [executor.submit(serve_queue) for _ in pool.procs]
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        _, running = concurrent.futures.wait(futures, timeout=left)
        if running:  # the time limit: stop the compiles still running
            stopped.set()
            pool.kill()
        for future in futures:
            future.result()
    finally:
        pool.kill()  # also on Ctrl-C: no worker outlives the plan
        executor.shutdown(wait=True, cancel_futures=True)
        pool.close_logs()


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def _until_fits(
    configs: list[Any],
    compile_one: Callable[[Any], dict[str, Any]],
    budget: float,
    results: list[dict[str, Any]],
    deadline: float | None = None,
) -> None:
    """Compile ``configs`` in order into ``results``, stopping at the first that fits ``budget``
    (or, past ``deadline``, before the next)."""
    for cfg in configs:
        if results and _past(deadline):
            return
        results.append(compile_one(cfg))
        if results[-1]["memory"]["total"] <= budget:
            return


def _skipped(job: Candidate, skip: Callable[[Candidate], bool]) -> bool:
    job.skipped = skip(job)
    return job.skipped


def _one_by_one(
    jobs: list[Candidate],
    compile_one: Callable[[DryRunConfig], dict[str, Any]],
    budget: float,
    done: Callable[[Candidate], None],
    skip: Callable[[Candidate], bool],
    deadline: float | None = None,
) -> None:
    """Each job compiled in this process's turn (one compile, or one extrapolated dry run, at a
    time), none started past ``deadline``."""
    for job in jobs:
        if _past(deadline):
            return
        if _skipped(job, skip):
            continue
        try:
            _until_fits(job.configs, compile_one, budget, job.results, deadline)
        except ShardkitError as e:  # one layout that fails to compile is one row of the plan, not the end of it
            job.error = str(e)
        done(job)


def serve(devices: int, jobs: TextIO, replies: TextIO) -> None:
    """A worker: answer each job line of ``jobs`` on ``replies``, a line per compiled setting and
    an end line."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)

    def compile_and_send(fields: dict[str, Any]) -> dict[str, Any]:
        result = _in_process(DryRunConfig(**fields))
        replies.write(json.dumps({"result": result}) + "\n")
        replies.flush()
        return result

    for line in jobs:
        job = json.loads(line)
        end: dict[str, Any] = {"end": True}
        try:
            _until_fits(job["configs"], compile_and_send, job["budget"], [])
        except Exception as e:  # one layout that fails to compile is one row of the plan, not the end of it
            end["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        replies.write(json.dumps(end) + "\n")
        replies.flush()


def main() -> None:
    # Ctrl-C in a terminal reaches the whole process group: the planner answers it (it prints
    # the partial table and kills its workers), so a worker ignores it. A planner that dies
    # closes the pipe, and the worker ends after its current compile.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Replies go to the real stdout; anything else printed while compiling goes to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    serve(int(sys.argv[1]), sys.stdin, replies)


if __name__ == "__main__":
    main()
