"""Doctests of the package (``pytest`` collects ``shardkit/`` too) see the same 8 simulated CPU
devices as the tests, set before JAX starts its backend, and compile with the tests' XLA flags
(``tests/helpers.py:TEST_XLA_FLAGS``)."""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent / "tests"))
from helpers import TEST_XLA_FLAGS

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# The xdist workers and every process a test starts map their step buffers in huge pages, as the
# shardkit command does (shardkit.runtime.host_allocator); this process has started already.
from shardkit.runtime.host_allocator import with_huge_pages

os.environ.update(with_huge_pages())

import pytest

import shardkit as sk

sk.simulate_devices(8)


def pytest_collection_modifyitems(config, items):
    """Mark the developer's loop (``-m dev``, tests/tiers.py), then hand the slow tests out first."""
    from tiers import is_dev  # tests/tiers.py: which tests the developer's loop (-m dev) runs

    for item in items:
        name = getattr(item, "originalname", item.name)
        if is_dev(item.nodeid.split("::")[0], name, item.get_closest_marker("slow") is not None):
            item.add_marker(pytest.mark.dev)
    _slow_first(items)


def _slow_first(items):
    """The tests marked slow run first, so that no several-minute test is handed out last. (A test
    that shares a module-scoped fixture with fast ones stays unmarked: split apart, they would build
    it twice.) The suite is bound by the machine's 2 cores, not by how xdist shares the tests out:
    handing them out one at a time (``--maxschedchunk 1``) instead of in blocks ran as long
    (2,111 s against 2,079 s), each slow test slower beside another."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order otherwise
