"""LoRA (shardkit.models.lora, shardkit.models.peft): adapters peft saved load onto their base
with peft's logits; adapters shardkit writes are peft's tensors and config; a LoRA run trains
the adapters only (the base bit for bit as it was, optimizer state for the adapters alone, no
weight gradient of the base computed) and equals one device under a hybrid layout; bad
adapters and settings are refused by name."""

import functools
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from helpers import assert_trees_close, run_trainer
from safetensors.numpy import load_file

import shardkit as sk
from shardkit.core.errors import CheckpointError, InputError, ModelError
from shardkit.core.partition import named
from shardkit.models.lora import LoRA
from shardkit.models.peft import split_adapters

REFERENCE = pathlib.Path(__file__).parent / "fixtures" / "hf_reference"
TOKENS = np.load(REFERENCE / "tokens.npy").astype(np.int32)
ONE = dict(layout="data=1", devices=jax.devices()[:1])
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")


def logits(run, params=None):
    return np.asarray(run.trainer.model.apply(run.state.params if params is None else params, TOKENS, None))


@pytest.mark.parametrize("layout", ["data=1", "data=2,fsdp=2,tensor=2"])
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_an_adapter_peft_saved_gives_peft_s_logits(family, layout):
    kwargs = ONE if layout == "data=1" else dict(layout=layout)
    run = sk.from_pretrained(REFERENCE / family, adapter=REFERENCE / "lora" / family, **kwargs)
    want = np.load(REFERENCE / "lora" / family / "reference_logits.npy")
    np.testing.assert_allclose(logits(run), want, atol=2e-6, rtol=0)
    base = np.load(REFERENCE / family / "reference_logits.npy")
    assert np.abs(base - want).max() > 0.1  # the adapter changes the output: the test can fail


def test_an_adapter_written_back_is_peft_s_own_tensors_and_settings(tmp_path):
    source = REFERENCE / "lora" / "qwen3"
    run = sk.from_pretrained(REFERENCE / "qwen3", adapter=source, **ONE)
    out = run.save(run.state.params, tmp_path / "adapter", adapter_only=True)
    theirs, ours = load_file(source / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    mine, peft_s = (json.loads((d / "adapter_config.json").read_text()) for d in (out, source))
    for key in ("r", "lora_alpha", "peft_type", "bias", "task_type"):
        assert mine[key] == peft_s[key], key
    assert sorted(mine["target_modules"]) == sorted(peft_s["target_modules"])
    assert mine["base_model_name_or_path"] == str(REFERENCE / "qwen3")


def test_merged_weights_compute_what_base_and_adapter_compute(tmp_path):
    run = sk.from_pretrained(REFERENCE / "llama3", adapter=REFERENCE / "lora" / "llama3", **ONE)
    merged = sk.from_pretrained(run.save(run.state.params, tmp_path / "merged"), **ONE)
    assert merged.config.lora is None and not any("lora" in k for k in merged.state.params["blocks"]["attn"])
    np.testing.assert_allclose(logits(merged), logits(run), atol=2e-6, rtol=0)


def test_new_adapters_start_as_the_base_and_train_alone():
    run = sk.from_pretrained(REFERENCE / "llama3", lora=LoRA(rank=4, alpha=8, targets=TARGETS), **ONE)
    np.testing.assert_allclose(logits(run), np.load(REFERENCE / "llama3" / "reference_logits.npy"), atol=2e-6)
    base_before, adapters_before = split_adapters(jax.device_get(run.state.params))
    state = run.state
    data = sk.TextDataset.builtin()
    for step in range(2):
        state, metrics = run.trainer.step(state, run.trainer.shard_batch(data.batch(step, 8, 32)))
        assert bool(metrics["finite"])
    base_after, adapters_after = split_adapters(jax.device_get(state.params))
    jax.tree.map(np.testing.assert_array_equal, base_after, base_before)  # the base, bit for bit
    assert not np.array_equal(
        adapters_after["blocks"]["attn"]["lora_q_b"], adapters_before["blocks"]["attn"]["lora_q_b"]
    )


# -- LoRA under a layout, against one device computed without the trainer ---------------------

CFG = sk.models.GPTConfig.preset("tiny", lora=LoRA(rank=4, alpha=8, targets=TARGETS))
LR, STEPS = 1e-2, 3


@functools.cache
def one_device_lora(compute=jnp.float32) -> list[float]:
    """Plain JAX + optax on one device: the GPT's forward, the gradient of the adapters alone.
    ``compute=jnp.bfloat16`` is bf16-master: bf16 weights in the forward (the base stored in
    bf16, never updated), the adapters' fp32 master updated by AdamW."""
    model = CFG.model()
    params = jax.device_put(model.init(jax.random.split(jax.random.key(0))[0]), jax.devices()[0])
    base, adapters = split_adapters(params)
    base = jax.tree.map(lambda x: x.astype(compute), base)
    from shardkit.models.peft import join_adapters

    def loss(adapters, batch):
        tokens = batch["tokens"]
        cast = jax.tree.map(lambda x: x.astype(compute), adapters)
        out = model.apply(join_adapters(base, cast), tokens[:, :-1], None)
        return optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), tokens[:, 1:]).mean()

    tx = optax.adamw(LR)
    opt_state, losses = tx.init(adapters), []
    data = sk.TextDataset.builtin()
    for step in range(STEPS):
        value, grads = jax.value_and_grad(loss)(adapters, data.batch(step, 8, 32))
        updates, opt_state = tx.update(grads, opt_state, adapters)
        adapters = optax.apply_updates(adapters, updates)
        losses.append(float(value))
    return losses


