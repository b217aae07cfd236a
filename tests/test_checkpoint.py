"""Orbax checkpoints: restore onto any layout and device count, survive SIGKILL, refuse bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from helpers import (
    TEST_XLA_FLAGS,
    assert_adam_params_close,
    assert_trees_close,
    json_log_losses,
    run_cli,
    start_cli,
    wait_for_log_lines,
)

import shardkit as sk
from shardkit.models import GPTConfig
from shardkit.training.checkpoint import Checkpointer

CFG = GPTConfig.preset("tiny", dropout=0.1)  # dropout on: restarts must replay the same bits
DATA = sk.TextDataset.builtin()


def batch(step):
    return DATA.batch(step, batch_size=8, seq_len=32)


def make_trainer(layout, devices=None, cfg=CFG):
    return sk.Trainer(cfg.model(), optax.adamw(3e-3), layout, devices=devices)


def train(trainer, state, steps, ckpt=None):
    losses = []
    for step in steps:
        state, metrics = trainer.step(state, trainer.shard_batch(batch(step)))
        losses.append(float(metrics["loss"]))
        if ckpt is not None:
            ckpt.save(trainer, state, data_position=step + 1)
    return state, losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """fsdp=8 for 10 steps, checkpointing every 5."""
    directory = tmp_path_factory.mktemp("ckpt")
    trainer = make_trainer("fsdp=8")
    ckpt = Checkpointer(directory, every=5, keep=3)
    state, losses = train(trainer, trainer.init(0), range(10), ckpt)
    ckpt.close()
    return directory, losses, jax.device_get(state.params)


def test_restore_onto_another_layout_continues_exactly(uninterrupted):
    directory, losses, final = uninterrupted
    ckpt = Checkpointer(directory)
    assert ckpt.steps() == [5, 10]
    trainer = make_trainer("data=2,tensor=4")
    state, record = ckpt.restore(trainer, step=5)
    assert record["data_position"] == 5 and record["layout"] == "fsdp=8"
    assert int(state.step) == 5
    assert state.params["lm_head"].sharding.spec == trainer.param_specs["lm_head"]
    state, resumed = train(trainer, state, range(5, 10))
    np.testing.assert_allclose(resumed, losses[5:], rtol=2e-5)
    assert_adam_params_close(jax.device_get(state.params), final, lr=3e-3, steps=5)


def test_restore_on_another_device_count(uninterrupted):
    directory, losses, _ = uninterrupted
    code = f"""
import json, optax, shardkit as sk
sk.simulate_devices(4)
from shardkit.training.checkpoint import Checkpointer
cfg = sk.models.GPTConfig.preset("tiny", dropout=0.1)
trainer = sk.Trainer(cfg.model(), optax.adamw(3e-3), "fsdp=2,tensor=2")
state, record = Checkpointer({str(directory)!r}).restore(trainer, step=5)
data = sk.TextDataset.builtin()
losses = []
for step in range(record["data_position"], 10):
    state, m = trainer.step(state, trainer.shard_batch(data.batch(step, batch_size=8, seq_len=32)))
    losses.append(float(m["loss"]))
print(json.dumps(losses))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS},
    )
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(json.loads(proc.stdout.strip().splitlines()[-1]), losses[5:], rtol=2e-5)


def test_keeps_the_last_k(tmp_path):
    trainer = make_trainer("data=8")
    ckpt = Checkpointer(tmp_path, every=2, keep=2)
    train(trainer, trainer.init(0), range(6), ckpt)
    ckpt.close()
    assert Checkpointer(tmp_path).steps() == [4, 6]


def test_training_goes_on_while_a_save_is_written(tmp_path):
    """The save copies the arrays off the devices first: donating the state to the next step
    while the write is in flight cannot change what lands on disk."""
    trainer = make_trainer("fsdp=8")
    state, _ = train(trainer, trainer.init(0), range(3))
    expected = jax.device_get(state.params)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.save(trainer, state, data_position=3, force=True)
    state, _ = train(trainer, state, range(3, 6))  # donates the buffers that were saved
    ckpt.close()
    restored, _ = Checkpointer(tmp_path).restore(trainer)
    assert int(restored.step) == 3
    assert_trees_close(jax.device_get(restored.params), expected, rtol=0, atol=0)


