"""Every test process sees 8 simulated CPU devices, set before JAX starts its backend."""

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
