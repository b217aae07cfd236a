"""Hardware profiles: what one accelerator computes, holds and moves, and how devices are grouped.

Figures are per device, bandwidths one direction. Built-in profiles use the vendors' published
dense peak numbers; ``Hardware.from_file`` reads a JSON file with the
same fields for anything else.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from shardkit.core.errors import InputError


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator kind.

    Attributes:
      name: short name (``h100``).
      flops: peak FLOP/s per dtype name (``bfloat16``, ``float32``), dense.
      memory_bytes: device memory.
      memory_bandwidth: device memory bandwidth, bytes/s.
      intra_node_bandwidth: bytes/s per device, one direction, to devices of the same node
        (NVLink, or ICI within a TPU slice).
      inter_node_bandwidth: bytes/s per device, one direction, to other nodes (InfiniBand, DCN).
      devices_per_node: devices that share the fast network.
    """

    name: str
    flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise InputError(f"Hardware {self.name} has no FLOP/s figure for {dtype}; known: {sorted(self.flops)}.")
        return self.flops[dtype]

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> Hardware:
        """Read a profile from JSON with this class's fields (``flops`` a dict of dtype -> FLOP/s)."""
        p = pathlib.Path(path)
        if not p.is_file():
            raise InputError(f"Hardware file {p} does not exist; give a JSON file or one of {', '.join(PROFILES)}.")
        try:
            data: dict[str, Any] = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"Hardware file {p} is not valid JSON ({e}).") from e
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data) - {"name"})
        if missing:
            raise InputError(f"Hardware file {p} lacks {missing}; every field of shardkit.Hardware is needed.")
        unknown = sorted(set(data) - fields)
        if unknown:
            raise InputError(f"Hardware file {p} has unknown fields {unknown}; expected {sorted(fields)}.")
        return cls(**{"name": p.stem, **data})


GB = 1e9
# The device dryrun and plan assume when none is named, and --layout auto on simulated CPU devices.
DEFAULT_HARDWARE = "h100"
PROFILES: dict[str, Hardware] = {
    # NVIDIA: 8 GPUs per node on NVLink 4 (450 GB/s per GPU per direction), one 400 Gb/s NDR
    # InfiniBand port per GPU between nodes (50 GB/s).
    "h100": Hardware("h100", {"bfloat16": 989e12, "float32": 67e12}, 80 * GB, 3.35e12, 450 * GB, 50 * GB, 8),
    "h200": Hardware("h200", {"bfloat16": 989e12, "float32": 67e12}, 141 * GB, 4.8e12, 450 * GB, 50 * GB, 8),
    # A100 SXM 80 GB: NVLink 3 (300 GB/s), HDR InfiniBand 200 Gb/s per GPU (25 GB/s).
    "a100": Hardware("a100", {"bfloat16": 312e12, "float32": 19.5e12}, 80 * GB, 2.0e12, 300 * GB, 25 * GB, 8),
    # TPU v5p: 459 TFLOP/s, 96 GB, 2.8 TB/s, ICI 90 GB/s per link one way; a pod slice of up to
    # 8960 chips shares ICI; DCN between slices assumed 6.25 GB/s per chip.
    "tpu-v5p": Hardware(
        "tpu-v5p", {"bfloat16": 459e12, "float32": 459e12 / 2}, 96 * GB, 2.8e12, 90 * GB, 6.25 * GB, 8960
    ),
    # TPU v5e: 197 TFLOP/s, 16 GB, 819 GB/s, ICI 45 GB/s per link one way, 256 chips per pod.
    "tpu-v5e": Hardware(
        "tpu-v5e", {"bfloat16": 197e12, "float32": 197e12 / 2}, 16 * GB, 819e9, 45 * GB, 6.25 * GB, 256
    ),
}


def get_hardware(name_or_path: str | Hardware) -> Hardware:
    """A built-in profile by name, or a JSON file's profile."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if name_or_path.endswith(".json") or pathlib.Path(name_or_path).exists():
        return Hardware.from_file(name_or_path)
    raise InputError(f"Unknown hardware {name_or_path!r}: use one of {', '.join(PROFILES)} or a JSON file path.")


def profile_of_device(device_kind: str) -> Hardware | None:
    """The built-in profile of a device by JAX's ``device_kind`` (``"NVIDIA H100 80GB HBM3"``,
    ``"TPU v5p"``), or None for a device with no published peak (a CPU).

    Example:
      >>> profile_of_device("NVIDIA H100 80GB HBM3").name, profile_of_device("cpu")
      ('h100', None)
    """
    kind = device_kind.lower().replace(" ", "-").replace("tpu-v5-lite", "tpu-v5e")  # JAX's name for v5e
    return next((PROFILES[name] for name in ("h200", "h100", "a100", "tpu-v5p", "tpu-v5e") if name in kind), None)
