"""One directory per run: its configuration, checkpoints and step log together.

``shardkit train --run-dir runs/exp1`` writes ``config.json`` (every setting), keeps checkpoints in
``checkpoints/`` and the step log in ``log.jsonl``. Run again with the same directory, it resumes;
a setting that changes what the run computes (``RESUMABLE_SETTINGS``) must be the same, or named
with ``--allow-change KEY``; ``--overwrite`` starts the run over.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from typing import Any

from shardkit.core.config import RESUMABLE_SETTINGS, TrainConfig
from shardkit.core.errors import CheckpointError

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
LOG = "log.jsonl"


def differences(stored: dict[str, Any], cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """``{setting: (stored, now)}`` for the settings that change what a resumed run computes.

    Example:
      >>> differences({"lr": 0.003, "layout": "data=8"}, TrainConfig(lr=0.01, layout="fsdp=8"))
      {'lr': (0.003, 0.01)}
    """
    now = dataclasses.asdict(cfg)
    return {k: (stored[k], now[k]) for k in sorted(RESUMABLE_SETTINGS) if k in stored and stored[k] != now[k]}


def prepare(cfg: TrainConfig) -> TrainConfig:
    """Set up (or check) ``cfg.run_dir`` and return ``cfg`` with its checkpoint directory and log.

    Raises:
      ShardkitError: a changed setting not named by ``--allow-change``, or ``--overwrite`` of a
        directory that is not a shardkit run; before anything is written.
    """
    assert cfg.run_dir is not None
    root = pathlib.Path(cfg.run_dir)
    config = root / CONFIG
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"--run-dir {root} is a file; give a directory.")
    if cfg.overwrite and root.exists():
        if not config.is_file() and any(root.iterdir()):
            raise CheckpointError(
                f"--overwrite: {root} holds files but no {CONFIG}, so it is not a shardkit run directory; "
                "nothing was deleted. Fix: choose another --run-dir."
            )
        for name in (CONFIG, LOG):
            (root / name).unlink(missing_ok=True)
        shutil.rmtree(root / CHECKPOINTS, ignore_errors=True)
    settings = dataclasses.asdict(cfg)
    if config.is_file():
        try:
            stored = json.loads(config.read_text())
        except ValueError as e:
            raise CheckpointError(f"{config} is not valid JSON ({e}); fix it, or start over with --overwrite.") from e
        changed = differences(stored, cfg)
        refused = {k: v for k, v in changed.items() if k not in {a.replace("-", "_") for a in cfg.allow_change}}
        if refused:
            listing = ", ".join(f"--{k.replace('_', '-')} {old} (now {new})" for k, (old, new) in refused.items())
            keys = " ".join(f"--allow-change {k.replace('_', '-')}" for k in refused)
            raise CheckpointError(
                f"Run directory {root} holds a run with {listing}. Fix: resume with the same settings, continue "
                f"under the new ones with {keys}, or start over with --overwrite."
            )
        history = stored.get("changes", [])
        if changed:
            history.append({k: {"was": old, "now": new} for k, (old, new) in changed.items()})
        settings["changes"] = history
    root.mkdir(parents=True, exist_ok=True)
    tmp = config.with_name(CONFIG + ".tmp")
    tmp.write_text(json.dumps(settings, indent=1))
    tmp.replace(config)
    return dataclasses.replace(
        cfg, run_dir=None, overwrite=False, checkpoint_dir=str(root / CHECKPOINTS), json_log=str(root / LOG)
    )
