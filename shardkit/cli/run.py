"""The main job: train the reference GPT on text, as ``shardkit train`` runs it.

``train(TrainConfig(...))`` is the same loop from Python (scripts, notebooks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, TextIO

import jax
import numpy as np
import optax

from shardkit.cli import run_dir
from shardkit.cli.progress import Progress
from shardkit.cli.run_inputs import dataset_of, fresh_state, model_of, tokenizer_path
from shardkit.cli.run_log import HELD_OUT, Profiler, evaluate_held_out, log_step, mfu_text, open_json_log
from shardkit.core.config import OPTIMIZER_NAMES, TrainConfig
from shardkit.core.errors import InputError, ModelError
from shardkit.io.data import TextDataset
from shardkit.io.tensorboard import Scalars
from shardkit.models.generate import generate
from shardkit.models.model import Model
from shardkit.plan import auto_layout
from shardkit.runtime.distributed import is_primary
from shardkit.runtime.stopping import StopRequests
from shardkit.training.checkpoint import Checkpointer, CheckpointWarning
from shardkit.training.train import NonFiniteError, Trainer


def _schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``--lr``, then cosine decay to lr/10 at the last step (or constant)."""
    warmup = min(cfg.warmup, max(cfg.steps - 1, 1))
    if cfg.lr_schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr)], [warmup]
        )
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.lr * 0.1)


def _clipped(cfg: TrainConfig, update: optax.GradientTransformation) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(cfg.clip), update) if cfg.clip > 0 else update


OPTIMIZERS: dict[str, Callable[[TrainConfig], optax.GradientTransformation]] = {
    "adamw": lambda c: _clipped(c, optax.adamw(_schedule(c), b2=c.b2, weight_decay=c.weight_decay)),
    "sgd": lambda c: _clipped(c, optax.sgd(_schedule(c), momentum=0.9)),
}
assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES, "config.OPTIMIZER_NAMES lists the optimizers the CLI offers"


def run_fingerprint(cfg: TrainConfig, dataset: TextDataset) -> dict[str, dict[str, Any]]:
    """The settings a resumed run must keep, as the checkpoint records them: what decides the
    batches the remaining steps read (``data``), and the optimizer's schedule (``schedule``)."""
    data: dict[str, Any] = {
        "seed": cfg.seed,
        "data": cfg.data or "builtin",
        "data_tokens": len(dataset.tokens),
        "batch": cfg.batch,
        "seq": cfg.seq,
    }
    # Recorded only when set, so checkpoints of runs without them still resume.
    if dataset.tokenizer is not None:
        data["tokenizer"] = tokenizer_path(cfg)
    if cfg.packing != "auto":
        data["packing"] = cfg.packing
    return {
        "data": data,
        # What the run trains, so export, eval and generate need only --checkpoint-dir (not compared on resume:
        # the parameters' tree is).
        "model": {
            "model": cfg.model,
            "init_from": cfg.init_from,
            "lora_rank": cfg.lora_rank,
            "lora_alpha": cfg.lora_alpha,
            "lora_targets": cfg.lora_targets,
            "adapter": cfg.adapter,
        },
        "schedule": {
            "optimizer": cfg.optimizer,
            "lr": cfg.lr,
            "warmup": cfg.warmup,
            "weight_decay": cfg.weight_decay,
            "lr_schedule": cfg.lr_schedule,
            "clip": cfg.clip,
            "b2": cfg.b2,
            "steps": cfg.steps,
        },
    }


def _halted(
    error: NonFiniteError,
    trainer: Trainer,
    ckpt: Checkpointer | None,
    cfg: TrainConfig,
    step: int,
    run: dict[str, dict[str, Any]],
    out: TextIO,
) -> NonFiniteError:
    """The guard stopped the run: keep the last good state on disk, and say how to go on."""
    if ckpt is None:
        text = f"{error} The last good state is lost: pass --checkpoint-dir to keep it."
        return NonFiniteError(text, error.state, error.step, error.parameter)
    ckpt.wait()  # the save in flight first: it may be the newest good one
    ckpt.save(trainer, error.state, data_position=step, run=run, force=True)
    ckpt.close()
    saved = int(error.state.step)
    print(f"halted: the last good state (step {saved}) is checkpoint step {saved} in {cfg.checkpoint_dir}", file=out)
    text = (
        f"{error} The last good state (step {saved}) is saved in {cfg.checkpoint_dir}. Fix: resume from it with "
        "the same command and a lower --lr (add --allow-schedule-change), after checking the data."
    )
    return NonFiniteError(text, error.state, error.step, error.parameter)


