"""Dry runs: compile a train step for N simulated devices from abstract shapes, allocating nothing.

A 70B-parameter model on 512 devices compiles on a laptop: parameters, optimizer state and
batch are ``jax.ShapeDtypeStruct`` with shardings, so only the compiler's own data structures
use host memory. When the current process already runs JAX with another device count, the dry
run happens in a fresh subprocess (the device count is fixed when JAX starts).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax._src import xla_bridge

from shardkit.analysis.extrapolate import MAX_COMPILED_DEVICES, extrapolate, shrink_plan
from shardkit.analysis.report import Report
from shardkit.core.config import DryRunSettings
from shardkit.core.errors import ClusterError, InputError, LayoutError, ModelError, short_repr
from shardkit.core.flags import to_argv
from shardkit.core.mesh import Layout
from shardkit.models import hf_config, published
from shardkit.models.gpt import GPTConfig
from shardkit.models.hf import read_config
from shardkit.models.model import Model
from shardkit.models.model_source import (
    ModelSource,
    build_model,
    factory_ref,
    importable_name,
    is_factory_ref,
    load_factory,
)
from shardkit.training.train import Trainer


@dataclasses.dataclass(frozen=True)
class DryRunConfig(DryRunSettings):
    """A training configuration to compile without running: the flags of ``shardkit dryrun``
    (:class:`shardkit.core.config.DryRunSettings`), and what they mean once JAX is here."""

    def num_devices(self) -> int:
        layout = Layout.parse(self.layout)
        if any(size == -1 for _, size in layout.sizes):
            if self.devices is None:
                raise LayoutError(
                    f"Layout {self.layout} has a -1 axis: give the device count (--devices N) for a dry run."
                )
            return layout.resolve(self.devices).num_devices
        if self.devices is not None and self.devices != layout.num_devices:
            layout.resolve(self.devices)  # raises with the fix
        return layout.num_devices

    def gpt_config(self) -> GPTConfig:
        """The GPT of a preset (``model``), or of a checkpoint's ``config.json`` (``init_from``)."""
        overrides: dict[str, Any] = {
            "remat": self.remat,
            "scan_layers": self.scan_layers,
            "attention": None if self.attention == "auto" else self.attention,
        }
        if self.max_seq is not None:
            overrides["max_seq"] = self.max_seq
        if self.n_layers is not None:
            overrides["n_layers"] = self.n_layers
        if self.vocab is not None:
            overrides["vocab"] = self.vocab
        if self.init_from:
            return hf_config.gpt_config(hf_config_of(self.init_from), **overrides)
        return GPTConfig.preset(self.model, **overrides)

    def model_label(self) -> str:
        """What the report calls the model: the preset or factory, or ``family:name`` of a config."""
        if not self.init_from:
            return self.model
        directory = published.config_dir(self.init_from)
        return f"{read_config(directory).get('model_type', 'hf')}:{directory.name}"

    def cli_args(self) -> list[str]:
        """The ``shardkit dryrun`` flags of this configuration (for a subprocess)."""
        return to_argv(self)


def hf_config_of(source: str) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory or of a shipped config (``init_from``)."""
    return read_config(published.config_dir(source))


def _factory_trainer(cfg: DryRunConfig, factory: Callable[[], Model] | None) -> tuple[Trainer, dict[str, Any]]:
    """The trainer of a user's model factory: next-token loss on ``(batch, seq + 1)`` tokens."""
    label = cfg.model
    factory = factory or load_factory(label)  # a misnamed factory is the first thing to fix
    if cfg.seq is None:
        raise InputError(f"Model {label} is your own: give the sequence length (--seq N, or seq=N) for a dry run.")
    changed = [
        f
        for f in ("remat", "attention", "max_seq", "scan_layers", "n_layers", "vocab")
        if getattr(cfg, f) != DryRunConfig.__dataclass_fields__[f].default
    ]
    if changed:
        raise ModelError(
            f"{', '.join(changed)} change shardkit's GPT presets only; model {label} is built by its factory. "
            "Fix: drop them, and set remat, the attention or the depth in your factory."
        )
    return _trainer_and_batch(build_model(factory, label), cfg, cfg.seq)


