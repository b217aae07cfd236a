"""Tokenizers: a byte-level BPE trained on the built-in corpus with the ``tokenizers`` library,
datasets cut by it, and the main job trained on its tokens (the preset's vocabulary follows it)."""

import io
import json
import pathlib

import numpy as np
import pytest
from tokenizers import Tokenizer

from shardkit.cli.commands import main
from shardkit.cli.run import train
from shardkit.core.config import TrainConfig
from shardkit.core.errors import InputError, ModelError
from shardkit.io.data import TextDataset, builtin_corpus
from shardkit.io.tokenizer import FILE, load, train_bpe

TEXT = builtin_corpus()[:200_000]
SMALL = dict(batch=8, seq=32, layout="fsdp=8", steps=2, sample_tokens=0)


def test_trained_bpe_round_trips_text_and_shortens_it(tmp_path):
    tok = train_bpe(TEXT, 512, tmp_path / "tok.json")
    assert tok.get_vocab_size() == 512
    sample = TEXT[:5000].decode("utf-8", errors="replace")
    ids = tok.encode(sample).ids
    assert tok.decode(ids) == sample  # byte-level: nothing is unknown, nothing lost
    assert len(ids) < 0.6 * len(sample.encode())
    again = Tokenizer.from_file(str(tmp_path / "tok.json"))  # the file is the library's own format
    assert again.encode(sample).ids == ids


def test_dataset_cut_by_a_tokenizer(tmp_path):
    tok = train_bpe(TEXT, 400)
    ds = TextDataset.from_text(TEXT, tok, seed=3)
    assert ds.vocab == 400 and ds.tokens.max() < 400
    rows = ds.batch(0, 4, 16)["tokens"]
    assert rows.shape == (4, 17) and rows.dtype == np.int32
    train_part, held = ds.split(0.1)
    assert held.tokenizer is tok and held.vocab == 400
    assert len(train_part.tokens) + len(held.tokens) == len(ds.tokens)
    assert ds.decode(ds.encode("def f(x):")) == "def f(x):"


@pytest.mark.slow
def test_cli_trains_a_tokenizer_and_the_main_job_uses_it(tmp_path):
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--vocab", "512", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["model"]["type"] == "BPE"
    log, ck = io.StringIO(), str(tmp_path / "ck")
    cfg = TrainConfig(model="tiny", tokenizer=str(out), checkpoint_dir=ck, checkpoint_every=2, **SMALL)
    result = train(cfg, out=log, progress=False)
    assert result["state"].params["embed"].shape == (512, 64)  # the preset's vocabulary is the tokenizer's
    assert "vocab 512" in log.getvalue()
    assert abs(result["losses"][0] - np.log(512)) < 1.0  # an untrained model: about uniform over 512 tokens
    exported = tmp_path / "hf"
    assert (
        main(["export", "--model", "tiny", "--tokenizer", str(out), "--checkpoint-dir", ck, "--out", str(exported)])
        == 0
    )
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == 512
    assert (exported / FILE).read_text() == out.read_text()  # the export ships its tokenizer


def test_an_init_from_checkpoint_brings_its_tokenizer(tmp_path):
    """A Hugging Face directory with tokenizer.json: --init-from uses it unless --tokenizer says otherwise;
    a model whose vocabulary is smaller than the tokenizer's is refused before anything compiles."""
    from test_hf import write_checkpoint

    write_checkpoint(tmp_path / "ck")  # vocab 96
    train_bpe(TEXT, 300, tmp_path / "ck" / FILE)
    with pytest.raises(ModelError, match="vocab 96 < the tokenizer's 300"):
        train(TrainConfig(init_from=str(tmp_path / "ck"), **SMALL), out=io.StringIO(), progress=False)


def test_bad_tokenizer_paths_and_sizes_are_refused(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot be read"):
        load(tmp_path / "bad.json")
    with pytest.raises(InputError, match="at least the 256"):
        train_bpe(TEXT, 100)
    with pytest.raises(InputError, match="no such file"):
        train(TrainConfig(model="tiny", tokenizer=str(tmp_path / "nope.json"), **SMALL), out=io.StringIO())
    assert pathlib.Path(tmp_path / "nope.json").exists() is False
