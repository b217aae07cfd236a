"""Doctests of the package (``pytest`` collects ``shardkit/`` too) see the same 8 simulated CPU
devices as the tests, set before JAX starts its backend.

The whole test session shares one persistent JAX compilation cache, in a fresh temporary
directory: the tests compile the same small programs again and again, in this process, in the
other xdist worker and in the subprocesses they start (CLI runs, README blocks, notebooks,
multi-process jobs), and compiling is most of their time on a CPU. Each session starts empty,
so every distinct program is still compiled once per run. ``shardkit.partitioned`` keeps the
report's dump compiles out of such a cache; ``tests/test_partitioned.py`` checks that.
"""

import atexit
import os
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # The first process of the session (pytest itself, before xdist starts its workers) makes
    # the directory; the workers and every subprocess inherit the variables.
    _cache = tempfile.mkdtemp(prefix="shardkit-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Compiles under 0.3 s are cheaper to repeat than to store and load.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
    # A size limit turns on JAX's file lock, which the processes writing this cache at once need.
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import shardkit as sk

sk.simulate_devices(8)
