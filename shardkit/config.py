"""The main job's configuration: every knob of ``shardkit train``, light enough that the command
line can build its flags without starting JAX."""

from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib

from shardkit.errors import ShardkitError

OPTIMIZER_NAMES = ("adamw", "sgd")
PRECISION_NAMES = ("fp32", "bf16", "bf16-master")
NONFINITE_NAMES = ("skip", "halt")
LR_SCHEDULES = ("cosine", "constant")
# Settings that change what a resumed run computes; a run directory refuses a change to any of
# them unless --allow-change names it. The layout is not one: a run resumes onto any layout.
RESUMABLE_SETTINGS = frozenset(
    {
        "model",
        "steps",
        "batch",
        "seq",
        "lr",
        "warmup",
        "weight_decay",
        "lr_schedule",
        "clip",
        "b2",
        "optimizer",
        "dropout",
        "seed",
        "data",
        "precision",
        "microbatches",
        "remat",
        "sequence_parallel",
    }
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every knob of the main job (the CLI flags of ``shardkit train``)."""

    model: str = "mini"
    layout: str = "data=2,fsdp=2,tensor=2"
    steps: int = 500
    batch: int = 16
    seq: int = 128
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    lr_schedule: str = "cosine"  # warmup, then cosine decay to lr/10 at the last step; or constant
    clip: float = 1.0  # gradient clipping by global norm (0: off)
    b2: float = 0.95  # AdamW's second-moment decay
    optimizer: str = "adamw"
    dropout: float = 0.0
    seed: int = 0
    data: str | None = None
    json_log: str | None = None
    precision: str = "fp32"
    microbatches: int = 1
    remat: str = "none"
    nonfinite: str = "skip"
    max_skips: int = 10  # skipped steps in a row that stop the run (0: never)
    sequence_parallel: bool = False
    schedule: str | None = None  # pipeline schedule with stage > 1 (default 1f1b)
    virtual_stages: int = 1  # interleaved pipeline stages: chunks of layers per device
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    reset_optimizer: bool = False  # resume the parameters with a fresh optimizer state
    allow_schedule_change: bool = False  # resume under another lr, warmup, steps or weight decay
    sample_tokens: int = 200
    prompt: str = "def "
    run_dir: str | None = None  # one directory per run: config.json, checkpoints/, log.jsonl
    allow_change: tuple[str, ...] = ()  # settings a resumed run may change (names of flags)
    overwrite: bool = False  # start the run in run_dir over

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow_change", tuple(self.allow_change or ()))  # argparse gives a list
        for name in ("steps", "batch", "seq"):
            if getattr(self, name) < 1:
                raise ShardkitError(f"--{name} must be at least 1, got {getattr(self, name)}.")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ShardkitError(f"--lr must be a finite positive number, got {self.lr}.")
        if self.seed < 0:
            raise ShardkitError(f"--seed must be >= 0, got {self.seed}.")
        if self.max_skips < 0:
            raise ShardkitError(f"--max-skips must be >= 0 (0: never stop on skipped steps), got {self.max_skips}.")
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ShardkitError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_NAMES)}.")
        if self.precision not in PRECISION_NAMES:
            raise ShardkitError(f"--precision {self.precision!r} is not one of {', '.join(PRECISION_NAMES)}.")
        if self.nonfinite not in NONFINITE_NAMES:
            raise ShardkitError(f"--nonfinite {self.nonfinite!r} is not one of {', '.join(NONFINITE_NAMES)}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ShardkitError(f"--dropout must be in [0, 1), got {self.dropout}.")
        if self.warmup < 0:
            raise ShardkitError(f"--warmup must be >= 0 steps, got {self.warmup}.")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ShardkitError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}.")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ShardkitError(f"--lr-schedule {self.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}.")
        if not math.isfinite(self.clip) or self.clip < 0:
            raise ShardkitError(f"--clip must be a finite number >= 0 (0: no clipping), got {self.clip}.")
        if not 0.0 < self.b2 < 1.0:
            raise ShardkitError(f"--b2 must be in (0, 1), e.g. 0.95 or 0.999, got {self.b2}.")
        for name, least in (("microbatches", 1), ("virtual_stages", 1), ("keep_checkpoints", 1)):
            if getattr(self, name) < least:
                flag = "--" + name.replace("_", "-")
                raise ShardkitError(f"{flag} must be at least {least}, got {getattr(self, name)}.")
        for name in ("checkpoint_every", "sample_tokens"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ShardkitError(f"{flag} must be >= 0, got {getattr(self, name)}.")
        if self.json_log is not None:
            log = pathlib.Path(self.json_log)
            if log.is_dir():
                raise ShardkitError(f"--json-log {self.json_log} is a directory; give a file path inside it.")
            if not log.absolute().parent.is_dir():
                raise ShardkitError(
                    f"--json-log {self.json_log}: directory {log.absolute().parent} does not exist. Fix: create it "
                    "first, or log elsewhere."
                )
        for key in self.allow_change:
            if key.replace("-", "_") not in RESUMABLE_SETTINGS:
                close = difflib.get_close_matches(key.replace("-", "_"), sorted(RESUMABLE_SETTINGS), n=1)
                raise ShardkitError(
                    f"--allow-change {key}: not a setting a resume compares"
                    + (f"; did you mean {close[0].replace('_', '-')}?" if close else "")
                    + f" Settings: {', '.join(sorted(k.replace('_', '-') for k in RESUMABLE_SETTINGS))}."
                )
        if (self.allow_change or self.overwrite) and not (self.run_dir or self.checkpoint_dir):
            raise ShardkitError("--allow-change and --overwrite apply to a --run-dir.")
        if self.run_dir and (self.checkpoint_dir or self.json_log):
            raise ShardkitError(
                "--run-dir holds the run's checkpoints and log itself; drop --checkpoint-dir and --json-log."
            )
        if (self.reset_optimizer or self.allow_schedule_change) and not (self.checkpoint_dir or self.run_dir):
            raise ShardkitError(
                "--reset-optimizer and --allow-schedule-change apply to a resume: add --checkpoint-dir."
            )
