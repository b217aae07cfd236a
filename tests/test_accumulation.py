"""Gradient accumulation that reduces once per step: the gradient bytes of K microbatches equal
one microbatch's in the compiled program, and the result equals one device's, dropout included."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from byo_models import GemmaLM, LinenLM, LMConfig
from flax import linen as nn
from flax import nnx
from helpers import assert_adam_params_close, assert_trees_close, reference_training, run_trainer

import shardkit as sk
from shardkit.core.errors import InputError, LayoutError
from shardkit.core.rules import entry_axes
from shardkit.models import GPT, GPTConfig
from shardkit.models.dropout import dropout

K = 4
B, T = 32, 32
DROPOUT = GPTConfig.preset("tiny", dropout=0.1)
BATCHES = [sk.TextDataset.builtin().batch(step, batch_size=B, seq_len=T) for step in range(3)]
SHAPE = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
# Layouts whose rows split over the data and/or fsdp axes, and how each is asked to reduce.
LAYOUTS = [("data=8", "auto"), ("fsdp=8", "once"), ("data=2,fsdp=2,tensor=2", "once")]


def accumulated_dropout_reference(lr: float, cfg: GPTConfig = DROPOUT) -> tuple[list[float], dict]:
    """One device, plain jax and optax: microbatch j of step i takes rows j::K and draws its
    dropout bits from fold_in(fold_in(rng, i), j), as TrainState and the step document."""
    graphdef = nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0)))
    init_key, rng = jax.random.split(jax.random.key(0))
    params = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(init_key)), nnx.Param))
    tx = optax.sgd(lr)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, tokens, i):
        key = jax.random.fold_in(rng, i)

        def loss_fn(p):
            total = 0.0
            for j in range(K):
                rows = tokens[j::K]
                logits = nnx.merge(graphdef, p)(rows[:, :-1], rngs=nnx.Rngs(dropout=jax.random.fold_in(key, j)))
                total += optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()
            return total / K

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, loss

    losses = []
    for i, b in enumerate(BATCHES):
        params, opt, loss = step(params, opt, jnp.asarray(b["tokens"]), i)
        losses.append(float(loss))
    return losses, jax.device_get(params)


@pytest.fixture(scope="module")
def dropout_reference():
    return accumulated_dropout_reference(lr=0.3)


@pytest.mark.parametrize("layout,reduce", LAYOUTS)
def test_reducing_once_equals_one_device_dropout_included(layout, reduce, dropout_reference):
    ref_losses, ref_params = dropout_reference
    trainer = sk.Trainer(DROPOUT.model(), optax.sgd(0.3), layout, microbatches=K, reduce_gradients=reduce)
    losses, params = run_trainer(trainer, BATCHES)
    assert trainer.accumulation.reduces == "once"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # SGD: the parameters move by the gradients themselves, so elementwise is machine-independent.
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-6)


def gradient_bytes(trainer: sk.Trainer) -> float:
    """Bytes per device per step of the gradients' reductions: backward all-reduces and
    reduce-scatters over the axes that split the rows (data, fsdp), not tensor's activations."""
    report = trainer.report(SHAPE)
    return sum(
        c.moved_bytes
        for c in report.collectives
        if c.direction == "backward"
        and c.kind in ("all-reduce", "reduce-scatter")
        and c.axes
        and set(c.axes) <= {"data", "fsdp"}
    )


