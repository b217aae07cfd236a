"""Gradient accumulation: bytes, memory and speed of reducing the gradients once per step against
once per microbatch, from compiled train steps on simulated devices.

    python benchmarks/accumulation.py                          # GPT mini, 8 devices, 4 microbatches
    python benchmarks/accumulation.py --model tiny --json benchmarks/results/accumulation.json

"gradient MB" is what one device sends per step in the gradients' reductions (backward
all-reduces and reduce-scatters over data and fsdp; ring formulas); "bound" is reducing fp32
gradients once (a reduce-scatter over the axes that split a parameter, an all-reduce of the
shard over the rest). "all MB" adds every other collective (FSDP's parameter gathers run per
microbatch under both; a pipeline's stage hops too). The last lines time the data-parallel and
the pipelined step both ways, alternating runs, and print the ratio of tokens/s (simulated
devices on a shared CPU: a ratio, not speeds). Under a pipeline, "per microbatch" reduces in
each backward slot of the schedule.
"""

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _results import write_json

import shardkit as sk
from shardkit.core.rules import entry_axes

ROWS = {"data", "fsdp"}


def gradient_bytes(report: sk.Report) -> float:
    return sum(
        c.moved_bytes
        for c in report.collectives
        if c.direction == "backward" and c.kind in ("all-reduce", "reduce-scatter") and c.axes and set(c.axes) <= ROWS
    )


def reduction_bound(trainer: sk.Trainer) -> float:
    mesh, total = dict(trainer.mesh.shape), 0.0
    specs = jax.tree.leaves(trainer.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for spec, leaf in zip(specs, jax.tree.leaves(trainer.abstract_params), strict=True):
        used = {a for entry in spec for a in entry_axes(entry)}
        local = 4 * leaf.size / math.prod(mesh[a] for a in used - ROWS)
        scattered = math.prod(mesh.get(a, 1) for a in used & ROWS)
        reduced = math.prod(mesh.get(a, 1) for a in ROWS - used)
        total += (scattered - 1) / scattered * local + 2 * (reduced - 1) / reduced * local / scattered
    return total


def compiled_rows(model: sk.Model, layouts: list[str], k: int, shape: dict) -> list[dict]:
    rows = []
    for layout in layouts:
        for microbatches, reduce in ((1, "auto"), (k, "per_microbatch"), (k, "once")):
            trainer = sk.Trainer(model, optax.adamw(1e-3), layout, microbatches=microbatches, reduce_gradients=reduce)
            report = trainer.report(shape)
            rows.append(
                {
                    "layout": layout,
                    "microbatches": microbatches,
                    "reduce": "-" if microbatches == 1 else reduce,
                    "gradient_MB": gradient_bytes(report) / 1e6,
                    "bound_MB": reduction_bound(trainer) / 1e6,
                    "all_MB": sum(report.bytes_by_axes().values()) / 1e6,
                    "temp_MB": report.memory.temp / 1e6,
                }
            )
    return rows


def timed(model: sk.Model, layout: str, k: int, batch: dict, rounds: int, steps: int) -> dict:
    """tokens/s of reducing once and per microbatch, alternating ``rounds`` times."""
    trainers = {
        r: sk.Trainer(model, optax.adamw(1e-3), layout, microbatches=k, reduce_gradients=r)
        for r in ("per_microbatch", "once")
    }
    states = {r: t.init(0) for r, t in trainers.items()}
    sharded = {r: t.shard_batch(batch) for r, t in trainers.items()}
    for r, t in trainers.items():  # compile and warm up
        states[r], m = t.step(states[r], sharded[r])
        jax.block_until_ready(m["loss"])
    seconds = {r: [] for r in trainers}
    for _ in range(rounds):
        for r, t in trainers.items():
            start = time.perf_counter()
            for _ in range(steps):
                states[r], m = t.step(states[r], sharded[r])
            jax.block_until_ready(m["loss"])
            seconds[r].append(time.perf_counter() - start)
    tokens = batch["tokens"].shape[0] * (batch["tokens"].shape[1] - 1) * steps
    best = {r: tokens / min(s) for r, s in seconds.items()}
    return {"layout": layout, "tokens_per_s": best, "ratio_once": best["once"] / best["per_microbatch"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sk.simulate_devices(args.devices)
    n, k = args.devices, args.microbatches
    model = sk.models.GPTConfig.preset(args.model).model()
    shape = {"tokens": jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)}
    layouts = [f"data={n}", f"fsdp={n}", f"data={n // 4},fsdp=2,tensor=2", f"stage=2,data={n // 2}"]
    rows = compiled_rows(model, layouts, k, shape)
    print(f"GPT {args.model}, {n} simulated devices, batch {args.batch} x {args.seq}, fp32, AdamW")
    heads = ("K", "reduce", "gradient MB", "bound MB", "all MB", "temp MB")
    print(f"{'layout':24s} " + " ".join(f"{h:>15s}" for h in heads))
    for r in rows:
        print(
            f"{r['layout']:24s} {r['microbatches']:15d} {r['reduce']:>15s} {r['gradient_MB']:15.3f} "
            f"{r['bound_MB']:15.3f} {r['all_MB']:15.3f} {r['temp_MB']:15.2f}"
        )
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.seq + 1)).astype(np.int32)
    speeds = [timed(model, layout, k, {"tokens": tokens}, args.rounds, args.steps) for layout in layouts[::3]]
    print()
    for speed in speeds:
        print(
            f"{speed['layout']}, {k} microbatches: tokens/s once {speed['tokens_per_s']['once']:,.0f}, "
            f"per microbatch {speed['tokens_per_s']['per_microbatch']:,.0f}, ratio {speed['ratio_once']:.3f}"
        )
    if args.json:
        write_json(args.json, {"model": args.model, "devices": n, "microbatches": k, "rows": rows, "speeds": speeds})


if __name__ == "__main__":
    main()
