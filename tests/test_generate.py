"""Generation: a KV cache whose tokens equal one whole forward per token, batched prompts of any
lengths, sampling keyed by the prompt and not the layout, transformers' greedy continuations on
every family (``tests/fixtures/hf_reference/generate.json``, written by transformers 5.25), the
cache split by the generation layout, and every bad request refused before a compile."""

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.models.generate import Generator, Placement, Sampling, choose
from shardkit.models.kv_cache import recompute_decoder

REFERENCE = pathlib.Path(__file__).parent / "fixtures" / "hf_reference"
FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "mixtral", "gemma2", "gemma3"]
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 8, 7]]  # lengths across a bucket's edge


def one_forward_per_token(model, params, prompt, n):
    """The definition: the whole sequence through ``apply`` for each new token, greedy."""
    apply = jax.jit(lambda p, x: model.apply(p, x, None))
    tokens = list(prompt)
    for _ in range(n):
        out = apply(params, jnp.asarray([tokens]))
        logits = out[0] if isinstance(out, tuple) else out  # a mixture of experts returns (logits, aux)
        tokens.append(int(jnp.argmax(logits[0, -1])))
    return tokens[len(prompt) :]


CONFIGS = {
    "tiny": dict(),
    "unrolled": dict(scan_layers=False),
    # Gemma 2/3's pieces: a window shorter than the rows, alternating layers, two rotary bases, caps.
    "windowed": dict(
        sliding_window=6,
        layer_types=("sliding", "full"),
        rope_local_theta=100.0,
        attn_softcap=20.0,
        final_softcap=10.0,
        qk_norm=True,
        post_norms=True,
        norm_offset=1.0,
    ),
    "experts": dict(n_experts=4, top_k=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_cache_gives_the_tokens_of_one_forward_per_token(name):
    cfg = sk.models.GPTConfig.preset("tiny", **CONFIGS[name])
    model = cfg.model()
    params = model.init(jax.random.key(1))
    got = sk.generate(model, params, PROMPTS, 14)
    # A mixture of experts generates as it would route with no capacity (dropless), as inference does.
    reference_model = sk.models.GPTConfig.preset("tiny", **CONFIGS[name], moe_dropless=True).model()
    assert got == [one_forward_per_token(reference_model, params, p, 14) for p in PROMPTS]


@pytest.mark.parametrize("name", ["tiny", "windowed"])
def test_a_long_prompts_first_pass_in_blocks_equals_the_whole_forward(name):
    """300 tokens: the prefill attends in blocks of 128 queries (plain and written-out attention,
    a window and caps included); every position's next-token logits equal the training forward's."""
    cfg = sk.models.GPTConfig.preset("tiny", max_seq=512, **CONFIGS[name])
    model = cfg.model()
    params = model.init(jax.random.key(2))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (2, 300)), jnp.int32)
    dec = model.decoder
    positions = jnp.broadcast_to(jnp.arange(300, dtype=jnp.int32), (2, 300))
    prefill = jax.jit(lambda p, last: dec.prefill(p, dec.empty(2, 320), tokens, positions, last)[0])
    whole = jax.jit(lambda p: model.apply(p, tokens, None))(params)  # (2, 300, V)
    for last in ([299, 299], [127, 128], [5, 256]):  # ends of blocks, and inside them
        got = prefill(params, jnp.asarray(last, jnp.int32))
        want = whole[jnp.arange(2), jnp.asarray(last)]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_a_model_without_a_cache_runs_whole_rows_and_takes_an_experts_logits():
    """The README's way of wrapping the GPT (no ``decoder``): rows recomputed; a mixture of
    experts returns ``(logits, aux)`` and the logits are what is sampled from."""
    cfg = sk.models.GPTConfig.preset("tiny-moe", moe_dropless=True)
    model = sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs))
    assert model.decoder is None
    params = model.init(jax.random.key(2))
    assert Generator(model, params).decoder.kind == "tokens"
    assert sk.generate(model, params, PROMPTS[:2], 6) == [
        one_forward_per_token(model, params, p, 6) for p in PROMPTS[:2]
    ]


