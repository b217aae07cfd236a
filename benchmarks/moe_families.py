"""The frontier's mixtures of experts: import, decode and dry runs at their real sizes.

1. The tiny checkpoints transformers wrote (``tests/fixtures/hf_reference/moe``): seconds to
   import onto one device, the largest logit error against transformers' logits, and decode
   tokens/s of a 64-token greedy continuation of a 13-token prompt (batch 1, one device).
2. DeepSeek-V3's latent cache: bytes per token and layer, against grouped attention of the same
   heads and widths (its keys and values whole).
3. The six shipped configs dry-run on 131,072 devices (``shardkit dryrun --init-from``, a fresh
   process each, bf16 parameters with fp32 masters, full remat, sequence 4096): parameters,
   wall seconds, the process tree's peak host memory and memory per device on the layout shown.
   The checkpoints' routing is dropless (transformers' own), which pads every expert's buffer to
   every token of its row: the per-device memory shows what that costs at scale.

With ``--torch-python`` (a Python with torch and transformers, not shardkit's dependencies),
transformers' ``generate`` decodes the same prompt from the same checkpoint on the same number of
threads, timed the same way (a warm-up call, then the median of three), beside shardkit's.

    python benchmarks/moe_families.py              # all three tables, JSON to benchmarks/results/
    python benchmarks/moe_families.py --no-dryrun  # the first two
    python benchmarks/moe_families.py --no-dryrun --torch-python /path/to/venv/bin/python
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from _results import write_json

NEW_TOKENS, REPEATS = 64, 3
TORCH_SCRIPT = r"""
import json, statistics, sys, time, torch, transformers
path, prompt, new, threads, repeats = sys.argv[1], json.loads(sys.argv[2]), *(int(a) for a in sys.argv[3:6])
torch.set_num_threads(threads)
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
model.generation_config.eos_token_id = None  # as shardkit's without eos_ids: every token greedy, none masked
ids = torch.tensor([prompt])
with torch.inference_mode():
    model.generate(ids, max_new_tokens=new, do_sample=False)  # warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        tokens = model.generate(ids, max_new_tokens=new, do_sample=False)
        times.append(time.perf_counter() - t)
