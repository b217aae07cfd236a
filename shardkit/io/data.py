"""Real text as byte-level tokens, and deterministic per-step batches.

The built-in corpus is text that every CPython install ships: the documentation topics of
``pydoc_data`` (English prose from the Python reference manual) followed by standard library
source files, so the main job trains on real text with no download.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sysconfig
from typing import Any

import numpy as np

from shardkit.core.errors import InputError

_STDLIB_FILES = (
    "this.py",
    "textwrap.py",
    "string.py",
    "functools.py",
    "dataclasses.py",
    "argparse.py",
    "collections/__init__.py",
    "json/encoder.py",
    "json/decoder.py",
    "pathlib.py",
    "random.py",
    "statistics.py",
    "fractions.py",
    "heapq.py",
    "bisect.py",
    "typing.py",
    "inspect.py",
)


def builtin_corpus(max_bytes: int = 4_000_000) -> bytes:
    """The built-in training text: Python's documentation topics, then stdlib sources.

    Args:
      max_bytes: cut the corpus at this many bytes.

    Returns:
      UTF-8 bytes, the same on every machine with the same Python version.
    """
    from pydoc_data import topics  # ships with CPython: the reference manual's topics as text

    parts = [topics.topics[name] for name in sorted(topics.topics)]
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for rel in _STDLIB_FILES:
        path = stdlib / rel
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(parts).encode("utf-8")[:max_bytes]


def load_text(path: str | pathlib.Path) -> bytes:
    """Read a user's text file (or every ``*.txt`` file of a directory, sorted) as bytes."""
    p = pathlib.Path(path)
    if p.is_dir():
        files = sorted(p.rglob("*.txt"))
        if not files:
            raise InputError(f"--data {p}: the directory has no *.txt files. Point --data at a text file.")
        return b"\n\n".join(f.read_bytes() for f in files)
    if not p.is_file():
        raise InputError(f"--data {p}: no such file. Give the path of a text file (or a directory of *.txt).")
    return p.read_bytes()


def read_jsonl(path: str | os.PathLike[str], flag: str) -> list[tuple[int, Any]]:
    """The JSON value of each non-blank line of ``path`` with its line number (from 1); an
    :class:`InputError` naming ``flag`` (``--data``), the file and the line for one that is not JSON."""
    records = []
    with pathlib.Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise InputError(f"{flag} {path}: line {number} is not JSON ({e.msg}).") from None
    return records


