"""The planner: layouts ranked from compiled facts and a hardware model."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest

import shardkit as sk
from shardkit.analysis.estimate import axis_links
from shardkit.analysis.estimate import predict as estimate
from shardkit.analysis.hardware import PROFILES, Hardware, get_hardware
from shardkit.plan import Plan, PlanOptions, candidate_layouts, format_plans, plan

H100 = PROFILES["h100"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("plan-cache")


def test_a_small_model_gets_pure_data_parallelism(cache):
    # Even with sequence splits on offer (narrowed to keep the test quick; the bubble test below
    # plans pipelines).
    options = PlanOptions(tensor=(1,), sequence=(1, 2), stage=(1,))
    result = plan("tiny", 8, "h100", batch=16, seq=64, options=options, cache_dir=cache)
    assert "data=4,sequence=2" in {p["layout"] for p in result["plans"]}
    assert result["best"] == "data=8"
    top = result["plans"][0]
    assert top["fits"] and top["predicted_step_seconds"] > 0 and 0 < top["predicted_mfu"] <= 1
    assert {
        "layout",
        "microbatches",
        "remat",
        "memory_per_device",
        "predicted_step_seconds",
        "predicted_mfu",
        "fits",
    } <= set(top)
    # The best layout string is one `shardkit train` accepts.
    assert sk.Layout.parse(result["best"]).resolve(8).spec() == "data=8"
    # Typed for code, the same facts as the JSON the command line prints.
    from shardkit.plan import Plan, PlanResult

    assert isinstance(result, PlanResult) and isinstance(result.plans[0], Plan)
    assert result.best == "data=8" and result.plans[0].layout == "data=8" and result.plans[0].fits
    assert json.loads(json.dumps(result.to_dict()))["plans"][0]["layout"] == result.best


def test_a_model_that_does_not_fit_under_data_parallelism_gets_fsdp(cache):
    small_gpu = dataclasses.replace(H100, name="small", memory_bytes=8e6 / 0.9)
    options = PlanOptions(tensor=(1,), remat=("full",), sequence=(1,), stage=(1,), zero=(0,))  # FSDP alone
    result = plan("mini", 8, small_gpu, batch=8, seq=16, options=options, cache_dir=cache)
    by_layout = {p["layout"]: p for p in result["plans"]}
    assert not by_layout["data=8"]["fits"] and "model state alone exceeds" in by_layout["data=8"]["note"]
    assert re.search(r"exceeds the memory budget by \d+\.\d MB", by_layout["data=8"]["note"])  # by how much
    assert "8.0 MB per device to fill" in format_plans(result)
    assert "fsdp" in result["best"]
    assert all(p["memory_per_device"] <= 8e6 for p in result["plans"] if p["fits"])


def test_tensor_parallelism_never_spans_nodes():
    two_per_node = dataclasses.replace(H100, devices_per_node=2)
    cfg = sk.models.GPTConfig.preset("llama2-7b")
    layouts = candidate_layouts(cfg, 64, 64, two_per_node, PlanOptions())
    assert layouts and max(s["tensor"] for s in layouts) == 2
    for shape in candidate_layouts(cfg, 64, 64, H100, PlanOptions()):
        assert axis_links({**shape, "expert": 1}, H100)["tensor"] == "intra"


def test_candidates_respect_layers_sequence_and_nodes():
    two_per_node = dataclasses.replace(H100, devices_per_node=2)
    cfg = sk.models.GPTConfig.preset("llama2-7b")  # 32 layers
    layouts = candidate_layouts(cfg, 64, 64, two_per_node, PlanOptions(), seq=2048)
    assert {s["stage"] for s in layouts} == {1, 2, 4, 8} and {s["sequence"] for s in layouts} == {1, 2}
    for s in layouts:
        links = axis_links({**s, "expert": 1}, two_per_node)
        assert links["tensor"] == links["sequence"] == "intra"  # both inside a node
        assert not (s["stage"] > 1 and s["sequence"] > 1)
        assert s["data"] * s["fsdp"] * s["tensor"] * s["sequence"] * s["stage"] == 64
    odd = candidate_layouts(cfg, 64, 64, H100, PlanOptions(stage=(3, 4)), seq=2047)
    assert {s["stage"] for s in odd} == {4} and {s["sequence"] for s in odd} == {1}  # 3 does not divide 32


def test_pipeline_plans_pay_their_bubble(cache):
    def staged(microbatches):
        options = PlanOptions(
            tensor=(1,), sequence=(1,), stage=(2,), microbatches=(microbatches,), remat=("none",), compile_top=1
        )
        result = plan("tiny", 8, "h100", batch=64, seq=64, options=options, cache_dir=cache)
        best = result["plans"][0]  # the one compiled: the analytic estimate's first
        assert best["layout"] == "data=4,stage=2" and best["compiled"]
        return best

    few, many = staged(2), staged(8)
    assert few["microbatches"] == 2 and many["microbatches"] == 8
    # Lock-step stages compute through the bubble: FLOPs per device scale as (m + p - 1) / m.
    assert few["compute_seconds"] / many["compute_seconds"] == pytest.approx((3 / 2) / (9 / 8), rel=0.05)
    assert Plan(**few).cli_flags().endswith("--schedule 1f1b")


def test_axis_links_follow_the_mesh_order():
    shape = {"data": 4, "fsdp": 4, "tensor": 8, "sequence": 1, "stage": 1, "expert": 1}
    links = axis_links(shape, H100)
    assert links["tensor"] == "intra" and links["fsdp"] == "inter" and links["data"] == "inter"
    shape = {"data": 16, "fsdp": 2, "tensor": 4, "sequence": 1, "stage": 1, "expert": 1}
    links = axis_links(shape, H100)
    assert (links["tensor"], links["fsdp"], links["data"]) == ("intra", "intra", "inter")


RESULT = {  # a dry-run summary: 1 TFLOP per device, 1 GB over fsdp (crosses nodes), 2 GB over tensor
    "layout": "fsdp=4,tensor=8",
    "devices": 32,
    "flops_per_device": 1e12,
    "model_flops_per_step": 3.0e13,
    "bytes_by_axes": {"fsdp": 1e9, "tensor": 2e9},
}


def test_predictions_respond_to_bandwidth():
    base = estimate(RESULT, H100, "bfloat16")
    assert base["compute_seconds"] == pytest.approx(1e12 / 989e12)
    assert base["comm_seconds"] == pytest.approx(1e9 / 50e9 + 2e9 / 450e9)
    slower_ib = estimate(RESULT, dataclasses.replace(H100, inter_node_bandwidth=25e9), "bfloat16")
    assert slower_ib["comm_seconds"] - base["comm_seconds"] == pytest.approx(1e9 / 25e9 - 1e9 / 50e9)
    faster_nvlink = estimate(RESULT, dataclasses.replace(H100, intra_node_bandwidth=900e9), "bfloat16")
    assert faster_nvlink["comm_seconds"] < base["comm_seconds"]
    assert base["step_seconds_overlap"] == pytest.approx(max(base["compute_seconds"], base["comm_seconds"]))
    assert base["mfu"] == pytest.approx(3.0e13 / (32 * 989e12 * base["step_seconds"]))


def test_predictions_respond_to_batch(cache):
    times = {}
    for batch in (16, 32):
        options = PlanOptions(tensor=(1,), microbatches=(1,), sequence=(1,), stage=(1,), prune=False)
        r = plan("tiny", 8, "h100", batch=batch, seq=64, options=options, cache_dir=cache)
        times[batch] = {p["layout"]: p for p in r["plans"]}
    for layout in ("data=8", "fsdp=8"):
        ratio = times[32][layout]["compute_seconds"] / times[16][layout]["compute_seconds"]
        assert ratio == pytest.approx(2.0, rel=0.05)
    # Data-parallel gradient traffic does not depend on the batch.
    assert times[32]["data=8"]["bytes_by_axes"] == times[16]["data=8"]["bytes_by_axes"]


def test_plan_cli_json(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkit.cli",
            "plan",
            "--model",
            "tiny",
            "--devices",
            "4",
            "--hardware",
            "a100",
            "--batch",
            "8",
            "--seq",
            "32",
            "--tensor",
            "1",
            "--microbatch-options",
            "1",
            "--remat-options",
            "none",
            "--sequence",
            "1",
            "--stage",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "SHARDKIT_CACHE": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["best"] == "data=4" and d["hardware"] == "a100" and len(d["plans"]) == 3
    assert (tmp_path / "dryruns.json").exists()


def test_hardware_profiles_and_files(tmp_path):
    from shardkit.analysis.hardware import profile_of_device

    assert get_hardware("h200").memory_bytes == 141e9
    # The profile of a device by JAX's device_kind (the main job's MFU); none for a CPU.
    assert profile_of_device("NVIDIA H100 80GB HBM3") is PROFILES["h100"]
    assert profile_of_device("TPU v5 lite") is PROFILES["tpu-v5e"] and profile_of_device("cpu") is None
    assert PROFILES["tpu-v5p"].peak_flops("bfloat16") == 459e12
    path = tmp_path / "mygpu.json"
    fields = {k: v for k, v in dataclasses.asdict(H100).items() if k != "name"}
    path.write_text(json.dumps({**fields, "memory_bytes": 24e9}))
    hw = Hardware.from_file(path)
    assert hw.name == "mygpu" and hw.memory_bytes == 24e9
    with pytest.raises(sk.ShardkitError, match="Unknown hardware 'b200'"):
        get_hardware("b200")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"flops": {"bfloat16": 1e15}}))
    with pytest.raises(sk.ShardkitError, match="lacks"):
        Hardware.from_file(bad)
    with pytest.raises(sk.ShardkitError, match="no FLOP/s figure for float8"):
        H100.peak_flops("float8")


def test_a_mixture_of_experts_is_planned_over_the_expert_axis(cache):
    cfg = sk.models.GPTConfig.preset("mixtral-8x7b")
    layouts = candidate_layouts(cfg, 64, 64, H100, PlanOptions(), seq=4096)
    assert {s["expert"] for s in layouts} == {1, 2, 4, 8}
    assert all(s["expert"] == 1 or (s["stage"] == 1 and s["sequence"] == 1) for s in layouts)
    dense = candidate_layouts(sk.models.GPTConfig.preset("llama2-7b"), 64, 64, H100, PlanOptions(expert=(2,)))
    assert dense == []  # a dense model has no experts to split
    options = PlanOptions(tensor=(1,), sequence=(1,), stage=(1,), expert=(4,), remat=("none",))
    result = plan("tiny-moe", 8, "h100", batch=16, seq=32, options=options, cache_dir=cache)
    staged = {p["layout"]: p for p in result["plans"]}
    assert "data=2,expert=4" in staged and staged["data=2,expert=4"]["bytes_by_axes"].get("expert", 0) > 0


def test_the_analytic_estimate_tracks_the_compiled_step():
    # The planner prunes by this estimate, so it must be within a small factor of what the
    # compiler produces: memory per device and bytes per mesh axis, on layouts of each kind.
    from shardkit.analysis.estimate import analytic
    from shardkit.plan import ModelFacts

    sizes = ModelFacts.of_preset("mini").sizes
    for layout in ("data=8", "fsdp=8", "data=2,tensor=4", "fsdp=4,tensor=2"):
        compiled = sk.dryrun("mini", layout=layout, batch=32, seq=128)
        shape = dict(sk.Layout.parse(layout).sizes)
        est = analytic(sizes, shape, H100, batch=32, seq=128, precision="fp32", compute_itemsize=4)
        assert 0.6 < est.memory_bytes / compiled["memory"]["total"] < 1.6, layout
        assert 0.6 < sum(est.bytes_by_axes.values()) / sum(compiled["bytes_by_axes"].values()) < 1.6, layout
        for axis in shape:
            if axis in compiled["bytes_by_axes"]:
                assert 0.5 < est.bytes_by_axes[axis] / compiled["bytes_by_axes"][axis] < 2, (layout, axis)


@pytest.mark.slow
def test_pruning_by_the_estimate_keeps_the_best_plan(tmp_path):
    options = PlanOptions(tensor=(1, 2), sequence=(1,), stage=(1,), remat=("none",), microbatches=(1,), prune=False)
    everything = plan(
        "mini", 8, "h100", 32, 128, dataclasses.replace(options, compile_top=None), cache_dir=tmp_path / "a"
    )
    pruned = plan("mini", 8, "h100", 32, 128, dataclasses.replace(options, compile_top=2), cache_dir=tmp_path / "b")
    assert everything["compiled"] == len(everything["plans"]) == everything["searched"] == 7
    assert pruned["compiled"] == 2 and pruned["best"] == everything["best"]
    left = [p for p in pruned["plans"] if not p["compiled"]]
    assert len(left) == 5 and all(p["estimated_step_seconds"] > 0 and "not compiled" in p["note"] for p in left)
    # The compiled plans rank above the estimated ones, and the best plan's command is complete.
    assert [p["compiled"] for p in pruned["plans"]] == [True, True] + [False] * 5
    assert pruned["best_flags"].startswith("--model mini --batch 32 --seq 128 --layout ")


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, devices, batch, seq, skips",
    [
        ({"model": "tiny"}, 8, 16, 64, True),  # every compiled step is slower than its estimate: skips
        ({"init_from": "llama-3.1-70b"}, 512, 1024, 4096, True),
    ],
)
def test_skipping_layouts_estimated_slower_than_a_compiled_plan_keeps_the_best(
    tmp_path, source, devices, batch, seq, skips
):
    """The skip trusts the estimate as the least a layout costs only while every compiled layout
    was slower than its estimate: with or without it, the top's best plan is the same."""
    options = PlanOptions(sequence=(1,), stage=(1,))
    kept = plan(devices=devices, batch=batch, seq=seq, options=options, cache_dir=tmp_path / "a", **source)
    every = plan(
        devices=devices,
        batch=batch,
        seq=seq,
        options=dataclasses.replace(options, prune=False),
        cache_dir=tmp_path / "b",
        **source,
    )
    assert kept["best_flags"] == every["best_flags"]
    assert every["compiled"] == 6 and (kept["compiled"] < 6) == skips
    skipped = [p for p in kept["plans"] if "slower than a compiled plan" in p["note"]]
    assert len(skipped) == every["compiled"] - kept["compiled"]


