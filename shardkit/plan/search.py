"""The planner's search space and its analytic pass: which layouts a model allows on N devices,
and what each one is estimated to cost before anything is compiled."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
from typing import Any, NamedTuple

import jax

from shardkit.analysis.estimate import Estimate, ModelSizes, analytic, axis_links, optimizer_bytes_per_param
from shardkit.analysis.hardware import Hardware
from shardkit.core.errors import ShardkitError
from shardkit.core.partition import Axes, specs_for
from shardkit.core.precision import Precision, as_precision
from shardkit.core.rules import default_rules
from shardkit.models.gpt import GPTConfig
from shardkit.models.hf_config import gpt_config
from shardkit.models.model import Model, model_facts
from shardkit.models.model_source import is_factory_ref
from shardkit.plan.dryrun import DryRunConfig, dry_run_optimizer, hf_config_of
from shardkit.plan.options import Plan, PlanOptions, size_text

# An estimate within this factor of the budget is worth compiling: the formulas count
# activations only to a small factor.
MEMORY_SLACK = 1.15


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
    def of_preset(cls, name: str, **overrides: Any) -> ModelFacts:
        return cls.of_gpt(GPTConfig.preset(name, **overrides), name)

    @classmethod
    def of_config(cls, source: str, **overrides: Any) -> ModelFacts:
        """The facts of a Hugging Face ``config.json`` (a checkpoint directory or a shipped
        config's name); the config's text is the fingerprint its cached dry runs are kept by."""
        config = hf_config_of(source)
        facts = cls.of_gpt(gpt_config(config, **overrides), source)
        fingerprint = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
        return dataclasses.replace(facts, fingerprint=fingerprint)

    @classmethod
    def of_gpt(cls, cfg: GPTConfig, name: str = "GPT") -> ModelFacts:
        routed_layers = sum(cfg.routed(i) for i in range(cfg.n_layers))
        expert_params = routed_layers * cfg.n_experts * 3 * cfg.dim * cfg.expert_dim  # shared experts are dense
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
            routed=cfg.top_k * cfg.capacity_factor if cfg.n_experts else 0.0,
            dropless=cfg.moe_dispatch if cfg.n_experts and cfg.moe_dropless else "",
            expert_dim=cfg.expert_dim if cfg.n_experts else 0,
            moe_layers=routed_layers,
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
            widths = (g.n_kv_heads, g.n_heads, g.mlp_dim, g.vocab) + ((g.expert_dim,) if g.n_experts else ())
            # fsdp splits the hidden size, and latent attention's ranks (stored as "embed" too)
            stored = (g.dim,) + ((g.latent.kv_rank, g.latent.q_rank or g.dim) if g.latent is not None else ())
            return not (any(w % t for w in widths) or any(w % f for w in stored))
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


def spec_of(shape: dict[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in shape.items() if s > 1) or "data=1"


class Setting(NamedTuple):
    """One way to run a layout: the remat policy, the microbatches and the ZeRO stage."""

    remat: str
    microbatches: int
    zero: int = 0


def settings_of(options: PlanOptions, shape: dict[str, int], batch: int, schedule: str | None) -> list[Setting]:
    """Remat policies, microbatch counts and ZeRO stages this layout's batch split allows,
    cheapest first (ZeRO only where there is a data axis to split the optimizer state over)."""
    counts = sorted(options.microbatches, reverse=schedule is not None)
    rows = shape["data"] * shape["fsdp"] * shape["expert"]
    stages = options.zero if shape["data"] > 1 else (0,)
    return [
        Setting(remat, mb, zero)
        for remat in options.remat
        for mb in counts
        if batch % (rows * mb) == 0
        for zero in dict.fromkeys(stages)
    ]


@dataclasses.dataclass(frozen=True)
class Question:
    """One planning question: a model on ``devices`` devices of ``hw``, a batch shape, a search space."""

    facts: ModelFacts
    model_name: str  # what its dry runs and the printed command call it
    devices: int
    hw: Hardware
    batch: int
    seq: int
    options: PlanOptions
    init_from: str | None = None  # the model is this config's, not model_name's preset
    vocab: int | None = None  # the model's vocabulary, when not its preset's or config's (a tokenizer's)

    @functools.cached_property
    def optimizer_bytes(self) -> float:
        """Optimizer state per parameter of the optimizer dry runs compile, read from it once."""
        return optimizer_bytes_per_param(dry_run_optimizer(), self.precision.update_dtype)

    @property
    def precision(self) -> Precision:
        return as_precision(self.options.precision)

    @property
    def budget(self) -> float:
        """Bytes per device a plan may use."""
        return self.options.headroom * self.hw.memory_bytes

    @property
    def compute_dtype(self) -> str:
        return jax.numpy.dtype(self.precision.compute).name

    def estimate(self, shape: dict[str, int], setting: Setting, schedule: str | None) -> Estimate:
        """The analytic estimate of one setting of one layout."""
        precision = self.precision
        assert self.facts.sizes is not None
        return analytic(
            self.facts.sizes,
            shape,
            self.hw,
            batch=self.batch,
            seq=self.seq,
            precision=precision.name,
            compute_itemsize=jax.numpy.dtype(precision.compute).itemsize,
            # What the planner compares with the budget is a dry run compiled by XLA:CPU, which
            # holds bf16 activations converted to fp32 (DeepSeek-V3's compiled at 1.33x an
            # estimate at 2 bytes): the estimate predicts that program.
            activation_itemsize=4,
            # What the compiled step gathers and reduces: the fp32 master copy and its gradients, if any.
            comm_itemsize=jax.numpy.dtype(precision.master or precision.params).itemsize,
            remat=setting.remat,
            microbatches=setting.microbatches,
            schedule=schedule,
            optimizer_bytes=self.optimizer_bytes,
            zero=setting.zero,
        )

    def dry_run(self, spec: str, setting: Setting, schedule: str | None) -> DryRunConfig:
        """The dry run that compiles one setting of one layout."""
        source: dict[str, Any] = {"init_from": self.init_from} if self.init_from else {"model": self.model_name}
        return DryRunConfig(
            **source,
            vocab=self.vocab,
            layout=spec,
            batch=self.batch,
            seq=self.seq,
            precision=self.precision.name,
            microbatches=setting.microbatches,
            remat=setting.remat,
            schedule=schedule,
            zero=setting.zero,
            # Every score formed in shardkit's GPT, as the estimate prices attention: the blocked
            # kernel's loops stop where the mask does, so their trip counts are not in the HLO and
            # its FLOPs would count one tile per block of queries (the compiled seconds would
            # undercut the estimate). A factory's model attends as it was written.
            attention="auto" if is_factory_ref(self.model_name) and not self.init_from else "xla",
        )


@dataclasses.dataclass
class Candidate:
    """A layout that survived the analytic pass: the settings to compile, cheapest first."""

    shape: dict[str, int]
    spec: str
    schedule: str | None
    settings: list[Setting]  # from the one the estimate chose
    estimate: Estimate  # at settings[0]
    configs: list[DryRunConfig] = dataclasses.field(default_factory=list)
    results: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    cached: int = 0  # how many of ``results`` came from the cache
    error: str = ""
    skipped: bool = False  # not compiled: its estimate was slower than a compiled plan that fits


def descending(settings: list[Setting], memory: list[float]) -> list[Setting]:
    """The settings worth compiling one after another: each is compiled only when the one before
    did not fit, so each must be estimated to need less memory than every one before it.

    Example:
      >>> s = [Setting("full", 1, 2), Setting("full", 2, 0), Setting("full", 2, 2)]
      >>> [x.microbatches for x in descending(s, [65e9, 161e9, 42e9])]
      [1, 2]
    """
    walk, least = [], float("inf")
    for setting, bytes_ in zip(settings, memory, strict=True):
        if bytes_ < least:
            walk.append(setting)
            least = bytes_
    return walk


def price(question: Question, layouts: list[dict[str, int]]) -> tuple[list[Plan], list[Candidate]]:
    """Every layout's settings priced analytically: the rows of layouts over the memory budget at
    every setting (not worth compiling), and the other layouts, fastest estimate first, each from
    the cheapest setting the estimate says fits."""
    budget = question.budget
    pruned: list[Plan] = []
    candidates: list[Candidate] = []
    for shape in layouts:
        spec = spec_of(shape)
        schedule = question.options.schedule if shape["stage"] > 1 else None
        settings = settings_of(question.options, shape, question.batch, schedule)
        if not settings:
            continue
        estimates = [question.estimate(shape, setting, schedule) for setting in settings]
        least = min(estimates, key=lambda e: e.memory_bytes)
        first = next((i for i, e in enumerate(estimates) if e.memory_bytes <= budget * MEMORY_SLACK), None)
        if first is not None:
            walk = descending(settings[first:], [e.memory_bytes for e in estimates[first:]])
            candidates.append(Candidate(shape, spec, schedule, walk, estimates[first]))
            continue
        note = (
            f"model state alone exceeds the memory budget by {size_text(least.state_bytes - budget)} (not compiled)"
            if least.state_bytes > budget
            else f"estimated {size_text(least.memory_bytes)} per device at best, "
            f"{size_text(least.memory_bytes - budget)} over the budget (not compiled)"
        )
        remat, mb, zero = settings[estimates.index(least)]
        pruned.append(
            Plan(
                spec, mb, remat, False, least.memory_bytes, {}, note=note, schedule=schedule, compiled=False, zero=zero
            )
        )
    return pruned, sorted(candidates, key=lambda c: c.estimate.step_seconds)
