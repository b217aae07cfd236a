"""The command line answers at once, says its version, and refuses bad numbers before any work."""

import json
import re
import subprocess
import sys

import pytest

from shardkit.core.config import TrainConfig

SUBCOMMANDS = ("train", "dryrun", "inspect", "plan", "launch")


def test_building_the_parser_starts_no_jax():
    code = (
        "import sys; from shardkit.cli.commands import build_parser; build_parser(); "
        "print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command):
    proc = subprocess.run([sys.executable, "-m", "shardkit.cli", command, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and f"shardkit {command}" in proc.stdout


def test_version():
    proc = subprocess.run([sys.executable, "-m", "shardkit.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("shardkit ")


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), 0.0, -1e-3])
def test_learning_rate_must_be_finite_and_positive(lr):
    import shardkit as sk

    with pytest.raises(sk.ShardkitError, match="finite positive"):
        TrainConfig(lr=lr)


def test_the_training_recipe_is_set_by_flags():
    # Warmup, the schedule after it, clipping and AdamW's b2 are flags, not hidden constants.
    import numpy as np
    import optax

    from shardkit.cli.run import OPTIMIZERS, _schedule

    cosine = _schedule(TrainConfig(lr=1.0, warmup=10, steps=100))
    constant = _schedule(TrainConfig(lr=1.0, warmup=10, steps=100, lr_schedule="constant"))
    assert float(cosine(5)) == float(constant(5)) == 0.5  # the same warmup
    assert float(cosine(100)) == pytest.approx(0.1) and float(constant(100)) == 1.0
    grads = {"w": np.full(4, 10.0, np.float32)}  # global norm 20
    for clip, norm in ((1.0, 1.0), (0.0, 20.0)):
        sgd = OPTIMIZERS["sgd"](TrainConfig(lr=1.0, warmup=0, steps=2, clip=clip, lr_schedule="constant"))
        updates, _ = sgd.update(grads, sgd.init(grads))
        assert float(optax.tree.norm(updates)) == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["train", "--precison", "bf16"], "--precison: did you mean --precision?"),
        (["train", "--learning-rate", "0.1"], "--learning-rate: shardkit calls it --lr"),
        (["trian"], "did you mean 'train'?"),
        (["train", "--optimizer", "adam"], "did you mean 'adamw'?"),
        (["dryrun", "--layot", "fsdp=8"], "--layot: did you mean --layout?"),
    ],
)
def test_a_misspelt_flag_or_choice_gets_a_suggestion(argv, hint, capsys):
    from shardkit.cli.commands import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and hint in capsys.readouterr().err


def test_dryrun_says_whether_the_plan_fits_the_hardware():
    from shardkit.plan.dryrun import memory_verdict

    over = memory_verdict(132e9, "h100")
    assert not over["fits"] and "does NOT fit one h100 (80.0 GB): 132.0 GB per device, 52.0 GB over" in over["text"]
    assert memory_verdict(132e9, "h200")["fits"]  # 141 GB
    flags = ["--model", "tiny", "--layout", "fsdp=8", "--batch", "8", "--seq", "64", "--hardware", "a100"]
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "dryrun", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"fits one a100 \(80.0 GB\): 0.0\d GB per device", proc.stdout)


