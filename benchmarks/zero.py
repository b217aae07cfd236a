"""ZeRO stages over the data axis against plain data parallelism and FSDP (ZeRO-3): memory per
device and bytes moved, from compiled dry runs (nothing is allocated).

    python benchmarks/zero.py                               # GPT mini on 8 simulated devices, bf16-master
    python benchmarks/zero.py --model gpt2-small --devices 64 --json benchmarks/results/zero.json

Each row compiles one train step. "formula" is ZeRO's per-device model state in mixed precision
(Rajbhandari et al. 2020): stage 0 16P (2 params + 2 grads + 12 optimizer), stage 1 4P + 12P/N,
stage 2 2P + 14P/N, stage 3 16P/N, of which the gradients are 2P (2P/N from stage 2 on) and the
rest is state; "state" is what the compiled step holds for the parameters, master weights and
moments (its arguments); "temp B/P" is the step's temporary memory per parameter (gradients,
activations, transients). With ``--microbatches K`` a last row accumulates K microbatches under
ZeRO-2 (on the gradient shards).
"""

import argparse

from _results import write_json

import shardkit as sk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="the preset's layer count by default")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    n = args.devices
    rows = []
    runs = [
        ("data (ZeRO-0)", f"data={n}", 0, 1),
        ("ZeRO-1", f"data={n}", 1, 1),
        ("ZeRO-2", f"data={n}", 2, 1),
        ("fsdp (ZeRO-3)", f"fsdp={n}", 0, 1),
    ]
    if args.microbatches > 1:
        runs.append((f"ZeRO-2, {args.microbatches} mb", f"data={n}", 2, args.microbatches))
    for name, layout, zero, micro in runs:
        r = sk.dryrun(
            args.model,
            layout=layout,
            batch=args.batch,
            seq=args.seq,
            precision="bf16-master",
            zero=zero,
            microbatches=micro,
            n_layers=args.layers,
            fsdp_min_size=0,  # stage 3 as the paper counts it: every parameter split, norm scales too
        )
        p = r["parameters"]
        stage = 3 if layout.startswith("fsdp") else zero
        formula = {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}[stage]
        state_formula = {0: 14 * p, 1: 2 * p + 12 * p / n, 2: 2 * p + 12 * p / n, 3: 14 * p / n}[stage]
        memory = r["memory"]
        state = memory["params"] + memory["optimizer"] + memory["master"]
        rows.append(
            {
                "stage": name,
                "layout": layout,
                "zero": zero,
                "parameters": p,
                "state_MB": state / 1e6,
                "formula_state_MB": state_formula / 1e6,
                "temp_MB": memory["temp"] / 1e6,
                "temp_bytes_per_parameter": memory["temp"] / p,
                "total_MB": memory["total"] / 1e6,
                "formula_MB": formula / 1e6,
                "moved_MB": sum(r["bytes_by_axes"].values()) / 1e6,
            }
        )
    print(f"{args.model}, {n} simulated devices, batch {args.batch} x {args.seq}, bf16-master, AdamW")
    heads = ("state MB", "formula", "temp MB", "temp B/P", "total MB", "ZeRO MB", "moved MB")
    print(f"{'stage':16s} " + " ".join(f"{h:>9s}" for h in heads))
    for row in rows:
        print(
            f"{row['stage']:16s} {row['state_MB']:9.2f} {row['formula_state_MB']:9.2f} {row['temp_MB']:9.2f} "
            f"{row['temp_bytes_per_parameter']:9.2f} {row['total_MB']:9.2f} {row['formula_MB']:9.2f} "
            f"{row['moved_MB']:9.2f}"
        )
    if args.json:
        write_json(args.json, {"model": args.model, "devices": n, "rows": rows})


if __name__ == "__main__":
    main()
