"""Collectives a compiled step runs beyond its layout's bound, named by the user's op and said
in words: what the model or XLA did, and what would remove it.

The bound (:mod:`shardkit.analysis.report`) counts what the layout needs: Megatron's all-reduces
per layer under ``tensor``, FSDP's gathers and reduce-scatters, the data axis's gradient
reduction. What a compiled step runs beyond it comes from the model's own structure or from
XLA's partitioner; :func:`extra_collectives` recognises the three patterns measured on models
written without shardkit:

- **separate projections of one input** under ``tensor``: each projection (``attn/q`` and
  ``attn/kv``, ``mlp/gate`` and ``mlp/up``) all-reduces its own share of the input's gradient in
  the backward pass, where one fused matmul would reduce once (XLA:CPU does not re-associate
  ``all-reduce(a) + all-reduce(b)``). shardkit's step sums them before the reduction
  (:mod:`shardkit.parallel.input_gradients`) wherever each weight is a parameter split over
  ``tensor`` on its output features, so a report names them only where it could not tell;
- **an embedding gradient reduced whole** over several batch axes and then sliced to its shard;
- **collective-permutes outside a pipeline or a ring**: XLA moving an array between two
  shardings it could not convert between (its "involuntary full rematerialization").

Example:
  >>> from shardkit.analysis.report_data import CollectiveStat
  >>> stats = [CollectiveStat("all-reduce", ("tensor",), f"layers/0/attn/{p}/dot_general", "backward", 1, 2, 64, 64.0)
  ...          for p in ("q", "kv")]
  >>> extra_collectives(stats)[0].split(":")[0]
  'layers/0/attn'
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from shardkit.analysis.report_data import CollectiveStat


def extra_collectives(collectives: Iterable[CollectiveStat]) -> list[str]:
    """One sentence per pattern found beyond the layout's bound, each naming the user's ops.

    Args:
      collectives: the report's collectives.

    Returns:
      Sentences, the separate projections first (by module), then embedding gradients, then
      collective-permutes; empty when none is found.
    """
    stats = list(collectives)
    return [*_separate_projections(stats), *_embedding_gradients(stats), *_stray_permutes(stats)]


def module_path(op: str) -> str:
    """The module path of an op: its named scopes without the primitive and any einsum spec
    (``layers/0/attn/kv/BTD,CDKH->CBTKH/dot_general`` -> ``layers/0/attn/kv``)."""
    parts = op.split(" (")[0].split("/")
    return "/".join(p for p in parts[:-1] if "->" not in p and "," not in p)


_FIX = (
    "shardkit sums such gradients before reducing them only where each weight is a parameter (or its "
    "cast) split over tensor on its output features. Fix: use the parameters as they are in the "
    "projections, or fuse them (as shardkit's GPT fuses q/k/v and gate/up)."
)


def _separate_projections(stats: list[CollectiveStat]) -> list[str]:
    by_parent: dict[str, dict[str, CollectiveStat]] = collections.defaultdict(dict)
    backward = [c for c in stats if c.kind == "all-reduce" and c.axes == ("tensor",) and c.direction == "backward"]
    activation = max((c.payload_bytes for c in stats if c.axes == ("tensor",) and c.direction == "forward"), default=0)
    out = []
    for c in backward:
        if "dot_general" not in c.op:
            continue
        if " (+" in c.op and activation and c.payload_bytes >= 1.5 * activation:
            # XLA combined the projections' all-reduces into one: the same bytes, in one call.
            out.append(
                f"{c.op}: the input gradients of several projections, all-reduced together over tensor "
                f"({c.payload_bytes / activation:.1f}x a layer's activation, {c.moved_bytes / 1e6:.3f} MB, where "
                "Megatron reduces one activation): separate projections of one input. " + _FIX
            )
            continue
        path = module_path(c.op)
        if "/" in path:
            parent, projection = path.rsplit("/", 1)
            by_parent[parent][projection] = c
    for parent, projections in sorted(by_parent.items()):
        if len(projections) < 2:
            continue
        names = sorted(projections)
        moved = sum(c.moved_bytes for c in projections.values())
        out.append(
            f"{parent}: {' and '.join(names)} each all-reduce their share of the input's gradient over tensor "
            f"({len(names)} all-reduces, {moved / 1e6:.3f} MB, where Megatron reduces once): separate "
            "projections of one input. " + _FIX
        )
    return out


def _embedding_gradients(stats: list[CollectiveStat]) -> list[str]:
    return [
        f"{c.op}: an embedding table's gradient is all-reduced whole over {'+'.join(c.axes)} "
        f"({c.moved_bytes / 1e6:.3f} MB), then sliced to the table's shard: XLA's partitioning of the "
        "lookup's scatter-add (shardkit reduces it onto the shards where the lookup reads a parameter's "
        "table as it is; here it could not)."
        for c in stats
        if c.kind == "all-reduce" and "scatter-add" in c.op and len(c.axes) > 1
    ]


def _stray_permutes(stats: list[CollectiveStat]) -> list[str]:
    return [
        f"{c.op}: a collective-permute over {'+'.join(c.axes)} ({c.moved_bytes / 1e6:.3f} MB): XLA moved an "
        "array between two shardings it could not convert between (an involuntary rematerialization)."
        for c in stats
        if c.kind == "collective-permute" and not {"stage", "sequence"} & set(c.axes)
    ]
