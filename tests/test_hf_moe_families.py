"""The frontier's mixtures of experts against numbers no one here computed: tiny Qwen3-MoE,
gpt-oss and DeepSeek-V3 checkpoints written by transformers 5.25, with its logits and its greedy
continuations (``tests/fixtures/hf_reference/moe``, made by its ``make_moe_fixtures.py``).

Each imports exactly (on one device, under expert and tensor layouts), exports back to the same
tensors and config, fine-tunes from transformers' own first loss, and generates transformers'
greedy tokens with a KV cache (DeepSeek-V3's a latent cache)."""

import json
import pathlib
import shutil

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file

import shardkit as sk
from shardkit.core.errors import CheckpointError, ModelError
from shardkit.models import hf, hf_config
from shardkit.models.generate import Generator

REFERENCE = pathlib.Path(__file__).parent / "fixtures" / "hf_reference" / "moe"
FAMILIES = ["qwen3_moe", "gpt_oss", "deepseek_v3"]
INDEX = json.loads((REFERENCE / "index.json").read_text())
TOKENS = np.load(REFERENCE / "tokens.npy").astype(np.int32)  # (2, 40): past gpt-oss's window of 8
TOLERANCE = 1e-4  # max abs error, fp32


def config_of(family):
    return json.loads((REFERENCE / family / "config.json").read_text())