def dry_run_optimizer() -> optax.GradientTransformation:
    """The optimizer a dry run compiles: AdamW, the state a real run holds (the planner reads its
    bytes per parameter from it too)."""
    return optax.adamw(1e-4)


def _trainer_and_batch(model: Model, cfg: DryRunConfig, seq: int) -> tuple[Trainer, dict[str, Any]]:
    """The configuration's trainer for ``model`` (AdamW: the state a real run holds) and its
    abstract ``(batch, seq + 1)`` token batch."""
    trainer = Trainer(
        model,
        dry_run_optimizer(),
        cfg.layout,
        precision=cfg.precision,
        microbatches=cfg.microbatches,
        schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages,
        zero=cfg.zero,
        fsdp_min_size=cfg.fsdp_min_size,
        reduce_gradients=cfg.reduce_gradients,
        sequence_parallel=cfg.sequence_parallel,
    )
    return trainer, {"tokens": jax.ShapeDtypeStruct((cfg.batch, seq + 1), jnp.int32)}


def trainer_for(
    cfg: DryRunConfig, factory: Callable[[], Model] | None = None
) -> tuple[Trainer, dict[str, jax.ShapeDtypeStruct]]:
    """The trainer and the abstract batch of a configuration, on the current devices.

    ``cfg.model`` names a GPT preset or a factory (``package.module:function``); ``factory``,
    when given, is that factory already in hand.
    """
    if cfg.init_from and (factory is not None or is_factory_ref(cfg.model)):
        raise ModelError(
            f"Both a model factory ({cfg.model if factory is None else importable_name(factory)}) and --init-from "
            f"{cfg.init_from}: give one."
        )
    if factory is not None or is_factory_ref(cfg.model):
        return _factory_trainer(cfg, factory)
    gpt = cfg.gpt_config()
    label = cfg.model_label()
    seq = cfg.seq or gpt.max_seq
    if seq > gpt.max_seq:
        raise InputError(f"--seq {seq} exceeds the {label} model's max_seq={gpt.max_seq}; give --max-seq {seq}.")
    return _trainer_and_batch(gpt.model(name=f"GPT-{label}"), cfg, seq)


