"""What keeping small parameters whole under FSDP saves (``fsdp_min_size``, DeepSpeed ZeRO-3's
parameter persistence threshold): collectives per step, bytes moved and parameter memory per
device, every parameter split (``fsdp_min_size=0``, the behaviour before) against the default
(vectors per layer whole: norm scales and biases).

Each row is one compiled train step under ``fsdp=8`` on simulated CPU devices, read from the
compiled program (no step is run): the models of ``examples/byo_models.py`` that shardkit did
not write, the GPT preset, and a dry run of Llama 3.1 8B from its shipped config (bf16 with an
fp32 master, remat full; 16 x 2,048 tokens).

    python benchmarks/fsdp_min_size.py
    python benchmarks/fsdp_min_size.py --no-llama --json benchmarks/results/fsdp_min_size.json
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

SETTINGS = {"all split": 0, "vectors whole": None}


def models(cfg: LMConfig, seq: int) -> dict:
    return {
        "nnx-gemma": lambda: sk.from_nnx(lambda rngs: GemmaLM(cfg, rngs=rngs)),
        "linen-lm": lambda: sk.from_linen(LinenLM(cfg), jnp.zeros((2, seq), jnp.int32)),
        "nnx-plain": lambda: sk.from_nnx(lambda rngs: PlainLM(cfg, rngs=rngs)),
        "gpt-mini": lambda: sk.models.GPTConfig.preset("mini").model(),
    }


def summary(collectives: list[dict], params_bytes: int) -> dict:
    over_fsdp = [c for c in collectives if "fsdp" in c["axes"]]
    return {
        "collectives": sum(c["count"] for c in collectives),
        "over_fsdp": sum(c["count"] for c in over_fsdp),
        "bytes_moved": sum(c["bytes"] for c in collectives),
        "params_per_device": params_bytes,
    }


def compiled_row(make, batch: dict, min_size) -> dict:
    report = sk.Trainer(make(), optax.adamw(1e-3), "fsdp=8", fsdp_min_size=min_size).report(batch)
    as_dict = report.to_dict()
    return summary(as_dict["collectives"], report.memory.params)


def llama_row(min_size) -> dict:
    result = sk.dryrun(
        init_from="llama-3.1-8b",
        layout="fsdp=8",
        batch=16,
        seq=2048,
        precision="bf16-master",
        remat="full",
        fsdp_min_size=min_size,
    )
    return summary(result["collectives"], result["memory"]["params"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--no-llama", action="store_true", help="skip the Llama 3.1 8B dry run (about 20 s)")
    parser.add_argument("--json", default="benchmarks/results/fsdp_min_size.json")
    args = parser.parse_args()
    cfg = LMConfig(dim=args.dim, mlp=4 * args.dim, heads=8, kv_heads=2, head_dim=args.dim // 8, layers=args.layers)
    batch = {"tokens": jax.ShapeDtypeStruct((16, args.seq + 1), jnp.int32)}
    rows = []
    for name, make in models(cfg, args.seq).items():
        rows += [{"model": name, "setting": s, **compiled_row(make, batch, m)} for s, m in SETTINGS.items()]
    if not args.no_llama:
        rows += [{"model": "llama-3.1-8b (dry run)", "setting": s, **llama_row(m)} for s, m in SETTINGS.items()]
    header = ("collectives", "over fsdp", "MB moved", "params MB/dev")
    print(f"{'model':24s} {'setting':14s} " + " ".join(f"{h:>13s}" for h in header))
    for r in rows:
        print(
            f"{r['model']:24s} {r['setting']:14s} {r['collectives']:13d} {r['over_fsdp']:13d} "
            f"{r['bytes_moved'] / 1e6:13.2f} {r['params_per_device'] / 1e6:13.2f}"
        )
    write_json(args.json, {"layout": "fsdp=8", "dim": args.dim, "layers": args.layers, "rows": rows})


if __name__ == "__main__":
    main()
