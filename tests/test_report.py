"""Reports of compiled steps against the reference formulas (ring collectives, ZeRO, Megatron), dry runs, inspect."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TEST_XLA_FLAGS

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.analysis.report import Report, sharding_warnings
from shardkit.models import GPTConfig

CFG = GPTConfig.preset("tiny")
B, T = 8, 32
BATCH = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}


def report_for(layout, cfg=CFG, **kwargs):
    trainer = sk.Trainer(cfg.model(), optax.adamw(1e-3), layout, **kwargs)
    return trainer, trainer.report(BATCH)


def param_bytes(trainer):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.model.abstract_params()))


def ring(kind, n, size):
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n * size


def moved(report, kind, axes, direction=None, op=None):
    return sum(
        c.moved_bytes
        for c in report.collectives
        if c.kind == kind
        and c.axes == axes
        and (direction is None or c.direction == direction)
        and (op is None or op in c.op)
    )


def test_data_parallel_report_matches_the_all_reduce_formula():
    trainer, report = report_for("data=8")
    assert {(c.kind, c.axes) for c in report.collectives} == {("all-reduce", ("data",))}
    expected = ring("all-reduce", 8, param_bytes(trainer))
    assert moved(report, "all-reduce", ("data",)) == pytest.approx(expected, rel=0.02)
    assert report.ratios["bytes"] == pytest.approx(1.0, rel=0.02)


def test_fsdp_report_gathers_params_and_reduce_scatters_gradients():
    trainer, report = report_for("fsdp=8")
    p = param_bytes(trainer)
    # Forward: every parameter gathered once.
    assert moved(report, "all-gather", ("fsdp",), "forward") == pytest.approx(ring("all-gather", 8, p), rel=0.02)
    # Gradients: one reduce-scatter of every parameter (the CPU's all-reduce + dynamic-slice, recognised).
    rs = [c for c in report.collectives if c.kind == "reduce-scatter"]
    assert rs and all(c.lowered_as == "all-reduce+dynamic-slice" for c in rs)
    assert sum(c.moved_bytes for c in rs) == pytest.approx(ring("reduce-scatter", 8, p), rel=0.03)
    # Backward: the layer weights are gathered again (count per layer = forward count).
    layer_fwd = [
        c
        for c in report.collectives
        if c.kind == "all-gather" and c.op.startswith("layer/") and c.direction == "forward"
    ]
    layer_bwd = [
        c
        for c in report.collectives
        if c.kind == "all-gather" and c.op.startswith("layer/") and c.direction == "backward"
    ]
    assert {c.count for c in layer_fwd} == {CFG.n_layers}
    assert sum(c.moved_bytes for c in layer_bwd) == pytest.approx(sum(c.moved_bytes for c in layer_fwd), rel=0.01)
    assert 0.85 <= report.ratios["bytes"] <= 1.05


def test_fsdp_memory_per_device_is_total_over_n():
    trainer, report = report_for("fsdp=8", fsdp_min_size=0)  # every parameter split, norm scales too
    abstract = trainer.abstract_state()
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((abstract.params, abstract.opt_state)))
    per_device = report.memory.params + report.memory.optimizer
    assert per_device == pytest.approx(total / 8, rel=0.02)
    assert report.ratios["memory"] == pytest.approx(1.0, rel=0.02)


def test_tensor_parallel_report_has_megatron_all_reduces_per_layer():
    _, report = report_for("data=2,tensor=4")
    activation = (B // 2) * T * CFG.dim * 4
    layer_ar = [
        c for c in report.collectives if c.kind == "all-reduce" and c.axes == ("tensor",) and c.op.startswith("layer/")
    ]
    # 2 forward (attention out, MLP down) and 2 backward (QKV, gate/up inputs) per layer.
    assert sorted((c.direction, c.op.split("/")[2]) for c in layer_ar) == [
        ("backward", "gate_up_proj"),
        ("backward", "qkv_proj"),
        ("forward", "down_proj"),
        ("forward", "out_proj"),
    ]
    assert {c.count for c in layer_ar} == {CFG.n_layers}
    assert {c.payload_bytes for c in layer_ar} == {activation}
    expected = 4 * CFG.n_layers * ring("all-reduce", 4, activation)
    assert sum(c.moved_bytes for c in layer_ar) == pytest.approx(expected, rel=0.01)
    # The bound adds the vocabulary-parallel embedding's forward and output layer's backward one.
    vocab_parallel = 2 * ring("all-reduce", 4, activation)
    assert report.lower_bound["bytes_tensor"] == pytest.approx(expected + vocab_parallel, rel=0.01)


def test_hybrid_report_has_each_axis_and_is_near_its_bound():
    _, report = report_for("data=2,fsdp=2,tensor=2")
    by_axes = report.bytes_by_axes()
    assert {"data", "fsdp", "tensor"} <= set(by_axes)
    assert 0.8 <= report.ratios["bytes"] <= 1.3


def test_source_op_names_the_layer_of_a_tensor_parallel_all_reduce():
    _, report = report_for("tensor=8", cfg=GPTConfig.preset("tiny", n_kv_heads=8))
    ops = {c.op for c in report.collectives if c.kind == "all-reduce" and c.direction == "forward"}
    assert any(op.startswith("layer/attn/out_proj/") for op in ops), ops
    _, unrolled = report_for("tensor=8", cfg=GPTConfig.preset("tiny", n_kv_heads=8, scan_layers=False))
    ops = {c.op for c in unrolled.collectives if c.kind == "all-reduce"}
    assert any(op.startswith("layer_1/mlp/down_proj/") for op in ops), ops


def test_matmul_flops_count_every_layer_and_match_the_model_count():
    flops = {}
    for scan in (True, False):
        cfg = GPTConfig.preset("tiny", scan_layers=scan, n_layers=4)
        _, report = report_for("data=8", cfg=cfg)
        flops[scan] = report.flops_per_device
    assert flops[True] == flops[False]
    assert flops[True] * 8 == pytest.approx(report.model_flops_per_step, rel=0.15)


def test_scanned_layers_keep_the_compiled_program_flat_in_depth():
    sizes = {}
    for scan in (True, False):
        for layers in (2, 8):
            cfg = GPTConfig.preset("tiny", scan_layers=scan, n_layers=layers)
            trainer = sk.Trainer(cfg.model(), optax.adamw(1e-3), "fsdp=8")
            sizes[scan, layers] = len(trainer.compile(BATCH).as_text().splitlines())
    assert sizes[True, 8] <= sizes[True, 2] * 1.02
    assert sizes[False, 8] > sizes[False, 2] * 2


def test_report_serialises_and_prints():
    _, report = report_for("data=2,fsdp=2,tensor=2")
    d = json.loads(report.to_json())
    assert {"devices", "layout", "parameters", "memory", "flops_per_device", "collectives", "lower_bound"} <= set(d)
    assert {"params", "optimizer", "temp", "total"} <= set(d["memory"])
    assert {"kind", "count", "bytes", "axes"} <= set(d["collectives"][0])
    assert Report.from_dict(d) == report
    table = report.table()
    assert "reduce-scatter*" in table and "lowered on cpu" in table


def test_accumulation_and_remat_show_in_the_report():
    cfg = GPTConfig.preset("tiny", dim=128, mlp_dim=512)
    batch = {"tokens": jax.ShapeDtypeStruct((32, 129), jnp.int32)}
    temps = {}
    for name, kwargs, remat in [("base", {}, "none"), ("micro4", {"microbatches": 4}, "none"), ("remat", {}, "full")]:
        trainer = sk.Trainer(
            GPTConfig.preset("tiny", dim=128, mlp_dim=512, remat=remat).model(), optax.adamw(1e-3), "data=8", **kwargs
        )
        temps[name] = trainer.report(batch).memory.temp
    del cfg
    assert temps["micro4"] < 0.7 * temps["base"]
    assert temps["remat"] < 0.8 * temps["base"]


def test_dry_run_7b_on_64_devices_matches_zero_memory():
    """bf16 params + fp32 master + fp32 Adam moments: ZeRO-3's 2 + 12 bytes per parameter on
    each of N devices (the remaining 2 bytes of ZeRO's 16, the bf16 gradient, live in temp)."""
    result = sk.dryrun(model="llama2-7b", layout="fsdp=64", batch=64, seq=512, precision="bf16-master", remat="full")
    n, p = 64, result["parameters"]
    assert result["devices"] == n
    assert p == pytest.approx(6.74e9, rel=0.01)
    mem = result["memory"]
    assert mem["params"] == pytest.approx(2 * p / n, rel=0.02)
    assert mem["master"] == pytest.approx(4 * p / n, rel=0.02)
    assert mem["optimizer"] == pytest.approx(8 * p / n, rel=0.02)
    model_state = mem["params"] + mem["master"] + mem["optimizer"]
    assert model_state == pytest.approx(14 * p / n, rel=0.02)
    assert mem["temp"] >= 2 * p / n / 32  # at least one layer's bf16 gradient is in flight
    assert result["lower_bound"]["state_memory_per_device"] == pytest.approx(14 * p / n, rel=0.02)
    assert result["compile_seconds"] > 0
    assert result["flops_per_device"] > 0


def test_dryrun_cli_json():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkit.cli",
            "dryrun",
            "--model",
            "gpt2-small",
            "--layout",
            "fsdp=4,tensor=4",
            "--batch",
            "16",
            "--seq",
            "256",
            "--precision",
            "bf16",
            "--microbatches",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["devices"] == 16 and d["layout"] == "fsdp=4,tensor=4" and d["microbatches"] == 2
    kinds = {c["kind"] for c in d["collectives"]}
    assert {"all-gather", "all-reduce"} <= kinds
    assert d["compile_seconds"] > 0


def test_inspect_warns_about_replicated_parameters_and_idle_rules():
    with pytest.warns(UserWarning, match="expert=4 splits only the rows: GPT has no experts"):
        trainer = sk.Trainer(CFG.model(), optax.adamw(1e-3), "data=2,expert=4")
    warnings = sharding_warnings(trainer)
    assert any("rule experts -> expert matches no parameter" in w for w in warnings)
    assert any("so the step runs as data=4 would" in w for w in warnings)
    assert any(w.startswith("blocks/mlp/w_gate_up 2x64x2x128") and "replicated on all 8 devices" in w for w in warnings)
    assert not sharding_warnings(sk.Trainer(CFG.model(), optax.adamw(1e-3), "fsdp=8"))


def test_inspect_cli_prints_all_sections():
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "inspect", "--layout", "data=8", "--batch", "8", "--seq", "32"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "XLA_FLAGS": TEST_XLA_FLAGS},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "blocks/attn/wqkv" in out and "per device" in out
    assert "all-reduce" in out and "memory per device" in out
    assert "replicated on all 8 devices" in out


