"""Instruction data: prompts and completions, or chats, rendered, masked and packed.

A ``.jsonl`` file whose rows are ``{"prompt": ..., "completion": ...}`` or ``{"messages":
[{"role": ..., "content": ...}, ...]}`` is fine-tuning data (:func:`is_instruction_file`):

- each row is rendered as text: by the checkpoint's chat template (``tokenizer_config.json``'s
  ``chat_template``, rendered in jinja2's sandbox as transformers renders it, with
  ``add_generation_prompt``, ``bos_token`` and ``eos_token``), or by a plain built-in template
  when there is none (:data:`PLAIN`); a prompt/completion row is the chat ``[user, assistant]``;
- only the completion's, or the assistant turns', tokens are scored (``loss_mask``): each
  assistant turn's text is found as the difference between the chat rendered up to it (with the
  generation prompt) and rendered through it, and a token is scored when its characters lie in
  such a span;
- rows are packed whole into training rows of ``seq + 1`` tokens, never across a document
  (``segments``: 1..k per row, 0 padding; :mod:`shardkit.models.segments`); a row longer than
  ``seq + 1`` is cut (:meth:`InstructionDataset.truncated` counts them);
- the packed rows are shuffled per epoch by the seed (Grain), read by ``(step, row)`` as every
  dataset here is.

Example:
  >>> ds = InstructionDataset.from_rows([{"prompt": "2+2=", "completion": "4"}] * 8, seed=0)
  >>> batch = ds.batch(0, batch_size=2, seq_len=31)
  >>> sorted(batch), int(batch["loss_mask"][0].sum()) > 0
  (['loss_mask', 'segments', 'tokens'], True)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardkit.core.errors import InputError
from shardkit.io.data import TextDataset, read_jsonl

# The built-in template for checkpoints without a chat template (and byte tokens).
PLAIN = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}### Assistant:\n{{ m['content'] }}{{ eos_token }}\n"
    "{% else %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")


def is_instruction_file(path: str | os.PathLike[str]) -> bool:
    """Whether a ``.jsonl`` file's first row is a prompt/completion pair or a chat."""
    p = pathlib.Path(path)
    if p.suffix != ".jsonl" or not p.is_file():
        return False
    with p.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and ("messages" in first or "prompt" in first)
    return False


def chat_of(row: Any, where: str) -> list[dict[str, str]]:
    """A row as a chat: ``messages`` checked, or ``[user: prompt, assistant: completion]``."""
    if not isinstance(row, Mapping):
        raise InputError(f"{where}: a row is a JSON object with 'prompt' and 'completion', or 'messages'.")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects.")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise InputError(
                    f"{where}: message {i} must be {{'role': one of {list(ROLES)}, 'content': a string}}, got {m!r}."
                )
        if not any(m["role"] == "assistant" for m in messages):
            raise InputError(f"{where}: the chat has no assistant turn, so nothing in it would be trained on.")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
        raise InputError(f"{where}: a row needs string fields 'prompt' and 'completion' (or a 'messages' list).")
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]


class Template:
    """A chat template compiled in jinja2's immutable sandbox, as transformers renders one."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", where: str = "chat template"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:  # what Hugging Face's templates call on bad input
            raise InputError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise InputError(f"{where} does not compile: {e}.") from e
        self.bos, self.eos, self.where = bos_token, eos_token, where

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool, row: str) -> str:
        from jinja2 import TemplateError

        try:
            return str(
                self.template.render(
                    messages=list(messages),
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos,
                    eos_token=self.eos,
                )
            )
        except (TemplateError, InputError) as e:  # InputError: the template's own raise_exception
            raise InputError(f"{row}: the {self.where} fails to render it ({e}).") from e

    def assistant_spans(self, messages: Sequence[Mapping[str, str]], row: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered chat and the character spans of its assistant turns."""
        text = self.render(messages, False, row)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(self.render(messages[:i], True, row))
            end = len(self.render(messages[: i + 1], False, row))
            if not text.startswith(self.render(messages[: i + 1], False, row)) or start > end:
                raise InputError(
                    f"{row}: the {self.where} renders a chat's beginning differently from the whole chat, so its "
                    "assistant turns cannot be found; give a template whose turns append."
                )
            spans.append((start, end))
        return text, spans


def template_of(checkpoint: str | None) -> Template:
    """The checkpoint's chat template (``tokenizer_config.json``), else :data:`PLAIN`."""
    config = pathlib.Path(checkpoint or "") / "tokenizer_config.json"
    if checkpoint and config.is_file():
        try:
            settings = json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{config} is not JSON ({e.msg} at line {e.lineno}).") from e
        source = settings.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if isinstance(source, str):
            token = lambda key: settings.get(key) if isinstance(settings.get(key), str) else ""
            return Template(source, token("bos_token"), token("eos_token"), where=f"chat template of {config}")
    return Template(PLAIN, where="built-in template")


