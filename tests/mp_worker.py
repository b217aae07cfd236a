"""A worker the multi-process tests start with `shardkit launch` (or alone, as one process).

    python tests/mp_worker.py MODE LAYOUT [CHECKPOINT_DIR]

MODE: train10 (10 steps, then 16 greedy tokens sampled), save5 (5 steps then a checkpoint),
resume5 (restore step 5, 5 more), report (collectives JSON), twice (initialize twice), hang
(write the pid, then train forever).
Rank 0 prints one JSON line starting with RESULT.
"""

import json
import os
import sys
import time

import shardkit as sk
from shardkit.runtime import distributed

mode, layout = sys.argv[1], sys.argv[2]
spec = distributed.initialize()
if mode == "twice":
    assert distributed.initialize() == spec  # a second call is harmless
if spec is None:
    sk.simulate_devices(8)

import jax
import optax

from shardkit.models.generate import generate
from shardkit.training.checkpoint import Checkpointer

cfg = sk.models.GPTConfig.preset("tiny", dropout=0.1)
trainer = sk.Trainer(cfg.model(), optax.adamw(3e-3), layout)
data = sk.TextDataset.builtin()
rows = trainer.local_rows(8)


def run(state, steps):
    losses = []
    for step in steps:
        local = data.batch(step, batch_size=8, seq_len=32, rows=rows)
        state, metrics = trainer.step(state, trainer.shard_batch(local))
        losses.append(float(metrics["loss"]))
    return state, losses


result = {"processes": jax.process_count(), "rank": jax.process_index(), "rows": [rows.start, rows.stop]}
if mode in ("train10", "twice"):
    state, result["losses"] = run(trainer.init(0), range(10))
    prompt = data.tokens[:4]
    result["sample"] = prompt.tolist() + generate(trainer.model, state.params, [prompt], 16)[0]
elif mode == "save5":
    state, result["losses"] = run(trainer.init(0), range(5))
    ckpt = Checkpointer(sys.argv[3])
    ckpt.save(trainer, state, data_position=5, force=True)
    ckpt.close()
elif mode == "resume5":
    state, record = Checkpointer(sys.argv[3]).restore(trainer, step=5)
    _, result["losses"] = run(state, range(record["data_position"], 10))
elif mode == "report":
    report = trainer.report({"tokens": jax.ShapeDtypeStruct((8, 33), jax.numpy.int32)})
    result["collectives"] = [[c.kind, list(c.axes), c.crosses_hosts] for c in report.collectives]
elif mode == "hang":
    with open(os.path.join(sys.argv[3], f"pid{jax.process_index()}"), "w") as f:
        f.write(str(os.getpid()))
    state = trainer.init(0)
    while True:
        state, _ = run(state, range(1))
        time.sleep(0.05)
if jax.process_index() == 0:
    print("RESULT " + json.dumps(result), flush=True)
else:
    print(f"rank {jax.process_index()} rows {rows.start}:{rows.stop}", flush=True)
    if "sample" in result:
        print(f"rank {jax.process_index()} sample {result['sample']}", flush=True)
