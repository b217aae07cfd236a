"""What a checkpoint must match before its state is used: the model's and optimizer's array
fingerprints, the run's settings (data and schedule), and the crc32 of its files and checksums of
its arrays. Functions of the directory, the record and the trainer; :mod:`shardkit.training.checkpoint`
calls them on restore."""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Collection, Mapping
from typing import Any

import jax
import numpy as np

from shardkit.core.errors import CheckpointError
from shardkit.core.partition import path_str
from shardkit.training.checksums import array_checksums, file_digests
from shardkit.training.train import Trainer, TrainState

MANIFEST = "shardkit_files.json"


class CheckpointDamaged(CheckpointError):
    """A checkpoint's files or arrays do not match what was written (``.step``, ``.reason``)."""

    def __init__(self, message: str, step: int, reason: str):
        super().__init__(message)
        self.step, self.reason = step, reason


def damaged(directory: pathlib.Path, steps: list[int], step: int, reason: str) -> CheckpointDamaged:
    """The error for a damaged checkpoint ``step``, naming the other ``steps`` to restore instead."""
    others = [s for s in steps if s != step]
    return CheckpointDamaged(
        f"Checkpoint step {step} in {directory} is damaged: {reason}. Restore another step "
        f"(available: {others or 'none'}), or omit the step to restore the newest one that verifies.",
        step,
        reason,
    )


def _shapes(tree: Any) -> dict[str, list[Any]]:
    return {
        path_str(p): [list(leaf.shape), str(np.dtype(leaf.dtype))]
        for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def fingerprint(trainer: Trainer) -> dict[str, list[Any]]:
    """``{parameter path: [shape, dtype]}`` of the trainer's stored parameters."""
    return _shapes(trainer.abstract_state().params)


def state_fingerprint(trainer: Trainer) -> dict[str, list[Any]]:
    """``{path: [shape, dtype]}`` of every array of the train state (optimizer state included)."""
    return _shapes(trainer.abstract_state())


def root_cause(error: BaseException) -> str:
    """What the user can act on: the innermost OS error of a chain, or the OS error code that
    tensorstore reports inside its message (``[os_error_code='28']``), else the error itself."""
    seen, chain = set(), []
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno:
            return f"OSError: [Errno {e.errno}] {os.strerror(e.errno)}"
    for e in chain:
        code = re.search(r"os_error_code='(\d+)'", str(e))
        if code:
            return f"OSError: [Errno {code.group(1)}] {os.strerror(int(code.group(1)))}"
    text = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def verify_files(directory: pathlib.Path, steps: list[int], step: int) -> None:
    """Raise CheckpointDamaged when a file of checkpoint ``step`` is missing or differs from its crc32."""
    folder = directory / str(step)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return  # a save killed after its rename and before its digests: the array checksums still guard it
    try:
        expected = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise damaged(directory, steps, step, f"its file list {MANIFEST} cannot be read ({root_cause(e)})") from e
    actual = file_digests(folder, skip=(MANIFEST,))
    for name, digest in expected.items():
        if name not in actual:
            raise damaged(directory, steps, step, f"file {name} is missing")
        if actual[name] != digest:
            raise damaged(directory, steps, step, f"file {name} has crc32 {actual[name]}, written as {digest}")


def verify_arrays(
    directory: pathlib.Path,
    steps: list[int],
    step: int,
    record: dict[str, Any],
    state: TrainState,
    skip_optimizer: bool,
) -> None:
    """Raise CheckpointDamaged when a restored array differs from the checksum written with it."""
    expected = record.get("checksums")
    if not expected:
        return  # written by a shardkit without checksums
    actual = array_checksums(state)
    for path, digest in actual.items():
        if skip_optimizer and path.startswith("opt_state"):
            continue
        if path in expected and expected[path] != digest:
            reason = f"array {path} does not match its checksum ({digest}, written as {expected[path]})"
            raise damaged(directory, steps, step, reason)


def check_compatible(
    directory: pathlib.Path, trainer: Trainer, record: dict[str, Any], step: int, reset_optimizer: bool
) -> None:
    """Refuse a checkpoint of another model, or of another optimizer unless it is being reset."""
    saved, ours = record.get("params", {}), fingerprint(trainer)
    if saved != ours:
        raise CheckpointError(
            f"Checkpoint step {step} in {directory} was written by another model "
            f"({record.get('model')}, precision {record.get('precision')}) than {trainer.model.name} "
            f"(precision {trainer.precision.name}): " + tree_differences(saved, ours, "parameters") + ". "
            "Restore it with the model configuration it was saved from, or start from a fresh directory."
        )
    saved_state = {k: v for k, v in record.get("state", {}).items() if k.startswith("opt_state")}
    our_state = {k: v for k, v in state_fingerprint(trainer).items() if k.startswith("opt_state")}
    if saved_state and saved_state != our_state and not reset_optimizer:
        optimizer = record.get("run", {}).get("schedule", {}).get("optimizer")
        raise CheckpointError(
            f"Checkpoint step {step} in {directory} holds the state of another optimizer"
            + (f" ({optimizer})" if optimizer else "")
            + ": "
            + tree_differences(saved_state, our_state, "optimizer arrays")
            + ". The checkpoint itself is fine. Fix: resume with the optimizer it was saved with"
            + (f" (--optimizer {optimizer})" if optimizer else "")
            + ", or keep its parameters and start a fresh optimizer state with --reset-optimizer "
            "(API: restore(..., reset_optimizer=True))."
        )


def check_run(
    directory: pathlib.Path,
    record: dict[str, Any],
    step: int,
    run: Mapping[str, Mapping[str, Any]] | None,
    allow_schedule_change: bool,
    allow: Collection[str] = (),
) -> None:
    """Refuse a resume whose data or schedule settings differ from the saved run's, unless allowed."""
    saved = record.get("run") or {}
    if run is None or not saved:
        return
    for group in ("data", "schedule"):
        if group == "schedule" and allow_schedule_change:
            continue
        old, new = saved.get(group, {}), dict(run.get(group, {}))
        allowed = {a.replace("-", "_") for a in allow}
        allowed |= {"data_tokens"} if "data" in allowed else set()  # the source's size goes with it
        changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k not in allowed]
        if not changed:
            continue
        diffs = ", ".join(f"--{k.replace('_', '-')} {old.get(k)} (now {new.get(k)})" for k in changed)
        same = " ".join(f"--{k.replace('_', '-')} {old.get(k)}" for k in changed if old.get(k) is not None)
        if group == "data":
            fix = (
                f"resume with the same settings ({same}), or start a new run in a fresh --checkpoint-dir: "
                "these settings decide which batches the remaining steps read"
            )
        else:
            fix = (
                f"resume with the same settings ({same}), or pass --allow-schedule-change (API: "
                "allow_schedule_change=True) to continue the saved state under the new schedule"
            )
        raise CheckpointError(f"Checkpoint step {step} in {directory} was saved by a run with {diffs}. Fix: {fix}.")


def tree_differences(saved: dict[str, Any], ours: dict[str, Any], what: str) -> str:
    missing = sorted(set(ours) - set(saved))[:3]
    extra = sorted(set(saved) - set(ours))[:3]
    changed = [p for p in sorted(set(ours) & set(saved)) if ours[p] != saved[p]][:3]
    details = []
    if missing:
        details.append(f"{what} not in the checkpoint: {missing}")
    if extra:
        details.append(f"{what} only in the checkpoint: {extra}")
    for p in changed:
        details.append(f"{p}: checkpoint {saved[p][0]} {saved[p][1]}, now {ours[p][0]} {ours[p][1]}")
    return "; ".join(details)
