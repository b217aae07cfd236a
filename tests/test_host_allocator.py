"""Host memory of CPU steps (shardkit.runtime.host_allocator): temporaries in heaps glibc keeps,
and huge pages, counted in page faults.

glibc reads its tunables when a process starts and adapts its mmap threshold to what a process
freed, so each case that computes runs in a fresh one.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import installed_command

from shardkit.analysis.hlo import largest_array_bytes
from shardkit.core.errors import InputError
from shardkit.runtime.host_allocator import (
    GLIBC_REUSE_LIMIT,
    HEAP_LIMIT,
    HEAP_OPTION,
    TUNABLE,
    huge_pages_on_request,
    jax_is_cpu_only,
    keep_heaps,
    temp_heap_options,
    with_huge_pages,
)

# 128 MiB results (32,768 pages of 4 KB): over glibc's largest mmap threshold (32 MiB), so each
# one is mapped in fresh and unmapped when freed.
FAULTS_PER_CALL = """
import json, resource
import jax, jax.numpy as jnp
x = jnp.ones((8192, 4096), jnp.float32)
add = jax.jit(lambda x: x + 1.0)
for _ in range(3):
    add(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    add(x).block_until_ready()  # the result is freed at once
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
print(json.dumps({"faults_per_call": faults, "pages": x.nbytes // 4096}))
"""


def without_tunables() -> dict:
    return {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"JAX_PLATFORMS": "cpu"}


def faults_per_call(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", FAULTS_PER_CALL], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not huge_pages_on_request(), reason="this kernel gives huge pages to all memory or to none: the tunable is moot"
)
def test_huge_pages_spare_nearly_every_page_fault_of_a_fresh_buffer():
    plain = faults_per_call(without_tunables())
    huge = faults_per_call(with_huge_pages(without_tunables(), mode="auto"))
    assert plain["faults_per_call"] >= 0.9 * plain["pages"]  # every 4 KB page faulted in anew
    assert huge["faults_per_call"] <= 0.1 * huge["pages"]  # about one fault per 2 MB


RESTARTS = """
import os
print("tunables:" + os.environ.get("GLIBC_TUNABLES", ""), flush=True)
from shardkit.runtime.host_allocator import restart_with_huge_pages
restart_with_huge_pages()
print("done", flush=True)
"""


@pytest.mark.skipif(not huge_pages_on_request(), reason="without huge pages on request there is nothing to restart for")
def test_the_process_restarts_once_with_the_tunable_and_carries_on():
    out = subprocess.run(
        [sys.executable, "-c", RESTARTS], capture_output=True, text=True, env=without_tunables(), timeout=120
    ).stdout.splitlines()
    assert out == ["tunables:", f"tunables:{TUNABLE}", "done"]
    env = without_tunables() | {"SHARDKIT_HOST_ALLOCATOR": "system"}
    out = subprocess.run([sys.executable, "-c", RESTARTS], capture_output=True, text=True, env=env).stdout.splitlines()
    assert out == ["tunables:", "done"]


def test_the_tunable_joins_the_users_own_and_never_overrides_them():
    cpu = {"JAX_PLATFORMS": "cpu"}
    assert (
        with_huge_pages(cpu | {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, mode="huge_pages")["GLIBC_TUNABLES"]
        == f"glibc.malloc.arena_max=2:{TUNABLE}"
    )
    assert with_huge_pages(cpu | {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, mode="huge_pages")["GLIBC_TUNABLES"] == (
        "glibc.malloc.hugetlb=0"
    )
    assert "GLIBC_TUNABLES" not in with_huge_pages(cpu, mode="system")
    # auto leaves processes that may compute on an accelerator alone.
    assert "GLIBC_TUNABLES" not in with_huge_pages({"JAX_PLATFORMS": "cuda"}, mode="auto")


def test_jax_platforms_decides_whether_jax_is_cpu_only():
    assert jax_is_cpu_only({"JAX_PLATFORMS": "cpu"})
    assert not jax_is_cpu_only({"JAX_PLATFORMS": "cuda,cpu"})
    assert not jax_is_cpu_only({"JAX_PLATFORMS": "tpu"})


def test_a_misspelled_mode_is_refused_with_the_choices():
    with pytest.raises(InputError, match="SHARDKIT_HOST_ALLOCATOR='fast': choose one of auto, huge_pages, system"):
        with_huge_pages({"SHARDKIT_HOST_ALLOCATOR": "fast"})
    with pytest.raises(InputError, match="choose one of auto, huge_pages, system"):
        with_huge_pages({}, mode="always")
    # The shardkit command reads it first of all, and says so as for any bad input.
    env = without_tunables() | {"SHARDKIT_HOST_ALLOCATOR": "fast"}
    proc = subprocess.run([installed_command(), "dryrun", "--help"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "choose one of auto, huge_pages, system" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_temporaries_are_split_only_on_the_cpu_when_large_and_made_of_small_arrays():
    big, small = 212 * 2**20, 8 * 2**20
    assert temp_heap_options("cpu", big, small, environ={}) == {HEAP_OPTION: HEAP_LIMIT}
    assert temp_heap_options("cpu", big, HEAP_LIMIT, environ={}) == {HEAP_OPTION: HEAP_LIMIT}  # an array fills a heap
    assert temp_heap_options("gpu", big, small, environ={}) == {}
    assert temp_heap_options("cpu", GLIBC_REUSE_LIMIT, small, environ={}) == {}  # glibc keeps it whole already
    assert temp_heap_options("cpu", big, HEAP_LIMIT + 1, environ={}) == {}  # it would get a heap of its own
    assert temp_heap_options("cpu", big, small, environ={"SHARDKIT_HOST_ALLOCATOR": "system"}) == {}
    with pytest.raises(InputError, match="choose one of auto, huge_pages, system"):
        temp_heap_options("cpu", big, small, environ={"SHARDKIT_HOST_ALLOCATOR": "heaps"})


# A thread allocates five buffers of 16 MiB (more than one of glibc's 64 MiB heaps holds), writes
# them and frees them, ten times: what XLA:CPU does with a step's heaps of temporaries.
KEEP_HEAPS = """
import ctypes, json, resource, sys, threading
from shardkit.runtime.host_allocator import keep_heaps
kept = keep_heaps() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE, faults = 16 * 2**20, []
def rounds():
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buffers = [libc.malloc(SIZE) for _ in range(5)]
        for p in buffers:
            ctypes.memset(p, 1, SIZE)
        for p in buffers:
            libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(json.dumps({"kept": kept, "faults": faults, "pages": 5 * SIZE // 4096}))
"""


def heap_faults(mode: str, env: dict) -> dict:
    command = [sys.executable, "-c", KEEP_HEAPS, mode]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heaps")
def test_kept_heaps_are_reused_without_faulting_their_pages_in_again():
    env = without_tunables() | {"SHARDKIT_HOST_ALLOCATOR": "auto"}
    plain, kept = heap_faults("plain", env), heap_faults("keep", env)
    assert kept["kept"] and not plain["kept"]
    assert min(plain["faults"][2:]) >= 0.9 * plain["pages"]  # glibc gives the heaps back: every page anew
    assert kept["faults"][0] >= 0.9 * kept["pages"]  # the first round maps them in ...
    assert max(kept["faults"][2:]) <= 0.01 * kept["pages"]  # ... and later rounds reuse them
    # SHARDKIT_HOST_ALLOCATOR=system leaves glibc as it is.
    system = heap_faults("keep", env | {"SHARDKIT_HOST_ALLOCATOR": "system"})
    assert not system["kept"] and min(system["faults"][2:]) >= 0.9 * system["pages"]


def test_keeping_heaps_is_refused_for_a_misspelled_mode():
    with pytest.raises(InputError, match="choose one of auto, huge_pages, system"):
        keep_heaps({"SHARDKIT_HOST_ALLOCATOR": "keep"})


def test_the_largest_array_of_a_compiled_program():
    import jax
    import jax.numpy as jnp

    x = jnp.ones((512, 64), jnp.float32)
    text = jax.jit(lambda x: (x @ x.T).sum()).lower(x).compile().as_text()
    assert largest_array_bytes(text) == 512 * 512 * 4  # x @ x.T, larger than x
    tuple_shape = "ENTRY %main {\n  %t = (f32[10]{0}, s8[3,1000]{1,0}) parameter(0)\n}"
    assert largest_array_bytes(tuple_shape) == 3000  # each element of a tuple alone
    assert largest_array_bytes("ENTRY %main {\n  %t = () tuple()\n}") == 0


# The benchmark's GPT at half its depth on 2 devices: 105 MB of temporaries a device, made of
# arrays of at most 8 MB. Runs the trainer's program and the same step compiled as XLA does by
# default (one heap), alternately, and counts page faults and resident memory.
HEAPS = """
import json, resource
import jax, optax
import shardkit as sk
from shardkit.analysis.hlo import largest_array_bytes
sk.simulate_devices(2)
cfg = sk.models.GPTConfig(vocab=256, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, mlp_dim=1024, max_seq=128)
trainer = sk.Trainer(cfg.model(), optax.adamw(1e-3), "data=2")
batch = trainer.shard_batch(sk.TextDataset.builtin().batch(0, batch_size=16, seq_len=128))
split = trainer.compile(batch)
one_heap = trainer.lower(batch).compile(compiler_options=trainer.compiler_options)

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def run(program, steps):
    state, losses, faults, resident = trainer.init(0), [], [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        state, metrics = program(state, batch)
        losses.append(float(metrics["loss"]))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        resident.append(rss())
    return {"losses": losses, "faults": faults[2:], "resident": resident}

out = {"split": run(split, 8), "one_heap": run(one_heap, 8)}
out["temp"] = [p.memory_analysis().temp_size_in_bytes for p in (split, one_heap)]
out["largest"] = largest_array_bytes(one_heap.as_text())
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_cpu_steps_temporaries_stay_mapped_between_steps_at_the_same_size():
    env = without_tunables() | {"SHARDKIT_HOST_ALLOCATOR": "auto"}  # glibc's defaults: no huge pages
    proc = subprocess.run([sys.executable, "-c", HEAPS], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    split, one_heap = out["split"], out["one_heap"]
    temp_split, temp_one = out["temp"]
    assert temp_one > GLIBC_REUSE_LIMIT and out["largest"] <= HEAP_LIMIT  # the case the split is for
    assert abs(temp_split - temp_one) <= 0.01 * temp_one  # the same bytes, in heaps
    assert split["losses"] == one_heap["losses"]  # the same program: the same numbers, bit for bit
    # One heap: each step maps its temporaries of both devices anew, page by page.
    assert min(one_heap["faults"]) >= 0.9 * 2 * temp_one / 4096
    # Heaps: glibc keeps them (the trainer also asked it not to trim or unmap a free heap,
    # keep_heaps). Most steps fault in no page of their temporaries again; now and then XLA
    # allocates on a worker thread whose arena has not held them yet (one to three heaps).
    assert sorted(split["faults"])[len(split["faults"]) // 2] <= 0.02 * min(one_heap["faults"])
    assert sum(split["faults"]) <= 0.1 * sum(one_heap["faults"])
    # What glibc keeps is reused, not added to: resident memory grows by at most the two devices'
    # temporaries again while XLA's worker threads first allocate in arenas of their own (at
    # most 130 MB here, and flat from the fourth step on over 40 steps), then stays.
    assert split["resident"][-1] - split["resident"][2] <= 2 * temp_split


def test_a_step_holding_an_array_larger_than_a_heap_keeps_xlas_single_heap():
    import optax

    import shardkit as sk

    # The embedding's gradient and the logits of a vocabulary of 12,000: 24.6 MB arrays.
    cfg = sk.models.GPTConfig(vocab=12000, dim=512, n_layers=1, n_heads=4, n_kv_heads=4, mlp_dim=1024, max_seq=128)
    trainer = sk.Trainer(cfg.model(), optax.adamw(1e-3), "data=8")
    batch = sk.TextDataset.builtin().batch(0, batch_size=32, seq_len=128)
    lowered = trainer.lower(batch)
    one_heap = lowered.compile(compiler_options=trainer.compiler_options)
    split = lowered.compile(compiler_options={**trainer.compiler_options, HEAP_OPTION: HEAP_LIMIT})
    temp = one_heap.memory_analysis().temp_size_in_bytes
    assert largest_array_bytes(one_heap.as_text()) > HEAP_LIMIT and temp > GLIBC_REUSE_LIMIT
    # Split, each large array would get a heap of its own and share its bytes with nothing.
    assert split.memory_analysis().temp_size_in_bytes > 1.3 * temp
    assert trainer.compile(batch).memory_analysis().temp_size_in_bytes == temp
