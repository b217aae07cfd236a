"""Training speed on CPU against what a user would pick instead: shardkit's data-parallel step on
2 simulated devices against PyTorch DDP with 2 processes (gloo), the same Llama-style byte model,
the same cores, alternating runs.

    python benchmarks/cpu_vs_pytorch.py                             # PyTorch from this interpreter
    python benchmarks/cpu_vs_pytorch.py --torch-python /path/to/python --json out.json

The model on both sides: vocabulary 256 (bytes), d=256, 4 layers, 4 heads of 64, SwiGLU 1024,
RMSNorm, rotary positions, untied head: 4.33M parameters; batch 16 x 128, fp32, AdamW. PyTorch
is not a dependency of shardkit: without it (here or at ``--torch-python``) only shardkit runs.
shardkit runs six ways: its layer stack scanned (the default), the scan unrolled with the
parameters still stacked (``GPTConfig(scan_unroll=True)``), the layers unrolled
(``GPTConfig(scan_layers=False)``), each started as the ``shardkit`` command starts (huge pages);
the default as a script of your own runs it (glibc's allocator settings, no
``glibc.malloc.hugetlb`` tunable: the step's temporaries in heaps glibc keeps,
``shardkit.runtime.host_allocator``), and as a notebook of your own runs it (the same settings,
the step run by a cell in a Jupyter kernel; ``pip install -e .[notebooks]``); and that again as
it ran before those heaps (``SHARDKIT_HOST_ALLOCATOR=system``: XLA's single heap, mapped in
afresh each step). Each run is its own process; rounds alternate the runs, and the medians over
``--rounds`` count. Each run times every step: tokens/s over all of them, and at its median step
(which leaves out steps another tenant of a shared machine slowed; both sides are timed so).
Page faults per step are printed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DIM, LAYERS, HEADS, MLP, VOCAB, SEQ, BATCH = 256, 4, 4, 1024, 256, 128, 16


# Worker name -> the GPTConfig fields of that form of the layer stack.
SHARDKIT_FORMS = {
    "shardkit": {},
    "shardkit-scan-unroll": {"scan_unroll": True},
    "shardkit-unrolled": {"scan_layers": False},
    "shardkit-glibc-malloc": {},  # the default form as your own script runs it (below)
    "shardkit-notebook": {},  # ... as a notebook of your own runs it, in a Jupyter kernel
    "shardkit-one-heap": {},  # ... and as it ran before the heaps
}
# Workers that run with glibc's defaults, no huge pages (the others start as the shardkit command
# would, shardkit.runtime.host_allocator) ...
GLIBC_DEFAULTS = {"shardkit-glibc-malloc", "shardkit-notebook", "shardkit-one-heap"}
# ... and of those, the one whose step keeps XLA's single heap of temporaries.
ONE_HEAP = {"shardkit-one-heap"}


def shardkit_worker(steps: int, warmup: int, form: dict) -> dict:
    import resource

    import jax
    import numpy as np
    import optax

    import shardkit as sk

    sk.simulate_devices(2)
    cfg = sk.models.GPTConfig(
        vocab=VOCAB,
        dim=DIM,
        n_layers=LAYERS,
        n_heads=HEADS,
        n_kv_heads=HEADS,
        mlp_dim=MLP,
        max_seq=SEQ,
        **form,
    )
    trainer = sk.Trainer(cfg.model(), optax.adamw(1e-3), "data=2")
    data = sk.TextDataset.builtin()
    batches = [trainer.shard_batch(data.batch(i, batch_size=BATCH, seq_len=SEQ)) for i in range(4)]
    state = trainer.init(0)
    for b in batches[:warmup]:  # compile and warm up
        state, metrics = trainer.step(state, b)
    jax.block_until_ready(metrics["loss"])
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step_seconds = []
    for i in range(steps):
        start = time.perf_counter()
        state, metrics = trainer.step(state, batches[i % len(batches)])
        jax.block_until_ready(metrics["loss"])  # the guard against non-finite steps waits anyway
        step_seconds.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    return throughput(step_seconds) | {
        "parameters": params,
        "page_faults_per_step": faults / steps,  # the kernel mapping in fresh host memory
    }


def notebook_worker(steps: int, warmup: int) -> dict:
    """:func:`shardkit_worker` (the default form) as a cell of a notebook runs it: in a Jupyter
    kernel (ipykernel, started by nbclient as Jupyter starts one), which inherits this process's
    environment (glibc's defaults) and imports shardkit itself."""
    import nbformat
    from nbclient import NotebookClient

    here = os.path.dirname(os.path.abspath(__file__))
    cell = (
        "import json\n"
        "import cpu_vs_pytorch\n"
        f"print(json.dumps(cpu_vs_pytorch.shardkit_worker({steps}, {warmup}, {{}})))"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": here}}).execute()
    printed = "".join(o.text for o in nb.cells[0].outputs if o.output_type == "stream" and o.name == "stdout")
    return json.loads(printed.strip().splitlines()[-1])


def throughput(step_seconds: list[float]) -> dict:
    """Tokens/s over all timed steps, and at the median step's time: the second leaves out the
    steps another tenant of a shared machine slowed (on either side alike)."""
    return {
        "tokens_per_s": BATCH * SEQ * len(step_seconds) / sum(step_seconds),
        "tokens_per_s_median_step": BATCH * SEQ / statistics.median(step_seconds),
    }


def torch_worker(steps: int, warmup: int) -> dict:
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_torch_rank, args=(2, steps, warmup, queue), nprocs=2, join=True)
    return queue.get()


def _torch_rank(rank: int, world: int, steps: int, warmup: int, queue) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)  # two processes on two cores, as shardkit's two devices
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)

    class RMSNorm(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def rope(x, cos, sin):  # rotate-half, as Llama
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.mlp_norm = RMSNorm(DIM), RMSNorm(DIM)
            self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
            self.out = nn.Linear(DIM, DIM, bias=False)
            self.gate_up = nn.Linear(DIM, 2 * MLP, bias=False)
            self.down = nn.Linear(MLP, DIM, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, DIM))
            gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.norm = RMSNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            inv = 1.0 / (10000 ** (torch.arange(0, DIM // HEADS, 2).float() / (DIM // HEADS)))
            angles = torch.outer(torch.arange(SEQ).float(), inv)
            self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1))
            self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1))

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            return self.head(self.norm(x))

    model = nn.parallel.DistributedDataParallel(LM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (BATCH // world, SEQ + 1), generator=gen) for _ in range(4)]

    def step(tokens):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for b in batches[:warmup]:
        step(b)
    dist.barrier()
    step_seconds = []
    for i in range(steps):  # each step ends in lockstep: DDP's all-reduce waits for both ranks
        start = time.perf_counter()
        step(batches[i % len(batches)])
        step_seconds.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        queue.put(throughput(step_seconds) | {"parameters": params})
    dist.destroy_process_group()


def run_worker(python: str, worker: str, steps: int, warmup: int) -> dict:
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    if worker in SHARDKIT_FORMS:
        from shardkit.runtime.host_allocator import with_huge_pages, without_huge_pages

        # glibc's defaults for the comparison form, whatever this shell asks for
        env = without_huge_pages(env) if worker in GLIBC_DEFAULTS else with_huge_pages(env)
        if worker in ONE_HEAP:
            env["SHARDKIT_HOST_ALLOCATOR"] = "system"
    proc = subprocess.run(
        [python, os.path.abspath(__file__), "--worker", worker, "--steps", str(steps), "--warmup", str(warmup)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if proc.returncode:
        raise RuntimeError(f"{worker} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_available(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--warmup", type=int, default=3, choices=range(1, 5), help="untimed steps first (compile included)"
    )
    parser.add_argument("--torch-python", default=sys.executable, help="an interpreter with PyTorch installed")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=(*SHARDKIT_FORMS, "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "torch":
            result = torch_worker(args.steps, args.warmup)
        elif args.worker == "shardkit-notebook":
            result = notebook_worker(args.steps, args.warmup)
        else:
            result = shardkit_worker(args.steps, args.warmup, SHARDKIT_FORMS[args.worker])
        print(json.dumps(result))
        return
    runners = dict.fromkeys(SHARDKIT_FORMS, sys.executable)
    if torch_available(args.torch_python):
        runners["torch"] = args.torch_python
    else:
        print(f"PyTorch is not importable by {args.torch_python}: timing shardkit only")
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    for _ in range(args.rounds):  # alternate, so the machine's drift touches each side alike
        for name, python in runners.items():
            runs[name].append(run_worker(python, name, args.steps, args.warmup))
    median = {name: medians(results) for name, results in runs.items()}
    print(f"medians of {args.rounds} rounds")
    print(
        f"{'run':22s} {'parameters':>12s} {'tokens/s':>10s} {'vs torch':>9s} "
        f"{'median step':>12s} {'vs torch':>9s} {'page faults/step':>17s}"
    )
    for name, result in median.items():
        ratios = [
            result[key] / median["torch"][key] if "torch" in median else float("nan")
            for key in ("tokens_per_s", "tokens_per_s_median_step")
        ]
        faults = f"{result['page_faults_per_step']:17,.0f}" if "page_faults_per_step" in result else f"{'':17s}"
        print(
            f"{name:22s} {result['parameters']:12,d} {result['tokens_per_s']:10,.0f} {ratios[0]:9.3f} "
            f"{result['tokens_per_s_median_step']:12,.0f} {ratios[1]:9.3f} {faults}"
        )
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _results import write_json

        write_json(args.json, {"rounds": args.rounds, "steps": args.steps, "median": median, "runs": runs})


def medians(results: list[dict]) -> dict:
    """Each figure's median over the rounds of one run (``parameters`` is the same in all)."""
    return {key: statistics.median(r[key] for r in results) for key in results[0]} | {
        "parameters": results[0]["parameters"]
    }


if __name__ == "__main__":
    main()
