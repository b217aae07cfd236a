"""Instruction data (shardkit.io.instructions): prompt/completion rows and chats rendered by the
checkpoint's chat template (jinja2's sandbox) or the built-in one, only the answers scored,
packed whole into rows; bad rows and templates refused by name; and a LoRA run on chat data
from the command line."""

import io
import json
import pathlib
import shutil

import numpy as np
import pytest

from shardkit.core.errors import InputError
from shardkit.io.instructions import InstructionDataset, Template, template_of

REFERENCE = pathlib.Path(__file__).parent / "fixtures" / "hf_reference"
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ]
}


def text(ids: np.ndarray) -> str:
    return bytes(np.asarray(ids, np.uint8).tolist()).decode()


def scored(ds: InstructionDataset, index: int = 0) -> str:
    ids, mask = ds.documents[index]
    return text(ids[mask > 0])


def test_a_prompt_and_completion_scores_the_completion_only():
    ds = InstructionDataset.from_rows([{"prompt": "2 + 2 =", "completion": " 4"}])
    ids, _ = ds.documents[0]
    assert text(ids) == "### User:\n2 + 2 =\n### Assistant:\n 4\n"
    assert scored(ds) == " 4\n"  # the completion and the end of the turn, nothing of the prompt


def test_a_chat_is_rendered_by_the_checkpoint_s_template_and_scores_the_assistant_turns(tmp_path):
    checkpoint = tmp_path / "ck"
    shutil.copytree(REFERENCE / "qwen3", checkpoint)
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    ds = InstructionDataset.from_rows([CHAT], template=template_of(str(checkpoint)))
    ids, _ = ds.documents[0]
    assert text(ids) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n"
        "<|im_start|>assistant\nRome.<|im_end|>\n"
    )
    assert scored(ds) == "Paris.<|im_end|>\nRome.<|im_end|>\n"


def test_packed_rows_hold_whole_documents_and_every_document_once_per_epoch():
    rows = [{"prompt": f"question {i}?", "completion": " answer " * (i % 4 + 1)} for i in range(40)]
    ds = InstructionDataset.from_rows(rows, seed=3)
    tokens, segments, _ = ds.packed(seq_len=127)
    assert ds.truncated(127) == 0
    documents = [text(ids) for ids, _ in ds.documents]
    found = []
    for row, seg in zip(tokens, segments, strict=True):
        for k in range(1, seg.max() + 1):
            found.append(text(row[seg == k]))
        assert np.all(np.diff(np.flatnonzero(seg == 0)) == 1) and (seg[-1] == 0 or seg.min() > 0)  # padding at the end
    assert sorted(found) == sorted(documents)
    epoch = ds.batch(0, len(tokens), 127)
    assert sorted(map(tuple, epoch["tokens"].tolist())) == sorted(map(tuple, tokens.tolist()))  # a permutation


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "row 1: the chat has no assistant turn"),
        ({"prompt": "hi"}, "row 1: a row needs string fields 'prompt' and 'completion'"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "row 1: message 0 must be"),
        ({"messages": []}, "non-empty list"),
    ],
    ids=["no-assistant", "no-completion", "bad-role", "empty-chat"],
)
def test_a_bad_row_is_refused_naming_it(row, message):
    with pytest.raises(InputError, match=message):
        InstructionDataset.from_rows([row])


def test_a_template_that_fails_is_refused_naming_the_row():
    strict = Template("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}{% endif %}")
    with pytest.raises(InputError, match="row 1: the chat template fails to render it \\(a system turn first\\)"):
        InstructionDataset.from_rows([{"prompt": "hi", "completion": "ho"}], template=strict)
    with pytest.raises(InputError, match="does not compile"):
        Template("{% for %}")


def test_a_lora_run_trains_on_chat_data_from_the_command_line(tmp_path):
    from shardkit.cli.run import train
    from shardkit.core.config import TrainConfig

    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(CHAT if i % 2 else {"prompt": f"{i} + 1 =", "completion": f" {i + 1}"}) + "\n" for i in range(64)
        )
    )
    cfg = TrainConfig(
        init_from=str(REFERENCE / "llama3"),
        lora_rank=4,
        data=str(data),
        steps=3,
        batch=8,
        seq=63,
        layout="data=2,fsdp=2,tensor=2",
        sample_tokens=0,
        lr=1e-2,
        warmup=0,
    )
    log = io.StringIO()
    result = train(cfg, out=log, progress=False)
    assert len(result["losses"]) == 3 and all(np.isfinite(result["losses"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"text": "c"}) + "\n")
    with pytest.raises(InputError, match="row 2: a row needs string fields"):
        train(TrainConfig(data=str(bad), steps=1, sample_tokens=0), out=io.StringIO(), progress=False)
