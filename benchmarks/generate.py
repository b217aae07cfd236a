"""Generation speed on CPU: decode time per token against the context, prefill and decode tokens/s
against the old recompute path and against transformers' ``generate`` on the same checkpoint and
threads, and the KV cache's bytes per device for Llama 3.1 8B under ``tensor=8`` (dry run).

    python benchmarks/generate.py                                   # shardkit only
    python benchmarks/generate.py --torch-python /path/to/python --json out.json

The model: ``GPTConfig.preset("mini", max_seq=2048)`` (d=128, 4 layers, 8 heads, 4 kv heads), one
prompt, fp32, greedy, one device. Its checkpoint is written in Hugging Face's Llama format and
transformers (4.x or 5.x, with torch, not shardkit dependencies; run by ``--torch-python`` in its
own process) generates from the same weights and prompt with the same number of threads.

- **context**: a prompt of P tokens (P = 64 and 1024), then N new tokens; the decode loop is timed
  alone (after its compile), so ms/token is the cost of a token with P..P+N cached positions. The
  contexts are timed in turns, medians of ``--repeats`` rounds, so their ratio is of one spell.
- **prefill**: the prompt's forward into the cache, after its compile, tokens/s of prompt.
- **recompute**: the same request through the recompute decoder (the model run over the whole
  row for each new token: what ``generate`` did before the cache).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import shardkit as sk

sk.simulate_devices(8)

import jax
import numpy as np
from _results import write_json

from shardkit.models import hf
from shardkit.models.generate import Generator, Sampling
from shardkit.models.kv_cache import recompute_decoder

TORCH_SCRIPT = r"""
import json, sys, time, torch, transformers
path = sys.argv[1]
prompt_len, new, threads, repeats = (int(a) for a in sys.argv[2:6])
torch.set_num_threads(threads)
model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
ids = torch.tensor([list(range(1, prompt_len + 1))]) % 256
out = {}
with torch.inference_mode():
    model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)  # warm up
    prefill, total = [], []
    for _ in range(repeats):
        t = time.perf_counter(); model(ids, use_cache=True); prefill.append(time.perf_counter() - t)
        t = time.perf_counter()
        tokens = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        total.append(time.perf_counter() - t)
