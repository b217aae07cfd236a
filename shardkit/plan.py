"""Plan: choose a layout from a model of the hardware, checked by what the compiler produces.

For a model, a global batch and a sequence length on N devices, the planner

1. enumerates the factorisations of N over ``data x fsdp x tensor x sequence x stage x expert``
   (tensor and sequence only inside a node and where heads and sequence divide; stages only
   where the layers divide; experts only for a mixture of experts);
2. prices every one of them *analytically* (:func:`shardkit.estimate.analytic`: FLOPs, the bytes
   each axis moves, state and activation memory), for each remat policy and microbatch count,
   and drops those whose estimated memory exceeds the budget at every setting;
3. compiles only the fastest few by that estimate (``PlanOptions.compile_top``), in parallel
   processes of N simulated devices where cores allow, walking from the cheapest setting the
   estimate says fits until the compiled step does fit (cached on disk);
4. ranks the compiled plans by the step time predicted from their compiled FLOPs and bytes per
   axis at the device's peak and the links' bandwidths (NVLink/ICI inside a node, InfiniBand/DCN
   between nodes), with and without overlap. A pipeline's bubble needs no formula there: the
   lock-step pipeline computes its idle slots, so they are in the compiled FLOPs.

Layouts that were not compiled stay in the result with their estimate, so a user sees what was
pruned and why.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
from jax._src import xla_bridge

from shardkit.dryrun import DryRunConfig, can_run_here
from shardkit.errors import ShardkitError
from shardkit.estimate import ModelSizes, analytic, axis_links, predict
from shardkit.hardware import Hardware, get_hardware
from shardkit.model import Model, model_facts
from shardkit.model_source import ModelSource, build_model, importable_name, is_factory_ref, load_factory
from shardkit.models.gpt import GPTConfig
from shardkit.partition import Axes, specs_for
from shardkit.precision import as_precision
from shardkit.rules import default_rules

# An estimate within this factor of the budget is worth compiling: the formulas count
# activations only to a small factor.
MEMORY_SLACK = 1.15
# Settings compiled per layout at most, walking from the one the estimate chose.
MAX_COMPILES_PER_LAYOUT = 3


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The search space. ``tensor=None``: powers of two up to the node size that divide the heads;
    ``sequence=None``: 1, 2, 4, 8 where they divide the sequence and fit in a node with tensor;
    ``stage=None``: 1, 2, 4, 8 where they divide the layers. Pipelines try microbatches most
    first (the 1F1B bubble shrinks with more and its memory does not grow); others fewest first.
    ``compile_top``: how many layouts, the fastest by the analytic estimate, are compiled (``None``:
    all). ``workers``: processes compiling at once (``None``: one per core, or this process when
    it already has the devices)."""

    precision: str = "bf16-master"
    tensor: tuple[int, ...] | None = None
    sequence: tuple[int, ...] | None = None
    stage: tuple[int, ...] | None = None
    expert: tuple[int, ...] | None = None  # None: sizes that divide a mixture's experts
    schedule: str = "1f1b"
    remat: tuple[str, ...] = ("none", "full")
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16)
    headroom: float = 0.9  # fraction of device memory a plan may use
    compile_top: int | None = 6
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.compile_top is not None and self.compile_top < 1:
            raise ShardkitError(f"compile_top={self.compile_top}: compile at least 1 layout (or None for all).")
        if self.workers is not None and self.workers < 1:
            raise ShardkitError(f"workers={self.workers}: give at least 1 process.")


@dataclasses.dataclass
class Plan:
    """One layout: the remat and microbatches that first fit, and its predictions.

    ``compiled``: whether the predictions come from a compiled step; a layout pruned by the
    analytic estimate has only ``estimated_*`` figures and ``fits`` says what the estimate says.
    """

    layout: str
    microbatches: int
    remat: str
    fits: bool
    memory_per_device: float
    bytes_by_axes: dict[str, float]
    # Predictions from the compiled step: None for a plan that was not compiled.
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    predicted_step_seconds: float | None = None  # compute then communication, no overlap
    predicted_step_seconds_overlap: float | None = None  # perfect overlap: the larger of the two
    predicted_mfu: float | None = None
    note: str = ""
    schedule: str | None = None
    compiled: bool = True
    estimated_step_seconds: float | None = None
    estimated_memory: float | None = None

    def cli_flags(self) -> str:
        flags = f"--layout {self.layout} --microbatches {self.microbatches} --remat {self.remat}"
        return flags + (f" --schedule {self.schedule}" if self.schedule else "")


