"""The benchmark scripts run (at a small size) and write the JSON they promise."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import TEST_XLA_FLAGS

from shardkit.runtime.host_allocator import without_huge_pages

ROOT = pathlib.Path(__file__).parent.parent
ENV = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}


def run(*cmd, timeout=600, env=None):
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env or ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_mfu_benchmark_small(tmp_path):
    out = run(
        sys.executable,
        "benchmarks/mfu.py",
        "--model",
        "tiny",
        "--batch",
        "8",
        "--seq",
        "32",
        "--steps",
        "2",
        "--json",
        str(tmp_path / "mfu.json"),
    )
    result = json.loads((tmp_path / "mfu.json").read_text())
    assert result["tokens_per_second"] > 0 and 0 < result["mfu"] < 1
    assert "measured" in result["peak_source"] and "tokens/s" in out


@pytest.mark.slow
def test_bench_gpu_script_falls_back_to_cpu():
    out = run("bash", "scripts/bench_gpu.sh")
    assert "no NVIDIA GPU found" in out and "MFU" in out


@pytest.mark.slow
def test_overhead_benchmark_small(tmp_path):
    out = run(
        sys.executable,
        "benchmarks/overhead.py",
        "--model",
        "tiny",
        "--seq",
        "32",
        "--steps",
        "3",
        "--json",
        str(tmp_path / "o.json"),
    )
    result = json.loads((tmp_path / "o.json").read_text())
    assert result["same_collectives"] is True and result["ratio_shardkit_over_hand_written"] > 0
    assert "ratio shardkit / hand-written" in out


@pytest.mark.slow
def test_dryrun_scale_quick(tmp_path):
    out = run(sys.executable, "benchmarks/dryrun_scale.py", "--quick", "--json", str(tmp_path / "d.json"))
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["sizes"][0]["devices"] == 64 and [r["layers"] for r in result["depths"]] == [12, 24]
    assert "goals" in out


@pytest.mark.slow
def test_checkpoint_stall_benchmark_small(tmp_path):
    run(sys.executable, "benchmarks/checkpoint_stall.py", "--model", "tiny", "--json", str(tmp_path / "c.json"))
    result = json.loads((tmp_path / "c.json").read_text())
    assert 0 < result["save_call_seconds"] <= result["until_on_disk_seconds"]


@pytest.mark.slow
def test_zero_benchmark_small(tmp_path):
    out = run(
        sys.executable, "benchmarks/zero.py", "--model", "tiny", "--seq", "32", "--json", str(tmp_path / "z.json")
    )
    rows = {r["stage"]: r for r in json.loads((tmp_path / "z.json").read_text())["rows"]}
    for row in rows.values():  # the compiled state is ZeRO's formula for every stage
        assert abs(row["state_MB"] - row["formula_state_MB"]) < 0.01 * row["formula_state_MB"]
    assert rows["ZeRO-1"]["state_MB"] < rows["data (ZeRO-0)"]["state_MB"] / 3
    assert "ZeRO-2" in out


@pytest.mark.slow
def test_accumulation_benchmark_small(tmp_path):
    out = run(
        sys.executable,
        "benchmarks/accumulation.py",
        "--model",
        "tiny",
        "--seq",
        "32",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--json",
        str(tmp_path / "a.json"),
    )
    result = json.loads((tmp_path / "a.json").read_text())
    rows = {(r["layout"], r["reduce"]): r for r in result["rows"]}
    for layout in ("data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "stage=2,data=4"):
        once, each = rows[layout, "once"], rows[layout, "per_microbatch"]
        assert abs(once["gradient_MB"] - once["bound_MB"]) <= 0.01 * once["bound_MB"]
        assert each["gradient_MB"] >= 0.95 * result["microbatches"] * once["gradient_MB"]
    assert [s["layout"] for s in result["speeds"]] == ["data=8", "stage=2,data=4"]
    assert all(s["ratio_once"] > 0 for s in result["speeds"]) and "ratio" in out


@pytest.mark.slow
def test_cpu_vs_pytorch_benchmark_times_shardkit_without_pytorch(tmp_path):
    # PyTorch is not a dependency: without it the benchmark times shardkit's forms and says so.
    out = run(
        sys.executable,
        "benchmarks/cpu_vs_pytorch.py",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--warmup",
        "3",  # untimed steps: compile, and the first mapping of each host buffer
        "--json",
        str(tmp_path / "t.json"),
    )
    median = json.loads((tmp_path / "t.json").read_text())["median"]
    forms = {
        "shardkit",
        "shardkit-scan-unroll",
        "shardkit-unrolled",
        "shardkit-glibc-malloc",
        "shardkit-notebook",  # the step run by a cell in a real Jupyter kernel
        "shardkit-one-heap",
    }
    assert set(median) >= forms
    assert all(r["tokens_per_s"] > 0 and r["parameters"] == 4_327_680 for r in median.values())
    assert all(r["tokens_per_s_median_step"] > 0 for r in median.values())
    faults = {name: median[name]["page_faults_per_step"] for name in forms}
    # XLA's single heap under glibc's defaults maps each step's 212 MB of temporaries per device in
    # anew: 51,800 pages of 4 KB a device. In heaps of 16 MiB glibc keeps most of them; huge pages
    # map the rest 2 MB at a time.
    assert faults["shardkit-one-heap"] > 2 * 40_000
    assert faults["shardkit-glibc-malloc"] < 0.4 * faults["shardkit-one-heap"]
    assert faults["shardkit-notebook"] < 0.4 * faults["shardkit-one-heap"]  # the kernel keeps them too
    assert faults["shardkit"] < 0.15 * faults["shardkit-one-heap"]
    if "torch" not in median:
        assert "PyTorch is not importable" in out


def test_weight_grad_dot_benchmark_small(tmp_path):
    small = ["--rows", "64", "--k", "16", "--m", "48", "--steps", "2"]
    out = run(sys.executable, "benchmarks/weight_grad_dot.py", *small, "--json", str(tmp_path / "w.json"))
    forms = json.loads((tmp_path / "w.json").read_text())["forms"]
    assert forms["autodiff x @ w"]["dots"] == ["f32[48,16]"] and forms["rows_matmul"]["dots"] == ["f32[16,48]"]
    assert forms["rows_matmul"]["speedup"] > 0 and "vs autodiff" in out


@pytest.mark.slow
def test_pipeline_benchmark_small(tmp_path):
    out = run(sys.executable, "benchmarks/pipeline.py", "--quick", "--json", str(tmp_path / "p.json"))
    result = json.loads((tmp_path / "p.json").read_text())
    assert {(r["stages"], r["virtual_stages"]) for r in result["bubble"]} == {(2, 1), (2, 2)}
    assert result["worst_bubble_gap_flops"] < 0.01  # the compiled program does the formula's work
    assert "GPipe" in out and result["memory"][-1]["gpipe"] > result["memory"][0]["gpipe"]


@pytest.mark.slow
def test_any_model_benchmark_small(tmp_path):
    out = run(
        sys.executable,
        "benchmarks/any_model.py",
        "--dim",
        "64",
        "--layers",
        "2",
        "--seq",
        "32",
        "--json",
        str(tmp_path / "a.json"),
    )
    rows = json.loads((tmp_path / "a.json").read_text())["rows"]
    after = {(r["model"], r["layout"]): r for r in rows if r["when"] == "after"}
    before = {(r["model"], r["layout"]): r for r in rows if r["when"] == "before"}
    for model in ("nnx-gemma", "linen-lm"):
        assert after[model, "fsdp=8"]["bytes_ratio"] <= 1.05 < before[model, "fsdp=8"]["bytes_ratio"]
        assert after[model, "fsdp=8"]["reduce_scatter"] and not before[model, "fsdp=8"]["reduce_scatter"]
    # The model that names no axes: its state whole on every device before, split over fsdp after.
    plain_after, plain_before = after["nnx-plain", "fsdp=8"], before["nnx-plain", "fsdp=8"]
    assert plain_after["state_mb"] < plain_before["state_mb"] / 6
    assert plain_after["reduce_scatter"] and plain_after["bytes_ratio"] <= 1.05
    assert "moved/bound" in out


@pytest.mark.slow
def test_fsdp_min_size_benchmark_small(tmp_path):
    out = run(
        sys.executable,
        "benchmarks/fsdp_min_size.py",
        *("--dim", "64", "--layers", "2", "--seq", "32", "--no-llama", "--json", str(tmp_path / "f.json")),
    )
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    by = {(r["model"], r["setting"]): r for r in rows}
    for model in ("nnx-gemma", "linen-lm", "nnx-plain", "gpt-mini"):
        split, whole = by[model, "all split"], by[model, "vectors whole"]
        assert whole["over_fsdp"] < split["over_fsdp"]
        assert whole["params_per_device"] > split["params_per_device"]
    assert "vectors whole" in out


@pytest.mark.slow
def test_plan_time_benchmark_small(tmp_path):
    out = run(
        sys.executable,
        "benchmarks/plan_time.py",
        "--question",
        "tiny:8:16:64",
        "--json",
        str(tmp_path / "plan.json"),
    )
    result = json.loads((tmp_path / "plan.json").read_text())
    (row,) = result["questions"]
    assert result["met"] and 0 < row["seconds_cache_filled"] < row["seconds_empty_cache"]
    assert row["compiled"] <= 6 < row["searched"] and row["best_flags"].startswith("--model tiny")
    assert "goal: under 30 s with an empty cache: met" in out


@pytest.mark.slow
@pytest.mark.parametrize("experts", [0, 4])  # Llama-shaped, Mixtral-shaped
def test_hf_import_benchmark_small(tmp_path, experts):
    """Two processes of two devices each read a small checkpoint: each reads its share.

    The resident memory each process adds is the benchmark's figure, not asserted here: on a 13 MB
    model allocator noise is as large as the signal (11.8 MB added against 0.9 x 13.0 MB once, on
    a busy machine, where a quiet run adds about half)."""
    plain = {**without_huge_pages(ENV), "SHARDKIT_HOST_ALLOCATOR": "system"}
    out = run(
        sys.executable,
        "benchmarks/hf_import.py",
        "--dim",
        "128",
        "--layers",
        "2",
        "--vocab",
        "8192",
        "--nproc",
        "2",
        "--devices-per-proc",
        "2",
        "--experts",
        str(experts),
        "--json",
        str(tmp_path / "h.json"),
        env=plain,
    )
    result = json.loads((tmp_path / "h.json").read_text())
    assert ("Mixtral-shaped" in out) == bool(experts)
    assert len(result["processes"]) == 2 and "sharded import" in out
    for p in result["processes"]:
        assert p["share"] * 2 == pytest.approx(result["model_bytes"], rel=0.01)  # fsdp=4 over 2 processes
        assert p["added"] > 0  # measured (the figure itself is the benchmark's)


@pytest.mark.slow
def test_generate_benchmark_small(tmp_path):
    small = ["--contexts", "8", "32", "--new", "6", "--repeats", "1", "--max-seq", "128"]
    out = run(sys.executable, "benchmarks/generate.py", *small, "--json", str(tmp_path / "g.json"))
    result = json.loads((tmp_path / "g.json").read_text())
    assert [r["context"] for r in result["rows"]] == [8, 32]
    assert all(r["same_tokens_as_recompute"] for r in result["rows"])  # the cache changes no token
    cache = result["llama_3_1_8b_cache"]  # 32 layers x 8 kv heads x 128 x 2 (k, v) x bf16 per position
    assert cache["one device"] == 32 * 8 * 128 * 2 * 2 * 8192 == 8 * cache["tensor=8"]
    assert "decode ms/token" in out


@pytest.mark.slow
def test_experts_benchmark_small(tmp_path):
    out = run(
        sys.executable,
        "benchmarks/experts.py",
        "--model",
        "user_moe",
        "--layout",
        "data=2,expert=4",
        "--layout",
        "data=8",
        "--json",
        str(tmp_path / "e.json"),
    )
    rows = {r["layout"]: r for r in json.loads((tmp_path / "e.json").read_text())["rows"]}
    placed, alone = rows["data=2,expert=4"]["after"], rows["data=2,expert=4"]["before"]
    assert placed["bytes_ratio"] <= 1.02 < alone["bytes_ratio"] and placed["bound_expert_mb"] > 0
    assert placed["state_mb"] < rows["data=8"]["after"]["state_mb"] / 2  # the experts split four ways
    assert "largest named" in out


@pytest.mark.slow
def test_long_context_benchmark_small(tmp_path):
    out = run(sys.executable, "benchmarks/long_context.py", "--quick", "--json", str(tmp_path / "l.json"))
    result = json.loads((tmp_path / "l.json").read_text())
    steps = {(r["model"], r["tokens"]): r for r in result["step_temporaries"]}
    for model in ("mini", "gemma2"):
        grows = steps[(model, 1024)]["blocked"]["temp_gb"] / steps[(model, 256)]["blocked"]["temp_gb"]
        assert grows < 4.5 < steps[(model, 1024)]["xla"]["temp_gb"] / steps[(model, 256)]["xla"]["temp_gb"]
    tiles = {r["mask"].split()[0]: r["tiles"] for r in result["skipping"]}
    assert tiles["causal"] < 0.6 * tiles["none"] and tiles["window"] < tiles["causal"]
    assert "blocked/jax.nn" in out


@pytest.mark.slow
def test_moe_families_benchmark_without_its_dry_runs(tmp_path):
    out = run(sys.executable, "benchmarks/moe_families.py", "--no-dryrun", "--json", str(tmp_path / "m.json"))
    result = json.loads((tmp_path / "m.json").read_text())
    assert {r["family"] for r in result["fixtures"]} == {"qwen3_moe", "gpt_oss", "deepseek_v3"}
    assert all(r["max_logit_error"] <= 1e-4 and r["decode_tokens_per_s"] > 0 for r in result["fixtures"])
    assert result["cache"]["deepseek-v3"] == {
        "latent_numbers": 576,
        "grouped_numbers": 128 * 320,
        "ratio": 128 * 320 / 576,
    }
    assert "latent cache 576" in out
