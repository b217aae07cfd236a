"""Doctests of the package (``pytest`` collects ``shardkit/`` too) see the same 8 simulated CPU
devices as the tests, set before JAX starts its backend."""

import shardkit as sk

sk.simulate_devices(8)
