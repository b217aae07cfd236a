"""Tokenizers as Hugging Face's ``tokenizers`` library writes them (``tokenizer.json``): one that
ships with a checkpoint, or a byte-level BPE trained here on your text.

Byte tokens (vocabulary 256, no file) stay the default of the main job; a tokenizer is a choice.

Example:
  >>> tok = train_bpe(b"the cat sat on the mat. " * 200, vocab_size=300)
  >>> tok.get_vocab_size() <= 300, tok.decode(tok.encode("the cat").ids)
  (True, 'the cat')
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from shardkit.core.errors import InputError

FILE = "tokenizer.json"


def tokenizer_file(path: str | os.PathLike[str]) -> pathlib.Path:
    """``path`` itself if it is a file, else ``path/tokenizer.json``; refused if neither exists."""
    p = pathlib.Path(path)
    found = p if p.is_file() else p / FILE
    if not found.is_file():
        raise InputError(
            f"--tokenizer {p}: no such file (nor {FILE} inside it). Give a tokenizer.json, e.g. one made by "
            "'shardkit tokenizer train --vocab 1024 --out tokenizer.json'."
        )
    return found


def load(path: str | os.PathLike[str]) -> Any:
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` (or of a directory holding one)."""
    from tokenizers import Tokenizer  # a Rust extension: imported when a tokenizer is asked for

    found = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(found))
    except Exception as e:  # the library raises a bare Exception for an unreadable file
        raise InputError(f"--tokenizer {found} cannot be read as a tokenizers file: {e}") from e


def train_bpe(text: bytes, vocab_size: int, out: str | os.PathLike[str] | None = None) -> Any:
    """A byte-level BPE tokenizer (GPT-2's scheme: every byte is a token, so nothing is unknown)
    with ``vocab_size`` tokens (fewer when the text offers no more merges), trained on ``text``.

    Args:
      text: UTF-8 bytes to learn merges from.
      vocab_size: tokens in the vocabulary, at least the 256 bytes.
      out: write the ``tokenizer.json`` here when given.

    Returns:
      The ``tokenizers.Tokenizer``.
    """
    if not isinstance(vocab_size, int) or vocab_size < 256:
        raise InputError(f"--vocab {vocab_size!r}: a byte-level BPE needs at least the 256 byte tokens.")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    lines = text.decode("utf-8", errors="replace").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer)
    if out is not None:
        pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(out))
    return tok
