"""The zoo (``zoo.py``) wrapped for shardkit: ``model(name)`` as a user would wrap each, and the
loss and batches that go with it (``shardkit dryrun --model zoo_factories:llama_style`` works too)."""

from __future__ import annotations

import jax.numpy as jnp
from zoo import ZOO

import shardkit as sk


def model(name: str, boundaries: bool | str = True) -> sk.Model:
    """The zoo's model ``name`` as a :class:`shardkit.Model` (``boundaries`` as ``from_nnx`` takes it)."""
    entry = ZOO[name]
    if entry.linen is not None:
        return sk.from_linen(entry.linen, jnp.zeros((2, 32), jnp.int32), boundaries=boundaries)
    return sk.from_nnx(entry.make, boundaries=boundaries)


def trainer(name: str, optimizer, layout: str, boundaries: bool | str = True, **kwargs) -> sk.Trainer:
    """A trainer of the zoo's model ``name`` with its own loss."""
    return sk.Trainer(model(name, boundaries), optimizer, layout, loss=ZOO[name].loss, **kwargs)


def gemma_style() -> sk.Model:
    return model("gemma_style")


def llama_style() -> sk.Model:
    return model("llama_style")