def _size(nbytes: float) -> str:
    """Bytes as GB, or MB below one GB (small models on small budgets in tests and notebooks)."""
    return f"{nbytes / 1e9:.1f} GB" if abs(nbytes) >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _dim_named(abstract: Any, axes: Any, name: str) -> int:
    """The largest size of a parameter dimension called ``name`` (0 when none is)."""
    leaves = jax.tree.leaves(abstract)
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, Axes))
    return max(
        (n for leaf, ax in zip(leaves, names, strict=True) for n, a in zip(leaf.shape, ax.names or ()) if a == name),
        default=0,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class ModelFacts:
    """What the planner needs of a model: its sizes and which splits its parameters allow.

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
    sizes: ModelSizes | None = None

    @classmethod
    def of_preset(cls, name: str) -> ModelFacts:
        return cls.of_gpt(GPTConfig.preset(name), name)

    @classmethod
    def of_gpt(cls, cfg: GPTConfig, name: str = "GPT") -> ModelFacts:
        expert_params = cfg.n_layers * cfg.n_experts * 3 * cfg.dim * cfg.mlp_dim
        sizes = ModelSizes(
            params=cfg.num_params(),
            layers=cfg.n_layers,
            dim=cfg.dim,
            heads=cfg.n_heads,
            kv_dim=cfg.n_kv_heads * cfg.head_dim,
            vocab=cfg.vocab,
            matmul_params=cfg.num_params() - cfg.vocab * cfg.dim,
            expert_params=expert_params,
            experts=cfg.n_experts,
            top_k=cfg.top_k if cfg.n_experts else 0,
        )
        return cls(name, cfg.num_params(), cfg.n_layers, cfg.n_experts, cfg.scan_layers, gpt=cfg, sizes=sizes)

    @classmethod
    def of_model(cls, name: str, model: Model) -> ModelFacts:
        abstract = model.abstract_params()
        leaves = jax.tree.leaves(abstract)
        raw = json.dumps(
            [[list(x.shape), str(x.dtype)] for x in leaves]
            + [str(a) for a in jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, Axes))]
        )
        info = model_facts(model)
        layers = model.stages.n_layers if model.stages else int(info.get("layers", 0))
        params = sum(x.size for x in leaves)
        sizes = ModelSizes(
            params=params,
            layers=layers,
            dim=int(info.get("dim", 0)),
            heads=int(info.get("heads", 0)),
            vocab=int(info.get("vocab", 0)) or _dim_named(abstract, model.axes, "vocab"),
            matmul_params=int(info.get("matmul_params", 0)),
        )
        return cls(
            name,
            params,
            layers,
            can_pipeline=model.stages is not None,
            model=model,
            fingerprint=hashlib.sha256(raw.encode()).hexdigest()[:16],
            abstract_params=abstract,
            sizes=sizes,
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


@dataclasses.dataclass
class _Candidate:
    """A layout that survived the analytic pass: the settings to compile, cheapest first."""

    shape: dict[str, int]
    spec: str
    schedule: str | None
    settings: list[tuple[str, int]]  # (remat, microbatches), from the one the estimate chose
    estimate: Any  # shardkit.estimate.Estimate at settings[0]
    configs: list[DryRunConfig] = dataclasses.field(default_factory=list)
    results: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    cached: int = 0  # how many of ``results`` came from the cache
    error: str = ""


def _settings(options: PlanOptions, shape: dict[str, int], batch: int, schedule: str | None) -> list[tuple[str, int]]:
    """Remat policies and microbatch counts this layout's batch split allows, cheapest first."""
    counts = sorted(options.microbatches, reverse=schedule is not None)
    rows = shape["data"] * shape["fsdp"] * shape["expert"]
    return [(remat, mb) for remat in options.remat for mb in counts if batch % (rows * mb) == 0]


class _Workers:
    """A few ``shardkit.plan_worker`` processes with ``devices`` simulated devices each."""

    def __init__(self, count: int, devices: int):
        import subprocess
        import tempfile

        path = os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)
        flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
        self.logs = [tempfile.TemporaryFile("w+") for _ in range(count)]  # noqa: SIM115 - closed in close_logs()
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "shardkit.plan_worker", str(devices)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
            for log in self.logs
        ]
        self.idle: list[int] = list(range(count))
        import threading

        self.lock = threading.Lock()

    def run(self, configs: list[DryRunConfig], budget: float) -> dict[str, Any]:
        """Compile ``configs`` in order on an idle worker until one fits; its reply."""
        with self.lock:
            i = self.idle.pop()
        proc, log = self.procs[i], self.logs[i]
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"configs": [dataclasses.asdict(c) for c in configs], "budget": budget}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            log.seek(0)
            raise ShardkitError(f"A planner worker process ended unexpectedly:\n{log.read()[-2000:]}")
        with self.lock:
            self.idle.append(i)
        return json.loads(line)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def close_logs(self) -> None:
        for log in self.logs:
            log.close()