@dataclasses.dataclass
class _Loop:
    """What the step loop leaves behind: the state, the losses, and how it ended."""

    state: Any
    losses: list[float] = dataclasses.field(default_factory=list)
    skipped: list[int] = dataclasses.field(default_factory=list)
    timed_seconds: float = 0.0
    timed_steps: int = 0
    stopped_after: int | None = None
    signal: tuple[int, str | None] | None = None  # (number, name) of the signal that stopped it
    last_batch: Any = None
    evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, held-out loss)


def _trainer_for(cfg: TrainConfig, out: TextIO) -> tuple[TextDataset, Trainer, TrainConfig]:
    """The dataset and the trainer of the main job, checked and described before any compile, and
    ``cfg`` as placed (``--layout auto``: by the planner's best plan for the devices present)."""
    dataset = dataset_of(cfg)
    own_vocab = dataset.tokenizer is not None or dataset.vocab != TextDataset.VOCAB  # tokenizer or token ids
    gpt_cfg, name = model_of(cfg, dataset.vocab if own_vocab else None)
    if gpt_cfg.vocab < dataset.vocab:
        what = "the tokenizer's" if dataset.tokenizer is not None else "the data's"
        raise ModelError(f"The model {name} has vocab {gpt_cfg.vocab} < {what} {dataset.vocab}.")
    if cfg.seq > gpt_cfg.max_seq:
        raise InputError(
            f"--seq {cfg.seq} exceeds the {name} model's max_seq={gpt_cfg.max_seq}; give --max-seq {cfg.seq}."
        )
    if cfg.layout == auto_layout.AUTO:
        cfg = auto_layout.choose(cfg, gpt_cfg.vocab if own_vocab and not cfg.init_from else None, out)
        gpt_cfg = dataclasses.replace(gpt_cfg, remat=cfg.remat)
    trainer = Trainer(
        gpt_cfg.model(name=name),
        OPTIMIZERS[cfg.optimizer](cfg),
        cfg.layout,
        precision=cfg.precision,
        microbatches=cfg.microbatches,
        nonfinite=cfg.nonfinite,
        max_skips=cfg.max_skips,
        sequence_parallel=cfg.sequence_parallel,
        schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages,
        zero=cfg.zero,
        fsdp_min_size=cfg.fsdp_min_size,
        reduce_gradients=cfg.reduce_gradients,
    )
    print(
        f"shardkit: {trainer.mesh.devices.size} {jax.devices()[0].platform} device(s), layout "
        f"{trainer.layout.spec()}, model {name} ({gpt_cfg.num_params() / 1e6:.2f}M parameters), precision "
        f"{cfg.precision}, batch {cfg.batch} x seq {cfg.seq}, {len(dataset.tokens):,} tokens of text"
        + (f" (tokenizer {tokenizer_path(cfg)}, vocab {dataset.vocab})" if dataset.tokenizer is not None else ""),
        file=out,
    )
    print(trainer.format_sharding_table(), file=out)
    # The batch shape is known now: refuse one that does not split, before anything is compiled.
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), np.int32)
    trainer.plan.check_microbatches({"tokens": tokens}, cfg.microbatches)
    return dataset, trainer, cfg


def _start_or_resume(
    cfg: TrainConfig, trainer: Trainer, run: dict[str, dict[str, Any]], out: TextIO
) -> tuple[Checkpointer | None, Any, int]:
    """``(checkpointer or None, the first state, the first step)``: a fresh state, or the newest
    checkpoint's (checked against this run's fingerprint)."""
    ckpt = (
        Checkpointer(cfg.checkpoint_dir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints)
        if cfg.checkpoint_dir
        else None
    )
    if ckpt is None:
        return None, fresh_state(cfg, trainer), 0
    ckpt.prepare(trainer)  # writable, room for a checkpoint, locked: before any step is computed
    if ckpt.latest_step() is None:
        return ckpt, fresh_state(cfg, trainer), 0
    with warnings.catch_warnings():  # said once, below, as "warning: ..."
        warnings.simplefilter("ignore", CheckpointWarning)
        state, record = ckpt.restore(
            trainer,
            run=run,
            reset_optimizer=cfg.reset_optimizer,
            allow_schedule_change=cfg.allow_schedule_change,
            allow=cfg.allow_change,
        )
    for warning in ckpt.warnings:
        print(f"warning: {warning}", file=out)
    first_step = record["data_position"]
    print(f"resumed from {cfg.checkpoint_dir} at step {first_step} (saved under layout {record['layout']})", file=out)
    return ckpt, state, first_step


