"""The main job's configuration: every knob of ``shardkit train``, light enough that the command
line can build its flags without starting JAX."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import pathlib

from shardkit.core.errors import InputError
from shardkit.core.flags import same_as, setting

OPTIMIZER_NAMES = ("adamw", "sgd")
PRECISION_NAMES = ("fp32", "bf16", "bf16-master")
NONFINITE_NAMES = ("skip", "halt")
LR_SCHEDULES = ("cosine", "constant")
PACKINGS = ("auto", "windows", "packed")
# When accumulated gradients are reduced (shardkit.training.accumulation): auto, once, per_microbatch.
REDUCE_GRADIENTS = ("auto", "once", "per_microbatch")
SCHEDULES = ("gpipe", "1f1b")  # pipeline schedules (shardkit.parallel.schedule)
ATTENTION_NAMES = ("auto", "blocked", "xla", "cudnn")  # GPTConfig.attention, "auto" for its None
# Settings that change what a resumed run computes; a run directory refuses a change to any of
# them unless --allow-change names it. The layout is not one: a run resumes onto any layout.
RESUMABLE_SETTINGS = frozenset(
    {
        "model",
        "init_from",
        "lora_rank",
        "lora_alpha",
        "lora_targets",
        "adapter",
        "tokenizer",
        "packing",
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


# The configs of real sizes in shardkit/models/published/ (dryrun, inspect and plan read them by name).
SHIPPED_CONFIGS = (
    "llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, mixtral-8x7b, qwen3-32b, gemma-3-27b, qwen3-30b-a3b, "
    "qwen3-235b-a22b, gpt-oss-20b, gpt-oss-120b, deepseek-v3, kimi-k2"
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every knob of the main job (the CLI flags of ``shardkit train``)."""

    model: str = setting(
        "mini",
        "a GPT preset (tiny, mini, gpt2-small, ..., llama2-70b, mixtral-8x7b); dryrun, inspect and plan also take "
        "your own factory as package.module:function",
    )
    init_from: str | None = setting(
        None,
        "start from a Hugging Face checkpoint directory (config.json + *.safetensors; Llama 2/3.x, Mistral, "
        "Mixtral, Qwen2/2.5, Qwen3, Gemma 2/3): the model is the checkpoint's, not --model's. dryrun, inspect and "
        "plan read only its config.json, and also take a shipped config of a real size: " + SHIPPED_CONFIGS,
    )
    tokenizer: str | None = setting(
        None,
        "a tokenizer.json (Hugging Face tokenizers) to cut the text with; a preset's vocabulary becomes its size. "
        "Default: byte tokens (vocab 256), or the --init-from checkpoint's own tokenizer.json",
    )
    lora_rank: int = setting(
        0,
        "train LoRA adapters of this rank on a frozen base (no gradient, no optimizer state for the base); "
        "0: every parameter trains",
    )
    lora_alpha: float = setting(0.0, "LoRA's alpha: the adapters' output is scaled by alpha / rank (0: 2 x rank)")
    lora_targets: str = setting(
        "q_proj,v_proj",
        "the projections LoRA adapts, comma-separated, as peft names them: q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj",
    )
    adapter: str | None = setting(
        None,
        "continue a LoRA adapter peft saved (adapter_config.json + adapter_model.safetensors) on --init-from; "
        "its rank, alpha and targets are the adapter's",
    )
    layout: str = setting(
        "data=2,fsdp=2,tensor=2",
        "mesh axis sizes, e.g. data=2,fsdp=-1,tensor=2 (-1 fills the rest); auto: the planner's fastest plan that fits "
        "the devices present (layout, microbatches, remat and ZeRO stage; chosen again on each resume)",
    )
    hardware: str | None = setting(
        None,
        "the device to plan for: h100, h200, a100, tpu-v5p, tpu-v5e, or a JSON profile (dryrun says whether the "
        "step fits one, plan ranks layouts on it: default h100; train --layout auto plans for it: default the "
        "devices' own, h100 for simulated CPU devices)",
    )
    steps: int = setting(500, "optimizer steps")
    batch: int = setting(16, "global batch (sequences per step)")
    seq: int = setting(128, "sequence length (tokens the model sees per sequence)")
    lr: float = setting(3e-3, "peak learning rate")
    warmup: int = setting(20, "learning-rate warmup steps")
    weight_decay: float = setting(0.1, "AdamW weight decay")
    lr_schedule: str = setting(
        "cosine", "after the warmup: cosine decay to lr/10 at the last step, or constant", choices=LR_SCHEDULES
    )
    clip: float = setting(1.0, "clip gradients to this global norm (0: off)")
    b2: float = setting(0.95, "AdamW's second-moment decay")
    optimizer: str = setting("adamw", "the optax optimizer", choices=OPTIMIZER_NAMES)
    dropout: float = setting(0.0, "dropout rate (the same masks on every layout)")
    seed: int = setting(0, "seed of the initial parameters, dropout and data order")
    data: str | None = setting(
        None,
        "a text file (or directory of *.txt) instead of the built-in corpus; or a corpus packed into rows by Grain: "
        ".jsonl (a 'text' field per line), .npy or nanoGPT's .bin of token ids; or instruction data: .jsonl of "
        "'prompt'/'completion' or 'messages' rows, rendered by the --init-from checkpoint's chat template, only the "
        "answers scored, packed whole",
    )
    packing: str = setting(
        "auto",
        "how rows are cut from the text: windows (random windows per step), packed (non-overlapping rows shuffled "
        "per epoch by Grain); auto: packed for .jsonl/.npy/.bin, windows for text",
        choices=PACKINGS,
    )
    json_log: str | None = setting(None, "write one JSON object per step to this file")
    precision: str = setting("fp32", "mixed-precision policy", choices=PRECISION_NAMES)
    microbatches: int = setting(1, "gradient accumulation steps; with stage>1, the microbatches in the pipeline")
    remat: str = setting("none", "rematerialisation per layer: none, full, dots, dots_no_batch")
    max_seq: int | None = setting(
        None,
        "the GPT's longest sequence (default: the preset's or the checkpoint config's); rotary positions "
        "extend to any length",
    )
    attention: str = setting(
        "auto",
        "the GPT's training attention: auto (cuDNN where it serves the mask on GPUs, else the blocked kernel; "
        "elsewhere blocked from 512 tokens), blocked (memory linear in the sequence), xla (every score formed), "
        "cudnn",
        choices=ATTENTION_NAMES,
    )
    nonfinite: str = setting("skip", "a step with NaN/Inf is skipped or stops the run", choices=NONFINITE_NAMES)
    max_skips: int = setting(10, "non-finite steps skipped in a row that stop the run (0: never)")
    sequence_parallel: bool = setting(False, "Megatron sequence parallelism on the tensor axis")
    zero: int = setting(
        0,
        "ZeRO stage over the data axis, parameters whole on every device: 1 shards the optimizer state and "
        "master weights, 2 the gradients too (0: off; stage 3 is the layout's fsdp axis)",
    )
    fsdp_min_size: int | None = setting(
        None,
        "parameters of fewer elements per layer stay whole on every device under fsdp, not gathered one by one "
        "(unset: vectors such as norm scales and biases stay whole, every matrix is split; 0: split all)",
    )
    reduce_gradients: str = setting(
        "auto",
        "with --microbatches >1, when the devices reduce the gradients: once per step, per_microbatch, or auto "
        "(once where no batch axis splits the parameters; without microbatches auto also reduces a parameter the "
        "model reads twice once, per_microbatch keeps XLA's pass)",
        choices=REDUCE_GRADIENTS,
    )
    schedule: str | None = setting(None, "pipeline schedule with stage>1 (default 1f1b)", choices=SCHEDULES)
    virtual_stages: int = setting(1, "interleaved pipeline stages per device (chunks of layers)")
    checkpoint_dir: str | None = setting(
        None, "save checkpoints here and resume from the newest one (under any layout)"
    )
    checkpoint_every: int = setting(100, "steps between checkpoints")
    keep_checkpoints: int = setting(3, "checkpoints kept (the newest)")
    reset_optimizer: bool = setting(False, "resume the parameters with a fresh optimizer state")
    allow_schedule_change: bool = setting(
        False,
        "resume although the schedule (--lr, --warmup, --weight-decay, --lr-schedule, --clip, --b2, --steps, "
        "--optimizer) differs from the checkpoint's",
    )
    eval_every: int = setting(
        0, "evaluate on the held-out split (the text's last 5%, never trained on) every N steps and at the end (0: off)"
    )
    eval_batches: int = setting(4, "batches of the held-out split per evaluation")
    profile_steps: str | None = setting(
        None,
        "capture a jax.profiler trace of steps A:B, a Python slice of the 0-based steps: 10:13 traces the progress "
        "line's steps 11 to 13 (for TensorBoard's profile plugin or Perfetto)",
    )
    profile_dir: str = setting("profile", "where --profile-steps writes its trace (inside --run-dir when given)")
    tensorboard: str | None = setting(
        None,
        "write TensorBoard event files here (process 0): loss, learning rate, gradient norm, tokens/s, MFU, "
        "held-out loss, memory per device",
    )
    sample_tokens: int = setting(200, "tokens to generate at the end")
    prompt: str = setting("def ", "the prompt of the sample")
    run_dir: str | None = setting(
        None, "one directory per run: config.json, checkpoints/ and log.jsonl; run again to resume"
    )
    allow_change: tuple[str, ...] = setting(
        (), "with --run-dir: resume although this setting changed (e.g. lr, steps, batch); repeatable", repeat=True
    )
    overwrite: bool = setting(False, "with --run-dir: start the run over")
    devices: int | None = setting(
        None,
        "device count, simulated on CPU where no GPU is present (default: the layout's count; 8 when it has a -1)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow_change", tuple(self.allow_change or ()))  # argparse gives a list
        for name in ("steps", "batch", "seq"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name} must be at least 1, got {getattr(self, name)}.")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise InputError(f"--lr must be a finite positive number, got {self.lr}.")
        if self.seed < 0:
            raise InputError(f"--seed must be >= 0, got {self.seed}.")
        if self.max_seq is not None and self.max_seq < 1:
            raise InputError(f"--max-seq must be a positive number of tokens, got {self.max_seq}.")
        if self.max_skips < 0:
            raise InputError(f"--max-skips must be >= 0 (0: never stop on skipped steps), got {self.max_skips}.")
        if self.optimizer not in OPTIMIZER_NAMES:
            raise InputError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_NAMES)}.")
        if self.precision not in PRECISION_NAMES:
            raise InputError(f"--precision {self.precision!r} is not one of {', '.join(PRECISION_NAMES)}.")
        if self.nonfinite not in NONFINITE_NAMES:
            raise InputError(f"--nonfinite {self.nonfinite!r} is not one of {', '.join(NONFINITE_NAMES)}.")
        if not 0.0 <= self.dropout < 1.0:
            raise InputError(f"--dropout must be in [0, 1), got {self.dropout}.")
        if self.warmup < 0:
            raise InputError(f"--warmup must be >= 0 steps, got {self.warmup}.")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise InputError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}.")
        if self.lr_schedule not in LR_SCHEDULES:
            raise InputError(f"--lr-schedule {self.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}.")
        if not math.isfinite(self.clip) or self.clip < 0:
            raise InputError(f"--clip must be a finite number >= 0 (0: no clipping), got {self.clip}.")
        if self.zero not in (0, 1, 2):
            raise InputError(f"--zero {self.zero}: give a ZeRO stage 0, 1 or 2 (stage 3 is --layout fsdp=N).")
        check_fsdp_min_size(self.fsdp_min_size)
        if self.lora_rank < 0:
            raise InputError(f"--lora-rank must be >= 1 for LoRA (0: full fine-tuning), got {self.lora_rank}.")
        if self.lora_alpha < 0:
            raise InputError(f"--lora-alpha must be > 0 (0: twice the rank), got {self.lora_alpha}.")
        if self.adapter is not None and not self.init_from:
            raise InputError("--adapter continues a peft adapter on its base: give the base with --init-from DIR.")
        if self.profile_steps is not None:
            self.profiled_steps()  # a malformed range is refused here, before anything runs
        if self.tensorboard is not None:
            check_tensorboard_available()
        if not 0.0 < self.b2 < 1.0:
            raise InputError(f"--b2 must be in (0, 1), e.g. 0.95 or 0.999, got {self.b2}.")
        for name, least in (("microbatches", 1), ("virtual_stages", 1), ("keep_checkpoints", 1), ("eval_batches", 1)):
            if getattr(self, name) < least:
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{flag} must be at least {least}, got {getattr(self, name)}.")
        for name in ("checkpoint_every", "sample_tokens", "eval_every"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{flag} must be >= 0, got {getattr(self, name)}.")
        self._check_run_files()

    def _check_run_files(self) -> None:
        """The log, run directory, checkpoint and resume flags: each usable, and together."""
        if self.json_log is not None:
            log = pathlib.Path(self.json_log)
            if log.is_dir():
                raise InputError(f"--json-log {self.json_log} is a directory; give a file path inside it.")
            if not log.absolute().parent.is_dir():
                raise InputError(
                    f"--json-log {self.json_log}: directory {log.absolute().parent} does not exist. Fix: create it "
                    "first, or log elsewhere."
                )
        for key in self.allow_change:
            if key.replace("-", "_") not in RESUMABLE_SETTINGS:
                close = difflib.get_close_matches(key.replace("-", "_"), sorted(RESUMABLE_SETTINGS), n=1)
                raise InputError(
                    f"--allow-change {key}: not a setting a resume compares"
                    + (f"; did you mean {close[0].replace('_', '-')}?" if close else "")
                    + f" Settings: {', '.join(sorted(k.replace('_', '-') for k in RESUMABLE_SETTINGS))}."
                )
        if (self.allow_change or self.overwrite) and not (self.run_dir or self.checkpoint_dir):
            raise InputError("--allow-change and --overwrite apply to a --run-dir.")
        if self.run_dir and (self.checkpoint_dir or self.json_log):
            raise InputError(
                "--run-dir holds the run's checkpoints and log itself; drop --checkpoint-dir and --json-log."
            )
        if (self.reset_optimizer or self.allow_schedule_change) and not (self.checkpoint_dir or self.run_dir):
            raise InputError("--reset-optimizer and --allow-schedule-change apply to a resume: add --checkpoint-dir.")

    def profiled_steps(self) -> range:
        """The steps ``--profile-steps A:B`` traces (0-based step numbers; empty when not set)."""
        return _profile_range(self.profile_steps, self.steps) if self.profile_steps else range(0)


def _profile_range(text: str, steps: int) -> range:
    first, sep, last = text.partition(":")
    try:
        span = range(int(first), int(last)) if sep else None
    except ValueError:
        span = None
    if span is None or not 0 < span.start < span.stop <= steps:
        raise InputError(
            f"--profile-steps {text}: give A:B with 0 < A < B <= --steps ({steps}), e.g. 10:13 (steps 10, 11 and 12; "
            "step 0 compiles)."
        )
    return span


@dataclasses.dataclass(frozen=True)
class DryRunSettings:
    """The settings of a dry run (the flags of ``shardkit dryrun`` and ``inspect``): the training
    run's shape, with the main job's meanings and defaults, and two knobs for compile-time
    studies. :class:`shardkit.plan.dryrun.DryRunConfig` adds what needs JAX."""

    model: str = same_as(TrainConfig, "model")
    init_from: str | None = same_as(TrainConfig, "init_from")
    layout: str = same_as(TrainConfig, "layout")
    batch: int = same_as(TrainConfig, "batch")
    seq: int | None = same_as(TrainConfig, "seq")
    precision: str = same_as(TrainConfig, "precision")
    microbatches: int = same_as(TrainConfig, "microbatches")
    schedule: str | None = same_as(TrainConfig, "schedule")
    virtual_stages: int = same_as(TrainConfig, "virtual_stages")
    remat: str = same_as(TrainConfig, "remat")
    max_seq: int | None = same_as(TrainConfig, "max_seq")
    attention: str = same_as(TrainConfig, "attention")
    zero: int = same_as(TrainConfig, "zero")
    fsdp_min_size: int | None = same_as(TrainConfig, "fsdp_min_size")
    reduce_gradients: str = same_as(TrainConfig, "reduce_gradients")
    sequence_parallel: bool = same_as(TrainConfig, "sequence_parallel")
    scan_layers: bool = setting(True, "unroll the layer stack instead of scanning it", flag="--unrolled", negate=True)
    n_layers: int | None = setting(None, "override the preset's number of layers", flag="--layers")
    vocab: int | None = setting(None, "override the model's vocabulary size (a tokenizer's)")
    devices: int | None = same_as(TrainConfig, "devices")

    def __post_init__(self) -> None:
        for name, least in (("batch", 1), ("microbatches", 1), ("virtual_stages", 1)):
            if getattr(self, name) < least:
                raise InputError(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(self, name)}.")
        for name in ("seq", "max_seq", "n_layers", "vocab", "devices"):
            value = getattr(self, name)
            if value is not None and value < 1:
                flag = {"n_layers": "layers"}.get(name, name)
                raise InputError(f"--{flag} {value}: give a positive number.")
        if self.zero not in (0, 1, 2):
            raise InputError(f"--zero {self.zero}: give a ZeRO stage 0, 1 or 2 (stage 3 is --layout fsdp=N).")
        check_fsdp_min_size(self.fsdp_min_size)


def check_tensorboard_available() -> None:
    """Refuse ``--tensorboard`` up front when tensorboardX is not installed.

    Raises:
      InputError: naming the package to install.
    """
    if importlib.util.find_spec("tensorboardX") is None:
        raise InputError(
            "--tensorboard needs the tensorboardX package: pip install tensorboardX "
            "(or pip install 'shardkit[tensorboard]'), or drop --tensorboard."
        )


def check_fsdp_min_size(value: object) -> None:
    """Refuse an ``fsdp_min_size`` that is not None or a count of elements >= 0.

    Raises:
      InputError: naming the accepted values.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    raise InputError(
        f"fsdp_min_size={value!r} (--fsdp-min-size): give a count of elements >= 0 (parameters smaller than it "
        "per layer stay whole under fsdp; 0 splits every one), or leave it unset to keep norm scales and biases "
        "whole."
    )


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The planner's search space (flags of ``shardkit plan``). ``tensor=None``: powers of two up
    to the node size that divide the heads; ``sequence=None``: 1, 2, 4, 8 where they divide the
    sequence and fit in a node with tensor; ``stage=None``: 1, 2, 4, 8 where they divide the
    layers. Pipelines try microbatches most first (the 1F1B bubble shrinks with more and its
    memory does not grow); others fewest first. ``compile_top``: how many layouts, the fastest by
    the analytic estimate, are compiled (``None``: all), less those whose estimate is slower than a
    plan already compiled that fits (``prune``). ``workers``: processes compiling at once
    (``None``: one per core, or this process when it already has the devices). ``time_limit``:
    seconds the search may take; after them no compile starts, the worker processes' compiles are
    stopped, and the answer ranks what compiled in time (the others are rows of the estimate)."""

    precision: str = same_as(TrainConfig, "precision", "bf16-master")  # plans are for accelerators
    tensor: tuple[int, ...] | None = setting(None, "tensor sizes to consider (default: powers of 2 in a node)")
    sequence: tuple[int, ...] | None = setting(None, "sequence (ring attention) sizes to consider (default 1,2,4,8)")
    stage: tuple[int, ...] | None = setting(None, "pipeline stage counts to consider (default 1,2,4,8)")
    expert: tuple[int, ...] | None = setting(None, "expert sizes to consider (default: divisors of the experts)")
    schedule: str | None = same_as(TrainConfig, "schedule")  # None: 1f1b
    remat: tuple[str, ...] = setting(("none", "full"), "remat policies to try, cheapest first", flag="--remat-options")
    microbatches: tuple[int, ...] = setting(
        (1, 2, 4, 8, 16), "microbatch counts to try, fewest first", flag="--microbatch-options"
    )
    zero: tuple[int, ...] = setting(
        (0, 2),
        "ZeRO stages to try where a layout has a data axis, in this order after each remat and microbatch "
        "setting (stage 1 moves 1.5x the bytes of stage 2 for less saving; add it to compare)",
        flag="--zero-options",
    )
    headroom: float = setting(0.9, "fraction of device memory a plan may use")
    compile_top: int | None = setting(
        6, "compile this many layouts, the fastest by the analytic estimate (0: all of them)", zero_is_none=True
    )
    workers: int | None = setting(None, "processes compiling at once (default: one per core)")
    time_limit: float | None = setting(
        None,
        "seconds the search may take: no compile starts after them and those running are stopped; the answer "
        "ranks what compiled in time (default: no limit)",
    )
    prune: bool = setting(
        True,
        "compile no layout whose estimate is already slower than a compiled plan that fits, while every compiled "
        "layout has been slower than its estimate (trusted as a lower bound only while the compiles agree); off: "
        "compile every one of --compile-top",
        flag="--no-prune",
        negate=True,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", self.schedule or "1f1b")
        if self.compile_top is not None and self.compile_top < 1:
            raise InputError(f"compile_top={self.compile_top}: compile at least 1 layout (or None for all).")
        if self.workers is not None and self.workers < 1:
            raise InputError(f"workers={self.workers}: give at least 1 process.")
        if self.time_limit is not None and not self.time_limit > 0:
            raise InputError(f"time_limit={self.time_limit}: give a number of seconds > 0 (or None: no limit).")
        if not self.zero or any(z not in (0, 1, 2) for z in self.zero):
            raise InputError(f"zero={self.zero}: give ZeRO stages among 0, 1 and 2, e.g. (0, 2).")
        if not 0 < self.headroom <= 1:
            raise InputError(f"headroom={self.headroom}: give the fraction of device memory to use, in (0, 1].")