class PlanInterrupted(KeyboardInterrupt):
    """Ctrl-C during a plan; ``result`` holds the plans compiled so far."""

    def __init__(self, result: dict[str, Any]):
        super().__init__("plan interrupted")
        self.result = result


def _compile_candidates(
    jobs: list[_Candidate],
    facts: ModelFacts,
    devices: int,
    budget: float,
    workers: int | None,
    done: Callable[[_Candidate], None],
) -> None:
    """Compile each job's configurations (until one fits), here or in worker processes."""
    pending = [j for j in jobs if j.configs]
    if not pending:
        return
    here = can_run_here(devices)
    importable = facts.model is None or is_factory_ref(pending[0].configs[0].model)
    if workers is None:
        started = xla_bridge.backends_are_initialized()
        workers = 1 if here and started else min(len(os.sched_getaffinity(0)), len(pending))
    if (here and workers == 1) or not importable:
        if not here:  # a factory only this process knows: say how to make it importable
            from shardkit.model_source import factory_ref

            factory_ref(facts.model)  # type: ignore[arg-type]
        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", devices)
        from shardkit.dryrun import _in_process

        factory = (lambda: facts.model) if facts.model is not None else None
        for job in pending:
            try:
                for cfg in job.configs:
                    job.results.append(_in_process(cfg, factory))
                    if job.results[-1]["memory"]["total"] <= budget:
                        break
            except ShardkitError as e:
                job.error = str(e)
            done(job)
        return
    pool = _Workers(min(workers, len(pending)), devices)
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=len(pool.procs))
    try:
        futures = {executor.submit(pool.run, job.configs, budget): job for job in pending}
        for future in concurrent.futures.as_completed(futures):
            job = futures[future]
            reply = future.result()
            job.results.extend(reply["results"])
            job.error = reply.get("error", "")
            done(job)
    finally:
        pool.kill()  # also on Ctrl-C: no worker outlives the plan
        executor.shutdown(wait=True, cancel_futures=True)
        pool.close_logs()


def _plan_of(job: _Candidate, budget: float, hw: Hardware, compute_dtype: str, unfinished: bool = False) -> Plan:
    """The table row of a compiled candidate: its first setting that fits, else its last."""
    est = job.estimate
    common = dict(schedule=job.schedule, estimated_step_seconds=est.step_seconds, estimated_memory=est.memory_bytes)
    if unfinished or not job.results:
        remat, mb = job.settings[0]
        note = "not compiled: interrupted" if unfinished else f"compile failed: {job.error}"
        return Plan(job.spec, mb, remat, False, est.memory_bytes, {}, note=note, compiled=False, **common)
    result = job.results[-1]
    fields = result["config"]
    fits = result["memory"]["total"] <= budget
    t = predict(result, hw, compute_dtype)
    over = _size(result["memory"]["total"] - budget)
    note = "" if fits else f"{over} over the budget at the best of {len(job.results)} settings compiled"
    return Plan(
        job.spec,
        fields["microbatches"],
        fields["remat"],
        fits,
        result["memory"]["total"],
        result["bytes_by_axes"],
        t["compute_seconds"],
        t["comm_seconds"],
        t["step_seconds"],
        t["step_seconds_overlap"],
        t["mfu"],
        note=note,
        **common,
    )