def reduction_bound(trainer: sk.Trainer) -> float:
    """Bytes per device of reducing fp32 gradients once, parameter by parameter, with ring
    collectives: a reduce-scatter over the row axes that split it, then an all-reduce of its
    shard over the other row axes (data parallelism's bytes plus ZeRO-3's)."""
    mesh, rows, total = dict(trainer.mesh.shape), {"data", "fsdp"}, 0.0
    specs = jax.tree.leaves(trainer.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for spec, leaf in zip(specs, jax.tree.leaves(trainer.abstract_params), strict=True):
        used = {a for entry in spec for a in entry_axes(entry)}
        local = 4 * leaf.size / math.prod(mesh[a] for a in used - rows)
        scattered = math.prod(mesh.get(a, 1) for a in used & rows)
        reduced = math.prod(mesh.get(a, 1) for a in rows - used)
        total += (scattered - 1) / scattered * local + 2 * (reduced - 1) / reduced * local / scattered
    return total


@pytest.mark.parametrize("layout,reduce", LAYOUTS)
def test_k_microbatches_move_the_gradient_bytes_of_one(layout, reduce):
    model = GPTConfig.preset("tiny").model()
    one = gradient_bytes(sk.Trainer(model, optax.adamw(1e-3), layout))
    once = sk.Trainer(model, optax.adamw(1e-3), layout, microbatches=K, reduce_gradients=reduce)
    each = sk.Trainer(model, optax.adamw(1e-3), layout, microbatches=K, reduce_gradients="per_microbatch")
    # At the ring bound, and never above one microbatch's (which, on the hybrid layout, reduces
    # the embedding and the norms over data and fsdp at once: 8% above the bound).
    assert gradient_bytes(once) == pytest.approx(reduction_bound(once), rel=0.01)
    assert gradient_bytes(once) <= 1.01 * one
    assert gradient_bytes(each) >= 0.95 * K * one  # what reducing once saves: the loop's K reductions
    report = once.report(SHAPE)
    assert report.gradient_reduction == "once"
    assert "gradients reduced once per step" in report.table()


DEEP_DROPOUT = GPTConfig.preset("tiny", dropout=0.1, n_layers=4)
# Pipelines: layout, how asked to reduce, schedule, virtual stages, model.
PIPELINES = [
    ("stage=2,data=4", "auto", "1f1b", 1, DROPOUT),
    ("stage=2,data=2,fsdp=2", "once", "gpipe", 1, DROPOUT),
    ("stage=2,data=2,tensor=2", "auto", "1f1b", 2, DEEP_DROPOUT),
]


@pytest.fixture(scope="module")
def deep_dropout_reference():
    return accumulated_dropout_reference(lr=0.3, cfg=DEEP_DROPOUT)


@pytest.mark.parametrize("layout,reduce,schedule,virtual,cfg", PIPELINES)
@pytest.mark.slow
def test_pipeline_reduces_once_after_the_schedule(
    layout, reduce, schedule, virtual, cfg, dropout_reference, deep_dropout_reference
):
    ref_losses, ref_params = dropout_reference if cfg is DROPOUT else deep_dropout_reference
    kwargs = dict(microbatches=K, schedule=schedule, virtual_stages=virtual)
    once = sk.Trainer(cfg.model(), optax.sgd(0.3), layout, reduce_gradients=reduce, **kwargs)
    losses, params = run_trainer(once, BATCHES)
    assert once.accumulation.reduces == "once"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-6)
    each = sk.Trainer(cfg.model(), optax.sgd(0.3), layout, reduce_gradients="per_microbatch", **kwargs)
    # Once per step, at the ring bound of the parameters each stage holds; per microbatch, each
    # backward slot reduces its microbatch's gradients.
    assert gradient_bytes(once) == pytest.approx(reduction_bound(once), rel=0.01)
    assert gradient_bytes(each) >= 0.95 * K * gradient_bytes(once)
    assert once.report(SHAPE).gradient_reduction == "once"


CFG = LMConfig(dim=64, mlp=256, layers=2)
MODELS = {
    "nnx-gemma": lambda: sk.from_nnx(lambda rngs: GemmaLM(CFG, rngs=rngs)),
    "linen-lm": lambda: sk.from_linen(LinenLM(CFG), jnp.zeros((2, T), jnp.int32)),
}