def max_error(run, family, rows=1):
    out = jax.jit(lambda params, x: run.trainer.model.apply(params, x, None))(
        run.state.params, np.tile(TOKENS, (rows, 1))
    )
    logits = np.asarray(out[0] if isinstance(out, tuple) else out)
    return float(np.abs(logits - np.tile(np.load(REFERENCE / family / "reference_logits.npy"), (rows, 1, 1))).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_transformers_on_one_device_and_under_expert_and_tensor_layouts(family):
    one = sk.from_pretrained(REFERENCE / family, layout="data=1", devices=jax.devices()[:1])
    assert max_error(one, family) <= TOLERANCE
    assert one.config.num_params() == INDEX[family]["params"]  # what transformers counts
    experts = sk.from_pretrained(REFERENCE / family, layout="expert=4,data=2")
    assert max_error(experts, family, rows=4) <= TOLERANCE
    tensor = sk.from_pretrained(REFERENCE / family, layout="data=2,fsdp=2,tensor=2")
    assert max_error(tensor, family, rows=2) <= TOLERANCE
    if family == "deepseek_v3":  # latent attention: heads over tensor, the latent ranks stored over fsdp
        specs = tensor.trainer.param_specs["blocks"]["attn"]
        assert specs["wq_b"] == specs["wkv_b"] == PartitionSpec(None, "fsdp", "tensor", None)
        held = tensor.state.params["blocks"]["attn"]["wkv_b"].addressable_shards[0].data.shape
        assert held == (2, tensor.config.latent.kv_rank // 2, tensor.config.n_heads // 2, 32)


def test_what_each_family_reads_is_the_reference_config():
    qwen = hf.gpt_config(config_of("qwen3_moe"))
    assert (qwen.dense_layers, qwen.expert_dim, qwen.mlp_dim, qwen.router.normalize) == ((0,), 32, 96, True)
    assert qwen.qk_norm and qwen.layer_stacks() == (("dense_blocks", range(1)), ("blocks", range(1, 3)))
    oss = hf.gpt_config(config_of("gpt_oss"))
    assert oss.attn_sinks and oss.qkv_bias and oss.attn_out_bias and oss.expert_bias and oss.router.logit_bias
    assert oss.sliding_layers == (True, False, True) and oss.swiglu_limit == 7.0 and oss.scan_layers
    assert oss.rope_scaling is not None and oss.rope_scaling.kind == "yarn" and not oss.rope_scaling.truncate
    deepseek = hf.gpt_config(config_of("deepseek_v3"))
    lat = deepseek.latent
    assert lat is not None and (lat.kv_rank, lat.q_rank, lat.rope_dim, lat.nope_dim, lat.v_dim) == (32, 48, 8, 16, 16)
    assert deepseek.router.score == "sigmoid" and deepseek.router.groups == (2, 1) and deepseek.router.scale == 2.5
    assert deepseek.shared_experts == 1 and deepseek.dense_layers == (0,) and deepseek.router.score_bias
    assert deepseek.query_scale == pytest.approx(24**-0.5 * (0.1 * np.log(4.0) + 1) ** 2)  # yarn's mscale_all_dim


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_the_reference_checkpoint_back_and_reimports(tmp_path, family):
    run = sk.from_pretrained(REFERENCE / family, layout="data=2,fsdp=2,tensor=2")
    out = run.save(run.state.params, tmp_path / family)
    reference = load_file(str(REFERENCE / family / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    assert sorted(written) == sorted(reference)
    for name, array in reference.items():
        assert written[name].dtype == array.dtype and written[name].tobytes() == array.tobytes(), name
    assert json.loads((out / "config.json").read_text()) == config_of(family)
    again = sk.from_pretrained(out, layout="fsdp=8")
    assert max_error(again, family, rows=4) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_config_written_for_the_model_reads_back_to_the_same_math(tmp_path, family):
    run = sk.from_pretrained(REFERENCE / family, layout="fsdp=8")
    out = hf.save_pretrained(run.state.params, run.config, tmp_path / "new")
    again = sk.from_pretrained(out, layout="fsdp=8")
    assert hf_config.math_of(again.config) == hf_config.math_of(run.config)
    assert max_error(again, family, rows=4) <= TOLERANCE


def first_loss(family):
    logits = np.load(REFERENCE / family / "reference_logits.npy")[:, :-1].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, TOKENS[:, 1:, None].astype(np.int64), axis=-1).mean()


@pytest.mark.parametrize("family", FAMILIES)
def test_fine_tuning_starts_from_the_reference_loss_and_lowers_it(family):
    run = sk.from_pretrained(REFERENCE / family, layout="expert=2,data=2,tensor=2", optimizer=optax.adamw(3e-3))
    batch = run.trainer.shard_batch({"tokens": np.tile(TOKENS, (4, 1))})
    state, losses = run.state, []
    for _ in range(3):
        state, metrics = run.trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], first_loss(family), rtol=1e-5)
    assert losses[-1] < losses[0]
    if family == "deepseek_v3":  # the correction bias is balanced from the load, never by the optimizer
        # layer 1, the first of the expert layers' stack (layer 0 is the dense prefix's)
        stored = load_file(str(REFERENCE / family / "model.safetensors"))[
            "model.layers.1.mlp.gate.e_score_correction_bias"
        ]
        np.testing.assert_array_equal(np.asarray(state.params["blocks"]["mlp"]["score_bias"][0]), stored)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate_on_one_device_and_sharded(family):
    """transformers ran each prompt alone; here both run as one batch (gpt-oss's sinks and
    sliding window, DeepSeek-V3's latent cache, in every decode step)."""
    run = sk.from_pretrained(REFERENCE / family, layout="data=1", devices=jax.devices()[:1])
    prompts, want = INDEX[family]["prompts"], INDEX[family]["greedy_20"]
    assert run.generate(prompts, 20) == want
    assert run.generate(prompts, 20, layout="data=2,tensor=2") == want


def test_latent_attention_caches_the_latent_and_rotary_key_per_token_and_layer():
    run = sk.from_pretrained(REFERENCE / "deepseek_v3", layout="data=1", devices=jax.devices()[:1])
    cfg, lat = run.config, run.config.latent
    per_token = cfg.n_layers * (lat.kv_rank + lat.rope_dim) * 4  # float32: 40 numbers a layer
    gen = Generator(run.trainer.model, run.state.params)
    assert gen.cache_bytes_per_device(2, 64) == 2 * 64 * per_token
    grouped = cfg.n_layers * 2 * cfg.n_heads * lat.qk_dim * 4  # keys and values of every head
    assert per_token * 4 < grouped  # 40 numbers against 192 a layer here; 576 against 49,152 in DeepSeek-V3


# -- bad input: refused by name -------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, change, words",
    [
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'.*'sigmoid'"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'.*'noaux_tc'"),
        ("deepseek_v3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("deepseek_v3", {"qk_head_dim": 32}, "qk_head_dim=32"),
        ("deepseek_v3", {"n_routed_experts": "8"}, "n_routed_experts is '8'"),
        ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4.*Dequantize"),
        ("gpt_oss", {"swiglu_limit": "7.0"}, "swiglu_limit is '7.0'"),
        ("gpt_oss", {"experts_per_token": 4}, "experts_per_token=4.*num_experts_per_tok=2"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
        ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_what_shardkit_cannot_compute_is_refused_by_key(family, change, words):
    config = {k: v for k, v in {**config_of(family), **change}.items() if v is not None}
    with pytest.raises(ModelError, match=words):
        hf.gpt_config(config)


def test_the_multi_token_prediction_layer_is_refused_by_name_or_dropped_when_asked(tmp_path):
    directory = shutil.copytree(REFERENCE / "deepseek_v3", tmp_path / "deepseek_v3")
    tensors = load_file(str(directory / "model.safetensors"))
    mtp = np.random.RandomState(0).randn(64, 128).astype(np.float32)  # DeepSeek-V3's eh_proj, in miniature
    save_file({**tensors, "model.layers.3.eh_proj.weight": mtp}, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layer\(s\) \[3\].*multi-token-prediction.*drop_mtp=True"):
        sk.from_pretrained(directory, layout="fsdp=8")
    dropped = sk.from_pretrained(directory, layout="fsdp=8", drop_mtp=True)
    assert max_error(dropped, "deepseek_v3", rows=4) <= TOLERANCE


def test_kimi_k2s_own_model_type_reads_as_deepseek_v3_and_exports_as_given(tmp_path):
    # The Hub's Kimi K2 is DeepSeek-V3's architecture under model_type kimi_k2, with its code named.
    directory = shutil.copytree(REFERENCE / "deepseek_v3", tmp_path / "kimi")
    auto_map = {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    (directory / "config.json").write_text(
        json.dumps({**config_of("deepseek_v3"), "model_type": "kimi_k2", "auto_map": auto_map})
    )
    run = sk.from_pretrained(directory, layout="expert=4,data=2")
    assert max_error(run, "deepseek_v3", rows=4) <= TOLERANCE
    out = run.save(run.state.params, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k2"
    assert max_error(sk.from_pretrained(out, layout="fsdp=8"), "deepseek_v3", rows=4) <= TOLERANCE


def test_an_embedding_larger_than_vocab_size_names_both(tmp_path):
    directory = shutil.copytree(REFERENCE / "qwen3_moe", tmp_path / "qwen3_moe")
    config = {**config_of("qwen3_moe"), "vocab_size": 200}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="embed_tokens.weight has 256 rows.*vocab_size is 200"):
        sk.from_pretrained(directory, layout="fsdp=8")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dry_run_counts_the_checkpoints_tensors_and_bounds_its_traffic_at_the_held_dtype(family):
    """bf16 parameters with fp32 masters: the bound counts every weight at 2 bytes, the experts'
    as the rest (it counted the experts at the model's 4 and went negative)."""
    result = sk.dryrun(
        init_from=str(REFERENCE / family), layout="expert=2,fsdp=4", batch=8, seq=32, precision="bf16-master"
    )
    stored = sum(a.size for a in load_file(str(REFERENCE / family / "model.safetensors")).values())
    assert (
        result["parameters"] == stored
    )  # DeepSeek's correction bias included (a buffer, not a weight, to transformers)
    assert all(value >= 0 for key, value in result["lower_bound"].items() if key.startswith("bytes"))
    assert result["lower_bound"]["bytes_fsdp"] > 0 and result["lower_bound"]["bytes_expert"] > 0
