"""`--run-dir`: one directory per run; a resume keeps the settings that change the math unless
`--allow-change` names them, and `--overwrite` starts over. Real runs of the main job."""

import io
import json

import pytest

import shardkit as sk
from shardkit.cli.run import train
from shardkit.core.config import TrainConfig
from shardkit.training.checkpoint import Checkpointer


def run(tmp_path, **kw):
    base = dict(model="tiny", layout="data=8", steps=4, batch=8, seq=32, sample_tokens=0, checkpoint_every=2)
    out = io.StringIO()
    result = train(TrainConfig(run_dir=str(tmp_path / "run"), **(base | kw)), progress=False, out=out)
    return result, out.getvalue()


@pytest.fixture
def finished(tmp_path):
    run(tmp_path)
    return tmp_path


def test_a_run_directory_holds_config_checkpoints_and_log(finished):
    root = finished / "run"
    config = json.loads((root / "config.json").read_text())
    assert config["lr"] == 3e-3 and config["steps"] == 4 and config["model"] == "tiny"
    assert Checkpointer(root / "checkpoints").steps() == [2, 4]
    assert [json.loads(line)["step"] for line in (root / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_changed_setting_is_refused_until_allowed(finished):
    with pytest.raises(sk.ShardkitError, match=r"--lr 0.003 \(now 0.01\), --steps 4 \(now 6\).*--allow-change lr"):
        run(finished, lr=0.01, steps=6)
    with pytest.raises(sk.ShardkitError, match=r"--steps 4 \(now 6\).*--allow-change steps"):
        run(finished, lr=0.01, steps=6, allow_change=("lr",))
    result, out = run(finished, lr=0.01, steps=6, allow_change=("lr", "steps"))
    assert f"resumed from {finished / 'run' / 'checkpoints'} at step 4" in out and len(result["losses"]) == 2
    config = json.loads((finished / "run" / "config.json").read_text())
    assert config["lr"] == 0.01 and config["changes"] == [
        {"lr": {"was": 0.003, "now": 0.01}, "steps": {"was": 4, "now": 6}}
    ]
    log = [json.loads(line)["step"] for line in (finished / "run" / "log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5, 6]


def test_another_layout_is_not_a_change(finished):
    result, out = run(finished, layout="fsdp=8", steps=4)
    assert "already reaches --steps 4" in out and result["losses"] == []


def test_overwrite_starts_over(finished):
    result, out = run(finished, lr=0.01, overwrite=True)
    assert "resumed" not in out and len(result["losses"]) == 4
    assert json.loads((finished / "run" / "config.json").read_text())["lr"] == 0.01


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "thesis.tex").write_text("precious")
    with pytest.raises(sk.ShardkitError, match=r"not a shardkit run directory; nothing was deleted"):
        run(tmp_path, overwrite=True)
    assert (tmp_path / "run" / "thesis.tex").read_text() == "precious"


def test_run_directory_settings_errors(tmp_path):
    with pytest.raises(sk.ShardkitError, match=r"--allow-change leaning-rate: .* Settings:"):
        TrainConfig(run_dir=str(tmp_path), allow_change=("leaning-rate",))
    with pytest.raises(sk.ShardkitError, match=r"did you mean lr"):
        TrainConfig(run_dir=str(tmp_path), allow_change=("lrr",))
    with pytest.raises(sk.ShardkitError, match=r"apply to a --run-dir"):
        TrainConfig(overwrite=True)
    with pytest.raises(sk.ShardkitError, match=r"drop --checkpoint-dir and --json-log"):
        TrainConfig(run_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "c"))
