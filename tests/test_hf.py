"""Hugging Face checkpoints in and out: small random Llama, Mistral and Qwen2 checkpoints written
here with ``safetensors``, read into shardkit's GPT under several layouts, checked against an
independent NumPy forward written from Hugging Face's modeling conventions, and written back
bit for bit."""

import io
import json
import pathlib

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

import shardkit as sk
from shardkit.core.errors import CheckpointError, InputError, ModelError
from shardkit.models import hf

V, D, L, H, F = 96, 32, 2, 4, 48
K = D // H
TOKENS = np.random.default_rng(1).integers(0, V, (4, 17)).astype(np.int32)


def write_checkpoint(directory, kind="llama", kv_heads=2, tied=False, dtype=np.float32, files=1, **extra):
    """A random checkpoint as Hugging Face lays one out; returns its tensors (as float64)."""
    rng = np.random.default_rng(0)
    bias = kind == "qwen2"
    t = {"model.embed_tokens.weight": rng.normal(size=(V, D)), "model.norm.weight": 1 + 0.1 * rng.normal(size=D)}
    if not tied:
        t["lm_head.weight"] = rng.normal(size=(V, D)) / np.sqrt(D)
    for i in range(L):
        p = f"model.layers.{i}."
        for name, shape in {
            "self_attn.q_proj.weight": (H * K, D),
            "self_attn.k_proj.weight": (kv_heads * K, D),
            "self_attn.v_proj.weight": (kv_heads * K, D),
            "self_attn.o_proj.weight": (D, H * K),
            "mlp.gate_proj.weight": (F, D),
            "mlp.up_proj.weight": (F, D),
            "mlp.down_proj.weight": (D, F),
        }.items():
            t[p + name] = rng.normal(size=shape) / np.sqrt(shape[1])
        t[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=D)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=D)
        if bias:
            for w, n in (("q", H), ("k", kv_heads), ("v", kv_heads)):
                t[p + f"self_attn.{w}_proj.bias"] = 0.1 * rng.normal(size=n * K)
    stored = {k: v.astype(dtype) for k, v in t.items()}
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(stored)
    if files == 1:
        save_file(stored, str(directory / "model.safetensors"))
    else:  # sharded, with an index, as large checkpoints are
        weight_map = {}
        for j, chunk in enumerate(np.array_split(np.array(names), files)):
            file = f"model-{j + 1:05d}-of-{files:05d}.safetensors"
            save_file({n: stored[n] for n in chunk}, str(directory / file))
            weight_map.update(dict.fromkeys(chunk.tolist(), file))
        (directory / hf.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = dict(
        model_type=kind,
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        **extra,
    )
    (directory / "config.json").write_text(json.dumps(config))
    return {k: v.astype(np.float64) for k, v in stored.items()}, config


def numpy_forward(t, config, tokens):
    """Logits ``(B, T, V)`` as Hugging Face's Llama/Mistral/Qwen2 modeling code computes them."""
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    b, n = tokens.shape

    def rms_norm(x, w):
        return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def rotate(x):  # (B, T, h, K): apply_rotary_pos_emb with rotate_half
        inv = 1.0 / theta ** (np.arange(0, K, 2) / K)
        emb = np.concatenate([np.arange(n)[:, None] * inv] * 2, axis=-1)[None, :, None, :]
        half = np.concatenate([-x[..., K // 2 :], x[..., : K // 2]], axis=-1)
        return x * np.cos(emb) + half * np.sin(emb)

    def linear(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    x = t["model.embed_tokens.weight"][tokens]
    mask = np.tril(np.ones((n, n), bool))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, t[p + "input_layernorm.weight"])
        q = rotate(linear(h, p + "self_attn.q_proj").reshape(b, n, heads, K))
        k = rotate(linear(h, p + "self_attn.k_proj").reshape(b, n, kv, K))
        v = linear(h, p + "self_attn.v_proj").reshape(b, n, kv, K)
        k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)  # repeat_kv
        scores = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(K)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqs,bshk->bqhk", probs, v).reshape(b, n, heads * K)
        x = x + linear(attn, p + "self_attn.o_proj")
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"])
        gate = linear(h, p + "mlp.gate_proj")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms_norm(x, t["model.norm.weight"])
    return x @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


def logits_of(run, tokens):
    apply = jax.jit(lambda params, x: run.trainer.model.apply(params, x, None))
    return np.asarray(apply(run.state.params, tokens), np.float64)


@pytest.mark.parametrize(
    "kind, layout, options",
    [
        ("llama", "data=8", dict(kv_heads=2)),
        ("llama", "data=2,fsdp=2,tensor=2", dict(kv_heads=2)),
        ("mistral", "fsdp=4,tensor=2", dict(kv_heads=4, sliding_window=32)),
        ("qwen2", "fsdp=8", dict(kv_heads=2, tied=True)),
    ],
)
def test_imported_logits_equal_hugging_face_conventions(tmp_path, kind, layout, options):
    tensors, config = write_checkpoint(tmp_path / kind, kind, **options)
    run = sk.from_pretrained(tmp_path / kind, layout=layout, scan_layers=kind != "qwen2")
    np.testing.assert_allclose(logits_of(run, TOKENS), numpy_forward(tensors, config, TOKENS), rtol=2e-4, atol=2e-4)
    assert run.config.tie_embeddings == options.get("tied", False)
    assert run.config.qkv_bias == (kind == "qwen2")
    if kind == "mistral":  # every layer's window; 17 tokens fit it, so the reference's full attention holds
        assert run.config.sliding_window == 32 and run.config.sliding_layers == (True, True)


def test_first_loss_equals_the_reference_cross_entropy_and_training_moves_it(tmp_path):
    tensors, config = write_checkpoint(tmp_path / "ck")
    run = sk.from_pretrained(tmp_path / "ck", layout="data=2,fsdp=2,tensor=2", optimizer=optax.adamw(1e-3))
    logits = numpy_forward(tensors, config, TOKENS[:, :-1])
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, TOKENS[:, 1:, None], axis=-1).mean()
    state, losses = run.state, []
    for _ in range(3):
        state, metrics = run.trainer.step(state, run.trainer.shard_batch({"tokens": np.tile(TOKENS, (2, 1))}))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], expected, rtol=1e-4)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("layout", ["fsdp=8", "data=2,fsdp=2,tensor=2"])
