"""What GSPMD annotations alone cannot express: explicit communication inside the step."""

import importlib
from typing import Any

_WHERE = {
    "MoE": "experts",
    "route": "experts",
    "pipeline_value_and_grad": "pipeline",
    "ring_attention": "ring_attention",
    "Schedule": "schedule",
    "make_schedule": "schedule",
}

__all__ = ["MoE", "Schedule", "make_schedule", "pipeline_value_and_grad", "ring_attention", "route"]


def __getattr__(name: str) -> Any:  # lazy (PEP 562): importing the schedules alone starts no JAX
    if name in _WHERE:
        return getattr(importlib.import_module(f"shardkit.parallel.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'shardkit.parallel' has no attribute {name!r}")
