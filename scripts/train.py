"""Train a GPT with shardkit as a library, in one page you can read top to bottom and edit
(nanoGPT-style): the settings are the constants below, or ``key=value`` arguments.

    python scripts/train.py                                    # 8 simulated CPU devices on a laptop
    python scripts/train.py layout=fsdp=8 steps=200 model=mini
    python scripts/train.py data=my_text.txt lr=1e-3

On a machine with GPUs the same command uses them. ``shardkit train`` is the full command (run
directories, checkpoints, precision, pipelines); this file shows what it does underneath.
"""

import sys
import time

import shardkit as sk
from shardkit.runtime.xla_flags import use_overlap_flags

# Settings: edit them here, or override as key=value on the command line.
model = "tiny"  # a GPT preset: tiny, mini, gpt2-small, ... (sk.models.GPTConfig.preset)
layout = "data=2,fsdp=2,tensor=2"  # mesh axis sizes; -1 fills the rest
steps = 100
batch = 16  # sequences per step, across all devices
seq = 64  # tokens per sequence
lr = 3e-3
warmup = 10
data = ""  # a text file, or "" for the built-in corpus
seed = 0
log_every = 10

for argument in sys.argv[1:]:  # key=value, typed like the default it replaces
    key, _, value = argument.partition("=")
    if key not in globals() or key.startswith("_") or not _:
        sys.exit(f"train.py: {argument!r}: give key=value with a setting of this file, e.g. steps=50")
    globals()[key] = type(globals()[key])(value)

sk.simulate_devices(sk.Layout.parse(layout).num_devices if "-1" not in layout else 8, if_no_accelerator=True)
use_overlap_flags()  # on GPUs, collectives overlap compute (shardkit.runtime.xla_flags); the CPU ignores them

import optax  # imported after the simulated device count is set, as JAX starts here

from shardkit.io.data import load_text

cfg = sk.models.GPTConfig.preset(model)
net = sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs))
warmup = min(warmup, steps - 1)  # a run shorter than the warmup still decays
schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 10)
trainer = sk.Trainer(net, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), layout)
print(f"{model} on {trainer.layout.spec()}:")
print(trainer.format_sharding_table())

corpus = sk.TextDataset.from_bytes(load_text(data), seed) if data else sk.TextDataset.builtin(seed)
state = trainer.init(seed=seed)
start = time.perf_counter()
for step in range(1, steps + 1):
    tokens = trainer.shard_batch(corpus.batch(step - 1, batch_size=batch, seq_len=seq))
    state, metrics = trainer.step(state, tokens)
    if step % log_every == 0 or step == steps:
        rate = step * batch * seq / (time.perf_counter() - start)
        print(f"step {step:5d}  loss {float(metrics['loss']):.4f}  {rate:,.0f} tokens/s")