def byo_reference(kind: str) -> tuple[list[float], dict]:
    """The whole batch in one pass on one device, flax and optax only (equal to K microbatches
    for a mean loss over rows)."""
    if kind == "nnx-gemma":
        with nnx.use_eager_sharding(False):
            graphdef = nnx.graphdef(nnx.eval_shape(lambda: GemmaLM(CFG, rngs=nnx.Rngs(0))))

        def init(key):
            with nnx.use_eager_sharding(False):
                return nnx.to_pure_dict(nnx.state(GemmaLM(CFG, rngs=nnx.Rngs(key)), nnx.Param))

        def forward(p, tokens):
            return nnx.merge(graphdef, p)(tokens)
    else:
        module = LinenLM(CFG)

        def init(key):
            return nn.meta.unbox(module.init({"params": key, "dropout": key}, jnp.zeros((2, T), jnp.int32))["params"])

        def forward(p, tokens):
            return module.apply({"params": p}, tokens)

    def loss_fn(params, batch):
        logits = forward(params, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    return reference_training(init, lambda p, b: p, loss_fn, optax.adamw(3e-3), BATCHES)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.slow
def test_models_written_without_shardkit_reduce_once(kind):
    ref_losses, ref_params = byo_reference(kind)
    for layout, reduce in [("data=8", "auto"), ("fsdp=8", "once")]:
        trainer = sk.Trainer(MODELS[kind](), optax.adamw(3e-3), layout, microbatches=K, reduce_gradients=reduce)
        losses, params = run_trainer(trainer, BATCHES)
        assert trainer.accumulation.reduces == "once", layout
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
        assert_adam_params_close(params, ref_params, lr=3e-3, steps=len(BATCHES))
        # At the ring bound. (One microbatch's own figure is no yardstick here: under fsdp=8 XLA
        # moves the Linen LM's embedding gradient as activations, outside the gradient reductions.)
        assert gradient_bytes(trainer) == pytest.approx(reduction_bound(trainer), rel=0.01), layout


class DropoutLM(nnx.Module):
    """An LM written the usual NNX way: nnx.Dropout drawing from the rngs it is called with."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.1)
        self.out = nnx.Linear(32, 64, rngs=rngs)

    def __call__(self, tokens, rngs=None):
        return self.out(self.drop(self.embed(tokens), rngs=rngs))


def test_a_model_that_draws_its_own_bits_is_reduced_per_microbatch_or_refused():
    batch = {"tokens": np.random.default_rng(0).integers(0, 64, (B, T + 1)).astype(np.int32)}
    auto = sk.Trainer(sk.from_nnx(DropoutLM), optax.sgd(0.1), "data=8", microbatches=K)
    _, metrics = auto.step(auto.init(0), auto.shard_batch(batch))
    assert auto.accumulation.reduces == "per_microbatch"
    assert "draws random bits itself" in auto.accumulation.reason
    assert np.isfinite(float(metrics["loss"]))
    once = sk.Trainer(sk.from_nnx(DropoutLM), optax.sgd(0.1), "data=8", microbatches=K, reduce_gradients="once")
    with pytest.raises(sk.ShardkitError, match=r"draws random bits itself.*sk.dropout"):
        once.lower(batch)


def test_a_mixture_of_experts_auxiliary_loss_is_reduced_per_microbatch():
    moe = GPTConfig.preset("tiny-moe")
    trainer = sk.Trainer(moe.model(), optax.adamw(1e-3), "data=8", microbatches=K)
    trainer.lower(SHAPE)
    assert trainer.accumulation.reduces == "per_microbatch"
    assert "auxiliary loss" in trainer.accumulation.reason


@pytest.mark.parametrize(
    "layout,reduce,error,match",
    [
        ("data=8", "sometimes", InputError, r"reduce_gradients='sometimes': choose one of"),
        ("data=4,sequence=2", "once", LayoutError, r"sequence=2 splits more than the rows"),
        ("data=8:explicit", "once", LayoutError, r"Explicit mesh axes"),
        ("tensor=4,data=1", "once", LayoutError, r"no mesh axis splits the rows"),
    ],
)
def test_reducing_once_where_it_cannot_be_done_is_refused_before_tracing(layout, reduce, error, match):
    cfg = GPTConfig.preset("tiny", n_layers=2, scan_layers=True)
    devices = jax.devices()[:4] if layout.startswith("tensor=4") else None  # tiny has 4 KV heads
    with pytest.raises(error, match=match):
        sk.Trainer(cfg.model(), optax.adamw(1e-3), layout, microbatches=K, reduce_gradients=reduce, devices=devices)


def test_auto_keeps_fsdp_gradients_split_and_says_why():
    trainer = sk.Trainer(GPTConfig.preset("tiny").model(), optax.adamw(1e-3), "fsdp=8", microbatches=K)
    assert trainer.accumulation.reduces == "per_microbatch"
    assert "split over fsdp" in trainer.accumulation.reason
    assert "gradients reduced per microbatch: the parameters are split over fsdp" in trainer.report(SHAPE).table()


def test_dropout_of_row_blocks_draws_the_bits_of_the_whole():
    x = jax.random.normal(jax.random.key(3), (8, 5, 4))
    key = jax.random.key(7)
    whole = dropout(x, 0.25, key)
    blocks = jax.vmap(lambda h: dropout(h, 0.25, key))(x.reshape(4, 2, 5, 4)).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(blocks), np.asarray(whole))
    kept = np.asarray(whole != 0)
    assert 0.6 < kept.mean() < 0.9  # about 1 - rate kept
    np.testing.assert_allclose(np.asarray(whole)[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
    # Gradients flow through the kept elements only, vmapped or not.
    g = jax.grad(lambda h: dropout(h, 0.25, key).sum())(x)
    np.testing.assert_allclose(np.asarray(g), kept / 0.75, rtol=1e-6)
    # A vmap over keys draws each its own bits.
    per_key = jax.vmap(lambda k: dropout(jnp.ones((4, 4)), 0.5, k))(jax.random.split(key, 2))
    assert not np.array_equal(np.asarray(per_key[0]), np.asarray(per_key[1]))


def test_zero_stages_reduce_once_onto_the_optimizers_shards():
    cfg = GPTConfig.preset("tiny")
    base = sk.Trainer(cfg.model(), optax.sgd(0.3), "data=8", microbatches=K, reduce_gradients="per_microbatch")
    _, want = run_trainer(base, BATCHES[:2])
    bytes_by_stage = {}
    for zero in (1, 2):
        # ZeRO-1 splits the optimizer's copies, not the parameters or gradients: 'auto' reduces
        # once. ZeRO-2 splits the gradients, so 'auto' sums them per microbatch on their shards
        # (test_zero.py), and reducing once is asked for.
        reduce = "auto" if zero == 1 else "once"
        trainer = sk.Trainer(cfg.model(), optax.sgd(0.3), "data=8", microbatches=K, zero=zero, reduce_gradients=reduce)
        _, params = run_trainer(trainer, BATCHES[:2])
        assert trainer.accumulation.reduces == "once"
        assert_trees_close(params, want, rtol=1e-4, atol=1e-6)
        bytes_by_stage[zero] = gradient_bytes(trainer)
    # ZeRO-1 all-reduces the sums once; ZeRO-2 reduce-scatters them onto the optimizer's shards.
    assert bytes_by_stage[1] == pytest.approx(reduction_bound(trainer), rel=0.01)
    assert bytes_by_stage[2] == pytest.approx(bytes_by_stage[1] / 2, rel=0.01)


PLAIN = GPTConfig.preset("tiny")


def masked_batches(fractional: bool = False) -> list[dict]:
    """Rows scoring very different numbers of tokens: row r is padding (segment 0) from
    ``lengths[r]`` on and a prompt (loss_mask 0) for its first ``prompts[r]`` tokens. Microbatch
    ``j`` takes rows ``j::K``, so the microbatches' counts differ about fourfold. ``fractional``:
    the completion tokens weigh float32 values in [0.1, 2) (whose sums no int count holds)."""
    out = []
    for step, b in enumerate(BATCHES):
        rng = np.random.default_rng(step)
        rows = np.arange(B)
        lengths = np.where(rows % K == 0, T + 1, rng.integers(6, 12, B))
        prompts = rng.integers(1, 5, B)
        positions = np.arange(T + 1)[None, :]
        segments = (positions < lengths[:, None]).astype(np.int32)
        loss_mask = (positions >= prompts[:, None]).astype(np.int32)
        if fractional:
            loss_mask = (loss_mask * rng.uniform(0.1, 2.0, loss_mask.shape)).astype(np.float32)
        out.append({"tokens": b["tokens"], "segments": segments, "loss_mask": loss_mask})
    return out


def token_weighted_reference(lr: float, batches: list[dict], cfg: GPTConfig = PLAIN) -> tuple[list[float], dict]:
    """One device, plain jax and optax, the whole batch in one pass: the loss is the sum of the
    scored tokens' cross-entropies over their number. A row of one document followed by
    padding needs no segment mask: causal attention never reads the padding after a token."""
    graphdef = nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0)))

    def init(key):
        return nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(key)), nnx.Param))

    def loss_fn(logits, batch):
        seg, mask = batch["segments"], batch["loss_mask"]
        weight = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)).astype(jnp.float32) * mask[:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        return (ce * weight).sum() / weight.sum()

    forward = lambda p, batch: nnx.merge(graphdef, p)(batch["tokens"][:, :-1])
    return reference_training(init, forward, loss_fn, optax.sgd(lr), batches)


# layout, how asked to reduce, pipeline schedule (None: a plain step), what the step does
MASKED = [
    ("data=8", "auto", None, "once"),
    ("data=2,fsdp=2,tensor=2", "per_microbatch", None, "per_microbatch"),
    ("stage=2,data=4", "auto", "1f1b", "once"),
    ("stage=2,data=2,tensor=2", "per_microbatch", "gpipe", "per_microbatch"),
]


def trains_as_one_pass(batches: list[dict], layout: str, reduce: str, schedule, reduces: str):
    """A trainer of K microbatches run on ``batches``, checked against the one-device token-weighted
    reference (losses and parameters); returns it and its losses."""
    ref_losses, ref_params = token_weighted_reference(0.3, batches)
    trainer = sk.Trainer(
        PLAIN.model(), optax.sgd(0.3), layout, microbatches=K, reduce_gradients=reduce, schedule=schedule
    )
    losses, params = run_trainer(trainer, batches)
    assert trainer.accumulation.reduces == reduces
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-6)
    return trainer, losses


@pytest.mark.parametrize("layout,reduce,schedule,reduces", MASKED)
def test_microbatches_with_loss_masks_give_the_token_weighted_loss(layout, reduce, schedule, reduces):
    """K microbatches that score different numbers of tokens weigh each microbatch's mean by its
    count: the loss and the update of one pass over the batch, not the mean of K means."""
    batches = masked_batches()
    _, losses = trains_as_one_pass(batches, layout, reduce, schedule, reduces)
    unweighted = np.mean(
        [float(token_weighted_reference(0.0, [{k: v[j::K] for k, v in batches[0].items()}])[0][0]) for j in range(K)]
    )
    assert abs(losses[0] - unweighted) > 1e-3  # the mean of K means differs: the test can tell


@pytest.mark.parametrize("layout,reduce,schedule,reduces", [MASKED[0], MASKED[1], MASKED[2]])
def test_fractional_loss_weights_weigh_microbatches_by_their_sums(layout, reduce, schedule, reduces):
    """A ``loss_mask`` of float weights: each microbatch's weighted mean weighs the sum of its
    weights (kept as a float32 count, not truncated), so K microbatches give one pass's loss."""
    batches = masked_batches(fractional=True)
    trainer, _ = trains_as_one_pass(batches, layout, reduce, schedule, reduces)
    scored = trainer.evaluate(trainer.init(0), trainer.shard_batch(batches[0]))["tokens"]
    assert scored.dtype == jnp.float32
    seg, mask = batches[0]["segments"], batches[0]["loss_mask"]
    want = (((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)) * mask[:, 1:]).sum()
    np.testing.assert_allclose(float(scored), want, rtol=1e-5)


# -- a parameter read twice, without microbatches ---------------------------------------------


def data_gradient_bytes(trainer: sk.Trainer, batch: dict) -> float:
    """Bytes per device of the backward reductions over ``data`` (the gradients')."""
    return sum(
        c.moved_bytes
        for c in trainer.report(batch).collectives
        if c.direction == "backward" and c.kind in ("all-reduce", "reduce-scatter") and c.axes == ("data",)
    )


@pytest.mark.parametrize("name", ["gemma_style", "encoder_decoder", "llama_style", "vit"])
@pytest.mark.parametrize("layout", ["data=8", "data=4,tensor=2"])
def test_a_parameter_read_twice_has_its_gradient_reduced_once(name, layout):
    """A table tied to the output layer (gemma_style) or shared by encoder and decoder has two
    gradient parts, which XLA reduces over ``data`` one by one; the step sums them on each
    device and reduces once, at the ring bound of the parameters. Never more bytes than XLA's
    own pass on any model (llama_style reads each parameter once, the ViT convolves)."""
    from zoo import ZOO
    from zoo_factories import trainer

    batch = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in ZOO[name].batch(0).items()}
    step = trainer(name, optax.adamw(1e-3), layout)
    xla = trainer(name, optax.adamw(1e-3), layout, reduce_gradients="per_microbatch")  # K=1: XLA's one pass
    ours, theirs = data_gradient_bytes(step, batch), data_gradient_bytes(xla, batch)
    assert ours <= theirs * 1.001
    if name in ("gemma_style", "encoder_decoder"):
        assert ours == pytest.approx(reduction_bound(step), rel=0.01)
        assert theirs > 1.03 * ours  # what reducing each use's part costs: the test can tell