def test_shared_flags_mean_the_same_everywhere():
    """One name, one help, one default per flag across subcommands; the planner's deliberate
    differences are listed here with their reason."""
    from shardkit.cli.commands import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    planner_differs = {  # asked about a size: no default; plans for accelerators: bf16 with fp32 masters
        ("plan", "--devices"): "required",
        ("plan", "--batch"): "required",
        ("plan", "--seq"): "required",
        ("plan", "--precision"): "bf16-master",
        # generation's own layout, not training's: by default one device (no collectives per token)
        ("generate", "--layout"): None,
    }
    seen: dict[str, tuple[str, object]] = {}
    shared = 0
    for name, sub in subparsers.items():
        for action in sub._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help") or (name, flag) in planner_differs:
                    continue
                if flag in seen:
                    shared += 1
                    assert (action.help, action.default) == seen[flag], f"{name} {flag}"
                else:
                    seen[flag] = (action.help, action.default)
    assert shared >= 25  # --model, --layout, --batch, ... in train, dryrun, inspect and plan
    plan = {a.option_strings[0]: a for a in subparsers["plan"]._actions if a.option_strings}
    assert plan["--devices"].required and plan["--precision"].default == "bf16-master"


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_shows_defaults_and_an_example(command):
    proc = subprocess.run([sys.executable, "-m", "shardkit.cli", command, "--help"], capture_output=True, text=True)
    assert f"example: shardkit {command}" in proc.stdout
    if command != "launch":
        assert "(default: " in proc.stdout


def test_a_switch_that_turns_something_off_shows_no_true_default():
    """``--unrolled`` unrolls the layers, which are scanned unless it is given: its help must not
    say "(default: True)" (the field's value, not the flag's)."""
    from shardkit.cli.commands import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["dryrun"].format_help().split())
    unrolled = help_text[help_text.index("--unrolled") :][:120]
    assert "default" not in unrolled.split("--", 2)[1]


def test_dryrun_inspect_and_plan_all_answer_in_json():
    from helpers import run_cli

    proc = run_cli("inspect", "--model", "tiny", "--layout", "fsdp=4,tensor=2", "--batch", "8", "--seq", "32", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["layout"] == "fsdp=4,tensor=2" and result["report"]["devices"] == 8
    wo = next(p for p in result["parameters"] if p["path"].endswith("attn/wo"))
    assert wo["spec"] == "[-, tensor, -, fsdp]" and result["report"]["bytes_by_axes"]["fsdp"] > 0


def test_a_config_file_and_overrides_sit_under_the_flags(tmp_path):
    """defaults < --config FILE < key=value < --flags, for every kind of field."""
    from shardkit.cli.commands import parse
    from shardkit.core.flags import config_from

    run = tmp_path / "run.toml"
    run.write_text(
        'model = "tiny"\nlr = 1\nsteps = 40\nlayout = "fsdp=8"\nsequence-parallel = true\nallow_change = ["lr"]\n'
        'run_dir = "runs/a"\n'
    )
    args = parse(["train", "--config", str(run), "steps=30", "seq=64", "--steps", "20", "--batch", "4"])
    cfg = config_from(TrainConfig, args)
    assert (cfg.model, cfg.layout, cfg.lr, cfg.sequence_parallel, cfg.allow_change) == (
        "tiny",
        "fsdp=8",
        1.0,
        True,
        ("lr",),
    )
    assert (cfg.steps, cfg.seq, cfg.batch, cfg.warmup) == (20, 64, 4, TrainConfig().warmup)
    assert isinstance(cfg.lr, float)


def test_every_config_rebuilds_from_its_generated_flags():
    """The argv generated from a config parses back to the same config (the subprocess path)."""
    from shardkit.cli.commands import build_parser
    from shardkit.core.config import DryRunSettings, PlanOptions
    from shardkit.core.flags import add_flags, config_from, to_argv

    train = TrainConfig(model="tiny", lr=0.01, allow_change=("lr", "steps"), run_dir="r", sequence_parallel=True)
    assert config_from(TrainConfig, build_parser().parse_args(["train", *to_argv(train)])) == train
    dry = DryRunSettings(model="tiny", layout="fsdp=8", scan_layers=False, n_layers=2, seq=64)
    assert config_from(DryRunSettings, build_parser().parse_args(["dryrun", *to_argv(dry)])) == dry
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, PlanOptions)
    options = PlanOptions(tensor=(1, 2), remat=("full",), microbatches=(4,), compile_top=None, headroom=0.5)
    assert config_from(PlanOptions, parser.parse_args(to_argv(options))) == options
    assert config_from(PlanOptions, parser.parse_args([])) == PlanOptions()
