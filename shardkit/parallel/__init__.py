"""What GSPMD annotations alone cannot express: explicit communication inside the step."""

from shardkit.parallel.experts import MoE, route
from shardkit.parallel.ring_attention import ring_attention

__all__ = ["MoE", "ring_attention", "route"]
