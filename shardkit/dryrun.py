"""Dry runs: compile a train step for N simulated devices from abstract shapes, allocating nothing.

A 70B-parameter model on 512 devices compiles on a laptop: parameters, optimizer state and
batch are ``jax.ShapeDtypeStruct`` with shardings, so only the compiler's own data structures
use host memory. When the current process already runs JAX with another device count, the dry
run happens in a fresh subprocess (the device count is fixed when JAX starts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax._src import xla_bridge

from shardkit.errors import ShardkitError
from shardkit.mesh import Layout
from shardkit.models.gpt import GPTConfig
from shardkit.report import Report
from shardkit.train import Trainer


@dataclasses.dataclass(frozen=True)
class DryRunConfig:
    """A training configuration to compile without running: the flags of ``shardkit dryrun``."""

    model: str = "llama2-7b"
    layout: str = "fsdp=8"
    batch: int = 8
    seq: int | None = None  # default: the model's max_seq
    precision: str = "fp32"
    microbatches: int = 1
    schedule: str | None = None  # pipeline schedule with stage > 1 (default 1f1b)
    virtual_stages: int = 1  # interleaved pipeline stages
    remat: str = "none"
    scan_layers: bool = True
    n_layers: int | None = None  # override the preset's depth (compile-time studies)
    devices: int | None = None  # needed only when the layout has a -1

    def num_devices(self) -> int:
        layout = Layout.parse(self.layout)
        if any(size == -1 for _, size in layout.sizes):
            if self.devices is None:
                raise ShardkitError(
                    f"Layout {self.layout} has a -1 axis: give the device count (--devices N) for a dry run."
                )
            return layout.resolve(self.devices).num_devices
        if self.devices is not None and self.devices != layout.num_devices:
            layout.resolve(self.devices)  # raises with the fix
        return layout.num_devices

    def gpt_config(self) -> GPTConfig:
        overrides: dict[str, Any] = {"remat": self.remat, "scan_layers": self.scan_layers}
        if self.n_layers is not None:
            overrides["n_layers"] = self.n_layers
        return GPTConfig.preset(self.model, **overrides)

    def cli_args(self) -> list[str]:
        args = ["--model", self.model, "--layout", self.layout, "--batch", str(self.batch)]
        args += ["--precision", self.precision, "--microbatches", str(self.microbatches), "--remat", self.remat]
        if self.seq is not None:
            args += ["--seq", str(self.seq)]
        if self.schedule is not None:
            args += ["--schedule", self.schedule]
        if self.virtual_stages != 1:
            args += ["--virtual-stages", str(self.virtual_stages)]
        if not self.scan_layers:
            args += ["--unrolled"]
        if self.n_layers is not None:
            args += ["--layers", str(self.n_layers)]
        if self.devices is not None:
            args += ["--devices", str(self.devices)]
        return args


def trainer_for(cfg: DryRunConfig) -> tuple[Trainer, dict[str, jax.ShapeDtypeStruct]]:
    """The trainer and the abstract batch of a configuration, on the current devices."""
    gpt = cfg.gpt_config()
    seq = cfg.seq or gpt.max_seq
    if seq > gpt.max_seq:
        raise ShardkitError(f"--seq {seq} exceeds the {cfg.model} model's max_seq={gpt.max_seq}.")
    trainer = Trainer(
        gpt.model(name=f"GPT-{cfg.model}"),
        optax.adamw(1e-4),
        cfg.layout,
        precision=cfg.precision,
        microbatches=cfg.microbatches,
        schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages,
    )
    return trainer, {"tokens": jax.ShapeDtypeStruct((cfg.batch, seq + 1), jnp.int32)}


def _in_process(cfg: DryRunConfig) -> dict[str, Any]:
    trainer, batch = trainer_for(cfg)
    report: Report = trainer.report(batch)
    out = report.to_dict()
    out["model"] = cfg.model
    out["config"] = dataclasses.asdict(cfg)
    out["peak_host_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def can_run_here(n: int) -> bool:
    """Whether this process can compile for ``n`` simulated devices without a subprocess."""
    if not xla_bridge.backends_are_initialized():
        return True
    devices = jax.devices()
    return devices[0].platform == "cpu" and len(devices) == n


def dryrun(cfg: DryRunConfig | None = None, **kwargs: Any) -> dict[str, Any]:
    """Compile ``cfg``'s train step for its device count on simulated CPU devices.

    Args:
      cfg: the configuration (or pass its fields as keyword arguments).

    Returns:
      The report as a dict (see :meth:`shardkit.report.Report.to_dict`) plus ``model``,
      ``config`` and ``peak_host_memory_bytes``.

    Example:
      >>> result = dryrun(model="tiny", layout="fsdp=2,tensor=4", batch=8, seq=64)
      >>> result["devices"]
      8
    """
    cfg = cfg if cfg is not None else DryRunConfig(**kwargs)
    n = cfg.num_devices()
    if can_run_here(n):
        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", n)
        return _in_process(cfg)
    return _in_subprocess(cfg)


def _in_subprocess(cfg: DryRunConfig) -> dict[str, Any]:
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "shardkit.cli", "dryrun", *cfg.cli_args(), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ShardkitError(f"Dry run in a subprocess failed ({' '.join(cmd[2:])}):\n{proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout)


def run_cli(cfg: DryRunConfig, as_json: bool) -> None:
    """``shardkit dryrun``: print the report table, or its JSON."""
    start = time.perf_counter()
    result = dryrun(cfg)
    if as_json:
        print(json.dumps(result))
        return
    print(Report.from_dict(result).table())
    print(f"(dry run took {time.perf_counter() - start:.1f} s)")
