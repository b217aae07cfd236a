"""A saved ``shardkit train`` run, read back: its parameters exported as a Hugging Face checkpoint
(``shardkit export``) or evaluated on the held-out text (``shardkit eval``)."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import shutil
import sys
from typing import Any, TextIO

import optax

from shardkit.cli.run_inputs import dataset_of, saved_model, tokenizer_path
from shardkit.cli.run_log import HELD_OUT, evaluate_held_out
from shardkit.core.config import TrainConfig
from shardkit.core.errors import CheckpointError
from shardkit.io import tokenizer
from shardkit.models import hf, peft
from shardkit.models.gpt import GPTConfig
from shardkit.runtime.distributed import is_primary
from shardkit.training.checkpoint import Checkpointer
from shardkit.training.train import Trainer


def with_recorded_model(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the model settings its run's newest checkpoint records (``--model``,
    ``--init-from``, LoRA's) wherever the command line left them at their defaults, so a saved
    run is named by ``--checkpoint-dir`` alone."""
    ckpt = Checkpointer(cfg.checkpoint_dir or "")
    newest = ckpt.latest_step() if cfg.checkpoint_dir and pathlib.Path(cfg.checkpoint_dir).is_dir() else None
    if newest is None:
        return cfg
    recorded = (ckpt.record(newest).get("run") or {}).get("model") or {}
    defaults = TrainConfig()
    given = {k: v for k, v in recorded.items() if hasattr(cfg, k) and getattr(cfg, k) == getattr(defaults, k)}
    if cfg.init_from and "model" in given:  # an --init-from on the command line names the model itself
        given.pop("model")
    return dataclasses.replace(cfg, **given) if given else cfg


def restore_params(
    cfg: TrainConfig, step: int | None = None, layout: str = "data=-1", model: tuple[GPTConfig, str] | None = None
) -> tuple[Trainer, Any, dict]:
    """The parameters of a saved ``shardkit train`` run, laid out by ``layout``.

    ``cfg`` names the run's model as its flags did (``model`` or ``init_from``, and ``tokenizer``,
    which sets a preset's vocabulary) and its ``checkpoint_dir``; the optimizer state is not read.
    ``model``: the run's ``(GPTConfig, name)`` when the caller already has it.

    Returns:
      ``(trainer, state, record)``: a trainer of the model (the checkpoint's precision), the
      state with its parameters, and the checkpoint's record.
    """
    cfg = with_recorded_model(cfg)
    gpt_cfg, name = model if model is not None else saved_model(cfg)
    ckpt = Checkpointer(cfg.checkpoint_dir or "")
    newest = ckpt.latest_step()
    precision = ckpt.record(step if step is not None else newest)["precision"] if newest is not None else "fp32"
    trainer = Trainer(gpt_cfg.model(name=name), optax.sgd(0.0), layout, precision=precision)
    state, record = ckpt.restore(trainer, step, reset_optimizer=True)
    return trainer, state, record


def export_checkpoint(cfg: TrainConfig, out: str, step: int | None = None, adapter_only: bool = False) -> pathlib.Path:
    """Write the parameters of a ``shardkit train`` checkpoint as a Hugging Face checkpoint
    (LoRA adapters merged into their weights), or its LoRA adapter alone in peft's format.

    Args:
      cfg: the run's model flags (``model`` or ``init_from``, whose config.json's other keys are
        kept; ``tokenizer``, copied into ``out``) and its ``checkpoint_dir``.
      out: the new directory.
      step: the step to export; None: the newest that verifies.
      adapter_only: write the run's LoRA adapter in peft's format (``adapter_config.json`` naming
        the base, ``adapter_model.safetensors``).

    Returns:
      ``out``.
    """
    if pathlib.Path(out).exists():
        raise CheckpointError(f"{out} exists; export writes a new directory (remove it or choose another).")
    cfg = with_recorded_model(cfg)
    gpt_cfg, name = saved_model(cfg)
    if adapter_only and gpt_cfg.lora is None:
        raise CheckpointError(f"--adapter-only: the run in {cfg.checkpoint_dir} trained no LoRA adapters.")
    _, state, record = restore_params(cfg, step, model=(gpt_cfg, name))
    if adapter_only:
        written = peft.write_adapter(state.params, gpt_cfg, out, base=cfg.init_from)
        if is_primary():
            print(
                f"wrote {written} (LoRA adapter, step {record['step']} of {cfg.checkpoint_dir}, base {cfg.init_from})"
            )
        return written
    base = hf.read_config(cfg.init_from) if cfg.init_from else None
    weights, merged_cfg = peft.merged(state.params, gpt_cfg)  # adapters folded into their weights
    written = hf.save_pretrained(weights, merged_cfg, out, base_config=base)
    path = tokenizer_path(cfg)
    if path and is_primary():
        shutil.copyfile(path, written / tokenizer.FILE)  # a checkpoint ships the tokenizer it was trained with
    if is_primary():
        print(f"wrote {written} (step {record['step']} of {cfg.checkpoint_dir}, model {name})")
    return written


def eval_checkpoint(cfg: TrainConfig, step: int | None = None, out: TextIO | None = None) -> dict[str, Any]:
    """Held-out loss and perplexity of a saved run: ``cfg.eval_batches`` batches of ``cfg.batch``
    x ``cfg.seq`` from the last 5% of the text (the part ``--eval-every`` holds out), under
    ``cfg.layout``. Prints one line; returns ``{"step", "eval_loss", "eval_perplexity", ...}``."""
    out = sys.stdout if out is None else out
    trainer, state, record = restore_params(cfg, step, cfg.layout)
    _, held_out = dataset_of(cfg).split(HELD_OUT)
    loss = evaluate_held_out(cfg, trainer, held_out, state.params)
    result = {
        "step": record["step"],
        "eval_loss": loss,
        "eval_perplexity": math.exp(loss),
        "batches": cfg.eval_batches,
        "tokens_per_batch": cfg.batch * cfg.seq,
    }
    if is_primary():
        print(
            f"{cfg.checkpoint_dir} step {record['step']}: held-out loss {loss:.4f}, perplexity {math.exp(loss):.2f} "
            f"({cfg.eval_batches} batches of {cfg.batch} x {cfg.seq}, layout {trainer.layout.spec()})",
            file=out,
        )
    return result
