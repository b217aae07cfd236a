"""The catalogue of bad inputs: each one, through the command line or the Python API, gives one
ShardkitError whose message names the problem, before anything is compiled or written. No raw
traceback, no silent result, no crash.

Each case is ``(id, call, match)``: ``call`` must raise ``ShardkitError`` matching ``match``
(a CLI case must return exit code 2 with ``shardkit: error: ...`` or argparse's usage error),
while JAX's compile events for the step, the init and the checksums are watched and the test's
directory must stay as it was. docs/errors.md lists the error family and every raise site.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src import monitoring as jax_monitoring

import shardkit as sk
from shardkit.cli import commands as cli
from shardkit.core.config import TrainConfig
from shardkit.models import GPTConfig
from shardkit.runtime import distributed
from shardkit.runtime.launch import launch
from shardkit.training.checkpoint import Checkpointer

TINY = GPTConfig.preset("tiny")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[pathlib.Path], object]
    match: str
    setup: Callable[[], object] | None = None  # built before compiles are watched


@functools.cache
def trainer(layout="data=8", **kwargs):
    return sk.Trainer(TINY.model(), optax.adamw(1e-3), layout, **kwargs)


@functools.cache
def tiny_state():
    """A state of ``trainer()``, built before a case watches compiles (never stepped: not donated)."""
    return trainer().init(0)


@functools.cache
def nnx_gpt():
    """The tiny GPT wrapped as the README wraps it, and its state."""
    t = sk.Trainer(sk.from_nnx(lambda rngs: sk.models.GPT(TINY, rngs=rngs)), optax.adamw(1e-3), "data=8")
    return t, t.init(0)


@functools.cache
def regression():
    """The residual MLP under mse_loss, and its state."""
    model = sk.from_nnx(lambda rngs: sk.models.MLP(sk.models.MLPConfig(), rngs=rngs))
    t = sk.Trainer(model, optax.sgd(0.1), "data=8", loss=sk.mse_loss)
    return t, t.init(0)


def regression_batch(x_cols=32, y_cols=32):
    return {"x": np.ones((8, x_cols), np.float32), "y": np.ones((8, y_cols), np.float32)}


def batch(rows=8, cols=17, dtype=np.int32, value=1):
    return {"tokens": np.full((rows, cols), value, dtype)}


@functools.cache
def saved_checkpoint() -> pathlib.Path:
    """A real checkpoint of the tiny GPT under adamw (step 1), with a run fingerprint."""
    import tempfile

    directory = pathlib.Path(tempfile.mkdtemp()) / "ck"
    t = trainer()
    state, _ = t.step(t.init(0), t.shard_batch(batch()))
    ckpt = Checkpointer(directory)
    ckpt.save(t, state, data_position=1, run={"data": {"seed": 0}, "schedule": {"lr": 1e-3}}, force=True)
    ckpt.close()
    return directory


@functools.cache
def donated():
    t = trainer()
    state = t.init(0)
    b = t.shard_batch(batch())
    t.step(state, b)
    return t, state, b


def cli_error(*argv: str) -> Callable[[pathlib.Path], object]:
    """Run the CLI in this process; turn its exit code 2 and message into a ShardkitError."""

    def run(tmp: pathlib.Path) -> None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main([a.replace("{tmp}", str(tmp)) for a in argv])
            except SystemExit as e:  # argparse: usage error, exit 2
                code = e.code
        if code == 2:
            raise sk.ShardkitError(err.getvalue())
        raise AssertionError(f"exit code {code}, stderr: {err.getvalue()[-500:]}")

    return run


TRAIN = ("train", "--model", "tiny", "--steps", "2", "--batch", "8", "--seq", "16", "--sample-tokens", "0")


REFERENCE = pathlib.Path(__file__).parent / "fixtures" / "hf_reference"


def hf_copy(family: str, change: str) -> pathlib.Path:
    """A copy of a reference checkpoint whose config.json has ``change`` (JSON), made once and
    outside the case's own directory (which must stay empty)."""
    return _hf_copy(family, change)


@functools.cache
def _hf_copy(family: str, change: str) -> pathlib.Path:
    import json
    import shutil
    import tempfile

    out = pathlib.Path(tempfile.mkdtemp()) / f"{family}-changed"
    shutil.copytree(REFERENCE / family, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **json.loads(change)}))
    return out


