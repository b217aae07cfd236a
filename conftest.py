"""Doctests of the package (``pytest`` collects ``shardkit/`` too) see the same 8 simulated CPU
devices as the tests, set before JAX starts its backend, and compile with the tests' XLA flags
(``tests/helpers.py:TEST_XLA_FLAGS``)."""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent / "tests"))
from helpers import TEST_XLA_FLAGS

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import shardkit as sk

sk.simulate_devices(8)


def pytest_configure(config):
    """Under ``-n 2``, xdist hands each worker its next test one at a time (``--maxschedchunk 1``
    unless given). Its default first hands each worker a quarter of its share in one block, in
    collection order: with the slow tests first, one worker got all 69 of them (2,060 s) while
    the other ran the remaining 770 (about 1,260 s) and then waited."""
    if getattr(config.option, "maxschedchunk", 0) is None:  # xdist installed, option not given
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    """The tests marked slow run first. Two workers taking one test at a time then end together: a
    several-minute test handed out last would leave the other worker idle for its whole length. (A
    test that shares a module-scoped fixture with fast ones stays unmarked: split apart, they would
    build it twice.)"""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order otherwise
