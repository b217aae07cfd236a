"""Corpora packed into training rows with Grain: JSONL documents, plain text, pre-tokenized arrays.

Documents are tokenized and joined, with the tokenizer's end-of-text token between them when it
has one, then cut into rows of ``seq + 1`` tokens: concatenate-then-split packing, as nanoGPT,
Levanter and MaxText pack pre-training text. The rows are a Grain ``MapDataset``, shuffled with
the seed (each epoch its own permutation) and read by index, so row ``r`` of the global batch of
step ``s`` is element ``s * batch + r`` of one fixed sequence wherever it is read:

- a process reads only the rows of its own devices (``trainer.local_rows``);
- the data position of a run is its step, which every checkpoint records, so a run resumed on
  another layout or process count reads exactly the batches it would have read. Grain's
  ``DataLoader`` keeps an iterator state per process shard instead, which does not carry over
  to another process count; keying the order by the global index is what makes it carry.

Pre-tokenized arrays are memory-mapped (``.npy`` of any integer type; ``.bin`` as nanoGPT writes
it, uint16), so a corpus larger than memory is read a row at a time.

Example:
  >>> ds = PackedDataset(np.arange(1000, dtype=np.int32), seed=0, vocab=1000)
  >>> ds.batch(step=0, batch_size=4, seq_len=9)["tokens"].shape
  (4, 10)
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import numpy as np

from shardkit.core.errors import InputError
from shardkit.io.data import TextDataset, read_jsonl

SUFFIXES = (".jsonl", ".npy", ".bin")
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def is_packed_source(path: str | os.PathLike[str]) -> bool:
    """Whether ``--data PATH`` names a source read through Grain (by its suffix)."""
    return pathlib.Path(path).suffix in SUFFIXES


def _eos_id(tokenizer: Any) -> int | None:
    for name in _EOS_NAMES:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return int(found)
    return None


def _jsonl_tokens(path: pathlib.Path, tokenizer: Any, field: str) -> tuple[np.ndarray, np.ndarray]:
    """Every document's tokens, joined (end-of-text between documents when the tokenizer has one),
    and each token's document (0, 1, ...; a separator belongs to the document it ends)."""
    texts = []
    for number, record in read_jsonl(path, "--data"):
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise InputError(f"--data {path}: line {number} has no string field {field!r} (the document's text).")
        texts.append(record[field])
    if not texts:
        raise InputError(f"--data {path}: no documents.")
    if tokenizer is None:  # byte tokens; a blank line ends each document
        pieces = [np.frombuffer((t + "\n\n").encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]
    else:
        eos = _eos_id(tokenizer)
        pieces = [np.asarray(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(texts)]
        if eos is not None:
            pieces = [np.append(p, np.int32(eos)) for p in pieces]
    documents = np.repeat(np.arange(len(pieces), dtype=np.int32), [len(p) for p in pieces])
    return np.concatenate(pieces), documents


def _array_tokens(path: pathlib.Path) -> np.ndarray:
    if path.suffix == ".bin":  # nanoGPT's prepare.py: raw uint16 token ids
        return np.memmap(path, dtype=np.uint16, mode="r")
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InputError(
            f"--data {path}: a .npy corpus is one 1-D array of token ids, not {tokens.dtype}{tokens.shape}."
        )
    return tokens


@dataclasses.dataclass(frozen=True)
class PackedDataset(TextDataset):
    """Token rows packed from a corpus and shuffled by Grain; batches by ``(seed, step)`` as
    :class:`TextDataset`'s, so the two serve the same training loop.

    Attributes:
      documents: each token's document (a ``.jsonl`` corpus): batches then carry
        ``"segments"``, so a row's documents never attend to each other
        (:mod:`shardkit.models.segments`). None for token arrays, whose documents are unknown.
    """

    documents: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], tokenizer: Any = None, seed: int = 0, field: str = "text"
    ) -> PackedDataset:
        """Read a ``.jsonl`` (one JSON object per document, its text under ``field``), ``.npy``
        or ``.bin`` corpus; documents are cut by ``tokenizer`` (bytes when None)."""
        p = pathlib.Path(path)
        if not p.is_file():
            raise InputError(f"--data {p}: no such file.")
        documents = None
        if p.suffix == ".jsonl":
            tokens, documents = _jsonl_tokens(p, tokenizer, field)
        else:
            tokens = _array_tokens(p)
        if tokenizer is not None:
            vocab = tokenizer.get_vocab_size()
        elif p.suffix == ".jsonl":
            vocab = TextDataset.VOCAB
        else:
            vocab = int(tokens.max()) + 1  # streamed over a memory map: no copy
        return cls(tokens, seed, vocab, tokenizer, documents=documents)

    def windows(self, step: int, batch_size: int, seq_len: int, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of step ``step``'s global batch: packed rows ``step * batch_size + r`` of
        the shuffled, repeated sequence of non-overlapping ``seq_len + 1`` windows."""
        import grain  # imported when a packed corpus is read: the package imports without it

        span = seq_len + 1
        count = len(self.tokens) // span
        tokens = self.tokens
        packed = (
            grain.MapDataset.range(count)
            .shuffle(seed=self.seed)
            .repeat()
            .map(lambda w: np.asarray(tokens[w * span : (w + 1) * span], dtype=np.int32))
        )
        return np.stack([packed[step * batch_size + int(r)] for r in rows])

    def split(self, held_out: float = 0.05) -> tuple[TextDataset, TextDataset]:
        """As :meth:`TextDataset.split`, each part keeping its tokens' documents."""
        train, test = super().split(held_out)
        if self.documents is None:
            return train, test
        cut = len(train.tokens)
        return (
            dataclasses.replace(self, tokens=train.tokens, documents=self.documents[:cut]),
            dataclasses.replace(self, tokens=test.tokens, documents=self.documents[cut:]),
        )

    def window_extras(self, step: int, batch_size: int, seq_len: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """``segments``: each row's documents numbered from 1 (a row may start inside a document:
        concatenate-then-split cuts documents, and never lets one attend to another)."""
        if self.documents is None:
            return {}
        import grain

        span = seq_len + 1
        order = grain.MapDataset.range(len(self.tokens) // span).shuffle(seed=self.seed).repeat()
        windows = [int(order[step * batch_size + int(r)]) for r in rows]
        docs = np.stack([self.documents[w * span : (w + 1) * span] for w in windows])
        return {"segments": (docs - docs[:, :1] + 1).astype(np.int32)}