def _in_process(cfg: DryRunConfig, factory: Callable[[], Model] | None = None) -> dict[str, Any]:
    trainer, batch = trainer_for(cfg, factory)
    report: Report = trainer.report(batch, dry_run=True)
    out = report.to_dict()
    out["model"] = cfg.model_label()
    out["config"] = dataclasses.asdict(cfg)
    out["peak_host_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def can_run_here(n: int) -> bool:
    """Whether this process can compile for ``n`` simulated devices without a subprocess."""
    if not xla_bridge.backends_are_initialized():
        return True
    devices = jax.devices()
    return devices[0].platform == "cpu" and len(devices) == n and jax.process_count() == 1


def dryrun(
    model: ModelSource | DryRunConfig | None = None, cfg: DryRunConfig | None = None, **kwargs: Any
) -> dict[str, Any]:
    """Compile a train step for its device count on simulated CPU devices, allocating nothing.

    Args:
      model: a GPT preset name, your own model factory (a function of no arguments returning a
        :class:`shardkit.Model`), or its name ``"package.module:function"``.
      cfg: the configuration (or pass its fields as keyword arguments: ``layout``, ``batch``,
        ``seq``, ``precision``, ``microbatches``, ...). A factory needs ``seq``.

    Returns:
      The report as a dict (see :meth:`shardkit.analysis.report.Report.to_dict`) plus ``model``,
      ``config`` and ``peak_host_memory_bytes``.

    Example:
      >>> result = dryrun("tiny", layout="fsdp=2,tensor=4", batch=8, seq=64)
      >>> result["devices"]
      8
      >>> mine = dryrun("mymodels:small_lm", layout="fsdp=8", batch=8, seq=128)  # doctest: +SKIP
    """
    if isinstance(model, DryRunConfig):  # dryrun(cfg), as before factories
        model, cfg = None, model
    if isinstance(model, Model):  # a model in hand: this process only (no name to import it by)
        model = (lambda m: lambda: m)(model)
    factory = model if callable(model) else None
    if model is not None and factory is None and not isinstance(model, str):
        raise ModelError(
            f"dryrun(model={short_repr(model)}): give a GPT preset name, a 'package.module:function' factory name, a "
            "function returning a shardkit Model, or a Model."
        )
    if cfg is None:
        name = getattr(factory, "__name__", "model") if factory is not None else model
        cfg = DryRunConfig(**kwargs) if name is None else DryRunConfig(model=str(name), **kwargs)
    n = cfg.num_devices()
    if n > MAX_COMPILED_DEVICES:
        return _extrapolated(cfg, factory)
    if can_run_here(n):
        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", n)
        return _in_process(cfg, factory)
    if factory is not None:  # another process must import it by name
        cfg = dataclasses.replace(cfg, model=factory_ref(factory))
    return _in_subprocess(cfg)


def _extrapolated(cfg: DryRunConfig, factory: Callable[[], Model] | None) -> dict[str, Any]:
    """A layout of more devices than the CPU compiler takes: two compiles with its fsdp or data
    axis (and the global batch with it) halved, in subprocesses side by side, and the fit of
    :mod:`shardkit.analysis.extrapolate`."""
    layout = Layout.parse(cfg.layout)
    if any(size == -1 for _, size in layout.sizes):
        layout = layout.resolve(cfg.num_devices())
    shrink = shrink_plan(layout)
    sizes = dict(layout.sizes)
    split = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1) * cfg.microbatches
    if cfg.batch % split:  # the default rules split the batch's rows over these axes
        raise LayoutError(
            f"--batch {cfg.batch} does not split over layout {layout.spec()}: data x fsdp x expert x microbatches "
            f"= {split}, and every device needs whole rows. Fix: a batch that is a multiple of {split}."
        )
    if factory is not None:
        cfg = dataclasses.replace(cfg, model=factory_ref(factory))
    smaller = [
        dataclasses.replace(cfg, layout=shrink.layout(layout, size), batch=shrink.batch(cfg.batch, size), devices=None)
        for size in shrink.sizes
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        small, large = pool.map(_in_subprocess, smaller)
    result = extrapolate(small, large, shrink, layout)
    result["model"], result["config"] = cfg.model_label(), dataclasses.asdict(cfg)
    return result


def _in_subprocess(cfg: DryRunConfig) -> dict[str, Any]:
    # The child imports what this process can (a model factory from the user's own modules).
    path = os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "shardkit.cli", "dryrun", *cfg.cli_args(), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ClusterError(f"Dry run in a subprocess failed ({' '.join(cmd[2:])}):\n{proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout)


def memory_verdict(per_device: float, hardware: str) -> dict[str, Any]:
    """Whether ``per_device`` bytes fit one device of ``hardware``, and by how much they miss.

    Example:
      >>> memory_verdict(132e9, "h100")["text"].split(":")[0]
      'does NOT fit one h100 (80.0 GB)'
    """
    from shardkit.analysis.hardware import get_hardware

    device = get_hardware(hardware)
    fits = per_device <= device.memory_bytes
    gb, cap = per_device / 1e9, device.memory_bytes / 1e9
    if fits:
        share = 100 * per_device / device.memory_bytes
        text = f"fits one {device.name} ({cap:.1f} GB): {gb:.2f} GB per device, {share:.0f}% of it"
    else:
        text = (
            f"does NOT fit one {device.name} ({cap:.1f} GB): {gb:.1f} GB per device, {gb - cap:.1f} GB over. Try "
            "more fsdp, --remat full, more --microbatches, or --precision bf16-master; "
            "`shardkit plan` searches these for you"
        )
    return {"hardware": device.name, "device_bytes": device.memory_bytes, "fits": fits, "text": text}


def run_cli(cfg: DryRunConfig, as_json: bool, hardware: str = "h100") -> None:
    """``shardkit dryrun``: print the report table and whether it fits ``hardware``, or the JSON."""
    start = time.perf_counter()
    result = dryrun(cfg)
    verdict = memory_verdict(result["memory"]["total"], hardware)
    if as_json:
        print(json.dumps({**result, "fits": verdict}))
        return
    print(Report.from_dict(result).table())
    if "extrapolated" in result:
        print(result["extrapolated"]["text"])
    print(verdict["text"])
    print(f"(dry run took {time.perf_counter() - start:.1f} s)")
