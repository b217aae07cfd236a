"""Evaluation on held-out text: a compiled loss without optimizer state or dropout, equal to one
device's, and `--eval-every` logging it during training."""

import json
import math

import jax
import numpy as np
import optax

import shardkit as sk
from shardkit.cli import commands as cli
from shardkit.models import GPTConfig

TINY = GPTConfig.preset("tiny", dropout=0.1)
BATCH = {"tokens": np.random.default_rng(1).integers(0, 256, (16, 33)).astype(np.int32)}


def test_the_held_out_loss_is_one_devices_and_the_steps_own_without_dropout():
    trainer = sk.Trainer(TINY.model(), optax.adamw(1e-3), "data=2,fsdp=2,tensor=2")
    one = sk.Trainer(TINY.model(), optax.adamw(1e-3), "data=1", devices=jax.devices()[:1])
    state, batch = trainer.init(0), trainer.shard_batch(BATCH)
    held = trainer.evaluate(state.params, batch)
    single = one.evaluate(one.init(0).params, one.shard_batch(BATCH))
    np.testing.assert_allclose(float(held["loss"]), float(single["loss"]), rtol=1e-5)
    assert int(held["tokens"]) == 16 * 32
    # No dropout: the same loss twice, and the plain step's loss when dropout is off.
    assert float(trainer.evaluate(state.params, batch)["loss"]) == float(held["loss"])
    plain = sk.Trainer(GPTConfig.preset("tiny").model(), optax.adamw(1e-3), "data=8")
    s = plain.init(0)
    before = float(plain.evaluate(s.params, plain.shard_batch(BATCH))["loss"])
    _, metrics = plain.step(s, plain.shard_batch(BATCH))
    assert math.isclose(before, float(metrics["loss"]), rel_tol=1e-6)


def test_the_compiled_evaluation_holds_no_optimizer_state():
    # fsdp_min_size=0: every parameter split eight ways, norm scales too, so the bytes are exact.
    trainer = sk.Trainer(GPTConfig.preset("tiny").model(), optax.adamw(1e-3), "fsdp=8", fsdp_min_size=0)
    trainer.evaluate(trainer.init(0).params, trainer.shard_batch(BATCH))
    evaluate = next(c for k, c in trainer._compiled.items() if k[0] == "evaluate")
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_params)) / 8
    batch = BATCH["tokens"].nbytes / 8
    assert evaluate.memory_analysis().argument_size_in_bytes == params + batch  # no moments, no master


def test_the_held_out_split_is_never_trained_on():
    data = sk.TextDataset.from_bytes(bytes(range(256)) * 40)
    train, held = data.split(0.05)
    assert len(train.tokens) + len(held.tokens) == len(data.tokens)
    assert np.array_equal(np.concatenate([train.tokens, held.tokens]), data.tokens)
    windows = train.batch(0, 64, 16)["tokens"]
    assert windows.shape == (64, 17) and len(held.tokens) == round(len(data.tokens) * 0.05)


def test_training_logs_the_held_out_loss_every_n_steps(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    argv = ["train", "--model", "tiny", "--steps", "5", "--batch", "8", "--seq", "32", "--sample-tokens", "0"]
    assert cli.main([*argv, "--eval-every", "2", "--eval-batches", "2", "--json-log", str(log)]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    evaluated = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(evaluated) == [2, 4, 5]  # every 2 steps, and at the end
    for r in evaluated.values():
        assert math.isclose(r["eval_perplexity"], math.exp(r["eval_loss"]), rel_tol=1e-9) and r["eval_loss"] > 0
    assert "eval at step 4: held-out loss" in capsys.readouterr().out


def test_shardkit_eval_of_a_saved_run_equals_the_runs_own_last_evaluation(tmp_path, capsys):
    """The held-out loss `shardkit eval --checkpoint` computes from the saved parameters is the one
    the run logged at its last step, under the run's layout and under another."""
    log, ck = tmp_path / "log.jsonl", str(tmp_path / "ck")
    small = ["--model", "tiny", "--batch", "8", "--seq", "32", "--eval-batches", "2"]
    argv = ["train", *small, "--steps", "3", "--sample-tokens", "0", "--eval-every", "3", "--json-log", str(log)]
    assert cli.main([*argv, "--checkpoint-dir", ck]) == 0
    logged = [json.loads(line) for line in log.read_text().splitlines()][-1]
    capsys.readouterr()
    for layout in ("data=2,fsdp=2,tensor=2", "fsdp=8"):
        assert cli.main(["eval", *small, "--checkpoint", ck, "--layout", layout, "--json"]) == 0
        result = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert result["step"] == 3
        np.testing.assert_allclose(result["eval_loss"], logged["eval_loss"], rtol=2e-5)
    assert cli.main(["eval", *small, "--checkpoint", str(tmp_path / "none")]) == 2  # no checkpoint: an error


def test_tensorboard_gets_the_runs_scalars(tmp_path):
    from shardkit.cli.run import OPTIMIZERS, _schedule  # noqa: F401  (the schedule the run follows)
    from shardkit.core.config import TrainConfig
    from shardkit.io.tensorboard import read_scalars

    board = tmp_path / "tb"
    argv = ["train", "--model", "tiny", "--steps", "4", "--batch", "8", "--seq", "32", "--sample-tokens", "0"]
    assert cli.main([*argv, "--eval-every", "2", "--eval-batches", "1", "--tensorboard", str(board)]) == 0
    scalars = read_scalars(board)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4]
    cfg = TrainConfig(model="tiny", steps=4, batch=8, seq=32)
    lrs = [v for _, v in scalars["train/learning_rate"]]
    np.testing.assert_allclose(lrs, [float(_schedule(cfg)(i)) for i in range(4)], rtol=1e-6)
    assert all(v > 0 for _, v in scalars["train/grad_norm"] + scalars["train/tokens_per_s"])
    assert len(scalars["memory/per_device_mib"]) == 1 and "train/mfu" not in scalars  # a CPU has no peak


def test_evaluation_of_a_model_written_without_shardkit():
    import byo_factories

    trainer = sk.Trainer(byo_factories.linen_lm(), optax.adamw(1e-3), "fsdp=4,tensor=2")
    one = sk.Trainer(byo_factories.linen_lm(), optax.adamw(1e-3), "data=1", devices=jax.devices()[:1])
    here = trainer.evaluate(trainer.init(0).params, trainer.shard_batch(BATCH))
    there = one.evaluate(one.init(0).params, one.shard_batch(BATCH))
    np.testing.assert_allclose(float(here["loss"]), float(there["loss"]), rtol=1e-5)
    assert int(here["tokens"]) == int(there["tokens"]) == 16 * 32
