"""Write the notebooks from their cells here (so their source is reviewable as Python), and run them.

python notebooks/make_notebooks.py            # rewrites notebooks/*.ipynb and executes them: outputs kept
python notebooks/make_notebooks.py --no-run   # sources only (outputs empty)
python notebooks/make_notebooks.py 01 05      # only the notebooks whose names start so

The stored notebooks keep their outputs, pictures included, so a reader browsing the repository
sees them; ``tests/test_notebooks.py`` re-executes each one and compares the structure of its
outputs (which cells print, which draw) with the stored one, and its sources with this file.
"""

import os
import pathlib
import sys
import tempfile

import nbformat

HERE = pathlib.Path(__file__).parent

QUICKSTART = [
    (
        "markdown",
        "# shardkit quickstart\n\nTrain a small GPT on 8 simulated CPU devices with a hybrid layout: "
        "data parallelism x FSDP x tensor parallelism. The same code runs unchanged on GPUs.",
    ),
    (
        "code",
        "import shardkit as sk\n\nsk.simulate_devices(8)  # first, before JAX starts\n\n"
        "import jax\nimport matplotlib.pyplot as plt\nimport optax\n\nprint(jax.devices())",
    ),
    (
        "markdown",
        "## A layout and the model\nMesh axes are `data, fsdp, tensor, sequence, stage, expert`; "
        "unnamed axes have size 1.",
    ),
    (
        "code",
        'layout = sk.Layout.parse("data=2,fsdp=2,tensor=2")\n'
        'cfg = sk.models.GPTConfig.preset("tiny")\n'
        "model = sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs))\n"
        "trainer = sk.Trainer(model, optax.adamw(3e-3), layout)\n"
        "print(trainer.layout, dict(trainer.mesh.shape))",
    ),
    (
        "markdown",
        "## How each parameter is sharded\n`[fsdp, tensor]` means dimension 0 is split over the "
        "`fsdp` mesh axis and dimension 1 over `tensor` (scaling-book notation `W[D_fsdp, V_tensor]`).",
    ),
    (
        "markdown",
        "## The device mesh\nEight devices as a `data x fsdp x tensor` grid: devices in a row of one panel share "
        "`tensor` work (Megatron's all-reduces), a column shares `fsdp` shards, the two panels are data replicas.",
    ),
    (
        "code",
        "grid = trainer.mesh.devices.reshape(2, 2, 2)  # (data, fsdp, tensor); the other axes have size 1\n"
        "fig, axes = plt.subplots(1, 2, figsize=(6, 2.4))\n"
        "for d, ax in enumerate(axes):\n"
        "    ax.imshow([[d * 4 + f * 2 + t for t in range(2)] for f in range(2)], cmap='Pastel1', vmin=0, vmax=8)\n"
        "    for f in range(2):\n"
        "        for t in range(2):\n"
        "            ax.text(t, f, f'device {grid[d, f, t].id}', ha='center', va='center')\n"
        "    ax.set_title(f'data = {d}'); ax.set_xlabel('tensor'); ax.set_ylabel('fsdp')\n"
        "    ax.set_xticks([0, 1]); ax.set_yticks([0, 1])\n"
        "plt.tight_layout(); plt.show()",
    ),
    ("code", "print(trainer.format_sharding_table())"),
    (
        "markdown",
        "## A picture of one array's sharding\nThe output head `lm_head` (D x V): each block is the "
        "part one group of devices holds.",
    ),
    (
        "code",
        "state = trainer.init(seed=0)\n"
        'head = state.params["lm_head"]\n'
        "fig, ax = plt.subplots(figsize=(6, 3))\n"
        "blocks = {}\n"
        "for shard in head.addressable_shards:\n"
        "    rows, cols = shard.index\n"
        "    key = (rows.start or 0, rows.stop or head.shape[0], cols.start or 0, cols.stop or head.shape[1])\n"
        "    blocks.setdefault(key, []).append(shard.device.id)\n"
        "for i, ((r0, r1, c0, c1), ids) in enumerate(sorted(blocks.items())):\n"
        "    ax.add_patch(plt.Rectangle((c0, r0), c1 - c0, r1 - r0, color=plt.cm.Pastel1(i), ec='k'))\n"
        "    ax.text((c0 + c1) / 2, (r0 + r1) / 2, 'devices ' + ','.join(map(str, ids)), ha='center', va='center')\n"
        "ax.set_xlim(0, head.shape[1]); ax.set_ylim(head.shape[0], 0)\n"
        "ax.set_xlabel('V (vocab), split over tensor'); ax.set_ylabel('D (embed), split over fsdp')\n"
        "ax.set_title(f'lm_head {head.shape}: {head.sharding.spec}')\n"
        "assert len(blocks) == 4  # fsdp=2 x tensor=2 blocks, each held by the 2 data replicas",
    ),
    (
        "markdown",
        "## Train on real text\nThe built-in corpus is Python's own documentation and sources, as byte tokens.",
    ),
    (
        "code",
        "data = sk.TextDataset.builtin()\n"
        "losses = []\n"
        "for step in range(40):\n"
        "    batch = trainer.shard_batch(data.batch(step, batch_size=16, seq_len=64))\n"
        "    state, metrics = trainer.step(state, batch)\n"
        '    losses.append(float(metrics["loss"]))\n'
        'print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")\n'
        "assert losses[-1] < losses[0]",
    ),
    (
        "code",
        "plt.figure(figsize=(6, 3))\nplt.plot(losses)\nplt.xlabel('step')\nplt.ylabel('loss')\n"
        "plt.title('tiny GPT, data=2,fsdp=2,tensor=2')\nplt.show()",
    ),
    (
        "markdown",
        "## What the compiler did\nCollectives in the compiled step, by kind and mesh axes, from `trainer.report()`.",
    ),
    (
        "code",
        "import collections\n\n"
        "report = trainer.report(batch)\n"
        "counts, moved = collections.Counter(), collections.Counter()\n"
        "for c in report.collectives:\n"
        "    axes = '+'.join(c.axes) or 'no mesh axis'\n"
        "    counts[f'{c.kind}\\nover {axes}'] += c.count\n"
        "    moved[f'{c.kind}\\nover {axes}'] += c.moved_bytes / 1e6\n"
        "fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)\n"
        "left.barh(list(counts), list(counts.values())); left.set_xlabel('collectives per step')\n"
        "right.barh(list(moved), list(moved.values()), color='tab:orange'); right.set_xlabel('MB sent per device per step')\n"
        "fig.suptitle(f'{trainer.layout.spec()}: what XLA emitted (bound {report.lower_bound[\"bytes_per_device\"] / 1e6:.2f} MB)')\n"
        "plt.tight_layout(); plt.show()",
    ),
]


