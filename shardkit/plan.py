"""Plan: choose a layout from what the compiler produces and a model of the hardware.

For a model, a global batch and a sequence length on N devices, the planner enumerates the
factorisations of N over ``data x fsdp x tensor x sequence x stage`` (tensor and sequence only
inside a node and only where heads and sequence divide; stages only where the layers divide),
and for each tries remat policies and microbatch counts until one fits: every candidate is a dry
run (compiled for N simulated devices, cached on disk). The step time is predicted from the
compiled matmul FLOPs at the device's peak and from the bytes each mesh axis moves at the
bandwidth of the link that axis crosses (NVLink/ICI inside a node, InfiniBand/DCN between
nodes), with and without overlap of compute and communication. A pipeline's bubble needs no
formula here: the lock-step pipeline computes its idle slots, so they are in the compiled FLOPs.

For a mixture-of-experts model (``tiny-moe``, ``mixtral-8x7b``) the ``expert`` axis joins the
search (sizes that divide the experts; it splits the batch too), without ``sequence`` or ``stage``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
from jax._src import xla_bridge

from shardkit.dryrun import DryRunConfig, can_run_here
from shardkit.errors import ShardkitError
from shardkit.hardware import PROFILES, Hardware, get_hardware
from shardkit.mesh import Layout
from shardkit.model import Model, model_facts
from shardkit.model_source import (
    ModelSource,
    build_model,
    factory_ref,
    importable_name,
    is_factory_ref,
    load_factory,
)
from shardkit.models.gpt import GPTConfig
from shardkit.partition import Axes, specs_for
from shardkit.precision import as_precision
from shardkit.rules import default_rules

STATE_BYTES_PER_PARAM = {"fp32": 12, "bf16": 12, "bf16-master": 14}


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The search space. ``tensor=None``: powers of two up to the node size that divide the heads;
    ``sequence=None``: 1, 2, 4, 8 where they divide the sequence and fit in a node with tensor;
    ``stage=None``: 1, 2, 4, 8 where they divide the layers. Pipelines try microbatches most
    first (the 1F1B bubble shrinks with more and its memory does not grow); others fewest first."""

    precision: str = "bf16-master"
    tensor: tuple[int, ...] | None = None
    sequence: tuple[int, ...] | None = None
    stage: tuple[int, ...] | None = None
    expert: tuple[int, ...] | None = None  # None: sizes that divide a mixture's experts
    schedule: str = "1f1b"
    remat: tuple[str, ...] = ("none", "full")
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16)
    headroom: float = 0.9  # fraction of device memory a plan may use


@dataclasses.dataclass
class Plan:
    """One candidate: a layout with the remat and microbatches that first fit, and its predictions."""

    layout: str
    microbatches: int
    remat: str
    fits: bool
    memory_per_device: float
    bytes_by_axes: dict[str, float]
    # Predictions: None for a plan that was not compiled.
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    predicted_step_seconds: float | None = None  # compute then communication, no overlap
    predicted_step_seconds_overlap: float | None = None  # perfect overlap: the larger of the two
    predicted_mfu: float | None = None
    note: str = ""
    schedule: str | None = None

    def cli_flags(self) -> str:
        flags = f"--layout {self.layout} --microbatches {self.microbatches} --remat {self.remat}"
        return flags + (f" --schedule {self.schedule}" if self.schedule else "")


def axis_links(layout_shape: dict[str, int], hw: Hardware) -> dict[str, str]:
    """``"intra"`` or ``"inter"`` for each mesh axis: does stepping along it leave the node?

    Devices are numbered node by node and the mesh is laid out in canonical axis order, so an
    axis stays inside a node when its stride times its size fits in (and divides) a node.
    """
    links, stride = {}, 1
    for axis in reversed([a for a in layout_shape]):
        size = layout_shape[axis]
        span = stride * size
        inside = span <= hw.devices_per_node and hw.devices_per_node % span == 0
        links[axis] = "intra" if inside or size == 1 else "inter"
        stride = span
    return links


def estimate(result: dict[str, Any], hw: Hardware, compute_dtype: str) -> dict[str, float]:
    """Predicted seconds of one step from a dry run's report dict on hardware ``hw``.

    Args:
      result: :meth:`shardkit.report.Report.to_dict` output (a dry run).
      hw: the hardware profile.
      compute_dtype: dtype of the matmuls (``bfloat16`` or ``float32``).

    Returns:
      ``compute_seconds``, ``comm_seconds``, ``step_seconds`` (no overlap), ``step_seconds_overlap``,
      ``mfu`` (model FLOPs over the whole machine's peak in the no-overlap step time).
    """
    links = axis_links(dict(Layout.parse(result["layout"]).sizes), hw)
    peak = hw.peak_flops(compute_dtype)
    compute = result["flops_per_device"] / peak
    comm = 0.0
    for axes, moved in result["bytes_by_axes"].items():
        if axes == "-" or not moved:
            continue
        slowest = "inter" if any(links.get(a, "intra") == "inter" for a in axes.split("+")) else "intra"
        comm += moved / (hw.inter_node_bandwidth if slowest == "inter" else hw.intra_node_bandwidth)
    step = compute + comm
    model_flops = result.get("model_flops_per_step") or result["flops_per_device"] * result["devices"]
    return {
        "compute_seconds": compute,
        "comm_seconds": comm,
        "step_seconds": step,
        "step_seconds_overlap": max(compute, comm),
        "mfu": model_flops / (result["devices"] * peak * step),
    }


