"""Module paths from before the package had folders, still importable.

Until the modules moved into ``core/``, ``training/``, ``analysis/`` and the others, users wrote
``from shardkit.report import sharding_warnings`` or ``import shardkit.checkpoint``. Those paths
keep working: a finder on ``sys.meta_path`` answers each old name with the module that now
holds the code, so both names are one module object (its classes compare equal, its globals
are shared). New code should import the new path, which :data:`MOVED` gives.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

# Old module below ``shardkit.`` -> where it lives now (below ``shardkit.``).
MOVED: dict[str, str] = {
    "accumulation": "training.accumulation",
    "auto_layout": "plan.auto_layout",
    "boundaries": "models.boundaries",
    "checkpoint": "training.checkpoint",
    "checkpoint_checks": "training.checkpoint_checks",
    "checksums": "training.checksums",
    "config": "core.config",
    "data": "io.data",
    "devices": "runtime.devices",
    "dirlock": "runtime.dirlock",
    "distributed": "runtime.distributed",
    "dropout": "models.dropout",
    "dryrun": "plan.dryrun",
    "error_sites": "cli.error_sites",
    "errors": "core.errors",
    "estimate": "analysis.estimate",
    "extrapolate": "analysis.extrapolate",
    "flags": "core.flags",
    "generate": "models.generate",
    "hardware": "analysis.hardware",
    "hlo": "analysis.hlo",
    "hlo_uses": "analysis.hlo_uses",
    "host_allocator": "runtime.host_allocator",
    "inputs": "core.inputs",
    "launch": "runtime.launch",
    "losses": "training.losses",
    "mesh": "core.mesh",
    "model": "models.model",
    "model_source": "models.model_source",
    "orbax_logs": "training.orbax_logs",
    "packed": "io.packed",
    "partition": "core.partition",
    "partitioned": "analysis.partitioned",
    "precision": "core.precision",
    "pretrained": "training.pretrained",
    "progress": "cli.progress",
    "report": "analysis.report",
    "report_data": "analysis.report_data",
    "rules": "core.rules",
    "run": "cli.run",
    "run_dir": "cli.run_dir",
    "run_inputs": "cli.run_inputs",
    "run_log": "cli.run_log",
    "saved_run": "cli.saved_run",
    "sharding": "core.sharding",
    "state": "core.state",
    "steps": "training.steps",
    "stopping": "runtime.stopping",
    "tensorboard": "io.tensorboard",
    "tokenizer": "io.tokenizer",
    "train": "training.train",
    "xla_flags": "runtime.xla_flags",
    "plan_worker": "plan.workers",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new path (imported once, shared by both names)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the new path's import ran the module's code."""


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds ``shardkit.<old>`` for every old name in :data:`MOVED`; any other name is left to
    the regular finders (an unknown module still raises ``ModuleNotFoundError``)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != "shardkit" or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(f"shardkit.{MOVED[old]}"))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (behind the regular finders: a module that
    exists at a path always wins)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