def test_export_round_trips_bit_for_bit(tmp_path, layout):
    write_checkpoint(tmp_path / "in", "qwen2", tied=True, dtype=ml_dtypes.bfloat16, files=3)
    original = {}
    for file in (tmp_path / "in").glob("*.safetensors"):
        original.update(load_file(str(file)))
    run = sk.from_pretrained(tmp_path / "in", layout=layout, precision="bf16-master")  # parameters kept in bf16
    out = run.save(run.state.params, tmp_path / "out")
    back = load_file(str(out / "model.safetensors"))
    assert back.keys() == original.keys()
    for name, array in original.items():
        assert back[name].dtype == array.dtype and back[name].tobytes() == array.tobytes(), name
    written = json.loads((out / "config.json").read_text())
    original_config = json.loads((tmp_path / "in" / "config.json").read_text())
    assert written == {**original_config, "torch_dtype": "bfloat16"}  # the original's keys, the dtype written


def test_export_shards_files_with_an_index_and_reimports(tmp_path):
    tensors, config = write_checkpoint(tmp_path / "in")
    run = sk.from_pretrained(tmp_path / "in", layout="fsdp=8")
    out = hf.save_pretrained(run.state.params, run.config, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((out / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = sk.from_pretrained(out, layout="data=8")
    np.testing.assert_allclose(logits_of(again, TOKENS), numpy_forward(tensors, config, TOKENS), rtol=2e-4, atol=2e-4)


def test_each_device_reads_only_its_own_block(tmp_path, monkeypatch):
    """Under fsdp=8 every read is one eighth of a tensor's rows at most: no whole tensor is read."""
    tensors, _ = write_checkpoint(tmp_path / "ck", kv_heads=4)
    reads = []
    original = hf.Tensors.read

    def recording(self, name, block):
        out = original(self, name, block)
        reads.append((name, out.size))
        return out

    monkeypatch.setattr(hf.Tensors, "read", recording)
    sk.from_pretrained(tmp_path / "ck", layout="fsdp=8")
    big = {n for n, a in tensors.items() if a.ndim == 2}
    assert {n for n, _ in reads} >= big
    for name, size in reads:
        if name in big:
            assert size * 8 <= tensors[name].size, (name, size, tensors[name].shape)


def test_gpt_written_by_shardkit_exports_as_llama(tmp_path):
    cfg = sk.models.GPTConfig(vocab=V, dim=D, n_layers=L, n_heads=H, n_kv_heads=2, mlp_dim=F, max_seq=64)
    trainer = sk.Trainer(cfg.model(), optax.sgd(0.1), "fsdp=8")
    state = trainer.init(3)
    out = hf.save_pretrained(state.params, cfg, tmp_path / "gpt")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    run = sk.from_pretrained(out, layout="data=8")
    expected = jax.jit(lambda p, x: trainer.model.apply(p, x, None))(state.params, TOKENS)
    np.testing.assert_allclose(logits_of(run, TOKENS), np.asarray(expected), rtol=1e-5, atol=1e-5)


# -- bad input: refused before anything is compiled or written ----------------------------------


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(model_type="gemma"), "Gemma 1"),
        (dict(model_type="gpt2"), "llama, mistral, mixtral, qwen2"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling.*low_freq_factor"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.*dynamic"),
        (dict(hidden_act="gelu"), "gated by silu"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(quantization_config={"quant_method": "gptq"}), "quantization_config.*does not know"),
    ],
)
def test_configs_gpt_cannot_express_are_refused(tmp_path, change, words):
    _, config = write_checkpoint(tmp_path / "ck")
    with pytest.raises(ModelError, match=words):
        hf.gpt_config({**config, **change})