def _held_out_record(
    cfg: TrainConfig, trainer: Trainer, held_out: TextDataset, loop: _Loop, step: int, out: TextIO
) -> dict:
    """Evaluate now: print the held-out loss and perplexity; their fields of the step's log line."""
    loss = evaluate_held_out(cfg, trainer, held_out, loop.state.params)
    loop.evals.append((step, loss))
    print(f"eval at step {step}: held-out loss {loss:.4f}, perplexity {math.exp(loss):.2f}", file=out)
    return {"eval_loss": loss, "eval_perplexity": math.exp(loss)}


def _steps(
    cfg: TrainConfig,
    trainer: Trainer,
    dataset: TextDataset,
    start: tuple[Checkpointer | None, Any, int],
    run: dict[str, dict[str, Any]],
    bar: Progress | None,
    out: TextIO,
    held_out: TextDataset | None = None,
) -> _Loop:
    """Run the steps from the first one to ``cfg.steps``: log, save, and stop politely on a signal."""
    ckpt, state, first_step = start
    loop, rows, schedule = _Loop(state), trainer.local_rows(cfg.batch), _schedule(cfg)
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(StopRequests())
        log = None
        if cfg.json_log and is_primary():  # one writer, whatever the process count
            log = stack.enter_context(open_json_log(pathlib.Path(cfg.json_log), first_step))
        board = Scalars(cfg.tensorboard) if cfg.tensorboard and is_primary() else None
        if board is not None:
            stack.callback(board.close)
        directory = os.path.join(cfg.run_dir, cfg.profile_dir) if cfg.run_dir else cfg.profile_dir
        profiler = Profiler(cfg.profiled_steps(), directory, out)
        stack.callback(profiler.close)  # a run stopped inside the range still writes its trace
        for step in range(first_step, cfg.steps):
            profiler.before(step)
            loop.last_batch = batch = trainer.shard_batch(dataset.batch(step, cfg.batch, cfg.seq, rows=rows))
            began = time.perf_counter()
            try:
                loop.state, metrics = trainer.step(loop.state, batch)
            except NonFiniteError as e:
                raise _halted(e, trainer, ckpt, cfg, step, run, out) from None
            loss = float(metrics["loss"])  # waits for the step
            seconds = time.perf_counter() - began
            profiler.after(step)
            if step > first_step:  # the first step includes the compile
                loop.timed_seconds, loop.timed_steps = loop.timed_seconds + seconds, loop.timed_steps + 1
            if "finite" in metrics and not bool(metrics["finite"]):
                loop.skipped.append(step + 1)
                print(f"step {step + 1}: loss {loss}: non-finite, not applied", file=out)
            loop.losses.append(loss)
            due = held_out is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps)
            evaluated = _held_out_record(cfg, trainer, held_out, loop, step + 1, out) if due and held_out else {}
            learning_rate = float(schedule(step)) if board is not None else 0.0  # only TensorBoard shows it
            log_step(cfg, trainer, (log, board), step + 1, loss, metrics, seconds, batch, evaluated, learning_rate)
            if bar is not None:
                bar.update(step + 1, loss, seconds)
            stopping = stop.requested()
            if ckpt is not None:
                # Periodic saves run in the background; data_position is the next batch to read.
                last = step + 1 == cfg.steps or stopping
                ckpt.save(trainer, loop.state, data_position=step + 1, run=run, force=last)
            if stopping:
                loop.stopped_after, loop.signal = step + 1, (stop.received[0], stop.signal_name)
                break
    return loop


def _summary(cfg: TrainConfig, trainer: Trainer, loop: _Loop, out: TextIO) -> float:
    """Print the losses, speed, MFU and memory per device; return the tokens/s after the compile."""
    losses, step_tokens, devices = loop.losses, cfg.batch * cfg.seq, trainer.mesh.devices.size
    mean_tps = step_tokens * loop.timed_steps / loop.timed_seconds if loop.timed_steps else float("nan")
    head, tail = losses[: min(10, len(losses))], losses[-min(10, len(losses)) :]
    print(
        f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} (mean of first/last 10 steps: "
        f"{np.mean(head):.4f} -> {np.mean(tail):.4f}); {mean_tps:,.0f} tokens/s after compile",
        file=out,
    )
    memory = trainer.compile(loop.last_batch).memory_analysis()
    per_device = (memory.argument_size_in_bytes + memory.temp_size_in_bytes) / 2**20 if memory else float("nan")
    print(
        f"summary: {len(losses)} steps on {devices} {jax.devices()[0].platform} device(s), layout "
        f"{trainer.layout.spec()}; {mean_tps:,.0f} tokens/s; {mfu_text(trainer.model, cfg, mean_tps, devices)}; "
        f"{per_device:,.1f} MiB per device (state + temporaries, from the compiled step)",
        file=out,
    )
    return mean_tps


