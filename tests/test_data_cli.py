"""The built-in corpus, per-step batches, and the `shardkit train` command end to end."""

import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import TEST_XLA_FLAGS, installed_command, run_cli

import shardkit as sk
from shardkit.cli.progress import Progress


def test_builtin_corpus_is_real_text():
    text = sk.builtin_corpus()
    assert len(text) > 500_000
    decoded = text.decode("utf-8")
    assert "The " in decoded and "def " in decoded  # English prose and Python source
    assert sk.builtin_corpus() == text  # deterministic


def test_batches_are_deterministic_and_split_across_processes():
    ds = sk.TextDataset.builtin(seed=3)
    full = ds.batch(step=7, batch_size=8, seq_len=16)["tokens"]
    assert full.shape == (8, 17) and full.dtype == np.int32
    np.testing.assert_array_equal(full, ds.batch(step=7, batch_size=8, seq_len=16)["tokens"])
    assert not np.array_equal(full, ds.batch(step=8, batch_size=8, seq_len=16)["tokens"])
    halves = [ds.batch(7, 8, 16, process_index=i, process_count=2)["tokens"] for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), full)
    # Rows are windows of the text: targets are the next bytes.
    row = full[0]
    start = bytes(ds.tokens).find(bytes(row.astype(np.uint8)))
    assert start >= 0


def test_user_text_file(tmp_path):
    path = tmp_path / "poem.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    ds = sk.TextDataset.from_bytes(sk.load_text(path))
    assert ds.decode(ds.batch(0, 2, 8)["tokens"][0]) in path.read_text() * 2


@pytest.mark.slow
def test_shardkit_train_end_to_end(tmp_path):
    log = tmp_path / "log.jsonl"
    data = tmp_path / "text.txt"
    data.write_text(sk.builtin_corpus(200_000).decode("utf-8", errors="replace"))
    result = run_cli(
        "train",
        "--model",
        "tiny",
        "--steps",
        "25",
        "--batch",
        "8",
        "--seq",
        "32",
        "--lr",
        "1e-2",
        "--data",
        str(data),
        "--json-log",
        str(log),
        "--sample-tokens",
        "20",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "8 cpu device(s), layout data=2,fsdp=2,tensor=2" in out
    assert "blocks/attn/wqkv" in out and "[-, fsdp, tensor, -, -]" in out
    assert "sample:" in out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 26))
    assert all(set(r) >= {"step", "loss", "tokens_per_s"} for r in records)
    assert np.mean([r["loss"] for r in records[-5:]]) < np.mean([r["loss"] for r in records[:5]]) - 1.0
    assert "step    25/25" in result.stderr  # progress bar
    # What it is doing, and speed without the compile.
    err = result.stderr
    assert err.index("compiling the train step") < err.index("compiled in") < err.index("step    25/25")
    assert re.search(r"step    25/25 .* tok/s \| \d+ ms/step \| elapsed \d+:\d\d \| eta 0:00", err)
    assert "sampling 20 tokens" in err
    assert re.search(
        r"summary: 25 steps on 8 cpu device\(s\), layout data=2,fsdp=2,tensor=2; [\d,]+ tokens/s; "
        r"MFU n/a \(cpu has no published peak[^)]*\); [\d.]+ MiB",
        out,
    )


def test_progress_leaves_the_compile_out_of_the_speed():
    out = io.StringIO()
    progress = Progress(total=100, tokens_per_step=1000, out=out)
    progress.update(1, loss=5.0, seconds=30.0)  # the compile
    for step in range(2, 11):
        progress.update(step, loss=4.0, seconds=0.5)
    text = out.getvalue()
    assert "compiled in 30.0 s" in text
    assert "step    10/100" in text and "2,000 tok/s | 500 ms/step" in text and "eta 0:45" in text


def test_shardkit_train_bad_layout_exits_with_the_fix():
    result = run_cli("train", "--layout", "data=3,tensor=3", "--devices", "8", "--steps", "1")
    assert result.returncode == 2
    assert "needs 9 devices but 8 are available" in result.stderr


def test_readme_library_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## As a library") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "XLA_FLAGS": TEST_XLA_FLAGS},
    )
    assert result.returncode == 0, result.stderr
    assert "blocks/attn/wqkv" in result.stdout
    assert float(result.stdout.strip().splitlines()[-1]) < 5.0


def test_shardkit_console_command_is_installed():
    result = subprocess.run([installed_command(), "train", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--layout" in result.stdout
