"""The main job's configuration: every knob of ``shardkit train``, light enough that the command
line can build its flags without starting JAX."""

from __future__ import annotations

import dataclasses
import math

from shardkit.errors import ShardkitError

OPTIMIZER_NAMES = ("adamw", "sgd")
PRECISION_NAMES = ("fp32", "bf16", "bf16-master")


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
    optimizer: str = "adamw"
    dropout: float = 0.0
    seed: int = 0
    data: str | None = None
    json_log: str | None = None
    precision: str = "fp32"
    microbatches: int = 1
    remat: str = "none"
    nonfinite: str = "skip"
    sequence_parallel: bool = False
    schedule: str | None = None  # pipeline schedule with stage > 1 (default 1f1b)
    virtual_stages: int = 1  # interleaved pipeline stages: chunks of layers per device
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    sample_tokens: int = 200
    prompt: str = "def "

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq"):
            if getattr(self, name) < 1:
                raise ShardkitError(f"--{name} must be at least 1, got {getattr(self, name)}.")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ShardkitError(f"--lr must be a finite positive number, got {self.lr}.")
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ShardkitError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_NAMES)}.")
