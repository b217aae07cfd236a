"""Checkpoints that cannot be silently wrong: damaged files are detected and skipped, a resume must
keep the run's settings, bad directories fail before the first step, one writer per directory.

Real files, real orbax saves, real file systems (tmpfs mounts where this runs as root)."""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import shardkit as sk
from shardkit.cli.run import train
from shardkit.core.config import TrainConfig
from shardkit.models import GPTConfig
from shardkit.runtime.dirlock import LOCK_NAME
from shardkit.training.checkpoint import MANIFEST, CheckpointDamaged, Checkpointer
from shardkit.training.checksums import array_checksums

CFG = GPTConfig.preset("tiny")
DATA = sk.TextDataset.builtin()
RUN = {"data": {"seed": 0, "batch": 8}, "schedule": {"lr": 3e-3, "steps": 10}}


def make_trainer(layout="data=8", optimizer=None):
    return sk.Trainer(CFG.model(), optimizer or optax.adamw(3e-3), layout)


def steps(trainer, state, ckpt, count, run=RUN):
    for step in range(int(state.step), int(state.step) + count):
        state, _ = trainer.step(state, trainer.shard_batch(DATA.batch(step, 8, 32)))
        ckpt.save(trainer, state, data_position=step + 1, run=run, force=True)
    return state


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Checkpoints of steps 1 and 2 (fsdp=8), and the states they hold."""
    directory = tmp_path_factory.mktemp("two")
    trainer = make_trainer("fsdp=8")
    ckpt = Checkpointer(directory, keep=3)
    state = trainer.init(0)
    saved = {}
    for _ in range(2):
        state = steps(trainer, state, ckpt, 1)
        saved[int(state.step)] = jax.device_get(state)
    ckpt.close()
    return directory, saved


def copy_of(two_steps, tmp_path):
    directory, saved = two_steps
    shutil.copytree(directory, tmp_path / "c")
    return tmp_path / "c", saved


# -- checksums ---------------------------------------------------------------------------------
def test_array_checksums_do_not_depend_on_the_layout_and_see_one_bit():
    state = make_trainer("fsdp=8").init(0)
    other = make_trainer("data=2,tensor=4")
    moved = jax.device_put(jax.device_get(state), other.state_shardings)
    sums = array_checksums(state)
    assert sums == array_checksums(moved) == array_checksums(jax.device_get(state))
    host = jax.device_get(state.params)
    leaf = jax.tree.leaves(host)[0]
    flat = leaf.reshape(-1).view(np.uint32)
    for index in (0, flat.size // 2, flat.size - 1):
        flipped = flat.copy()
        flipped[index] ^= np.uint32(1 << (index % 32))
        changed = jax.tree.unflatten(
            jax.tree.structure(host),
            [flipped.view(np.float32).reshape(leaf.shape)] + [x for x in jax.tree.leaves(host)[1:]],
        )
        assert array_checksums(changed) != array_checksums(host)


def test_each_save_lists_its_files(two_steps):
    directory, _ = two_steps
    for step in (1, 2):
        listed = json.loads((directory / str(step) / MANIFEST).read_text())
        on_disk = {str(p.relative_to(directory / str(step))) for p in (directory / str(step)).rglob("*") if p.is_file()}
        assert set(listed) == on_disk - {MANIFEST}


@pytest.mark.parametrize("trial", range(12))
def test_a_flipped_byte_anywhere_is_detected_and_the_previous_step_restored(two_steps, tmp_path, trial):
    directory, saved = copy_of(two_steps, tmp_path)
    rng = np.random.default_rng(trial)
    files = sorted(p for p in (directory / "2" / "state").rglob("*") if p.is_file() and p.stat().st_size)
    target = files[rng.integers(len(files))]
    data = bytearray(target.read_bytes())
    offset = int(rng.integers(len(data)))
    data[offset] ^= 1 << int(rng.integers(8))
    target.write_bytes(bytes(data))
    trainer = make_trainer("data=2,tensor=4")
    ckpt = Checkpointer(directory)
    with pytest.warns(UserWarning, match=r"Restored checkpoint step 1 .* skipped step 2: file state/"):
        state, record = ckpt.restore(trainer)
    assert record["step"] == 1
    assert_trees_close(jax.device_get(state), saved[1], rtol=0, atol=0)
    with pytest.raises(CheckpointDamaged, match=r"step 2 .* is damaged: file .* has crc32"):
        ckpt.restore(trainer, step=2)


def test_values_changed_behind_the_file_list_are_caught_by_the_array_checksums(two_steps, tmp_path):
    """Without the file list (a save killed before writing it), a flipped value is still caught."""
    directory, _ = copy_of(two_steps, tmp_path)
    (directory / "2" / MANIFEST).unlink()
    record = json.loads((directory / "2" / "record" / "metadata").read_text())
    path = next(iter(record["checksums"]))
    record["checksums"][path] = "0" * 16
    (directory / "2" / "record" / "metadata").write_text(json.dumps(record))
    with pytest.warns(UserWarning, match=rf"skipped step 2: array {path} does not match its checksum"):
        _, record = Checkpointer(directory).restore(make_trainer())
    assert record["step"] == 1


def test_an_empty_step_directory_is_skipped_with_a_warning(two_steps, tmp_path):
    directory, _ = copy_of(two_steps, tmp_path)
    (directory / "8").mkdir()
    ckpt = Checkpointer(directory)
    with pytest.warns(UserWarning, match="skipped step 8"):
        _, record = ckpt.restore(make_trainer())
    assert record["step"] == 2 and ckpt.warnings and "step 8" in ckpt.warnings[0]


def test_when_nothing_verifies_the_error_lists_each_step(two_steps, tmp_path):
    directory, _ = copy_of(two_steps, tmp_path)
    for step in (1, 2):
        (directory / str(step) / "record" / "metadata").write_text("{ not json")
    with pytest.raises(sk.ShardkitError, match=r"No checkpoint .* verifies: step 2: .*; step 1: .*fresh"):
        Checkpointer(directory).restore(make_trainer())


# -- a resume keeps the run's settings ---------------------------------------------------------
def test_another_optimizer_is_not_called_damage_and_can_be_reset(two_steps):
    directory, saved = two_steps
    sgd = make_trainer("data=8", optax.sgd(0.1, momentum=0.9))
    with pytest.raises(sk.ShardkitError, match=r"another optimizer.*checkpoint itself is fine.*--reset-optimizer") as e:
        Checkpointer(directory).restore(sgd)
    assert "delete" not in str(e.value) and not isinstance(e.value, CheckpointDamaged)
    state, record = Checkpointer(directory).restore(sgd, reset_optimizer=True)
    assert record["step"] == 2 and int(state.step) == 2
    assert_trees_close(jax.device_get(state.params), saved[2].params, rtol=0, atol=0)
    fresh = sgd.init(0).opt_state
    assert_trees_close(jax.device_get(state.opt_state), jax.device_get(fresh), rtol=0, atol=0)
    state, _ = sgd.step(state, sgd.shard_batch(DATA.batch(2, 8, 32)))  # and it trains on
    assert int(state.step) == 3


def test_a_different_seed_or_batch_is_named(two_steps):
    directory, _ = two_steps
    changed = {"data": {"seed": 1, "batch": 8}, "schedule": RUN["schedule"]}
    with pytest.raises(sk.ShardkitError, match=r"--seed 0 \(now 1\)\. Fix: resume with the same settings \(--seed 0\)"):
        Checkpointer(directory).restore(make_trainer(), run=changed)


def test_a_schedule_change_needs_to_be_allowed(two_steps):
    directory, saved = two_steps
    changed = {"data": RUN["data"], "schedule": {"lr": 1e-3, "steps": 20}}
    with pytest.raises(
        sk.ShardkitError, match=r"--lr 0.003 \(now 0.001\), --steps 10 \(now 20\).*--allow-schedule-change"
    ):
        Checkpointer(directory).restore(make_trainer(), run=changed)
    state, _ = Checkpointer(directory).restore(make_trainer(), run=changed, allow_schedule_change=True)
    assert_trees_close(jax.device_get(state), saved[2], rtol=0, atol=0)


# -- the directory, before the first step -------------------------------------------------------
@contextlib.contextmanager
def mounted_tmpfs(path, size, read_only=False):
    path.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a file system needs root")


def test_a_read_only_directory_fails_before_any_step(tmp_path):
    trainer = make_trainer()
    if os.geteuid() == 0:  # root ignores permission bits: use a read-only mount
        context = mounted_tmpfs(tmp_path / "ro", "1m", read_only=True)
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o500)
        context = contextlib.nullcontext(tmp_path / "ro")
    with context as ro, pytest.raises(sk.ShardkitError, match=r"not writable \((PermissionError|OSError)"):
        Checkpointer(ro / "run").prepare(trainer)


@needs_root
def test_a_disk_too_small_for_one_checkpoint_fails_before_any_step(tmp_path):
    with (
        mounted_tmpfs(tmp_path / "tiny", "256k") as tiny,
        pytest.raises(sk.ShardkitError, match=r"MiB free; a checkpoint of this state needs about"),
    ):
        Checkpointer(tiny / "run").prepare(make_trainer())


@needs_root
def test_a_disk_that_fills_up_gives_one_clear_error_and_keeps_the_earlier_checkpoints(tmp_path):
    trainer = make_trainer()
    state = trainer.init(0)
    one = sum(x.nbytes for x in jax.tree.leaves(jax.device_get(state)))
    with mounted_tmpfs(tmp_path / "small", f"{int(one * 1.6) // 1024}k") as small:
        ckpt = Checkpointer(small / "run", keep=3)
        state = steps(trainer, state, ckpt, 1)
        ckpt.wait()
        with pytest.raises(
            sk.ShardkitError, match=r"Saving checkpoint step 2 .* failed \(OSError: .*No space left"
        ) as e:
            steps(trainer, state, ckpt, 1)
            ckpt.wait()
        assert "earlier checkpoints are intact (steps [1])" in str(e.value)
        assert not list((small / "run").glob("*tmp*"))
        ckpt.close()
        _, record = Checkpointer(small / "run").restore(trainer)
        assert record["step"] == 1


def test_leftover_temporary_saves_are_removed_by_the_next_run(tmp_path):
    leftover = tmp_path / "run" / "7.orbax-checkpoint-tmp-1234"
    leftover.mkdir(parents=True)
    (leftover / "junk").write_bytes(b"x" * 1000)
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.prepare(make_trainer())
    assert not leftover.exists()
    ckpt.close()


HOLDER = textwrap.dedent(
    """
    import sys, time
    from shardkit.runtime.dirlock import DirectoryLock
    import pathlib
    DirectoryLock(pathlib.Path(sys.argv[1])).acquire()
    print("locked", flush=True)
    time.sleep(60)
    """
)


def test_two_writers_in_one_directory(tmp_path):
    (tmp_path / "run").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        pattern = rf"in use by PID {holder.pid} on host {socket.gethostname()}"
        with pytest.raises(sk.ShardkitError, match=pattern):
            Checkpointer(tmp_path / "run").prepare(make_trainer())
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone: its lock is stale and taken over with a warning.
    with pytest.warns(UserWarning, match=f"stale lock .* process {holder.pid}"):
        ckpt = Checkpointer(tmp_path / "run")
        ckpt.prepare(make_trainer())
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    ckpt.close()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


# -- the main job: the log on resume, the halt checkpoint ---------------------------------------
def small_run(tmp_path, **kw):
    base = dict(
        model="tiny", layout="data=8", steps=5, batch=8, seq=32, sample_tokens=0, checkpoint_dir=str(tmp_path / "ck")
    )
    return TrainConfig(**(base | kw))


def test_the_json_log_holds_each_step_once_after_a_resume(tmp_path):
    log = tmp_path / "log.jsonl"
    train(small_run(tmp_path, checkpoint_every=2, json_log=str(log)), progress=False, out=io.StringIO())
    shutil.rmtree(tmp_path / "ck" / "5")  # as if killed after step 5 was logged, before it was saved
    result = train(small_run(tmp_path, checkpoint_every=2, json_log=str(log)), progress=False, out=io.StringIO())
    assert len(result["losses"]) == 1  # resumed at 4, ran step 5
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_a_resume_with_another_seed_is_refused_before_training(tmp_path):
    train(small_run(tmp_path, steps=2), progress=False, out=io.StringIO())
    with pytest.raises(sk.ShardkitError, match=r"--seed 0 \(now 3\)"):
        train(small_run(tmp_path, steps=2, seed=3), progress=False, out=io.StringIO())


def test_a_diverging_run_escalates_and_leaves_its_last_good_state_on_disk(tmp_path):
    cfg = small_run(tmp_path, steps=12, lr=1e30, warmup=0, max_skips=3, checkpoint_every=1)
    with pytest.raises(
        sk.ShardkitError, match=r"3 steps in a row were not finite.*last good state \(step (\d+)\) is saved"
    ):
        train(cfg, progress=False, out=io.StringIO())
    ckpt = Checkpointer(tmp_path / "ck")
    last = ckpt.latest_step()
    state, record = ckpt.restore(make_trainer(optimizer=optax.adamw(1.0)), reset_optimizer=True)
    assert int(state.step) == last >= 1
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))
    assert record["data_position"] == last  # a resume retries the first batch that was skipped


SMALL_RUN_FLAGS = [
    "--model",
    "tiny",
    "--layout",
    "data=8",
    "--steps",
    "6",
    "--batch",
    "8",
    "--seq",
    "32",
    "--checkpoint-every",
    "1",
    "--sample-tokens",
    "0",
]


@needs_root
@pytest.mark.slow
def test_the_cli_on_a_full_disk_prints_one_error_and_no_traceback(tmp_path):
    with mounted_tmpfs(tmp_path / "full", "3m") as full:
        result = subprocess.run(
            [sys.executable, "-m", "shardkit.cli", "train", *SMALL_RUN_FLAGS, "--checkpoint-dir", str(full / "run")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stderr and "ERROR" not in result.stderr, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert (
            len(errors) == 1
            and "No space left on device" in errors[0]
            and "earlier checkpoints are intact" in errors[0]
        )
        assert not list((full / "run").glob("*tmp*"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_sigterm_or_ctrl_c_saves_and_the_same_command_resumes(tmp_path, signum):
    log = tmp_path / "log.jsonl"
    command = [sys.executable, "-m", "shardkit.cli", "train", "--model", "tiny", "--layout", "data=8"]
    steps = 80  # the signal comes after step 3: 77 steps left is seconds of running, even on a loaded machine
    command += ["--steps", str(steps), "--batch", "8", "--seq", "32", "--sample-tokens", "0"]
    command += ["--checkpoint-every", "1000", "--checkpoint-dir", str(tmp_path / "ck"), "--json-log", str(log)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr[-2000:]
    name = signal.Signals(signum).name
    match = re.search(rf"stopped by {name} after step (\d+): checkpoint step (\d+) saved .* same command", stderr)
    assert match and match.group(1) == match.group(2) and "Traceback" not in stderr, stderr[-2000:]
    saved = int(match.group(2))
    assert Checkpointer(tmp_path / "ck").steps() == [saved] and 3 <= saved < steps
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {tmp_path / 'ck'} at step {saved}" in again.stdout
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, steps + 1))


@pytest.mark.parametrize("factory", ["gemma_lm", "linen_lm"])
def test_models_written_without_shardkit_get_the_same_checks(tmp_path, factory):
    """A Flax NNX and a Linen LM written with Flax's own metadata: vocabulary found, bad ids refused,
    checkpoints verified across layouts and a damaged step skipped."""
    import byo_factories

    model = getattr(byo_factories, factory)()
    trainer = sk.Trainer(model, optax.adamw(1e-3), "fsdp=8")
    assert trainer.vocab == 256
    tokens = np.zeros((8, 17), np.int32)
    tokens[3, 4] = 300
    with pytest.raises(sk.ShardkitError, match=r"token ids from 0 to 300"):
        trainer.shard_batch({"tokens": tokens})
    ckpt = Checkpointer(tmp_path, keep=3)
    state = trainer.init(0)
    saved = {}
    for step in range(2):
        state, _ = trainer.step(state, trainer.shard_batch(DATA.batch(step, 8, 16)))
        ckpt.save(trainer, state, data_position=step + 1, force=True)
        saved[step + 1] = jax.device_get(state)
    ckpt.close()
    data_files = sorted(p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file() and p.stat().st_size > 1000)
    blob = bytearray(data_files[-1].read_bytes())
    blob[len(blob) // 2] ^= 0x10
    data_files[-1].write_bytes(bytes(blob))
    other = sk.Trainer(getattr(byo_factories, factory)(), optax.adamw(1e-3), "data=4,tensor=2")
    with pytest.warns(UserWarning, match="skipped step 2"):
        restored, record = Checkpointer(tmp_path).restore(other)
    assert record["step"] == 1
    assert_trees_close(jax.device_get(restored), saved[1], rtol=0, atol=0)


def test_a_run_that_ends_in_an_error_leaves_no_lock(tmp_path):
    code = textwrap.dedent(
        f"""
        import pathlib
        from shardkit.runtime.dirlock import DirectoryLock
        DirectoryLock(pathlib.Path({str(tmp_path)!r})).acquire()
        raise RuntimeError("the run failed")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "the run failed" in result.stderr and not (tmp_path / LOCK_NAME).exists()


