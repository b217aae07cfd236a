"""`--profile-steps A:B` captures a jax.profiler trace of those steps (TensorBoard/Perfetto)."""

import gzip
import json

import pytest

import shardkit as sk
from shardkit.cli import commands as cli
from shardkit.core.config import TrainConfig


def test_a_trace_of_the_chosen_steps_is_written_and_holds_the_train_step(tmp_path, capsys):
    argv = ["train", "--model", "tiny", "--steps", "4", "--batch", "8", "--seq", "32", "--sample-tokens", "0"]
    assert cli.main([*argv, "--profile-steps", "1:3", "--profile-dir", str(tmp_path / "prof")]) == 0
    assert f"profile of steps 2 to 3 (--profile-steps 1:3) in {tmp_path / 'prof'}" in capsys.readouterr().out
    (xplane,) = (tmp_path / "prof").rglob("*.xplane.pb")  # TensorBoard's profile plugin reads this
    assert b"jit_step" in xplane.read_bytes()
    (trace,) = (tmp_path / "prof").rglob("*.trace.json.gz")  # Perfetto reads this
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any("jit_step" in str(e.get("name", "")) for e in events)


@pytest.mark.parametrize("text", ["0:2", "3:2", "2", "a:b", "2:9"])
def test_a_bad_profile_range_is_refused_before_anything_runs(text):
    with pytest.raises(sk.ShardkitError, match=r"--profile-steps .*give A:B with 0 < A < B <= --steps \(5\)"):
        TrainConfig(steps=5, profile_steps=text)