def test_checkpoint_problems_are_named(tmp_path):
    write_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="config.json"):
        sk.from_pretrained(tmp_path, layout="data=8")  # the parent: no config.json
    tensors = load_file(str(tmp_path / "ck" / "model.safetensors"))
    for edit, words in [
        (lambda t: t.pop("model.norm.weight"), "lacks 1 tensors"),
        (lambda t: t.update({"model.norm.weight": np.ones(D + 1, np.float32)}), r"shape \(33,\)"),
        (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.ones(D, np.float32)}), "no place for"),
    ]:
        changed = dict(tensors)
        edit(changed)
        save_file(changed, str(tmp_path / "ck" / "model.safetensors"))
        with pytest.raises(CheckpointError, match=words):
            sk.from_pretrained(tmp_path / "ck", layout="data=8")
    (tmp_path / "ck" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        sk.from_pretrained(tmp_path / "ck", layout="data=8")


def test_export_never_overwrites_and_init_checks_the_tree(tmp_path):
    write_checkpoint(tmp_path / "ck")
    run = sk.from_pretrained(tmp_path / "ck", layout="data=8")
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="exists"):
        run.save(run.state.params, tmp_path / "taken")
    assert list((tmp_path / "taken").iterdir()) == []
    wrong = jax.tree.map(lambda p: p, run.state.params)
    wrong["embed"] = wrong["embed"][:, :-1]
    with pytest.raises(InputError, match="embed"):
        run.trainer.init(params=wrong)


# -- the command line: export a run's checkpoint, then train from it -----------------------------


def test_cli_exports_a_run_and_trains_from_the_export(tmp_path):
    from shardkit.cli.commands import main
    from shardkit.cli.run import train
    from shardkit.core.config import TrainConfig
    from shardkit.io.data import TextDataset

    small = dict(batch=8, seq=32, layout="fsdp=8", sample_tokens=0)
    first = train(
        TrainConfig(model="tiny", steps=2, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, **small),
        out=io.StringIO(),
        progress=False,
    )
    export = ["export", "--model", "tiny", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]
    assert main(export) == 0
    exported = sk.from_pretrained(tmp_path / "hf", layout="data=8")
    for a, b in zip(jax.tree.leaves(first["state"].params), jax.tree.leaves(exported.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tuned_cfg = TrainConfig(init_from=str(tmp_path / "hf"), steps=1, lr=1e-9, warmup=0, **small)
    tuned = train(tuned_cfg, out=io.StringIO(), progress=False)
    batch = TextDataset.builtin(0).batch(0, 8, 32)
    expected = exported.trainer.evaluate(exported.state.params, exported.trainer.shard_batch(batch))["loss"]
    np.testing.assert_allclose(tuned["losses"][0], float(expected), rtol=1e-5)
    assert main(export) == 2  # never over an existing directory
