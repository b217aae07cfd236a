"""``plan(...)``: price every layout, compile the fastest few, rank what the compiler says."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

from shardkit.analysis.estimate import predict
from shardkit.analysis.hardware import Hardware, get_hardware
from shardkit.core.errors import InputError, LayoutError, ModelError, short_repr
from shardkit.models.model_source import ModelSource, build_model, importable_name, is_factory_ref, load_factory
from shardkit.plan.cache import DryRunCache
from shardkit.plan.options import Plan, PlanInterrupted, PlanOptions, PlanResult, size_text
from shardkit.plan.search import Candidate, ModelFacts, Question, candidate_layouts, price
from shardkit.plan.workers import compile_candidates

# Settings compiled per layout at most, walking from the one the estimate chose.
MAX_COMPILES_PER_LAYOUT = 3


def plan_of(job: Candidate, budget: float, hw: Hardware, compute_dtype: str, unfinished: str = "") -> Plan:
    """The table row of a compiled candidate: its first setting that fits, else its last
    (``unfinished``: why it was not compiled, for a search stopped before its turn)."""
    est = job.estimate
    common: dict[str, Any] = dict(
        schedule=job.schedule, estimated_step_seconds=est.step_seconds, estimated_memory=est.memory_bytes
    )
    if job.skipped:
        return _estimated_row(job, "not compiled: its estimate is slower than a compiled plan that fits")
    if unfinished or not job.results:
        remat, mb, zero = job.settings[0]
        note = f"not compiled: {unfinished}" if unfinished else f"compile failed: {job.error}"
        return Plan(job.spec, mb, remat, False, est.memory_bytes, {}, note=note, compiled=False, zero=zero, **common)
    result = job.results[-1]
    fields = result["config"]
    fits = result["memory"]["total"] <= budget
    t = predict(result, hw, compute_dtype)
    over = size_text(result["memory"]["total"] - budget)
    note = "" if fits else f"{over} over the budget at the best of {len(job.results)} settings compiled"
    if "extrapolated" in result:
        small, large = result["extrapolated"]["from_devices"]
        note = "; ".join(filter(None, [note, f"extrapolated from {small:,} and {large:,} devices"]))
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
        zero=fields.get("zero", 0),
        **common,
    )


def rank(plans: list[Plan]) -> list[Plan]:
    """Compiled plans that fit, fastest first; then estimated ones; then those that do not fit."""

    def key(p: Plan) -> tuple[int, float]:
        if p.compiled and p.fits:
            return (0, p.predicted_step_seconds or math.inf)
        if p.fits:
            return (1, p.estimated_step_seconds or math.inf)
        return (2, p.memory_per_device)

    return sorted(plans, key=key)


def _facts_of(
    model: ModelSource | None, options: PlanOptions, init_from: str | None, vocab: int | None
) -> tuple[ModelFacts, str, PlanOptions]:
    """The model's facts, the name its dry runs go by, and the options it allows."""
    overrides = {} if vocab is None else {"vocab": vocab}
    if init_from is not None:
        if model is not None:
            raise ModelError(f"plan: both a model ({short_repr(model)}) and init_from={init_from!r}; give one.")
        return ModelFacts.of_config(init_from, **overrides), init_from, options
    if model is None:
        raise ModelError("plan: give the model (a GPT preset, a factory or its name), or init_from=DIR.")
    factory = model if callable(model) else None
    if factory is None and not is_factory_ref(model):  # type: ignore[arg-type]
        return ModelFacts.of_preset(model, **overrides), model, options  # type: ignore[arg-type, return-value]
    if vocab is not None:
        raise ModelError(f"plan: vocab={vocab} changes a GPT preset's or a config's size; a factory sets its own.")
    factory = factory or load_factory(model)  # type: ignore[arg-type]
    label = model if isinstance(model, str) else importable_name(factory)
    # A factory builds its own model: remat and depth are its business (see _factory_trainer).
    return ModelFacts.of_model(label, build_model(factory, label)), label, dataclasses.replace(options, remat=("none",))


def _estimated_row(c: Candidate, note: str = "not compiled: slower by the estimate") -> Plan:
    """The table row of a layout priced but not compiled (slower by the estimate than those that were)."""
    remat, mb, zero = c.settings[0]
    est = c.estimate
    return Plan(
        c.spec,
        mb,
        remat,
        True,
        est.memory_bytes,
        est.bytes_by_axes,
        note=note,
        schedule=c.schedule,
        compiled=False,
        estimated_step_seconds=est.step_seconds,
        estimated_memory=est.memory_bytes,
        zero=zero,
    )


def kind_of(c: Candidate) -> tuple[tuple[str, ...], bool]:
    """A layout's kind: the mesh axes it splits, and whether it uses ZeRO. The estimate's error is
    much the same within a kind (the same collectives) and differs between kinds."""
    return tuple(sorted(axis for axis, size in c.shape.items() if size > 1)), c.settings[0].zero > 0


