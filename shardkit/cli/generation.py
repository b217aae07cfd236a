"""``shardkit generate``: continue text with a Hugging Face checkpoint or a saved training run.

One ``--prompt`` (default ``"def "``, as ``train``'s sample) streams its continuation as it is
produced; ``--prompts FILE.jsonl`` (rows of
``{"prompt": "..."}``) runs them as one batch and prints one JSON line per prompt. Text is cut
with the checkpoint's tokenizer (``tokenizer.json``), or into bytes where there is none.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any, TextIO

from shardkit.cli.run_inputs import tokenizer_path
from shardkit.core.config import TrainConfig
from shardkit.core.errors import InputError
from shardkit.io import tokenizer as tokenizers
from shardkit.io.data import read_jsonl
from shardkit.runtime.distributed import is_primary


class Text:
    """Text to token ids and back: a tokenizer.json's, or UTF-8 bytes (vocab 256)."""

    def __init__(self, path: str | None):
        self.tokenizer = tokenizers.load(path) if path else None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return str(self.tokenizer.decode(ids))


def read_prompts(path: str) -> list[str]:
    """The ``"prompt"`` of each JSON line of ``path`` (blank lines skipped)."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise InputError(f'--prompts {path}: no such file (one JSON object per line: {{"prompt": "..."}}).')
    prompts = []
    for number, row in read_jsonl(file, "--prompts"):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise InputError(f'--prompts {path}, line {number}: each line needs a "prompt" string, got {row!r:.80}.')
        prompts.append(row["prompt"])
    if not prompts:
        raise InputError(f"--prompts {path} has no prompts.")
    return prompts


def eos_of(init_from: str | None) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: ``generation_config.json``'s, else ``config.json``'s."""
    if not init_from:
        return ()
    for name in ("generation_config.json", "config.json"):
        file = pathlib.Path(init_from) / name
        if file.is_file():
            try:
                value = json.loads(file.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                continue
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
    return ()


def model_and_params(cfg: TrainConfig, step: int | None, layout: str | None) -> tuple[Any, Any]:
    """The model and parameters to generate with: a saved run's (``--checkpoint-dir``) or a
    Hugging Face checkpoint's (``--init-from`` alone, read straight into ``layout``'s shards)."""
    if cfg.checkpoint_dir:
        from shardkit.cli.saved_run import restore_params

        trainer, state, _ = restore_params(cfg, step)
        return trainer.model, state.params
    if not cfg.init_from:
        raise InputError("generate needs --init-from DIR (a Hugging Face checkpoint) or --checkpoint-dir RUN.")
    from shardkit.cli.run_inputs import lora_of
    from shardkit.models import hf, peft
    from shardkit.models.generate import Placement, check_layout

    gpt = hf.gpt_config(hf.read_config(cfg.init_from), lora=lora_of(cfg))  # --adapter: peft's LoRA on the base
    model = gpt.model(name=pathlib.Path(cfg.init_from).name)
    placement = Placement.of(layout)
    check_layout(gpt.decoder(), placement.mesh)  # before any weight is read
    return model, peft.load_with_adapters(cfg.init_from, gpt, model, placement.params(model), cfg.seed, cfg.adapter)


def run(args: Any, cfg: TrainConfig, out: TextIO | None = None) -> list[dict[str, Any]]:
    """The ``generate`` subcommand: returns one ``{"prompt", "completion", "tokens"}`` per prompt."""
    out = sys.stdout if out is None else out
    if cfg.checkpoint_dir:  # the run's model as its checkpoint records it (its base's tokenizer and eos too)
        from shardkit.cli.saved_run import with_recorded_model

        cfg = with_recorded_model(cfg)
    texts = [args.prompt] if args.prompts is None else read_prompts(args.prompts)
    text = Text(tokenizer_path(cfg))
    prompts = [text.encode(t) for t in texts]
    from shardkit.models.generate import Generator

    model, params = model_and_params(cfg, args.step, args.gen_layout)
    gen = Generator(model, params, args.gen_layout)
    options = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_ids=() if args.ignore_eos else eos_of(cfg.init_from),
    )
    stream = _streamer(text, out) if args.prompts is None and is_primary() else None
    if stream is not None:
        print(args.prompt, end="", file=out, flush=True)
    new = gen.generate(prompts, args.max_new_tokens, on_tokens=stream, **options)
    rows = [{"prompt": t, "completion": text.decode(ids), "tokens": ids} for t, ids in zip(texts, new, strict=True)]
    if is_primary():
        if stream is None:
            for row in rows:
                print(json.dumps(row, ensure_ascii=False), file=out)
        else:
            print(file=out)
        length = max(len(p) for p in prompts) + args.max_new_tokens
        cache = gen.cache_bytes_per_device(len(prompts), length)
        layout = args.gen_layout or "one device"
        print(
            f"[KV cache: {cache / 2**20:.2f} MiB per device for {len(prompts)} x {length} positions, {layout}]",
            file=sys.stderr,
        )
    return rows


def _streamer(text: Text, out: TextIO) -> Callable[[list[list[int]]], None]:
    """Prints the prompt, then each new piece of the continuation as the decode loop hands it back."""
    shown = [""]

    def show(rows: list[list[int]]) -> None:
        now = text.decode(rows[0])
        if now.startswith(shown[0]):
            print(now[len(shown[0]) :], end="", file=out, flush=True)
            shown[0] = now

    return show