@functools.cache
def broken_checkpoint(what: str) -> pathlib.Path:
    """A copy of the llama3 reference checkpoint with ``config.json`` cut short (``"config"``)
    or its ``model.safetensors`` cut to half (``"weights"``): a download that stopped."""
    import shutil
    import tempfile

    out = pathlib.Path(tempfile.mkdtemp()) / f"llama3-{what}"
    shutil.copytree(REFERENCE / "llama3", out)
    file = out / ("config.json" if what == "config" else "model.safetensors")
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return out


def train_flags(*extra: str) -> Callable[[pathlib.Path], object]:
    return cli_error(*TRAIN, *extra)


@functools.cache
def toml_file(text: str) -> str:
    """A config file with ``text``, outside the case's watched directory."""
    import tempfile

    path = pathlib.Path(tempfile.mkdtemp()) / "run.toml"
    path.write_text(text)
    return str(path)


def train_config(text: str, *overrides: str) -> Callable[[pathlib.Path], object]:
    return lambda tmp: train_flags("--config", toml_file(text), *overrides)(tmp)


CLI_CASES = [
    Case("cli-layout-misspelt-axis", train_flags("--layout", "dta=8"), r"dta.*Did you mean 'data'"),
    Case("cli-lora-rank-negative", train_flags("--lora-rank", "-1"), r"--lora-rank must be >= 1"),
    Case("cli-lora-unknown-target", train_flags("--lora-rank", "4", "--lora-targets", "q_proj,attn"), r"\['attn'\]"),
    Case("cli-adapter-without-base", train_flags("--adapter", "somewhere"), r"--adapter continues .* --init-from"),
    Case(
        "cli-adapter-not-peft",
        lambda tmp: cli_error(*TRAIN[:1], "--init-from", str(REFERENCE / "llama3"), "--adapter", str(tmp), *TRAIN[3:])(
            tmp
        ),
        r"has no adapter_config.json",
    ),
    Case("cli-config-missing-file", train_flags("--config", "{tmp}/none.toml"), r"none.toml: no such file"),
    Case("cli-config-not-toml", train_config("lr = = 3"), r"is not valid TOML"),
    Case("cli-config-unknown-key", train_config("learning_rate = 0.1"), r"'learning_rate'.*not a setting"),
    Case("cli-config-misspelt-key", train_config("wieght_decay = 0.1"), r"Did you mean weight_decay"),
    Case("cli-config-wrong-type", train_config('steps = "many"'), r"--steps takes a whole number"),
    Case("cli-config-table", train_config("[model]\nname = 'tiny'"), r"tables .*\[model\].*flat"),
    Case("cli-config-bad-choice", train_config('optimizer = "lion"'), r"'lion' is not one of adamw, sgd"),
    Case("cli-override-without-equals", train_flags("lr"), r"'lr': write overrides as key=value"),
    Case("cli-override-bad-number", train_flags("lr=fast"), r"lr='fast'.*--lr takes a number"),
    Case("cli-eval-every-negative", train_flags("--eval-every", "-1"), r"--eval-every must be >= 0"),
    Case(
        "cli-eval-batches-zero",
        train_flags("--eval-every", "2", "--eval-batches", "0"),
        r"--eval-batches must be at least 1",
    ),
    Case("cli-profile-steps-malformed", train_flags("--profile-steps", "3-5"), r"--profile-steps 3-5: give A:B"),
    Case("cli-zero-stage-three", train_flags("--zero", "3"), r"--zero 3: give a ZeRO stage 0, 1 or 2"),
    Case("cli-fsdp-min-size-negative", train_flags("--fsdp-min-size", "-1"), r"fsdp_min_size=-1 \(--fsdp-min-size\)"),
    Case("cli-b2-one-or-more", train_flags("--b2", "1.5"), r"--b2 must be in \(0, 1\)"),
    Case("cli-clip-negative", train_flags("--clip", "-1"), r"--clip must be a finite number >= 0"),
    Case("cli-lr-schedule-unknown", train_flags("--lr-schedule", "linear"), r"invalid choice: 'linear'"),
    Case("cli-layout-capitalised-axis", train_flags("--layout", "Data=8"), r"Data.*Did you mean 'data'"),
    Case("cli-layout-abbreviations", train_flags("--layout", "dp=2,tp=4"), r"dp.*data"),
    Case("cli-layout-wrong-product", train_flags("--layout", "data=3"), r"3 devices.*8"),
    Case("cli-layout-zero", train_flags("--layout", "data=0"), r"data=0"),
    Case("cli-layout-repeated-axis", train_flags("--layout", "data=2,data=4"), r"data.*(twice|more than once|repeat)"),
    Case("cli-layout-empty", train_flags("--layout", ""), r"The layout is empty"),
    Case("cli-layout-not-a-number", train_flags("--layout", "data=x"), r"data=x"),
    Case("cli-layout-two-fills", train_flags("--layout", "data=-1,fsdp=-1"), r"-1"),
    Case("cli-steps-zero", train_flags("--steps", "0"), r"--steps must be at least 1"),
    Case("cli-steps-negative", train_flags("--steps", "-5"), r"--steps must be at least 1"),
    Case("cli-steps-not-int", train_flags("--steps", "ten"), r"invalid int value: 'ten'"),
    Case("cli-batch-zero", train_flags("--batch", "0"), r"--batch must be at least 1"),
    Case(
        "cli-batch-not-divisible",
        train_flags("--batch", "6"),
        r"6 rows, which do not split over the 4 devices of its batch axes \(data x fsdp\): use a multiple of 4, "
        r"e\.g\. 4 or 8 \(--batch on the command line\)",
    ),
    Case("cli-seq-zero", train_flags("--seq", "0"), r"--seq must be at least 1"),
    Case("cli-seq-too-long", train_flags("--seq", "100000"), r"--seq 100000 exceeds .*max_seq"),
    Case("cli-lr-nan", train_flags("--lr", "nan"), r"--lr must be a finite positive number"),
    Case("cli-lr-inf", train_flags("--lr", "inf"), r"--lr must be a finite positive number"),
    Case("cli-lr-zero", train_flags("--lr", "0"), r"--lr must be a finite positive number"),
    Case("cli-lr-negative", train_flags("--lr", "-0.1"), r"--lr must be a finite positive number"),
    Case("cli-lr-text", train_flags("--lr", "fast"), r"invalid float value: 'fast'"),
    Case("cli-optimizer-unknown", train_flags("--optimizer", "lion"), r"invalid choice: 'lion'"),
    Case("cli-precision-unknown", train_flags("--precision", "fp8"), r"invalid choice: 'fp8'"),
    Case("cli-model-unknown", train_flags("--model", "gpt5"), r"--model 'gpt5' is not a preset"),
    Case("cli-dropout-above-one", train_flags("--dropout", "1.5"), r"--dropout must be in \[0, 1\)"),
    Case("cli-dropout-negative", train_flags("--dropout", "-0.1"), r"--dropout must be in \[0, 1\)"),
    Case("cli-seed-negative", train_flags("--seed", "-1"), r"--seed must be >= 0"),
    Case("cli-devices-zero", train_flags("--devices", "0"), r"--devices 0: simulate at least 1 device"),
    Case("cli-devices-negative", train_flags("--devices", "-3"), r"--devices -3: simulate at least 1 device"),
    Case("cli-microbatches-zero", train_flags("--microbatches", "0"), r"--microbatches must be at least 1"),
    Case("cli-microbatches-not-dividing", train_flags("--microbatches", "3"), r"microbatches=3.*multiple of 12"),
    Case("cli-json-log-missing-dir", train_flags("--json-log", "{tmp}/no/such/log.jsonl"), r"does not exist"),
    Case("cli-json-log-is-a-dir", train_flags("--json-log", "{tmp}"), r"is a directory"),
    Case("cli-data-missing", train_flags("--data", "{tmp}/missing.txt"), r"no such file"),
    Case("cli-data-empty-dir", train_flags("--data", "{tmp}"), r"no \*.txt files"),
    Case("cli-remat-unknown", train_flags("--remat", "sometimes"), r"remat='sometimes'"),
    Case("cli-virtual-stages-zero", train_flags("--virtual-stages", "0"), r"--virtual-stages must be at least 1"),
    Case("cli-schedule-without-stages", train_flags("--schedule", "gpipe"), r"need pipeline stages"),
    Case("cli-checkpoint-every-negative", train_flags("--checkpoint-every", "-1"), r"--checkpoint-every must be >= 0"),
    Case("cli-keep-zero", train_flags("--keep-checkpoints", "0"), r"--keep-checkpoints must be at least 1"),
    Case("cli-warmup-negative", train_flags("--warmup", "-1"), r"--warmup must be >= 0"),
    Case("cli-weight-decay-negative", train_flags("--weight-decay", "-0.1"), r"--weight-decay must be"),
    Case("cli-max-skips-negative", train_flags("--max-skips", "-1"), r"--max-skips must be >= 0"),
    Case("cli-reset-without-checkpoints", train_flags("--reset-optimizer"), r"apply to a resume: add --checkpoint-dir"),
    Case("cli-sample-tokens-negative", train_flags("--sample-tokens", "-1"), r"--sample-tokens must be >= 0"),
    Case("cli-nonfinite-unknown", train_flags("--nonfinite", "ignore"), r"invalid choice: 'ignore'"),
    Case("cli-unknown-flag", train_flags("--learning-rate", "0.1"), r"unrecognized arguments: --learning-rate"),
    Case("cli-checkpoint-dir-is-a-file", train_flags("--checkpoint-dir", __file__), r"is a file; give a directory"),
    Case("cli-stage-with-indivisible-layers", train_flags("--layout", "stage=8"), r"2 layers.*stage=8"),
    Case("cli-dryrun-unknown-model", cli_error("dryrun", "--model", "gpt5", "--layout", "fsdp=8"), r"gpt5"),
    Case(
        "cli-dryrun-missing-factory-module",
        cli_error("dryrun", "--model", "no_such_pkg.models:build", "--layout", "fsdp=8"),
        r"no_such_pkg",
    ),
    Case(
        "cli-dryrun-missing-factory-function",
        cli_error("dryrun", "--model", "byo_factories:no_such_factory", "--layout", "fsdp=8"),
        r"no_such_factory",
    ),
    Case(
        "cli-dryrun-init-from-nothing-there",
        cli_error("dryrun", "--init-from", "no-such-model", "--seq", "64", "--layout", "fsdp=8"),
        r"no config.json there.*llama-3.1-70b",
    ),
    Case(
        "cli-dryrun-init-from-seq-too-long",
        cli_error("dryrun", "--init-from", "qwen3-32b", "--seq", "65536", "--layout", "fsdp=8"),
        r"--seq 65536 exceeds the qwen3:qwen3-32b model's max_seq=40960",
    ),
    Case(
        "cli-dryrun-init-from-and-factory",
        cli_error("dryrun", "--model", "byo_factories:gemma_lm", "--init-from", "llama-3.1-8b", "--seq", "64"),
        r"Both a model factory",
    ),
    Case(
        "cli-plan-init-from-unknown-key",
        lambda tmp: cli_error(
            "plan",
            "--init-from",
            str(hf_copy("qwen3", '{"logit_scale": 2.0}')),
            "--devices",
            "8",
            "--batch",
            "8",
            "--seq",
            "64",
        )(tmp),
        r"logit_scale",
    ),
    Case("cli-dryrun-batch-zero", cli_error("dryrun", "--model", "tiny", "--batch", "0"), r"batch"),
    Case("cli-dryrun-fill-without-devices", cli_error("dryrun", "--model", "tiny", "--layout", "data=-1"), r"-1"),
    Case("cli-dryrun-devices-zero", cli_error("dryrun", "--model", "tiny", "--devices", "0"), r"--devices 0"),
    Case("cli-inspect-misspelt-axis", cli_error("inspect", "--layout", "tensr=8"), r"tensr.*tensor"),
    Case("cli-plan-devices-zero", cli_error("plan", "--devices", "0", "--batch", "8", "--seq", "128"), r"--devices 0"),
    Case(
        "cli-plan-unknown-hardware",
        cli_error("plan", "--devices", "8", "--batch", "8", "--seq", "128", "--hardware", "tpu-v9"),
        r"tpu-v9",
    ),
    Case("cli-plan-missing-batch", cli_error("plan", "--devices", "8", "--seq", "128"), r"--batch"),
    Case(
        "cli-plan-negative-compile-top",
        cli_error("plan", "--devices", "8", "--batch", "8", "--seq", "128", "--compile-top", "-1"),
        r"compile at least 1 layout",
    ),
    Case(
        "cli-plan-zero-workers",
        cli_error("plan", "--devices", "8", "--batch", "8", "--seq", "128", "--workers", "0"),
        r"workers=0: give at least 1 process",
    ),
    Case("cli-launch-zero-processes", cli_error("launch", "--nproc", "0", "--", "python"), r"--nproc 0"),
    Case("cli-launch-no-command", cli_error("launch", "--nproc", "2"), r"needs a command after `--`"),
    Case("cli-launch-unknown-command", cli_error("launch", "--nproc", "2", "--", "no-such-cmd"), r"not found on PATH"),
    Case("cli-unknown-subcommand", cli_error("trian"), r"invalid choice: 'trian'"),
    Case(
        "cli-init-from-unknown-config-key",
        lambda tmp: cli_error(*TRAIN[:1], "--init-from", str(hf_copy("gemma2", '{"logit_scale": 2.0}')), *TRAIN[3:])(
            tmp
        ),
        r"logit_scale=2.0.*does not know",
    ),
    Case(
        "cli-train-layout-auto-nothing-fits",
        cli_error("train", "--model", "llama2-70b", "--layout", "auto", "--steps", "1", "--batch", "8", "--seq", "64"),
        r"--layout auto: no layout of the model fits 8 h100 devices",
    ),
    Case(
        "cli-init-from-longrope",
        lambda tmp: cli_error(
            *TRAIN[:1],
            "--init-from",
            str(hf_copy("llama3", '{"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 5e5}}')),
            *TRAIN[3:],
        )(tmp),
        r"rope_type 'longrope'",
    ),
    Case(
        "cli-init-from-gemma1",
        lambda tmp: cli_error(*TRAIN[:1], "--init-from", str(hf_copy("gemma2", '{"model_type": "gemma"}')), *TRAIN[3:])(
            tmp
        ),
        r"Gemma 1",
    ),
]


