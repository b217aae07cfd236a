"""Compiled dry runs on disk, so that asking the planner again costs seconds, not compiles."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import jax

from shardkit.plan.dryrun import DryRunConfig

# Bumped when the figures a dry run reports change meaning (e.g. bf16 collectives counted at the
# partitioner's dtype, sequence-parallel reduce-scatters named as such) or the compiled step
# changes for the same settings (3: the in-place non-finite guard and the CPU step options; 4:
# mixtures of experts dispatched sorted by default), so older entries miss.
COUNTING = 4


class DryRunCache:
    """Dry-run results on disk, keyed by everything that changes the compiled program."""

    def __init__(self, directory: str | pathlib.Path | None):
        root = directory or os.environ.get("SHARDKIT_CACHE") or pathlib.Path.home() / ".cache" / "shardkit"
        self.path = pathlib.Path(root) / "dryruns.json"
        try:
            self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, json.JSONDecodeError):
            self.data = {}  # a damaged cache is only a slower plan

    @staticmethod
    def key(cfg: DryRunConfig, fingerprint: str = "") -> str:
        """Everything that changes the compiled program; ``fingerprint`` stands for a factory's
        model (its parameters' shapes, dtypes and names), whose code the name alone does not pin."""
        raw = json.dumps([dataclasses.asdict(cfg), jax.__version__, fingerprint, COUNTING], sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()[:24]

    def get(self, cfg: DryRunConfig, fingerprint: str = "") -> dict[str, Any] | None:
        return self.data.get(self.key(cfg, fingerprint))

    def put(self, cfg: DryRunConfig, result: dict[str, Any], fingerprint: str = "") -> None:
        keep = {
            k: result[k]
            for k in (
                "layout",
                "devices",
                "memory",
                "flops_per_device",
                "bytes_by_axes",
                "model_flops_per_step",
                "compile_seconds",
            )
        }
        if "extrapolated" in result:  # past the compiler's device limit: the table says so
            keep["extrapolated"] = result["extrapolated"]
        self.data[self.key(cfg, fingerprint)] = keep
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)  # atomic: a killed plan never leaves a half-written cache
