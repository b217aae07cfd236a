"""Every test process sees 8 simulated CPU devices, set before JAX starts its backend."""

import gc
import pathlib
import sys

import shardkit as sk

# examples/ holds models written the way people outside shardkit write them (byo_models.py).
EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

sk.simulate_devices(8)

# Scripts that the multi-process tests start as workers; --doctest-modules must not import them.
collect_ignore = ["mp_worker.py", "launch_worker.py"]
collect_ignore_glob = ["fixtures/*"]  # fixtures/hf_reference/make_fixtures.py needs torch and transformers

import jax
import pytest

assert len(jax.devices()) == 8, "conftest must run before anything starts JAX"


@pytest.fixture(scope="session")
def devices():
    return jax.devices()


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs(request):
    """After each test module, the compiled programs its tests and caches hold are let go (the
    module's functools caches cleared, then JAX's): a worker of the suite compiles thousands of
    programs in one process, and XLA:CPU keeps each loaded executable's code while anything
    refers to it (two crashes of a worker inside XLA's compiler, late in a full run, are what
    this guards against)."""
    yield
    for value in list(vars(request.module).values()):
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()
    jax.clear_caches()
    gc.collect()
