"""Blocked attention (shardkit.parallel.attention): the same numbers and gradients as the whole
score matrix for every mask shardkit computes, memory linear in the sequence, hidden blocks
skipped, bad input refused; and the GPT's families through it."""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from helpers import gpt_reference, run_cli, run_trainer

import shardkit as sk
from shardkit.core.errors import InputError
from shardkit.models import GPTConfig
from shardkit.models.segments import packed_rows
from shardkit.parallel import ring_attention
from shardkit.parallel.attention import attention_with_lse, visited_blocks

REFERENCE = pathlib.Path(__file__).parent / "fixtures" / "hf_reference"


def reference(q, k, v, causal=True, window=None, softcap=None, scale=None, sinks=None, segments=None,
              kv_segments=None, q_offset=0):  # fmt: skip
    """Attention written the textbook way, every score formed: ``(B, T, H, Kv)`` and ``(B, T, H)``."""
    b, t, h, d = q.shape
    s, n = k.shape[1], k.shape[2]
    k, v = jnp.repeat(k, h // n, axis=2), jnp.repeat(v, h // n, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * (scale or d**-0.5)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    query, key = q_offset + np.arange(t)[:, None], np.arange(s)[None, :]
    seen = np.ones((t, s), bool)
    if causal:
        seen &= key <= query
    if window:
        seen &= key > query - window
    seen = jnp.asarray(seen)[None, None]
    if segments is not None:
        other = segments if kv_segments is None else kv_segments
        seen = seen & (segments[:, None, :, None] == other[:, None, None, :])
    scores = jnp.where(seen, scores, -jnp.inf)
    if sinks is not None:
        scores = jnp.concatenate([scores, jnp.broadcast_to(sinks[None, :, None, None], (b, h, t, 1))], -1)
    lse = jax.nn.logsumexp(scores, -1)
    weights = jnp.exp(scores - lse[..., None])[..., :s]
    return jnp.einsum("bhts,bshd->bthd", weights, v), lse.transpose(0, 2, 1)


def inputs(t=200, s=None, h=4, n=2, d=16, dv=None, seed=0):
    s, dv = s or t, dv or d
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (2, t, h, d))
    k = jax.random.normal(keys[1], (2, s, n, d))
    v = jax.random.normal(keys[2], (2, s, n, dv))
    return q, k, v, jax.random.normal(keys[3], (2, t, h, dv)), jax.random.normal(keys[4], (2, t, h))


def documents(rows, length, seed):
    """Sorted document ids 0..3 per row, as packed rows carry."""
    return jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 4, (rows, length)), axis=1), jnp.int32)


