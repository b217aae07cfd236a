"""Every test process sees 8 simulated CPU devices, set before JAX starts its backend."""

import shardkit as sk

sk.simulate_devices(8)

import jax
import pytest

assert len(jax.devices()) == 8, "conftest must run before anything starts JAX"


@pytest.fixture(scope="session")
def devices():
    return jax.devices()
