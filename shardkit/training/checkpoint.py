"""Checkpoints with orbax-checkpoint: asynchronous, atomic, verified, restored onto any layout.

A checkpoint holds the whole train state (parameters, optimizer state, master weights, step,
random key) and a JSON record:

- the data position (where the data stream resumes);
- fingerprints: every state array's path, shape and dtype, and the run's settings that a
  resume must keep (seed, data, batch shape; schedule and total steps), so a mismatch is named;
- a layout-independent checksum per array (:mod:`shardkit.training.checksums`), verified on restore.

Once a save is complete on disk, a crc32 of each of its files is added next to it. Orbax writes
each checkpoint into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoints intact and the partial one invisible.

Restoring reads each array straight into the shardings of the trainer it is given (save under
``fsdp=8``, restore under ``data=2,tensor=4`` or on another device count) and checks it. With no
step named, the newest checkpoint that verifies is restored and each newer one that does not is
named in a warning: a damaged checkpoint never stops a resume while a good one exists, and no
message advises deleting a checkpoint that verifies.

Before the first save the directory is checked (writable, room for a checkpoint) and locked
(:mod:`shardkit.runtime.dirlock`), so a bad directory fails before any step is computed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import sys
import time
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from shardkit.core.errors import CheckpointError
from shardkit.core.state import update_target
from shardkit.runtime.dirlock import DirectoryLock
from shardkit.training.checkpoint_checks import (
    MANIFEST,
    CheckpointDamaged,
    check_compatible,
    check_run,
    damaged,
    fingerprint,
    root_cause,
    state_fingerprint,
    verify_arrays,
    verify_files,
)
from shardkit.training.checksums import array_checksums, file_digests
from shardkit.training.orbax_logs import TMP_MARK, quiet_closed_loops
from shardkit.training.train import Trainer, TrainState

_FORMAT = 2
_ROOM_FACTOR = 1.2  # a save needs the state's bytes, plus metadata and some slack


class CheckpointWarning(UserWarning):
    """A checkpoint restored past newer ones that failed to verify (also in ``Checkpointer.warnings``,
    which ``shardkit train`` prints once, as ``warning: ...``)."""


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
      >>> ckpt.prepare(trainer)  # writable, room, lock: before step 1  # doctest: +SKIP
      >>> ckpt.save(trainer, state, data_position=step)                 # doctest: +SKIP
      >>> state, record = ckpt.restore(trainer)   # newest verified, onto trainer's layout  # doctest: +SKIP
    """

    def __init__(self, directory: str | pathlib.Path, *, every: int = 0, keep: int = 3, async_save: bool = True):
        if not isinstance(every, int) or every < 0:
            raise CheckpointError(
                f"Checkpointer(every={every!r}): give a step interval >= 0 (0: save only when forced)."
            )
        if not isinstance(keep, int) or keep < 1:
            raise CheckpointError(f"Checkpointer(keep={keep!r}): keep at least 1 checkpoint.")
        self.directory = pathlib.Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"Checkpoint directory {self.directory} is a file; give a directory path.")
        self.every = every
        self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save)
        self._opened: ocp.CheckpointManager | None = None
        self._lock = DirectoryLock(self.directory)
        self._prepared = False
        self._unlisted: list[int] = []  # saved steps whose file digests are not yet written
        self.warnings: list[str] = []  # what the last restore skipped, and why

    @property
    def _manager(self) -> ocp.CheckpointManager:
        # Opened on first use, and the directory made only by a save: restoring from a mistyped
        # path must fail, not create an empty directory.
        if self._opened is None:
            if not self.directory.is_dir():
                raise CheckpointError(f"Checkpoint directory {self.directory} does not exist; check the path.")
            self._opened = ocp.CheckpointManager(self.directory, options=self._options)
        return self._opened

    # -- before the first step ----------------------------------------------------------------
    def prepare(self, trainer: Trainer) -> None:
        """Check that the directory can take a checkpoint of ``trainer``'s state and lock it.

        Creates the directory, writes and removes a probe file, checks the free space against
        the state's bytes (x1.2), takes the lock (process 0), and removes temporary directories
        that an earlier, killed save left behind. :meth:`save` calls it once if you do not.

        Raises:
          ShardkitError: not writable, not enough room, or in use by another run.
        """
        if self._prepared:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".shardkit-probe-{os.getpid()}"
            probe.write_bytes(b"shardkit")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(
                f"Checkpoint directory {self.directory} is not writable ({root_cause(e)}). "
                "Fix: choose a writable --checkpoint-dir, or fix its permissions or mount."
            ) from e
        need = _ROOM_FACTOR * sum(
            np.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(trainer.abstract_state())
        )
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise CheckpointError(
                f"Checkpoint directory {self.directory} has {free / 2**20:,.1f} MiB free; a checkpoint of this "
                f"state needs about {need / 2**20:,.1f} MiB. Fix: free space, or choose another --checkpoint-dir."
            )
        if not getattr(sys.unraisablehook, "shardkit_quiet", False):
            sys.unraisablehook = quiet_closed_loops(sys.unraisablehook)
        if jax.process_index() == 0:
            self._lock.acquire()
            for leftover in self.directory.glob(f"*{TMP_MARK}*"):  # we hold the lock: nobody is writing it
                shutil.rmtree(leftover, ignore_errors=True)
        self._prepared = True

    # -- saving ---------------------------------------------------------------------------
    def save(
        self,
        trainer: Trainer,
        state: TrainState,
        *,
        data_position: int,
        run: Mapping[str, Mapping[str, Any]] | None = None,
        force: bool = False,
    ) -> bool:
        """Start saving ``state`` if its step is due (or ``force``). Returns whether it saves.

        Args:
          trainer: the trainer the state belongs to (its fingerprints are recorded).
          state: the train state after ``state.step`` steps.
          data_position: where the data stream resumes (shardkit's datasets: the step).
          run: the run's settings that a resume must keep, in two groups:
            ``{"data": {"seed": 0, "batch": 16, ...}, "schedule": {"lr": 3e-3, "steps": 500, ...}}``
            (keys are the names of the flags that set them).
          force: save whatever the step.

        Raises:
          ShardkitError: an earlier background save failed, or this one could not start; the
            message names the cause (e.g. no space left), and the earlier checkpoints are intact.
        """
        step = int(state.step)
        if not force and (self.every == 0 or step % self.every):
            return False
        self.prepare(trainer)
        self._finish_saves()
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
            "state": state_fingerprint(trainer),
            "run": {k: dict(v) for k, v in (run or {}).items()},
            "checksums": array_checksums(state),
        }
        try:
            self._manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
            )
        except Exception as e:  # orbax raises many kinds; the cause is what matters
            self._failed(step, e)
        self._unlisted.append(step)
        return True

    def _finish_saves(self) -> None:
        """Wait for the background save, surface its failure, then list the files of finished saves."""
        if self._opened is None:
            return
        try:
            self._opened.wait_until_finished()
        except Exception as e:
            self._failed(self._unlisted[-1] if self._unlisted else -1, e)
        if jax.process_index() == 0:
            for step in self._unlisted:
                folder = self.directory / str(step)
                if folder.is_dir():
                    tmp = folder / (MANIFEST + ".tmp")
                    tmp.write_text(json.dumps(file_digests(folder, skip=(MANIFEST, tmp.name))))
                    tmp.replace(folder / MANIFEST)  # atomic: a manifest is whole or absent
        self._unlisted = []

    def _failed(self, step: int, error: BaseException) -> None:
        self._unlisted = [s for s in self._unlisted if s != step]
        # Orbax's other writer threads may still be finishing (and creating files) after the first
        # error surfaced: close the manager so they are joined before the partial save is removed.
        if self._opened is not None:
            with contextlib.suppress(Exception):
                self._opened.wait_until_finished()
            with contextlib.suppress(Exception):
                self._opened.close()
            self._opened = None  # opened again on next use
        deadline, quiet = time.monotonic() + 5.0, 0
        while quiet < 3 and time.monotonic() < deadline:  # empty three looks in a row: no late writer
            leftovers = list(self.directory.glob(f"*{TMP_MARK}*"))
            for leftover in leftovers:
                shutil.rmtree(leftover, ignore_errors=True)
            quiet = 0 if leftovers else quiet + 1
            time.sleep(0.05)
        raise CheckpointError(
            f"Saving checkpoint step {step} in {self.directory} failed ({root_cause(error)}). The partial "
            f"save was removed; earlier checkpoints are intact (steps {self.steps()}). Fix: free space or "
            "make the directory writable, or choose another --checkpoint-dir; then resume."
        ) from error

    def wait(self) -> None:
        """Block until every started save is complete on disk (raises if one failed)."""
        self._finish_saves()

    def close(self) -> None:
        """Finish the saves and release the directory's lock."""
        try:
            self._finish_saves()
        finally:
            if self._opened is not None:
                with contextlib.suppress(Exception):
                    self._opened.close()
                self._opened = None
            self._lock.release()
            self._prepared = False

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
            raise damaged(self.directory, self.steps(), step, f"its record cannot be read ({root_cause(e)})") from e

    def restore(
        self,
        trainer: Trainer,
        step: int | None = None,
        *,
        run: Mapping[str, Mapping[str, Any]] | None = None,
        reset_optimizer: bool = False,
        allow_schedule_change: bool = False,
        allow: Collection[str] = (),
    ) -> tuple[TrainState, dict[str, Any]]:
        """Read checkpoint ``step`` (default: the newest that verifies) into ``trainer``'s shardings.

        Args:
          trainer: the layout, precision and optimizer to restore into.
          step: a step to restore; None: the newest verified one, skipping damaged newer ones with
            a warning (also kept in :attr:`warnings`).
          run: this run's settings (as given to :meth:`save`), compared with the checkpoint's.
          reset_optimizer: restore parameters, step and key only, with a fresh optimizer state
            (to resume with another optimizer).
          allow_schedule_change: accept different ``run["schedule"]`` settings (lr, steps, ...).
          allow: names of settings (either group) that may differ, e.g. ``{"batch"}``.

        Returns:
          ``(state, record)``; ``record["data_position"]`` says where to resume the data.

        Raises:
          ShardkitError: no checkpoint, unknown step, a checkpoint of another model, optimizer,
            precision or run settings (naming each difference and the flag that resolves it),
            or no checkpoint that verifies.
          CheckpointDamaged: the named ``step`` is damaged (its files or arrays fail their checks).
        """
        self.warnings = []
        if not self.directory.is_dir():
            raise CheckpointError(f"Checkpoint directory {self.directory} does not exist; check the path.")
        if step is not None:
            self._check_step(step)
            return self._restore_step(trainer, step, run, reset_optimizer, allow_schedule_change, allow)
        steps = self.steps()
        if not steps:
            raise CheckpointError(
                f"No complete checkpoint in {self.directory}. Train with checkpoints first, or point to the "
                "directory that holds them."
            )
        skipped: list[str] = []
        for candidate in reversed(steps):
            try:
                restored = self._restore_step(trainer, candidate, run, reset_optimizer, allow_schedule_change, allow)
            except CheckpointDamaged as e:
                skipped.append(f"step {e.step}: {e.reason}")
                continue
            if skipped:
                self.warnings = [
                    f"Restored checkpoint step {candidate} from {self.directory}, the newest that verifies; "
                    f"skipped {'; '.join(skipped)}."
                ]
                warnings.warn(self.warnings[0], CheckpointWarning, stacklevel=2)
            return restored
        raise CheckpointError(
            f"No checkpoint in {self.directory} verifies: {'; '.join(skipped)}. The run cannot resume from "
            "these files; start from a fresh --checkpoint-dir (keep these for inspection)."
        )

    def _restore_step(
        self,
        trainer: Trainer,
        step: int,
        run: Mapping[str, Mapping[str, Any]] | None,
        reset_optimizer: bool,
        allow_schedule_change: bool,
        allow: Collection[str],
    ) -> tuple[TrainState, dict[str, Any]]:
        verify_files(self.directory, self.steps(), step)
        record = self.record(step)
        check_compatible(self.directory, trainer, record, step, reset_optimizer)
        check_run(self.directory, record, step, run, allow_schedule_change, allow)
        target = trainer.abstract_state()
        try:
            if reset_optimizer:
                state = self._restore_without_optimizer(trainer, step, target)
            else:
                args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
                state = self._manager.restore(step, args=args)["state"]
        except Exception as e:
            raise damaged(self.directory, self.steps(), step, f"its arrays cannot be read ({root_cause(e)})") from e
        verify_arrays(self.directory, self.steps(), step, record, state, skip_optimizer=reset_optimizer)
        return state, record

    def _restore_without_optimizer(self, trainer: Trainer, step: int, target: TrainState) -> TrainState:
        part = {"step": target.step, "params": target.params, "rng": target.rng}
        if target.master is not None:
            part["master"] = target.master
        if target.model_state is not None:  # running statistics belong to the model, not the optimizer
            part["model_state"] = target.model_state
        restored = ocp.PyTreeCheckpointer().restore(
            self.directory / str(step) / "state",
            args=ocp.args.PyTreeRestore(
                item=part, restore_args=ocp.checkpoint_utils.construct_restore_args(part), partial_restore=True
            ),
        )
        master = restored.get("master")
        fresh = jax.jit(trainer.optimizer.init, out_shardings=trainer.state_shardings.opt_state)
        return TrainState(
            step=restored["step"],
            params=restored["params"],
            opt_state=fresh(update_target(restored["params"], master)),
            rng=restored["rng"],
            master=master,
            model_state=restored.get("model_state"),
        )

    def _check_step(self, step: int) -> None:
        self._manager  # noqa: B018 -- raises for a missing directory
        steps = self.steps()
        if step not in steps:
            raise CheckpointError(
                f"No complete checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}."
            )
