"""A planner's compile worker: ``python -m shardkit.plan_worker DEVICES``.

It starts JAX once with ``DEVICES`` simulated CPU devices, then reads one job per line on
stdin, ``{"configs": [DryRunConfig fields, ...], "budget": bytes}``, compiles the configurations
in order until one fits the budget, and answers one line on stdout, ``{"results": [report
dicts]}`` (with ``"error"`` when a configuration failed to compile). The planner keeps a few of
these alive so that each compile pays for JAX's start-up only once per process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, TextIO


def serve(devices: int, jobs: TextIO, replies: TextIO) -> None:
    """Answer each job line of ``jobs`` with one line on ``replies``."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    from shardkit.dryrun import DryRunConfig, _in_process

    for line in jobs:
        job = json.loads(line)
        results: list[dict[str, Any]] = []
        reply: dict[str, Any] = {"results": results}
        try:
            for fields in job["configs"]:
                results.append(_in_process(DryRunConfig(**fields)))
                if results[-1]["memory"]["total"] <= job["budget"]:
                    break
        except Exception as e:  # one layout that fails to compile is one row of the plan, not the end of it
            reply["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        replies.write(json.dumps(reply) + "\n")
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
