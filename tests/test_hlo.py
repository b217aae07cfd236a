"""The compiled step's collectives match the layout (counted in the HLO, not inferred from outputs)."""

import collections
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.models import GPT, GPTConfig

CFG = GPTConfig.preset("tiny")
B, T = 8, 32
BATCH = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}


def compiled_collectives(layout):
    model = sk.from_nnx(lambda rngs: GPT(CFG, rngs=rngs))
    trainer = sk.Trainer(model, optax.adamw(1e-3), layout)
    found = hlo.collectives(trainer.compile(BATCH).as_text())
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.abstract_params()))
    return trainer, found, param_bytes


def by_kind_and_axes(trainer, found):
    out = collections.defaultdict(list)
    for c in found:
        out[(c.kind, hlo.mesh_axes_of(c.groups, trainer.mesh))].append(c)
    return out


def test_data_parallel_reduces_gradients_and_gathers_no_parameters():
    trainer, found, param_bytes = compiled_collectives("data=8")
    groups = by_kind_and_axes(trainer, found)
    assert set(groups) == {("all-reduce", ("data",))}, set(groups)
    reduced = sum(c.payload_bytes * c.executions for c in groups[("all-reduce", ("data",))])
    # Every gradient is all-reduced once (plus the scalar loss/count).
    assert param_bytes <= reduced <= param_bytes * 1.01


def test_fsdp_gathers_parameters_and_reduces_gradients_over_fsdp():
    trainer, found, param_bytes = compiled_collectives("fsdp=8")
    groups = by_kind_and_axes(trainer, found)
    assert {axes for _, axes in groups} == {("fsdp",)}
    gathers = groups[("all-gather", ("fsdp",))]
    assert len(gathers) >= 9, "each sharded weight of the layer body, embedding and head is gathered"
    # The gradient reduction over fsdp: reduce-scatter on GPU; all-reduce + dynamic-slice on CPU.
    reductions = groups.get(("reduce-scatter", ("fsdp",)), []) + groups.get(("all-reduce", ("fsdp",)), [])
    assert sum(c.payload_bytes * c.executions for c in reductions) >= param_bytes
    # Parameters are gathered, not the (B, T, D) activations: no data movement of the batch.
    assert all(c.op_name.endswith(("dot_general", "mul", "sharding_constraint")) for c in gathers)


def test_tensor_parallel_all_reduces_activations_over_tensor():
    trainer, found, param_bytes = compiled_collectives("data=2,tensor=4")
    groups = by_kind_and_axes(trainer, found)
    assert not any(kind == "all-gather" for kind, _ in groups), "tensor parallelism gathers no weights"
    activation_bytes = (B // 2) * T * CFG.dim * 4  # (B/data, T, D) fp32
    tensor_ar = [c for c in groups[("all-reduce", ("tensor",))] if c.payload_bytes == activation_bytes]
    # Megatron: one all-reduce after attention and one after the MLP forward, two more backward,
    # in every layer (the scanned body runs n_layers times).
    in_layers = [c for c in tensor_ar if c.executions == CFG.n_layers]
    assert len(in_layers) == 4, [c.op_name for c in tensor_ar]
    # forward: attention output and MLP down projections; backward: the fused QKV and gate/up inputs
    for scope in ("layer/attn/out_proj/", "layer/mlp/down_proj/", "layer/attn/qkv_proj/", "layer/mlp/gate_up_proj/"):
        assert sum(scope in c.op_name for c in in_layers) == 1, (scope, [c.op_name for c in in_layers])
    # Gradients are reduced over data only.
    assert sum(c.payload_bytes * c.executions for c in groups[("all-reduce", ("data",))]) >= param_bytes / 4


def test_hybrid_layout_has_all_three_patterns():
    trainer, found, _ = compiled_collectives("data=2,fsdp=2,tensor=2")
    groups = by_kind_and_axes(trainer, found)
    assert ("all-gather", ("fsdp",)) in groups
    assert ("all-reduce", ("tensor",)) in groups
    assert any(kind == "all-reduce" and "data" in axes for kind, axes in groups)


@pytest.mark.parametrize(
    "line,groups",
    [
        ("%a = f32[4]{0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add", ((0, 1), (2, 3))),
        ("%a = f32[4]{0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add", ((0, 1, 2, 3), (4, 5, 6, 7))),
        (
            "%a = f32[4]{0} all-reduce(%x), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
            ((0, 4), (1, 5), (2, 6), (3, 7)),
        ),
        (
            "%a = f32[4]{0} all-gather(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}",
            ((0, 4), (1, 5), (2, 6), (3, 7)),
        ),
        (
            # A sub-axis: the minor 2 of axis_2's 4 (ids [0,1,4,5 | 2,3,6,7] over axis_0, then axis_2).
            "%a = f32[4]{0} all-to-all(%x), replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4,'axis_3'=1], "
            "device_ids=([2,2,2]T(1,0,2)) {'axis_2':(2)2}, dimensions={0}",
            ((0, 1), (4, 5), (2, 3), (6, 7)),
        ),
    ],
)
def test_replica_group_spellings(line, groups):
    (c,) = hlo.collectives(line)
    assert c.groups == groups
    assert c.payload_bytes == 16


# -- the compiled-program parser on stored programs (tests/fixtures) -----------------------------

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def test_dot_flops_of_a_stored_cpu_program_counts_every_loop_trip():
    # 3 scanned layers of (16, 64) @ (64, 64); saved from the CPU backend of jax 0.10.2.
    text = (FIXTURES / "cpu_scan_matmul.hlo").read_text()
    assert hlo.dot_flops(text) == 3 * 2 * 16 * 64 * 64


def test_dot_flops_counts_gpu_library_matmuls():
    # A GPU-style program: a cuBLAS gemm in a 4-trip loop and a cuBLASLt matmul outside it.
    text = (FIXTURES / "gpu_cublas_gemm.hlo").read_text()
    assert hlo.dot_flops(text) == 4 * 2 * 32 * 512 * 256 + 2 * 32 * 512 * 256
    (ar,) = hlo.collectives(text)
    assert ar.kind == "all-reduce" and ar.executions == 4 and ar.payload_bytes == 32 * 512 * 4


def test_dot_flops_agrees_with_xla_cost_analysis_where_there_is_no_loop():
    def f(a, b, c):
        return (a @ b) @ c

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((32, 64), (64, 128), (128, 16))]
    compiled = jax.jit(f).lower(*shapes).compile()
    want = 2 * 32 * 64 * 128 + 2 * 32 * 128 * 16
    assert hlo.dot_flops(compiled.as_text()) == want
    assert compiled.cost_analysis()["flops"] == pytest.approx(want, rel=0.01)


