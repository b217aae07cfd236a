"""Write the notebooks from their cells here (so their source is reviewable as Python).

python notebooks/make_notebooks.py      # rewrites notebooks/*.ipynb (outputs empty)
"""

import pathlib

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
    ("markdown", "## What the compiler did\nCollectives in the compiled step, by kind and mesh axes."),
    (
        "code",
        "import collections\nfrom shardkit import hlo\n\n"
        "compiled = trainer.compile(batch)\n"
        "counts = collections.Counter()\n"
        "for c in hlo.collectives(compiled.as_text()):\n"
        "    counts[(c.kind, '+'.join(hlo.mesh_axes_of(c.groups, trainer.mesh)))] += c.executions\n"
        "for (kind, axes), n in sorted(counts.items()):\n"
        "    print(f'{kind:12s} over {axes:10s} x{n}')",
    ),
]


def build(cells, path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
        for kind, src in cells
    ]
    nbformat.write(nb, path)


if __name__ == "__main__":
    build(QUICKSTART, HERE / "01_quickstart.ipynb")