@pytest.mark.parametrize("layout", ["data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2", "stage=2,data=4"])
def test_a_lora_run_equals_one_device(layout):
    microbatches = 2 if "stage" in layout else 1  # a pipeline: 2 microbatches of 4 rows, the same mean
    trainer = sk.Trainer(CFG.model(), optax.adamw(LR), layout, microbatches=microbatches)
    state, losses, data = trainer.init(0), [], sk.TextDataset.builtin()
    for step in range(STEPS):
        state, metrics = trainer.step(state, trainer.shard_batch(data.batch(step, 8, 32)))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, one_device_lora(), rtol=1e-5)
    if "stage" in layout:  # the stages freeze the base too: no weight gradient of it in the schedule
        full = sk.Trainer(sk.models.GPTConfig.preset("tiny").model(), optax.adamw(LR), layout, microbatches=2)
        batch = {"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)}
        assert trainer.report(batch).flops_per_device < 0.85 * full.report(batch).flops_per_device
        return
    # Adapters split as their base weights: B of q over tensor with the kv heads, A of o too.
    specs = trainer.state_shardings.params["blocks"]
    assert "tensor" in str(specs["attn"]["lora_q_b"].spec) and "tensor" in str(specs["attn"]["lora_o_a"].spec)
    assert "fsdp" in str(specs["attn"]["lora_q_a"].spec) and "tensor" in str(specs["mlp"]["lora_down_a"].spec)


def test_the_optimizer_holds_state_for_the_adapters_only_and_no_base_gradient_is_computed():
    batch = {"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)}
    lora = sk.Trainer(CFG.model(), optax.adamw(LR), "data=2,fsdp=2,tensor=2")
    full = sk.Trainer(sk.models.GPTConfig.preset("tiny").model(), optax.adamw(LR), "data=2,fsdp=2,tensor=2")
    lora_report, full_report = lora.report(batch), full.report(batch)
    abstract, shardings = lora.abstract_state().params, lora.state_shardings.params
    _, adapter_abstract = split_adapters(abstract)
    _, adapter_shardings = split_adapters(shardings)
    per_device = sum(
        int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
        for a, s in zip(jax.tree.leaves(adapter_abstract), jax.tree.leaves(adapter_shardings), strict=True)
    )
    moments = 2 * per_device  # adamw's mu and nu of each adapter, split as the adapter
    assert moments <= lora_report.memory.optimizer <= moments + 64  # + the step counters
    assert lora_report.memory.optimizer < 0.2 * full_report.memory.optimizer
    # No weight gradient of the frozen base: a third of a full step's matmul FLOPs is gone.
    assert lora_report.flops_per_device < 0.8 * full_report.flops_per_device


def test_bf16_master_keeps_a_master_copy_of_the_adapters_alone(tmp_path):
    """Under bf16-master a frozen base has no fp32 master (it never updates): the master's bytes
    per device are the adapters' fp32 bytes, under ZeRO-1 too; the run equals one device, and a
    checkpoint of it restores (with the optimizer reset as well)."""
    layout, batch = "data=4,fsdp=2", {"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)}
    lora = sk.Trainer(CFG.model(), optax.adamw(LR), layout, precision="bf16-master", zero=1)
    full = sk.Trainer(
        sk.models.GPTConfig.preset("tiny").model(), optax.adamw(LR), layout, precision="bf16-master", zero=1
    )
    abstract = split_adapters(lora.abstract_state().params)[1]
    update = split_adapters(named(lora.plan.update_specs, lora.mesh))[1]
    adapters_fp32 = sum(
        int(np.prod(s.shard_shape(a.shape))) * 4
        for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(update), strict=True)
    )
    master = lora.report(batch).memory.master
    assert master == adapters_fp32
    assert master < 0.2 * full.report(batch).memory.master

    state, losses, data = lora.init(0), [], sk.TextDataset.builtin()
    base_before = split_adapters(jax.device_get(state.params))[0]
    for step in range(STEPS):
        state, metrics = lora.step(state, lora.shard_batch(data.batch(step, 8, 32)))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, one_device_lora(jnp.bfloat16), rtol=2e-3)
    jax.tree.map(np.testing.assert_array_equal, split_adapters(jax.device_get(state.params))[0], base_before)

    ckpt = sk.Checkpointer(tmp_path / "ck")
    ckpt.save(lora, state, data_position=STEPS, force=True)
    ckpt.close()
    for reset in (False, True):
        restored, _ = sk.Checkpointer(tmp_path / "ck").restore(lora, reset_optimizer=reset)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.master), jax.device_get(state.master))
        after, _ = lora.step(restored, lora.shard_batch(data.batch(STEPS, 8, 32)))
        assert np.isfinite(jax.device_get(after.params["blocks"]["attn"]["lora_q_b"])).all()


