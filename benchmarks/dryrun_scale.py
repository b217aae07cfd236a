"""How far a laptop sees: compile seconds and peak host memory of dry runs of large models.

Each dry run is a fresh process (its own simulated device count), compiling the full train
step (bf16 parameters, fp32 master weights, Adam, full remat) from abstract shapes.

    python benchmarks/dryrun_scale.py                  # the table below, JSON to benchmarks/results/
    python benchmarks/dryrun_scale.py --quick          # 7B on 64 devices and 12/24 layers only

Goals: llama2-70b on 512 devices compiles in under 60 s with under 4 GB of host memory on a
2-core machine; 96 layers compile within 1.3x the time of 12 (the layer stack is scanned).
"""

import argparse
import json
import subprocess
import sys
import time

from _results import write_json

SIZES = [("llama2-7b", 64), ("llama2-13b", 256), ("llama2-70b", 512)]
DEPTHS = [12, 24, 48, 96]


def dryrun(model, devices, layers=None, seq=4096):
    layout = f"fsdp={devices // 8},tensor=8"
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "dryrun",
        "--model",
        model,
        "--layout",
        layout,
        "--batch",
        str(devices),
        "--seq",
        str(seq),
        "--precision",
        "bf16-master",
        "--remat",
        "full",
        "--json",
    ]
    if layers:
        cmd += ["--layers", str(layers)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    d = json.loads(proc.stdout)
    return {
        "model": model,
        "devices": devices,
        "layout": layout,
        "layers": layers or d["config"]["n_layers"],
        "parameters": d["parameters"],
        "compile_seconds": d["compile_seconds"],
        "process_seconds": wall,
        "peak_host_memory_gb": d["peak_host_memory_bytes"] / 1e9,
        "model_state_gb_per_device": (d["memory"]["params"] + d["memory"]["optimizer"] + d["memory"]["master"]) / 1e9,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="benchmarks/results/dryrun_scale.json")
    args = parser.parse_args()
    sizes = SIZES[:1] if args.quick else SIZES
    depths = DEPTHS[:2] if args.quick else DEPTHS

    rows = [dryrun(model, n) for model, n in sizes]
    print(
        f"{'model':12s} {'devices':>7s} {'params':>8s} {'compile s':>9s} {'process s':>9s} {'host GB':>8s} "
        f"{'state GB/dev':>12s}"
    )
    for r in rows:
        print(
            f"{r['model']:12s} {r['devices']:7d} {r['parameters'] / 1e9:7.1f}B {r['compile_seconds']:9.2f} "
            f"{r['process_seconds']:9.2f} {r['peak_host_memory_gb']:8.2f} {r['model_state_gb_per_device']:12.2f}"
        )

    depth_rows = [dryrun("llama2-7b", 64, layers=L) for L in depths]
    base = depth_rows[0]["compile_seconds"]
    print(f"\n{'layers':>6s} {'compile s':>9s} {'vs 12':>6s}   (llama2-7b shape, 64 devices)")
    for r in depth_rows:
        print(f"{r['layers']:6d} {r['compile_seconds']:9.2f} {r['compile_seconds'] / base:6.2f}")

    goals = {}
    big = [r for r in rows if r["model"] == "llama2-70b"]
    if big:
        goals["70b_512_compile_under_60s"] = big[0]["compile_seconds"] < 60
        goals["70b_512_host_memory_under_4gb"] = big[0]["peak_host_memory_gb"] < 4
    goals["deepest_within_1.3x_of_12_layers"] = depth_rows[-1]["compile_seconds"] <= 1.3 * base
    print("\ngoals:", goals)
    write_json(args.json, {"sizes": rows, "depths": depth_rows, "goals": goals})


if __name__ == "__main__":
    main()
