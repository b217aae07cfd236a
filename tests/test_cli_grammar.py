"""The command line answers at once, says its version, and refuses bad numbers before any work."""

import re
import subprocess
import sys

import pytest

from shardkit.config import TrainConfig

SUBCOMMANDS = ("train", "dryrun", "inspect", "plan", "launch")


def test_building_the_parser_starts_no_jax():
    code = (
        "import sys; from shardkit.cli import build_parser; build_parser(); "
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
    from shardkit.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and hint in capsys.readouterr().err


def test_dryrun_says_whether_the_plan_fits_the_hardware():
    from shardkit.dryrun import memory_verdict

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
