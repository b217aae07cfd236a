"""Models with running statistics, written as Flax's tutorials write them (``nnx.BatchNorm``
in an NNX CNN, ``nn.BatchNorm`` with a ``train`` flag in Linen), train under every layout as an
independent one-device Flax loop does: same losses, parameters and running statistics, the
statistics of each step taken over the whole (global) batch, evaluation reading the running
averages, checkpoints keeping them; and each misuse is refused with the fix."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import shardkit as sk
from shardkit.core.errors import InputError, ModelError
from shardkit.training.checkpoint import Checkpointer

LR, STEPS, BATCH = 0.1, 3, 16
LAYOUTS = ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2"]


class TutorialCNN(nnx.Module):
    """As Flax's NNX MNIST tutorial writes a CNN: BatchNorm keeps its statistics in the module,
    no sharding metadata, no shardkit calls."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.fc = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        return self.fc(nnx.relu(self.bn(self.conv(x))).mean(axis=(1, 2)))


class LinenCNN(nn.Module):
    """As Flax's Linen examples write one: ``use_running_average=not train``."""

    @nn.compact
    def __call__(self, x, train: bool):
        # No bias before BatchNorm (it would cancel), as CNNs write it; Adam would amplify its ~0 gradient.
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Conv(8, (3, 3), use_bias=False)(x))
        return nn.Dense(10)(nn.relu(x).mean(axis=(1, 2)))


LINEN_FLAGS = {"train_kwargs": {"train": True}, "eval_kwargs": {"train": False}}


def classification(forward, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(forward(batch["x"]), batch["y"])
    return losses.mean(), jnp.asarray(losses.shape[0], jnp.int32)


def image_batches():
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(1.0, 2.0, size=(BATCH, 8, 8, 1)).astype(np.float32),
            "y": rng.integers(0, 10, BATCH).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def nnx_reference(batches, microbatches=1):
    """Plain Flax NNX + optax on one device: ``model.train()``, one forward per microbatch (rows
    ``i::K``, as shardkit splits them) in order, the mean of their gradients applied."""
    init_key, _ = jax.random.split(jax.random.key(0))
    with jax.default_device(jax.devices()[0]):
        model = TutorialCNN(nnx.Rngs(init_key))
        model.train()
        optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
        losses = []
        for batch in batches:
            parts = [{k: v[i::microbatches] for k, v in batch.items()} for i in range(microbatches)]
            results = [nnx.value_and_grad(lambda m, b=b: classification(m, b)[0])(model) for b in parts]
            grads = jax.tree.map(lambda *g: sum(g) / microbatches, *[g for _, g in results])
            optimizer.update(model, grads)
            losses.append(float(np.mean([loss for loss, _ in results])))
        model.eval()
        held_out = float(classification(model, batches[0])[0])
    params, stats = (nnx.to_pure_dict(nnx.state(model, kind)) for kind in (nnx.Param, nnx.BatchStat))
    return losses, params, stats, held_out


def train(trainer, batches):
    state, losses = trainer.init(0), []
    for batch in batches:
        state, metrics = trainer.step(state, trainer.shard_batch(batch))
        assert bool(metrics["finite"])
        losses.append(float(metrics["loss"]))
    return state, losses


def assert_trees_close(got, want, rtol):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=1e-6, err_msg=str(path))


