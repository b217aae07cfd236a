"""Long context: attention's memory and time, the whole score matrix against the blocked kernel
(shardkit.parallel.attention).

Three tables, on 8 simulated CPU devices:

1. Temporaries per device of a compiled train step (``trainer.report``), ``data=8``, one row of
   T tokens per device: the ``mini`` GPT and the Gemma 2 fixture's config (soft caps, a sliding
   window on alternate layers), with ``attention="xla"`` (every score formed) and the default.
2. Seconds of one attention's forward and backward on the CPU, by length: the score matrix
   (``jax.nn.dot_product_attention``, and the same masks written out) against the blocked
   kernel; where the ratio crosses 1 is ``BLOCKED_FROM``.
3. What skipping hidden blocks saves: the blocked kernel's time for causal attention and a
   window against attention with no mask, with the tiles it scores.

    python benchmarks/long_context.py                  # the tables at 1k-16k tokens
    python benchmarks/long_context.py --quick          # small sizes (the test suite's)
"""

import argparse
import json
import pathlib
import time

from _results import write_json

import shardkit as sk

sk.simulate_devices(8)

import flax
import jax
import jax.numpy as jnp
import optax

from shardkit.models.hf_config import gpt_config
from shardkit.parallel.attention import BLOCKED_FROM, visited_blocks

GEMMA2 = pathlib.Path(__file__).parent.parent / "tests" / "fixtures" / "hf_reference" / "gemma2" / "config.json"


def step_temporaries(name: str, tokens: int, attention: str | None) -> dict:
    """The compiled train step's temporaries per device (GB) for one row of ``tokens`` per device."""
    if name == "mini":
        cfg = sk.models.GPTConfig.preset("mini", max_seq=tokens, attention=attention)
    else:
        cfg = gpt_config(json.loads(GEMMA2.read_text()), max_seq=tokens, attention=attention)
    batch = {"tokens": jax.ShapeDtypeStruct((8, tokens + 1), jnp.int32)}
    report = sk.Trainer(cfg.model(), optax.adamw(1e-3), "data=8").report(batch)
    return {"temp_gb": report.memory.temp / 1e9, "total_gb": report.memory.total / 1e9}


def seconds(fn, *args, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls, after one to compile."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def attention_seconds(tokens: int, **masks) -> dict:
    """Forward and backward of one layer's attention (mini's heads: 8 queries, 4 kv, 16 dims)."""
    q, kv = jnp.ones((1, tokens, 8, 16)), jnp.ones((1, tokens, 4, 16))
    out = {}
    for name, attend in (
        ("jax_nn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
        ("materialized", lambda q, k, v: sk.attention(q, k, v, implementation="materialized", **masks)),
        ("blocked", lambda q, k, v: sk.attention(q, k, v, implementation="blocked", **masks)),
    ):
        if name == "jax_nn" and masks:
            continue
        grad = jax.jit(jax.grad(lambda q, k, v, f=attend: f(q, k, v).sum(), argnums=(0, 1, 2)))
        out[name] = seconds(grad, q, kv, kv)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: 256-1024 tokens")
    parser.add_argument("--json", default="benchmarks/results/long_context.json")
    args = parser.parse_args()
    step_lengths = (256, 1024) if args.quick else (1024, 4096, 16384)
    time_lengths = (256, 512, 1024) if args.quick else (256, 384, 512, 1024, 2048, 4096)
    skip_length = 1024 if args.quick else 8192
    result: dict = {"versions": {"jax": jax.__version__, "flax": flax.__version__}, "blocked_from": BLOCKED_FROM}

    print(f"{'model':8s} {'tokens':>7s} {'every score GB':>15s} {'blocked GB':>11s} {'ratio':>7s}")
    result["step_temporaries"] = []
    for name in ("mini", "gemma2"):
        for tokens in step_lengths:
            whole, blocked = step_temporaries(name, tokens, "xla"), step_temporaries(name, tokens, "blocked")
            row = {"model": name, "tokens": tokens, "xla": whole, "blocked": blocked}
            result["step_temporaries"].append(row)
            ratio = whole["temp_gb"] / blocked["temp_gb"]
            print(f"{name:8s} {tokens:7d} {whole['temp_gb']:15.3f} {blocked['temp_gb']:11.3f} {ratio:7.1f}", flush=True)

    print(f"\n{'tokens':>7s} {'jax.nn s':>9s} {'scores s':>9s} {'blocked s':>10s} {'blocked/jax.nn':>15s}")
    result["attention_seconds"] = []
    for tokens in time_lengths:
        row = {"tokens": tokens, **attention_seconds(tokens)}
        result["attention_seconds"].append(row)
        print(
            f"{tokens:7d} {row['jax_nn']:9.4f} {row['materialized']:9.4f} {row['blocked']:10.4f} "
            f"{row['blocked'] / row['jax_nn']:15.2f}",
            flush=True,
        )

    print(f"\n{'mask':18s} {'tiles':>6s} {'blocked s':>10s} {'vs no mask':>11s}")
    window = skip_length // 8
    q = jnp.ones((1, skip_length, 8, 16))
    kv = jnp.ones((1, skip_length, 4, 16))
    result["skipping"] = []
    base = None
    for label, masks in (("none", dict(causal=False)), ("causal", {}), (f"window {window}", dict(window=window))):
        grad = jax.jit(
            jax.grad(lambda q, k, v, m=masks: sk.attention(q, k, v, implementation="blocked", **m).sum(), (0, 1, 2))
        )
        took = seconds(grad, q, kv, kv)
        base = base or took
        tiles = visited_blocks(skip_length, skip_length, causal=masks.get("causal", True), window=masks.get("window"))
        result["skipping"].append({"mask": label, "tiles": tiles, "seconds": took, "vs_no_mask": took / base})
        print(f"{label:18s} {tiles:6d} {took:10.4f} {took / base:11.2f}", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
