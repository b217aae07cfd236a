"""Small parameters stay whole under FSDP (``fsdp_min_size``, DeepSpeed ZeRO-3's parameter
persistence threshold): norm scales and biases are not gathered and reduce-scattered one by one.
Checked on the compiled programs (collective counts, per-device memory) and against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from byo_models import LinenLM, LMConfig
from helpers import assert_adam_params_close, reference_training, run_trainer

import shardkit as sk
from shardkit.core.errors import InputError

TINY = sk.models.GPTConfig.preset("tiny")
B, T = 16, 32
BATCH = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}


def leaves(specs):
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def fsdp_collectives(report):
    return sum(c.count for c in report.collectives if "fsdp" in c.axes)


def stacked(path):
    """Whether a parameter belongs to the GPT's layer stack (its dimension 0 is the layer)."""
    return any(getattr(k, "key", None) == "blocks" for k in path)


def vector_elements(params):
    """Elements of the parameters that are vectors per layer: 1-D, or 2-D stacked over layers."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(x.size for path, x in flat if x.ndim - (1 if stacked(path) and x.ndim > 1 else 0) <= 1)


def test_norm_scales_stay_whole_and_cost_no_collectives():
    split_all = sk.Trainer(TINY.model(), optax.adamw(1e-3), "fsdp=8", fsdp_min_size=0)
    default = sk.Trainer(TINY.model(), optax.adamw(1e-3), "fsdp=8")
    scale = default.plan.param_specs["blocks"]["attn_norm"]["scale"]  # (layers, embed)
    assert "fsdp" not in str(scale) and "fsdp" in str(split_all.plan.param_specs["blocks"]["attn_norm"]["scale"])
    assert "fsdp" in str(default.plan.param_specs["blocks"]["mlp"]["w_down"])  # matrices still split
    before, after = split_all.report(BATCH), default.report(BATCH)
    # Each split norm scale cost a gather in the forward pass, one in the backward and a
    # reduce-scatter of its gradient; what is left is the matrices' traffic.
    assert fsdp_collectives(after) < fsdp_collectives(before)
    assert after.memory.params > before.memory.params
    # Per device, the vectors are whole: 7/8 of their bytes more than split eight ways, exactly.
    vectors = vector_elements(default.abstract_params) * 4
    assert vectors > 0
    assert after.memory.params - before.memory.params == vectors - vectors // 8


def test_a_threshold_in_elements_keeps_matrices_below_it_whole():
    model = TINY.model()
    everything = sk.Trainer(model, optax.adamw(1e-3), "fsdp=8", fsdp_min_size=10**9)
    report = everything.report(BATCH)
    assert not [c for c in report.collectives if c.kind == "all-gather" and "fsdp" in c.axes]
    assert all("fsdp" not in str(s) for s in leaves(everything.plan.param_specs))
    # A threshold between the sizes, counted per layer of the stack: the largest parameters
    # stay split, every smaller one is whole.
    flat = jax.tree_util.tree_flatten_with_path(model.abstract_params())[0]
    per_layer = [x.size // (x.shape[0] if stacked(path) else 1) for path, x in flat]
    middle = sk.Trainer(model, optax.adamw(1e-3), "fsdp=8", fsdp_min_size=max(per_layer))
    for spec, size, (_, x) in zip(leaves(middle.plan.param_specs), per_layer, flat):
        assert ("fsdp" in str(spec)) == (size == max(per_layer)), (spec, x.shape)


@pytest.mark.parametrize("min_size", [None, 0])
def test_losses_equal_one_device_either_way(min_size):
    cfg = LMConfig(dim=64, mlp=256, layers=2)
    data = sk.TextDataset.builtin()
    batches = [data.batch(step, batch_size=B, seq_len=T) for step in range(3)]
    module = LinenLM(cfg)
    trainer = sk.Trainer(
        sk.from_linen(module, jnp.zeros((2, T), jnp.int32)), optax.adamw(3e-3), "fsdp=8", fsdp_min_size=min_size
    )
    losses, params = run_trainer(trainer, batches)

    def init(key):
        from flax import linen as nn

        return nn.meta.unbox(module.init({"params": key, "dropout": key}, jnp.zeros((2, T), jnp.int32))["params"])

    def loss_fn(params, batch):
        logits = module.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    want_losses, want_params = reference_training(init, lambda p, b: p, loss_fn, optax.adamw(3e-3), batches)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    assert_adam_params_close(params, want_params, lr=3e-3, steps=len(batches))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "small"])
def test_a_bad_threshold_is_refused_before_any_compile(bad):
    with pytest.raises(InputError, match="fsdp_min_size"):
        sk.Trainer(TINY.model(), optax.adamw(1e-3), "fsdp=8", fsdp_min_size=bad)