def test_a_tied_gpt_reduced_once_equals_one_device():
    cfg = GPTConfig.preset("tiny", tie_embeddings=True)
    graphdef = nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0)))

    def init(key):
        return nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(key)), nnx.Param))

    def loss_fn(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    forward = lambda p, batch: nnx.merge(graphdef, p)(batch["tokens"][:, :-1])
    ref_losses, ref_params = reference_training(init, forward, loss_fn, optax.sgd(0.3), BATCHES)
    trainer = sk.Trainer(cfg.model(), optax.sgd(0.3), "data=4,tensor=2")
    losses, params = run_trainer(trainer, BATCHES)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-6)
    assert data_gradient_bytes(trainer, SHAPE) == pytest.approx(reduction_bound(trainer), rel=0.01)


def test_a_tied_gpt_reduced_once_weighs_each_devices_rows_by_their_scored_tokens():
    """Without microbatches, the one reduction of a tied model weighs each device's block of rows
    by the tokens it scores under a loss mask: the loss of one pass over the whole batch."""
    cfg = GPTConfig.preset("tiny", tie_embeddings=True)
    batches = masked_batches()
    ref_losses, ref_params = token_weighted_reference(0.3, batches, cfg)
    trainer = sk.Trainer(cfg.model(), optax.sgd(0.3), "data=4,tensor=2")
    losses, params = run_trainer(trainer, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-6)
