"""The families people fine-tune, against numbers no one here computed: seven tiny checkpoints
written by transformers 5.25 itself, with the logits transformers computes for fixed token ids
(``tests/fixtures/hf_reference``, provenance in its README). Each imports into shardkit's GPT and
gives those logits on one device and under sharded layouts, exports back to the same tensors and
config, and trains from its first loss."""

import io
import json
import pathlib
import shutil

import jax
import numpy as np
import optax
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import shardkit as sk
from shardkit.core.errors import CheckpointError, ModelError
from shardkit.models import hf, hf_config

REFERENCE = pathlib.Path(__file__).parent / "fixtures" / "hf_reference"
FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "mixtral", "gemma2", "gemma3"]
TOKENS = np.load(REFERENCE / "tokens.npy").astype(np.int32)  # (2, 40): past the sliding window of 16
TOLERANCE = 1e-4  # max abs error, fp32


def reference_logits(family):
    return np.load(REFERENCE / family / "reference_logits.npy")


def logits_of(run, tokens):
    out = jax.jit(lambda params, x: run.trainer.model.apply(params, x, None))(run.state.params, tokens)
    return np.asarray(out[0] if isinstance(out, tuple) else out)


def max_error(run, family, rows=1):
    return float(
        np.abs(logits_of(run, np.tile(TOKENS, (rows, 1))) - np.tile(reference_logits(family), (rows, 1, 1))).max()
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_one_device_and_two_sharded_layouts_give_transformers_logits(family):
    one = sk.from_pretrained(REFERENCE / family, layout="data=1", devices=jax.devices()[:1])
    assert max_error(one, family) <= TOLERANCE
    tensor = sk.from_pretrained(REFERENCE / family, layout="fsdp=4,tensor=2")  # 4 rows: 2 copies of the ids
    assert max_error(tensor, family, rows=2) <= TOLERANCE
    fsdp = sk.from_pretrained(REFERENCE / family, layout="fsdp=8", scan_layers=False)  # unrolled layers too
    assert max_error(fsdp, family, rows=4) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_the_reference_checkpoint_back_and_reimports(tmp_path, family):
    run = sk.from_pretrained(REFERENCE / family, layout="data=2,fsdp=2,tensor=2")
    out = run.save(run.state.params, tmp_path / family)
    reference = load_file(str(REFERENCE / family / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in reference.items()}
    for name, array in reference.items():
        assert written[name].dtype == array.dtype and written[name].tobytes() == array.tobytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((REFERENCE / family / "config.json").read_text())
    again = sk.from_pretrained(out, layout="fsdp=8")
    assert max_error(again, family, rows=4) <= TOLERANCE


@pytest.mark.parametrize("family", ["llama3", "gemma2", "mixtral"])
def test_a_new_config_written_for_the_model_reads_back_to_the_same_math(tmp_path, family):
    """Without the original config.json, export writes transformers 4's spelling (read by 4 and 5)."""
    run = sk.from_pretrained(REFERENCE / family, layout="fsdp=8")
    out = hf.save_pretrained(run.state.params, run.config, tmp_path / "new")
    config = json.loads((out / "config.json").read_text())
    assert "rope_parameters" not in config and "rope_theta" in config
    again = sk.from_pretrained(out, layout="fsdp=8")
    assert hf_config.math_of(again.config) == hf_config.math_of(run.config)
    assert max_error(again, family, rows=4) <= TOLERANCE


def first_loss(family):
    """The next-token loss of the reference's own logits: what the first step must report."""
    logits = reference_logits(family)[:, :-1].astype(np.float64)  # (2, 39, V): the model reads tokens[:, :-1]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, TOKENS[:, 1:, None].astype(np.int64), axis=-1).mean()


@pytest.mark.parametrize("family", FAMILIES)
def test_fine_tuning_starts_from_the_reference_loss_and_lowers_it(family):
    run = sk.from_pretrained(REFERENCE / family, layout="data=2,fsdp=2,tensor=2", optimizer=optax.adamw(3e-3))
    assert run.config.aux_loss_weight == 0.0 or not run.config.n_experts  # output_router_logits: false
    batch = run.trainer.shard_batch({"tokens": np.tile(TOKENS, (4, 1))})
    state, losses = run.state, []
    for _ in range(3):
        state, metrics = run.trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], first_loss(family), rtol=1e-5)
    assert losses[-1] < losses[0]


