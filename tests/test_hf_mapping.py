"""A checkpoint into a model written without shardkit (``examples/byo_models.py``'s Gemma-style
NNX ``GemmaLM``) through a declarative mapping, checked against a NumPy forward of that model's
math written here from the checkpoint's own tensors; the mapping's export gives the tensors back
bit for bit; a stacked mapping rebuilds the GPT import exactly."""

import json
import pathlib
import shutil

import jax
import numpy as np
import optax
import pytest
from byo_models import GemmaLM, LMConfig
from safetensors.numpy import load_file, save_file

import shardkit as sk
from shardkit.core.errors import CheckpointError, ModelError
from shardkit.models.hf_mapping import Mapping, concat, stack, tensor

REFERENCE = pathlib.Path(__file__).parent / "fixtures" / "hf_reference" / "llama3"  # written by transformers
TOKENS = np.load(REFERENCE.parent / "tokens.npy").astype(np.int32)
CFG = LMConfig(vocab=256, dim=64, heads=4, kv_heads=2, head_dim=16, mlp=96, layers=2)
LAYER = "model.layers.{i}."
GEMMA_LM = {
    "embed/embedding": "model.embed_tokens.weight",
    "layers/{i}/pre_attn/scale": LAYER + "input_layernorm.weight",
    "layers/{i}/attn/q/kernel": tensor(LAYER + "self_attn.q_proj.weight", "(n h) d -> d n h", h=16),
    "layers/{i}/attn/kv/kernel": stack(
        tensor(LAYER + "self_attn.k_proj.weight", "(k h) d -> d k h", h=16),
        tensor(LAYER + "self_attn.v_proj.weight", "(k h) d -> d k h", h=16),
    ),
    "layers/{i}/attn/out/kernel": tensor(LAYER + "self_attn.o_proj.weight", "d (n h) -> n h d", h=16),
    "layers/{i}/pre_mlp/scale": LAYER + "post_attention_layernorm.weight",
    "layers/{i}/mlp/gate/kernel": tensor(LAYER + "mlp.gate_proj.weight", "f d -> d f"),
    "layers/{i}/mlp/up/kernel": tensor(LAYER + "mlp.up_proj.weight", "f d -> d f"),
    "layers/{i}/mlp/down/kernel": tensor(LAYER + "mlp.down_proj.weight", "d f -> f d"),
    "final_norm/scale": "model.norm.weight",
}


