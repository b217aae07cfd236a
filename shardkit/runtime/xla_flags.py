"""The XLA flags that let a GPU overlap collectives with compute: the one place shardkit sets
them. On a GPU, XLA runs collectives asynchronously (``all-gather-start`` ... ``-done`` pairs
in the compiled program) and its latency-hiding scheduler moves the starts early and the dones
late, so that FSDP's parameter gathers and the gradients' reduce-scatters run under the layers'
matmuls; combining small collectives into large ones and pipelining them across loop iterations
(a scanned layer stack) gives the scheduler room to do so. These are the flags MaxText and
Levanter set for GPU training.

The CPU backend ignores every ``xla_gpu_*`` flag and runs collectives synchronously, so the
CPU-compiled programs of the tests have no start/done pairs; :attr:`shardkit.analysis.hlo.Collective.asynchronous`
reads them where a backend emits them.

On the CPU backend a few options are chosen per program instead (:func:`step_compiler_options`),
each so that the CPU-compiled step holds what a GPU's would, which is what a dry run predicts:
XLA:CPU's default scheduler orders a program for concurrency, which issues every FSDP parameter
all-gather at the start of the step (they depend only on the parameters), so every layer's
gathered weights are alive at once, and works out every parameter's update at once; its
memory-minimizing scheduler gathers each layer where it is used. Scanned layer stacks keep the
default, as their loop takes one layer at a time anyway.

Example:
  >>> with_overlap_flags("--xla_gpu_enable_latency_hiding_scheduler=false").split()[0]
  '--xla_gpu_enable_latency_hiding_scheduler=false'
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

_COMBINE_BYTES = str(128 * 2**20)  # gather and reduce up to 128 MiB at once (a layer of a 7B model)

OVERLAP_FLAGS: dict[str, str] = {
    # Schedule collectives by their cost model: starts early, dones late, under compute.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Collectives on their own high-priority stream, so compute does not delay them.
    "xla_gpu_enable_highest_priority_async_stream": "true",
    # One large collective instead of many small ones (per-layer parameters are small).
    "xla_gpu_all_gather_combine_threshold_bytes": _COMBINE_BYTES,
    "xla_gpu_all_reduce_combine_threshold_bytes": _COMBINE_BYTES,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": _COMBINE_BYTES,
    # Inside a scanned layer stack: gather the next layer's parameters (and scatter the previous
    # layer's gradients) while this layer computes.
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
}


def with_overlap_flags(xla_flags: str) -> str:
    """``xla_flags`` with each of :data:`OVERLAP_FLAGS` the user has not set already appended
    (a flag the user set keeps the user's value)."""
    given = {part.lstrip("-").split("=", 1)[0] for part in xla_flags.split()}
    extra = [f"--{name}={value}" for name, value in OVERLAP_FLAGS.items() if name not in given]
    return " ".join([*xla_flags.split(), *extra])


def use_overlap_flags(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Put :data:`OVERLAP_FLAGS` into ``XLA_FLAGS`` before JAX starts its backend (XLA reads the
    variable once). Returns False, changing nothing, when the backend has already started.

    ``shardkit train`` and ``shardkit launch`` call it; a script of your own calls it first thing,
    before any JAX array exists.
    """
    import sys

    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if xla_bridge is not None and xla_bridge.backends_are_initialized():
        return False
    environ["XLA_FLAGS"] = with_overlap_flags(environ.get("XLA_FLAGS", ""))
    return True


# XLA:CPU orders a program for concurrency by default (a breadth-first schedule); this option asks
# for its memory-minimizing scheduler instead. (As a per-compile option only the scheduler type
# takes effect; xla_cpu_enable_concurrency_optimized_scheduler=false does only in XLA_FLAGS.)
CPU_MEMORY_SCHEDULER: dict[str, str | bool] = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


# A dry run compiles a step it never runs: only the CPU backend's buffers and collectives are read,
# which come from the HLO passes and buffer assignment, before code generation; LLVM's
# optimization of the generated code is a fifth of a 70B step's compile and changes neither
# (tests/test_report.py compares the two compiles' reports).
DRY_RUN_OPTIONS: dict[str, str | bool | int] = {"xla_backend_optimization_level": 0}

# XLA:CPU has no bf16 matmuls or slices: a pass converts each bf16 operation to f32, so a scanned
# layer stack reads each layer's weights as dynamic-slice(convert(stacked weights)), and
# while-loop-invariant code motion then converts the whole stack to f32 once, before the loop:
# 4 bytes a parameter that a GPU (which slices and multiplies in bf16) never holds. Without that
# pass the conversion stays per layer, inside the loop.
CPU_NO_HOISTING = "while-loop-invariant-code-motion"
# XLA:CPU combines all of a program's all-reduces that do not depend on each other into one. A
# step of unstacked layers that reduces its gradients to shards (FSDP, ZeRO-2: a reduce-scatter,
# on the CPU an all-reduce and a slice) would then hold every whole gradient at once; a GPU
# reduce-scatters them in buckets of at most its combine threshold (OVERLAP_FLAGS). A scanned
# stack reduces each layer's gradients inside its loop, one layer at a time, either way.
CPU_NO_COMBINING = "cpu-all-reduce-combiner"


def step_compiler_options(
    platform: str, loops_over_layers: bool = False, half_compute: bool = False, splits_gradients: bool = False
) -> dict[str, str | bool]:
    """Compiler options for one train step, on the CPU only: the memory-minimizing scheduler
    unless the step runs its layers in a loop over stacked parameters (``loops_over_layers``,
    :attr:`shardkit.Trainer.loops_over_layers`; :data:`CPU_MEMORY_SCHEDULER`); for such a loop
    computed in a 16-bit float (``half_compute``), no loop-invariant code motion
    (:data:`CPU_NO_HOISTING`); and when the gradients of layers that are not looped over are
    reduced to shards over the batch's axes (``splits_gradients``), no combining of all-reduces
    (:data:`CPU_NO_COMBINING`).

    A scanned layer stack gathers one layer per loop iteration under either schedule, and the
    default keeps its dry runs' memory an exact fit across device counts
    (:mod:`shardkit.analysis.extrapolate`), so it keeps the default.

    Measured on the Gemma-style NNX model of ``examples/byo_models.py`` (4 layers, width 256):
    under ``fsdp=8`` temporary memory 58.83 MB with the default schedule, 54.86 MB with this
    one (a layer's gathered weights are 3.8 MB); under ``data=8``, with the step's guard against
    non-finite updates, 74.4 MB against 49.6 MB, and 8% faster (504 against 464 ms a step).

    Measured on a scanned GPT (4 layers, width 512, bf16-master): without the hoisting,
    temporary memory per parameter went from 8.46 to 3.69 bytes under ZeRO-2 (``data=8``) and
    from 5.02 to 3.56 under ``fsdp=8``, and the step ran 4-19% faster.

    Measured on the Gemma-style model (ZeRO-2 over ``data=8``, 4 microbatches): temporary memory
    29.5 MB with combined all-reduces, 14.2 MB without, at the same step time.

    Example:
      >>> step_compiler_options("cpu")
      {'xla_cpu_scheduler_type': 'CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED'}
      >>> step_compiler_options("gpu")
      {}
      >>> step_compiler_options("cpu", loops_over_layers=True)
      {}
      >>> step_compiler_options("cpu", loops_over_layers=True, half_compute=True)
      {'xla_disable_hlo_passes': 'while-loop-invariant-code-motion'}
    """
    if platform != "cpu":
        return {}
    options: dict[str, str | bool] = {} if loops_over_layers else dict(CPU_MEMORY_SCHEDULER)
    disabled = [CPU_NO_HOISTING] * (loops_over_layers and half_compute)
    disabled += [CPU_NO_COMBINING] * (splits_gradients and not loops_over_layers)
    if disabled:
        options["xla_disable_hlo_passes"] = ",".join(disabled)
    return options