def one_of_each_kind(candidates: list[Candidate], top: int) -> list[Candidate]:
    """The ``top`` layouts to compile: the fastest by estimate of each kind, fastest first, then
    the next fastest of any kind while room is left.

    Between kinds the estimate is least sure: on llama2-70b over 512 H100s the six fastest by
    estimate were five ZeRO layouts with a data axis, which the compiled steps put at 1.1-1.7x
    their estimates, while the best plan (``fsdp=256,tensor=2``, 0.97x) was tenth, within 0.3%
    of four others.
    """
    chosen: list[Candidate] = []
    kinds: set[tuple[tuple[str, ...], bool]] = set()
    for c in candidates:
        if len(chosen) < top and kind_of(c) not in kinds:
            chosen.append(c)
            kinds.add(kind_of(c))
    rest = [c for c in candidates if c not in chosen]
    chosen += rest[: top - len(chosen)]
    return sorted(chosen, key=candidates.index)


def _not_chosen_note(c: Candidate, chosen: list[Candidate]) -> str:
    if any(kind_of(x) == kind_of(c) and x.estimate.step_seconds <= c.estimate.step_seconds for x in chosen):
        return "not compiled: slower by the estimate than a compiled layout of its kind"
    return "not compiled: slower by the estimate"


@dataclasses.dataclass
class _Bound:
    """What the compiles so far say about the rest: the fastest compiled plan that fits, and the
    least ratio of a compiled step to its estimate. A layout estimated no faster than that plan
    need not be compiled, but only while every compiled step came out slower than its estimate
    (the estimate then bounds the step from below; a small model's can be above its compiled
    step, and then every layout of the top is compiled)."""

    fastest: float = math.inf
    least_ratio: float = math.inf

    def see(self, row: Plan) -> None:
        predicted, estimated = row.predicted_step_seconds, row.estimated_step_seconds
        if predicted is None:
            return
        if row.fits:
            self.fastest = min(self.fastest, predicted)
        if estimated:
            self.least_ratio = min(self.least_ratio, predicted / estimated)

    def rules_out(self, estimated_seconds: float) -> bool:
        return self.least_ratio >= 1.0 and estimated_seconds >= self.fastest


def _take_from_cache(question: Question, chosen: list[Candidate], cache: DryRunCache) -> None:
    """Give each chosen layout its dry runs to compile, less what the cache already knows."""
    budget = question.budget
    for c in chosen:
        configs = [question.dry_run(c.spec, setting, c.schedule) for setting in c.settings[:MAX_COMPILES_PER_LAYOUT]]
        for cfg in configs:
            cached = cache.get(cfg, question.facts.fingerprint)
            if cached is None:
                break
            c.results.append({**cached, "config": dataclasses.asdict(cfg)})
            if cached["memory"]["total"] <= budget:
                break
        c.cached = len(c.results)
        fitted = bool(c.results) and c.results[-1]["memory"]["total"] <= budget
        c.configs = [] if fitted else configs[len(c.results) :]


def _result(
    question: Question,
    rows: list[Plan],
    searched: int,
    compiled: int,
    seconds: float,
    interrupted: bool = False,
) -> PlanResult:
    """The answer: the ranked rows, the best one and its complete ``shardkit train`` flags."""
    ranked = rank(rows)
    best = ranked[0] if ranked and ranked[0].compiled and ranked[0].fits else None
    precision = question.precision.name
    flags = None
    if best:
        source = f"--init-from {question.init_from}" if question.init_from else f"--model {question.model_name}"
        flags = f"{source} --batch {question.batch} --seq {question.seq} {best.cli_flags()} "
        flags += f"--precision {precision}"
    return PlanResult(
        model=question.model_name,
        devices=question.devices,
        hardware=question.hw.name,
        batch=question.batch,
        seq=question.seq,
        precision=precision,
        memory_budget=question.budget,
        searched=searched,
        compiled=compiled,
        interrupted=interrupted,
        seconds=seconds,
        best=best.layout if best else None,
        best_flags=flags,
        plans=tuple(ranked),
    )