INSPECT = [
    (
        "markdown",
        "# Inspect and dry-run\n\nWhat does XLA actually do with a layout? One model under several layouts: "
        "per-device memory, collective bytes by mesh axis, and a dry run of a model far too large for this "
        "machine. Collectives are read from the compiled HLO; on CPU a gradient reduce-scatter is lowered "
        "as all-reduce + dynamic-slice and reported as the reduce-scatter it stands for (marked `*`).",
    ),
    (
        "code",
        "import shardkit as sk\n\nsk.simulate_devices(8)\n\n"
        "import jax\nimport jax.numpy as jnp\nimport matplotlib.pyplot as plt\nimport optax",
    ),
    (
        "code",
        'cfg = sk.models.GPTConfig.preset("mini")\n'
        'batch = {"tokens": jax.ShapeDtypeStruct((16, 129), jnp.int32)}  # abstract: nothing allocated\n'
        'layouts = ["data=8", "fsdp=8", "data=2,tensor=4", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2"]\n'
        "reports = {}\n"
        "for layout in layouts:\n"
        "    trainer = sk.Trainer(cfg.model(), optax.adamw(1e-3), layout)\n"
        "    reports[layout] = trainer.report(batch)\n"
        'print(reports["data=2,fsdp=2,tensor=2"].table())',
    ),
    (
        "markdown",
        "## Memory per device\nModel state falls as 1/N under FSDP; temporaries are activations and gathered weights.",
    ),
    (
        "code",
        'parts = ["params", "optimizer", "batch", "temp"]\n'
        "fig, ax = plt.subplots(figsize=(7, 3.5))\n"
        "bottom = [0.0] * len(layouts)\n"
        "for part in parts:\n"
        "    values = [getattr(reports[l].memory, part) / 1e6 for l in layouts]\n"
        "    ax.bar(layouts, values, bottom=bottom, label=part)\n"
        "    bottom = [b + v for b, v in zip(bottom, values)]\n"
        "ax.set_ylabel('MB per device'); ax.legend(); plt.xticks(rotation=20); plt.show()",
    ),
    (
        "markdown",
        "## Collective bytes by mesh axis\nMeasured bytes sent per device per step (ring formulas), "
        "next to the layout's lower bound.",
    ),
    (
        "code",
        "axes = sorted({a for r in reports.values() for a in r.bytes_by_axes()})\n"
        "print(f\"{'layout':24s}\" + ''.join(f'{a:>12s}' for a in axes) + f\"{'bound':>12s}{'ratio':>7s}\")\n"
        "for layout, r in reports.items():\n"
        "    by = r.bytes_by_axes()\n"
        "    cells = ''.join(f'{by.get(a, 0) / 1e6:12.3f}' for a in axes)\n"
        "    print(f\"{layout:24s}{cells}{r.lower_bound['bytes_per_device'] / 1e6:12.3f}{r.ratios['bytes']:7.2f}\")\n"
        "fig, ax = plt.subplots(figsize=(7, 3.5))\n"
        "bottom = [0.0] * len(layouts)\n"
        "for a in axes:\n"
        "    values = [reports[l].bytes_by_axes().get(a, 0) / 1e6 for l in layouts]\n"
        "    ax.bar(layouts, values, bottom=bottom, label=a)\n"
        "    bottom = [b + v for b, v in zip(bottom, values)]\n"
        "ax.set_ylabel('MB moved per device per step'); ax.legend(); plt.xticks(rotation=20); plt.show()",
    ),
    (
        "markdown",
        "## A dry run of a large model\nLlama-2 70B on 512 simulated devices, bf16 parameters with "
        "fp32 master weights, full remat. This kernel has 8 devices, so the dry run runs in a subprocess.",
    ),
    (
        "code",
        'result = sk.dryrun(model="llama2-70b", layout="fsdp=64,tensor=8", batch=64, seq=4096,\n'
        '                   precision="bf16-master", remat="full")\n'
        "print(sk.Report.from_dict(result).table())\n"
        "print(f\"compiled in {result['compile_seconds']:.1f} s using \"\n"
        "      f\"{result['peak_host_memory_bytes'] / 1e9:.2f} GB of host memory\")\n"
        'mem = result["memory"]\n'
        'assert result["devices"] == 512 and mem["params"] + mem["master"] + mem["optimizer"] < 3e9',
    ),
]


CHECKPOINT = [
    (
        "markdown",
        "# Checkpoint and resume under another layout\n\nTrain under `fsdp=8`, save with orbax every 10 "
        "steps, stop; restore the step-20 checkpoint under `data=2,tensor=4` and continue. The resumed "
        "curve lies on the uninterrupted one: dropout bits depend on the seed and the step, never on the "
        "layout.",
    ),
    (
        "code",
        "import shardkit as sk\n\nsk.simulate_devices(8)\n\n"
        "import tempfile\n\nimport matplotlib.pyplot as plt\nimport numpy as np\nimport optax\n\n"
        "from shardkit.training.checkpoint import Checkpointer",
    ),
    (
        "code",
        'cfg = sk.models.GPTConfig.preset("tiny", dropout=0.1)\n'
        "data = sk.TextDataset.builtin()\n\n\n"
        "def run(trainer, state, steps, ckpt=None):\n"
        "    losses = []\n"
        "    for step in steps:\n"
        "        state, m = trainer.step(state, trainer.shard_batch(data.batch(step, batch_size=16, seq_len=64)))\n"
        '        losses.append(float(m["loss"]))\n'
        "        if ckpt is not None:\n"
        "            ckpt.save(trainer, state, data_position=step + 1)\n"
        "    return state, losses\n\n\n"
        'fsdp = sk.Trainer(cfg.model(), optax.adamw(3e-3), "fsdp=8")\n'
        "directory = tempfile.mkdtemp()\n"
        "ckpt = Checkpointer(directory, every=10, keep=3)\n"
        "_, straight = run(fsdp, fsdp.init(0), range(40), ckpt)\n"
        "ckpt.close()\n"
        'print("checkpoints:", Checkpointer(directory).steps())',
    ),
    (
        "code",
        'tp = sk.Trainer(cfg.model(), optax.adamw(3e-3), "data=2,tensor=4")\n'
        "state, record = Checkpointer(directory).restore(tp, step=20)\n"
        'print("restored step", int(state.step), "saved under", record["layout"], "->", tp.layout)\n'
        'print("lm_head now", state.params["lm_head"].sharding.spec)\n'
        'state, resumed = run(tp, state, range(record["data_position"], 40))\n'
        'print(f"max |difference| after resuming: {np.max(np.abs(np.array(resumed) - straight[20:])):.2e}")\n'
        "assert np.allclose(resumed, straight[20:], rtol=1e-4)",
    ),
    (
        "code",
        "plt.figure(figsize=(7, 3.5))\n"
        "plt.plot(range(1, 41), straight, label='fsdp=8, uninterrupted')\n"
        "plt.plot(range(21, 41), resumed, '--', label='restored at 20 under data=2,tensor=4')\n"
        "plt.axvline(20, color='gray', lw=0.5)\n"
        "plt.xlabel('step')\nplt.ylabel('loss')\nplt.legend()\nplt.show()",
    ),
]