def gemma_lm_forward(t, tokens):
    """GemmaLM's math on the checkpoint's tensors, in float64: scaled embeddings, RMSNorm (eps 1e-6),
    half-split rotary (base 10000), grouped attention, tanh-GELU gated MLP, tied output."""
    b, n = tokens.shape
    heads, kv, k = CFG.heads, CFG.kv_heads, CFG.head_dim

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def rope(x):
        inv = 1.0 / 10000 ** (np.arange(k // 2) / (k // 2))
        angle = np.arange(n)[:, None] * inv  # (T, K/2)
        cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
        a, c = x[..., : k // 2], x[..., k // 2 :]
        return np.concatenate([a * cos - c * sin, c * cos + a * sin], axis=-1)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    x = t["model.embed_tokens.weight"][tokens] * np.sqrt(CFG.dim)
    mask = np.tril(np.ones((n, n), bool))
    for i in range(CFG.layers):
        p = f"model.layers.{i}."
        h = norm(x, t[p + "input_layernorm.weight"])
        q = rope((h @ t[p + "self_attn.q_proj.weight"].T).reshape(b, n, heads, k))
        kk = rope((h @ t[p + "self_attn.k_proj.weight"].T).reshape(b, n, kv, k))
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(b, n, kv, k)
        kk, v = np.repeat(kk, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)
        scores = np.where(mask, np.einsum("bqhk,bshk->bhqs", q, kk) / np.sqrt(k), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("bhqs,bshk->bqhk", probs, v).reshape(b, n, -1) @ t[p + "self_attn.o_proj.weight"].T
        h = norm(x, t[p + "post_attention_layernorm.weight"])
        up = gelu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)
        x = x + up @ t[p + "mlp.down_proj.weight"].T
    return norm(x, t["model.norm.weight"]) @ t["model.embed_tokens.weight"].T


def checkpoint_tensors(directory=REFERENCE):
    return {k: v.astype(np.float64) for k, v in load_file(str(directory / "model.safetensors")).items()}


def trainer_of(layout, **kw):
    return sk.Trainer(sk.from_nnx(lambda rngs: GemmaLM(CFG, rngs=rngs)), optax.adamw(1e-3), layout, **kw)


def logits(trainer, params, rows=1):
    out = jax.jit(lambda p, x: trainer.model.apply(p, x, None))(params, np.tile(TOKENS, (rows, 1)))
    return np.asarray(out, np.float64)


@pytest.mark.parametrize(
    "layout, rows",
    [("data=1", 1), ("data=2,fsdp=2,tensor=2", 4), ("fsdp=8", 4)],
)
def test_your_nnx_model_loads_a_checkpoint_through_a_mapping(layout, rows):
    devices = {"devices": jax.devices()[:1]} if layout == "data=1" else {}
    trainer = trainer_of(layout, **devices)
    params = Mapping(GEMMA_LM).load(REFERENCE, trainer)
    state = trainer.init(0, params=params)
    expected = np.tile(gemma_lm_forward(checkpoint_tensors(), TOKENS), (rows, 1, 1))
    np.testing.assert_allclose(logits(trainer, state.params, rows), expected, atol=1e-4, rtol=1e-4)
    q = state.params["layers"][0]["attn"]["q"]["kernel"]
    if layout != "data=1":  # born sharded: no device holds the whole kernel
        assert max(s.data.size for s in q.addressable_shards) < q.size


def test_the_mapping_exports_the_same_tensors_and_reimports(tmp_path):
    trainer = trainer_of("fsdp=4,tensor=2")
    mapping = Mapping(GEMMA_LM)
    state = trainer.init(0, params=mapping.load(REFERENCE, trainer))
    config = {"model_type": "gemma_lm_of_mine", "hidden_size": 64}
    out = mapping.save(state.params, tmp_path / "out", config=config)
    original = load_file(str(REFERENCE / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    assert written.keys() == original.keys()
    for name, array in original.items():
        assert written[name].tobytes() == array.tobytes(), name
    assert json.loads((out / "config.json").read_text()) == {**config, "torch_dtype": "float32"}
    again = mapping.load(out, trainer_of("fsdp=8"))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_stacked_mapping_rebuilds_the_gpt_import_exactly():
    """GPT's scanned layers are stacked parameters (``stacked="i"``); its fused q/k/v and gate/up
    weights are concatenations: the mapping gives exactly what from_pretrained reads."""
    run = sk.from_pretrained(REFERENCE, layout="fsdp=8")
    g, k = 2, 16  # query heads per kv head, head size
    mapping = Mapping(
        {
            "embed": "model.embed_tokens.weight",
            "final_norm/scale": "model.norm.weight",
            "blocks/attn_norm/scale": LAYER + "input_layernorm.weight",
            "blocks/mlp_norm/scale": LAYER + "post_attention_layernorm.weight",
            "blocks/attn/wqkv": concat(
                tensor(LAYER + "self_attn.q_proj.weight", "(n g k) d -> d n g k", g=g, k=k),
                tensor(LAYER + "self_attn.k_proj.weight", "(n g k) d -> d n g k", g=1, k=k),
                tensor(LAYER + "self_attn.v_proj.weight", "(n g k) d -> d n g k", g=1, k=k),
                axis=2,
            ),
            "blocks/attn/wo": tensor(LAYER + "self_attn.o_proj.weight", "d (h k) -> h k d", k=k),
            "blocks/mlp/w_gate_up": concat(
                tensor(LAYER + "mlp.gate_proj.weight", "(one f) d -> d one f", one=1),
                tensor(LAYER + "mlp.up_proj.weight", "(one f) d -> d one f", one=1),
                axis=1,
            ),
            "blocks/mlp/w_down": tensor(LAYER + "mlp.down_proj.weight", "d f -> f d"),
        },
        stacked="i",
    )
    params = mapping.load(REFERENCE, run.trainer)
    for a, b in zip(jax.tree.leaves(run.state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- bad input -----------------------------------------------------------------------------------


def test_a_parameter_no_rule_covers_is_named():
    rules = {k: v for k, v in GEMMA_LM.items() if k != "final_norm/scale"}
    with pytest.raises(ModelError, match="'final_norm/scale' matches no rule"):
        Mapping(rules).load(REFERENCE, trainer_of("fsdp=8"))


def test_a_tensor_the_mapping_needs_or_leaves_over_is_named(tmp_path):
    shutil.copytree(REFERENCE, tmp_path / "ck")
    tensors = load_file(str(tmp_path / "ck" / "model.safetensors"))
    save_file({**tensors, "model.extra.weight": np.ones(3, np.float32)}, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not read.*model.extra.weight"):
        Mapping(GEMMA_LM).load(tmp_path / "ck", trainer_of("fsdp=8"))
    Mapping(GEMMA_LM, ignore=(r"^model\.extra\.",)).load(tmp_path / "ck", trainer_of("fsdp=8"))  # ignored: loads
    tensors.pop("model.norm.weight")
    save_file(tensors, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks tensor 'model.norm.weight'"):
        Mapping(GEMMA_LM).load(tmp_path / "ck", trainer_of("fsdp=8"))


@pytest.mark.parametrize(
    "rule, error, words",
    [
        (tensor(LAYER + "self_attn.q_proj.weight", "(n h) d -> d n h", h=32), CheckpointError, r"shape \(64, 4, 16\)"),
        (tensor(LAYER + "self_attn.q_proj.weight", "(n h) d -> d n"), ModelError, "exactly the left side's factors"),
        (tensor(LAYER + "self_attn.q_proj.weight", "n h d -> d n h"), ModelError, "names 3 dimensions"),
        (tensor(LAYER + "self_attn.q_proj.weight", "(n h) d d -> d n h"), ModelError, "each once"),
        (tensor(LAYER + "self_attn.q_proj.weight", "n h d"), ModelError, "one '->'"),
    ],
)
def test_a_pattern_that_does_not_fit_is_refused_by_name(rule, error, words):
    with pytest.raises(error, match=words):
        Mapping({**GEMMA_LM, "layers/{i}/attn/q/kernel": rule}).load(REFERENCE, trainer_of("fsdp=8"))


def test_a_linen_model_loads_and_exports_through_a_mapping(tmp_path):
    """The Linen LM of examples/ (an MLP of one Dense, no gate; its own head) from the Mistral
    reference: each parameter is its tensor rearranged, and the export gives the tensors back."""
    import jax.numpy as jnp
    from byo_models import LinenLM

    model = sk.from_linen(LinenLM(CFG), jnp.zeros((2, 32), jnp.int32))
    trainer = sk.Trainer(model, optax.sgd(0.0), "fsdp=4,tensor=2")
    block = "block_{i}/"
    mapping = Mapping(
        {
            "embed/embedding": "model.embed_tokens.weight",
            "lm_head/kernel": tensor("lm_head.weight", "v d -> d v"),
            "RMSNorm_0/scale": "model.norm.weight",
            block + "RMSNorm_0/scale": LAYER + "input_layernorm.weight",
            block + "RMSNorm_1/scale": LAYER + "post_attention_layernorm.weight",
            block + "attention/query/kernel": tensor(LAYER + "self_attn.q_proj.weight", "(n h) d -> d n h", h=16),
            block + "attention/key/kernel": tensor(LAYER + "self_attn.k_proj.weight", "(n h) d -> d n h", h=16),
            block + "attention/value/kernel": tensor(LAYER + "self_attn.v_proj.weight", "(n h) d -> d n h", h=16),
            block + "attention/out/kernel": tensor(LAYER + "self_attn.o_proj.weight", "d (n h) -> n h d", h=16),
            block + "wi/kernel": tensor(LAYER + "mlp.up_proj.weight", "f d -> d f"),
            block + "wo/kernel": tensor(LAYER + "mlp.down_proj.weight", "d f -> f d"),
        },
        ignore=(r"mlp\.gate_proj",),  # this model has no gate
    )
    mistral = REFERENCE.parent / "mistral"
    params = mapping.load(mistral, trainer)
    t = load_file(str(mistral / "model.safetensors"))
    q = np.asarray(params["block_1"]["attention"]["query"]["kernel"])
    np.testing.assert_array_equal(q, t["model.layers.1.self_attn.q_proj.weight"].T.reshape(64, 4, 16))
    out = np.asarray(params["block_0"]["attention"]["out"]["kernel"])
    np.testing.assert_array_equal(out, t["model.layers.0.self_attn.o_proj.weight"].T.reshape(4, 16, 64))
    np.testing.assert_array_equal(np.asarray(params["lm_head"]["kernel"]), t["lm_head.weight"].T)
    written = load_file(str(mapping.save(params, tmp_path / "out") / "model.safetensors"))
    assert written.keys() == {n for n in t if "gate_proj" not in n}
    for name, array in written.items():
        assert array.tobytes() == t[name].tobytes(), name
