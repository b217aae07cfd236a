"""A small worker for the launcher tests: `python tests/launch_worker.py MODE [MARKER]`.

MODE:
- sleep MARKER: print the pid, start a child that sleeps (MARKER in its command line), sleep;
- stubborn MARKER: the same, ignoring SIGTERM;
- sync: join jax.distributed, print the pid, synchronise with the others every 0.2 s;
- join: join jax.distributed, say where this process sits, and exit;
- init: the same, and one collective with the others first (extra arguments ignored).

A ShardkitError is printed as the CLI would, with exit code 2.
"""

import os
import signal
import subprocess
import sys
import time

mode = sys.argv[1]
rank = os.environ.get("SHARDKIT_PROCESS_ID", "?")
if mode in ("sleep", "stubborn"):
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    marker = sys.argv[2]  # in the child's command line, so a test finds it in the process table
    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(300)  # {marker}"])
    print(f"pid {os.getpid()} child {child.pid}", flush=True)
    time.sleep(300)
    sys.exit(0)

from shardkit.core.errors import ShardkitError
from shardkit.runtime import distributed

try:
    distributed.initialize(timeout_s=60)
except ShardkitError as e:
    print(f"shardkit: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
import jax

print(
    f"pid {os.getpid()} process {jax.process_index()} of {jax.process_count()}, "
    f"{len(jax.local_devices())} local of {len(jax.devices())} devices",
    flush=True,
)
from jax.experimental import multihost_utils

multihost_utils.sync_global_devices("joined")  # one collective: the processes really talk
if mode == "sync":
    for i in range(300):
        multihost_utils.sync_global_devices(f"tick{i}")
        time.sleep(0.2)
