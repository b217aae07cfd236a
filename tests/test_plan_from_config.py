"""Dry runs and plans from a checkpoint's config.json alone (``--init-from``), and the shipped
configs of real sizes checked against the parameter counts their makers published."""

from __future__ import annotations

import json
import pathlib

import pytest
import safetensors.numpy

import shardkit as sk
from shardkit.core.config import SHIPPED_CONFIGS
from shardkit.models import hf, published

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf_reference"

# Parameter counts as published, independent of shardkit: the model cards' safetensors totals
# (Llama 3.1, Mixtral, Qwen3's "32.8B"), and for Gemma 3 27B the technical report's Table 1
# (1,416M embedding + 25,600M non-embedding parameters; its 417M vision encoder is not a
# gemma3_text model's).
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.55e9,
    "llama-3.1-405b": 405.85e9,
    "mixtral-8x7b": 46.70e9,
    "qwen3-32b": 32.8e9,
    "gemma-3-27b": 27.016e9,
    # The mixtures: the model cards' totals (Qwen3's "30.5B" and "235B" with 235.1B in its report's
    # table, gpt-oss's 20.9B and 116.8B, DeepSeek-V3's 671B of main model, Kimi K2's 1.04T
    # reported as 1,026B of weights).
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235.1e9,
    "gpt-oss-20b": 20.9e9,
    "gpt-oss-120b": 116.8e9,
    "deepseek-v3": 671.0e9,
    "kimi-k2": 1026e9,
}
FAMILY = {
    "llama-3.1-8b": "llama",
    "llama-3.1-70b": "llama",
    "llama-3.1-405b": "llama",
    "mixtral-8x7b": "mixtral",
    "qwen3-32b": "qwen3",
    "gemma-3-27b": "gemma3_text",
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen3-235b-a22b": "qwen3_moe",
    "gpt-oss-20b": "gpt_oss",
    "gpt-oss-120b": "gpt_oss",
    "deepseek-v3": "deepseek_v3",
    "kimi-k2": "deepseek_v3",
}


def test_every_shipped_config_is_named_in_the_flag_help():
    assert set(published.names()) == set(PUBLISHED_PARAMS) == set(SHIPPED_CONFIGS.split(", "))


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_shipped_config_has_the_published_parameter_count(name):
    config = hf.read_config(published.config_dir(name))
    assert config["model_type"] == FAMILY[name]
    count = hf.gpt_config(config).num_params()
    assert count == pytest.approx(PUBLISHED_PARAMS[name], rel=0.005)


def _checkpoint_params(directory: pathlib.Path) -> int:
    """Elements in the checkpoint's tensors, read from its files (not from shardkit)."""
    total = 0
    for path in directory.glob("*.safetensors"):
        total += sum(a.size for a in safetensors.numpy.load_file(path).values())
    return total


@pytest.mark.parametrize("family", ["mixtral", "gemma3"])
def test_dryrun_from_a_checkpoint_config_counts_its_tensors(family):
    directory = FIXTURES / family
    result = sk.dryrun(init_from=str(directory), layout="fsdp=4,tensor=2", batch=8, seq=32)
    assert result["parameters"] == _checkpoint_params(directory)
    assert result["model"] == f"{json.loads((directory / 'config.json').read_text())['model_type']}:{family}"
    assert result["config"]["init_from"] == str(directory)


def test_dryrun_of_llama_3_1_8b_holds_an_eighth_of_its_weights():
    result = sk.dryrun(
        init_from="llama-3.1-8b", layout="fsdp=8", batch=8, seq=128, precision="bf16-master", remat="full"
    )
    params = 8_030_261_248  # the model card's count, to the parameter
    assert result["parameters"] == params
    # bf16 parameters and an fp32 master copy, each matrix split eight ways (every dimension
    # divides); the RMSNorm scales (two a layer and the final one, 4,096 each) stay whole.
    norms = (2 * 32 + 1) * 4096
    assert result["memory"]["params"] == (params - norms) * 2 // 8 + norms * 2
    assert result["memory"]["master"] == (params - norms) * 4 // 8 + norms * 4


def test_plan_from_a_checkpoint_config_prints_train_flags_for_it():
    directory = FIXTURES / "llama3"
    result = sk.plan(
        init_from=str(directory),
        devices=8,
        hardware="h100",
        batch=16,
        seq=64,
        options=sk.PlanOptions(compile_top=2, sequence=(1,), stage=(1,), remat=("none",), prune=False),
    )
    assert result.model == str(directory)
    assert result.best is not None and result.compiled == 2
    assert result.best_flags.startswith(f"--init-from {directory} --batch 16 --seq 64 --layout {result.best}")
    # The planner's facts are the config's: its 2 key/value heads split over tensor=2 at most.
    assert any("tensor=2" in p.layout for p in result.plans)
    assert not any(f"tensor={t}" in p.layout for p in result.plans for t in (4, 8))
