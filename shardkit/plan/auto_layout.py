"""``--layout auto``: the planner's fastest plan that fits, for the devices this run has.

``shardkit train --layout auto`` asks :func:`shardkit.plan.plan` the run's own question (its model,
global batch, sequence length and precision, on the devices present) and trains with the best
plan's layout, microbatches, remat policy and ZeRO stage. A resumed run asks again, so a run that
lost a node re-plans for the devices it has left: the global batch stays the checkpoint's (the
run's fingerprint holds it) and the plan makes up for fewer devices with more microbatches.
None of the choices changes the math: layouts, microbatches, remat and ZeRO compute the same
step (to float rounding). A setting the user gave on the command line (``--microbatches 4``,
``--remat full``, ``--zero 2``) is kept, and the planner chooses the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TextIO

import jax
import numpy as np

from shardkit.analysis.hardware import DEFAULT_HARDWARE, profile_of_device
from shardkit.core.config import TrainConfig
from shardkit.core.errors import LayoutError
from shardkit.plan import PlanOptions, PlanResult, plan

AUTO = "auto"
_DEFAULTS = TrainConfig()
# The placement a plan decides; everything else of the run stays as given.
PLACEMENT = ("layout", "microbatches", "remat", "zero", "schedule")


def hardware_of(cfg: TrainConfig) -> str:
    """``--hardware``, else the profile of the devices present (h100 for simulated CPU devices)."""
    if cfg.hardware:
        return cfg.hardware
    profile = profile_of_device(jax.devices()[0].device_kind)
    return profile.name if profile is not None else DEFAULT_HARDWARE


def options_of(cfg: TrainConfig) -> PlanOptions:
    """The search space: the run's precision, and any placement setting the user fixed."""
    fixed: dict[str, Any] = {}
    if cfg.remat != _DEFAULTS.remat:
        fixed["remat"] = (cfg.remat,)
    if cfg.microbatches != _DEFAULTS.microbatches:
        fixed["microbatches"] = (cfg.microbatches,)
    if cfg.zero != _DEFAULTS.zero:
        fixed["zero"] = (cfg.zero,)
    return PlanOptions(precision=cfg.precision, schedule=cfg.schedule, **fixed)


def choose(cfg: TrainConfig, vocab: int | None, out: TextIO) -> TrainConfig:
    """``cfg`` placed by the planner's best plan for ``jax.device_count()`` devices (``vocab``:
    the model's vocabulary when a tokenizer's replaces its own). Says what it chose and why.

    Several processes (``jax.distributed``) plan once, on process 0, and all take its answer.

    Raises:
      LayoutError: no layout of the run fits the devices; the message has the planner's closest.
    """
    devices, hardware = jax.device_count(), hardware_of(cfg)
    flags = ""
    if jax.process_index() == 0:
        result = plan(
            None if cfg.init_from else cfg.model,
            devices,
            hardware,
            cfg.batch,
            cfg.seq,
            options_of(cfg),
            init_from=cfg.init_from,
            vocab=vocab,
        )
        _say(result, out)
        flags = _flags_of(result)
    if jax.process_count() > 1:
        flags = _from_process_zero(flags)
    if not flags:
        raise LayoutError(
            f"--layout auto: no layout of the model fits {devices} {hardware} devices with batch {cfg.batch} x seq "
            f"{cfg.seq} at {cfg.precision}. Fix: more devices, a smaller --batch or --seq, or look at "
            f"`shardkit plan --devices {devices} --hardware {hardware} ...` for the closest."
        )
    layout, microbatches, remat, zero, schedule = flags.split()
    return dataclasses.replace(
        cfg,
        layout=layout,
        microbatches=int(microbatches),
        remat=remat,
        zero=int(zero),
        schedule=None if schedule == "-" else schedule,
    )


def placed(cfg: TrainConfig, chosen: TrainConfig) -> TrainConfig:
    """``cfg`` with the placement of ``chosen`` (after the run directory recorded ``auto``)."""
    return dataclasses.replace(cfg, **{name: getattr(chosen, name) for name in PLACEMENT})


def _flags_of(result: PlanResult) -> str:
    if result.best is None:
        return ""
    best = result.plans[0]
    return f"{best.layout} {best.microbatches} {best.remat} {best.zero} {best.schedule or '-'}"


def _say(result: PlanResult, out: TextIO) -> None:
    if result.best is None:
        return
    best = result.plans[0]
    step = best.predicted_step_seconds or 0.0
    print(
        f"layout auto: {result.devices} devices of {result.hardware}, batch {result.batch} x seq {result.seq}: "
        f"{best.layout}, microbatches {best.microbatches}, remat {best.remat}"
        + (f", ZeRO-{best.zero}" if best.zero else "")
        + f": the fastest that fits of {result.compiled} layouts compiled ({step:.4g} s a step predicted, "
        f"{best.memory_per_device / 1e9:.2f} GB of {result.memory_budget / 1e9:.1f} GB per device); "
        f"{result.searched} layouts searched",
        file=out,
    )


def _from_process_zero(flags: str, width: int = 256) -> str:
    """Process 0's ``flags`` on every process."""
    from jax.experimental import multihost_utils

    raw = np.zeros(width, np.uint8)
    encoded = flags.encode()[:width]
    raw[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(raw))
    return bytes(got[got > 0].astype(np.uint8)).decode()