def test_mixtral_routes_every_token_under_expert_parallelism():
    """Dropless routing: the expert axis moves tokens with all-to-alls and drops none."""
    run = sk.from_pretrained(REFERENCE / "mixtral", layout="expert=4,data=2")
    assert run.config.moe_dropless and run.config.n_experts == 4 and run.config.top_k == 2
    assert max_error(run, "mixtral", rows=4) <= TOLERANCE
    report = run.trainer.report({"tokens": jax.ShapeDtypeStruct((8, 41), np.int32)})
    a2a = [c for c in report.collectives if c.kind == "all-to-all"]
    assert {c.axes for c in a2a} == {("expert",)}
    # Per layer: tokens to the experts and back, forward and backward. Dropless with one expert a
    # device, each device sends every one of its 40 tokens a slot at each destination: 4 x 40 rows
    # of 64 fp32 features; each destination also learns its expert's count (one int32 from each).
    # (XLA may combine the exchanges into fewer all-to-alls: their bytes are what is fixed.)
    slots, counts = 4 * 40 * run.config.dim * 4, 4 * 4
    assert sum(c.count * c.payload_bytes for c in a2a) == run.config.n_layers * (4 * slots + counts)
    dropping = sk.from_pretrained(REFERENCE / "mixtral", layout="fsdp=8", moe_dropless=False, capacity_factor=1.0)
    assert max_error(dropping, "mixtral", rows=4) > 1e-3  # capacity drops tokens: not what transformers computes


# -- configs: both spellings, and nothing guessed ------------------------------------------------