def test_the_abandoned_writes_of_a_failed_save_are_not_logged(caplog):
    # A full disk fails a save's writes in tensorstore's futures; once the save has raised its one
    # error, asyncio would log each garbage-collected future ("never retrieved") at exit, at a
    # time that depends on the collector. Only those are dropped.
    import logging

    import shardkit.training.checkpoint  # noqa: F401 - installs the filter

    asyncio_log = logging.getLogger("asyncio")
    ours = "future: <Future finished exception=ValueError('Error writing \"/r/3.orbax-checkpoint-tmp/state/d/x\"')>"
    other = "future: <Future finished exception=ValueError('something else')>"
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio_log.error("Future exception was never retrieved\n%s", ours)
        asyncio_log.error("Task exception was never retrieved\n%s", ours.replace("Future", "Task"))
        asyncio_log.error("Future exception was never retrieved\n%s", other)
    assert [r.getMessage().splitlines()[1] for r in caplog.records] == [other]


@pytest.mark.slow
def test_the_command_says_once_which_damaged_checkpoint_it_skipped(tmp_path):
    """A resume past a checkpoint that fails to verify is said once, as ``warning: ...``, not also
    as a Python warning with its source line."""
    from helpers import TEST_XLA_FLAGS

    base = [sys.executable, "-m", "shardkit.cli", "train", "--model", "tiny", "--layout", "data=8", "--batch", "8"]
    base += ["--seq", "16", "--sample-tokens", "0", "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path)]
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    subprocess.run([*base, "--steps", "2"], check=True, capture_output=True, env=env, timeout=600)
    data_files = sorted(p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file() and p.stat().st_size > 1000)
    blob = bytearray(data_files[-1].read_bytes())
    blob[len(blob) // 2] ^= 0x10
    data_files[-1].write_bytes(bytes(blob))
    again = [*base, "--steps", "3", "--allow-schedule-change"]
    resumed = subprocess.run(again, capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    said = resumed.stdout + resumed.stderr
    assert said.count("newest that verifies") == 1
    assert "warning: Restored checkpoint step 1" in resumed.stdout and "UserWarning" not in said