def plan(
    model: ModelSource | None = None,
    devices: int = 0,
    hardware: str | Hardware = "h100",
    batch: int = 0,
    seq: int = 0,
    options: PlanOptions | None = None,
    *,
    init_from: str | None = None,
    vocab: int | None = None,
    cache_dir: str | pathlib.Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlanResult:
    """Rank the layouts of ``model`` on ``devices`` devices of ``hardware``.

    Every layout is priced analytically; the fastest ``options.compile_top`` are compiled (in
    worker processes with ``devices`` simulated devices, or here when this process already has
    them) and ranked by the step time their compiled programs predict.

    Args:
      model: a GPT preset name, a model factory or its ``"package.module:function"`` name.
      init_from: instead of ``model``, a Hugging Face checkpoint directory (its ``config.json``
        alone is read) or a shipped config's name (:mod:`shardkit.models.published`).
      vocab: the vocabulary size, when a tokenizer's replaces the preset's or config's.
      devices: the device count to plan for.
      hardware: a profile name (``h100``, ...) or a :class:`~shardkit.analysis.hardware.Hardware`.
      batch, seq: global batch rows and sequence length.
      options: the search space (:class:`PlanOptions`).
      cache_dir: where compiled dry runs are cached (default ``~/.cache/shardkit``).
      progress: called with a line of text for each step of the search ("k of N").

    Returns:
      A :class:`~shardkit.plan.options.PlanResult`: ``.best`` (a layout string or None),
      ``.best_flags``, ``.plans`` (ranked :class:`Plan` rows) and the question; it also reads as
      the JSON-shaped dict ``shardkit plan --json`` prints (``result["best"]``).

    Raises:
      PlanInterrupted: on Ctrl-C, with the plans compiled so far in ``.result``.

    Example:
      >>> result = plan("tiny", 8, "h100", batch=16, seq=64)   # doctest: +SKIP
      >>> result["best"]                                         # doctest: +SKIP
      'data=8'
      >>> plan(init_from="llama-3.1-70b", devices=512, batch=1024, seq=4096).best_flags  # doctest: +SKIP
      '--init-from llama-3.1-70b --batch 1024 --seq 4096 --layout data=64,fsdp=8 ...'
    """
    start = time.perf_counter()
    for name, value in (("devices", devices), ("batch", batch), ("seq", seq)):
        if value < 1:
            raise InputError(f"plan: give {name}, a positive number (got {value}).")
    say = progress or (lambda _: None)
    facts, model_name, options = _facts_of(model, options or PlanOptions(), init_from, vocab)
    question = Question(facts, model_name, devices, get_hardware(hardware), batch, seq, options, init_from, vocab)
    layouts = candidate_layouts(facts, devices, batch, question.hw, options, seq)
    pruned, candidates = price(question, layouts)
    if not pruned and not candidates:
        raise LayoutError(
            f"No layout of {model_name} divides over {devices} devices with batch {batch}: choose a batch divisible by "
            "the device count, or another device count."
        )
    chosen = one_of_each_kind(candidates, options.compile_top) if options.compile_top else candidates
    rows = pruned + [_estimated_row(c, _not_chosen_note(c, chosen)) for c in candidates if c not in chosen]
    cache = DryRunCache(cache_dir)
    _take_from_cache(question, chosen, cache)
    say(
        f"{len(layouts)} layouts: {len(layouts) - len(candidates)} over the memory budget by estimate; compiling "
        f"the {len(chosen)} fastest of the other {len(candidates)} by estimate "
        f"({sum(bool(c.configs) for c in chosen)} not cached)"
    )
    finished = [c for c in chosen if not c.configs]
    budget, hw, dtype = question.budget, question.hw, question.compute_dtype

    bound = _Bound()
    for job in finished:  # what the cache already knows counts too
        bound.see(plan_of(job, budget, hw, dtype))

    def slower(job: Candidate) -> bool:
        if not options.prune or not bound.rules_out(job.estimate.step_seconds):
            return False
        say(
            f"skipped {job.spec}: estimated {job.estimate.step_seconds:.3f} s/step, no faster than "
            f"{bound.fastest:.3f} s compiled"
        )
        return True

    def done(job: Candidate) -> None:
        for cfg, result in zip(job.configs, job.results[job.cached :], strict=False):
            cache.put(cfg, result, facts.fingerprint)
        finished.append(job)
        row = plan_of(job, budget, hw, dtype)
        bound.see(row)
        step = f"{row.predicted_step_seconds:.3f} s/step" if row.predicted_step_seconds is not None else row.note
        say(
            f"[{len(finished)} of {len(chosen)}] {row.layout} remat={row.remat} microbatches={row.microbatches}: "
            f"{row.memory_per_device / 1e9:.2f} GB/device ({'fits' if row.fits else 'does not fit'}), {step} "
            f"(estimate {job.estimate.step_seconds:.3f} s)"
        )

    def answer(interrupted: bool = False) -> PlanResult:
        why = "interrupted" if interrupted else f"past the time limit of {options.time_limit or 0:g} s"
        rows_now = rows + [plan_of(c, budget, hw, dtype, "" if c in finished else why) for c in chosen]
        return _result(question, rows_now, len(layouts), len(finished), time.perf_counter() - start, interrupted)

    deadline = None if options.time_limit is None else start + options.time_limit
    try:
        compile_candidates(chosen, facts, devices, budget, options.workers, done, slower, deadline)
    except KeyboardInterrupt:
        raise PlanInterrupted(answer(interrupted=True)) from None
    return answer()