@dataclasses.dataclass(frozen=True)
class TextDataset:
    """Tokens of a text (bytes, vocabulary 256, unless a tokenizer cut them) with deterministic
    random windows per step.

    A batch depends only on ``(seed, step)``, so the data position of a run is its step, a
    restarted run sees the same batches, and each process can cut its own rows of the global batch.

    Example:
      >>> ds = TextDataset.from_bytes(b"hello world " * 100)
      >>> ds.batch(step=0, batch_size=4, seq_len=8)["tokens"].shape
      (4, 9)
    """

    tokens: np.ndarray  # (N,) uint8 bytes, or int32 token ids
    seed: int = 0
    vocab: int = 256
    tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)  # a tokenizers.Tokenizer

    VOCAB = 256  # byte tokens

    def __post_init__(self) -> None:
        if not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise InputError(
                f"TextDataset: seed={self.seed!r}; give an integer >= 0 (numpy's generators take no other)."
            )

    @classmethod
    def from_bytes(cls, text: bytes, seed: int = 0) -> TextDataset:
        """Byte tokens of ``text`` (UTF-8 bytes; encode a ``str`` first)."""
        if not isinstance(text, (bytes, bytearray, memoryview)):
            raise InputError(
                f"TextDataset.from_bytes takes bytes, got {type(text).__name__}. Fix: pass text.encode('utf-8')."
            )
        if not len(text):
            raise InputError("TextDataset.from_bytes got empty text; give it some text to train on.")
        return cls(np.frombuffer(text, dtype=np.uint8).copy(), seed)

    @classmethod
    def from_text(cls, text: bytes, tokenizer: Any, seed: int = 0) -> TextDataset:
        """Tokens of ``text`` (UTF-8 bytes) cut by a ``tokenizers.Tokenizer`` (:mod:`shardkit.io.tokenizer`)."""
        byte_tokens = cls.from_bytes(text, seed)  # the same checks of the text
        ids = tokenizer.encode(bytes(byte_tokens.tokens).decode("utf-8", errors="replace")).ids
        return cls(np.asarray(ids, dtype=np.int32), seed, tokenizer.get_vocab_size(), tokenizer)

    @classmethod
    def builtin(cls, seed: int = 0) -> TextDataset:
        """The built-in corpus (see :func:`builtin_corpus`)."""
        return cls.from_bytes(builtin_corpus(), seed)

    def batch(
        self,
        step: int,
        batch_size: int,
        seq_len: int,
        process_index: int = 0,
        process_count: int = 1,
        *,
        rows: slice | None = None,
    ) -> dict[str, np.ndarray]:
        """Rows of the global batch of ``step`` that belong to ``process_index``.

        Args:
          step: the training step (the data position).
          batch_size: global batch size, divisible by ``process_count``.
          seq_len: tokens per row the model sees; rows hold ``seq_len + 1`` (inputs and targets).
          process_index, process_count: this process's slice of the global batch.
          rows: the rows of the global batch to return (overrides the process split), e.g.
            ``trainer.local_rows(batch_size)``.

        Returns:
          ``{"tokens": (rows of this process, seq_len + 1) int32}``; only those rows are read.
        """
        for name, value, least in (("step", step, 0), ("batch_size", batch_size, 1), ("seq_len", seq_len, 1)):
            if not isinstance(value, (int, np.integer)) or value < least:
                raise InputError(f"{type(self).__name__}.batch: {name}={value!r}; give an integer >= {least}.")
        if len(self.tokens) <= seq_len + 1:
            raise InputError(
                f"The text has {len(self.tokens)} tokens, too few for windows of seq_len+1={seq_len + 1}. "
                "Use more text or a shorter --seq."
            )
        if batch_size % process_count:
            raise InputError(
                f"Global batch {batch_size} does not divide over {process_count} processes; "
                f"use a multiple of {process_count}."
            )
        per = batch_size // process_count
        mine = np.arange(batch_size)[
            rows if rows is not None else slice(process_index * per, (process_index + 1) * per)
        ]
        return {
            "tokens": self.windows(step, batch_size, seq_len, mine),
            **self.window_extras(step, batch_size, seq_len, mine),
        }

    def window_extras(self, step: int, batch_size: int, seq_len: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """What else :meth:`windows`' rows carry, shaped as their tokens: ``segments`` (the
        documents of each row, 1..k) where the corpus knows its documents, ``loss_mask`` where
        only some tokens are scored; none for plain text."""
        return {}

    def windows(self, step: int, batch_size: int, seq_len: int, rows: np.ndarray) -> np.ndarray:
        """``(len(rows), seq_len + 1)`` int32: rows ``rows`` of step ``step``'s global batch, each a
        window of the text starting at a random place drawn from ``(seed, step)``."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - seq_len - 1, size=batch_size)
        return np.stack([self.tokens[s : s + seq_len + 1] for s in starts[rows]]).astype(np.int32)

    def split(self, held_out: float = 0.05) -> tuple[TextDataset, TextDataset]:
        """``(train, held_out)``: the text cut in two at ``1 - held_out`` of its tokens, so no
        window of the held-out part was trained on.

        Example:
          >>> train, test = TextDataset.from_bytes(b"x" * 1000).split(0.1)
          >>> len(train.tokens), len(test.tokens)
          (900, 100)
        """
        if not 0.0 < held_out < 1.0:
            raise InputError(f"TextDataset.split: held_out={held_out!r}; give a fraction in (0, 1), e.g. 0.05.")
        cut = round(len(self.tokens) * (1 - held_out))
        return (
            dataclasses.replace(self, tokens=self.tokens[:cut]),
            dataclasses.replace(self, tokens=self.tokens[cut:]),
        )

    def decode(self, tokens: np.ndarray) -> str:
        if self.tokenizer is not None:
            return str(self.tokenizer.decode(np.asarray(tokens).tolist()))
        return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def encode(self, text: str) -> np.ndarray:
        if self.tokenizer is not None:
            return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
