"""Factories of the third-party-style models, as a user would name them on the command line
(``shardkit dryrun --model byo_factories:gemma_lm``)."""

import jax.numpy as jnp
from byo_models import GemmaLM, LinenLM, LMConfig

import shardkit as sk


def gemma_lm() -> sk.Model:
    return sk.from_nnx(lambda rngs: GemmaLM(LMConfig(dim=64, mlp=256, layers=2), rngs=rngs))


def linen_lm() -> sk.Model:
    return sk.from_linen(LinenLM(LMConfig(dim=64, mlp=256, layers=2)), jnp.zeros((2, 32), jnp.int32))


def not_a_model():
    return "a string"