print(json.dumps({"seconds": statistics.median(times), "tokens": tokens[0, len(prompt):].tolist(),
                  "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))
"""
FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf_reference" / "moe"
FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
# name: (layout of 131,072 devices, global batch: a row per data x fsdp x expert device)
SHIPPED = {
    "qwen3-30b-a3b": ("expert=64,fsdp=2048", 131072),  # with tensor=4 its fsdp=8 and 16 compiles differ
    "qwen3-235b-a22b": ("expert=32,fsdp=1024,tensor=4", 32768),
    "gpt-oss-20b": ("expert=32,fsdp=512,tensor=8", 16384),
    "gpt-oss-120b": ("expert=32,fsdp=512,tensor=8", 16384),
    "deepseek-v3": ("expert=64,fsdp=2048", 131072),
    "kimi-k2": ("expert=64,fsdp=2048", 131072),
}


def torch_decode(python: str, family: str, prompt: list[int]) -> dict:
    """transformers' greedy ``generate`` of ``NEW_TOKENS`` from the fixture, in its own process."""
    cmd = [python, "-c", TORCH_SCRIPT, str(FIXTURES / family), json.dumps(prompt)]
    cmd += [str(NEW_TOKENS), str(os.cpu_count()), str(REPEATS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fixtures_table(torch_python: str | None = None) -> list[dict]:
    import jax
    import numpy as np

    import shardkit as sk

    tokens = np.load(FIXTURES / "tokens.npy").astype(np.int32)
    index = json.loads((FIXTURES / "index.json").read_text())
    rows = []
    for family in FAMILIES:
        start = time.perf_counter()
        run = sk.from_pretrained(FIXTURES / family, layout="data=1", devices=jax.devices()[:1])
        seconds = time.perf_counter() - start
        out = jax.jit(lambda p, x, run=run: run.trainer.model.apply(p, x, None))(run.state.params, tokens)
        logits = np.asarray(out[0] if isinstance(out, tuple) else out)
        error = float(np.abs(logits - np.load(FIXTURES / family / "reference_logits.npy")).max())
        prompt = index[family]["prompts"][1]
        run.generate([prompt], NEW_TOKENS)  # compiles
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            ours = run.generate([prompt], NEW_TOKENS)
            times.append(time.perf_counter() - start)
        decode = NEW_TOKENS / sorted(times)[REPEATS // 2]
        row = {"family": family, "import_s": seconds, "max_logit_error": error, "decode_tokens_per_s": decode}
        if torch_python:
            theirs = torch_decode(torch_python, family, prompt)
            row["transformers_tokens_per_s"] = NEW_TOKENS / theirs["seconds"]
            row["same_tokens"] = list(ours[0]) == theirs["tokens"]
            row["versions"] = theirs["versions"]
        rows.append(row)
    return rows


def cache_table() -> dict:
    from shardkit.models import hf, published

    out = {}
    for name in ("deepseek-v3", "kimi-k2"):
        cfg = hf.gpt_config(hf.read_config(published.config_dir(name)))
        lat = cfg.latent
        grouped = cfg.n_heads * (lat.qk_dim + lat.v_dim)  # every head's key and value
        out[name] = {
            "latent_numbers": lat.cached_per_token,
            "grouped_numbers": grouped,
            "ratio": grouped / lat.cached_per_token,
        }
    return out


def dryrun(name: str, layout: str, batch: int) -> dict:
    cmd = [sys.executable, "-m", "shardkit.cli", "dryrun", "--init-from", name, "--layout", layout]
    cmd += ["--batch", str(batch), "--seq", "4096", "--precision", "bf16-master", "--remat", "full", "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    seconds = time.perf_counter() - start
    if proc.returncode:
        return {"name": name, "layout": layout, "error": proc.stderr.strip().splitlines()[-1], "seconds": seconds}
    result = json.loads(proc.stdout)
    return {
        "name": name,
        "layout": layout,
        "parameters": result["parameters"],
        "seconds": seconds,
        # each compile's host memory, as the extrapolating dry run measures it (its two run side by side)
        "host_gb_each_compile": [b / 1e9 for b in result.get("extrapolated", {}).get("host_memory_bytes", [])],
        "memory_per_device_gb": result["memory"]["total"] / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-dryrun", action="store_true", help="skip the 131,072-device dry runs")
    parser.add_argument("--torch-python", help="a Python with torch and transformers: their generate beside ours")
    parser.add_argument("--json", default="benchmarks/results/moe_families.json")
    args = parser.parse_args()
    result = {"fixtures": fixtures_table(args.torch_python), "cache": cache_table(), "dryruns": []}
    print(
        f"{'family':<12} {'import s':>9} {'max |logit err|':>16} {'decode tok/s':>13} {'transformers':>13} "
        f"{'same tokens':>12}"
    )
    for row in result["fixtures"]:
        error, speed = row["max_logit_error"], row["decode_tokens_per_s"]
        theirs = f"{row['transformers_tokens_per_s']:>13.1f}" if "transformers_tokens_per_s" in row else f"{'-':>13}"
        print(
            f"{row['family']:<12} {row['import_s']:>9.2f} {error:>16.2e} {speed:>13.1f} {theirs} "
            f"{row.get('same_tokens', '-')!s:>12}"
        )
    for name, row in result["cache"].items():
        latent, grouped = row["latent_numbers"], row["grouped_numbers"]
        print(f"{name}: latent cache {latent} numbers a token and layer, grouped {grouped} ({row['ratio']:.1f}x)")
    if not args.no_dryrun:
        head = f"{'config':<16} {'layout (131,072 devices)':<30} {'params':>10} {'seconds':>8}"
        print(f"{head} {'host GB':>12} {'GB/device':>10}")
        for name, (layout, batch) in SHIPPED.items():
            row = dryrun(name, layout, batch)
            result["dryruns"].append(row)
            if "error" in row:
                print(f"{name:<16} {layout:<30} error: {row['error']}")
                continue
            host = "/".join(f"{gb:.2f}" for gb in row["host_gb_each_compile"])
            print(
                f"{name:<16} {layout:<30} {row['parameters'] / 1e9:>9.2f}B {row['seconds']:>8.1f} "
                f"{host:>12} {row['memory_per_device_gb']:>10.1f}"
            )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
