"""Dry runs past the CPU compiler's 2048 devices: how good the fit is, and what it costs.

1. Against full compiles (at sizes the compiler takes): a layout compiled whole, and extrapolated
   from two compiles with its fsdp (or data) axis, and the global batch, at a quarter and a half of
   their size: memory per device, bytes moved and matmul FLOPs, extrapolated / compiled.
2. At sizes past the limit: llama2-70b on 4,096 to 16,384 devices, and Llama 3.1 70B and 405B
   (the shipped configs, ``--init-from``) on 131,072: wall time of the whole dry run (its two
   compiles run side by side) and the host memory of each compile. Goal: under 60 s and 4 GB.

Every run is ``shardkit dryrun`` in a fresh process, bf16 parameters with fp32 master weights,
Adam, full remat, sequence 4096. A model named like ``llama-3.1-70b`` is a shipped config.

    python benchmarks/dryrun_extrapolate.py            # both tables, JSON to benchmarks/results/
    python benchmarks/dryrun_extrapolate.py --quick    # one check, and the 131,072-device runs
"""

import argparse
import importlib
import json
import subprocess
import sys
import time

from _results import write_json

CHECKS = [
    ("llama2-7b", "fsdp=256,tensor=8", 256),
    ("llama2-13b", "fsdp=256,tensor=8", 256),
    ("llama2-7b", "data=64,fsdp=4,tensor=8", 256),
    ("llama-3.1-70b", "fsdp=64,tensor=8", 64),
    ("llama-3.1-70b", "fsdp=128,tensor=8", 128),
    ("llama-3.1-70b", "fsdp=256,tensor=8", 256),
    ("llama-3.1-405b", "fsdp=256,tensor=8", 256),
]
FAR = [("llama2-70b", "fsdp=512,tensor=8", 4096), ("llama2-70b", "fsdp=1024,tensor=8", 4096)]
FAR.append(("llama2-70b", "fsdp=2048,tensor=8", 4096))
FAR += [("llama-3.1-70b", "fsdp=16384,tensor=8", 16384), ("llama-3.1-405b", "fsdp=16384,tensor=8", 16384)]
GOAL_SECONDS, GOAL_HOST_GB = 60.0, 4.0


def model_flags(model: str) -> list[str]:
    return ["--init-from", model] if model.startswith("llama-3") else ["--model", model]


def cli_dryrun(model: str, layout: str, batch: int) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "shardkit.cli", "dryrun", *model_flags(model), "--layout", layout]
    cmd += ["--batch", str(batch), "--seq", "4096", "--precision", "bf16-master", "--remat", "full", "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout), time.perf_counter() - start


def extrapolated_below(model: str, layout: str, batch: int) -> dict:
    """The layout extrapolated from its axis at a quarter and a half (the limit lowered to half)."""
    ex = importlib.import_module("shardkit.analysis.extrapolate")
    from shardkit.core.mesh import Layout

    parsed = Layout.parse(layout)
    shrink = ex.shrink_plan(parsed, limit=parsed.num_devices // 2)
    parts = [cli_dryrun(model, shrink.layout(parsed, size), shrink.batch(batch, size))[0] for size in shrink.sizes]
    return ex.extrapolate(*parts, shrink, parsed)


def moved(result: dict) -> float:
    return sum(c["moved_bytes"] for c in result["collectives"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="benchmarks/results/dryrun_extrapolate.json")
    args = parser.parse_args()
    checks, far = (CHECKS[:1], FAR[-2:]) if args.quick else (CHECKS, FAR)
    rows = []
    print(f"{'model':14s} {'layout':24s} {'devices':>7s} {'memory ext/full':>15s} {'bytes':>7s} {'FLOPs':>7s}")
    from shardkit.core.errors import LayoutError

    for model, layout, batch in checks:
        full, _ = cli_dryrun(model, layout, batch)
        try:
            got = extrapolated_below(model, layout, batch)
        except LayoutError as refused:  # the two smaller programs differ: the fit is refused, not guessed
            rows.append({"model": model, "layout": layout, "devices": full["devices"], "refused": str(refused)})
            print(f"{model:14s} {layout:24s} {full['devices']:7d} refused: {str(refused).split(':')[1][:60]}")
            continue
        row = {
            "model": model,
            "layout": layout,
            "devices": full["devices"],
            "from_devices": got["extrapolated"]["from_devices"],
            "memory_full": full["memory"],
            "memory_extrapolated": got["memory"],
            "memory_ratio": got["memory"]["total"] / full["memory"]["total"],
            "bytes_ratio": moved(got) / moved(full),
            "flops_ratio": got["flops_per_device"] / full["flops_per_device"],
        }
        rows.append(row)
        print(
            f"{model:14s} {layout:24s} {row['devices']:7d} {row['memory_ratio']:15.4f} "
            f"{row['bytes_ratio']:7.4f} {row['flops_ratio']:7.4f}"
        )
    print()
    print(
        f"{'model':14s} {'layout':24s} {'devices':>7s} {'wall s':>7s} {'host GB (each compile)':>24s} {'GB/device':>9s}"
    )
    scale = []
    for model, layout, batch in far:
        result, seconds = cli_dryrun(model, layout, batch)
        each = [b / 1e9 for b in result["extrapolated"]["host_memory_bytes"]]
        scale.append(
            {
                "model": model,
                "layout": layout,
                "devices": result["devices"],
                "seconds": seconds,
                "host_memory_gb": each,
                "memory_per_device_gb": result["memory"]["total"] / 1e9,
                "from_devices": result["extrapolated"]["from_devices"],
                "met": seconds < GOAL_SECONDS and sum(each) < GOAL_HOST_GB,
            }
        )
        print(
            f"{model:14s} {layout:24s} {result['devices']:7d} {seconds:7.1f} "
            f"{' + '.join(f'{g:.2f}' for g in each):>24s} {result['memory']['total'] / 1e9:9.2f}"
        )
    met = all(row["met"] for row in scale)
    print(
        f"goal: every run under {GOAL_SECONDS:.0f} s and {GOAL_HOST_GB:.0f} GB of host memory: "
        + ("met" if met else "MISSED")
    )
    write_json(args.json, {"checks": rows, "scale": scale, "goal_met": met})


if __name__ == "__main__":
    main()
