"""Corpora packed into rows by Grain: JSONL documents with a tokenizer, memory-mapped .npy/.bin
token arrays; every window once per epoch, each process its own rows, and a run resumed on two
processes of four devices reading exactly the batches one process of eight would have."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import TEST_XLA_FLAGS

from shardkit.cli.run import train
from shardkit.core.config import TrainConfig
from shardkit.core.errors import InputError
from shardkit.io.data import builtin_corpus
from shardkit.io.packed import PackedDataset
from shardkit.io.tokenizer import train_bpe

TEXT = builtin_corpus()[:120_000].decode("utf-8", errors="replace")


def write_jsonl(path, n=60):
    docs = [TEXT[i * 2000 : (i + 1) * 2000] for i in range(n)]
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = train_bpe(TEXT.encode(), 400)
    tok.add_special_tokens(["<|endoftext|>"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def test_jsonl_documents_are_tokenized_joined_and_cut_into_rows(tmp_path, tokenizer):
    tok, _ = tokenizer
    docs = write_jsonl(tmp_path / "c.jsonl")
    ds = PackedDataset.from_file(tmp_path / "c.jsonl", tok, seed=1)
    eos = tok.token_to_id("<|endoftext|>")
    expected = np.concatenate([np.append(tok.encode(d).ids, eos) for d in docs])
    np.testing.assert_array_equal(ds.tokens, expected)
    assert ds.vocab == tok.get_vocab_size()
    seq, batch = 31, 8
    windows = {tuple(expected[w * 32 : w * 32 + 32]) for w in range(len(expected) // 32)}
    for step in range(5):  # each row is one of the non-overlapping windows of the stream
        assert all(tuple(row) in windows for row in ds.batch(step, batch, seq)["tokens"])
    assert (
        ds.batch(0, batch, seq)["tokens"].tolist()
        != PackedDataset.from_file(tmp_path / "c.jsonl", tok, seed=2).batch(0, batch, seq)["tokens"].tolist()
    )  # the seed shuffles
    # Each row says where its documents begin: a new segment right after each end-of-text.
    batch = ds.batch(3, batch, seq)
    for row, segments in zip(batch["tokens"], batch["segments"], strict=True):
        assert segments[0] == 1 and np.all(np.diff(segments) >= 0)
        ends = np.flatnonzero(row[:-1] == eos)
        assert np.array_equal(np.flatnonzero(np.diff(segments)), ends)  # a new document after each eos, only there
    _, held_out = ds.split(0.25)
    assert held_out.batch(0, 2, seq)["segments"].shape == (2, seq + 1)


def test_each_process_reads_its_own_rows_of_one_global_order(tmp_path):
    tokens = np.arange(100_000, dtype=np.int32) % 5000
    np.save(tmp_path / "t.npy", tokens)
    ds = PackedDataset.from_file(tmp_path / "t.npy", seed=0)
    assert isinstance(ds.tokens, np.memmap) and ds.vocab == 5000  # memory-mapped, not read whole
    whole = ds.batch(7, 16, 63)["tokens"]
    for count in (2, 4, 8):
        parts = [ds.batch(7, 16, 63, p, count)["tokens"] for p in range(count)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(ds.batch(7, 16, 63, rows=slice(4, 8))["tokens"], whole[4:8])
    # One epoch is every window once: 100,000 tokens hold 1,562 windows of 64; 97 steps of 16 rows.
    first = np.concatenate(
        [PackedDataset(np.arange(100_000), 0, 100_000).batch(s, 16, 63)["tokens"] for s in range(97)]
    )
    assert np.all(first[:, 0] % 64 == 0) and len(set(first[:, 0].tolist())) == 97 * 16


def test_nanogpt_bin_files_are_uint16_memory_maps(tmp_path):
    tokens = (np.arange(50_000) % 50_257).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    ds = PackedDataset.from_file(tmp_path / "train.bin")
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.dtype == np.uint16
    row = ds.batch(0, 1, 99)["tokens"][0]
    assert row.dtype == np.int32 and row[0] % 100 == 0 and np.all(np.diff(row) == 1)  # one whole window


def test_plain_text_goes_through_grain_when_asked(tmp_path):
    """--packing packed: the built-in corpus's bytes, cut into shuffled non-overlapping rows."""
    from shardkit.cli.run_inputs import dataset_of

    ds = dataset_of(TrainConfig(packing="packed"))
    assert isinstance(ds, PackedDataset) and ds.vocab == 256
    row = ds.batch(0, 4, 63)["tokens"]
    assert all(bytes(r.astype(np.uint8)) in builtin_corpus() for r in row)
    assert type(dataset_of(TrainConfig())).__name__ == "TextDataset"  # the default: random windows
    (tmp_path / "c.jsonl").write_text('{"text": "abc"}\n')
    with pytest.raises(InputError, match="--packing packed"):
        dataset_of(TrainConfig(data=str(tmp_path / "c.jsonl"), packing="windows"))


def test_bad_corpora_are_refused_with_their_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(InputError, match="line 2 is not JSON"):
        PackedDataset.from_file(tmp_path / "bad.jsonl")
    (tmp_path / "field.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(InputError, match="no string field 'text'"):
        PackedDataset.from_file(tmp_path / "field.jsonl")
    np.save(tmp_path / "two.npy", np.zeros((4, 4), np.int32))
    with pytest.raises(InputError, match="1-D array"):
        PackedDataset.from_file(tmp_path / "two.npy")
    with pytest.raises(InputError, match="no such file"):
        PackedDataset.from_file(tmp_path / "missing.jsonl")


@pytest.mark.slow
def test_resume_on_two_processes_continues_one_processs_data_order(tmp_path, tokenizer):
    """1 process x 8 devices for 4 steps, against 2 steps there and 2 more on 2 processes x 4
    devices under another layout: the last two losses agree, so the batches were the same."""
    _, tok_path = tokenizer
    write_jsonl(tmp_path / "c.jsonl")
    settings = dict(model="tiny", data=str(tmp_path / "c.jsonl"), tokenizer=str(tok_path), batch=8, seq=32)
    flags = ["--model", "tiny", "--data", settings["data"], "--tokenizer", str(tok_path), "--batch", "8", "--seq", "32"]
    constant = dict(lr_schedule="constant", warmup=0, sample_tokens=0)  # the lr does not depend on --steps
    straight = train(TrainConfig(layout="fsdp=8", steps=4, **constant, **settings), out=io.StringIO())
    ck = str(tmp_path / "ck")
    train(TrainConfig(layout="fsdp=8", steps=2, checkpoint_dir=ck, **constant, **settings), out=io.StringIO())
    log = tmp_path / "resumed.jsonl"
    resume = [*flags, "--layout", "data=2,fsdp=4", "--steps", "4", "--lr-schedule", "constant", "--warmup", "0"]
    resume += ["--checkpoint-dir", ck, "--allow-schedule-change", "--json-log", str(log), "--sample-tokens", "0"]
    launch = [sys.executable, "-m", "shardkit.cli", "launch", "--nproc", "2", "--devices-per-proc", "4", "--"]
    proc = subprocess.run(
        [*launch, sys.executable, "-m", "shardkit.cli", "train", *resume],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    resumed = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in resumed] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in resumed], straight["losses"][2:], rtol=2e-5)