@pytest.mark.filterwarnings("ignore:TutorialCNN names no parameter")  # tensor=2 has nothing to split
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nnx_batch_norm_trains_as_one_device_under_every_layout(layout):
    batches = image_batches()
    ref_losses, ref_params, ref_stats, ref_held_out = nnx_reference(batches)
    trainer = sk.Trainer(sk.from_nnx(TutorialCNN), optax.sgd(LR), layout, loss=classification)
    state, losses = train(trainer, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(state.params, ref_params, rtol=2e-4)
    assert_trees_close(state.model_state, ref_stats, rtol=2e-4)
    assert not np.allclose(np.asarray(state.model_state["bn"]["mean"]), 0.0)  # the statistics moved
    held_out = float(trainer.evaluate(state, trainer.shard_batch(batches[0]))["loss"])
    np.testing.assert_allclose(held_out, ref_held_out, rtol=2e-5)


def test_the_batch_statistics_are_reduced_over_the_data_axis_in_the_forward_pass():
    """Synchronised batch normalization with no code for it: the mean over a batch split over
    ``data`` is an all-reduce of per-channel sums in the compiled forward pass."""
    trainer = sk.Trainer(sk.from_nnx(TutorialCNN), optax.sgd(LR), "data=8", loss=classification)
    report = trainer.report(image_batches()[0])
    forward = [c for c in report.collectives if c.direction == "forward" and c.kind == "all-reduce"]
    assert forward and all(c.axes == ("data",) for c in forward)
    assert max(c.payload_bytes for c in forward) <= 8 * 4 * 2  # per-channel statistics, not activations


def test_microbatches_update_the_statistics_once_per_microbatch_as_sequential_passes_do():
    batches = image_batches()
    ref_losses, ref_params, ref_stats, _ = nnx_reference(batches, microbatches=2)
    trainer = sk.Trainer(sk.from_nnx(TutorialCNN), optax.sgd(LR), "data=8", loss=classification, microbatches=2)
    state, losses = train(trainer, batches)
    assert trainer.accumulation.reduces == "per_microbatch"
    assert "running statistics" in trainer.accumulation.reason
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(state.params, ref_params, rtol=2e-4)
    assert_trees_close(state.model_state, ref_stats, rtol=2e-4)


def linen_reference(batches):
    """Plain Linen + optax on one device: ``mutable=["batch_stats"]`` in training."""
    module = LinenCNN()
    init_key, _ = jax.random.split(jax.random.key(0))
    variables = module.init({"params": init_key, "dropout": init_key}, jnp.zeros((1, 8, 8, 1)), train=True)
    params, stats = variables["params"], variables["batch_stats"]
    tx = optax.adam(1e-2)
    opt_state, losses = tx.init(params), []
    for batch in batches:

        def loss_of(p, b=batch, s=stats):
            logits, new = module.apply({"params": p, "batch_stats": s}, b["x"], train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    logits = module.apply({"params": params, "batch_stats": stats}, batches[0]["x"], train=False)
    held_out = float(optax.softmax_cross_entropy_with_integer_labels(logits, batches[0]["y"]).mean())
    return losses, params, stats, held_out


@pytest.mark.parametrize("layout", ["data=8", "fsdp=8"])
def test_linen_batch_stats_train_as_one_device(layout):
    batches = image_batches()
    ref_losses, ref_params, ref_stats, ref_held_out = linen_reference(batches)
    model = sk.from_linen(LinenCNN(), jnp.zeros((1, 8, 8, 1)), **LINEN_FLAGS)
    trainer = sk.Trainer(model, optax.adam(1e-2), layout, loss=classification)
    state, losses = train(trainer, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(state.params, ref_params, rtol=2e-4)
    assert_trees_close(state.model_state["batch_stats"], ref_stats, rtol=2e-4)
    held_out = float(trainer.evaluate(state, trainer.shard_batch(batches[0]))["loss"])
    np.testing.assert_allclose(held_out, ref_held_out, rtol=2e-5)


def test_running_statistics_survive_a_checkpoint_onto_another_layout(tmp_path):
    batches = image_batches()
    model = sk.from_nnx(TutorialCNN)
    first = sk.Trainer(model, optax.adam(1e-2), "fsdp=8", loss=classification)
    state, _ = train(first, batches[:2])
    saved = jax.device_get(state.model_state)
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(first, state, data_position=2, force=True)
    ckpt.close()
    second = sk.Trainer(model, optax.adam(1e-2), "data=8", loss=classification)
    for reset in (False, True):
        restored, _ = Checkpointer(tmp_path / "ck").restore(second, reset_optimizer=reset)
        assert_trees_close(restored.model_state, saved, rtol=0)
        assert restored.model_state["bn"]["mean"].sharding.is_fully_replicated
    # Training on from the restored state matches training on without a stop.
    _, on = first.step(state, first.shard_batch(batches[2]))
    restored, _ = Checkpointer(tmp_path / "ck").restore(second)
    _, resumed = second.step(restored, second.shard_batch(batches[2]))
    np.testing.assert_allclose(float(resumed["loss"]), float(on["loss"]), rtol=2e-5)


def test_a_skipped_step_leaves_the_running_statistics_as_they_were():
    trainer = sk.Trainer(sk.from_nnx(TutorialCNN), optax.sgd(jnp.inf), "data=8", loss=classification)
    state = trainer.init(0)
    before = jax.device_get(state.model_state)
    state, metrics = trainer.step(state, trainer.shard_batch(image_batches()[0]))
    assert not bool(metrics["finite"])
    assert_trees_close(state.model_state, before, rtol=0)


def test_misuses_of_a_model_with_running_statistics_are_refused_with_the_fix():
    model = sk.from_nnx(TutorialCNN)
    batch = image_batches()[0]
    with pytest.raises(ModelError, match="apply_model"):
        model.apply(model.init(jax.random.key(0)), jnp.asarray(batch["x"]), None)
    trainer = sk.Trainer(model, optax.sgd(LR), "data=8", loss=classification)
    state = trainer.init(0)
    with pytest.raises(InputError, match=r"trainer.evaluate\(state, batch\)"):
        trainer.evaluate(state.params, trainer.shard_batch(batch))
    with pytest.raises(ModelError, match="reduce_gradients='auto'"):
        sk.Trainer(model, optax.sgd(LR), "data=8", loss=classification, microbatches=2, reduce_gradients="once")
    with pytest.raises(ModelError, match="(?s)stores state besides its parameters.*stacked_layers"):
        sk.from_nnx(TutorialCNN, stacked_layers="layers")
    stateless = sk.models.GPTConfig.preset("tiny").model()
    with_state = dataclasses.replace(stateless, state_init=model.state_init, state_apply=model.state_apply)
    with pytest.raises(sk.errors.PipelineError, match="running statistics"):
        sk.Trainer(with_state, optax.sgd(LR), "stage=2,data=4", microbatches=2)
    # A Linen model given no flag that reads its running averages cannot evaluate.

    class AlwaysBatchStatistics(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.BatchNorm(use_running_average=False)(x).mean(axis=(1, 2)))

    unflagged = sk.from_linen(AlwaysBatchStatistics(), jnp.zeros((1, 8, 8, 1)))
    trainer = sk.Trainer(unflagged, optax.sgd(LR), "data=8", loss=classification)
    with pytest.raises(ModelError, match=r"(?s)writes its state \['batch_stats'\].*eval_kwargs"):
        trainer.evaluate(trainer.init(0), trainer.shard_batch(batch))


class PmapResNetBlock(nn.Module):
    """BatchNorm as Flax's ImageNet example writes it for ``pmap``: ``axis_name="batch"``, so that
    each device's statistics are averaged over the devices."""

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name="batch")
        y = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
        y = norm()(nn.Conv(8, (3, 3), use_bias=False)(y))
        return nn.Dense(10)(nn.relu(y + nn.Conv(8, (1, 1), use_bias=False)(x)).mean(axis=(1, 2)))


def pmap_reference(batches, devices=8):
    """The pmap training step of Flax's ImageNet example: parameters replicated, each device's
    rows, gradients and BatchNorm statistics averaged over the ``batch`` axis."""
    module = PmapResNetBlock()
    init_key, _ = jax.random.split(jax.random.key(0))
    variables = jax.jit(lambda k: module.init({"params": k}, jnp.zeros((1, 8, 8, 1)), train=False))(init_key)
    tx = optax.sgd(LR)

    def step(params, stats, opt_state, batch):
        def loss_of(p):
            logits, new = module.apply(
                {"params": p, "batch_stats": stats}, batch["x"], train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        grads, loss = jax.lax.pmean((grads, loss), "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    replicate = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * devices), tree)
    params, stats = replicate(variables["params"]), replicate(variables["batch_stats"])
    opt_state, losses = replicate(tx.init(variables["params"])), []
    pstep = jax.pmap(step, axis_name="batch", devices=jax.devices()[:devices])
    for batch in batches:
        split = {k: v.reshape(devices, -1, *v.shape[1:]) for k, v in batch.items()}
        params, stats, opt_state, loss = pstep(params, stats, opt_state, split)
        losses.append(float(loss[0]))
    return losses, jax.tree.map(lambda x: x[0], params), jax.tree.map(lambda x: x[0], stats)


@pytest.mark.parametrize("layout", ["data=8", "fsdp=8"])
def test_a_model_written_for_pmap_trains_as_its_pmap_step_does(layout):
    """``axis_name="batch"`` needs no edit: shardkit binds the name to an axis of size 1 (under
    ``jit`` the batch mean is already the global one) and the result is the pmap step's."""
    batches = image_batches()
    ref_losses, ref_params, ref_stats = pmap_reference(batches)
    model = sk.from_linen(PmapResNetBlock(), jnp.zeros((1, 8, 8, 1)), **LINEN_FLAGS)
    assert model.axis_names == ("batch",)
    trainer = sk.Trainer(model, optax.sgd(LR), layout, loss=classification)
    state, losses = train(trainer, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(state.params, ref_params, rtol=2e-4)
    assert_trees_close(state.model_state["batch_stats"], ref_stats, rtol=2e-4)
    assert np.isfinite(float(trainer.evaluate(state, trainer.shard_batch(batches[0]))["loss"]))
    accumulating = sk.Trainer(model, optax.sgd(LR), layout, loss=classification, microbatches=2)
    accumulating.step(accumulating.init(0), accumulating.shard_batch(batches[0]))
    assert accumulating.accumulation.reduces == "per_microbatch"


class NamedAxisCNN(TutorialCNN):
    def __init__(self, rngs: nnx.Rngs, axis_name: str | None = "batch"):
        super().__init__(rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, axis_name=axis_name, rngs=rngs)


def test_an_nnx_batch_norm_with_an_axis_name_trains_as_one_device():
    batches = image_batches()
    ref_losses, ref_params, ref_stats, _ = nnx_reference(batches)  # TutorialCNN: the same, no axis name
    model = sk.from_nnx(NamedAxisCNN)
    assert model.axis_names == ("batch",)
    trainer = sk.Trainer(model, optax.sgd(LR), "fsdp=8", loss=classification)
    state, losses = train(trainer, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(state.params, ref_params, rtol=2e-4)
    assert_trees_close(state.model_state, ref_stats, rtol=2e-4)