def test_one_layout_faster_than_its_estimate_turns_the_skip_off():
    from shardkit.plan.planner import _Bound

    def row(predicted, estimated, fits=True):
        return Plan(
            "data=8", 1, "none", fits, 1.0, {}, predicted_step_seconds=predicted, estimated_step_seconds=estimated
        )

    bound = _Bound()
    bound.see(row(2.0, 1.0))  # slower than its estimate: the estimate is a lower bound so far
    assert bound.rules_out(2.5) and not bound.rules_out(1.5)
    bound.see(row(0.9, 1.0, fits=False))  # one compiled faster than its estimate: no more skips
    assert not bound.rules_out(2.5)


def _plan_workers(marker: str) -> list[int]:
    """PIDs of planner workers started with ``SHARDKIT_CACHE=marker``."""
    import pathlib

    found = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if (
                b"shardkit.plan.workers" in (proc / "cmdline").read_bytes()
                and marker.encode() in (proc / "environ").read_bytes()
            ):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


# SIGINT handled and not blocked in the planner, as a shell in a terminal starts a command: a test
# runner's process need not be so, and a child inherits both an ignored and a blocked SIGINT (a
# Python child then never raises KeyboardInterrupt). Set in the child itself: a preexec_fn would
# fork this multithreaded (JAX) process.
AS_IN_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); sys.argv[0] = 'shardkit'; "
    "runpy.run_module('shardkit.cli.commands', run_name='__main__')"
)