PLAN = [
    (
        "markdown",
        "# Plan: how to shard Llama 3.1 70B and Mixtral 8x7B on the GPUs you have\n\n"
        "The planner reads a model from a Hugging Face `config.json` alone (no weights): a checkpoint's "
        "directory, or one of the configs of real sizes that ship with shardkit. It prices every layout "
        "analytically, compiles the fastest few for N simulated devices (dry runs, cached on disk), predicts "
        "each one's step time from the compiled matmul FLOPs and the bytes each mesh axis moves over the link "
        "it crosses (NVLink inside a node, InfiniBand between nodes), and ranks what fits. A layout whose "
        "estimate is already slower than a compiled plan that fits is not compiled, while the estimate has "
        "proved a lower bound in the search.",
    ),
    (
        "code",
        "import matplotlib.pyplot as plt\n\n"
        "import shardkit as sk\n"
        "from shardkit.models import hf, published\n\n"
        'for name in ("llama-3.1-70b", "mixtral-8x7b"):\n'
        "    cfg = hf.gpt_config(hf.read_config(published.config_dir(name)))\n"
        '    print(f"{name}: {cfg.num_params() / 1e9:.2f}B parameters, {cfg.n_layers} layers, dim {cfg.dim}, "\n'
        '          f"{cfg.n_heads} heads ({cfg.n_kv_heads} kv), vocab {cfg.vocab}, experts {cfg.n_experts}")',
    ),
    (
        "code",
        "# Mixtral: 3 layouts compiled (the fastest of each kind first), to keep this notebook quick; the command's "
        "default is 6.\n"
        "questions = {\n"
        '    "llama-3.1-70b": dict(devices=512, batch=1024, seq=4096, options=sk.PlanOptions()),\n'
        '    "mixtral-8x7b": dict(devices=64, batch=256, seq=4096, options=sk.PlanOptions(compile_top=3)),\n'
        "}\n"
        "results = {}\n"
        "for name, question in questions.items():\n"
        '    results[name] = sk.plan(init_from=name, hardware="h100", **question)\n'
        '    print(sk.format_plans(results[name], top=6), end="\\n\\n")',
    ),
    (
        "markdown",
        "## Every candidate layout\nEach point is a layout at the first setting (remat, microbatches, ZeRO) "
        "that fits it: compiled ones at their compiled memory and predicted step, the others at their "
        "analytic estimate. The star is the plan to run; the red line is the memory budget (90% of 80 GB). "
        "The estimate is close to what the compiled steps predict (within 0.6-2.1x over every layout of the "
        "Llama question; for Mixtral's dropless routing it counts each expert padded to the whole group, as "
        "the compiled dispatch is), but a grey point is still an estimate, not a plan: `--compile-top 0` "
        "compiles every one of them.",
    ),
    (
        "code",
        "fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))\n"
        "for ax, (name, result) in zip(axes, results.items()):\n"
        '    rows = result["plans"]\n'
        "    kinds = {\n"
        '        "compiled, fits": ([p for p in rows if p["compiled"] and p["fits"]], "tab:blue", "o"),\n'
        '        "compiled, does not fit": ([p for p in rows if p["compiled"] and not p["fits"]], "tab:red", "x"),\n'
        '        "estimated only": ([p for p in rows if not p["compiled"]], "0.7", "."),\n'
        "    }\n"
        "    for label, (plans, color, marker) in kinds.items():\n"
        '        x = [p["memory_per_device"] / 1e9 for p in plans]\n'
        '        y = [p["predicted_step_seconds"] or p["estimated_step_seconds"] for p in plans]\n'
        '        ax.scatter(x, y, c=color, marker=marker, label=f"{label} ({len(plans)})")\n'
        "    best = rows[0]\n"
        '    ax.scatter([best["memory_per_device"] / 1e9], [best["predicted_step_seconds"]], s=250, marker="*",\n'
        '               c="gold", edgecolors="k", zorder=3, label=f"best: {best[\'layout\']}")\n'
        '    ax.axvline(result["memory_budget"] / 1e9, color="r", lw=0.8)\n'
        '    ax.set_xscale("log"); ax.set_yscale("log")\n'
        '    ax.set_xlabel("GB per device"); ax.set_ylabel("seconds per step (predicted or estimated)")\n'
        "    q = questions[name]\n"
        "    ax.set_title(f\"{name} on {q['devices']} H100, batch {q['batch']} x seq {q['seq']}: \"\n"
        "                 f\"{result['searched']} layouts, {result['compiled']} compiled\", fontsize=10)\n"
        '    ax.legend(fontsize=8, loc="upper right")\n'
        "plt.tight_layout()\nplt.show()",
    ),
    (
        "code",
        "# The best plan is a complete command for the real checkpoint (point --init-from at its directory).\n"
        "for name, result in results.items():\n"
        "    print(f\"shardkit train {result['best_flags']}\")\n"
        '    assert result["best"] is not None and sk.Layout.parse(result["best"]).num_devices == questions[name]["devices"]\n'
        '    assert result["plans"][0]["fits"] and result["plans"][0]["memory_per_device"] <= result["memory_budget"]\n'
        "# A mixture of experts is planned over the expert axis too.\n"
        'assert any("expert" in p["layout"] for p in results["mixtral-8x7b"]["plans"])',
    ),
]