def _rank(plans: list[Plan]) -> list[Plan]:
    """Compiled plans that fit, fastest first; then estimated ones; then those that do not fit."""

    def key(p: Plan) -> tuple[int, float]:
        if p.compiled and p.fits:
            return (0, p.predicted_step_seconds or math.inf)
        if p.fits:
            return (1, p.estimated_step_seconds or math.inf)
        return (2, p.memory_per_device)

    return sorted(plans, key=key)


def _facts_of(model: ModelSource, options: PlanOptions) -> tuple[ModelFacts, str, PlanOptions]:
    """The model's facts, the name its dry runs go by, and the options it allows."""
    factory = model if callable(model) else None
    if factory is None and not is_factory_ref(model):  # type: ignore[arg-type]
        return ModelFacts.of_preset(model), model, options  # type: ignore[arg-type, return-value]
    factory = factory or load_factory(model)  # type: ignore[arg-type]
    label = model if isinstance(model, str) else importable_name(factory)
    # A factory builds its own model: remat and depth are its business (see _factory_trainer).
    return ModelFacts.of_model(label, build_model(factory, label)), label, dataclasses.replace(options, remat=("none",))


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

    Every layout is priced analytically; the fastest ``options.compile_top`` are compiled (in
    worker processes with ``devices`` simulated devices, or here when this process already has
    them) and ranked by the step time their compiled programs predict.

    Args:
      model: a GPT preset name, a model factory or its ``"package.module:function"`` name.
      devices: the device count to plan for.
      hardware: a profile name (``h100``, ...) or a :class:`~shardkit.hardware.Hardware`.
      batch, seq: global batch rows and sequence length.
      options: the search space (:class:`PlanOptions`).
      cache_dir: where compiled dry runs are cached (default ``~/.cache/shardkit``).
      progress: called with a line of text for each step of the search ("k of N").

    Returns:
      ``{"best": layout string or None, "best_flags": CLI flags, "plans": [plan dicts, ranked],
      "searched", "compiled", "hardware", "model", "devices", "batch", "seq", "seconds"}``.

    Raises:
      PlanInterrupted: on Ctrl-C, with the plans compiled so far in ``.result``.

    Example:
      >>> result = plan("tiny", 8, "h100", batch=16, seq=64)   # doctest: +SKIP
      >>> result["best"]                                         # doctest: +SKIP
      'data=8'
    """
    start = time.perf_counter()
    options = options or PlanOptions()
    hw = get_hardware(hardware)
    say = progress or (lambda _: None)
    facts, model_name, options = _facts_of(model, options)
    assert facts.sizes is not None
    precision = as_precision(options.precision)
    compute_dtype = jax.numpy.dtype(precision.compute).name
    itemsize = jax.numpy.dtype(precision.compute).itemsize
    # What the compiled step gathers and reduces: the fp32 master copy and its gradients, if any.
    comm_itemsize = jax.numpy.dtype(precision.master or precision.params).itemsize
    budget = options.headroom * hw.memory_bytes
    layouts = candidate_layouts(facts, devices, batch, hw, options, seq)

    plans: list[Plan] = []
    candidates: list[_Candidate] = []
    for shape in layouts:
        spec = _spec(shape)
        schedule = options.schedule if shape["stage"] > 1 else None
        settings = _settings(options, shape, batch, schedule)
        if not settings:
            continue
        estimates = [
            analytic(
                facts.sizes,
                shape,
                hw,
                batch=batch,
                seq=seq,
                precision=precision.name,
                compute_itemsize=itemsize,
                comm_itemsize=comm_itemsize,
                remat=remat,
                microbatches=mb,
                schedule=schedule,
            )
            for remat, mb in settings
        ]
        least = min(estimates, key=lambda e: e.memory_bytes)
        first = next((i for i, e in enumerate(estimates) if e.memory_bytes <= budget * MEMORY_SLACK), None)
        if first is None:
            alone = least.state_bytes > budget
            note = (
                f"model state alone exceeds the memory budget by {_size(least.state_bytes - budget)} (not compiled)"
                if alone
                else f"estimated {_size(least.memory_bytes)} per device at best, "
                f"{_size(least.memory_bytes - budget)} over the budget (not compiled)"
            )
            remat, mb = settings[estimates.index(least)]
            plans.append(
                Plan(spec, mb, remat, False, least.memory_bytes, {}, note=note, schedule=schedule, compiled=False)
            )
            continue
        candidates.append(_Candidate(shape, spec, schedule, settings[first:], estimates[first]))
    if not plans and not candidates:
        raise ShardkitError(
            f"No layout of {model_name} divides over {devices} devices with batch {batch}: choose a batch divisible by "
            "the device count, or another device count."
        )

    candidates.sort(key=lambda c: c.estimate.step_seconds)
    chosen = candidates[: options.compile_top] if options.compile_top else candidates
    for c in candidates[len(chosen) :]:
        remat, mb = c.settings[0]
        plans.append(
            Plan(
                c.spec,
                mb,
                remat,
                True,
                c.estimate.memory_bytes,
                c.estimate.bytes_by_axes,
                note="not compiled: slower by the estimate",
                schedule=c.schedule,
                compiled=False,
                estimated_step_seconds=c.estimate.step_seconds,
                estimated_memory=c.estimate.memory_bytes,
            )
        )
    cache = _Cache(cache_dir)
    for c in chosen:
        configs = [
            DryRunConfig(
                model=model_name,
                layout=c.spec,
                batch=batch,
                seq=seq,
                precision=precision.name,
                microbatches=mb,
                remat=remat,
                schedule=c.schedule,
            )
            for remat, mb in c.settings[:MAX_COMPILES_PER_LAYOUT]
        ]
        for cfg in configs:  # what the cache already knows costs nothing
            cached = cache.get(cfg, facts.fingerprint)
            if cached is None:
                break
            c.results.append({**cached, "config": dataclasses.asdict(cfg)})
            if cached["memory"]["total"] <= budget:
                break
        c.cached = len(c.results)
        fitted = bool(c.results) and c.results[-1]["memory"]["total"] <= budget
        c.configs = [] if fitted else configs[len(c.results) :]
    to_compile = sum(bool(c.configs) for c in chosen)
    say(
        f"{len(layouts)} layouts: {len(layouts) - len(candidates)} over the memory budget by estimate; compiling "
        f"the {len(chosen)} fastest of the other {len(candidates)} by estimate ({to_compile} not cached)"
    )
    finished: list[_Candidate] = [c for c in chosen if not c.configs]

    def result_dict(interrupted: bool = False) -> dict[str, Any]:
        unfinished = [c for c in chosen if c not in finished]
        rows = plans + [_plan_of(c, budget, hw, compute_dtype) for c in finished]
        rows += [_plan_of(c, budget, hw, compute_dtype, unfinished=True) for c in unfinished]
        ranked = _rank(rows)
        best = ranked[0] if ranked and ranked[0].compiled and ranked[0].fits else None
        flags = None
        if best:
            flags = f"--model {model_name} --batch {batch} --seq {seq} {best.cli_flags()} --precision {precision.name}"
        return {
            "model": model_name,
            "devices": devices,
            "hardware": hw.name,
            "batch": batch,
            "seq": seq,
            "precision": precision.name,
            "memory_budget": budget,
            "searched": len(layouts),
            "compiled": len(finished),
            "interrupted": interrupted,
            "seconds": time.perf_counter() - start,
            "best": best.layout if best else None,
            "best_flags": flags,
            "plans": [dataclasses.asdict(p) for p in ranked],
        }

    def done(job: _Candidate) -> None:
        for cfg, result in zip(job.configs, job.results[job.cached :], strict=False):
            cache.put(cfg, result, facts.fingerprint)
        finished.append(job)
        row = _plan_of(job, budget, hw, compute_dtype)
        step = f"{row.predicted_step_seconds:.3f} s/step" if row.predicted_step_seconds is not None else row.note
        say(
            f"[{len(finished)} of {len(chosen)}] {row.layout} remat={row.remat} microbatches={row.microbatches}: "
            f"{row.memory_per_device / 1e9:.2f} GB/device ({'fits' if row.fits else 'does not fit'}), {step} "
            f"(estimate {job.estimate.step_seconds:.3f} s)"
        )

    try:
        _compile_candidates(chosen, facts, devices, budget, options.workers, done)
    except KeyboardInterrupt:
        raise PlanInterrupted(result_dict(interrupted=True)) from None
    return result_dict()


def format_plans(result: dict[str, Any], top: int = 15) -> str:
    """The ranked plans as a table, and the best plan's complete ``shardkit train`` command.

    Compiled plans show the step time their compiled program predicts; the others show the
    analytic estimate in brackets, with why they were not compiled.
    """
    lines = [
        f"{result['model']} on {result['devices']} x {result['hardware']}, batch {result['batch']} x seq "
        f"{result['seq']}, {result['precision']}, {_size(result['memory_budget'])} per device to fill: "
        f"{result.get('searched', len(result['plans']))} layouts searched, "
        f"{result.get('compiled', '?')} compiled in {result.get('seconds', 0):.0f} s"
        + (" (interrupted: partial table)" if result.get("interrupted") else ""),
        f"{'rank':>4s}  {'layout':28s} {'mb':>3s} {'remat':6s} {'GB/dev':>7s} {'fits':5s} {'step s':>9s} "
        f"{'overlap s':>9s} {'MFU':>5s}  bytes per axis (MB)",
    ]
    for i, p in enumerate(result["plans"][:top], 1):
        if p["predicted_step_seconds"] is not None:
            step = f"{p['predicted_step_seconds']:9.3f}"
        elif p.get("estimated_step_seconds") is not None:
            step = f"{'(' + format(p['estimated_step_seconds'], '.3f') + ')':>9s}"
        else:
            step = f"{'-':>9s}"
        over = (
            f"{p['predicted_step_seconds_overlap']:9.3f}"
            if p["predicted_step_seconds_overlap"] is not None
            else f"{'-':>9s}"
        )
        mfu = f"{p['predicted_mfu']:5.2f}" if p["predicted_mfu"] is not None else f"{'-':>5s}"
        moved = ", ".join(f"{a} {b / 1e6:.1f}" for a, b in sorted(p["bytes_by_axes"].items()) if b)
        detail = moved if p.get("compiled", True) else f"{p['note']}" + (f"; est. {moved}" if moved else "")
        fits = ("yes" if p["fits"] else "no") + ("" if p.get("compiled", True) else "?")
        lines.append(
            f"{i:4d}  {p['layout']:28s} {p['microbatches']:3d} {p['remat']:6s} {p['memory_per_device'] / 1e9:7.2f} "
            f"{fits:5s} {step} {over} {mfu}  {detail or '-'}"
        )
    if len(result["plans"]) > top:
        lines.append(f"      ... {len(result['plans']) - top} more (--json lists all)")
    if result["best"]:
        lines.append(f"best: shardkit train {result['best_flags']}")
    elif result.get("interrupted"):
        lines.append("interrupted before any plan was compiled")
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
        compile_top=args.compile_top or None,
        workers=args.workers,
    )


def run_cli(args: Any) -> None:
    """``shardkit plan``: progress lines, then the ranked table (or its JSON); Ctrl-C prints the
    partial table."""
    options = options_from(args)
    stream = sys.stderr if args.json else sys.stdout
    try:
        result = plan(
            args.model,
            args.devices,
            args.hardware,
            args.batch,
            args.seq,
            options,
            progress=lambda m: print(m, file=stream, flush=True),
        )
    except PlanInterrupted as stop:
        print(json.dumps(stop.result) if args.json else format_plans(stop.result), flush=True)
        raise SystemExit(130) from None
    print(json.dumps(result) if args.json else format_plans(result))
