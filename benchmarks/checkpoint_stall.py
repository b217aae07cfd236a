"""Does saving a checkpoint stall training? Time of `Checkpointer.save` (what the step loop waits
for) against the time until the checkpoint is on disk, and steps run while it is written.

    python benchmarks/checkpoint_stall.py                 # GPT gpt2-small shape, fsdp=8, 8 simulated devices
"""

import argparse
import tempfile
import threading
import time

import shardkit as sk

sk.simulate_devices(8)

import optax
from _results import write_json

from shardkit.training.checkpoint import Checkpointer


class RssPeak:
    """The process's resident memory, sampled every 5 ms: its peak since :meth:`reset`."""

    def __init__(self):
        self.peak, self.stop = 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.005)

    def reset(self) -> int:
        self.peak = self.now()
        return self.peak


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--json", default="benchmarks/results/checkpoint_stall.json")
    args = parser.parse_args()
    cfg = sk.models.GPTConfig.preset(args.model, n_layers=4)
    trainer = sk.Trainer(cfg.model(), optax.adamw(1e-4), "fsdp=8")
    state = trainer.init(0)
    data = sk.TextDataset.builtin()
    batch = trainer.shard_batch(data.batch(0, 8, 64))
    state, m = trainer.step(state, batch)
    float(m["loss"])
    t = time.perf_counter()
    state, m = trainer.step(state, batch)
    float(m["loss"])
    step_s = time.perf_counter() - t

    ckpt = Checkpointer(tempfile.mkdtemp(), keep=1)
    t = time.perf_counter()
    ckpt.save(trainer, state, data_position=2, force=True)
    save_returned = time.perf_counter() - t
    steps_during_write = 0
    while ckpt._manager.is_saving_in_progress():
        state, m = trainer.step(state, batch)
        float(m["loss"])
        steps_during_write += 1
    on_disk = time.perf_counter() - t
    ckpt.close()
    # Host memory a save adds: its peak (no step running meanwhile) over the memory before it.
    rss = RssPeak()
    ckpt = Checkpointer(tempfile.mkdtemp(), keep=1)
    before = rss.reset()
    ckpt.save(trainer, state, data_position=3, force=True)
    ckpt.close()
    save_peak = rss.peak - before
    state_mb = sum(x.size * x.dtype.itemsize for x in __import__("jax").tree.leaves(state)) / 1e6
    result = {
        "model": args.model,
        "layers": 4,
        "state_mb": state_mb,
        "step_seconds": step_s,
        "save_call_seconds": save_returned,
        "until_on_disk_seconds": on_disk,
        "steps_run_while_writing": steps_during_write,
        "rss_before_save_mb": before / 1e6,
        "save_added_rss_mb": save_peak / 1e6,
        "save_added_rss_over_state": save_peak / (state_mb * 1e6),
    }
    print(
        f"state {state_mb:.0f} MB: save() returned after {save_returned:.3f} s, on disk after {on_disk:.3f} s; "
        f"{steps_during_write} training steps ({step_s:.3f} s each) ran while it was written; "
        f"a save alone added {save_peak / 1e6:.0f} MB of host memory ({save_peak / (state_mb * 1e6):.2f}x the state) "
        f"to the {before / 1e6:.0f} MB resident before it"
    )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