KILL_SCRIPT = """
import sys, time, optax, shardkit as sk
sk.simulate_devices(8)
from shardkit.training.checkpoint import Checkpointer
cfg = sk.models.GPTConfig.preset("tiny", dim=512, mlp_dim=2048, n_layers=4, n_heads=8, n_kv_heads=8)
trainer = sk.Trainer(cfg.model(), optax.adamw(3e-3), "fsdp=8")
data = sk.TextDataset.builtin()
ckpt = Checkpointer(sys.argv[1], every=2, keep=5)
state = trainer.init(0)
for step in range(4):
    state, _ = trainer.step(state, trainer.shard_batch(data.batch(step, batch_size=8, seq_len=32)))
    if step + 1 == 2:
        ckpt.save(trainer, state, data_position=2)
        ckpt.wait()
        print("SAVED 2", flush=True)
ckpt.save(trainer, state, data_position=4)
print("SAVING 4", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS},
    )
    for line in proc.stdout:
        if line.startswith("SAVING 4"):
            break
    time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    leftovers = sorted(p.name for p in directory.iterdir())
    assert any(name.startswith("4") and name != "4" for name in leftovers), leftovers  # killed mid-save
    ckpt = Checkpointer(directory)
    assert ckpt.steps() == [2]
    cfg = GPTConfig.preset("tiny", dim=512, mlp_dim=2048, n_layers=4, n_heads=8, n_kv_heads=8)
    trainer = make_trainer("data=2,fsdp=4", cfg=cfg)
    state, record = ckpt.restore(trainer)
    assert record["data_position"] == 2 and int(state.step) == 2
    # Continuing from step 2 gives the losses of a run that was never interrupted.
    fresh = make_trainer("fsdp=8", cfg=cfg)
    _, reference = train(fresh, fresh.init(0), range(4))
    _, resumed = train(trainer, state, range(2, 4))
    np.testing.assert_allclose(resumed, reference[2:], rtol=2e-5)


@pytest.mark.slow
def test_cli_killed_then_resumed_under_another_layout(tmp_path):
    """A preempted `shardkit train --checkpoint-dir` run, re-run with another layout, ends where
    the uninterrupted run ends."""
    base = ["train", "--model", "tiny", "--batch", "8", "--seq", "32", "--steps", "20", "--sample-tokens", "0"]
    base += ["--checkpoint-every", "5"]
    ckpt, log = tmp_path / "run", tmp_path / "a.jsonl"
    first = start_cli(*base, "--layout", "fsdp=8", "--checkpoint-dir", str(ckpt), "--json-log", str(log))
    wait_for_log_lines(log, 12)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    killed_at = len(log.read_text().splitlines())
    assert 12 <= killed_at < 20
    second = run_cli(*base, "--layout", "data=2,tensor=4", "--checkpoint-dir", str(ckpt), "--json-log", str(log))
    assert second.returncode == 0, second.stderr
    # The newest complete checkpoint: a save still being written at the kill does not count.
    resumed_from = int(re.search(r"at step (\d+) \(saved under layout fsdp=8\)", second.stdout).group(1))
    assert resumed_from % 5 == 0 and 5 <= resumed_from <= killed_at
    straight = run_cli(*base, "--layout", "fsdp=8", "--json-log", str(tmp_path / "b.jsonl"))
    assert straight.returncode == 0, straight.stderr
    last = json_log_losses(log)  # steps after the checkpoint appear twice: the rerun's kept
    reference = json_log_losses(tmp_path / "b.jsonl")
    assert sorted(last) == list(range(1, 21))
    np.testing.assert_allclose([last[s] for s in range(1, 21)], [reference[s] for s in range(1, 21)], rtol=1e-4)
    assert Checkpointer(ckpt).steps()[-1] == 20


# -- bad input --------------------------------------------------------------------------------


def test_restore_from_a_missing_directory(tmp_path):
    with pytest.raises(sk.ShardkitError, match="does not exist; check the path"):
        Checkpointer(tmp_path / "nope").record(5)


def test_restore_with_no_checkpoint(tmp_path):
    with pytest.raises(sk.ShardkitError, match="No complete checkpoint in"):
        Checkpointer(tmp_path).restore(make_trainer("data=8"))


def test_restore_an_unknown_step(uninterrupted):
    with pytest.raises(sk.ShardkitError, match=r"step 7 .*available steps: \[5, 10\]"):
        Checkpointer(uninterrupted[0]).restore(make_trainer("data=8"), step=7)


def test_restore_a_checkpoint_of_another_model(uninterrupted):
    other = make_trainer("data=8", cfg=GPTConfig.preset("tiny", dim=128))
    with pytest.raises(
        sk.ShardkitError,
        match=r"written by another model.*blocks/attn/wo: checkpoint \[2, 8, 8, 64\] float32, now \[2, 8, 16, 128\]",
    ):
        Checkpointer(uninterrupted[0]).restore(other, step=5)


def test_restore_with_another_precision(uninterrupted):
    trainer = sk.Trainer(CFG.model(), optax.adamw(3e-3), "data=8", precision="bf16-master")
    with pytest.raises(sk.ShardkitError, match="float32, now .* bfloat16"):
        Checkpointer(uninterrupted[0]).restore(trainer, step=5)


def test_restore_a_corrupted_checkpoint(tmp_path):
    trainer = make_trainer("data=8")
    ckpt = Checkpointer(tmp_path)
    ckpt.save(trainer, trainer.init(0), data_position=0, force=True)
    ckpt.close()
    data_files = [p for p in (tmp_path / "0" / "state").rglob("*") if p.is_file() and p.stat().st_size > 1000]
    for p in data_files:
        p.write_bytes(b"\\x00garbage" * 10)
    with pytest.raises(sk.ShardkitError, match=r"No checkpoint in .* verifies: step 0: (file|array)"):
        Checkpointer(tmp_path).restore(trainer)


def test_bad_checkpointer_settings(tmp_path):
    with pytest.raises(sk.ShardkitError, match="interval >= 0"):
        Checkpointer(tmp_path, every=-1)
    with pytest.raises(sk.ShardkitError, match="keep at least 1"):
        Checkpointer(tmp_path, keep=0)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(sk.ShardkitError, match="is a file"):
        Checkpointer(f)
