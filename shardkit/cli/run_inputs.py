"""What a run trains: its model (a GPT preset, or a Hugging Face checkpoint's) and its data (text
windows, or a corpus packed by Grain, cut by bytes or a tokenizer), chosen from its settings."""

from __future__ import annotations

import pathlib
from typing import Any

from shardkit.core.config import TrainConfig
from shardkit.core.errors import InputError, ModelError
from shardkit.io import tokenizer
from shardkit.io.data import TextDataset, builtin_corpus, load_text
from shardkit.io.instructions import InstructionDataset, is_instruction_file
from shardkit.io.packed import PackedDataset, is_packed_source
from shardkit.models import hf, peft
from shardkit.models.gpt import GPTConfig
from shardkit.models.lora import LoRA
from shardkit.training.train import Trainer


def lora_of(cfg: TrainConfig) -> LoRA | None:
    """The run's LoRA: ``--adapter``'s (peft's config), ``--lora-rank``'s, or None."""
    if cfg.adapter:
        return peft.read_lora(cfg.adapter)
    if not cfg.lora_rank:
        return None
    targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    try:
        return LoRA(rank=cfg.lora_rank, alpha=cfg.lora_alpha or 2.0 * cfg.lora_rank, targets=targets)
    except ModelError as e:
        raise InputError(f"--lora-rank/--lora-alpha/--lora-targets: {e}") from e


def model_of(cfg: TrainConfig, vocab: int | None = None) -> tuple[GPTConfig, str]:
    """The GPT of the run and its name: a preset's (its vocabulary the tokenizer's when ``vocab``
    is given), or a Hugging Face checkpoint's (``--init-from``), with the run's LoRA adapters."""
    attention = None if cfg.attention == "auto" else cfg.attention
    options = dict(dropout=cfg.dropout, remat=cfg.remat, attention=attention, lora=lora_of(cfg))
    if cfg.max_seq is not None:
        options["max_seq"] = cfg.max_seq
    if cfg.init_from:
        hf_cfg = hf.read_config(cfg.init_from)
        return hf.gpt_config(hf_cfg, **options), hf_name(cfg)
    if cfg.model not in GPTConfig.preset_names():
        raise ModelError(f"--model {cfg.model!r} is not a preset; choose one of {', '.join(GPTConfig.preset_names())}.")
    sizes = {"vocab": vocab} if vocab is not None else {}
    return GPTConfig.preset(cfg.model, **options, **sizes), f"GPT-{cfg.model}"


def tokenizer_path(cfg: TrainConfig) -> str | None:
    """``--tokenizer``, else the ``--init-from`` checkpoint's own tokenizer.json, else None (bytes)."""
    if cfg.tokenizer:
        return cfg.tokenizer
    shipped = pathlib.Path(cfg.init_from or "") / tokenizer.FILE
    return str(shipped) if cfg.init_from and shipped.is_file() else None


def dataset_of(cfg: TrainConfig) -> TextDataset:
    """The run's text: random windows of a text file or the built-in corpus, a ``.jsonl``,
    ``.npy`` or ``.bin`` corpus packed into rows by Grain (:mod:`shardkit.io.packed`), or
    instruction data: a ``.jsonl`` of prompt/completion rows or chats, rendered by the
    checkpoint's chat template, scored on the answers, packed by document
    (:mod:`shardkit.io.instructions`)."""
    path = tokenizer_path(cfg)
    tok = tokenizer.load(path) if path else None
    if cfg.data and is_instruction_file(cfg.data):  # prompt/completion rows or chats: masked, packed whole
        if cfg.packing == "windows":
            raise InputError(f"--packing windows reads text files; {cfg.data} is instruction data, packed by document.")
        return InstructionDataset.from_file(cfg.data, tok, cfg.seed, checkpoint=cfg.init_from)
    if cfg.data and is_packed_source(cfg.data):
        if cfg.packing == "windows":
            raise InputError(f"--packing windows reads text files; {cfg.data} is read packed (--packing packed).")
        return PackedDataset.from_file(cfg.data, tok, cfg.seed)
    text = load_text(cfg.data) if cfg.data else builtin_corpus()
    ds = TextDataset.from_bytes(text, cfg.seed) if tok is None else TextDataset.from_text(text, tok, cfg.seed)
    return PackedDataset(ds.tokens, ds.seed, ds.vocab, ds.tokenizer) if cfg.packing == "packed" else ds


def hf_name(cfg: TrainConfig) -> str:
    path = pathlib.Path(cfg.init_from or "")
    return f"{hf.read_config(path).get('model_type', 'hf')}:{path.name}"


def fresh_state(cfg: TrainConfig, trainer: Trainer) -> Any:
    """The first state of a new run: initialised, or the ``--init-from`` checkpoint's weights."""
    if not cfg.init_from:
        return trainer.init(cfg.seed)
    gpt_cfg, _ = model_of(cfg)
    params = peft.load_with_adapters(
        cfg.init_from, gpt_cfg, trainer.model, trainer.state_shardings.params, cfg.seed, cfg.adapter
    )
    return trainer.init(cfg.seed, params=params)


def saved_model(cfg: TrainConfig) -> tuple[GPTConfig, str]:
    """The model of a saved run, as its flags named it (a tokenizer sets a preset's vocabulary)."""
    path = tokenizer_path(cfg)
    return model_of(cfg, tokenizer.load(path).get_vocab_size() if path else None)