# -- bad input ---------------------------------------------------------------------------------


def copy_adapter(tmp_path, family="llama3", **changes):
    out = tmp_path / "adapter"
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REFERENCE / "lora" / family, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: LoRA(rank=0), ModelError, "rank=0"),
        (lambda: LoRA(rank=-2), ModelError, "rank=-2"),
        (lambda: LoRA(targets=("q_proj", "qkv")), ModelError, r"\['qkv'\] not among"),
        (lambda: LoRA(alpha=0), ModelError, "alpha=0"),
        (lambda: sk.models.GPTConfig.preset("tiny-moe", lora=LoRA(targets=("up_proj",))), ModelError, "mixture"),
    ],
    ids=["rank-zero", "rank-negative", "unknown-target", "alpha-zero", "moe-mlp"],
)
def test_bad_settings_are_refused_by_name(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(use_dora=True), "use_dora=True is not supported"),
        (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
        (dict(target_modules=["q_proj", "wqkv"]), r"\['wqkv'\] not among"),
        (dict(bias="all"), "bias='all'"),
        (dict(r=4), r"has shape \(8, 64\); .* implies \(4, 64\)"),
    ],
    ids=["dora", "rank-pattern", "unknown-target", "bias", "other-rank"],
)
def test_an_adapter_shardkit_cannot_honour_is_refused_by_name(tmp_path, changes, message):
    with pytest.raises(CheckpointError, match=message):
        sk.from_pretrained(REFERENCE / "llama3", adapter=copy_adapter(tmp_path, **changes), **ONE)