def api(fn: Callable[[], object]) -> Callable[[pathlib.Path], object]:
    return lambda _tmp: fn()


@functools.cache
def initialized(layout="data=8", **kwargs):
    t = trainer(layout, **kwargs)
    return t, t.init(0)


API_CASES = [
    Case("api-dataset-negative-seed", api(lambda: sk.TextDataset.builtin(seed=-1)), r"seed=-1; give an integer >= 0"),
    Case(
        "api-step-host-batch-longer-than-max-seq",
        api(lambda: trainer().step(tiny_state(), batch(cols=TINY.max_seq + 2))),
        r"sequences of 129 tokens \(\+1 target\); the model takes at most max_seq=128",
        setup=lambda: tiny_state(),
    ),
    Case("api-not-a-model", api(lambda: sk.Trainer("gpt", optax.sgd(0.1))), r"model must be a shardkit Model"),
    Case("api-not-an-optimizer", api(lambda: sk.Trainer(TINY.model(), "adam")), r"optimizer must be an optax"),
    Case("api-layout-misspelt", api(lambda: trainer("dta=8")), r"dta.*Did you mean 'data'"),
    Case("api-layout-product", api(lambda: trainer("data=3")), r"3 devices.*8"),
    Case("api-layout-dict-float", api(lambda: sk.Trainer(TINY.model(), optax.sgd(0.1), {"data": 8.5})), r"8.5"),
    Case("api-precision-unknown", api(lambda: trainer(precision="fp8")), r"Unknown precision 'fp8'"),
    Case("api-microbatches-zero", api(lambda: trainer(microbatches=0)), r"microbatches must be a positive integer"),
    Case("api-held-out-fraction", api(lambda: sk.TextDataset.from_bytes(b"abc" * 99).split(1.5)), r"held_out=1.5"),
    Case("api-zero-stage-three", api(lambda: trainer(zero=3)), r"zero=3.*Stage 3 is the fsdp axis"),
    Case("api-zero-without-data-axis", api(lambda: trainer("fsdp=8", zero=1)), r"zero=1.*data=1.*add a data axis"),
    Case("api-microbatches-bool", api(lambda: trainer(microbatches=True)), r"microbatches must be a positive integer"),
    Case("api-microbatches-float", api(lambda: trainer(microbatches=2.0)), r"microbatches must be a positive integer"),
    Case("api-nonfinite-unknown", api(lambda: trainer(nonfinite="ignore")), r"'skip', 'halt' or None"),
    Case("api-max-skips-negative", api(lambda: trainer(max_skips=-1)), r"max_skips=-1"),
    Case("api-schedule-without-stages", api(lambda: trainer(schedule="1f1b")), r"need pipeline stages"),
    Case(
        "api-rules-unknown-mesh-axis",
        api(lambda: trainer(rules=sk.default_rules() + sk.Rules.of(embed="model"))),
        r"'model'",
    ),
    Case("api-rules-not-pairs", api(lambda: trainer(rules=5)), r"[Rr]ules"),
    Case("api-no-devices", api(lambda: sk.Trainer(TINY.model(), optax.sgd(0.1), devices=[])), r"device"),
    Case("api-batch-not-a-dict", api(lambda: trainer().shard_batch([np.zeros((8, 17), np.int32)])), r"dict of arrays"),
    Case("api-batch-empty", api(lambda: trainer().shard_batch({})), r"non-empty dict"),
    Case("api-batch-without-tokens", api(lambda: trainer().shard_batch({"ids": np.zeros((8, 17), np.int32)})), "ids"),
    Case("api-tokens-float", api(lambda: trainer().shard_batch(batch(dtype=np.float32))), r"token ids must be int"),
    Case(
        "api-tokens-1d", api(lambda: trainer().shard_batch({"tokens": np.zeros(8, np.int32)})), r"\(batch, seq \+ 1\)"
    ),
    Case("api-tokens-one-column", api(lambda: trainer().shard_batch(batch(cols=1))), r"\(batch, seq \+ 1\)"),
    Case("api-tokens-negative", api(lambda: trainer().shard_batch(batch(value=-3))), r"from -3 to -3"),
    Case("api-tokens-beyond-vocab", api(lambda: trainer().shard_batch(batch(value=256))), r"\[0, 256\)"),
    Case("api-tokens-a-list", api(lambda: trainer().shard_batch({"tokens": [[1, 2, 3]] * 8})), r"not an array"),
    Case("api-tokens-longer-than-max-seq", api(lambda: trainer().shard_batch(batch(cols=TINY.max_seq + 2))), "max_seq"),
    Case(
        "api-batch-rows-indivisible",
        api(lambda: initialized()[0].step(initialized()[1], initialized()[0].shard_batch(batch(rows=12)))),
        r"12 rows, which do not split over the 8 devices .*e\.g\. 8 or 16",
        setup=initialized,
    ),
    Case(
        "api-microbatches-indivisible",
        api(
            lambda: initialized(microbatches=3)[0].step(initialized(microbatches=3)[1], trainer().shard_batch(batch()))
        ),
        r"multiple of 24",
        setup=lambda: initialized(microbatches=3),
    ),
    Case(
        "api-gpt-from-nnx-longer-than-max-seq",  # the README's wrapping: no max_seq in the model's info
        api(lambda: nnx_gpt()[0].step(nnx_gpt()[1], nnx_gpt()[0].shard_batch(batch(cols=TINY.max_seq + 73)))),
        r"200 tokens; it takes at most max_seq=128",
        setup=nnx_gpt,
    ),
    Case(
        "api-mse-y-shape",
        api(lambda: regression()[0].step(regression()[1], regression()[0].shard_batch(regression_batch(y_cols=1)))),
        r"prediction for batch\['x'\] \(8, 32\) has shape \(8, 32\), batch\['y'\] has shape \(8, 1\)",
        setup=regression,
    ),
    Case(
        "api-mse-x-shape",
        api(lambda: regression()[0].step(regression()[1], regression()[0].shard_batch(regression_batch(x_cols=5)))),
        r"does not take batch\['x'\] of shape \(8, 5\)",
        setup=regression,
    ),
    Case(
        "api-hf-config-layers-negative",  # named as config.json names it, not as GPTConfig does
        api(lambda: sk.from_pretrained(hf_copy("llama3", '{"num_hidden_layers": -2}'), layout="data=8")),
        r"config.json: num_hidden_layers=-2 must be a positive integer",
    ),
    Case(
        "api-hf-config-heads-not-grouping",
        api(lambda: sk.from_pretrained(hf_copy("llama3", '{"num_attention_heads": 5}'), layout="data=8")),
        r"num_attention_heads=5 must be a multiple of num_key_value_heads=2",
    ),
    Case(
        "api-hf-config-not-json",
        api(lambda: sk.from_pretrained(broken_checkpoint("config"), layout="data=8")),
        r"config.json is not JSON \(.* at line \d+",
    ),
    Case(
        "api-hf-safetensors-truncated",
        api(lambda: sk.from_pretrained(broken_checkpoint("weights"), layout="data=8")),
        r"model.safetensors is not a readable safetensors file .* truncated",
    ),
    Case("api-donated-state", lambda _tmp: donated()[0].step(donated()[1], donated()[2]), r"donated", setup=donated),
    Case("api-gpt-zero-layers", api(lambda: GPTConfig(n_layers=0)), r"n_layers"),
    Case("api-gpt-zero-dim", api(lambda: GPTConfig(dim=0)), r"dim"),
    Case("api-gpt-heads-not-dividing", api(lambda: GPTConfig(dim=64, n_heads=5)), r"n_heads"),
    Case("api-gpt-kv-heads", api(lambda: GPTConfig(n_heads=8, n_kv_heads=3, dim=64)), r"multiple of n_kv_heads"),
    Case("api-gpt-param-dtype", api(lambda: GPTConfig(param_dtype="float17")), r"float17"),
    Case("api-gpt-dropout", api(lambda: GPTConfig(dropout=2.0)), r"dropout"),
    Case("api-gpt-vocab-zero", api(lambda: GPTConfig(vocab=0)), r"vocab"),
    Case("api-gpt-remat", api(lambda: GPTConfig(remat="sometimes")), r"remat='sometimes'"),
    Case("api-gpt-preset-unknown", api(lambda: GPTConfig.preset("gpt5")), r"Choose one of"),
    Case("api-gpt-preset-unknown-field", api(lambda: GPTConfig.preset("tiny", layers=3)), r"layers"),
    Case("api-data-batch-zero", api(lambda: sk.TextDataset.builtin().batch(0, batch_size=0, seq_len=16)), r"batch"),
    Case("api-data-seq-zero", api(lambda: sk.TextDataset.builtin().batch(0, batch_size=8, seq_len=0)), r"seq_len"),
    Case("api-data-step-negative", api(lambda: sk.TextDataset.builtin().batch(-1, batch_size=8, seq_len=16)), "step"),
    Case("api-data-too-short", api(lambda: sk.TextDataset.from_bytes(b"short").batch(0, 2, 64)), r"too few"),
    Case("api-data-empty", api(lambda: sk.TextDataset.from_bytes(b"")), r"empty"),
    Case("api-data-not-bytes", api(lambda: sk.TextDataset.from_bytes("text")), r"bytes"),
    Case(
        "api-data-processes",
        api(lambda: sk.TextDataset.builtin().batch(0, batch_size=8, seq_len=16, process_index=0, process_count=3)),
        r"does not divide over 3 processes",
    ),
    Case("api-load-text-missing", lambda tmp: sk.load_text(str(tmp / "missing.txt")), r"no such file"),
    Case("api-checkpointer-every", lambda tmp: Checkpointer(tmp, every=-1), r"interval >= 0"),
    Case("api-checkpointer-keep", lambda tmp: Checkpointer(tmp, keep=0), r"keep at least 1"),
    Case("api-checkpointer-file", api(lambda: Checkpointer(__file__)), r"is a file"),
    Case("api-restore-missing-dir", lambda tmp: Checkpointer(tmp / "nope").restore(trainer()), r"does not exist"),
    Case("api-restore-empty-dir", lambda tmp: Checkpointer(tmp).restore(trainer()), r"No complete checkpoint"),
    Case(
        "api-restore-unknown-step",
        api(lambda: Checkpointer(saved_checkpoint()).restore(trainer(), step=7)),
        r"No complete checkpoint for step 7",
        setup=saved_checkpoint,
    ),
    Case(
        "api-restore-other-model",
        api(
            lambda: Checkpointer(saved_checkpoint()).restore(
                sk.Trainer(GPTConfig.preset("tiny", dim=128).model(), optax.adamw(1e-3), "data=8")
            )
        ),
        r"written by another model",
        setup=saved_checkpoint,
    ),
    Case(
        "api-restore-other-precision",
        api(lambda: Checkpointer(saved_checkpoint()).restore(trainer(precision="bf16-master"))),
        r"float32, now .* bfloat16",
        setup=saved_checkpoint,
    ),
    Case(
        "api-restore-other-optimizer",
        api(lambda: Checkpointer(saved_checkpoint()).restore(sk.Trainer(TINY.model(), optax.sgd(0.1), "data=8"))),
        r"another optimizer.*--reset-optimizer",
        setup=saved_checkpoint,
    ),
    Case(
        "api-restore-other-seed",
        api(lambda: Checkpointer(saved_checkpoint()).restore(trainer(), run={"data": {"seed": 5}})),
        r"--seed 0 \(now 5\)",
        setup=saved_checkpoint,
    ),
    Case(
        "api-restore-other-lr",
        api(
            lambda: Checkpointer(saved_checkpoint()).restore(
                trainer(), run={"data": {"seed": 0}, "schedule": {"lr": 0.1}}
            )
        ),
        r"--lr 0.001 \(now 0.1\).*--allow-schedule-change",
        setup=saved_checkpoint,
    ),
    Case("api-from-nnx-not-callable", api(lambda: sk.from_nnx(5)), r"from_nnx"),
    Case(
        "api-annotate-wrong-rank",
        api(lambda: sk.annotate(TINY.model(), {r".*": ("embed",)})),
        r"gives .* 1 names .* dimensions",
    ),
    Case(
        "api-annotate-regex-matches-nothing",
        api(lambda: sk.annotate(TINY.model(), {r"^nothing$": ("embed",)}, strict=True)),
        r"matched no parameter",
    ),
    Case("api-dryrun-unknown-model", api(lambda: sk.dryrun(model="gpt5", layout="fsdp=8")), r"gpt5"),
    Case(
        "api-plan-init-from-and-model",
        api(lambda: sk.plan("tiny", 8, "h100", 8, 64, init_from="llama-3.1-8b")),
        r"both a model",
    ),
    Case("api-plan-without-devices", api(lambda: sk.plan(init_from="llama-3.1-8b", batch=8, seq=64)), r"devices"),
    Case("api-dryrun-not-a-model", api(lambda: sk.dryrun(model=42, layout="fsdp=8")), r"42"),
    Case("api-simulate-zero", api(lambda: sk.simulate_devices(0)), r"positive integer"),
    Case("api-simulate-too-late", api(lambda: sk.simulate_devices(4)), r"restart the kernel"),
    Case("api-simulate-float", api(lambda: sk.simulate_devices(2.5)), r"positive integer"),
    Case(
        "api-distributed-id-out-of-range",
        api(lambda: distributed.initialize("127.0.0.1:1", num_processes=2, process_id=5)),
        r"outside 0..1",
    ),
    Case(
        "api-distributed-env-not-int",
        api(lambda: distributed.detect({"SHARDKIT_NUM_PROCESSES": "two"})),
        r"SHARDKIT_NUM_PROCESSES='two' must be an integer",
    ),
    Case("api-launch-no-command", api(lambda: launch([], 2)), r"needs a command"),
    Case("api-launch-zero-processes", api(lambda: launch(["python"], 0)), r"--nproc 0"),
    Case("api-launch-unknown-command", api(lambda: launch(["no-such-cmd"], 2)), r"not found on PATH"),
    Case("api-launch-not-executable", lambda tmp: launch([str(tmp / "x/y")], 2), r"not an executable file"),
    Case("api-config-steps", api(lambda: TrainConfig(steps=0)), r"--steps must be at least 1"),
    Case("api-config-precision", api(lambda: TrainConfig(precision="fp8")), r"--precision 'fp8'"),
    Case("api-config-nonfinite", api(lambda: TrainConfig(nonfinite="warn")), r"--nonfinite 'warn'"),
    Case("api-config-optimizer", api(lambda: TrainConfig(optimizer="lion")), r"--optimizer 'lion'"),
    Case("api-constrain-indivisible", api(lambda: _constrain_indivisible()), r"divid"),
    Case(
        "api-step-state-of-another-layout",
        api(lambda: trainer().step(initialized("fsdp=8")[1], trainer().shard_batch(batch()))),
        r"laid out as .* not as this trainer's layout data=8 expects",
        setup=lambda: initialized("fsdp=8"),
    ),
]


