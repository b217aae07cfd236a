"""Host memory of importing a Hugging Face checkpoint: each process reads only its own shards.

Writes a random Llama-shaped checkpoint (float32 safetensors), then measures the peak resident
memory a process adds while reading it:

- "whole file": one process reads every tensor (``safetensors.numpy.load_file``), what a loader
  that does not slice does, before placing anything;
- "sharded import": ``shardkit launch`` starts P processes of D simulated devices each, and each
  runs :func:`shardkit.models.hf.load_params` under ``fsdp=P*D``: a device's share is
  1/(P*D) of the model, a process's 1/P.

    python benchmarks/hf_import.py                  # ~220 MB model, 4 processes x 4 devices (16x a device's share)
    python benchmarks/hf_import.py --experts 8 --layers 2 --json benchmarks/results/hf_import_mixtral.json
                                                    # Mixtral-shaped: 8 experts a layer, top-2
    python benchmarks/hf_import.py --family deepseek_v3 --json benchmarks/results/hf_import_deepseek_v3.json
                                                    # the tiny fixture's config, widths x 8: each
                                                    # family's own Hub names (qwen3_moe, gpt_oss too)
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from _results import write_json


class RssPeak:
    """The process's own (anonymous) resident memory, sampled every 2 ms: its peak since
    :meth:`reset`. Pages of the memory-mapped checkpoint file are the kernel's page cache, shared
    by the processes of a host and dropped under pressure; they are not counted."""

    def __init__(self):
        self.peak, self.stop = 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no RssAnon in /proc/self/status")

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def reset(self) -> int:
        self.peak = self.now()
        return self.peak


def write_checkpoint(directory: pathlib.Path, dim: int, layers: int, vocab: int, experts: int = 0) -> int:
    """A random checkpoint: Llama-shaped, or Mixtral-shaped with ``experts`` > 0 (top-2 routing)."""
    from safetensors.numpy import save_file

    heads, kv, mlp = 8, 2, int(dim * 2.75)
    k = dim // heads
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": (vocab, dim),
        "lm_head.weight": (vocab, dim),
        "model.norm.weight": (dim,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": (heads * k, dim),
                p + "self_attn.k_proj.weight": (kv * k, dim),
                p + "self_attn.v_proj.weight": (kv * k, dim),
                p + "self_attn.o_proj.weight": (dim, heads * k),
                p + "input_layernorm.weight": (dim,),
                p + "post_attention_layernorm.weight": (dim,),
            }
        )
        if experts:
            moe = p + "block_sparse_moe."
            tensors[moe + "gate.weight"] = (experts, dim)
            for e in range(experts):
                x = f"{moe}experts.{e}."
                tensors.update({x + "w1.weight": (mlp, dim), x + "w3.weight": (mlp, dim), x + "w2.weight": (dim, mlp)})
        else:
            tensors.update(
                {
                    p + "mlp.gate_proj.weight": (mlp, dim),
                    p + "mlp.up_proj.weight": (mlp, dim),
                    p + "mlp.down_proj.weight": (dim, mlp),
                }
            )
    arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in tensors.items()}
    save_file(arrays, str(directory / "model.safetensors"))
    config = dict(
        model_type="mixtral" if experts else "llama",
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
    )
    if experts:
        config.update(num_local_experts=experts, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None)
    (directory / "config.json").write_text(json.dumps(config))
    return sum(a.nbytes for a in arrays.values())


FIXTURES = pathlib.Path(__file__).parent.parent / "tests" / "fixtures" / "hf_reference" / "moe"
WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size")


def write_family_checkpoint(directory: pathlib.Path, family: str, widen: int, vocab: int) -> int:
    """A random checkpoint of a mixture-of-experts family in its own Hub names and layout (Qwen3-MoE's
    expert modules, gpt-oss's fused gate_up, DeepSeek-V3's latent attention and shared experts):
    the fixture's ``config.json`` with its widths times ``widen``, written by shardkit's export,
    which the fixtures' tests hold to transformers' own files."""
    import jax

    from shardkit.models import hf

    config = json.loads((FIXTURES / family / "config.json").read_text())
    config.update({k: config[k] * widen for k in WIDTHS if k in config}, vocab_size=vocab)
    config.pop("num_nextn_predict_layers", None)  # export writes no multi-token-prediction layer
    cfg = hf.gpt_config(config)
    params = jax.jit(cfg.model().init)(jax.random.key(0))
    hf.save_pretrained(params, cfg, directory / "checkpoint", base_config=config)
    for item in (directory / "checkpoint").iterdir():
        item.rename(directory / item.name)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))


def worker(directory: str, layout: str) -> None:
    """One process of the sharded import: print its own share and the memory it added."""
    from shardkit.runtime import distributed

    distributed.initialize()
    import jax
    import optax

    import shardkit as sk
    from shardkit.models import hf

    cfg = hf.gpt_config(hf.read_config(directory))
    trainer = sk.Trainer(cfg.model(), optax.sgd(0.0), layout)  # allocates nothing
    shardings = trainer.state_shardings.params
    rss = RssPeak()
    before = rss.reset()
    start = time.perf_counter()
    params = jax.block_until_ready(hf.load_params(directory, cfg, shardings))
    seconds = time.perf_counter() - start
    share = sum(s.data.nbytes for p in jax.tree.leaves(params) for s in p.addressable_shards)
    line = {"process": jax.process_index(), "added": rss.peak - before, "share": share, "seconds": seconds}
    print("RESULT " + json.dumps(line), flush=True)


def whole_file(directory: pathlib.Path) -> int:
    """Peak memory added by reading every tensor of the checkpoint in one process (a subprocess,
    so this process's own allocations do not count)."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); from hf_import import RssPeak; "
        "from safetensors.numpy import load_file; r = RssPeak(); b = r.reset(); "
        f"t = load_file({str(directory / 'model.safetensors')!r}); import time; time.sleep(0.05); print(r.peak - b)"
    )
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--devices-per-proc", type=int, default=4)
    parser.add_argument("--experts", type=int, default=0, help="> 0: a Mixtral-shaped checkpoint of this many experts")
    parser.add_argument("--family", choices=("qwen3_moe", "gpt_oss", "deepseek_v3"), help="that family instead")
    parser.add_argument("--widen", type=int, default=8, help="--family: the fixture's widths times this")
    parser.add_argument("--layout", default=None, help="default: fsdp over every device")
    parser.add_argument("--json", default="benchmarks/results/hf_import.json")
    parser.add_argument("--worker", nargs=2, metavar=("DIR", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    devices = args.nproc * args.devices_per_proc
    layout = args.layout or f"fsdp={devices}"
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        if args.family:
            model_bytes = write_family_checkpoint(directory, args.family, args.widen, args.vocab)
        else:
            model_bytes = write_checkpoint(directory, args.dim, args.layers, args.vocab, args.experts)
        whole = whole_file(directory)
        command = [
            sys.executable,
            "-m",
            "shardkit.cli",
            "launch",
            "--nproc",
            str(args.nproc),
            "--devices-per-proc",
            str(args.devices_per_proc),
            "--",
            sys.executable,
            __file__,
            "--worker",
            str(directory),
            layout,
        ]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [json.loads(x.split("RESULT ", 1)[1]) for x in done.stdout.splitlines() if "RESULT " in x]
        if done.returncode or len(lines) != args.nproc:
            sys.exit(f"the sharded import failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    mb = 1e6
    kind = f"Mixtral-shaped, {args.experts} experts" if args.experts else "Llama-shaped"
    kind = f"{args.family}, the fixture x {args.widen}" if args.family else kind
    share = f"a device's share is 1/{devices}"
    print(f"model {model_bytes / mb:.1f} MB ({kind}, float32), {devices} devices ({layout}): {share}")
    print(f"{'how':28s} {'process':>7s} {'share MB':>9s} {'added MB':>9s} {'added/model':>11s} {'added/share':>11s}")
    whole_row = f"{model_bytes / mb:9.1f} {whole / mb:9.1f} {whole / model_bytes:11.2f}"
    print(f"{'whole file, one process':28s} {'-':>7s} {whole_row}")
    for r in sorted(lines, key=lambda r: r["process"]):
        print(
            f"{'sharded import':28s} {r['process']:7d} {r['share'] / mb:9.1f} {r['added'] / mb:9.1f} "
            f"{r['added'] / model_bytes:11.2f} {r['added'] / r['share']:11.2f}"
        )
    write_json(
        args.json,
        {"config": vars(args), "model_bytes": model_bytes, "whole_file_added": whole, "processes": lines},
    )


if __name__ == "__main__":
    main()