@dataclasses.dataclass(frozen=True, eq=False)
class ModelFacts:
    """What the planner needs of a model: its size and which splits its parameters allow.

    Built from a GPT preset (:meth:`of_preset`) or from any :class:`shardkit.Model`
    (:meth:`of_model`), whose parameters' own names and shapes decide what divides.
    """

    name: str
    params: int
    n_layers: int
    n_experts: int = 0
    can_pipeline: bool = False
    gpt: GPTConfig | None = None
    model: Model | None = None
    fingerprint: str = ""
    abstract_params: Any = None  # the model's parameter shapes, evaluated once

    @classmethod
    def of_preset(cls, name: str) -> ModelFacts:
        return cls.of_gpt(GPTConfig.preset(name), name)

    @classmethod
    def of_gpt(cls, cfg: GPTConfig, name: str = "GPT") -> ModelFacts:
        return cls(name, cfg.num_params(), cfg.n_layers, cfg.n_experts, cfg.scan_layers, gpt=cfg)

    @classmethod
    def of_model(cls, name: str, model: Model) -> ModelFacts:
        abstract = model.abstract_params()
        leaves = jax.tree.leaves(abstract)
        raw = json.dumps(
            [[list(x.shape), str(x.dtype)] for x in leaves]
            + [str(a) for a in jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, Axes))]
        )
        layers = model.stages.n_layers if model.stages else int(model_facts(model).get("layers", 0))
        return cls(
            name,
            sum(x.size for x in leaves),
            layers,
            can_pipeline=model.stages is not None,
            model=model,
            fingerprint=hashlib.sha256(raw.encode()).hexdigest()[:16],
            abstract_params=abstract,
        )

    def divides(self, shape: dict[str, int]) -> bool:
        """Whether every parameter splits evenly under a layout of mesh axis sizes ``shape``."""
        t, f = shape.get("tensor", 1), shape.get("fsdp", 1)
        if self.gpt is not None:
            g = self.gpt
            return not (g.n_kv_heads % t or g.n_heads % t or g.mlp_dim % t or g.vocab % t or g.dim % f)
        assert self.model is not None
        try:
            specs_for(self.model.axes, self.abstract_params, default_rules(), shape)
        except ShardkitError:
            return False
        return True


def candidate_layouts(
    facts: ModelFacts | GPTConfig, devices: int, batch: int, hw: Hardware, options: PlanOptions, seq: int | None = None
) -> list[dict[str, int]]:
    """Every ``data x fsdp x tensor x sequence x stage x expert`` split of the devices that the
    model, the batch and the sequence length ``seq`` allow: at most one of ``sequence``, ``stage``
    and ``expert`` above 1 (``expert`` only for a mixture of experts, ``stage`` only for a model
    that says how it splits into stages); tensor and sequence inside a node."""
    if isinstance(facts, GPTConfig):
        facts = ModelFacts.of_gpt(facts)
    tensors = options.tensor or tuple(t for t in (1, 2, 4, 8, 16) if t <= hw.devices_per_node)
    experts = options.expert or tuple(e for e in (1, 2, 4, 8, 16) if facts.n_experts and facts.n_experts % e == 0)

    def allowed(t: int, s: int, p: int, e: int) -> bool:
        return (
            devices % (t * s * p * e) == 0
            and (s == 1 or (seq is not None and seq % s == 0))
            and (p == 1 or (facts.can_pipeline and facts.n_layers % p == 0))
            and (e == 1 or (facts.n_experts > 0 and facts.n_experts % e == 0))
            and sum(x > 1 for x in (s, p, e)) <= 1  # pipelines and islands do not nest yet
        )

    out = []
    for t, s, p, e in itertools.product(
        tensors, options.sequence or (1, 2, 4, 8), options.stage or (1, 2, 4, 8), experts or (1,)
    ):
        if not allowed(t, s, p, e):
            continue
        rest = devices // (t * s * p * e)
        for f in (f for f in range(1, rest + 1) if rest % f == 0):
            d = rest // f
            shape = {"data": d, "fsdp": f, "tensor": t, "sequence": s, "stage": p, "expert": e}
            if not facts.divides(shape):
                continue
            links = axis_links(shape, hw)
            # Stages come after tensor in the mesh order, so t * s * p devices must fit in a node
            # or tensor steps between nodes; the link check covers the node size for tensor and
            # sequence. (Pipelines between nodes with tensor inside need across_hosts=stage, not
            # searched yet.)
            if batch % (d * f * e) == 0 and links["tensor"] == links["sequence"] == "intra":
                out.append(shape)
    return out


