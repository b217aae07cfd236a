"""Megatron sequence parallelism (tensor axis) and ring attention (sequence axis)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpt_reference, run_cli, run_trainer

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.models import GPTConfig
from shardkit.parallel import ring_attention

CFG = GPTConfig.preset("tiny")
DATA = sk.TextDataset.builtin()
BATCHES = [DATA.batch(step, batch_size=8, seq_len=32) for step in range(6)]


def qkv(b=2, t=64, h=4, n=2, d=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (b, t, h, d)),
        jax.random.normal(keys[1], (b, t, n, d)),
        jax.random.normal(keys[2], (b, t, n, d)),
    )


@pytest.mark.parametrize("layout", ["sequence=8", "sequence=4,data=2", "sequence=2,tensor=2,data=2"])
def test_ring_attention_is_exact(layout):
    q, k, v = qkv()
    w = jax.random.normal(jax.random.key(9), q.shape)
    mesh = sk.Layout.parse(layout).make_mesh()

    def loss(attn, q, k, v):
        return jnp.sum(attn(q, k, v) * w)

    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    ring = lambda q, k, v: ring_attention(q, k, v, mesh, sk.default_rules())
    want, want_grads = jax.value_and_grad(loss, argnums=(1, 2, 3))(plain, q, k, v)
    with sk.use_sharding(mesh, sk.default_rules()):
        got, got_grads = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3)), static_argnums=0)(ring, q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for a, b in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_ring_attention_passes_keys_around_the_sequence_ring():
    q, k, v = qkv()
    trainer_mesh = sk.Layout.parse("sequence=4,data=2").make_mesh()
    f = jax.jit(lambda q, k, v: ring_attention(q, k, v, trainer_mesh, sk.default_rules()))
    found = hlo.collectives(f.lower(q, k, v).compile().as_text())
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert permutes and all(hlo.mesh_axes_of(c.groups, trainer_mesh) == ("sequence",) for c in permutes)
    assert not [c for c in found if c.kind == "all-gather"], "no device gathers the whole sequence"


def test_attention_memory_per_device_falls_with_the_ring():
    # Each ring step runs the blocked kernel: one tile of scores, whatever the sequence, so what
    # falls with the ring is the part that grows with the tokens each device holds.
    q, k, v = qkv(b=1, t=4096, h=4, n=4, d=16)

    def temp(layout):
        mesh = sk.Layout.parse(layout).make_mesh(jax.devices()[: sk.Layout.parse(layout).num_devices])
        if dict(mesh.shape)["sequence"] == 1:
            attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            attn = lambda q, k, v: ring_attention(q, k, v, mesh, sk.default_rules())
        grad = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).sum(), argnums=(0, 1, 2)))
        return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    whole, two, four, eight = temp("sequence=1"), temp("sequence=2"), temp("sequence=4"), temp("sequence=8")
    assert four < two * 0.8
    assert eight < four * 0.8
    assert two < whole / 100, "no device forms a quadratic score matrix"


@pytest.fixture(scope="module")
def reference():
    return gpt_reference(CFG, optax.adamw(1e-3), BATCHES)[0]


@pytest.mark.parametrize(
    "layout,sp",
    [
        ("sequence=2,data=2,tensor=2", False),
        ("sequence=4,fsdp=2", False),
        ("data=2,tensor=4", True),
        ("sequence=2,tensor=4", True),
    ],
)
def test_gpt_with_sequence_layouts_matches_single_device(layout, sp, reference):
    trainer = sk.Trainer(CFG.model(), optax.adamw(1e-3), layout, sequence_parallel=sp)
    losses, _ = run_trainer(trainer, BATCHES)
    np.testing.assert_allclose(losses, reference, rtol=5e-5)


def layer_collectives(sp):
    trainer = sk.Trainer(CFG.model(), optax.adamw(1e-3), "data=2,tensor=4", sequence_parallel=sp)
    report = trainer.report({"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)})
    return report, [c for c in report.collectives if c.op.startswith("layer/") and c.axes == ("tensor",)]


def test_sequence_parallelism_gathers_the_sequence_before_each_block():
    plain, plain_layer = layer_collectives(False)
    sp, sp_layer = layer_collectives(True)
    activation = 4 * 32 * CFG.dim * 4  # (B/data, T, D) fp32
    assert not [c for c in plain_layer if c.kind == "all-gather"]
    forward_gathers = [c for c in sp_layer if c.kind == "all-gather" and c.direction == "forward"]
    # The sequence-sharded residual stream is gathered over tensor at the head of the attention
    # and MLP blocks (XLA names the gather after the norm's multiply that feeds the projection).
    assert {c.op.split("/")[1] for c in forward_gathers} == {"attn", "mlp"}
    assert {c.payload_bytes for c in forward_gathers} == {activation}
    assert not [c for c in sp_layer if c.kind == "all-to-all"], "no reshuffles between seq- and head-sharding"
    # Norms and residuals hold a 1/tensor slice of the sequence: less activation memory.
    assert sp.memory.temp < plain.memory.temp


def test_sequence_parallelism_moves_megatrons_volume_labelled_as_gathers_and_scatters():
    plain, plain_layer = layer_collectives(False)
    sp, sp_layer = layer_collectives(True)
    # Each of plain tensor parallelism's 4 all-reduces per layer (2 forward, 2 backward) becomes
    # an all-gather and a reduce-scatter, which the report names as such (the CPU backend
    # lowers the scatter as an all-reduce whose result is only ever sliced).
    assert not [c for c in sp_layer if c.kind == "all-reduce" and c.payload_bytes > 1024]
    scatters = {(c.op.split("/")[2], c.direction) for c in sp_layer if c.kind == "reduce-scatter"}
    assert scatters == {
        ("out_proj", "forward"),
        ("down_proj", "forward"),
        ("qkv_proj", "backward"),
        ("gate_up_proj", "backward"),
    }
    # No re-gathers in the backward pass: it gathers only the gradients arriving at the two
    # row-parallel projections (the transposes of their reduce-scatters).
    assert {c.op.split("/")[2] for c in sp_layer if c.kind == "all-gather" and c.direction == "backward"} == {
        "out_proj",
        "down_proj",
    }
    activations = lambda layer: sum(c.moved_bytes for c in layer if c.payload_bytes > 1024)
    assert activations(sp_layer) == pytest.approx(activations(plain_layer), rel=1e-6)  # Megatron-SP: TP's volume
    # Besides: the norms' weight gradients, summed over the sequence shards (as in Megatron).
    assert sum(c.moved_bytes for c in sp_layer) <= 1.01 * sum(c.moved_bytes for c in plain_layer)
    assert sp.bytes_by_axes()["tensor"] <= 1.01 * plain.bytes_by_axes()["tensor"]


def test_a_dry_run_on_the_command_line_shows_sequence_parallel_scatters():
    args = ("dryrun", "--model", "tiny", "--layout", "data=2,tensor=4", "--batch", "8", "--seq", "32", "--json")
    plain, sp = run_cli(*args), run_cli(*args, "--sequence-parallel")
    assert plain.returncode == 0 and sp.returncode == 0, sp.stderr[-2000:]
    kinds = lambda out: {c["kind"] for c in json.loads(out)["collectives"] if c["axes"] == ["tensor"]}
    assert "reduce-scatter" in kinds(sp.stdout) and "reduce-scatter" not in kinds(plain.stdout)


def test_ring_attention_refuses_a_sequence_not_split_over_the_sequence_axis():
    q, k, v = qkv(b=4, t=16, h=4, n=4, d=8)
    mesh = sk.Layout.parse("sequence=2,data=4").make_mesh()
    rules = sk.Rules.of(batch="data", seq=None, heads=None, kv_heads=None, kv=None)  # 'seq' unsharded
    with pytest.raises(sk.errors.ShardkitError, match="sequence dimension sharded over 'sequence' alone"):
        ring_attention(q, k, v, mesh, rules)


def test_sequence_that_does_not_divide_the_sequence_axis_is_refused():
    trainer = sk.Trainer(CFG.model(), optax.adamw(1e-3), "sequence=8")
    with pytest.raises(sk.errors.ShardkitError, match="seq"):
        trainer.compile({"tokens": jax.ShapeDtypeStruct((8, 13), jnp.int32)})  # 12 positions over 8
