"""What GSPMD annotations alone cannot express: explicit communication inside the step."""

from shardkit.parallel.experts import MoE, route
from shardkit.parallel.pipeline import pipeline_value_and_grad
from shardkit.parallel.ring_attention import ring_attention
from shardkit.parallel.schedule import Schedule, make_schedule

__all__ = ["MoE", "Schedule", "make_schedule", "pipeline_value_and_grad", "ring_attention", "route"]
