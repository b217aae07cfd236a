"""A model that names no axes at all (Flax's built-in layers, no sharding metadata, no shardkit
calls) still gets ZeRO-3 under fsdp: every parameter and its optimizer state split over fsdp,
weights gathered before use, gradients reduce-scattered, losses equal to one device's."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from byo_models import LMConfig, PlainLM
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardkit as sk

CFG = LMConfig(dim=64, heads=4, mlp=256, layers=2)
B, T, LR, STEPS = 16, 32, 3e-3, 3


def plain_lm(rngs: nnx.Rngs) -> PlainLM:
    return PlainLM(CFG, rngs=rngs)


BATCHES = [sk.TextDataset.builtin().batch(s, batch_size=B, seq_len=T) for s in range(STEPS)]


def one_device_losses():
    """Plain Flax NNX + optax on one device; parameters from ``split(key(0))[0]``, as documented."""
    init_key, _ = jax.random.split(jax.random.key(0))
    with jax.default_device(jax.devices()[0]):
        model = plain_lm(nnx.Rngs(init_key))
        optimizer = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
        losses = []
        for batch in BATCHES:
            tokens = jnp.asarray(batch["tokens"])

            def loss_fn(m, tokens=tokens):
                logits = m(tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            losses.append(float(loss))
        return losses


@pytest.mark.slow
def test_an_unannotated_model_gets_zero3_under_fsdp():
    model = sk.from_nnx(plain_lm)
    trainer = sk.Trainer(model, optax.adamw(LR), "fsdp=8")
    # Every matrix is split over fsdp (each has a dimension 8 divides), and its Adam moments too;
    # the vectors (biases, LayerNorm scales) stay whole (fsdp_min_size's default).
    leaves = jax.tree.leaves(trainer.state_shardings.params, is_leaf=lambda x: hasattr(x, "spec"))
    shapes = jax.tree.leaves(trainer.abstract_params)
    split = ["fsdp" in str(s.spec) for s in leaves]
    assert split == [len(x.shape) >= 2 for x in shapes], [(s.spec, x.shape) for s, x in zip(leaves, shapes)]
    moments = jax.tree.leaves(trainer.state_shardings.opt_state, is_leaf=lambda x: hasattr(x, "spec"))
    assert sum("fsdp" in str(s.spec) for s in moments) == 2 * sum(split)  # Adam's mu and nu
    assert tuple(trainer.state_shardings.params["embed"]["embedding"].spec)[:1] == ("fsdp",)  # vocab rows
    # The compiled step: weights gathered and gradients reduce-scattered over fsdp, at the bound;
    # state per device an eighth of data parallelism's.
    batch = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
    fsdp = trainer.report(batch)
    data = sk.Trainer(model, optax.adamw(LR), "data=8").report(batch)
    kinds = {(c.kind, c.axes) for c in fsdp.collectives}
    assert ("all-gather", ("fsdp",)) in kinds and ("reduce-scatter", ("fsdp",)) in kinds
    assert fsdp.ratios["bytes"] <= 1.05
    assert fsdp.memory.arguments < data.memory.arguments / 6
    # Training: the losses of an independent one-device loop.
    state, losses = trainer.init(0), []
    for b in BATCHES:
        state, metrics = trainer.step(state, trainer.shard_batch(b))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, one_device_losses(), rtol=2e-5)


def test_a_model_that_names_some_axes_keeps_the_others_as_it_wrote_them():
    """Flax reads an unannotated parameter of an annotated model as replicated on purpose."""

    class Half(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))
            self.named = nnx.Linear(CFG.dim, CFG.dim, kernel_init=init, use_bias=False, rngs=rngs)
            self.plain = nnx.Linear(CFG.dim, CFG.dim, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.plain(self.named(x))

    trainer = sk.Trainer(sk.from_nnx(Half), optax.sgd(0.1), "fsdp=8", loss=sk.mse_loss)
    assert trainer.state_shardings.params["named"]["kernel"].spec == P("fsdp", None)
    assert trainer.state_shardings.params["plain"]["kernel"].spec == P()


def test_a_tensor_axis_under_a_model_that_names_nothing_is_a_warning_with_the_fix():
    model = sk.from_nnx(plain_lm)
    with pytest.warns(UserWarning, match="(?s)names no parameter's axes.*tensor=2.*sk.annotate"):
        trainer = sk.Trainer(model, optax.adamw(LR), "fsdp=4,tensor=2")
    assert any("repeat each other's work" in w for w in sk.report.sharding_warnings(trainer))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sk.Trainer(model, optax.adamw(LR), "fsdp=8")  # nothing to warn about


class ScannedBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(CFG.dim, rngs=rngs)
        self.up = nnx.Linear(CFG.dim, CFG.mlp, rngs=rngs)
        self.down = nnx.Linear(CFG.mlp, CFG.dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(self.down(nnx.gelu(self.up(self.ln(x)))))


class ScannedLM(nnx.Module):
    """Layers stacked with nnx.vmap and run with nnx.scan, as Flax's docs write a deep model, each
    keeping its dropout stream; no metadata."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 8):
        self.embed = nnx.Embed(CFG.vocab, CFG.dim, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return ScannedBlock(rngs)

        self.blocks = stack(rngs)
        self.head = nnx.Linear(CFG.dim, CFG.vocab, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, x):
            return block(x)

        return self.head(run(self.blocks, self.embed(tokens)))


def test_stacked_layers_keep_their_layer_dimension_whole_and_train_alike_under_every_layout():
    model = sk.from_nnx(ScannedLM)
    results = {}
    for layout in ("data=8", "fsdp=8"):
        trainer = sk.Trainer(model, optax.adamw(LR), layout)
        state, losses = trainer.init(0), []
        evaluated = float(trainer.evaluate(state, trainer.shard_batch(BATCHES[0]))["loss"])
        for b in BATCHES:
            state, metrics = trainer.step(state, trainer.shard_batch(b))
            losses.append(float(metrics["loss"]))
        results[layout] = (losses, evaluated)
    # (8 layers, 64, 256): the layer dimension 8 divides too, but the scan reads one layer a step.
    assert tuple(trainer.state_shardings.params["blocks"]["up"]["kernel"].spec) == (None, None, "fsdp")
    np.testing.assert_allclose(results["fsdp=8"][0], results["data=8"][0], rtol=2e-5)
    assert results["fsdp=8"][1] == pytest.approx(results["data=8"][1], rel=1e-5)
    assert abs(results["data=8"][0][0] - results["data=8"][1]) > 1e-4  # dropout in steps, not in evaluation


def test_an_unannotated_model_split_by_the_fallback_gets_no_warning_that_fsdp_splits_nothing():
    model = sk.from_nnx(plain_lm)
    trainer = sk.Trainer(model, optax.adamw(LR), "fsdp=8")
    split = [r for r in trainer.sharding_table() if "fsdp" in r["spec"]]
    assert len(split) >= len(trainer.sharding_table()) // 2  # the fallback does split most of them
    warned = sk.report.sharding_warnings(trainer)
    assert not any("shard no weights" in w for w in warned), warned
