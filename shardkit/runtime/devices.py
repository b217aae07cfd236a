"""Simulated CPU devices: N devices on one host, so any layout runs on a laptop.

JAX fixes its device list when the backend first starts, so the count must be chosen before the
first array is created. ``simulate_devices`` sets it through JAX's own option
(``jax_num_cpu_devices``) and refuses, with the fix spelled out, when it is already too late.
"""

from __future__ import annotations

import os

import jax
from jax._src import xla_bridge  # backends_are_initialized has no public alias in jax 0.10

from shardkit.core.errors import LayoutError

TOO_LATE = """\
simulate_devices({n}) was called after JAX had started with {have} {platform} device(s).
The device count is fixed when JAX's backend starts (the first array, jax.devices(), ...).
Fix: call it first thing, before any JAX computation:

    import shardkit as sk
    sk.simulate_devices({n})      # first line after the imports
    ...

In a notebook, restart the kernel and run that cell first; in a shell, you can instead set
    XLA_FLAGS=--xla_force_host_platform_device_count={n} JAX_PLATFORMS=cpu
"""


def ask_for_cpu_devices(n: int) -> None:
    """Ask JAX's CPU backend for ``n`` devices without choosing the platform: a GPU or TPU, if
    present, is still JAX's default (only the CPU backend reads this option). A device count
    the user set in ``XLA_FLAGS`` is left alone."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", n)


def simulate_devices(n: int, *, if_no_accelerator: bool = False) -> list[jax.Device]:
    """Make JAX run on ``n`` simulated CPU devices (all on this host).

    Call before anything else touches JAX. Calling again with the same ``n`` is harmless.

    Args:
      n: number of devices to simulate, >= 1.
      if_no_accelerator: use the GPUs or TPUs instead when this machine has them, so one script
        runs unchanged on a laptop and on a GPU server.

    Returns:
      The ``n`` CPU devices (or, with ``if_no_accelerator``, the accelerators where present).

    Raises:
      ShardkitError: if ``n`` is not a positive integer, or JAX already started with another
        device count or platform.

    Example:
      >>> import shardkit as sk
      >>> len(sk.simulate_devices(8))
      8
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise LayoutError(f"simulate_devices(n) needs a positive integer, got {n!r}.")
    if xla_bridge.backends_are_initialized():
        devices = jax.devices()
        if (devices[0].platform == "cpu" and len(devices) == n) or (if_no_accelerator and devices[0].platform != "cpu"):
            return devices
        raise LayoutError(TOO_LATE.format(n=n, have=len(devices), platform=devices[0].platform))
    if if_no_accelerator:
        ask_for_cpu_devices(n)
        return jax.devices()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
    return jax.devices()