def test_an_adapter_of_another_base_is_refused_before_any_weight_is_read(tmp_path):
    from safetensors.numpy import save_file

    tensors = load_file(REFERENCE / "lora" / "llama3" / "adapter_model.safetensors")
    narrow = copy_adapter(tmp_path)  # as a base of width 32 would have it
    save_file(
        {k: v[:, :32] if "lora_A" in k and "o_proj" not in k else v for k, v in tensors.items()},
        str(narrow / "adapter_model.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"shape \(8, 32\); .* another base model"):
        sk.from_pretrained(REFERENCE / "llama3", adapter=narrow, **ONE)
    deeper = tmp_path / "deeper"  # as a base of three layers would have it
    shutil.copytree(REFERENCE / "lora" / "llama3", deeper)
    extra = {k.replace("layers.1.", "layers.2."): v for k, v in tensors.items() if "layers.1." in k}
    save_file({**tensors, **extra}, str(deeper / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="another base model"):
        sk.from_pretrained(REFERENCE / "llama3", adapter=deeper, **ONE)
    broken = copy_adapter(tmp_path / "b")
    (broken / "adapter_config.json").write_text('{"r": 8,')
    with pytest.raises(CheckpointError, match="is not JSON"):
        sk.from_pretrained(REFERENCE / "llama3", adapter=broken, **ONE)
    with pytest.raises(InputError, match="not both"):
        sk.from_pretrained(REFERENCE / "llama3", adapter=broken, lora=LoRA(), **ONE)


# -- the command line --------------------------------------------------------------------------


def test_the_command_trains_an_adapter_and_exports_it_from_the_run_alone(tmp_path):
    """``train --init-from BASE --lora-rank 4``, then ``export --checkpoint-dir RUN --adapter-only``
    with nothing else (the run records its base): peft's format, the trained adapter's logits; and
    ``train --adapter`` continues it from where it was."""
    import io

    from shardkit.cli.commands import main
    from shardkit.cli.run import train
    from shardkit.core.config import TrainConfig

    base = str(REFERENCE / "llama3")
    small = dict(batch=8, seq=32, layout="data=2,fsdp=2,tensor=2", sample_tokens=0, lr=1e-2, warmup=0)
    cfg = TrainConfig(
        init_from=base,
        lora_rank=4,
        lora_targets="q_proj,v_proj,down_proj",
        steps=2,
        checkpoint_dir=str(tmp_path / "run"),
        checkpoint_every=2,
        **small,
    )
    trained = train(cfg, out=io.StringIO(), progress=False)
    assert (
        main(["export", "--checkpoint-dir", str(tmp_path / "run"), "--adapter-only", "--out", str(tmp_path / "a")]) == 0
    )
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, base)
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    run = sk.from_pretrained(base, adapter=tmp_path / "a", **ONE)
    np.testing.assert_allclose(logits(run), logits(run, jax.device_get(trained["state"].params)), atol=2e-6)
    assert np.abs(logits(run) - np.load(REFERENCE / "llama3" / "reference_logits.npy")).max() > 1e-3  # it trained
    resumed = TrainConfig(init_from=base, adapter=str(tmp_path / "a"), steps=1, **small)
    again = train(resumed, out=io.StringIO(), progress=False)
    assert again["losses"][0] < trained["losses"][0]  # it goes on from the adapter, not from zero


# -- LoRA on a model written without shardkit --------------------------------------------------


@pytest.mark.parametrize(
    "name, targets",
    [
        ("llama_style", r"self_attn/(q|v)_proj$|mlp/down$"),
        ("gemma_style", r"attn/(q|kv)_einsum$|mlp/up_proj$"),
        ("linen_lm", r"attention/(query|value)$|wo$"),
    ],
)
def test_lora_on_a_users_nnx_model_trains_the_adapters_alone_as_one_device(name, targets):
    """``sk.with_lora``: adapters on the zoo's ``nnx.Linear`` (Llama-style), ``nnx.Einsum``
    (Gemma-style, a stacked (2, K, D, H) k/v kernel) and Linen ``DenseGeneral`` (the Linen LM)
    projections; the base bit for bit as it was, optimizer state for the adapters only, and the
    losses of one device under a hybrid layout."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    from zoo import ZOO

    entry = ZOO[name]
    losses = {}
    for layout in ("data=1", "data=2,fsdp=2,tensor=2"):
        make = (entry.make,) if entry.linen is None else (entry.linen, np.zeros((2, 32), np.int32))
        model = sk.with_lora(*make, targets=targets, lora=LoRA(rank=4, alpha=8))
        devices = jax.devices()[:1] if layout == "data=1" else None
        trainer = sk.Trainer(model, optax.adamw(1e-2), layout, loss=entry.loss, devices=devices)
        state = trainer.init(0)
        base_before = split_adapters(jax.device_get(state.params))[0]
        seen = []
        for step in range(3):
            state, metrics = trainer.step(state, trainer.shard_batch(entry.batch(step)))
            seen.append(float(metrics["loss"]))
        losses[layout] = seen
        base_after, adapters = split_adapters(jax.device_get(state.params))
        jax.tree.map(np.testing.assert_array_equal, base_after, base_before)
        assert any(np.abs(b).max() > 0 for b in jax.tree.leaves(adapters))  # B moved off zero
    np.testing.assert_allclose(losses["data=2,fsdp=2,tensor=2"], losses["data=1"], rtol=2e-5)
    assert losses["data=1"][-1] < losses["data=1"][0]
    specs = trainer.state_shardings.params
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in p): s for p, s in jax.tree_util.tree_flatten_with_path(specs)[0]
    }
    assert any("lora_b" in p and "tensor" in str(s.spec) for p, s in flat.items()), flat  # B split as its kernel's out
    moments = sum(
        int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize * 2
        for p, a, s in zip(flat, jax.tree.leaves(trainer.abstract_state().params), jax.tree.leaves(specs), strict=True)
        if "lora_" in p
    )
    report = trainer.report(
        {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in entry.batch(0).items()}
    )
    assert moments <= report.memory.optimizer <= moments + 64


# Layers stacked by nnx.vmap and applied by nnx.scan, or scanned by Linen's nn.scan: each
# projection's kernel is (layers, in, out), and so must its adapters be.
D, LAYERS, V = 32, 3, 64


def _names(*axes):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)


class StackedBlock(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, 4 * D, kernel_init=_names("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(4 * D, D, kernel_init=_names("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.relu(self.up(x)))


class StackedLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return StackedBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def body(block, x):
            return block(x)

        return self.head(body(self.blocks, self.embed(tokens)))


class LinenBlock(linen.Module):
    @linen.compact
    def __call__(self, x, _):
        init = lambda *axes: linen.with_logical_partitioning(linen.initializers.lecun_normal(), axes)
        h = linen.relu(linen.Dense(4 * D, kernel_init=init("embed", "mlp"), name="up")(x))
        return x + linen.Dense(D, kernel_init=init("mlp", "embed"), name="down")(h), None


class ScannedLinenLM(linen.Module):
    split_dropout: bool = True  # a dropout RNG for each layer (adapter dropout needs one; False: none passed)

    @linen.compact
    def __call__(self, tokens):
        scanned = linen.scan(
            LinenBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True, **({"dropout": True} if self.split_dropout else {})},
            length=LAYERS,
            metadata_params={linen.PARTITION_NAME: "layers"},
        )
        x, _ = scanned(name="blocks")(linen.Embed(V, D, name="embed")(tokens), None)
        return linen.Dense(V, name="head")(x)


def stacked_reference(params: dict, scale: float) -> list[float]:
    """Plain JAX + optax on one device: layer ``l`` computes with slice ``l`` of every stacked
    kernel and adapter; AdamW on the adapters alone."""
    base, adapters = split_adapters(jax.device_get(params))
    from shardkit.models.peft import join_adapters

    def dense(p, x):
        out = x @ p["kernel"] + p["bias"]
        return out + scale * (x @ p["lora_a"]) @ p["lora_b"] if "lora_a" in p else out

    def loss(adapters, tokens):
        p = join_adapters(base, adapters)
        x = p["embed"]["embedding"][tokens[:, :-1]]
        for layer in range(LAYERS):
            block = jax.tree.map(lambda a, i=layer: a[i], p["blocks"])
            x = x + dense(block["down"], jax.nn.relu(dense(block["up"], x)))
        logits = dense(p["head"], x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    tx = optax.adamw(1e-2)
    opt_state, losses = tx.init(adapters), []
    for tokens in stacked_batches():
        value, grads = jax.value_and_grad(loss)(adapters, tokens)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        adapters = optax.apply_updates(adapters, updates)
        losses.append(float(value))
    return losses


def stacked_batches() -> list[np.ndarray]:
    return [np.random.default_rng(step).integers(0, V, (8, 17)).astype(np.int32) for step in range(3)]


@pytest.mark.parametrize("style", ["nnx.vmap + nnx.scan", "linen.scan"])
def test_lora_on_stacked_layers_gives_each_layer_its_own_adapters(style):
    """Adapters on projections whose layers are stacked get the stack's leading dimension (named
    as the kernel's, so split alike), and a LoRA run equals plain JAX on one device that slices
    layer by layer."""
    lora = LoRA(rank=4, alpha=8)
    if style == "linen.scan":
        model = sk.with_lora(ScannedLinenLM(), np.zeros((2, 16), np.int32), targets=r"blocks/(up|down)$", lora=lora)
    else:
        model = sk.with_lora(lambda rngs: StackedLM(rngs), targets=r"blocks/(up|down)$", lora=lora)
    shapes = model.abstract_params()["blocks"]
    assert shapes["up"]["lora_a"].shape == (LAYERS, D, 4) and shapes["down"]["lora_b"].shape == (LAYERS, 4, D)
    trainer = sk.Trainer(model, optax.adamw(1e-2), "data=2,fsdp=2,tensor=2")
    assert "tensor" in str(trainer.param_specs["blocks"]["up"]["lora_b"])  # B split as the kernel's out
    state = trainer.init(0)
    reference = stacked_reference(state.params, lora.scale)
    losses = []
    for tokens in stacked_batches():
        state, metrics = trainer.step(state, trainer.shard_batch({"tokens": tokens}))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference, rtol=2e-5)
    adapters = split_adapters(jax.device_get(state.params))[1]
    b = adapters["blocks"]["up"]["lora_b"]
    assert not np.allclose(b[0], b[1])  # each layer trained its own slice


def test_lora_targets_that_match_nothing_are_refused():
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    from zoo import ZOO

    with pytest.raises(ModelError, match="match no nnx.Linear or nnx.Einsum") as nnx_error:
        sk.with_lora(ZOO["llama_style"].make, targets=r"wqkv$").abstract_params()
    with pytest.raises(ModelError, match="match no nn.Dense or nn.DenseGeneral") as linen_error:
        sk.with_lora(ZOO["linen_lm"].linen, np.zeros((2, 32), np.int32), targets=r"wqkv$")
    # Each message shows paths of that model: a target written from one adapts it (else the same error).
    for error, make in (
        (nnx_error, lambda t: sk.with_lora(ZOO["llama_style"].make, targets=t).abstract_params()),
        (linen_error, lambda t: sk.with_lora(ZOO["linen_lm"].linen, np.zeros((2, 32), np.int32), targets=t)),
    ):
        shown = re.findall(r"'([^']+)'", str(error.value))[1:]  # after the targets' own quotes
        assert len(shown) >= 2
        make(f"^{re.escape(shown[0])}$")


def test_lora_dropout_drops_the_adapters_input_in_training_alike_on_every_layout():
    """peft's lora_dropout: the adapters' input dropped in training (the bits follow the rows, so
    any layout draws the same); evaluating drops nothing."""
    data = sk.TextDataset.builtin().batch(0, 8, 32)
    results = {}
    for rate in (0.0, 0.5):
        cfg = sk.models.GPTConfig.preset("tiny", lora=LoRA(rank=4, alpha=8, targets=TARGETS, dropout=rate))
        for layout in ("data=8", "data=2,fsdp=2,tensor=2"):
            trainer = sk.Trainer(cfg.model(), optax.sgd(0.5), layout)
            state = trainer.init(0)
            state, _ = trainer.step(state, trainer.shard_batch(data))  # B moves off zero
            state, metrics = trainer.step(state, trainer.shard_batch(data))  # now the adapters matter
            held = trainer.evaluate(state, trainer.shard_batch(data))["loss"]
            results[rate, layout] = float(metrics["loss"]), float(held)
    dropped, kept = results[0.5, "data=8"], results[0.0, "data=8"]
    assert dropped[0] == pytest.approx(results[0.5, "data=2,fsdp=2,tensor=2"][0], rel=1e-5)
    assert abs(dropped[0] - kept[0]) > 1e-4  # training dropped something
    assert dropped[1] == pytest.approx(results[0.5, "data=2,fsdp=2,tensor=2"][1], rel=1e-5)


def _stacked_lora(style: str, rate: float) -> sk.Model:
    lora = LoRA(rank=4, alpha=8, dropout=rate)
    if style == "linen.scan":
        return sk.with_lora(ScannedLinenLM(), np.zeros((2, 16), np.int32), targets=r"blocks/(up|down)$", lora=lora)
    return sk.with_lora(lambda rngs: StackedLM(rngs), targets=r"blocks/(up|down)$", lora=lora)


@pytest.mark.parametrize("style", ["nnx.vmap + nnx.scan", "linen.scan"])
def test_lora_dropout_on_your_own_model_drops_in_training_alike_on_every_layout(style):
    """``with_lora(..., lora=LoRA(dropout=p))`` on a user's NNX or Linen model: the adapters'
    input is dropped in training (so the run departs from p=0 once B has moved off zero), the
    bits are the same on any layout and when the step reduces once over each device's rows,
    and evaluating drops nothing."""
    rows = stacked_batches()
    batches = [{"tokens": np.concatenate([rows[i], rows[i - 1]])} for i in range(len(rows))]  # 16 rows
    runs = {}
    for rate, layout, micro, reduce in (
        (0.0, "data=8", 1, "auto"),
        (0.5, "data=8", 1, "auto"),
        (0.5, "data=2,fsdp=2,tensor=2", 1, "auto"),
        (0.5, "data=8", 2, "once"),
        (0.5, "data=8", 2, "per_microbatch"),
    ):
        trainer = sk.Trainer(
            _stacked_lora(style, rate), optax.sgd(0.5), layout, microbatches=micro, reduce_gradients=reduce
        )
        losses, params = run_trainer(trainer, batches)
        held = float(trainer.evaluate(params, trainer.shard_batch(batches[0]))["loss"])
        runs[rate, layout, micro, reduce] = losses, held, params, trainer
    kept, dropped = runs[0.0, "data=8", 1, "auto"], runs[0.5, "data=8", 1, "auto"]
    b_dropped, b_kept = (split_adapters(run[2])[1]["blocks"]["up"]["lora_b"] for run in (dropped, kept))
    assert np.abs(b_dropped - b_kept).max() > 0.1 * np.abs(b_kept).max()  # training dropped something
    np.testing.assert_allclose(dropped[0], runs[0.5, "data=2,fsdp=2,tensor=2", 1, "auto"][0], rtol=1e-5)
    once, each = runs[0.5, "data=8", 2, "once"], runs[0.5, "data=8", 2, "per_microbatch"]
    assert once[3].accumulation.reduces == "once"
    np.testing.assert_allclose(once[0], each[0], rtol=1e-5)  # a vmap over rows draws the microbatch's bits
    assert_trees_close(once[2], each[2], rtol=1e-4, atol=1e-6)
    # Evaluating drops nothing: the dropout-trained adapters score as on a model without dropout.
    plain = runs[0.0, "data=8", 1, "auto"][3]
    assert dropped[1] == pytest.approx(
        float(plain.evaluate(dropped[2], plain.shard_batch(batches[0]))["loss"]), rel=1e-6
    )


def test_lora_dropout_inside_a_linen_scan_without_a_dropout_rng_is_refused_by_name():
    lora = LoRA(rank=4, alpha=8, dropout=0.5)
    model = sk.with_lora(
        ScannedLinenLM(split_dropout=False), np.zeros((2, 16), np.int32), targets=r"blocks/(up|down)$", lora=lora
    )
    trainer = sk.Trainer(model, optax.sgd(0.5), "data=8")
    batch = trainer.shard_batch({"tokens": stacked_batches()[0]})
    needs_dropout_rng = r"LoRA dropout on 'blocks/up'.*split_rngs=\{'params': True, 'dropout': True\}"
    with pytest.raises(ModelError, match=needs_dropout_rng):
        trainer.step(trainer.init(0), batch)
    trainer.evaluate(trainer.init(0), batch)  # evaluating draws nothing: no RNG needed
