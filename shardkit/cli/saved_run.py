"""A saved ``shardkit train`` run, read back: its parameters exported as a Hugging Face checkpoint
(``shardkit export``) or evaluated on the held-out text (``shardkit eval``)."""

from __future__ import annotations

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
from shardkit.models import hf
from shardkit.models.gpt import GPTConfig
from shardkit.runtime.distributed import is_primary
from shardkit.training.checkpoint import Checkpointer
from shardkit.training.train import Trainer


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
    gpt_cfg, name = model if model is not None else saved_model(cfg)
    ckpt = Checkpointer(cfg.checkpoint_dir or "")
    newest = ckpt.latest_step()
    precision = ckpt.record(step if step is not None else newest)["precision"] if newest is not None else "fp32"
    trainer = Trainer(gpt_cfg.model(name=name), optax.sgd(0.0), layout, precision=precision)
    state, record = ckpt.restore(trainer, step, reset_optimizer=True)
    return trainer, state, record


def export_checkpoint(cfg: TrainConfig, out: str, step: int | None = None) -> pathlib.Path:
    """Write the parameters of a ``shardkit train`` checkpoint as a Hugging Face checkpoint.

    Args:
      cfg: the run's model flags (``model`` or ``init_from``, whose config.json's other keys are
        kept; ``tokenizer``, copied into ``out``) and its ``checkpoint_dir``.
      out: the new directory.
      step: the step to export; None: the newest that verifies.

    Returns:
      ``out``.
    """
    if pathlib.Path(out).exists():
        raise CheckpointError(f"{out} exists; export writes a new directory (remove it or choose another).")
    gpt_cfg, name = saved_model(cfg)
    _, state, record = restore_params(cfg, step, model=(gpt_cfg, name))
    base = hf.read_config(cfg.init_from) if cfg.init_from else None
    written = hf.save_pretrained(state.params, gpt_cfg, out, base_config=base)
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