def _constrain_indivisible():
    t = trainer()
    with sk.use_sharding(t.mesh, t.rules):
        jax.eval_shape(lambda x: sk.constrain(x, ("batch", "mlp")), jnp.zeros((4, 12)))


CASES = CLI_CASES + API_CASES
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# The programs that do work: the train step, the sharded init, the checkpoint checksums. (Eager
# one-op programs, such as making a PRNG key, compile too; they are not what "before any compile"
# is about.)
PROGRAMS = {"jit(step)", "jit(_init_fn)", "jit(_all_lanes)"}


@contextlib.contextmanager
def watching_compiles():
    """Every backend compile in the block (jit calls included), as JAX reports them."""
    seen: list[str] = []

    def listener(event, *_args, **kwargs):
        if event == COMPILE_EVENT and kwargs.get("fun_name") in PROGRAMS:
            seen.append(kwargs["fun_name"])

    jax_monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax_monitoring.unregister_event_duration_listener(listener)


def test_the_compile_watch_sees_jit_calls():
    t = trainer("fsdp=8")
    with watching_compiles() as seen:
        state = t.init(0)
        t.step(state, t.shard_batch(batch()))
    assert seen == ["jit(_init_fn)", "jit(step)"]


def test_the_catalogue_has_at_least_100_cases_with_distinct_ids():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path):
    if case.setup is not None:
        case.setup()
    before = sorted(tmp_path.rglob("*"))
    with watching_compiles() as compiles, pytest.raises(sk.ShardkitError, match=case.match) as error:
        case.call(tmp_path)
    assert compiles == [], "an error must come before any compile"
    assert sorted(tmp_path.rglob("*")) == before, "an error must come before any write"
    message = str(error.value)
    assert "Traceback" not in message and len(message) < 2000