PIPELINE = [
    (
        "markdown",
        "# Pipeline, experts and sequence: the layouts with explicit communication\n\n"
        "Pipeline stages (`stage` axis), ring attention (`sequence` axis) and mixtures of experts "
        "(`expert` axis) each run a `jax.shard_map` island inside the compiled step, composed with "
        "the annotated layouts on the other axes. On 8 simulated CPU devices.",
    ),
    (
        "code",
        "import shardkit as sk\n\nsk.simulate_devices(8)\n\n"
        "import jax\nimport jax.numpy as jnp\nimport matplotlib.pyplot as plt\nimport optax\n\n"
        "from shardkit.parallel.schedule import make_schedule\n\n"
        "data = sk.TextDataset.builtin()",
    ),
    (
        "markdown",
        "## The pipeline schedules\nEach row is a stage, time runs right; a stage's forward (blue) costs 1, "
        "its backward (orange) 2. Grey is the bubble: (p-1)/(m+p-1) of the step for both "
        "schedules. 1F1B starts each microbatch's backward as soon as it can, so a stage holds at "
        "most 2(p-s)-1 microbatch inputs instead of all m. Interleaved 1F1B (v=2 chunks per device, "
        "labels microbatch.chunk) runs half a stage per slot and cuts the bubble to (p-1)/(vm+p-1).",
    ),
    (
        "code",
        "def draw(schedule, ax, fwd=1.0, bwd=2.0):\n"
        "    m, v = schedule.microbatches, schedule.virtual_stages\n"
        "    fwd, bwd = fwd / v, bwd / v  # a slot runs one chunk of a stage\n"
        "    label = lambda q: f'{q % m}.{q // m}' if v > 1 else str(q)\n"
        "    t = 0.0\n"
        "    for kind, f, b in schedule.rows():\n"
        "        width = fwd * ('F' in kind) + bwd * ('B' in kind)\n"
        "        for s in range(schedule.stages):\n"
        "            ax.add_patch(plt.Rectangle((t, s), width, 0.9, color='0.85'))\n"
        "            if f[s] >= 0:\n"
        "                ax.add_patch(plt.Rectangle((t, s), fwd, 0.9, color='tab:blue'))\n"
        "                ax.text(t + fwd / 2, s + 0.45, label(f[s]), ha='center', va='center', color='w', fontsize=6)\n"
        "            if b[s] >= 0:\n"
        "                x0 = t + fwd * ('F' in kind)\n"
        "                ax.add_patch(plt.Rectangle((x0, s), bwd, 0.9, color='tab:orange'))\n"
        "                ax.text(x0 + bwd / 2, s + 0.45, label(b[s]), ha='center', va='center', fontsize=6)\n"
        "        t += width\n"
        "    ax.set_xlim(0, t); ax.set_ylim(schedule.stages, 0)\n"
        "    ax.set_yticks([s + 0.45 for s in range(schedule.stages)], [f'stage {s}' for s in range(schedule.stages)])\n"
        "    ax.set_title(f'{schedule.name}: p={schedule.stages}, m={schedule.microbatches}, v={v}, '\n"
        "                 f'bubble {schedule.bubble():.3f}, holds up to {schedule.stash} microbatches')\n\n"
        "# Each schedule on its own time axis: a shared one would cut the longer rows off.\n"
        "fig, axes = plt.subplots(3, 1, figsize=(11, 7.5))\n"
        "for ax, (name, v) in zip(axes, [('gpipe', 1), ('1f1b', 1), ('1f1b', 2)]):\n"
        "    draw(make_schedule(name, 4, 8, virtual_stages=v), ax)\n"
        "    ax.set_xlabel('time (one stage forward = 1)')\n"
        "plt.tight_layout(); plt.show()\n"
        "print(make_schedule('1f1b', 4, 8).format())",
    ),
    (
        "markdown",
        "## Train a pipelined GPT\n2 stages x 2-way data x 2-way tensor parallelism, 4 microbatches, 1F1B. "
        "Each stage holds half the layers (and their optimizer state); the loss is the one a single "
        "device computes.",
    ),
    (
        "code",
        'cfg = sk.models.GPTConfig.preset("tiny", n_layers=4)\n'
        'pipelined = sk.Trainer(cfg.model(), optax.adamw(3e-3), "stage=2,data=2,tensor=2", microbatches=4, '
        'schedule="1f1b")\n'
        'one_device = sk.Trainer(cfg.model(), optax.adamw(3e-3), "data=1", devices=jax.devices()[:1])\n'
        "state, ref_state = pipelined.init(0), one_device.init(0)\n"
        "losses, ref_losses = [], []\n"
        "for step in range(30):\n"
        "    tokens = data.batch(step, batch_size=16, seq_len=64)\n"
        "    state, metrics = pipelined.step(state, pipelined.shard_batch(tokens))\n"
        "    ref_state, ref_metrics = one_device.step(ref_state, one_device.shard_batch(tokens))\n"
        '    losses.append(float(metrics["loss"])); ref_losses.append(float(ref_metrics["loss"]))\n'
        'print(f"pipelined loss {losses[0]:.4f} -> {losses[-1]:.4f}; one device {ref_losses[0]:.4f} -> '
        '{ref_losses[-1]:.4f}")\n'
        "assert abs(losses[0] - ref_losses[0]) < 1e-4 and losses[-1] < losses[0] - 1.0\n"
        'plt.plot(losses, label="stage=2,data=2,tensor=2 (1F1B)"); plt.plot(ref_losses, "--", label="one device")\n'
        'plt.xlabel("step"); plt.ylabel("loss"); plt.legend(); plt.show()',
    ),
    (
        "code",
        "# What the compiler did: activations and gradients hop between stages by collective-permute.\n"
        'report = pipelined.report({"tokens": jax.ShapeDtypeStruct((16, 65), jnp.int32)})\n'
        "print(report.table())",
    ),
    (
        "markdown",
        "## Memory per device against sequence length: every score, blocked, and the ring\n"
        "Same global batch (8 sequences). `data=8` gives each device whole sequences; with "
        '`attention="xla"` it forms every score (T^2 per head), by default it runs the blocked '
        "kernel from 512 tokens (`sk.attention`: memory linear in T). `sequence=8` gives each device "
        "an eighth of every sequence and ring attention, each step the blocked kernel: for rows one "
        "device cannot hold at all.",
    ),
    (
        "code",
        "lengths = [256, 512, 1024, 2048]\n"
        "memory = {}\n"
        'for label, layout, attention in [("data=8, every score", "data=8", "xla"), ("data=8", "data=8", None), '
        '("sequence=8", "sequence=8", None)]:\n'
        '    small = sk.models.GPTConfig.preset("tiny", max_seq=2048, attention=attention)\n'
        "    trainer = sk.Trainer(small.model(), optax.adamw(1e-3), layout)\n"
        "    memory[label] = [\n"
        '        trainer.compile({"tokens": jax.ShapeDtypeStruct((8, t + 1), jnp.int32)}).memory_analysis().temp_size_in_bytes\n'
        "        for t in lengths\n"
        "    ]\n"
        "for layout, values in memory.items():\n"
        '    plt.plot(lengths, [v / 1e6 for v in values], "o-", label=layout)\n'
        'plt.xscale("log", base=2); plt.yscale("log"); plt.xlabel("sequence length"); '
        'plt.ylabel("temporary MB per device"); plt.legend(); plt.show()\n'
        'ratio = memory["data=8, every score"][-1] / memory["data=8"][-1]\n'
        'print(f"at T={lengths[-1]}: {ratio:.1f}x less memory per device in blocks")\n'
        "assert ratio > 10",
    ),
    (
        "markdown",
        "## A mixture-of-experts GPT\n4 experts, top-2 routing with capacity factor 1.25, experts split "
        "over `expert=4`, tokens dispatched by all-to-all; the load-balancing loss is part of the loss.",
    ),
    (
        "code",
        'moe = sk.models.GPTConfig.preset("tiny", n_experts=4, top_k=2)\n'
        'trainer = sk.Trainer(moe.model(), optax.adamw(3e-3), "expert=4,data=2")\n'
        "state = trainer.init(0)\n"
        "losses = []\n"
        "for step in range(30):\n"
        "    state, metrics = trainer.step(state, trainer.shard_batch(data.batch(step, batch_size=16, seq_len=64)))\n"
        '    losses.append(float(metrics["loss"]))\n'
        'print(f"MoE loss {losses[0]:.3f} -> {losses[-1]:.3f}")\n'
        "assert losses[-1] < losses[0] - 1.0\n"
        'report = trainer.report({"tokens": jax.ShapeDtypeStruct((16, 65), jnp.int32)})\n'
        "by_kind = {}\n"
        "for c in report.collectives:\n"
        "    axes = '+'.join(c.axes) or 'no mesh axis'\n"
        '    key = f"{c.kind}\\nover {axes}"\n'
        "    by_kind[key] = by_kind.get(key, 0) + c.count\n"
        "fig, (ax, curve) = plt.subplots(1, 2, figsize=(11, 3.2))\n"
        'ax.barh(list(by_kind), list(by_kind.values()), color="tab:purple")\n'
        'ax.set_xlabel("collectives per step"); ax.set_title("MoE step: tokens go to their experts by all-to-all")\n'
        'curve.plot(losses); curve.set_xlabel("step"); curve.set_ylabel("loss"); curve.set_title("MoE loss")\n'
        "plt.tight_layout(); plt.show()\n"
        'assert any(k.startswith("all-to-all") and "expert" in k for k in by_kind)',
    ),
]


