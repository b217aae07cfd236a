"""Golden compiled programs: what XLA emits for the reference GPT under three layouts, and for a
model shardkit did not write under two, pinned.

Each file in tests/golden/ is a summary of the compiled step's collectives (kind, mesh axes,
direction, op scope, executions per step, payload bytes). A change that alters what the compiler
emits (a refactor of the step, a new constraint, another jax version) fails here with the
difference, the way MaxText's HLO diff test does. When the change is intended, regenerate with

    SHARDKIT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py

and say in the commit why the program changed.
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import optax
import pytest

import shardkit as sk

GOLDEN = pathlib.Path(__file__).parent / "golden"
BATCH = {"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)}


def gemma():
    from byo_factories import gemma_lm  # a model shardkit did not write: pins the module boundaries

    return gemma_lm()


MODELS = {"gpt_tiny": lambda: sk.models.GPTConfig.preset("tiny").model(), "byo_gemma": gemma}
CASES = [
    ("gpt_tiny", "fsdp=8"),
    ("gpt_tiny", "data=2,tensor=4"),
    ("gpt_tiny", "data=2,fsdp=2,tensor=2"),
    ("byo_gemma", "fsdp=8"),
    ("byo_gemma", "data=2,fsdp=2,tensor=2"),
]


def summary(model: str, layout: str) -> dict:
    trainer = sk.Trainer(MODELS[model](), optax.adamw(1e-3), layout)
    report = trainer.report(BATCH)
    rows = sorted([c.kind, "+".join(c.axes), c.direction, c.op, c.count, c.payload_bytes] for c in report.collectives)
    return {
        "jax": jax.__version__,
        "layout": layout,
        "collectives": rows,
        "temp_bytes": report.memory.temp,
        "matmul_flops_per_device": report.flops_per_device,
    }


@pytest.mark.parametrize("model,layout", CASES)
def test_compiled_program_matches_its_golden_summary(model, layout):
    path = GOLDEN / f"{model}_{layout.replace(',', '_').replace('=', '')}.json"
    got = summary(model, layout)
    if os.environ.get("SHARDKIT_UPDATE_GOLDEN"):
        rows = ",\n  ".join(json.dumps(r) for r in got["collectives"])
        head = json.dumps({k: v for k, v in got.items() if k != "collectives"})[:-1]
        path.write_text(f'{head}, "collectives": [\n  {rows}\n]}}\n')  # one collective per line
    want = json.loads(path.read_text())
    if want["jax"] != got["jax"]:
        pytest.skip(f"golden summaries were made with jax {want['jax']}; this is {got['jax']}: regenerate them")
    missing = [r for r in want["collectives"] if r not in got["collectives"]]
    extra = [r for r in got["collectives"] if r not in want["collectives"]]
    assert not missing and not extra, f"collectives changed:\n  gone: {missing}\n  new:  {extra}"
    assert got["matmul_flops_per_device"] == want["matmul_flops_per_device"]
    assert got["temp_bytes"] == pytest.approx(want["temp_bytes"], rel=0.02)
