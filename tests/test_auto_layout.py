"""``shardkit train --layout auto``: the planner places the run on the devices present, and again
on each resume, with the global batch and the math of the checkpoint."""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest
from helpers import json_log_losses, run_cli, start_cli, wait_for_log_lines

from shardkit.core.config import TrainConfig
from shardkit.plan.auto_layout import options_of

# A device whose memory the tiny model's step fills on 4 devices but not on 8 (its compiled step
# at batch 16 x seq 64, fp32: 5.5 MB under data=8; 9.0 MB under data=4, 5.8 MB with 2 microbatches):
# the budget is 90% of 7 MB.
SMALL_DEVICE = {
    "flops": {"bfloat16": 989e12, "float32": 67e12},
    "memory_bytes": 7.0e6,
    "memory_bandwidth": 3.35e12,
    "intra_node_bandwidth": 450e9,
    "inter_node_bandwidth": 50e9,
    "devices_per_node": 8,
}


def test_settings_given_on_the_command_line_are_kept_and_the_rest_searched():
    options = options_of(TrainConfig(layout="auto", microbatches=4, precision="fp32"))
    assert options.microbatches == (4,) and options.precision == "fp32"
    assert options.remat == ("none", "full") and options.zero == (0, 2)  # the planner's own search


@pytest.mark.slow
def test_a_run_checkpointed_on_8_devices_resumes_on_4_replanned_with_the_same_losses(tmp_path):
    hardware = tmp_path / "small.json"
    hardware.write_text(json.dumps(SMALL_DEVICE))
    base = ["train", "--model", "tiny", "--layout", "auto", "--hardware", str(hardware), "--batch", "16", "--seq", "64"]
    base += ["--steps", "12", "--precision", "fp32", "--sample-tokens", "0", "--checkpoint-every", "100"]
    cache = {"SHARDKIT_CACHE": str(tmp_path / "cache")}
    ckpt, log = tmp_path / "run", tmp_path / "a.jsonl"
    first = start_cli(
        *base,
        "--devices",
        "8",
        "--checkpoint-dir",
        str(ckpt),
        "--json-log",
        str(log),
        env=cache,
        stdout=subprocess.PIPE,
    )
    wait_for_log_lines(log, 5)
    first.send_signal(signal.SIGTERM)  # a node is lost: the run saves where it is and stops
    out_first, _ = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM
    placed_on_8 = re.search(r"layout auto: 8 devices .*?: (\S+), microbatches (\d+)", out_first)
    assert placed_on_8, out_first

    second = run_cli(*base, "--devices", "4", "--checkpoint-dir", str(ckpt), "--json-log", str(log), env=cache)
    assert second.returncode == 0, second.stderr
    placed_on_4 = re.search(r"layout auto: 4 devices .*?: (\S+), microbatches (\d+)", second.stdout)
    assert placed_on_4, second.stdout
    layout_4, microbatches_4 = placed_on_4.group(1), int(placed_on_4.group(2))
    resumed = re.search(r"resumed from .* at step (\d+) \(saved under layout (\S+)\)", second.stdout)
    assert resumed and int(resumed.group(1)) >= 5 and resumed.group(2) == placed_on_8.group(1)
    # The re-plan fits the smaller machine: 4 devices hold what 8 did, so the plan splits the
    # batch into microbatches or the state over the devices, and says so.
    assert layout_4 != placed_on_8.group(1)
    assert microbatches_4 > 1 or "fsdp" in layout_4 or "tensor" in layout_4

    straight = run_cli(*base, "--devices", "8", "--json-log", str(tmp_path / "b.jsonl"), env=cache)
    assert straight.returncode == 0, straight.stderr
    got, reference = json_log_losses(log), json_log_losses(tmp_path / "b.jsonl")
    assert sorted(got) == sorted(reference) == list(range(1, 13))
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-5), step


@pytest.mark.slow
def test_two_processes_plan_once_and_train_the_same_steps_as_one(tmp_path):
    """Under jax.distributed process 0 plans (its compiles in worker processes) and every process
    takes its answer; the run is the one a single process of the same 8 devices trains."""
    train = ["train", "--model", "tiny", "--layout", "auto", "--steps", "3", "--batch", "16", "--seq", "64"]
    train += ["--sample-tokens", "0", "--precision", "fp32"]
    cache = {"SHARDKIT_CACHE": str(tmp_path / "cache")}
    launch = ["launch", "--nproc", "2", "--devices-per-proc", "4", "--", "shardkit"]
    two = run_cli(*launch, *train, "--json-log", str(tmp_path / "two.jsonl"), env=cache)
    assert two.returncode == 0, two.stderr[-3000:]
    said = two.stdout + two.stderr
    assert said.count("layout auto: 8 devices") == 1 and "[rank 0] layout auto: 8 devices" in said
    one = run_cli(*train, "--devices", "8", "--json-log", str(tmp_path / "one.jsonl"), env=cache)
    assert one.returncode == 0, one.stderr[-3000:]
    got, reference = json_log_losses(tmp_path / "two.jsonl"), json_log_losses(tmp_path / "one.jsonl")
    assert sorted(got) == [1, 2, 3]
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-5), step