BRING_YOUR_OWN = [
    (
        "markdown",
        "# Bring your own model\n\nA Gemma-style NNX language model written the way Flax users write one: "
        "`nnx.with_partitioning` names on its kernels, grouped-query attention, blocks with several positional "
        "arguments, and no `sk.constrain` anywhere (`examples/byo_models.py`; it does not import shardkit). "
        "We take it from unannotated to sharded, reported, dry-run at another size and planned.",
    ),
    (
        "code",
        "import pathlib\nimport sys\n\nimport shardkit as sk\n\nsk.simulate_devices(8)\n\n"
        "sys.path.insert(0, str(pathlib.Path(sk.__file__).parents[1] / 'examples'))  # the repository's examples\n"
        "import jax\nimport jax.numpy as jnp\nimport matplotlib.pyplot as plt\nimport numpy as np\nimport optax\n"
        "from byo_models import GemmaLM, LMConfig\n\n"
        "cfg = LMConfig(dim=128, mlp=512, layers=4)\n"
        "model = sk.from_nnx(lambda rngs: GemmaLM(cfg, rngs=rngs))\n"
        "trainer = sk.Trainer(model, optax.adamw(3e-3), 'fsdp=8')\n"
        "print(trainer.format_sharding_table())",
    ),
    (
        "markdown",
        "## What FSDP does to a model that constrains nothing\nWithout help XLA copies the weights' `embed -> fsdp` "
        "split into the activations and all-reduces them in every matmul. shardkit constrains every submodule's "
        "batched outputs to the batch axes (`boundaries=True`, the default), so the weights are gathered instead: "
        "ZeRO-3's all-gathers and reduce-scatters.",
    ),
    (
        "code",
        "batch = {'tokens': jax.ShapeDtypeStruct((16, 129), jnp.int32)}\n"
        "rows = {}\n"
        "for label, boundaries in (('before', False), ('after', True)):\n"
        "    m = sk.from_nnx(lambda rngs: GemmaLM(cfg, rngs=rngs), boundaries=boundaries)\n"
        "    for layout in ('data=8', 'fsdp=8'):\n"
        "        r = sk.Trainer(m, optax.adamw(3e-3), layout).report(batch)\n"
        "        rows[label, layout] = (r.ratios['bytes'], r.memory.temp / 1e6)\n"
        "        print(f'{label:6s} {layout:7s} moved/bound {r.ratios[\"bytes\"]:5.2f}  temp {r.memory.temp / 1e6:6.1f} MB')\n"
        "fig, axes = plt.subplots(1, 2, figsize=(9, 3))\n"
        "names = [f'{w}\\n{l}' for w, l in rows]\n"
        "axes[0].bar(names, [v[0] for v in rows.values()], color=['grey', 'grey', 'tab:blue', 'tab:blue'])\n"
        "axes[0].axhline(1.0, color='k', ls='--', lw=1); axes[0].set_ylabel('bytes moved / lower bound')\n"
        "axes[1].bar(names, [v[1] for v in rows.values()], color=['grey', 'grey', 'tab:blue', 'tab:blue'])\n"
        "axes[1].set_ylabel('temporary MB per device')\n"
        "fig.tight_layout()\n"
        "assert rows['after', 'fsdp=8'][0] <= 1.05 < rows['before', 'fsdp=8'][0]",
    ),
    ("markdown", "## The collectives, named by the model's own module paths"),
    ("code", "print(trainer.report(batch).table())"),
    (
        "markdown",
        "## Renaming a few parameters\n`sk.annotate` keeps the model's own names and overrides only what its "
        "regexes match. A rule that matches nothing is a warning the report lists (an error with `strict=True`).",
    ),
    (
        "code",
        "import warnings\n"
        "with warnings.catch_warnings(record=True):\n"
        "    warnings.simplefilter('always')\n"
        "    renamed = sk.annotate(model, [(r'mlp/down/kernel$', ('mlp', None)), (r'not/in/this/model$', None)])\n"
        "t = sk.Trainer(renamed, optax.adamw(3e-3), 'fsdp=8')\n"
        "print([r['spec'] for r in t.sharding_table() if r['path'].endswith('down/kernel')])\n"
        "print(sk.report.sharding_warnings(t))",
    ),
    (
        "markdown",
        "## Training under a hybrid layout, next to one device\nThe same losses on `data=2,fsdp=2,tensor=2` as "
        "on one device.",
    ),
    (
        "code",
        "data = sk.TextDataset.builtin()\n"
        "def train(layout, devices):\n"
        "    t = sk.Trainer(model, optax.adamw(3e-3), layout, devices=devices)\n"
        "    state, losses = t.init(0), []\n"
        "    for step in range(20):\n"
        "        state, metrics = t.step(state, t.shard_batch(data.batch(step, batch_size=16, seq_len=64)))\n"
        "        losses.append(float(metrics['loss']))\n"
        "    return losses\n"
        "one = train('data=1', jax.devices()[:1])\n"
        "hybrid = train('data=2,fsdp=2,tensor=2', jax.devices())\n"
        "plt.figure(figsize=(5, 3)); plt.plot(one, label='1 device'); plt.plot(hybrid, '--', label='data=2,fsdp=2,tensor=2')\n"
        "plt.xlabel('step'); plt.ylabel('loss'); plt.legend(); plt.tight_layout()\n"
        "np.testing.assert_allclose(hybrid, one, rtol=1e-4)\n"
        "print(f'loss {one[0]:.3f} -> {one[-1]:.3f} on both')",
    ),
    (
        "markdown",
        "## A dry run of this model at another size, and a plan\nA factory (`byo_factories:gemma_lm`) names "
        "the model so another process can build it: here a dry run for 16 devices, then the planner's ranking "
        "of layouts for 8 H100s, priced from the compiled programs of this model.",
    ),
    (
        "code",
        "from byo_factories import gemma_lm\n"
        "result = sk.dryrun(gemma_lm, layout='fsdp=8,tensor=2', batch=32, seq=64)\n"
        "print(sk.report.Report.from_dict(result).table())",
    ),
    (
        "code",
        "options = sk.PlanOptions(tensor=(1, 2), sequence=(1,), stage=(1,), microbatches=(1,))\n"
        "plan = sk.plan(gemma_lm, 8, 'h100', batch=32, seq=64, options=options)\n"
        "print(sk.format_plans(plan))",
    ),
]

