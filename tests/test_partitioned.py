"""bf16 collectives counted at the dtype XLA's SPMD partitioner chose: the CPU compiler runs them
in f32 (all-reduce promotion, bf16 normalization), a GPU does not."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from byo_models import LinenLM, LMConfig

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.analysis.report import collective_stats

SHAPE = {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}


def moved(stats):
    return sum(c.moved_bytes for c in stats)


@pytest.mark.parametrize("layout", ["data=8", "fsdp=8"])
def test_bf16_collectives_are_counted_at_the_partitioners_dtype(layout):
    trainer = sk.Trainer(sk.models.GPTConfig.preset("tiny").model(), optax.adamw(1e-3), layout, precision="bf16-master")
    report = trainer.report(SHAPE)
    assert report.partitioner_dtypes
    assert "bytes at the dtypes XLA's partitioner chose" in report.table()
    # The compiled program itself moves the promoted f32: about twice as many bytes.
    promoted = moved(
        collective_stats(trainer.compile(SHAPE).as_text(), trainer.mesh, trainer.update_specs, trainer.abstract_params)
    )
    assert promoted >= 1.8 * moved(report.collectives)
    # Gradients and gathered parameters are bf16 here: the layout's bound, not twice it.
    assert report.ratios["bytes"] <= 1.05


def test_a_model_mixing_f32_and_bf16_is_never_undercounted():
    # The Linen LM of examples/ mixes dtypes (Linen's norms compute in f32): where the
    # partitioner has collectives of one kind and shape in both, the larger size counts.
    linen = sk.from_linen(LinenLM(LMConfig(dim=64, mlp=256, layers=2)), jnp.zeros((2, 32), jnp.int32))
    trainer = sk.Trainer(linen, optax.adamw(1e-3), "fsdp=8", precision="bf16-master")
    report = trainer.report(SHAPE)
    assert report.partitioner_dtypes
    raw = collective_stats(
        trainer.compile(SHAPE).as_text(), trainer.mesh, trainer.update_specs, trainer.abstract_params
    )
    assert moved(raw) / 2 <= moved(report.collectives) <= moved(raw)


def test_fp32_reports_are_read_from_the_compiled_program_alone():
    trainer = sk.Trainer(sk.models.GPTConfig.preset("tiny").model(), optax.adamw(1e-3), "data=8")
    report = trainer.report(SHAPE)
    assert not report.partitioner_dtypes
    compiled = trainer.compile(SHAPE).as_text()
    raw = collective_stats(compiled, trainer.mesh, trainer.update_specs, trainer.abstract_params)
    assert moved(report.collectives) == pytest.approx(moved(raw))
    assert "partitioner" not in report.table()


def test_partitioned_module_sizes_override_only_smaller_dtypes():
    from shardkit.analysis import partitioned

    compiled = (
        "%ar = f32[64,32]{1,0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add\n"
        "%ag = f32[16]{0} all-gather(%y), replica_groups={{0,1}}, dimensions={0}\n"
    )
    partitioned_text = (
        "%ar.1 = bf16[64,32]{1,0} all-reduce(%x.1), replica_groups={{0,1}}, to_apply=%add\n"
        "%ag.1 = f32[16]{0} all-gather(%y.1), replica_groups={{0,1}}, dimensions={0}\n"
    )
    counted = {
        c.kind: c.payload_bytes for c in partitioned.at_partitioner_dtypes(hlo.collectives(compiled), partitioned_text)
    }
    assert counted == {"all-reduce": 64 * 32 * 2, "all-gather": 16 * 4}


CACHED_REPORTS = """
import json, os, sys
import shardkit as sk
sk.simulate_devices(8)
import jax, jax.numpy as jnp, optax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
shape = {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}
def trainer():
    model = sk.models.GPTConfig.preset("tiny").model()
    return sk.Trainer(model, optax.adamw(1e-3), "data=8", precision="bf16-master")
trainer().compile(shape)  # the step is now in the persistent cache
before = len(os.listdir(sys.argv[1]))
reports = [trainer().report(shape) for _ in range(2)]  # fresh trainers: no in-memory executable
print(json.dumps({
    "entries": [before, len(os.listdir(sys.argv[1]))],
    "partitioner": [r.partitioner_dtypes for r in reports],
    "moved": [r.moved_bytes for r in reports],
}))
"""


@pytest.mark.slow
def test_a_persistent_compilation_cache_does_not_hide_the_partitioned_module(tmp_path):
    # JAX's persistent cache leaves dump options out of its key: a report whose dump compile
    # loaded the cached step would find no partitioned module and count the CPU's f32 bytes.
    # The cache is process-wide (JAX decides once whether it is in use): its own process.
    proc = subprocess.run(
        [sys.executable, "-c", CACHED_REPORTS, str(tmp_path / "cache")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after = result["entries"]
    assert before >= 1, "the persistent cache was not in use"
    assert after == before, "the reports' dump compiles were written to the persistent cache"
    assert result["partitioner"] == [True, True]
    # The same bytes as a report in this process, compiled independently of that cache.
    trainer = sk.Trainer(
        sk.models.GPTConfig.preset("tiny").model(), optax.adamw(1e-3), "data=8", precision="bf16-master"
    )
    assert result["moved"] == [trainer.report(SHAPE).moved_bytes] * 2