def test_collective_report_on_a_non_gpt_model_needs_no_model_facts():
    import flax.linen as nn

    model = sk.annotate(
        sk.from_linen(nn.Dense(64), jnp.zeros((1, 32))), [(r"kernel$", ("embed", "mlp")), (r".*", None)]
    )
    trainer = sk.Trainer(model, optax.sgd(0.1), "fsdp=8", loss=sk.mse_loss)
    report = trainer.report({"x": jnp.zeros((16, 32)), "y": jnp.zeros((16, 64))})
    assert report.model_flops_per_step is None
    assert report.lower_bound["bytes_tensor"] == 0
    assert hlo.count(trainer.compile({"x": jnp.zeros((16, 32)), "y": jnp.zeros((16, 64))}).as_text())["all-gather"]
    np.testing.assert_allclose(report.memory.params, 32 * 64 * 4 / 8 + 64 * 4, rtol=0.01)


def test_the_bound_counts_a_pipelines_sends_between_stages():
    """Each microbatch's boundary activation forward and its gradient back: the compiled
    lock-step pipeline sends at least that, and at most that times its ticks per microbatch."""
    m, p = 4, 2
    result = sk.dryrun("tiny", layout="data=2,stage=2,tensor=2", batch=16, seq=64, microbatches=m)
    bound, measured = result["lower_bound"]["bytes_stage"], result["bytes_by_axes"]["stage"]
    per_group_rows = 16 / 2  # the batch split over data
    activation = per_group_rows * 64 * GPTConfig.preset("tiny").dim * 4  # (rows, seq, dim) in fp32
    assert bound == 2 * activation
    assert bound <= measured <= bound * (m + p - 1) / m * 1.2
    plain = sk.dryrun("tiny", layout="data=4,tensor=2", batch=16, seq=64)
    assert plain["lower_bound"]["bytes_stage"] == 0.0


