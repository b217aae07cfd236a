"""Layouts on models shardkit did not write: measured/bound bytes and memory, before and after
module boundaries (examples/byo_models.py: a Gemma-style NNX LM and a Linen LM, neither of which
constrains its activations).

"before" wraps the model with ``boundaries=False`` (what a user got until now: XLA's guess);
"after" is the default. The third model, ``nnx-plain``, names no axes at all (Flax's built-in
layers, no metadata): its "before" also keeps every parameter whole on every device, as it was
until shardkit split unnamed parameters over fsdp. Each row is one compiled train step on 8
simulated CPU devices.

    python benchmarks/any_model.py                   # dim 256, 4 layers, batch 16 x 128
    python benchmarks/any_model.py --dim 64 --layers 2 --seq 32 --json benchmarks/results/any_model.json
    python benchmarks/any_model.py --layers 8 --remat   # each layer recomputed (nnx.remat / nn.remat)
    python benchmarks/any_model.py --layers 8 --remat dots   # only the gathered weights recomputed
    python benchmarks/any_model.py --kv-heads 8 --layout tensor=8 --layout data=2,fsdp=4
    python benchmarks/any_model.py --zoo    # examples/zoo.py: eight styles, four layouts, the named excess

The hybrid and ``tensor=8`` rows also measure shardkit's rewrite of the backward pass
(``shardkit.parallel.input_gradients``): separate projections of one input reduce their input
gradient once, the embedding table's gradient is reduced onto its shards.
"""

import argparse
import pathlib
import sys

from _results import write_json

import shardkit as sk

sk.simulate_devices(8)
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))

import jax
import jax.numpy as jnp
import optax
from byo_models import GemmaLM, LinenLM, LMConfig, PlainLM
from jax.sharding import PartitionSpec

LAYOUTS = ("data=8", "fsdp=8", "data=2,fsdp=2,tensor=2")


def models(cfg: LMConfig, seq: int):
    return {
        "nnx-gemma": lambda b: sk.from_nnx(lambda rngs: GemmaLM(cfg, rngs=rngs), boundaries=b),
        "linen-lm": lambda b: sk.from_linen(LinenLM(cfg), jnp.zeros((2, seq), jnp.int32), boundaries=b),
        "nnx-plain": lambda b: plain(cfg, b),
    }


def plain(cfg: LMConfig, after: bool) -> sk.Model:
    model = sk.from_nnx(lambda rngs: PlainLM(cfg, rngs=rngs), boundaries=after)
    return model if after else sk.annotate(model, [(r".*", PartitionSpec())])  # every parameter whole


def row(name, when, layout, report):
    # Activations reduced over fsdp in the forward pass (all-reduces, or all-reduces each device
    # then slices, which the report names reduce-scatters): what the boundaries remove.
    act_fsdp = sum(
        c.moved_bytes
        for c in report.collectives
        if "fsdp" in c.axes and (c.kind == "all-reduce" or (c.kind == "reduce-scatter" and c.direction == "forward"))
    )
    return {
        "model": name,
        "when": when,
        "layout": layout,
        "bytes_ratio": report.ratios["bytes"],
        "moved_mb": report.moved_bytes / 1e6,
        "bound_mb": report.lower_bound["bytes_per_device"] / 1e6,
        "all_reduce_over_fsdp_mb": act_fsdp / 1e6,
        "reduce_scatter": any(c.kind == "reduce-scatter" and c.direction == "backward" for c in report.collectives),
        "temp_mb": report.memory.temp / 1e6,
        "state_mb": report.memory.arguments / 1e6,
        "gflops_per_device": report.flops_per_device / 1e9,
    }


