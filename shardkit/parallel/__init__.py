"""What GSPMD annotations alone cannot express: explicit communication inside the step (experts'
all-to-alls, the pipeline and its schedules, ring attention), and the blocked attention kernel
ring attention runs on each device.

May import: ``core``, ``runtime``.
"""

from shardkit._lazy import install

_WHERE = {
    "attention": "attention",
    "attention_with_lse": "attention",
    "ExpertLoad": "experts",
    "MoE": "experts",
    "Router": "experts",
    "Routing": "experts",
    "balance_bias": "experts",
    "load_apart": "experts",
    "moe_layer": "experts",
    "route": "experts",
    "route_tokens": "experts",
    "top_k_by_rows": "experts",
    "pipeline_value_and_grad": "pipeline",
    "ring_attention": "ring_attention",
    "Schedule": "schedule",
    "make_schedule": "schedule",
}

__all__ = [
    "ExpertLoad",
    "MoE",
    "Router",
    "Routing",
    "Schedule",
    "attention",
    "attention_with_lse",
    "balance_bias",
    "load_apart",
    "make_schedule",
    "moe_layer",
    "pipeline_value_and_grad",
    "ring_attention",
    "route",
    "route_tokens",
    "top_k_by_rows",
]

# Lazy (PEP 562): importing the schedules alone starts no JAX.
__getattr__, __dir__ = install(__name__, _WHERE, ("attention", "experts", "pipeline", "schedule"))