def _signal_state(pid: int) -> str:
    """The signal masks of ``pid`` (``SigBlk``, ``SigIgn``, ``SigCgt``: SIGINT is bit 1)."""
    import pathlib

    try:
        lines = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as e:
        return f"no status of {pid}: {e}"
    return " ".join(line for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


@pytest.mark.slow
def test_the_planner_shows_k_of_n_and_ctrl_c_prints_the_partial_table(tmp_path):
    import os
    import signal
    import time

    cmd = [sys.executable, "-c", AS_IN_A_TERMINAL, "plan", "--model", "llama2-7b", "--devices", "64"]
    cmd += ["--hardware", "h100", "--batch", "256", "--seq", "4096", "--workers", "2"]
    env = {**os.environ, "SHARDKIT_CACHE": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = proc.stdout.readline()
    assert "layouts:" in first and "compiling the 6 fastest" in first, first
    deadline = time.time() + 120
    while not _plan_workers(str(tmp_path)) and time.time() < deadline:
        time.sleep(0.2)
    assert _plan_workers(str(tmp_path)), "the planner compiles in worker processes"
    time.sleep(3)
    signals = _signal_state(proc.pid)  # what the planner does with SIGINT when it is sent
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"{signals}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err
    assert "(interrupted: partial table)" in out
    assert "interrupted before any plan was compiled" in out or "best: shardkit train" in out
    time.sleep(1)
    assert _plan_workers(str(tmp_path)) == [], "no worker outlives the plan"


def test_the_state_estimate_reads_its_bytes_from_the_optimizer_and_the_precision():
    import optax

    from shardkit.analysis.estimate import ModelSizes, analytic, optimizer_bytes_per_param
    from shardkit.analysis.hardware import PROFILES

    assert optimizer_bytes_per_param(optax.adamw(1e-3)) == 8.0  # two float32 moments
    assert optimizer_bytes_per_param(optax.sgd(0.1)) == 0.0
    assert optimizer_bytes_per_param(optax.sgd(0.1, momentum=0.9)) == 4.0
    assert optimizer_bytes_per_param(optax.adafactor(1e-3)) < 1.0  # factored second moments
    sizes = ModelSizes(params=1e9, layers=16, dim=2048, heads=16, kv_dim=2048, vocab=32000)
    per_param = {}
    for precision, optimizer in (("bf16-master", optax.adamw(1e-3)), ("fp32", optax.sgd(0.1))):
        e = analytic(
            sizes,
            {"fsdp": 8},
            PROFILES["h100"],
            batch=8,
            seq=1024,
            precision=precision,
            compute_itemsize=2,
            optimizer_bytes=optimizer_bytes_per_param(optimizer),
        )
        per_param[precision] = e.state_bytes * 8 / sizes.params
    assert per_param == {"bf16-master": 14.0, "fp32": 4.0}  # ZeRO's 2 + 4 + 8; plain SGD keeps only the params


def test_the_planner_splits_the_optimizer_state_over_data_when_memory_asks(cache):
    """Under a budget the replicated optimizer state does not fit, a layout with a data axis is
    planned with ZeRO (the state split over data) and the command says so; without the stages
    on offer the same question has no ZeRO in its answer."""
    small_gpu = dataclasses.replace(H100, name="small", memory_bytes=8e6 / 0.9)
    base = dict(tensor=(1,), remat=("full",), sequence=(1,), stage=(1,), compile_top=3)
    result = plan("mini", 8, small_gpu, batch=8, seq=16, options=PlanOptions(**base), cache_dir=cache)
    best = next(p for p in result.plans if p.layout == result.best)
    assert best.zero == 2 and "--zero 2" in result.best_flags and "data=" in result.best
    assert f"{result.best} zero2" in format_plans(result)
    plain = plan("mini", 8, small_gpu, batch=8, seq=16, options=PlanOptions(**base, zero=(0,)), cache_dir=cache)
    assert "--zero" not in plain.best_flags and all(p.zero == 0 for p in plain.plans)


@pytest.mark.slow
def test_the_planner_plans_past_the_compilers_device_limit(tmp_path):
    """4,096 devices for a model written without shardkit, by its factory name: the compiler takes
    at most 2048, so each layout compiled is dry-run from two smaller compiles (as `shardkit
    dryrun` does) instead of failing with XLA's "Multiprocess computations" error."""
    options = PlanOptions(
        tensor=(1, 2), sequence=(1,), stage=(1,), remat=("none",), microbatches=(1,), zero=(0,), compile_top=2
    )
    result = plan("byo_factories:gemma_lm", 4096, "h100", batch=4096, seq=64, options=options, cache_dir=tmp_path)
    compiled = [p for p in result.plans if p.compiled]
    assert len(compiled) == 2 and all(p.fits and p.predicted_step_seconds > 0 for p in compiled), result.plans
    assert result.best == compiled[0].layout and sk.Layout.parse(result.best).num_devices == 4096
    assert all(p.note == "extrapolated from 1,024 and 2,048 devices" for p in compiled)
    cached = json.loads((tmp_path / "dryruns.json").read_text())
    texts = [r["extrapolated"]["text"] for r in cached.values()]
    assert len(texts) == 2 and all("extrapolated from 1,024 and 2,048 devices" in t for t in texts)
    best = next(r for r in cached.values() if r["layout"] == result.best)
    assert best["memory"]["total"] == pytest.approx(compiled[0].memory_per_device)


def test_a_factory_with_no_importable_name_past_the_device_limit_is_refused_before_any_compile(tmp_path):
    """Past 2048 devices the compiles run in subprocesses that import the model by name: a lambda has none."""
    from shardkit.core.errors import ModelError
    from shardkit.models.gpt import GPTConfig

    model = GPTConfig.preset("tiny").model()
    options = PlanOptions(tensor=(1,), sequence=(1,), stage=(1,), remat=("none",), microbatches=(1,), zero=(0,))
    with pytest.raises(ModelError, match="factory, 'package.module:function'"):
        plan(lambda: model, 4096, "h100", batch=4096, seq=64, options=options, cache_dir=tmp_path)
    assert not (tmp_path / "dryruns.json").exists()


def test_a_time_limit_stops_the_compiles_and_ranks_what_compiled_in_time(tmp_path, monkeypatch):
    # llama2-7b on 64 devices: each compile takes tens of seconds here, the whole search minutes.
    monkeypatch.setenv("SHARDKIT_PLAN_MARKER", str(tmp_path))  # the workers inherit it: found below
    options = PlanOptions(workers=2, time_limit=4.0)
    result = plan("llama2-7b", 64, "h100", batch=256, seq=4096, options=options, cache_dir=tmp_path)
    chosen = [p for p in result.plans if p.compiled or "past the time limit" in p.note]
    late = [p for p in chosen if not p.compiled]
    assert late and all(p.note == "not compiled: past the time limit of 4 s" for p in late)
    assert result.compiled == len(chosen) - len(late) < 6
    assert result.seconds < 45  # stopped, not waited for: the search without a limit takes minutes
    assert _plan_workers(str(tmp_path)) == [], "no worker outlives the plan"


def test_a_time_limit_that_is_not_a_positive_number_is_refused():
    from shardkit.core.errors import InputError

    with pytest.raises(InputError, match="time_limit=0"):
        PlanOptions(time_limit=0)