FINETUNE = [
    (
        "markdown",
        "# Fine-tune a pretrained checkpoint\n\nA Llama-3-shaped checkpoint (`config.json` in transformers 5's spelling, "
        "`model.safetensors`, `tokenizer.json`, as published on the Hugging Face Hub) is built here with NumPy, imported into shardkit's "
        "GPT under a hybrid layout on 8 simulated devices, fine-tuned with a held-out loss, exported back, and "
        "checked after the round trip.",
    ),
    (
        "code",
        "import shardkit as sk\n\nsk.simulate_devices(8)\n\n"
        "import json\nimport pathlib\nimport shutil\n\n"
        "import matplotlib.pyplot as plt\nimport numpy as np\nimport optax\n"
        "from safetensors import safe_open\nfrom safetensors.numpy import save_file\n\n"
        "from shardkit.io.tokenizer import train_bpe",
    ),
    (
        "markdown",
        "## A checkpoint in Hugging Face's layout\nWeights stored as PyTorch's `nn.Linear` keeps them "
        "(out, in), grouped-query attention (8 query heads, 2 KV heads), tied embeddings, Llama 3.1's rotary scaling "
        "(`rope_type: llama3`, base 500,000), a byte-level BPE tokenizer of 512 tokens.",
    ),
    (
        "code",
        "ckpt = pathlib.Path('llama3-small'); shutil.rmtree(ckpt, ignore_errors=True); ckpt.mkdir()\n"
        "text = sk.builtin_corpus()\n"
        "tokenizer = train_bpe(text, 512, ckpt / 'tokenizer.json')\n"
        "V, D, F, L, H, KV = tokenizer.get_vocab_size(), 128, 344, 2, 8, 2\n"
        "K = D // H\n"
        "rng = np.random.default_rng(0)\n"
        "def w(*shape):\n"
        "    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)\n"
        "tensors = {'model.embed_tokens.weight': w(V, D), 'model.norm.weight': np.ones(D, np.float32)}  # tied: no lm_head\n"
        "for i in range(L):\n"
        "    p = f'model.layers.{i}.'\n"
        "    tensors |= {p + 'self_attn.q_proj.weight': w(H * K, D), p + 'self_attn.k_proj.weight': w(KV * K, D),\n"
        "                p + 'self_attn.v_proj.weight': w(KV * K, D), p + 'self_attn.o_proj.weight': w(D, H * K),\n"
        "                p + 'mlp.gate_proj.weight': w(F, D), p + 'mlp.up_proj.weight': w(F, D), p + 'mlp.down_proj.weight': w(D, F),\n"
        "                p + 'input_layernorm.weight': np.ones(D, np.float32), p + 'post_attention_layernorm.weight': np.ones(D, np.float32)}\n"
        "save_file(tensors, str(ckpt / 'model.safetensors'), metadata={'format': 'pt'})\n"
        "config = dict(architectures=['LlamaForCausalLM'], model_type='llama', vocab_size=V, hidden_size=D,\n"
        "              intermediate_size=F, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,\n"
        "              head_dim=K, max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act='silu', tie_word_embeddings=True,\n"
        "              rope_parameters=dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,\n"
        "                                   high_freq_factor=4.0, original_max_position_embeddings=64))\n"
        "(ckpt / 'config.json').write_text(json.dumps(config, indent=2))\n"
        "print(sorted(p.name for p in ckpt.iterdir()))\n"
        "print(len(tensors), 'tensors,', sum(t.size for t in tensors.values()) / 1e6, 'M parameters')",
    ),
    (
        "markdown",
        "## Import, sharded\n`sk.from_pretrained` maps the names (q/k/v fused per KV group, gate/up fused, "
        "(out, in) transposed) and reads each parameter straight into its shards.",
    ),
    (
        "code",
        "run = sk.from_pretrained(ckpt, layout='data=2,fsdp=2,tensor=2', optimizer=optax.adamw(1e-3))\n"
        "print(run.config.rope_theta, run.config.rope_scaling, run.config.tie_embeddings)\n"
        "print(run.trainer.format_sharding_table())",
    ),
    (
        "markdown",
        "## What `rope_type: llama3` does\nEach rotary frequency of a head, before and after Llama 3.1's scaling: "
        "wavelengths longer than the original context are stretched by the factor, short ones kept, the band between "
        "interpolated. A checkpoint read with the default frequencies gives wrong logits with no error.",
    ),
    (
        "code",
        "from shardkit.models.rope import inverse_frequencies\n"
        "plain = inverse_frequencies(K, run.config.rope_theta)\n"
        "scaled = inverse_frequencies(K, run.config.rope_theta, run.config.rope_scaling)\n"
        "plt.figure(figsize=(6, 3))\n"
        "plt.semilogy(plain, 'o-', label='default (base 500,000)')\n"
        "plt.semilogy(scaled, 's-', label='llama3 scaling, factor 8')\n"
        "plt.xlabel('frequency index within a head'); plt.ylabel('inverse frequency'); plt.legend(); plt.tight_layout()\n"
        "print('scaled / plain:', np.round(scaled / plain, 3))",
    ),
    (
        "markdown",
        "## Fine-tune with a held-out loss\nThe text, cut by the checkpoint's tokenizer; its last 5% is held out.",
    ),
    (
        "code",
        "data, held_out = sk.TextDataset.from_text(text, tokenizer).split(0.05)\n"
        "trainer, state = run.trainer, run.state\n"
        "train_losses, eval_points = [], []\n"
        "def held_out_loss(params, trainer=trainer):\n"
        "    losses = [trainer.evaluate(params, trainer.shard_batch(held_out.batch(i, 16, 64)))['loss'] for i in range(4)]\n"
        "    return float(np.mean(losses))\n"
        "eval_points.append((0, held_out_loss(state.params)))\n"
        "for step in range(60):\n"
        "    state, metrics = trainer.step(state, trainer.shard_batch(data.batch(step, batch_size=16, seq_len=64)))\n"
        "    train_losses.append(float(metrics['loss']))\n"
        "    if (step + 1) % 15 == 0:\n"
        "        eval_points.append((step + 1, held_out_loss(state.params)))\n"
        "print('held-out loss:', ', '.join(f'{s}: {l:.3f}' for s, l in eval_points))\n"
        "assert eval_points[-1][1] < eval_points[0][1]",
    ),
    (
        "code",
        "plt.figure(figsize=(6, 3))\n"
        "plt.plot(range(1, 61), train_losses, label='train')\n"
        "plt.plot(*zip(*eval_points), 'o-', label='held out')\n"
        "plt.xlabel('step'); plt.ylabel('loss'); plt.legend(); plt.tight_layout()",
    ),
    (
        "markdown",
        "## Export, and read it back\n`run.save` writes `config.json` (the checkpoint's own keys kept) and "
        "`model.safetensors`, loadable by transformers as a `LlamaForCausalLM`. Imported again, under another layout, "
        "it gives the same held-out loss.",
    ),
    (
        "code",
        "out = pathlib.Path('llama3-small-tuned'); shutil.rmtree(out, ignore_errors=True)\n"
        "run.save(state.params, out)\n"
        "with safe_open(str(out / 'model.safetensors'), 'np') as f:\n"
        "    names = sorted(f.keys())\n"
        "    changed = np.abs(f.get_tensor('model.layers.0.self_attn.q_proj.weight') - tensors['model.layers.0.self_attn.q_proj.weight']).max()\n"
        "print(len(names), 'tensors written; q_proj of layer 0 moved by up to', float(changed))\n"
        "again = sk.from_pretrained(out, layout='fsdp=8')\n"
        "after = held_out_loss(again.state.params, again.trainer)\n"
        "print(f'held-out loss after the round trip {after:.5f}, before {eval_points[-1][1]:.5f}')\n"
        "assert abs(after - eval_points[-1][1]) < 1e-4",
    ),
]