def _spec(shape: dict[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in shape.items() if s > 1) or "data=1"


class _Cache:
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
        raw = json.dumps([dataclasses.asdict(cfg), jax.__version__, fingerprint], sort_keys=True)
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
        self.data[self.key(cfg, fingerprint)] = keep
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)  # atomic: a killed plan never leaves a half-written cache


def plan(
    model: ModelSource,
    devices: int,
    hardware: str | Hardware,
    batch: int,
    seq: int,
    options: PlanOptions | None = None,
    *,
    cache_dir: str | pathlib.Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Rank the layouts of ``model`` on ``devices`` devices of ``hardware``.

    Runs in this process when it has exactly ``devices`` simulated CPU devices (or JAX has not
    started yet), otherwise in a subprocess.

    Returns:
      ``{"best": layout string or None, "best_flags": CLI flags, "plans": [plan dicts, ranked],
      "hardware", "model", "devices", "batch", "seq"}``.

    Example:
      >>> result = plan("tiny", 8, "h100", batch=16, seq=64)   # doctest: +SKIP
      >>> result["best"]                                         # doctest: +SKIP
      'data=8'
    """
    options = options or PlanOptions()
    hw = get_hardware(hardware)
    factory = model if callable(model) else None
    if not can_run_here(devices):
        ref = factory_ref(factory) if factory is not None else model
        return _plan_in_subprocess(ref, devices, hw, batch, seq, options, cache_dir)
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
    from shardkit.dryrun import _in_process

    if factory is None and not is_factory_ref(model):
        facts = ModelFacts.of_preset(model)
    else:
        factory = factory or load_factory(model)
        label = model if isinstance(model, str) else importable_name(factory)
        facts = ModelFacts.of_model(label, build_model(factory, label))
        # A factory builds its own model: remat and depth are its business (see _factory_trainer).
        options = dataclasses.replace(options, remat=("none",))
    model_name = facts.name
    precision = as_precision(options.precision)
    compute_dtype = jax.numpy.dtype(precision.compute).name
    budget = options.headroom * hw.memory_bytes
    state_per_param = STATE_BYTES_PER_PARAM[precision.name]
    cache = _Cache(cache_dir)
    plans: list[Plan] = []
    for shape in candidate_layouts(facts, devices, batch, hw, options, seq):
        spec = _spec(shape)
        schedule = options.schedule if shape["stage"] > 1 else None
        split = shape["fsdp"] * shape["tensor"] * shape["stage"] * shape["expert"]  # ~ what the big weights divide by
        state = facts.params * state_per_param / split
        if state > budget:
            note = "model state alone exceeds the memory budget (not compiled)"
            plans.append(Plan(spec, 1, options.remat[0], False, state, {}, note=note))
            continue
        chosen = None
        counts = sorted(options.microbatches, reverse=schedule is not None)
        for remat in options.remat:
            for mb in counts:
                if batch % (shape["data"] * shape["fsdp"] * shape["expert"] * mb):
                    continue
                dr = DryRunConfig(
                    model=model_name,
                    layout=spec,
                    batch=batch,
                    seq=seq,
                    precision=precision.name,
                    microbatches=mb,
                    remat=remat,
                    schedule=schedule,
                )
                result = cache.get(dr, facts.fingerprint)
                if result is None:
                    if progress:
                        progress(f"dry run {spec} remat={remat} microbatches={mb}")
                    result = _in_process(dr, (lambda: facts.model) if facts.model is not None else None)
                    cache.put(dr, result, facts.fingerprint)
                chosen = (remat, mb, result)
                if result["memory"]["total"] <= budget:
                    break
            if chosen and chosen[2]["memory"]["total"] <= budget:
                break
        if chosen is None:
            continue
        remat, mb, result = chosen
        t = estimate(result, hw, compute_dtype)
        plans.append(
            Plan(
                spec,
                mb,
                remat,
                result["memory"]["total"] <= budget,
                result["memory"]["total"],
                result["bytes_by_axes"],
                t["compute_seconds"],
                t["comm_seconds"],
                t["step_seconds"],
                t["step_seconds_overlap"],
                t["mfu"],
                schedule=schedule,
            )
        )
    if not plans:
        raise ShardkitError(
            f"No layout of {model_name} divides over {devices} devices with batch {batch}: choose a batch divisible by "
            "the device count, or another device count."
        )
    plans.sort(
        key=lambda p: (not p.fits, p.predicted_step_seconds if p.predicted_step_seconds is not None else math.inf)
    )
    best = plans[0] if plans[0].fits else None
    return {
        "model": model_name,
        "devices": devices,
        "hardware": hw.name,
        "batch": batch,
        "seq": seq,
        "precision": precision.name,
        "best": best.layout if best else None,
        "best_flags": (
            f"--model {model_name} --batch {batch} --seq {seq} " + best.cli_flags() + f" --precision {precision.name}"
            if best
            else None
        ),
        "plans": [dataclasses.asdict(p) for p in plans],
    }


def _plan_in_subprocess(
    model: str, devices: int, hw: Hardware, batch: int, seq: int, options: PlanOptions, cache_dir: Any
) -> dict[str, Any]:
    hw_file = None
    if PROFILES.get(hw.name) != hw:  # a custom or modified profile travels as a file
        import tempfile

        hw_file = pathlib.Path(tempfile.mkdtemp()) / f"{hw.name}.json"
        hw_file.write_text(json.dumps({k: v for k, v in dataclasses.asdict(hw).items() if k != "name"}))
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "plan",
        "--model",
        model,
        "--devices",
        str(devices),
        "--hardware",
        str(hw_file or hw.name),
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--precision",
        options.precision,
        "--remat",
        ",".join(options.remat),
        "--microbatches",
        ",".join(map(str, options.microbatches)),
        "--json",
    ]
    searched = (("--tensor", options.tensor), ("--sequence", options.sequence), ("--stage", options.stage))
    for flag, values in (*searched, ("--expert", options.expert)):
        if values:
            cmd += [flag, ",".join(map(str, values))]
    cmd += ["--schedule", options.schedule]
    path = os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    if cache_dir:
        env["SHARDKIT_CACHE"] = str(cache_dir)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ShardkitError(f"Planning in a subprocess failed:\n{proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout)


def format_plans(result: dict[str, Any], top: int = 15) -> str:
    """The ranked plans as a table, and the best plan's flags."""
    lines = [
        f"{result['model']} on {result['devices']} x {result['hardware']}, batch {result['batch']} x seq "
        f"{result['seq']}, {result['precision']}",
        f"{'rank':>4s}  {'layout':28s} {'mb':>3s} {'remat':6s} {'GB/dev':>7s} {'fits':5s} {'step s':>8s} "
        f"{'overlap s':>9s} {'MFU':>5s}  bytes per axis (MB)",
    ]
    for i, p in enumerate(result["plans"][:top], 1):
        step = f"{p['predicted_step_seconds']:8.3f}" if p["predicted_step_seconds"] is not None else f"{'-':>8s}"
        over = (
            f"{p['predicted_step_seconds_overlap']:9.3f}"
            if p["predicted_step_seconds_overlap"] is not None
            else f"{'-':>9s}"
        )
        mfu = f"{p['predicted_mfu']:5.2f}" if p["predicted_mfu"] is not None else f"{'-':>5s}"
        axes = ", ".join(f"{a} {b / 1e6:.1f}" for a, b in sorted(p["bytes_by_axes"].items()) if b) or p["note"]
        lines.append(
            f"{i:4d}  {p['layout']:28s} {p['microbatches']:3d} {p['remat']:6s} {p['memory_per_device'] / 1e9:7.2f} "
            f"{'yes' if p['fits'] else 'no':5s} {step} {over} {mfu}  {axes}"
        )
    if result["best"]:
        lines.append(f"best: --layout {result['best']}   (shardkit train {result['best_flags']})")
    else:
        lines.append("no plan fits in memory: more devices, a smaller batch, or more microbatches")
    return "\n".join(lines)


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ShardkitError(f"Expected comma-separated integers, got {text!r}.") from None


def options_from(args: Any) -> PlanOptions:
    """PlanOptions from the ``shardkit plan`` flags."""
    return PlanOptions(
        precision=args.precision,
        remat=tuple(r for r in args.remat_options.split(",") if r),
        microbatches=parse_ints(args.microbatch_options),
        tensor=parse_ints(args.tensor) if args.tensor else None,
        sequence=parse_ints(args.sequence) if args.sequence else None,
        stage=parse_ints(args.stage) if args.stage else None,
        expert=parse_ints(args.expert) if args.expert else None,
        schedule=args.schedule or "1f1b",
    )


def run_cli(args: Any) -> None:
    """``shardkit plan``: the ranked table, or its JSON."""
    options = options_from(args)
    result = plan(
        args.model,
        args.devices,
        args.hardware,
        args.batch,
        args.seq,
        options,
        progress=None if args.json else lambda m: print(m, file=sys.stderr, flush=True),
    )
    print(json.dumps(result) if args.json else format_plans(result))