out["prefill_s"] = sorted(prefill)[len(prefill) // 2]
out["generate_s"] = sorted(total)[len(total) // 2]
out["tokens"] = tokens[0, prompt_len:].tolist()
out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
print(json.dumps(out))
"""


def prepared(model, params, prompt, new, recompute=False):
    """Compiled ``(prefill, decode)`` of one prompt: ``prefill()`` -> seconds; ``decode()`` ->
    (seconds of the decode loop alone, after a fresh prefill; the new tokens)."""
    gen = Generator(model, params)
    if recompute:
        gen.decoder = recompute_decoder(lambda p, x: model.apply(p, x, None), model.decoder.max_seq)
    n = len(prompt)
    length = min(model.decoder.max_seq, 1 << (n - 1).bit_length()) + new
    width = min(length, max(8, 1 << (n - 1).bit_length()))
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :n] = prompt
    sampling = Sampling()
    args = (gen.decoder, gen.placement, sampling, length, new, gen.params)
    inputs = (jax.numpy.asarray(tokens), jax.numpy.array([n], np.int32), jax.numpy.zeros(1, np.int32))
    live = jax.numpy.ones(1, bool)

    def run_prefill():
        return jax.block_until_ready(gen._prefill(*args, *inputs, live))

    def prefill():
        t = time.perf_counter()
        run_prefill()
        return time.perf_counter() - t

    def decode():
        state = run_prefill()
        t = time.perf_counter()
        out = jax.block_until_ready(gen._decode(gen.decoder, gen.placement, sampling, gen.params, state, np.int32(new)))
        return time.perf_counter() - t, np.asarray(out["out"])[0].tolist()

    decode()  # compiles both
    return prefill, decode


def interleaved(requests, repeats):
    """Median prefill and decode seconds of each request, timed in turns (one round times every
    request once), so a busy spell of a shared machine falls on all of them; and its tokens."""
    prefill = {key: [] for key in requests}
    decode = {key: [] for key in requests}
    tokens = {}
    for _ in range(repeats):
        for key, (run_prefill, run_decode) in requests.items():
            prefill[key].append(run_prefill())
            seconds, tokens[key] = run_decode()
            decode[key].append(seconds)
    return {key: (statistics.median(prefill[key]), statistics.median(decode[key]), tokens[key]) for key in requests}


def torch_times(python, path, prompt_len, new, threads, repeats):
    cmd = [python, "-c", TORCH_SCRIPT, str(path), str(prompt_len), str(new), str(threads), str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_8b_cache(batch, length):
    """Per-device KV cache bytes for Llama 3.1 8B (its shipped config, bf16) under tensor=8, from shapes."""
    from shardkit.models.generate import Placement, cache_bytes_per_device
    from shardkit.models.published import config_dir

    cfg = hf.gpt_config(hf.read_config(config_dir("llama-3.1-8b")), param_dtype="bfloat16")
    dec = cfg.decoder()
    return {
        "batch": batch,
        "positions": length,
        "tensor=8": cache_bytes_per_device(dec, batch, length, Placement.of("tensor=8")),
        "one device": cache_bytes_per_device(dec, batch, length, Placement.of(None)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--torch-python", default=None, help="a Python with torch and transformers")
    parser.add_argument("--max-seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=None, help="the model's width (default: mini's, 128)")
    parser.add_argument("--layers", type=int, default=None, help="its layers (default: mini's, 4)")
    parser.add_argument("--mlp-dim", type=int, default=None, help="its MLP width (default: mini's, 384)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    sizes = {"dim": args.dim, "n_layers": args.layers, "mlp_dim": args.mlp_dim}
    cfg = sk.models.GPTConfig.preset("mini", max_seq=args.max_seq, **{k: v for k, v in sizes.items() if v})
    model = cfg.model()
    params = jax.device_put(model.init(jax.random.key(0)), jax.devices()[0])
    rows = []
    prompts = {p: [(i % 255) + 1 for i in range(p)] for p in args.contexts}
    cached = interleaved({p: prepared(model, params, prompts[p], args.new) for p in args.contexts}, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        path = hf.save_pretrained(params, cfg, pathlib.Path(tmp) / "mini")
        for p in args.contexts:
            prefill_s, decode_s, tokens = cached[p]
            row = {
                "context": p,
                "new": args.new,
                "shardkit_prefill_tok_s": p / prefill_s,
                "shardkit_decode_ms_per_token": 1e3 * decode_s / (args.new - 1),
                "shardkit_decode_tok_s": (args.new - 1) / decode_s,
            }
            old_path = prepared(model, params, prompts[p], args.new, recompute=True)
            _, recompute_s, recompute_tokens = interleaved({p: old_path}, max(1, args.repeats // 2))[p]
            row["recompute_decode_tok_s"] = (args.new - 1) / recompute_s
            row["same_tokens_as_recompute"] = tokens == recompute_tokens
            if args.torch_python:
                ref = torch_times(args.torch_python, path, p, args.new, args.threads, args.repeats)
                if ref is not None:
                    # transformers' generate = its prefill + new - 1 decode steps.
                    decode_ref = max(ref["generate_s"] - ref["prefill_s"], 1e-9)
                    row["transformers_prefill_tok_s"] = p / ref["prefill_s"]
                    row["transformers_decode_tok_s"] = (args.new - 1) / decode_ref
                    row["decode_vs_transformers"] = row["shardkit_decode_tok_s"] / row["transformers_decode_tok_s"]
                    row["prefill_vs_transformers"] = row["shardkit_prefill_tok_s"] / row["transformers_prefill_tok_s"]
                    row["same_tokens_as_transformers"] = tokens == ref["tokens"]
                    row["versions"] = ref["versions"]
            rows.append(row)
    flat = rows[-1]["shardkit_decode_ms_per_token"] / rows[0]["shardkit_decode_ms_per_token"]
    cache = llama_8b_cache(batch=1, length=8192)
    print(
        f"model: mini (dim {cfg.dim}, {cfg.n_layers} layers, MLP {cfg.mlp_dim}, max_seq {args.max_seq}), one prompt, "
        f"{args.new} new tokens, fp32, {args.threads} threads"
    )
    cols = [
        ("context", "context", "{}"),
        ("prefill tok/s", "shardkit_prefill_tok_s", "{:.0f}"),
        ("decode ms/tok", "shardkit_decode_ms_per_token", "{:.2f}"),
        ("decode tok/s", "shardkit_decode_tok_s", "{:.0f}"),
        ("recompute tok/s", "recompute_decode_tok_s", "{:.0f}"),
        ("hf prefill tok/s", "transformers_prefill_tok_s", "{:.0f}"),
        ("hf decode tok/s", "transformers_decode_tok_s", "{:.0f}"),
        ("decode vs hf", "decode_vs_transformers", "{:.2f}"),
        ("same tokens", "same_tokens_as_transformers", "{}"),
    ]
    print("  ".join(f"{c[0]:>16}" for c in cols))
    for row in rows:
        print("  ".join(f"{(c[2].format(row[c[1]]) if c[1] in row else '-'):>16}" for c in cols))
    print(f"decode ms/token at {args.contexts[-1]} cached positions / at {args.contexts[0]}: {flat:.2f}")
    print(
        f"Llama 3.1 8B KV cache, bf16, 1 x 8192 positions: {cache['tensor=8'] / 2**20:.0f} MiB per device under "
        f"tensor=8 ({cache['one device'] / 2**20:.0f} MiB on one device)"
    )
    result = {
        "rows": rows,
        "decode_flatness": flat,
        "llama_3_1_8b_cache": cache,
        "config": dataclasses.asdict(cfg) | {"rope_scaling": None},
        "versions": {"jax": jax.__version__, "shardkit": sk.__version__},
    }
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