VARIANTS = {
    "causal": {},
    "grouped kv, uneven blocks": dict(shape=dict(t=203, h=8, n=2)),
    "window": dict(window=37),
    "softcap and scale": dict(softcap=5.0, scale=0.3),
    "sinks": dict(sinks=True),
    "packed documents": dict(segments=True),
    "latent attention's head dims": dict(shape=dict(d=24, dv=8)),
    "cross-attention": dict(causal=False, shape=dict(t=90, s=150), kv_segments=True),
    "prefill after a cache": dict(q_offset=136, shape=dict(t=64, s=200)),
    "everything at once": dict(window=50, softcap=3.0, sinks=True, segments=True, scale=0.2),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_blocked_attention_equals_every_score_formed_forward_and_backward(variant):
    kw = dict(VARIANTS[variant])
    q, k, v, w_out, w_lse = inputs(**kw.pop("shape", {}))
    if kw.pop("sinks", False):
        kw["sinks"] = jax.random.normal(jax.random.key(7), (q.shape[2],))
    if kw.pop("segments", False):
        kw["segments"] = documents(2, q.shape[1], 1)
    if kw.pop("kv_segments", False):
        kw["segments"], kw["kv_segments"] = documents(2, q.shape[1], 2), documents(2, k.shape[1], 3)
    sinks = kw.pop("sinks", None)

    def loss(attend, q, k, v, sinks):
        out, lse = attend(q, k, v, sinks)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

    blocked = lambda q, k, v, sinks: attention_with_lse(
        q, k, v, sinks=sinks, implementation="blocked", block_q=32, block_k=48, **kw
    )
    written = lambda q, k, v, sinks: reference(q, k, v, sinks=sinks, **kw)
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    got, got_grads = jax.jit(jax.value_and_grad(lambda *a: loss(blocked, *a), argnums))(q, k, v, sinks)
    want, want_grads = jax.value_and_grad(lambda *a: loss(written, *a), argnums)(q, k, v, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(blocked(q, k, v, sinks)[0], written(q, k, v, sinks)[0], atol=1e-5)
    for g, r in zip(got_grads, want_grads, strict=True):
        assert float(jnp.abs(g - r).max() / jnp.abs(r).max()) <= 1e-5


def test_a_traced_window_and_bfloat16():
    q, k, v, w, _ = inputs(t=130)
    traced = jax.jit(lambda q, k, v, window: sk.attention(q, k, v, window=window, implementation="blocked"))
    for window in (20, 130):
        want = reference(q, k, v, window=window)[0]
        np.testing.assert_allclose(traced(q, k, v, jnp.int32(window)), want, atol=1e-5)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = sk.attention(*low, implementation="blocked", block_q=32, block_k=32)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), reference(q, k, v)[0], atol=3e-2)
    grads = jax.grad(lambda *a: jnp.sum(sk.attention(*a, implementation="blocked").astype(jnp.float32) * w), (0, 1, 2))
    want = jax.grad(lambda *a: jnp.sum(reference(*a)[0] * w), (0, 1, 2))(q, k, v)
    for g, r in zip(grads(*low), want, strict=True):
        assert g.dtype == jnp.bfloat16
        assert float(jnp.abs(g.astype(jnp.float32) - r).max() / jnp.abs(r).max()) < 2e-2  # bf16's 8 bits


def temporaries(attend, t):
    q = jnp.ones((1, t, 4, 16))
    grad = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
    return grad.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_with_the_sequence_not_its_square():
    blocked = lambda q, k, v: sk.attention(q, k, v, implementation="blocked")
    whole = lambda q, k, v: sk.attention(q, k, v, implementation="materialized")
    assert temporaries(blocked, 8192) < 5 * temporaries(blocked, 2048)  # 4x the tokens
    assert temporaries(whole, 4096) > 12 * temporaries(whole, 1024)
    assert temporaries(blocked, 8192) < temporaries(whole, 2048)


def test_blocks_the_mask_hides_are_never_scored():
    assert visited_blocks(1024, 1024, causal=False) == 64
    assert visited_blocks(1024, 1024) == 8 * 9 // 2  # the diagonal and below
    assert visited_blocks(4096, 4096, window=512) <= 32 * 5  # a window of 4 blocks: 4 back at most, and its own
    assert visited_blocks(256, 1280, q_offset=1024) == 9 + 10  # a prompt's chunk after 1,024 cached tokens