SAMPLE_TEMPERATURE = 0.8  # the sample after training: drawn, not greedy (a small model repeats itself)


def sample_length(model: Model, prompt_tokens: int, wanted: int) -> int:
    """``--sample-tokens``, less what would run past the model's positions (a prompt of 4 tokens
    on the ``tiny`` preset, max_seq 128, samples 124 of 200)."""
    limit = model.decoder.max_seq if model.decoder is not None else model.info.get("max_seq")
    return wanted if limit is None else max(1, min(wanted, limit - prompt_tokens))


def train(cfg: TrainConfig, *, out: TextIO | None = None, progress: bool = True) -> dict[str, Any]:
    """Train the reference GPT on the built-in corpus (or ``cfg.data``) and sample from it.

    Args:
      cfg: the run's configuration.
      out: where the layout, the sharding table and the summary are printed (default: the
        ``sys.stdout`` of the moment of the call).
      progress: show the progress bar on stderr.

    Returns:
      ``{"losses", "first_loss", "last_loss", "tokens_per_s", "sample", "layout", "devices"}``.
    """
    out = sys.stdout if out is None else out
    if not is_primary():  # several processes, one program: process 0 speaks for all
        out = open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the run
    dataset, trainer, chosen = _trainer_for(cfg, out)
    held_out = None
    if cfg.eval_every:  # the last 5% of the text is never trained on
        dataset, held_out = dataset.split(HELD_OUT)
    if cfg.run_dir:  # everything is checked: now the run directory may be written (as asked: "auto")
        cfg = run_dir.prepare(cfg)
    cfg = auto_layout.placed(cfg, chosen)
    run = run_fingerprint(cfg, dataset)
    ckpt, _, first_step = start = _start_or_resume(cfg, trainer, run, out)
    bar = Progress(cfg.steps, cfg.batch * cfg.seq, first=first_step) if progress and is_primary() else None
    if bar is not None and first_step < cfg.steps:
        bar.note(f"compiling the train step ({trainer.layout.spec()}, batch {cfg.batch} x seq {cfg.seq})")
    loop = _steps(cfg, trainer, dataset, start, run, bar, out, held_out)
    devices, layout = trainer.mesh.devices.size, trainer.layout.spec()
    if loop.stopped_after is not None and loop.signal is not None:
        if ckpt is not None:
            ckpt.close()
        how = (
            f"checkpoint step {int(loop.state.step)} saved in {cfg.checkpoint_dir}; run the same command to resume"
            if ckpt is not None
            else "nothing saved (no --checkpoint-dir)"
        )
        print(f"stopped by {loop.signal[1]} after step {loop.stopped_after}: {how}", file=sys.stderr)
        return {"losses": loop.losses, "state": loop.state, "trainer": trainer, "stopped_by": loop.signal[0]}
    if ckpt is not None:
        if first_step >= cfg.steps:
            print(f"checkpoint at step {first_step} already reaches --steps {cfg.steps}; nothing to train", file=out)
        ckpt.close()
        print(f"checkpoints in {cfg.checkpoint_dir}: steps {ckpt.steps()}", file=out)
    if not loop.losses:
        return {"losses": [], "state": loop.state, "trainer": trainer, "layout": layout, "devices": devices}
    mean_tps = _summary(cfg, trainer, loop, out)
    sample = ""
    if cfg.sample_tokens > 0:
        if bar is not None:
            bar.note(f"sampling {cfg.sample_tokens} tokens")
        prompt = dataset.encode(cfg.prompt) if cfg.prompt else dataset.tokens[:1].astype(np.int32)
        sampled = generate(
            trainer.model,
            loop.state.params,
            [prompt.tolist()],
            sample_length(trainer.model, len(prompt), cfg.sample_tokens),
            temperature=SAMPLE_TEMPERATURE,
            seed=cfg.seed,
        )[0]
        sample = dataset.decode(np.concatenate([prompt, np.asarray(sampled, np.int32)]))
        print("sample:\n" + sample, file=out)
    return {
        "losses": loop.losses,
        "first_loss": loop.losses[0],
        "last_loss": loop.losses[-1],
        "tokens_per_s": mean_tps,
        "sample": sample,
        "layout": layout,
        "devices": devices,
        "skipped_steps": loop.skipped,
        "eval_losses": loop.evals,
        "state": loop.state,
        "trainer": trainer,
    }