def encode(text: str, spans: list[tuple[int, int]], tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, mask)``: the text's token ids, and 1 where a token's characters lie in a span."""
    inside = np.zeros(len(text) + 1, bool)
    for start, end in spans:
        inside[start:end] = True
    if tokenizer is None:  # bytes: each character's UTF-8 bytes
        ids: list[int] = []
        flags: list[bool] = []
        for ch, flag in zip(text, inside, strict=False):
            encoded = ch.encode("utf-8")
            ids.extend(encoded)
            flags.extend([bool(flag)] * len(encoded))
        return np.asarray(ids, np.int32), np.asarray(flags, np.float32)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    scored = [bool(inside[a:b].any()) if b > a else False for a, b in encoding.offsets]
    return np.asarray(encoding.ids, np.int32), np.asarray(scored, np.float32)


@dataclasses.dataclass(frozen=True)
class InstructionDataset(TextDataset):
    """Fine-tuning rows (tokens, segments, loss mask) packed from rendered chats; batches by
    ``(seed, step)`` as :class:`TextDataset`'s, so they serve the same training loop.

    Attributes:
      documents: each row's ``(token ids, loss mask)``, in the file's order.
    """

    documents: tuple[tuple[np.ndarray, np.ndarray], ...] = dataclasses.field(default=(), compare=False, repr=False)
    _packed: dict[int, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, documents: Sequence[tuple[np.ndarray, np.ndarray]], seed: int, vocab: int, tokenizer: Any = None):
        tokens = np.concatenate([d for d, _ in documents])
        return cls(tokens, seed, vocab, tokenizer, documents=tuple(documents))

    def truncated(self, seq_len: int) -> int:
        """How many rows are longer than ``seq_len + 1`` tokens, and so cut."""
        return sum(1 for ids, _ in self.documents if len(ids) > seq_len + 1)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Any],
        seed: int = 0,
        tokenizer: Any = None,
        template: Template | None = None,
        where: str = "",
    ) -> InstructionDataset:
        template = template or Template(PLAIN, where="built-in template")
        documents = []
        for number, row in enumerate(rows, 1):
            name = f"{where}row {number}" if where else f"row {number}"
            text, spans = template.assistant_spans(chat_of(row, name), name)
            documents.append(encode(text, spans, tokenizer))
        if not documents:
            raise InputError(f"{where or 'instruction data'}: no rows.")
        vocab = tokenizer.get_vocab_size() if tokenizer is not None else TextDataset.VOCAB
        return cls.of(documents, seed, vocab, tokenizer)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], tokenizer: Any = None, seed: int = 0, checkpoint: str | None = None
    ) -> InstructionDataset:
        """Read a ``.jsonl`` of prompt/completion rows or chats (see the module), rendered with
        ``checkpoint``'s chat template when it has one."""
        rows = [record for _, record in read_jsonl(path, "--data")]
        return cls.from_rows(rows, seed, tokenizer, template_of(checkpoint), where=f"--data {path}: ")

    def packed(self, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, segments, loss_mask)`` rows of ``seq_len + 1``: documents whole, in order,
        greedily, a row closed when the next document does not fit."""
        if seq_len not in self._packed:
            span = seq_len + 1
            rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
            current: list[tuple[np.ndarray, np.ndarray]] = []
            for ids, mask in self.documents:
                ids, mask = ids[:span], mask[:span]
                if sum(len(d) for d, _ in current) + len(ids) > span:
                    rows.append(current)
                    current = []
                current.append((ids, mask))
            rows.append(current)
            tokens, segments, weights = (np.zeros((len(rows), span), t) for t in (np.int32, np.int32, np.float32))
            for r, docs in enumerate(rows):
                at = 0
                for k, (ids, mask) in enumerate(docs, 1):
                    tokens[r, at : at + len(ids)], segments[r, at : at + len(ids)] = ids, k
                    weights[r, at : at + len(ids)] = mask
                    at += len(ids)
            self._packed[seq_len] = tokens, segments, weights
        return self._packed[seq_len]

    def _rows(self, step: int, batch_size: int, seq_len: int, rows: np.ndarray) -> np.ndarray:
        """The packed rows that rows ``rows`` of step ``step``'s global batch read: ``step *
        batch_size + r`` of their per-epoch shuffle by the seed."""
        import grain  # imported when instruction data is read: the package imports without it

        order = grain.MapDataset.range(len(self.packed(seq_len)[0])).shuffle(seed=self.seed).repeat()
        return np.asarray([order[step * batch_size + int(r)] for r in rows], np.int64)

    def windows(self, step: int, batch_size: int, seq_len: int, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of step ``step``'s global batch: packed rows of whole documents."""
        return self.packed(seq_len)[0][self._rows(step, batch_size, seq_len, rows)]

    def window_extras(self, step: int, batch_size: int, seq_len: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The same rows' ``segments`` (each document of a row, 1..k) and ``loss_mask`` (the answers)."""
        _, segments, weights = self.packed(seq_len)
        chosen = self._rows(step, batch_size, seq_len, rows)
        return {"segments": segments[chosen], "loss_mask": weights[chosen]}

    def split(self, held_out: float = 0.05) -> tuple[TextDataset, TextDataset]:
        """``(train, held_out)``: the last ``held_out`` of the rows held out, whole."""
        if not 0.0 < held_out < 1.0:
            raise InputError(f"held_out={held_out} must be in (0, 1).")
        cut = max(1, round(len(self.documents) * (1 - held_out)))
        if cut >= len(self.documents):
            raise InputError(f"{len(self.documents)} rows are too few to hold {held_out:.0%} of them out.")
        make = lambda docs: InstructionDataset.of(docs, self.seed, self.vocab, self.tokenizer)
        return make(self.documents[:cut]), make(self.documents[cut:])