def test_the_default_picks_blocks_from_the_measured_length():
    from shardkit.parallel.attention import BLOCKED_FROM

    q = jnp.ones((1, BLOCKED_FROM, 2, 8))
    text = lambda t, impl: jax.jit(lambda q: sk.attention(q, q, q, implementation=impl)).lower(q[:, :t]).as_text()
    assert "while" in text(BLOCKED_FROM, None) and "while" not in text(BLOCKED_FROM // 2, None)
    assert "while" in text(BLOCKED_FROM // 2, "blocked")


BAD = [
    (dict(q=jnp.ones((2, 8, 4))), "(batch, sequence, heads, head_dim)"),
    (dict(k=jnp.ones((2, 8, 2, 6))), "do not agree"),
    (dict(k=jnp.ones((2, 8, 3, 8)), v=jnp.ones((2, 8, 3, 8))), "do not divide"),
    (dict(implementation="flash"), "choose one of"),
    (dict(causal=False, window=4), "causal=True"),
    (dict(window=0), "positive number of tokens"),
    (dict(softcap=-1.0), "positive number"),
    (dict(sinks=jnp.ones((2,))), "one logit per query head"),
    (dict(segments=jnp.ones((2, 7), jnp.int32)), "segments of shape"),
    (dict(kv_segments=jnp.ones((2, 8), jnp.int32)), "need segments too"),
    (dict(block_q=0), "positive int"),
]


@pytest.mark.parametrize(("change", "words"), BAD, ids=[w for _, w in BAD])
def test_bad_input_is_refused_with_the_fix(change, words):
    args = dict(q=jnp.ones((2, 8, 4, 8)), k=jnp.ones((2, 8, 2, 8)), v=jnp.ones((2, 8, 2, 8))) | change
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        sk.attention(**args)


@pytest.mark.parametrize("layout", ["sequence=4,data=2", "sequence=2,tensor=2,data=2"])
def test_ring_attention_with_every_mask_equals_one_device(layout):
    q, k, v, w, _ = inputs(t=256, h=4, n=2)
    masks = dict(window=40, softcap=4.0, scale=0.2, segments=documents(2, 256, 5))
    sinks = jax.random.normal(jax.random.key(3), (4,))
    mesh = sk.Layout.parse(layout).make_mesh()
    loss = lambda attend, *a: jnp.sum(attend(*a) * w)
    ring = lambda q, k, v, sinks: ring_attention(q, k, v, mesh, sk.default_rules(), sinks=sinks, **masks)
    written = lambda q, k, v, sinks: reference(q, k, v, sinks=sinks, **masks)[0]
    with sk.use_sharding(mesh, sk.default_rules()):
        got, got_grads = jax.jit(jax.value_and_grad(lambda *a: loss(ring, *a), (0, 1, 2, 3)))(q, k, v, sinks)
    want, want_grads = jax.value_and_grad(lambda *a: loss(written, *a), (0, 1, 2, 3))(q, k, v, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, r in zip(got_grads, want_grads, strict=True):
        assert float(jnp.abs(g - r).max() / jnp.abs(r).max()) <= 1e-5


GEMMA_LIKE = dict(attn_softcap=20.0, query_scale=0.2, sliding_window=24, layer_types=("sliding", "full"), max_seq=256)


@pytest.mark.parametrize("config", [{}, GEMMA_LIKE], ids=["plain", "softcap, scale, alternating windows"])
def test_the_gpt_through_blocks_gives_the_logits_of_the_whole_scores(config):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 200)), jnp.int32)
    segments = documents(2, 200, 9) + 1
    outs = {}
    for attention in ("xla", "blocked"):
        model = GPTConfig.preset("tiny", attention=attention, **{"max_seq": 256} | config).model()
        params = model.init(jax.random.key(0))
        with packed_rows(None):  # read at trace time: a function of its own each
            plain = jax.jit(lambda p, m=model: m.apply(p, tokens, None))(params)
        with packed_rows(segments):
            packed = jax.jit(lambda p, m=model: m.apply(p, tokens, None))(params)
        assert float(jnp.abs(plain - packed).max()) > 0.1, "the documents changed what a token sees"
        outs[attention] = (plain, packed)
    for got, want in zip(outs["blocked"], outs["xla"], strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_soft_capped_windowed_gpt_trains_under_the_ring_as_on_one_device():
    cfg = GPTConfig.preset("tiny", **GEMMA_LIKE | {"max_seq": 64})
    data = sk.TextDataset.builtin()
    batches = [data.batch(step, batch_size=8, seq_len=64) for step in range(3)]
    want, _ = gpt_reference(cfg, optax.adamw(1e-3), batches)
    got, _ = run_trainer(sk.Trainer(cfg.model(), optax.adamw(1e-3), "sequence=4,data=2"), batches)
    np.testing.assert_allclose(got, want, rtol=2e-5)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "mixtral", "gemma2", "gemma3"])
def test_families_through_blocks_give_transformers_logits(family):
    run = sk.from_pretrained(REFERENCE / family, layout="data=1", devices=jax.devices()[:1], attention="blocked")
    tokens = np.load(REFERENCE / "tokens.npy").astype(np.int32)
    out = jax.jit(lambda params, x: run.trainer.model.apply(params, x, None))(run.state.params, tokens)
    out = out[0] if isinstance(out, tuple) else out  # a mixture of experts: (logits, its load)
    assert float(np.abs(np.asarray(out) - np.load(REFERENCE / family / "reference_logits.npy")).max()) <= 1e-4


