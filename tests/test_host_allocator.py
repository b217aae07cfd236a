"""Huge pages for CPU steps' host buffers (shardkit.runtime.host_allocator), counted in page faults.

glibc reads its tunables when a process starts, so each case that computes runs in a fresh one.
"""

import json
import os
import subprocess
import sys

import pytest

from shardkit.core.errors import InputError
from shardkit.runtime.host_allocator import TUNABLE, huge_pages_on_request, jax_is_cpu_only, with_huge_pages

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
    proc = subprocess.run(["shardkit", "dryrun", "--help"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "choose one of auto, huge_pages, system" in proc.stderr
    assert "Traceback" not in proc.stderr
