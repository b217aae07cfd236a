"""Auxiliary-loss-free balancing (DeepSeek-V3): each expert layer's score bias moves after every
step toward an even load, outside the gradient, the same on every layout as on one device."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit.core.errors import ModelError, PipelineError
from shardkit.models import GPTConfig
from shardkit.parallel.experts import ExpertLoad, Router

RATE = 0.01
ROUTER = Router(score="sigmoid", score_bias=True, balance_rate=RATE)
CFG = GPTConfig.preset("tiny", n_experts=4, top_k=2, capacity_factor=1.0, router=ROUTER, aux_loss_weight=0.0)
DATA = sk.TextDataset.builtin()
BATCHES = [DATA.batch(step, batch_size=8, seq_len=32) for step in range(3)]


def biases(params):
    """Every expert layer's score bias, ``(L, E)``, from a scanned or an unscanned GPT."""
    blocks = params["blocks"]
    if "mlp" in blocks:
        return np.asarray(blocks["mlp"]["score_bias"], np.float32)
    return np.stack([np.asarray(blocks[i]["mlp"]["score_bias"], np.float32) for i in sorted(blocks)])


def train(cfg, layout, batches, devices=None, **options):
    trainer = sk.Trainer(cfg.model(), optax.adamw(3e-3), layout, devices=devices, **options)
    state, losses, loads = trainer.init(0), [], []
    for batch in batches:
        state, metrics = trainer.step(state, trainer.shard_batch(batch))
        losses.append(float(metrics["loss"]))
        loads.append(float(metrics["expert_tokens_max"] - metrics["expert_tokens_min"]))
    return state, losses, loads


def layer_loads(cfg, params, tokens):
    """``(L, E)`` (token, choice) pairs per expert of one forward pass on one device, from the
    model's own :class:`ExpertLoad` output (the inputs the LM loss feeds it)."""
    _, load = cfg.model().apply(params, jnp.asarray(tokens[:, :-1]), None)
    assert isinstance(load, ExpertLoad)
    return np.asarray(load.tokens, np.float32)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_one_step_moves_each_bias_by_the_rate_against_its_layers_load(scan_layers):
    cfg = dataclasses.replace(CFG, scan_layers=scan_layers)
    one = jax.devices()[:1]
    before = sk.Trainer(cfg.model(), optax.adamw(3e-3), "data=1", devices=one).init(0).params
    load = layer_loads(cfg, before, BATCHES[0]["tokens"])
    state, _, _ = train(cfg, "data=1", BATCHES[:1], devices=one)
    expected = biases(before) - RATE * np.sign(load - load.mean(axis=-1, keepdims=True))
    np.testing.assert_allclose(biases(state.params), expected, atol=1e-7)
    assert np.abs(biases(state.params)).max() == pytest.approx(RATE)  # it moved, by the rate, no more


@pytest.mark.parametrize("layout", ["expert=4,data=2", "tensor=2,expert=4", "data=2,fsdp=2,expert=2"])
def test_sharded_balancing_equals_one_device(layout):
    one_state, one_losses, _ = train(CFG, "data=1", BATCHES, devices=jax.devices()[:1])
    state, losses, _ = train(CFG, layout, BATCHES)
    np.testing.assert_allclose(losses, one_losses, rtol=2e-5)
    np.testing.assert_allclose(biases(state.params), biases(one_state.params), atol=1e-7)
    assert np.abs(biases(state.params)).max() > 0


def test_balancing_under_zero_and_bf16_master_moves_the_stored_bias():
    # Frozen parameters have no master copy: under ZeRO the stored bias is the one moved.
    one_state, _, _ = train(CFG, "data=1", BATCHES[:2], devices=jax.devices()[:1], precision="bf16-master")
    state, _, _ = train(CFG, "data=8", BATCHES[:2], zero=1, precision="bf16-master")
    np.testing.assert_allclose(biases(state.params), biases(one_state.params), atol=1e-4)
    assert np.abs(biases(state.params)).max() > 0


def test_balancing_evens_the_load_that_the_router_alone_leaves_uneven():
    batches = [DATA.batch(step % 4, batch_size=8, seq_len=32) for step in range(40)]
    fast = dataclasses.replace(CFG, router=dataclasses.replace(ROUTER, balance_rate=0.05))
    still = dataclasses.replace(CFG, router=dataclasses.replace(ROUTER, balance_rate=0.0))
    _, _, balanced = train(fast, "expert=4,data=2", batches)
    _, _, left = train(still, "expert=4,data=2", batches)
    # The spread between the most and the least loaded expert over the last steps (measured:
    # 80.5 pairs balanced, 167.2 left alone).
    assert np.mean(balanced[-8:]) < 0.75 * np.mean(left[-8:]), (balanced[-8:], left[-8:])


def test_bad_balancing_is_refused_before_anything_compiles():
    with pytest.raises(ModelError, match="balance_rate=-0.1 must be a number >= 0"):
        Router(score_bias=True, balance_rate=-0.1)
    with pytest.raises(ModelError, match="set score_bias=True"):
        Router(balance_rate=1e-3)
    with pytest.raises(ModelError, match="n_experts=0"):
        GPTConfig.preset("tiny", router=ROUTER)
    with pytest.raises(PipelineError, match="balance_rate"):
        sk.Trainer(CFG.model(), optax.adamw(1e-3), "stage=2,data=4", microbatches=2)


HF = pathlib.Path(__file__).parent / "fixtures" / "hf_reference" / "moe"


def test_a_deepseek_checkpoint_balances_when_asked_and_a_router_without_a_score_bias_is_refused():
    from safetensors.numpy import load_file

    run = sk.from_pretrained(HF / "deepseek_v3", layout="expert=2,data=4", balance_rate=RATE)
    assert run.config.router.balance_rate == RATE
    stored = load_file(str(HF / "deepseek_v3" / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    tokens = np.load(HF / "tokens.npy").astype(np.int32)
    state, _ = run.trainer.step(run.state, run.trainer.shard_batch({"tokens": np.tile(tokens, (4, 1))}))
    moved = np.asarray(state.params["blocks"]["mlp"]["score_bias"][0]) - stored
    np.testing.assert_allclose(np.abs(moved[moved != 0]), RATE, rtol=1e-3)  # each by the rate, in the bias's dtype
    assert np.count_nonzero(moved) > 0
    with pytest.raises(ModelError, match="has none"):
        sk.from_pretrained(HF / "qwen3_moe", layout="data=8", balance_rate=RATE)
