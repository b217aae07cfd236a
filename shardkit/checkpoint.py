"""Checkpoints with orbax-checkpoint: asynchronous, atomic, the last K kept, restored onto any layout.

A checkpoint holds the whole train state (parameters, optimizer state, master weights, step,
random key) and a small JSON record: the data position and a fingerprint of the model (every
parameter's path, shape and dtype). Orbax writes each checkpoint into a temporary directory
and renames it when complete, so a process killed mid-save leaves the previous checkpoints
intact and the partial one invisible. Restoring reads each array straight into the shardings
of the trainer it is given: save under ``fsdp=8``, restore under ``data=2,tensor=4`` or on
another device count.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from shardkit.errors import ShardkitError
from shardkit.partition import path_str
from shardkit.train import Trainer, TrainState

_FORMAT = 1


def fingerprint(trainer: Trainer) -> dict[str, list[Any]]:
    """``{parameter path: [shape, dtype]}`` of the trainer's stored parameters."""
    params = trainer.abstract_state().params
    return {
        path_str(p): [list(leaf.shape), str(np.dtype(leaf.dtype))]
        for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }


class Checkpointer:
    """Save train states every ``every`` steps into ``directory``, keeping the newest ``keep``.

    Saving is asynchronous: :meth:`save` returns once the arrays are copied off the devices and
    writes in the background while training goes on; :meth:`wait` blocks until it is on disk.

    Args:
      directory: where checkpoints live (created if missing); one sub-directory per step.
      every: save when ``step % every == 0`` (0: only when asked with ``force=True``).
      keep: how many complete checkpoints to keep.
      async_save: write in the background.

    Example:
      >>> ckpt = Checkpointer("/tmp/run1", every=100, keep=3)           # doctest: +SKIP
      >>> ckpt.save(state, data_position=step)                          # doctest: +SKIP
      >>> state, record = ckpt.restore(trainer)   # newest, onto trainer's layout  # doctest: +SKIP
    """

    def __init__(self, directory: str | pathlib.Path, *, every: int = 0, keep: int = 3, async_save: bool = True):
        if not isinstance(every, int) or every < 0:
            raise ShardkitError(f"Checkpointer(every={every!r}): give a step interval >= 0 (0: save only when forced).")
        if not isinstance(keep, int) or keep < 1:
            raise ShardkitError(f"Checkpointer(keep={keep!r}): keep at least 1 checkpoint.")
        self.directory = pathlib.Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ShardkitError(f"Checkpoint directory {self.directory} is a file; give a directory path.")
        self.every = every
        self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save)
        self._opened: ocp.CheckpointManager | None = None

    @property
    def _manager(self) -> ocp.CheckpointManager:
        # Opened on first use, and the directory made only by a save: restoring from a mistyped
        # path must fail, not create an empty directory.
        if self._opened is None:
            if not self.directory.is_dir():
                raise ShardkitError(f"Checkpoint directory {self.directory} does not exist; check the path.")
            self._opened = ocp.CheckpointManager(self.directory, options=self._options)
        return self._opened

    # -- saving ---------------------------------------------------------------------------
    def save(self, trainer: Trainer, state: TrainState, *, data_position: int, force: bool = False) -> bool:
        """Start saving ``state`` if its step is due (or ``force``). Returns whether it saves.

        Args:
          trainer: the trainer the state belongs to (its fingerprint is recorded).
          state: the train state after ``state.step`` steps.
          data_position: where the data stream resumes (shardkit's datasets: the step).
          force: save whatever the step.
        """
        step = int(state.step)
        if not force and (self.every == 0 or step % self.every):
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        if step in self._manager.all_steps():
            return False  # already saved (e.g. the final step was also a periodic one)
        record = {
            "format": _FORMAT,
            "step": step,
            "data_position": int(data_position),
            "model": trainer.model.name,
            "layout": trainer.layout.spec(),
            "precision": trainer.precision.name,
            "params": fingerprint(trainer),
        }
        self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
        )
        return True

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        if self._opened is not None:
            self._opened.wait_until_finished()

    def close(self) -> None:
        if self._opened is not None:
            self.wait()
            self._opened.close()

    # -- restoring ------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (partial saves never appear)."""
        if not self.directory.is_dir():
            return []
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def record(self, step: int) -> dict[str, Any]:
        """The JSON record of checkpoint ``step``."""
        self._check_step(step)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
        except Exception as e:  # orbax raises many kinds; all mean the same to the user
            raise ShardkitError(self._unreadable(step, e)) from e

    def restore(self, trainer: Trainer, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """Read checkpoint ``step`` (default: newest) into ``trainer``'s shardings.

        Returns:
          ``(state, record)``; ``record["data_position"]`` says where to resume the data.

        Raises:
          ShardkitError: no checkpoint, unknown step, a checkpoint of another model or
            precision, or unreadable files; always before any array is read.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise ShardkitError(
                    f"No complete checkpoint in {self.directory}. Train with checkpoints first, or point to the "
                    "directory that holds them."
                )
        record = self.record(step)
        self._check_compatible(trainer, record, step)
        target = trainer.abstract_state()
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))[
                "state"
            ]
        except Exception as e:
            raise ShardkitError(self._unreadable(step, e)) from e
        return restored, record

    def _check_step(self, step: int) -> None:
        self._manager  # noqa: B018 -- raises for a missing directory
        steps = self.steps()
        if step not in steps:
            raise ShardkitError(
                f"No complete checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}."
            )

    def _check_compatible(self, trainer: Trainer, record: dict[str, Any], step: int) -> None:
        saved, ours = record.get("params", {}), fingerprint(trainer)
        if saved != ours:
            missing = sorted(set(ours) - set(saved))[:3]
            extra = sorted(set(saved) - set(ours))[:3]
            changed = [p for p in sorted(set(ours) & set(saved)) if ours[p] != saved[p]][:3]
            details = []
            if missing:
                details.append(f"parameters not in the checkpoint: {missing}")
            if extra:
                details.append(f"parameters only in the checkpoint: {extra}")
            for p in changed:
                details.append(f"{p}: checkpoint {saved[p][0]} {saved[p][1]}, model {ours[p][0]} {ours[p][1]}")
            raise ShardkitError(
                f"Checkpoint step {step} in {self.directory} was written by another model "
                f"({record.get('model')}, precision {record.get('precision')}) than {trainer.model.name} "
                f"(precision {trainer.precision.name}): " + "; ".join(details) + ". Restore it with the model "
                "configuration it was saved from, or start from a fresh directory."
            )

    def _unreadable(self, step: int, error: Exception) -> str:
        return (
            f"Checkpoint step {step} in {self.directory} cannot be read ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200]}). The files are damaged or incomplete: delete "
            f"{self.directory / str(step)} and restore an earlier step (available: {self.steps()})."
        )