ZOO_LAYOUTS = ("data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "data=4,tensor=2")


def zoo(layouts, json_path: str) -> None:
    """Each model of examples/zoo.py at its own size: bytes/bound without boundaries and with
    them, and the share of the excess the report names ("beyond the bound:")."""
    import warnings

    import numpy as np
    from zoo import ZOO
    from zoo_factories import trainer

    warnings.filterwarnings("ignore", message=".*names no parameter")  # the CNN under tensor=2, as warned
    rows = []
    for name, entry in ZOO.items():
        batch = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in entry.batch(0).items()}
        for layout in layouts or ZOO_LAYOUTS:
            ratio = {}
            for when, boundaries in (("off", False), ("on", True)):
                report = trainer(name, optax.adamw(1e-3), layout, boundaries=boundaries).report(batch)
                ratio[when] = report.ratios["bytes"]
            excess = report.moved_bytes - report.lower_bound["bytes_per_device"]
            named = sum(e.moved_bytes for e in report.beyond())
            rows.append(
                {
                    "model": name,
                    "layout": layout,
                    "bytes_ratio_boundaries_off": ratio["off"],
                    "bytes_ratio": ratio["on"],
                    "moved_mb": report.moved_bytes / 1e6,
                    "bound_mb": report.lower_bound["bytes_per_device"] / 1e6,
                    "excess_mb": excess / 1e6,
                    "named_mb": named / 1e6,
                    "named_share": named / excess if excess > 0 else None,
                    "largest_named": report.beyond()[0].op if report.beyond() else None,
                }
            )
            r = rows[-1]
            share = "-" if r["named_share"] is None else f"{r['named_share']:.2f}"
            largest = r["largest_named"] or ""
            print(
                f"{name:16s} {layout:24s} {r['bytes_ratio_boundaries_off']:9.2f} {r['bytes_ratio']:9.2f} "
                f"{r['moved_mb']:9.3f} {r['bound_mb']:9.3f} {r['named_mb']:9.3f} {share:>6s}  {largest}",
                flush=True,
            )
    write_json(json_path, {"versions": {"jax": jax.__version__}, "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--remat",
        nargs="?",
        const="full",
        choices=["full", "dots"],
        help="the models recompute each layer in the backward pass: everything (full), or all but the "
        "matmul outputs (dots: jax.checkpoint_policies.dots_saveable, so FSDP gathers the weights again)",
    )
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (8 lets tensor=8 split them)")
    parser.add_argument(
        "--layout", action="append", help=f"a layout to measure (repeat the flag; default: {', '.join(LAYOUTS)})"
    )
    parser.add_argument("--zoo", action="store_true", help="measure examples/zoo.py's eight models instead")
    parser.add_argument("--json", default=None, help="default benchmarks/results/any_model.json (zoo: zoo.json)")
    args = parser.parse_args()
    if args.zoo:
        print(
            f"{'model':16s} {'layout':24s} {'off/bound':>9s} {'on/bound':>9s} {'moved MB':>9s} {'bound MB':>9s} "
            f"{'named MB':>9s} {'named':>6s}  largest named"
        )
        return zoo(args.layout, args.json or "benchmarks/results/zoo.json")
    cfg = LMConfig(
        dim=args.dim,
        mlp=4 * args.dim,
        heads=8,
        kv_heads=args.kv_heads,
        head_dim=args.dim // 8,
        layers=args.layers,
        remat=args.remat is not None,
        remat_policy=jax.checkpoint_policies.dots_saveable if args.remat == "dots" else None,
    )
    batch = {"tokens": jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)}
    rows = []
    for name, make in models(cfg, args.seq).items():
        for when, boundaries in (("before", False), ("after", True)):
            for layout in args.layout or LAYOUTS:
                report = sk.Trainer(make(boundaries), optax.adamw(1e-3), layout).report(batch)
                rows.append(row(name, when, layout, report))
    print(
        f"{'model':10s} {'when':7s} {'layout':24s} {'moved/bound':>11s} {'AR fsdp MB':>10s} {'RS':3s} "
        f"{'temp MB':>8s} {'state MB':>8s} {'GFLOP/dev':>9s}"
    )
    for r in rows:
        print(
            f"{r['model']:10s} {r['when']:7s} {r['layout']:24s} {r['bytes_ratio']:11.2f} "
            f"{r['all_reduce_over_fsdp_mb']:10.2f} {'yes' if r['reduce_scatter'] else 'no':3s} "
            f"{r['temp_mb']:8.2f} {r['state_mb']:8.2f} {r['gflops_per_device']:9.3f}"
        )
    write_json(
        args.json or "benchmarks/results/any_model.json",
        {"config": vars(args), "versions": {"jax": jax.__version__}, "rows": rows},
    )


if __name__ == "__main__":
    main()
