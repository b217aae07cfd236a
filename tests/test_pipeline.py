"""Pipeline parallelism: schedule tables, the executor, GPT over the stage axis, and bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, gpt_reference, run_cli, run_trainer

import shardkit as sk
from shardkit.models import GPTConfig
from shardkit.parallel.pipeline import pipeline_value_and_grad
from shardkit.parallel.schedule import make_schedule

CFG = GPTConfig.preset("tiny", n_layers=4)
DATA = sk.TextDataset.builtin()
BATCHES = [DATA.batch(step, batch_size=16, seq_len=32) for step in range(4)]
TOKENS = {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}


# -- schedule tables ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_schedule_bubble_is_the_textbook_fraction(name, v):
    for p in range(1, 6):
        for m in range(p if v > 1 else 1, 13, p if v > 1 else 1):
            s = make_schedule(name, p, m, v)  # make_schedule checks every timing rule of the table
            for fwd_cost, bwd_cost in ((1, 1), (1, 2), (1, 3)):
                # Interleaving divides the bubble by v: (p-1)/m of ideal time becomes (p-1)/(v m).
                assert s.bubble(fwd_cost, bwd_cost) == pytest.approx((p - 1) / (v * m + p - 1))


def test_1f1b_holds_at_most_2p_minus_1_microbatches_whatever_m():
    p = 4
    for m in (1, 4, 8, 32):
        one_f_one_b, gpipe = make_schedule("1f1b", p, m), make_schedule("gpipe", p, m)
        most = one_f_one_b.in_flight().max(axis=0)  # per stage
        np.testing.assert_array_equal(most, [min(m, 2 * (p - s) - 1) for s in range(p)])
        assert one_f_one_b.stash == min(m, 2 * p - 1)
        np.testing.assert_array_equal(gpipe.in_flight().max(axis=0), [m] * p)
        assert one_f_one_b.ticks == m + 2 * (p - 1) and gpipe.ticks == 2 * (m + p - 1)


def test_interleaved_1f1b_holds_a_bounded_number_of_chunk_inputs():
    p, v = 4, 2
    held = [make_schedule("1f1b", p, m, v).in_flight().max() for m in (8, 16, 32)]
    assert held[0] == held[1] == held[2]  # flat in m
    assert make_schedule("gpipe", p, 32, v).in_flight().max() == v * 32  # GPipe holds every chunk input


def test_schedule_picture_names_every_slot():
    text = make_schedule("1f1b", 2, 2).format().splitlines()
    assert text[1:] == ["   0  F0         .", "   1  F1         F0 B0", "   2  B0         F1 B1", "   3  B1         ."]


# -- the executor against jax.grad ---------------------------------------------------------------


@pytest.mark.parametrize("name,m,v", [("gpipe", 6, 1), ("1f1b", 6, 1), ("gpipe", 8, 2), ("1f1b", 4, 2)])
def test_executor_matches_jax_grad(name, m, v):
    n_layers, dim, p = 8, 16, 4
    k = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k[0], (n_layers, dim, dim)) / 4
    shift = jax.random.normal(k[1], (dim,))
    xs = jax.random.normal(k[2], (m, 3, dim))

    def layers(w, h):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)[0]

    def reference(w, shift):
        return jnp.mean(jax.vmap(lambda x: jnp.sum(layers(w, x + shift) ** 2))(xs))

    want_loss, (want_w, want_shift) = jax.value_and_grad(reference, argnums=(0, 1))(w, shift)

    def stage_loss(lw, shared, x_in, mb, stage, i):  # stage: virtual stage, of v * p
        h = layers(lw, jnp.where(stage == 0, mb + shared["shift"], x_in))
        return h, jnp.where(stage == v * p - 1, jnp.sum(h**2), 0.0), jnp.int32(3)

    mesh = sk.Layout.parse("data=2,stage=4").make_mesh()
    boundary = jax.ShapeDtypeStruct((3, dim), jnp.float32)
    run = jax.jit(
        lambda w, shift: pipeline_value_and_grad(
            stage_loss, w, {"shift": shift}, xs, boundary, make_schedule(name, p, m, v), mesh
        )
    )
    loss, count, got_w, got_shared = run(w, shift)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert int(count) == 3 * m  # read on the last stage only, once per microbatch
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_shared["shift"], want_shift, rtol=1e-5, atol=1e-6)


# -- GPT over the stage axis ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sgd_reference():
    return gpt_reference(CFG, optax.sgd(0.5), BATCHES)


@pytest.mark.parametrize(
    "layout,schedule,microbatches,virtual",
    [
        ("stage=2,data=2,tensor=2", "1f1b", 4, 1),
        ("stage=2,fsdp=2,tensor=2", "gpipe", 2, 1),
        ("stage=4,data=2", "1f1b", 8, 1),
        ("stage=2,data=2,tensor=2", "1f1b", 4, 2),
        ("stage=2,fsdp=4", "gpipe", 2, 2),
    ],
)
def test_pipelined_gpt_matches_single_device(layout, schedule, microbatches, virtual, sgd_reference):
    trainer = sk.Trainer(
        CFG.model(), optax.sgd(0.5), layout, microbatches=microbatches, schedule=schedule, virtual_stages=virtual
    )
    losses, params = run_trainer(trainer, BATCHES)
    want_losses, want_params = sgd_reference
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    assert_trees_close(params, want_params, rtol=1e-4, atol=1e-5)  # SGD: params move by the gradients


def test_pipelined_moe_gpt_matches_single_device():
    cfg = GPTConfig.preset("tiny", n_layers=2, n_experts=4, top_k=2, capacity_factor=1.0)
    want, _ = gpt_reference(cfg, optax.adamw(3e-3), BATCHES, microbatches=2)
    trainer = sk.Trainer(cfg.model(), optax.adamw(3e-3), "stage=2,data=4", microbatches=2)
    losses, _ = run_trainer(trainer, BATCHES)
    np.testing.assert_allclose(losses, want, rtol=2e-5)  # the load-balancing loss of both stages counts


@pytest.mark.slow
def test_pipeline_draws_the_dropout_bits_of_gradient_accumulation():
    cfg = GPTConfig.preset("tiny", n_layers=4, dropout=0.2)
    accumulated = sk.Trainer(cfg.model(), optax.sgd(0.5), "data=4", microbatches=4, devices=jax.devices()[:4])
    pipelined = sk.Trainer(cfg.model(), optax.sgd(0.5), "stage=2,data=4", microbatches=4)
    want, _ = run_trainer(accumulated, BATCHES[:2])
    got, _ = run_trainer(pipelined, BATCHES[:2])
    np.testing.assert_allclose(got, want, rtol=2e-5)


def test_stages_hold_their_layers_and_talk_by_collective_permute():
    p = 2
    trainer = sk.Trainer(CFG.model(), optax.adamw(1e-3), f"stage={p},data=4", microbatches=4, schedule="1f1b")
    state = trainer.init(0)
    w = state.params["blocks"]["attn"]["wqkv"]  # (L, D, N, G+2, K)
    assert {s.data.shape[0] for s in w.addressable_shards} == {CFG.n_layers // p}
    mu = state.opt_state[0].mu["blocks"]["attn"]["wqkv"]  # optimizer moments follow the layers
    assert {s.data.shape[0] for s in mu.addressable_shards} == {CFG.n_layers // p}
    assert {s.data.shape for s in state.params["embed"].addressable_shards} == {(CFG.vocab, CFG.dim)}
    report = trainer.report(TOKENS)
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    assert {c.axes for c in permutes} == {("stage",)}
    # One activation hop per forward slot and one gradient hop per backward slot, but for the
    # very last gradient hop (p=2: the backward-only phase is one tick, unrolled), which feeds
    # nothing and which XLA removes.
    schedule = trainer.schedule
    slots = sum(ph.ticks * len(ph.kind) for ph in schedule.phases)
    assert schedule.phases[-1].ticks == 1
    assert sum(c.count for c in permutes) == slots - 1
    # Shared (embedding, head) gradients are summed over stages once per step.
    assert any(c.kind == "all-reduce" and "stage" in c.axes for c in report.collectives)


@pytest.mark.slow
def test_1f1b_temporary_memory_stays_flat_while_gpipe_grows():
    def temp(schedule, m):
        trainer = sk.Trainer(CFG.model(), optax.sgd(0.1), "stage=2,data=4", microbatches=m, schedule=schedule)
        tokens = {"tokens": jax.ShapeDtypeStruct((4 * m, 129), jnp.int32)}  # microbatch of 4 rows
        return trainer.compile(tokens).memory_analysis().temp_size_in_bytes

    one_f_one_b = [temp("1f1b", m) for m in (4, 16)]
    gpipe = [temp("gpipe", m) for m in (4, 16)]
    stash_row = 1 * 128 * CFG.dim * 4  # one microbatch's stage input per device (4 rows / data=4), bytes
    assert gpipe[1] - gpipe[0] >= 12 * stash_row  # 12 more microbatch inputs held
    assert one_f_one_b[1] - one_f_one_b[0] < stash_row, (one_f_one_b, gpipe)  # stash of 3 either way


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.slow
def test_shardkit_train_and_dryrun_pipeline(tmp_path):
    log = tmp_path / "log.jsonl"
    train = run_cli(
        *("train", "--model", "mini", "--layout", "stage=2,data=2,tensor=2", "--microbatches", "4"),
        *("--schedule", "gpipe", "--virtual-stages", "2", "--steps", "20", "--batch", "16", "--seq", "32"),
        *("--lr", "1e-2"),
        *("--sample-tokens", "5", "--json-log", str(log)),
    )
    assert train.returncode == 0, train.stderr
    assert "layout data=2,tensor=2,stage=2" in train.stdout
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 20 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5
    dry = run_cli(
        *("dryrun", "--model", "tiny", "--layout", "stage=2,fsdp=4", "--microbatches", "4"),
        *("--schedule", "1f1b", "--virtual-stages", "1", "--batch", "16", "--seq", "32", "--json"),
    )
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert any(c["kind"] == "collective-permute" and c["axes"] == ["stage"] for c in report["collectives"])


# -- bad input -----------------------------------------------------------------------------------


def test_layers_that_do_not_divide_into_stages_are_refused():
    with pytest.raises(sk.errors.ShardkitError, match=r"4 layers: they do not divide into stage=8 stages.*\[1, 2, 4\]"):
        sk.Trainer(CFG.model(), optax.sgd(0.1), "stage=8", microbatches=8)


def test_microbatches_that_do_not_divide_the_batch_are_refused():
    trainer = sk.Trainer(CFG.model(), optax.sgd(0.1), "stage=2,data=4", microbatches=3)
    with pytest.raises(sk.errors.ShardkitError, match="microbatches=3.*multiple of 12"):
        trainer.compile(TOKENS)


def test_model_without_stages_is_refused():
    unstacked = GPTConfig.preset("tiny", scan_layers=False).model()
    with pytest.raises(sk.errors.ShardkitError, match="does not say how it splits into stages"):
        sk.Trainer(unstacked, optax.sgd(0.1), "stage=2,data=4")


def test_interleaved_stages_need_whole_groups_and_enough_layers():
    with pytest.raises(sk.errors.ShardkitError, match="microbatches=3 must be a multiple of 2"):
        sk.Trainer(CFG.model(), optax.sgd(0.1), "stage=2,data=4", microbatches=3, virtual_stages=2)
    with pytest.raises(sk.errors.ShardkitError, match="4 layers: they do not divide into stage=4 stages x virtual"):
        sk.Trainer(CFG.model(), optax.sgd(0.1), "stage=4,data=2", microbatches=4, virtual_stages=2)


def test_nnx_model_without_the_stage_methods_is_refused():
    with pytest.raises(sk.errors.ShardkitError, match="lacks the method.*embed_inputs, run_layers, head"):
        sk.from_nnx(lambda rngs: sk.models.MLP(sk.models.MLPConfig(), rngs=rngs), stacked_layers="layers")


def test_schedule_without_stages_and_unknown_schedule_are_refused():
    with pytest.raises(sk.errors.ShardkitError, match="need pipeline stages"):
        sk.Trainer(CFG.model(), optax.sgd(0.1), "data=8", schedule="gpipe")
    with pytest.raises(sk.errors.ShardkitError, match="Unknown pipeline schedule 'zb'"):
        sk.Trainer(CFG.model(), optax.sgd(0.1), "stage=2,data=4", schedule="zb")


def test_stage_with_sequence_axis_is_refused():
    with pytest.raises(sk.errors.ShardkitError, match="stage with sequence>1"):
        sk.Trainer(CFG.model(), optax.sgd(0.1), "stage=2,sequence=2,data=2")
