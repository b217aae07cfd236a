"""Tokens per second and model FLOPs utilisation of the reference GPT on whatever device is here.

MFU = model FLOPs per step / (devices x peak FLOP/s x step time), with model FLOPs counted as
PaLM does: 6 x (parameters in matmuls) per token for the forward and backward passes, plus
12 x layers x hidden x sequence per token for attention. Peak FLOP/s comes from the hardware
profile of the GPU found (H100, H200, A100); on a CPU, which has no published peak, it is the
measured rate of a large matmul in the same dtype, and the table says so.

    python benchmarks/mfu.py                                  # CPU: small model, 8 simulated devices
    python benchmarks/mfu.py --gpu --model llama-1b --precision bf16 --batch 8 --seq 2048 --attention cudnn
"""

import argparse
import statistics
import sys
import time

from _results import write_json

import shardkit as sk

if "--gpu" not in sys.argv:
    sk.simulate_devices(8)

import jax
import jax.numpy as jnp
import optax

from shardkit.analysis.hardware import PROFILES


def peak_flops(dtype):
    """(peak FLOP/s per device, where the figure comes from)."""
    kind = jax.devices()[0].device_kind.lower()
    for name in ("h200", "h100", "a100"):
        if name in kind:
            return PROFILES[name].peak_flops(dtype), f"{name} profile"
    n = 2048
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times), f"measured {n}x{n} matmul on {jax.devices()[0].platform}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mini")
    parser.add_argument("--layout", default="data=-1")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", default="fp32", help="fp32, bf16 or bf16-master")
    parser.add_argument("--attention", default=None, help="dot_product_attention implementation: xla or cudnn")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--gpu", action="store_true", help="use the accelerator (default: 8 simulated CPU devices)")
    parser.add_argument("--json", default="benchmarks/results/mfu.json")
    args = parser.parse_args()

    cfg = sk.models.GPTConfig.preset(args.model, attention=args.attention, remat=args.remat)
    trainer = sk.Trainer(cfg.model(), optax.adamw(1e-4), args.layout, precision=args.precision)
    data = sk.TextDataset.builtin()
    batches = [trainer.shard_batch(data.batch(s, args.batch, args.seq)) for s in range(2)]
    state = trainer.init(0)
    start = time.perf_counter()
    state, metrics = trainer.step(state, batches[0])
    jax.block_until_ready(metrics)
    compile_and_first = time.perf_counter() - start
    times = []
    for step in range(args.steps):
        t = time.perf_counter()
        state, metrics = trainer.step(state, batches[step % 2])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    matmul_params = cfg.num_params() - cfg.vocab * cfg.dim
    model_flops = tokens * (6 * matmul_params + 12 * cfg.n_layers * cfg.dim * args.seq)
    dtype = jnp.bfloat16 if args.precision.startswith("bf16") else jnp.float32
    peak, source = peak_flops(dtype)
    devices = trainer.mesh.devices.size
    mfu = model_flops / (devices * peak * step_s)
    result = {
        "model": args.model,
        "parameters": cfg.num_params(),
        "layout": trainer.layout.spec(),
        "devices": devices,
        "device_kind": jax.devices()[0].device_kind,
        "precision": args.precision,
        "attention": args.attention,
        "batch": args.batch,
        "seq": args.seq,
        "median_step_seconds": step_s,
        "first_step_seconds": compile_and_first,
        "tokens_per_second": tokens / step_s,
        "model_flops_per_step": model_flops,
        "peak_flops_per_device": peak,
        "peak_source": source,
        "mfu": mfu,
        "jax": jax.__version__,
    }
    print(f"{'model':12s} {'devices':>7s} {'tokens/s':>12s} {'step s':>8s} {'MFU':>6s}  peak from")
    print(f"{args.model:12s} {devices:7d} {tokens / step_s:12,.0f} {step_s:8.4f} {mfu:6.1%}  {source}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
