"""LoRA against full fine-tuning: per-device memory of Llama 3.1 8B (its shipped config, a dry run
on 8 simulated devices, nothing allocated) and steps/s of a small GPT on this CPU.

    python benchmarks/lora.py                       # 8B dry runs + the CPU timing
    python benchmarks/lora.py --skip-8b --json out.json

- **memory**: ``trainer.report(batch, dry_run=True)`` of one compiled step, bf16 parameters with
  an fp32 master copy (``bf16-master``) or fp32, AdamW, ``fsdp=8``, batch 8 x 2048, full remat;
  LoRA r=16, alpha 32 on q, k, v, o, gate, up and down (peft's "all-linear" for Llama).
- **speed**: ``GPTConfig.preset("mini")`` (d=128, 4 layers), batch 16 x 128, ``data=8`` on 8
  simulated CPU devices, the median of timed steps after the compile; LoRA r=16 on the same seven
  projections.
"""

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import shardkit as sk

sk.simulate_devices(8)

import jax
import jax.numpy as jnp
import optax
from _results import write_json

from shardkit.models import hf
from shardkit.models.published import config_dir

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def memory_8b(precision: str, lora: sk.LoRA | None) -> dict:
    cfg = hf.gpt_config(hf.read_config(config_dir("llama-3.1-8b")), remat="full", max_seq=2048, lora=lora)
    trainer = sk.Trainer(cfg.model(), optax.adamw(1e-5), "fsdp=8", precision=precision)
    report = trainer.report({"tokens": jax.ShapeDtypeStruct((8, 2049), jnp.int32)}, dry_run=True)
    m = report.memory
    return {
        "params_gb": m.params / 1e9,
        "optimizer_gb": m.optimizer / 1e9,
        "master_gb": m.master / 1e9,
        "temp_gb": m.temp / 1e9,
        "total_gb": m.total / 1e9,
        "moved_gb": report.moved_bytes / 1e9,
        "gflops_per_device": report.flops_per_device / 1e9,
    }


def steps_per_second(lora: sk.LoRA | None, repeats: int) -> float:
    cfg = sk.models.GPTConfig.preset("mini", lora=lora)
    trainer = sk.Trainer(cfg.model(), optax.adamw(1e-3), "data=8")
    state, data = trainer.init(0), sk.TextDataset.builtin()
    batch = trainer.shard_batch(data.batch(0, 16, 128))
    state, _ = trainer.step(state, batch)  # compiles
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-8b", action="store_true", help="only the CPU timing")
    parser.add_argument("--json", default="benchmarks/results/lora.json")
    args = parser.parse_args()
    lora = sk.LoRA(rank=args.rank, alpha=2 * args.rank, targets=ALL_LINEAR)
    result: dict = {"config": vars(args), "versions": {"jax": jax.__version__}}
    if not args.skip_8b:
        rows = []
        for precision in ("bf16-master", "fp32"):
            for name, adapters in (("full", None), (f"lora r={args.rank}", lora)):
                row = {"precision": precision, "what": name, **memory_8b(precision, adapters)}
                rows.append(row)
                print(
                    f"llama-3.1-8b fsdp=8 {precision:11s} {name:10s} params {row['params_gb']:6.2f} GB  optimizer "
                    f"{row['optimizer_gb']:6.2f}  master {row['master_gb']:6.2f}  temp {row['temp_gb']:6.2f}  total "
                    f"{row['total_gb']:6.2f} GB/device  moved {row['moved_gb']:6.2f} GB  "
                    f"{row['gflops_per_device']:,.0f} GFLOP/device",
                    flush=True,
                )
        result["llama_3_1_8b"] = rows
    full, adapted = steps_per_second(None, args.repeats), steps_per_second(lora, args.repeats)
    result["cpu_mini"] = {"full_steps_per_s": full, "lora_steps_per_s": adapted, "lora_over_full": adapted / full}
    print(
        f"mini, data=8 on 8 simulated CPU devices: full {full:.2f} steps/s, LoRA {adapted:.2f} ({adapted / full:.2f}x)"
    )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