def test_a_prompt_prefilled_in_blocks_generates_what_transformers_does():
    want = json.loads((REFERENCE / "generate.json").read_text())
    run = sk.from_pretrained(REFERENCE / "gemma2", layout="data=1", devices=jax.devices()[:1], attention="blocked")
    assert run.generate(want["prompts"], want["new_tokens"]) == want["gemma2"]


def test_the_command_trains_past_the_presets_length_and_takes_the_attention_it_is_given():
    temps = {}
    for attention in ("xla", "auto"):
        args = ("dryrun", "--model", "tiny", "--layout", "data=8", "--batch", "8", "--seq", "2048")
        done = run_cli(*args, "--max-seq", "2048", "--attention", attention)
        assert done.returncode == 0, done.stderr
        temps[attention] = float(re.search(r"temp ([\d.]+)", done.stdout).group(1))
    assert temps["auto"] < temps["xla"] / 5
    refused = run_cli("dryrun", "--model", "tiny", "--layout", "data=8", "--batch", "8", "--seq", "2048")
    assert refused.returncode != 0 and "give --max-seq 2048" in refused.stderr


def test_where_cudnn_refuses_the_gpu_default_falls_back_to_blocks(monkeypatch):
    """The GPU rule run on the CPU: cuDNN is asked first and refuses here ("not detected"), as it
    refuses float32 or a head dim on a GPU; the GPT then runs the blocked kernel, same logits."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 64)), jnp.int32)
    model = GPTConfig.preset("tiny").model()
    params = model.init(jax.random.key(0))
    want = jax.jit(lambda p: model.apply(p, tokens, None))(params)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    text = jax.jit(lambda p: model.apply(p, tokens, None)).lower(params).as_text()
    assert "while" in text  # the blocked kernel's loops, though 64 tokens are under BLOCKED_FROM
    np.testing.assert_allclose(jax.jit(lambda p: model.apply(p, tokens, None))(params), want, atol=2e-5)


class _NnxAttentionLM(nnx.Module):
    """A user's NNX model, no logical names: one Linear for q, k, v and sk.attention."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 256, dim: int = 32, heads: int = 4):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.out = nnx.Linear(dim, vocab, rngs=rngs)
        self.heads = heads

    def __call__(self, tokens):
        x = self.embed(tokens)
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        return self.out(x + sk.attention(q, k, v, window=48, softcap=30.0, implementation="blocked").reshape(b, t, d))


class _LinenAttentionLM(nn.Module):
    """The same written in Linen, with DenseGeneral projections per head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(256, 32)(tokens)
        q, k, v = (nn.DenseGeneral((4, 8), name=n)(x) for n in "qkv")
        y = sk.attention(q, k, v, window=48, softcap=30.0, implementation="blocked")
        return nn.Dense(256)(x + nn.DenseGeneral(32, axis=(-2, -1))(y))


@pytest.mark.parametrize("style", ["nnx", "linen"])
def test_users_models_calling_sk_attention_train_as_one_device_in_linear_memory(style):
    def model():
        if style == "nnx":
            return sk.from_nnx(_NnxAttentionLM)
        return sk.from_linen(_LinenAttentionLM(), jnp.zeros((2, 16), jnp.int32))

    data = sk.TextDataset.builtin()
    batches = [data.batch(step, batch_size=8, seq_len=256) for step in range(2)]
    one = sk.Trainer(model(), optax.adamw(1e-3), "data=1", devices=jax.devices()[:1])
    sharded = sk.Trainer(model(), optax.adamw(1e-3), "data=4,fsdp=2")
    np.testing.assert_allclose(run_trainer(sharded, batches)[0], run_trainer(one, batches)[0], rtol=2e-5)
    temp = lambda t: sharded.report({"tokens": jax.ShapeDtypeStruct((8, t + 1), jnp.int32)}).memory.temp
    assert temp(2048) < 5 * temp(512)  # 4x the tokens; every score formed would be 16x