def _gpt(name):
    return lambda: GPTConfig.preset(name).model()


def _byo(name):  # models written without shardkit (examples/): Flax NNX and Linen
    return lambda: getattr(__import__("byo_factories"), name)()


@pytest.mark.parametrize(
    "model, layout, kwargs",
    [
        (_gpt("tiny"), "fsdp=8", {}),
        (_gpt("tiny"), "data=2,fsdp=2,tensor=2", {"precision": "bf16-master"}),
        (_gpt("tiny"), "data=4,tensor=2", {"zero": 2, "microbatches": 2}),
        (_gpt("mini"), "data=2,fsdp=2,stage=2", {"microbatches": 2}),
        (_byo("gemma_lm"), "data=2,fsdp=2,tensor=2", {"precision": "bf16-master"}),
        (_byo("linen_lm"), "fsdp=8", {}),
    ],
)
def test_a_dry_run_compiles_the_same_buffers_and_collectives_without_code_optimization(model, layout, kwargs):
    """A dry run compiles without LLVM's optimization of the generated code (faster); what the
    report reads (buffers, collectives, FLOPs) comes before code generation and must not move."""
    trainer = sk.Trainer(model(), optax.adamw(1e-3), layout, **kwargs)
    dry = trainer.report(BATCH, dry_run=True)
    assert not trainer._compiled  # a program compiled for a dry run is never the one a step runs
    full = trainer.report(BATCH)
    assert dry.memory == full.memory
    assert dry.collectives == full.collectives
    assert dry.flops_per_device == full.flops_per_device