LORA = [
    (
        "markdown",
        "# LoRA on a chat set, in peft's format\n\nA Qwen3-shaped checkpoint (per-head q/k norms, tied embeddings, a "
        "ChatML chat template) is built here with NumPy. LoRA adapters train on a small chat set while the base stays "
        "frozen, under a hybrid layout on 8 simulated devices; the adapter is saved in peft's format, loaded back with "
        "`sk.from_pretrained(..., adapter=)`, and the answers before and after are compared.",
    ),
    (
        "code",
        "import shardkit as sk\n\nsk.simulate_devices(8)\n\n"
        "import json\nimport pathlib\nimport shutil\n\n"
        "import matplotlib.pyplot as plt\nimport numpy as np\nimport optax\n"
        "from safetensors.numpy import save_file\n\n"
        "from shardkit.io.instructions import InstructionDataset, template_of",
    ),
    (
        "markdown",
        "## A checkpoint with a chat template\nByte tokens (vocabulary 256), 2 layers, 4 query heads over 2 KV heads, "
        "q/k RMSNorm per head; `tokenizer_config.json` carries the chat template transformers would render.",
    ),
    (
        "code",
        "ckpt = pathlib.Path('qwen3-small'); shutil.rmtree(ckpt, ignore_errors=True); ckpt.mkdir()\n"
        "V, D, F, L, H, KV, K = 256, 96, 256, 2, 4, 2, 24\n"
        "rng = np.random.default_rng(0)\n"
        "def w(*shape):\n"
        "    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)\n"
        "ones = lambda n: np.ones(n, np.float32)\n"
        "tensors = {'model.embed_tokens.weight': w(V, D), 'model.norm.weight': ones(D)}  # tied: no lm_head\n"
        "for i in range(L):\n"
        "    p = f'model.layers.{i}.'\n"
        "    tensors |= {p + 'self_attn.q_proj.weight': w(H * K, D), p + 'self_attn.k_proj.weight': w(KV * K, D),\n"
        "                p + 'self_attn.v_proj.weight': w(KV * K, D), p + 'self_attn.o_proj.weight': w(D, H * K),\n"
        "                p + 'self_attn.q_norm.weight': ones(K), p + 'self_attn.k_norm.weight': ones(K),\n"
        "                p + 'mlp.gate_proj.weight': w(F, D), p + 'mlp.up_proj.weight': w(F, D), p + 'mlp.down_proj.weight': w(D, F),\n"
        "                p + 'input_layernorm.weight': ones(D), p + 'post_attention_layernorm.weight': ones(D)}\n"
        "save_file(tensors, str(ckpt / 'model.safetensors'), metadata={'format': 'pt'})\n"
        "config = dict(architectures=['Qwen3ForCausalLM'], model_type='qwen3', vocab_size=V, hidden_size=D, intermediate_size=F,\n"
        "              num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV, head_dim=K, max_position_embeddings=256,\n"
        "              rms_norm_eps=1e-6, hidden_act='silu', tie_word_embeddings=True,\n"
        "              rope_parameters=dict(rope_type='default', rope_theta=1e6))\n"
        "(ckpt / 'config.json').write_text(json.dumps(config, indent=2))\n"
        "chatml = (\"{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\\\n' + m['content'] + '<|im_end|>\\\\n' }}\"\n"
        "          \"{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\\\n' }}{% endif %}\")\n"
        "(ckpt / 'tokenizer_config.json').write_text(json.dumps({'chat_template': chatml, 'eos_token': '<|im_end|>'}))\n"
        "print(sorted(p.name for p in ckpt.iterdir()))",
    ),
    (
        "markdown",
        "## Chat data: rendered, scored on the answers, packed by document\nEach chat is rendered by the checkpoint's "
        "template; only the assistant's tokens are scored (`loss_mask`), and chats are packed whole into rows of 256 "
        "tokens (`segments`: attention stays within a chat, positions restart at each).",
    ),
    (
        "code",
        "capitals = {'France': 'Paris', 'Italy': 'Rome', 'Spain': 'Madrid', 'Japan': 'Tokyo', 'Egypt': 'Cairo',\n"
        "            'Peru': 'Lima', 'Kenya': 'Nairobi', 'Canada': 'Ottawa'}\n"
        "chats = [{'messages': [{'role': 'user', 'content': f'Capital of {c}?'}, {'role': 'assistant', 'content': f'{city}.'}]}\n"
        "         for c, city in capitals.items()]\n"
        "template = template_of(str(ckpt))\n"
        "data = InstructionDataset.from_rows(chats * 16, seed=0, template=template)\n"
        "batch = data.batch(0, 4, 255)\n"
        "row, seg, mask = batch['tokens'][0], batch['segments'][0], batch['loss_mask'][0]\n"
        "print(bytes(row[seg == 1].astype(np.uint8)).decode())\n"
        "print('scored:', repr(bytes(row[(seg == 1) & (mask > 0)].astype(np.uint8)).decode()))\n"
        "print('chats in the first row:', seg.max())",
    ),
    (
        "markdown",
        "## LoRA on the frozen base\nRank 16 on every projection; only the adapters have gradients and optimizer "
        "state, each split as its base weight is.",
    ),
    (
        "code",
        "lora = sk.LoRA(rank=16, alpha=32, targets=('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'))\n"
        "run = sk.from_pretrained(ckpt, lora=lora, layout='data=2,fsdp=2,tensor=2', optimizer=optax.adamw(1e-2))\n"
        "print('\\n'.join(line for line in run.trainer.format_sharding_table().splitlines() if 'lora' in line or 'parameter' in line))\n\n"
        "def answer(params, country):\n"
        "    prompt = template.render([{'role': 'user', 'content': f'Capital of {country}?'}], True, 'prompt').encode()\n"
        "    new = run.generate([list(prompt)], 16, params=params)[0]\n"
        "    return bytes(new).decode(errors='replace').split('<|im_end')[0]\n\n"
        "before = {c: answer(run.state.params, c) for c in capitals}\n"
        "print(before)",
    ),
    (
        "code",
        "state, losses = run.state, []\n"
        "for step in range(100):\n"
        "    state, metrics = run.trainer.step(state, run.trainer.shard_batch(data.batch(step, 4, 255)))\n"
        "    losses.append(float(metrics['loss']))\n"
        "print(f'loss {losses[0]:.3f} -> {losses[-1]:.3f}, {int(metrics[\"tokens\"])} answer tokens scored in the last step')\n"
        "plt.figure(figsize=(6, 3)); plt.semilogy(losses); plt.xlabel('step'); plt.ylabel('loss on the answers')\n"
        "plt.title('LoRA r=16, base frozen'); plt.tight_layout(); plt.show()",
    ),
    (
        "markdown",
        "## Save in peft's format, load back\n`adapter_only=True` writes `adapter_config.json` and "
        "`adapter_model.safetensors` with peft's names; peft loads them onto the base, and so does `from_pretrained`.",
    ),
    (
        "code",
        "adapter = pathlib.Path('capitals-adapter'); shutil.rmtree(adapter, ignore_errors=True)\n"
        "run.save(state.params, adapter, adapter_only=True)\n"
        "print(sorted(p.name for p in adapter.iterdir()))\n"
        "settings = json.loads((adapter / 'adapter_config.json').read_text())\n"
        "print({k: settings[k] for k in ('r', 'lora_alpha', 'target_modules', 'base_model_name_or_path')})\n"
        "tuned = sk.from_pretrained(ckpt, adapter=adapter, layout='data=2,fsdp=2,tensor=2')\n"
        "after = {c: answer(tuned.state.params, c) for c in capitals}\n"
        "for c in capitals:\n"
        "    print(f'{c:7s} before {before[c]!r:28s} after {after[c]!r}')\n"
        "assert after == {c: answer(state.params, c) for c in capitals}  # the loaded adapter is the trained one",
    ),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_inspect_and_dryrun.ipynb": INSPECT,
    "03_pipeline_experts_sequence.ipynb": PIPELINE,
    "04_checkpoint_and_resume.ipynb": CHECKPOINT,
    "05_plan.ipynb": PLAN,
    "06_bring_your_own_model.ipynb": BRING_YOUR_OWN,
    "07_finetune_pretrained.ipynb": FINETUNE,
    "08_lora_chat.ipynb": LORA,
}


