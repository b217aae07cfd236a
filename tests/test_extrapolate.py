"""Dry runs past the CPU compiler's 2048 devices: two compiles with the fsdp or data axis (and the
global batch) halved and a fit in 1/n. The fit is checked against full compiles by lowering the limit (a layout of 8
devices extrapolated from 2 and 4), and a real 4,096-device dry run goes through the command line."""

import importlib
import json
import subprocess
import sys

import pytest

from shardkit.analysis import extrapolate as ex
from shardkit.core.errors import LayoutError
from shardkit.core.mesh import Layout

dr = importlib.import_module("shardkit.plan.dryrun")  # the module, not the function of the same name


def compare(layout: str, model="tiny"):
    """(full compile, extrapolated from the two halvings below it) for ``layout``.

    All three compile in subprocesses with XLA's default CPU options, as the extrapolation's own
    compiles do: the tests' compile-time flags (elemental emitters) move temp bytes by a few
    bytes, which would compare two compilers rather than the fit."""
    full = dr._in_subprocess(dr.DryRunConfig(model=model, layout=layout, batch=16, seq=64))
    parsed = Layout.parse(layout)
    shrink = ex.shrink_plan(parsed, limit=parsed.num_devices // 2)
    parts = [
        dr._in_subprocess(
            dr.DryRunConfig(model=model, layout=shrink.layout(parsed, s), batch=shrink.batch(16, s), seq=64)
        )
        for s in shrink.sizes
    ]
    return full, ex.extrapolate(*parts, shrink, parsed)


def moved(result):
    return sum(c["moved_bytes"] for c in result["collectives"])


@pytest.mark.slow
def test_fsdp_extrapolates_to_the_full_compile_exactly():
    full, got = compare("fsdp=8")
    assert got["memory"] == full["memory"]  # every buffer is a + b/n under fsdp
    assert moved(got) == pytest.approx(moved(full), rel=1e-6)
    assert got["flops_per_device"] == pytest.approx(full["flops_per_device"], rel=1e-9)
    over_fsdp = [c["group_size"] for c in got["collectives"] if tuple(c["axes"]) == ("fsdp",)]
    assert over_fsdp == [8] * sum(tuple(c["axes"]) == ("fsdp",) for c in full["collectives"]) and over_fsdp
    assert "extrapolated from 2 and 4 devices" in got["extrapolated"]["text"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "byo_factories:linen_lm", "byo_factories:gemma_lm"])
def test_data_parallel_extrapolates_to_the_full_compile_exactly(model):
    """The two smaller compiles keep each device's rows, so under data parallelism they are the full
    program with smaller replica groups: shardkit's GPT, and the Linen and Gemma-style NNX models of
    examples/ (Flax's own metadata, no sk.constrain). (Compiled with the global batch fixed instead,
    XLA's temporaries were 2.2% off at 8 devices from 2 and 4.)"""
    full, got = compare("data=8", model=model)
    assert got["memory"] == full["memory"]
    assert moved(got) == pytest.approx(moved(full), rel=1e-6)
    assert got["flops_per_device"] == pytest.approx(full["flops_per_device"], rel=1e-9)
    assert got["model_flops_per_step"] == pytest.approx(full["model_flops_per_step"], rel=1e-9)
    assert got["extrapolated"]["from_layouts"] == ["data=2", "data=4"]


def test_layouts_that_cannot_be_halved_are_refused_before_any_compile():
    with pytest.raises(LayoutError, match="cannot be dry-run"):
        ex.shrink_plan(Layout.parse("tensor=4096"))
    with pytest.raises(LayoutError, match="cannot be dry-run"):
        ex.shrink_plan(Layout.parse("fsdp=3,tensor=1024"))
    shrink = ex.shrink_plan(Layout.parse("fsdp=2048,tensor=8"))
    assert shrink == ex.Shrink("fsdp", 2048, (128, 256))  # 1,024 and 2,048 devices compiled


def test_a_batch_that_does_not_split_over_the_full_layout_is_refused_before_any_compile():
    """The smaller compiles take the full layout's rows per device, so those rows must be whole."""
    with pytest.raises(LayoutError, match="a multiple of 4096"):
        dr.dryrun("tiny", layout="data=1024,fsdp=4", batch=2048, seq=64)
    with pytest.raises(LayoutError, match="a multiple of 2048"):  # microbatches count too
        dr.dryrun("tiny", layout="data=1024,tensor=4", batch=1024, seq=64, microbatches=2)


@pytest.mark.slow
def test_a_4096_device_dry_run_on_the_command_line_is_extrapolated():
    cmd = [sys.executable, "-m", "shardkit.cli", "dryrun", "--model", "tiny", "--layout", "data=1024,tensor=4"]
    proc = subprocess.run(
        [*cmd, "--batch", "1024", "--seq", "64", "--json"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["devices"] == 4096 and result["extrapolated"]["from_devices"] == [1024, 2048]
    assert result["memory"]["total"] > 0 and result["fits"]["fits"]
    inspect = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "inspect", "--model", "tiny", "--layout", "data=1024,tensor=4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inspect.returncode == 2 and "shardkit dryrun, which extrapolates" in inspect.stderr


@pytest.mark.slow
def test_a_model_written_without_shardkit_extrapolates_under_fsdp():
    """The Gemma-style NNX LM of examples/ (Flax's own metadata, no sk.constrain), by its factory
    name: fsdp=16 extrapolated from 4 and 8 against its full compile. (From fsdp=2 XLA compiles
    its embedding lookup without the all-to-all it uses from 4 on: the programs differ, and the
    fit is refused rather than made; at real sizes the halvings are hundreds of devices.)"""
    full, got = compare("fsdp=16", model="byo_factories:gemma_lm")
    assert moved(got) == pytest.approx(moved(full), rel=0.01)
    assert got["flops_per_device"] == pytest.approx(full["flops_per_device"], rel=1e-6)
    assert got["memory"]["arguments"] == full["memory"]["arguments"]
    assert got["memory"]["total"] == pytest.approx(full["memory"]["total"], rel=0.005)  # measured: 0.09% off