def test_unrecognised_text_is_an_error_not_zero():
    with pytest.raises(hlo.HloFormatError, match="No HLO computation"):
        hlo.dot_flops("this is not HLO\nat all")
    text = (FIXTURES / "cpu_scan_matmul.hlo").read_text()
    with pytest.raises(hlo.HloFormatError, match="matmuls, but none could be read"):
        hlo.dot_flops(text.replace("lhs_contracting_dims", "lhs_contraction"))
    with pytest.raises(hlo.HloFormatError, match="no trip count"):
        hlo.dot_flops(text.replace("known_trip_count", "trip"))
    mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=4]"
    with pytest.raises(hlo.HloFormatError, match="replica group's axis: \"'axis_9'\""):
        hlo.collectives(f"%a = f32[4]{{0}} all-gather(%x), {mesh} {{'axis_9'}}, dimensions={{0}}")
    with pytest.raises(hlo.HloFormatError, match="two parts of one axis"):
        hlo.collectives(f"%a = f32[4]{{0}} all-gather(%x), {mesh} {{'axis_1':(1)2,'axis_1':(2)2}}, dimensions={{0}}")


def test_the_program_is_parsed_once_into_typed_instructions():
    text = (FIXTURES / "cpu_scan_matmul.hlo").read_text()
    program = hlo.parse(text)
    assert hlo.parse(text) is program  # the report's three readings share one parse
    opcodes = {i.opcode for i in program.instructions}
    assert {"dot", "while", "parameter"} <= opcodes
    loop = next(i for i in program.instructions if i.opcode == "while")
    body = loop.line.split("body=%")[1].split(",")[0].split()[0]
    assert program.executions[body] > 1 and body in loop.references
    dots = [i for i in program.instructions if i.opcode == "dot"]
    assert dots and all(i.references and i.computation for i in dots)
    assert hlo.dot_flops(program) == hlo.dot_flops(text) > 0


def test_asynchronous_collectives_are_read_as_start_done_pairs():
    """A GPU program (XLA's text format, written by hand: no GPU here) runs its collectives as
    start/done pairs; each pair is one collective, marked asynchronous, with the result's bytes."""
    text = (FIXTURES / "gpu_async_collectives.hlo").read_text()
    found = hlo.collectives(text)
    assert [(c.kind, c.asynchronous, c.payload_bytes) for c in found] == [
        ("all-gather", True, 64 * 512 * 4),
        ("all-reduce", True, 64 * 512 * 4),
    ]
    assert hlo.dot_flops(text) == 2 * 64 * 64 * 512  # the cuBLAS gemm between them
    trainer = sk.Trainer(sk.models.GPTConfig.preset("tiny").model(), optax.sgd(0.1), "fsdp=8")
    cpu = hlo.collectives(trainer.compile({"tokens": np.zeros((8, 17), np.int32)}).as_text())
    assert cpu and not any(c.asynchronous for c in cpu)  # the CPU backend runs them synchronously


def test_the_overlap_flags_are_known_to_this_xla_and_keep_the_users_values(tmp_path):
    import os
    import subprocess
    import sys

    from shardkit.runtime.xla_flags import OVERLAP_FLAGS, use_overlap_flags, with_overlap_flags

    mine = with_overlap_flags(
        "--xla_gpu_enable_latency_hiding_scheduler=false --xla_force_host_platform_device_count=8"
    )
    assert mine.count("xla_gpu_enable_latency_hiding_scheduler") == 1 and "scheduler=false" in mine
    assert all(f"--{name}=" in mine for name in OVERLAP_FLAGS)
    # XLA aborts on an unknown flag: a fresh process with all of them compiles an FSDP step on CPU.
    code = (
        "import shardkit as sk, optax, numpy as np; sk.simulate_devices(8); "
        "t = sk.Trainer(sk.models.GPTConfig.preset('tiny').model(), optax.sgd(0.1), 'fsdp=8'); "
        "print(t.compile({'tokens': np.zeros((8, 17), np.int32)}).memory_analysis() is not None)"
    )
    env = {**os.environ, "XLA_FLAGS": with_overlap_flags("")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert use_overlap_flags(environ) is False  # this process's backend has started: nothing changes
    assert environ == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