def build(cells) -> nbformat.NotebookNode:
    """A notebook of ``(kind, source)`` cells, with fixed cell ids so rebuilding changes nothing."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
        for kind, src in cells
    ]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"
    return nb


def execute(nb: nbformat.NotebookNode, workdir: str, timeout: int = 900, xla_flags: str = "") -> nbformat.NotebookNode:
    """Run ``nb`` in a fresh Python kernel from ``workdir``, on simulated devices it chooses itself.

    ``xla_flags`` become the kernel's ``XLA_FLAGS`` (XLA's defaults when empty, as a reader's
    kernel; the tests pass their faster-compiling flags).
    """
    from nbclient import NotebookClient

    env = {**os.environ, "XLA_FLAGS": xla_flags}  # no device count: the notebook chooses its own
    env.pop("MPLBACKEND", None)  # the kernel's inline backend: pictures in the outputs
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": workdir}})
    client.execute(env=env)  # the kernel's environment; this process's own is left as it was
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timestamps would change every run
    return nb


if __name__ == "__main__":
    chosen = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name, cells in NOTEBOOKS.items():
        if chosen and not any(name.startswith(c) for c in chosen):
            continue
        nb = build(cells)
        if "--no-run" not in sys.argv:
            with tempfile.TemporaryDirectory() as workdir:
                execute(nb, workdir)
            print(f"executed {name}", flush=True)
        nbformat.write(nb, HERE / name)