@pytest.mark.parametrize("factory", ["gemma_lm", "linen_lm"])
def test_models_written_without_shardkit_generate_as_the_reference_does(factory):
    import byo_factories

    model = getattr(byo_factories, factory)()
    params = sk.Trainer(model, optax.sgd(0.1), "fsdp=8").init(0).params
    one_device = jax.device_put(params, jax.devices()[0])
    assert sk.generate(model, params, [[3, 1], [4]], 6) == [
        one_forward_per_token(model, one_device, p, 6) for p in ([3, 1], [4])
    ]


@pytest.fixture(scope="module")
def reference_generations():
    return json.loads((REFERENCE / "generate.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate_batched_and_sharded(family, reference_generations):
    """transformers ran each prompt alone; here both run as one batch, on one device and under
    data=2,tensor=2 (rows over data, kv heads over tensor)."""
    run = sk.from_pretrained(REFERENCE / family, layout="data=1", devices=jax.devices()[:1])
    want = reference_generations[family]
    prompts = reference_generations["prompts"]
    assert run.generate(prompts, reference_generations["new_tokens"]) == want
    assert run.generate(prompts, 32, layout="data=2,tensor=2") == want


@pytest.fixture(scope="module")
def tiny():
    model = sk.models.GPTConfig.preset("tiny").model()
    return model, model.init(jax.random.key(0))


def test_sampling_draws_the_same_tokens_on_any_layout_and_the_seed_matters(tiny):
    model, params = tiny
    options = dict(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    one = sk.generate(model, params, PROMPTS, 12, **options)
    assert sk.generate(model, params, PROMPTS, 12, layout="data=2,tensor=2", **options) == one
    assert sk.generate(model, params, PROMPTS, 12, layout="fsdp=4", **options) == one
    assert sk.generate(model, params, PROMPTS, 12, **{**options, "seed": 8}) != one
    # The narrowest top-k and top-p leave only the likeliest token: greedy.
    greedy = sk.generate(model, params, PROMPTS, 12)
    assert sk.generate(model, params, PROMPTS, 12, temperature=1.0, top_k=1, seed=3) == greedy
    assert sk.generate(model, params, PROMPTS, 12, temperature=1.0, top_p=1e-6, seed=3) == greedy


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.split(jax.random.key(0), 2000)
    assert set(np.asarray(choose(logits, keys, Sampling(temperature=1.0, top_k=2))).tolist()) == {0, 1}
    # top_p 0.7: 0.5 alone falls short, 0.5 + 0.3 reaches it: tokens 0 and 1.
    drawn = np.asarray(choose(logits, keys, Sampling(temperature=1.0, top_p=0.7)))
    assert set(drawn.tolist()) == {0, 1}
    assert abs((drawn == 0).mean() - 0.5 / 0.8) < 0.05  # renormalised over what is kept


def test_a_row_stops_after_its_eos_token_and_keeps_it(tiny):
    model, params = tiny
    free = sk.generate(model, params, PROMPTS, 10)
    eos = free[1][3]
    stopped = sk.generate(model, params, PROMPTS, 10, eos_ids=[eos])
    for row, full in zip(stopped, free, strict=True):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:cut]


def test_the_cache_is_split_by_the_generation_layout_and_its_bytes_reported(tiny):
    model, params = tiny
    gen = Generator(model, params, "data=2,tensor=2")
    cfg = sk.models.GPTConfig.preset("tiny")
    state = gen._prefill(
        gen.decoder,
        gen.placement,
        Sampling(),
        24,
        4,
        gen.params,
        *(jax.device_put(x, gen.placement.rows()) for x in (np.ones((2, 8), np.int32), np.array([3, 8], np.int32))),
        *(jax.device_put(x, gen.placement.rows()) for x in (np.arange(2, dtype=np.int32), np.ones(2, bool))),
    )
    assert len(state["cache"]) == cfg.n_layers
    for keys, values in state["cache"]:  # each layer's own (B, N, C, K)
        for x in (keys, values):
            assert x.shape == (2, cfg.n_kv_heads, 24, cfg.head_dim)
            assert x.sharding.shard_shape(x.shape) == (1, cfg.n_kv_heads // 2, 24, cfg.head_dim)
    whole = 2 * cfg.n_layers * keys.size * keys.dtype.itemsize  # keys and values of every layer
    assert gen.cache_bytes_per_device(2, 24) == whole // 4
    assert Generator(model, params).cache_bytes_per_device(2, 24) == whole


def compiled_decode_loop(gen: Generator) -> tuple[dict, str]:
    """One 8-token prompt's state after its prefill (64 positions), and the text of the compiled
    loop that decodes 8 tokens from it."""
    state = gen._prefill(
        gen.decoder, gen.placement, Sampling(), 64, 8, gen.params, jnp.ones((1, 8), jnp.int32),
        jnp.array([8], jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, bool),
    )  # fmt: skip
    lowered = gen._decode.lower(gen.decoder, gen.placement, Sampling(), gen.params, state, jnp.int32(8))
    return state, lowered.compile().as_text()


def test_a_decode_step_costs_one_tokens_work_and_one_device_needs_no_collectives(tiny):
    """The compiled decode loop's FLOPs, against the recompute decoder's over the same cache length."""
    model, params = tiny
    cached = Generator(model, params)
    state, text = compiled_decode_loop(cached)
    assert "while" in text and sum(hlo.count(text).values()) == 0
    recompute = recompute_decoder(lambda p, x: model.apply(p, x, None), 128)

    def flops(decoder, cache):
        step = jax.jit(
            lambda c: decoder.forward(
                cached.params, c, jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), 9), jnp.zeros(1, jnp.int32)
            )
        )
        return step.lower(cache).compile().cost_analysis()["flops"]

    ratio = flops(recompute, jnp.zeros((1, 64), jnp.int32)) / flops(cached.decoder, state["cache"])
    assert ratio > 20, f"a cached step should do a small fraction of a whole row's work, ratio {ratio:.1f}"


def test_a_decode_step_reads_each_layers_weights_and_cache_where_they_lie(tiny):
    """Inside the compiled loop nothing slices a layer's weights or cache out of a stacked array,
    and no layer's cache is copied to be updated: each such copy (at every token) read and wrote
    as many bytes again as the matmuls read."""
    model, params = tiny
    state, text = compiled_decode_loop(Generator(model, params))
    layer_sizes = {int(np.prod(w.shape[1:])) for w in jax.tree.leaves(params["blocks"])}
    layer_sizes.add(int(np.prod(state["cache"][0][0].shape)))
    sliced = []
    for body in re.findall(r"body=%([\w.-]+)", text):  # every loop's body: its own instructions
        block = text[text.index(f"%{body} (") :]
        for line in block[: block.index("\n}")].splitlines()[1:]:
            name, _, op = line.partition(" = ")
            shape = re.match(r"f32\[([\d,]*)\]", op)
            copied = re.search(r"^(dynamic-slice|slice|copy)[\w.-]*$", name.strip().lstrip("%").split("_")[0])
            if shape and copied and int(np.prod([int(d) for d in shape.group(1).split(",") if d])) in layer_sizes:
                sliced.append(name.strip())
    assert not sliced, f"the decode loop slices or copies a layer's weights or cache: {sliced}"


BAD = [
    (dict(prompts=[[1] * 120], max_new_tokens=20), "128 \\(max_seq\\)"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens=0 must be a whole number >= 1"),
    (dict(prompts=[[1]], max_new_tokens=4, temperature=-0.5), "temperature=-0.5 must be >= 0"),
    (dict(prompts=[[1]], max_new_tokens=4, top_p=1.5), "top_p=1.5 must be in \\(0, 1\\]"),
    (dict(prompts=[[1]], max_new_tokens=4, top_p=0.0), "top_p=0.0 must be in \\(0, 1\\]"),
    (dict(prompts=[[1]], max_new_tokens=4, top_k=0), "top_k=0 must be a whole number >= 1"),
    (dict(prompts=[[1, 2], []], max_new_tokens=4), "prompt 1 is empty"),
    (dict(prompts=[], max_new_tokens=4), "non-empty list of token-id lists"),
    (dict(prompts=[["a"]], max_new_tokens=4), "prompt 0 must be a list of token ids"),
    (dict(prompts=[[1], [1, 300]], max_new_tokens=4), "prompt 1 holds token id 300, outside .* \\[0, 256\\)"),
]


@pytest.mark.parametrize("request_, message", BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_bad_requests_are_refused_by_name(tiny, request_, message):
    model, params = tiny
    with pytest.raises(sk.errors.InputError, match=message):
        sk.generate(model, params, **request_)


def test_a_layout_that_cannot_split_the_kv_heads_is_refused(tiny):
    model, params = tiny  # 4 kv heads
    with pytest.raises(sk.errors.LayoutError, match="4 kv heads over tensor=8"):
        sk.generate(model, params, [[1]], 2, layout="tensor=8")


def test_placement_without_a_layout_is_one_device(tiny):
    model, params = tiny
    sharded = jax.device_put(params, sk.Trainer(model, optax.sgd(0.1), "fsdp=4,tensor=2").state_shardings.params)
    gen = Generator(model, sharded)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(gen.params)} == {1}
    assert Placement.of(None).batch_multiple() == 1 and Placement.of("data=2,fsdp=2").batch_multiple() == 4


@pytest.mark.slow
def test_the_command_streams_one_prompt_and_writes_a_json_line_per_prompt(tmp_path, reference_generations):
    from helpers import run_cli

    family = REFERENCE / "llama3"  # no tokenizer.json beside it: text is cut into bytes
    run = sk.from_pretrained(family, layout="data=1", devices=jax.devices()[:1])
    texts = ["abc", "hello, world"]
    want = run.generate([list(t.encode()) for t in texts], 12)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    common = ("generate", "--init-from", str(family), "--max-new-tokens", "12", "--ignore-eos")
    batch = run_cli(*common, "--prompts", str(prompts), "--layout", "data=2,tensor=2")
    assert batch.returncode == 0, batch.stderr
    rows = [json.loads(line) for line in batch.stdout.splitlines()]
    assert [r["tokens"] for r in rows] == want and [r["prompt"] for r in rows] == texts
    assert "KV cache:" in batch.stderr and "data=2,tensor=2" in batch.stderr
    one = run_cli(*common, "--prompt", "abc")
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith("abc") and one.stdout.rstrip("\n") == "abc" + rows[0]["completion"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--max-new-tokens", "0"), "max_new_tokens=0"),
        (("--max-new-tokens", "4", "--top-p", "2"), "top_p=2.0 must be in"),
        (("--max-new-tokens", "4", "--layout", "tensor=8"), "kv heads over tensor=8"),
        (("--max-new-tokens", "4", "--prompts", "PROMPTS"), 'line 2: each line needs a "prompt" string'),
        (("--max-new-tokens", "4000"), "max_seq"),
    ],
    ids=["no-new-tokens", "top-p", "kv-heads", "prompts-row", "too-long"],
)
def test_the_command_refuses_bad_requests_by_name(tmp_path, flags, message):
    from shardkit.cli.commands import main

    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    flags = tuple(str(bad) if f == "PROMPTS" else f for f in flags)
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stderr(buffer):
        assert main(["generate", "--init-from", str(REFERENCE / "llama3"), *flags]) == 2
    assert message in buffer.getvalue(), buffer.getvalue()


def test_the_command_continues_a_saved_run_as_its_parameters_do(tmp_path):
    """``shardkit generate --checkpoint-dir RUN --model tiny``: the run's own parameters, read
    from its checkpoint, continue a prompt as sk.generate does with the same parameters."""
    import contextlib
    import io

    from shardkit.cli.commands import main
    from shardkit.cli.run import train
    from shardkit.core.config import TrainConfig

    run = tmp_path / "run"
    cfg = TrainConfig(model="tiny", steps=2, batch=8, seq=32, layout="fsdp=8", sample_tokens=0)
    trained = train(
        dataclasses.replace(cfg, checkpoint_dir=str(run), checkpoint_every=2), out=io.StringIO(), progress=False
    )
    model = sk.models.GPTConfig.preset("tiny").model()
    want = sk.generate(model, trained["state"].params, [list(b"def ")], 10)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        flags = ["--max-new-tokens", "10", "--prompts", str(tmp_path / "p.jsonl")]
        (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def "}) + "\n")
        assert main(["generate", "--model", "tiny", "--checkpoint-dir", str(run), *flags]) == 0
    assert json.loads(out.getvalue().splitlines()[0])["tokens"] == want