def transformers4_spelling(config):
    """The same config as transformers 4 wrote it: top-level rope_theta / rope_scaling, no layer_types."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    params = config["rope_parameters"]
    if "full_attention" in params:  # Gemma 3
        old["rope_theta"] = params["full_attention"]["rope_theta"]
        old["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        old["sliding_window_pattern"] = config.get("_sliding_window_pattern", 6)
        old.pop("_sliding_window_pattern", None)
    else:
        old["rope_theta"] = params["rope_theta"]
        if params.get("rope_type", "default") != "default":
            old["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return old


@pytest.mark.parametrize("family", FAMILIES)
def test_both_spellings_of_a_config_read_to_the_same_model(tmp_path, family):
    config = json.loads((REFERENCE / family / "config.json").read_text())
    old = transformers4_spelling(config)
    assert hf.gpt_config(old) == hf.gpt_config(config)
    if family in ("llama3", "gemma3"):  # and the old spelling imports to the reference's logits
        shutil.copytree(REFERENCE / family, tmp_path / family)
        (tmp_path / family / "config.json").write_text(json.dumps(old))
        run = sk.from_pretrained(tmp_path / family, layout="fsdp=8")
        assert max_error(run, family, rows=4) <= TOLERANCE


def test_what_each_family_reads_is_the_reference_config():
    llama3 = hf.gpt_config(json.loads((REFERENCE / "llama3" / "config.json").read_text()))
    assert llama3.rope_theta == 500000.0 and llama3.rope_scaling.kind == "llama3" and llama3.rope_scaling.factor == 8
    gemma2 = hf.gpt_config(json.loads((REFERENCE / "gemma2" / "config.json").read_text()))
    assert gemma2.layer_types == ("sliding", "full") and gemma2.sliding_window == 16
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.query_scale) == (50.0, 30.0, 0.25)
    gemma3 = hf.gpt_config(json.loads((REFERENCE / "gemma3" / "config.json").read_text()))
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.qk_norm) == (1e6, 1e4, True)
    assert gemma3.sliding_layers == (True, True)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unknown_key_is_refused_by_name(family):
    config = json.loads((REFERENCE / family / "config.json").read_text())
    with pytest.raises(ModelError, match="logit_scale=2.0.*does not know"):
        hf.gpt_config({**config, "logit_scale": 2.0})


@pytest.mark.parametrize(
    "family, change, words",
    [
        ("llama3", {"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "longrope"),
        ("llama3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "original_max_"),
        ("llama3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}, "low_freq_factor"),
        ("llama3", {"rope_theta": 10000.0}, "two spellings must agree"),
        ("llama3", {"rope_parameters": {"rope_theta": 1e4, "mscale": 1.0}}, "mscale"),
        ("llama3", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial rotary"),
        ("llama3", {"hidden_act": "gelu"}, "gated by silu"),
        ("llama3", {"attention_bias": True}, "output projection"),
        ("llama3", {"mlp_bias": True}, "mlp_bias"),
        ("llama3", {"attention_dropout": 0.1}, "attention dropout"),
        ("qwen2", {"use_mrope": True}, "use_mrope"),
        ("mixtral", {"router_jitter_noise": 0.01}, "routing noise"),
        ("gemma2", {"hidden_activation": "relu"}, "gelu_pytorch_tanh"),
        ("gemma3", {"use_bidirectional_attention": True}, "causal"),
        ("gemma3", {"layer_types": ["sliding_attention"]}, "expected 2"),
        ("gemma2", {"model_type": "gemma"}, "Gemma 1"),
        ("gemma3", {"model_type": "gemma3"}, "multimodal"),
        ("llama3", {"model_type": "gpt2"}, "imports llama, mistral"),
    ],
)
def test_options_shardkit_cannot_compute_are_refused(family, change, words):
    config = json.loads((REFERENCE / family / "config.json").read_text())
    with pytest.raises(ModelError, match=words):
        hf.gpt_config({**config, **change})


@pytest.mark.parametrize(
    "family, key", [("gemma2", "attn_logit_softcapping"), ("mistral", "sliding_window"), ("qwen3", "head_dim")]
)
def test_a_key_whose_default_is_the_familys_own_is_required(family, key):
    config = json.loads((REFERENCE / family / "config.json").read_text())
    config.pop(key)
    with pytest.raises(ModelError, match=f"lacks {key}.*default"):
        hf.gpt_config(config)


# -- checkpoints that disagree with themselves ---------------------------------------------------


def copy_of(tmp_path, family):
    shutil.copytree(REFERENCE / family, tmp_path / family)
    return tmp_path / family


def test_tensors_that_disagree_with_the_config_are_named(tmp_path):
    ck = copy_of(tmp_path, "gemma3")
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "head_dim": 32}))
    with pytest.raises(CheckpointError, match=r"q_proj.weight has shape \(64, 64\); config.json implies \(128, 64\)"):
        sk.from_pretrained(ck, layout="fsdp=8")
    gemma2 = {**config, "model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    gemma2.pop("_sliding_window_pattern")
    gemma2["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    (ck / "config.json").write_text(json.dumps(gemma2))
    with pytest.raises(CheckpointError, match="no place for.*q_norm"):  # Gemma 2 has no q/k norms
        sk.from_pretrained(ck, layout="fsdp=8")


def test_a_missing_shard_file_is_named(tmp_path):
    ck = copy_of(tmp_path, "mixtral")
    tensors = load_file(str(ck / "model.safetensors"))
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:10]}, str(ck / "model-00001-of-00002.safetensors"))
    (ck / "model.safetensors").unlink()
    weight_map = {n: f"model-0000{1 + (i >= 10)}-of-00002.safetensors" for i, n in enumerate(names)}
    (ck / hf.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="missing.*model-00002-of-00002.safetensors"):
        sk.from_pretrained(ck, layout="fsdp=8")


def test_a_dtype_shardkit_cannot_hold_is_named(tmp_path):
    ck = copy_of(tmp_path, "qwen3")
    tensors = load_file(str(ck / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
    save_file(tensors, str(ck / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight.*I8"):
        sk.from_pretrained(ck, layout="fsdp=8")


def test_the_fixtures_are_what_transformers_wrote():
    """Provenance: the fixtures are the shared reference, as transformers 5.25 saved them."""
    index = json.loads((REFERENCE / "index.json").read_text())
    assert index["_made_with"]["transformers"] == "5.25.0"
    for family in FAMILIES:
        with safe_open(str(REFERENCE / family / "model.safetensors"), "np") as f:
            count = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118
        assert count == index[family]["params"]
        cfg = hf.gpt_config(json.loads((REFERENCE / family / "config.json").read_text()))
        assert cfg.num_params() == count


# -- the command line: train from each family, export what the import reads -------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_cli_trains_from_every_family_and_exports_what_the_import_reads(tmp_path, family):
    from shardkit.cli.commands import main
    from shardkit.cli.run import train
    from shardkit.core.config import TrainConfig
    from shardkit.io.data import TextDataset

    small = dict(batch=8, seq=32, layout="fsdp=8", sample_tokens=0, init_from=str(REFERENCE / family))
    cfg = TrainConfig(steps=1, lr=1e-9, warmup=0, checkpoint_dir=str(tmp_path / "run"), checkpoint_every=1, **small)
    result = train(cfg, out=io.StringIO(), progress=False)
    imported = sk.from_pretrained(REFERENCE / family, layout="fsdp=8")
    batch = imported.trainer.shard_batch(TextDataset.builtin(0).batch(0, 8, 32))
    np.testing.assert_allclose(
        result["losses"][0], float(imported.trainer.evaluate(imported.state.params, batch)["loss"]), rtol=1e-5
    )
    export = [
        "export",
        "--init-from",
        str(REFERENCE / family),
        "--checkpoint-dir",
        str(tmp_path / "run"),
        "--out",
        str(tmp_path / "hf"),
    ]
    assert main(export) == 0
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    reference = load_file(str(REFERENCE / family / "model.safetensors"))
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in reference.items()}
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (REFERENCE / family / "config.json").read_text()
    )
    assert max_error(sk.from_pretrained(tmp_path / "hf", layout="fsdp=8"), family, rows=4) < 1e-2  # 1 step at lr 1e-9


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_inf_weight_is_named_with_its_file_before_any_step(tmp_path, bad):
    ck = copy_of(tmp_path, "llama3")
    tensors = load_file(str(ck / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    save_file(tensors, str(ck / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: tensor model.layers.1.mlp.down_proj.weight holds 1 NaN"
    ):
        sk.from_pretrained(ck, layout="fsdp=8")


@pytest.mark.parametrize(
    ("family", "key", "value"),
    [
        ("llama3", "rms_norm_eps", "1e-6"),
        ("llama3", "hidden_size", "64"),
        ("llama3", "num_hidden_layers", 2.5),
        ("llama3", "head_dim", 16.0),
        ("llama3", "rope_theta", True),
        ("mixtral", "router_jitter_noise", "0"),
    ],
)
def test_a_number_written_as_something_else_is_refused_by_key(tmp_path, family, key, value):
    ck = copy_of(tmp_path, family)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ModelError, match=rf"config.json \({config['model_type']}\): {key} is {value!r}"):
        sk.from_pretrained(ck, layout="fsdp=8")
