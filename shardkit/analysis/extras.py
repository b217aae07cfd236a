"""Every byte a compiled step moves beyond its layout's bound, named by the user's op, with its
cause and the fix.

The bound (:func:`shardkit.analysis.report.lower_bound`) is a sum of terms, each the least one
kind of traffic needs: ``fsdp`` (ZeRO-3's gathers and reduce-scatters) and ``data`` (the gradients'
reduction) together the *parameters* term, ``tensor`` (Megatron's four all-reduces of a layer's
activation per layer) and ``stage`` (a pipeline's sends). :func:`beyond_the_bound` accounts
for a report's collectives against those terms:

1. each collective belongs to the term whose traffic it is (an all-gather over ``fsdp``, a
   backward reduction over ``data``/``fsdp``, an all-reduce over ``tensor``, a permute over
   ``stage``) or to none (an all-gather over ``tensor``, an activation reduced over ``fsdp`` in
   the forward pass, a collective-permute outside a pipeline or ring, an all-to-all...);
2. a collective of no term is beyond the bound, whole;
3. a term that moves more than its share of the bound has its excess named: its collectives in
   order, the least expected first (those outside the layers, smaller than a layer's activation,
   several projections' shares of one gradient), until they cover the excess.

So the named bytes are at least ``measured - bound`` (each term's excess is at most what it
names; a term below its share only makes the total smaller), whatever the model; the cause and
fix of each come from what the collective is (:func:`explain`), the patterns measured on models
written without shardkit among them:

- **separate projections of one input** under ``tensor``: each (``attn/q`` and ``attn/kv``,
  ``mlp/gate`` and ``mlp/up``) all-reduces its own share of the input's gradient, where one
  fused matmul reduces once. shardkit sums them before the reduction
  (:mod:`shardkit.parallel.input_gradients`) where each weight is a parameter split over
  ``tensor`` on its output features;
- **an embedding gradient reduced whole** over several batch axes, then sliced to its shard;
- **collective-permutes outside a pipeline or a ring**: XLA moving an array between two
  shardings it could not convert between (its "involuntary full rematerialization").

Example:
  >>> from shardkit.analysis.report_data import CollectiveStat
  >>> stats = [CollectiveStat("all-gather", ("tensor",), "layers/0/attn/q_norm/mul", "forward", 2, 2, 1000, 1e6)]
  >>> [(e.op, e.moved_bytes) for e in beyond_the_bound(stats, {"bytes_tensor": 0.0})]
  [('layers/0/attn/q_norm/mul', 1000000.0)]
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from shardkit.analysis.report_data import CollectiveStat

BATCH_AXES = frozenset({"data", "fsdp"})
# Every axis that splits the rows: a gradient may be reduced over any of them.
ROW_AXES = BATCH_AXES | {"expert"}
# A term over its share of the bound by less than this part of it is rounding (arrays padded to
# divide their axes), not traffic to name.
ROUNDING = 0.005


@dataclasses.dataclass(frozen=True)
class Excess:
    """One collective (aggregated by op) beyond the bound.

    Attributes:
      op: the user's op (module path and primitive), as the report's table names it.
      kind, axes, direction: as :class:`CollectiveStat` has them.
      moved_bytes: the bytes of it counted beyond the bound: all of it for a collective of no term;
        against a term's excess, what is left of the excess when it is named (at most all of it).
      total_bytes: all the bytes it moves.
      term: the bound's term it was set against, or ``""`` for none.
      cause: what the model or XLA did, in a sentence.
      fix: what the user can change (or why nothing needs to).
    """

    op: str
    kind: str
    axes: tuple[str, ...]
    direction: str
    moved_bytes: float
    total_bytes: float
    term: str
    cause: str
    fix: str

    def line(self) -> str:
        axes = "+".join(self.axes) or "-"
        part = "" if self.moved_bytes >= self.total_bytes else f" of its {self.total_bytes / 1e6:.3f} MB"
        return (
            f"{self.op}: {self.kind} over {axes}, {self.direction} ({self.moved_bytes / 1e6:.3f} MB{part}): "
            f"{self.cause} Fix: {self.fix}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "axes": list(self.axes), "mb": self.moved_bytes / 1e6}


def term_of(c: CollectiveStat) -> str:
    """The bound's term whose traffic ``c`` is: ``parameters``, ``tensor``, ``stage``, ``expert``,
    or ``""``."""
    axes = set(c.axes)
    if not axes:
        return ""
    if c.kind == "collective-permute":
        return "stage" if axes == {"stage"} else ""
    if c.kind == "all-reduce" and axes == {"tensor"}:
        return "tensor"
    if axes == {"expert"} and (
        c.kind in ("all-to-all", "all-gather") or (c.kind == "reduce-scatter" and c.direction == "forward")
    ):
        return "expert"  # tokens to their experts and back (a dense mixture: rows gathered, sums scattered)
    if axes <= ROW_AXES and c.kind in ("reduce-scatter", "all-reduce") and c.direction == "backward":
        return "parameters"  # gradients reduced over the axes that split the rows
    if axes <= BATCH_AXES:
        if c.kind == "all-gather" and "fsdp" in axes:
            return "parameters"  # ZeRO-3 gathers weights for the forward and again for the backward
        if c.kind in ("reduce-scatter", "all-reduce") and c.direction == "backward":
            return "parameters"  # gradients reduced over the batch axes
    return ""


def _budget(bound: Mapping[str, float], term: str) -> float:
    """Bytes the bound allows a term (``parameters``: the ``fsdp`` and ``data`` terms together)."""
    if term == "parameters":
        return bound.get("bytes_fsdp", 0.0) + bound.get("bytes_data", 0.0)
    return bound.get(f"bytes_{term}", 0.0)


def _in_a_layer(op: str) -> bool:
    """Whether the op's path goes through a numbered layer (``blocks/0/...``, ``block_1/...``) or
    a scanned layer stack (``layer/...``, ``layers/...``, or inside a loop)."""
    return bool(re.search(r"(^|/)([^/]*_)?\d+(/|$)", op) or re.search(r"(^|/)layers?/", op)) or "/while/" in op


def typical_activation(stats: Iterable[CollectiveStat]) -> int:
    """The payload most all-reduces over ``tensor`` inside the layers have: a layer's activation."""
    sizes = collections.Counter(
        c.payload_bytes for c in stats if c.kind == "all-reduce" and c.axes == ("tensor",) and _in_a_layer(c.op)
    )
    return sizes.most_common(1)[0][0] if sizes else 0


def _combined(op: str) -> int:
    """How many collectives XLA combined into the one named ``op`` (``... (+2 combined)`` -> 3)."""
    found = re.search(r"\(\+(\d+) combined\)", op)
    return 1 + int(found.group(1)) if found else 1


def _einsum_operands(op: str) -> int:
    """Operands of the einsum an op comes from (``.../btke,btkc,btk->btec/dot_general`` -> 3), 0
    for an op of no einsum."""
    found = re.search(r"(^|/)([^/]*)->[^/]*/", op)
    return found.group(2).count(",") + 1 if found else 0


def megatron_sized(c: CollectiveStat, activation: float) -> bool:
    """Whether ``c`` carries whole activations, one per collective XLA combined into it (a norm's
    few bytes combined with one aside): the size of Megatron's all-reduces."""
    if not activation:
        return False
    k = round(c.payload_bytes / activation)
    return 1 <= k <= _combined(c.op) and abs(c.payload_bytes - k * activation) <= 0.05 * activation


def _least_expected_first(members: list[CollectiveStat], term: str, activation: float) -> list[CollectiveStat]:
    """A term's collectives in the order they are named against its excess."""
    if term == "tensor":
        activation = activation or typical_activation(members)

        def expected(c: CollectiveStat) -> tuple[bool, bool]:
            # Several activations' reductions XLA combined into one inside a layer come before
            # the vocabulary's one each (which the bound counts): a residual block reduces once
            # each way, and consecutive blocks cannot be combined (each needs the other's
            # output), so such a group usually holds a reduction Megatron's count has not.
            several = _combined(c.op) > 1 and c.payload_bytes >= 1.5 * activation
            return megatron_sized(c, activation) and not several, _in_a_layer(c.op) and not several

        return sorted(members, key=lambda c: (*expected(c), -c.moved_bytes))
    # Parameters: gradients all-reduced over several axes (a parameter kept whole) first, then a
    # backward gather larger than its module's forward one (a weight gathered at another split),
    # then the rest, largest first.
    gathers = [c for c in members if c.kind == "all-gather"]
    forward = {module_path(c.op): c.payload_bytes for c in gathers if c.direction == "forward"}

    def unexpected(c: CollectiveStat) -> int:
        if c.kind == "all-reduce" and len(c.axes) >= 2:
            return 0
        if c.kind == "all-gather" and c.direction == "backward" and c.payload_bytes > forward.get(module_path(c.op), 0):
            return 1
        return 2

    return sorted(members, key=lambda c: (unexpected(c), -c.moved_bytes))


def beyond_the_bound(
    collectives: Iterable[CollectiveStat], bound: Mapping[str, float], activation: float = 0.0
) -> list[Excess]:
    """The collectives that account for what a step moves beyond its bound, largest first.

    Args:
      collectives: the report's collectives.
      bound: the report's ``lower_bound`` (its ``bytes_<term>`` entries).
      activation: the payload of one of Megatron's all-reduces (a layer's activation per
        microbatch); 0 takes the payload most all-reduces over ``tensor`` in the layers have.

    Returns:
      One :class:`Excess` per collective named, their bytes adding up to at least the measured
      bytes minus the bound.
    """
    stats = [c for c in collectives if c.moved_bytes > 0]
    by_term: dict[str, list[CollectiveStat]] = collections.defaultdict(list)
    experts = bound.get("bytes_expert", 0.0) > 0
    # An experts' op whose forward traffic over expert is no term's: its backward (which may look
    # like a gradient's reduction) is the same op's, beyond the bound too.
    expert_ops = {_op_key(c) for c in stats if experts and "expert" in c.axes and not term_of(c)}
    # A dense mixture's tokens gathered over expert forward are its sums reduce-scattered there
    # backward: the same op's, the expert term's (not a gradient's reduction, which it looks like).
    gathered = {_op_key(c) for c in stats if c.axes == ("expert",) and c.kind == "all-gather" and term_of(c)}
    tensor_experts = experts and bound.get("bytes_tensor", 0.0) > 0
    for c in stats:
        term = "" if _op_key(c) in expert_ops else term_of(c)
        if experts and c.axes == ("expert",) and c.kind == "reduce-scatter" and _op_key(c) in gathered:
            term = "expert"
        if not term and tensor_experts and c.axes == ("tensor",) and c.kind in ("all-gather", "reduce-scatter"):
            # The bound's cheaper use of tensor for small experts: their rows split over tensor,
            # the tokens' outputs and the experts' weights gathered there (their gradients
            # reduce-scattered) are what its tensor term counts.
            term = "tensor"
        by_term[term].append(c)
    named = [(c, "", c.moved_bytes) for c in by_term.pop("", [])]
    for term, members in by_term.items():
        budget = _budget(bound, term)
        excess = sum(c.moved_bytes for c in members) - budget
        if excess <= ROUNDING * budget:  # padding and odd sizes, not traffic
            continue
        for c in _least_expected_first(members, term, activation):
            if excess <= 0:
                break
            named.append((c, term, min(c.moved_bytes, excess)))  # a big collective only in part beyond
            excess -= c.moved_bytes
    projections, activation = _separate_projections(stats), activation or typical_activation(stats)
    out = [
        Excess(
            c.op,
            c.kind,
            c.axes,
            c.direction,
            beyond,
            c.moved_bytes,
            term,
            *explain(c, term, projections, activation, experts),
        )
        for c, term, beyond in named
    ]
    return sorted(out, key=lambda e: -e.moved_bytes)


def _op_key(c: CollectiveStat) -> tuple[str, str]:
    """An op's module path and primitive, whichever direction it runs in."""
    return module_path(c.op), c.op.split(" (")[0].rsplit("/", 1)[-1]


def module_path(op: str) -> str:
    """The module path of an op: its named scopes without the primitive and any einsum spec
    (``layers/0/attn/kv/BTD,CDKH->CBTKH/dot_general`` -> ``layers/0/attn/kv``)."""
    parts = op.split(" (")[0].split("/")
    return "/".join(p for p in parts[:-1] if "->" not in p and "," not in p)


_FIX_PROJECTIONS = (
    "shardkit sums such gradients before reducing them where each weight is a parameter (or its cast) split over "
    "tensor on its output features; use the parameters as they are in the projections, or fuse them (as "
    "shardkit's GPT fuses q/k/v and gate/up)."
)


def _separate_projections(stats: list[CollectiveStat]) -> set[str]:
    """Ops that are one of several projections of one input all-reducing their input gradient."""
    by_parent: dict[str, list[str]] = collections.defaultdict(list)
    for c in stats:
        if c.kind == "all-reduce" and c.axes == ("tensor",) and c.direction == "backward" and "dot_general" in c.op:
            path = module_path(c.op)
            if "/" in path:
                by_parent[path.rsplit("/", 1)[0]].append(c.op)
    return {op for ops in by_parent.values() if len(ops) >= 2 for op in ops}


FIX_EXPERTS = (
    "write the experts as a matmul of the routed tokens with the stacked weights (an einsum whose experts "
    "dimension is a batch dimension, as GShard's dispatch), name the weights' dimension 'experts', or call "
    "sk.parallel.moe_layer(..., dispatch='sorted'), which sorts each device's tokens by expert, sends them to "
    "their experts and runs grouped matmuls (jax.lax.ragged_dot) under any layout."
)


def _explain_expert(c: CollectiveStat) -> tuple[str, str]:
    """``(cause, fix)`` of traffic over ``expert`` beyond the experts' dispatch and combine."""
    if c.kind == "all-gather" and c.payload_bytes and "dot_general" in c.op:
        return (
            "expert weights (or tokens) gathered over expert for an experts' matmul: XLA moved the weights to "
            "the tokens (ZeRO-3 over the experts) where expert parallelism moves the tokens.",
            FIX_EXPERTS,
        )
    primitive = _op_key(c)[1]
    if c.kind == "all-reduce" and primitive == "dot_general" and set(c.axes) == {"expert"}:
        return (
            "an experts' matmul XLA could not split by experts (a grouped jax.lax.ragged_dot, a loop over "
            "experts): every device multiplies every row by its own experts and the outputs are summed over expert.",
            FIX_EXPERTS,
        )
    if primitive in ("sort", "gather", "scatter", "scatter-add", "argsort") and c.direction in ("forward", "backward"):
        return (
            f"tokens sorted or permuted over the whole batch (a {primitive} across rows split over "
            f"{'+'.join(c.axes)}): every device's rows are gathered to order them.",
            "sort each device's tokens by expert within its own rows, or call "
            "sk.parallel.moe_layer(..., dispatch='sorted'), which does so in a shard_map.",
        )
    if c.kind == "all-to-all":
        return (
            "more tokens moved to and from their experts than the routed tokens: buffers padded beyond top_k x "
            "the capacity factor (a dropless einsum pads every expert to every token; a dropless sorted "
            "dispatch sends each expert device room for the most a device's tokens can route there, n x "
            "min(top_k, E/n) rows a token, as static shapes need), or buffers exchanged more than once each way.",
            "route with a capacity factor (1.25 is usual; sk.parallel.moe_layer(..., capacity_factor=1.25, "
            "dispatch='sorted') drops what GShard drops and moves top_k x 1.25 rows a token); dropless, a "
            "smaller expert axis sends fewer padded rows.",
        )
    return (
        f"a {c.kind} over expert the experts' dispatch and combine do not need: an array whose experts "
        "dimension is split is gathered or reduced for an op that reads it whole.",
        FIX_EXPERTS,
    )


def explain(
    c: CollectiveStat,
    term: str,
    projections: frozenset[str] | set[str] = frozenset(),
    activation: float = 0.0,
    experts: bool = False,
) -> tuple[str, str]:
    """``(cause, fix)`` of one collective beyond the bound, from what it is (``activation``: a
    layer's activation, the payload of Megatron's all-reduces; ``experts``: the bound has an
    experts' dispatch, so traffic over ``expert`` is the experts')."""
    axes = "+".join(c.axes)
    batch_only = set(c.axes) <= BATCH_AXES
    if c.kind == "collective-permute" and experts and "expert" in c.axes:  # an expert's slice sent to others
        return _explain_expert(c)
    if c.kind == "collective-permute" and not {"stage", "sequence"} & set(c.axes):
        return (
            "XLA moved an array between two shardings it could not convert between (an involuntary "
            "rematerialization), here at a lookup or reshape whose operands are split differently.",
            "give the operands one split (name the table's and the ids' axes alike), or sk.constrain the op's output.",
        )
    if c.kind == "all-reduce" and "scatter-add" in c.op and len(c.axes) > 1:
        return (
            "an embedding table's gradient is all-reduced whole, then sliced to the table's shard: XLA's partitioning "
            "of the lookup's scatter-add.",
            "read the table as a parameter, as it is (shardkit then reduces it onto its shards).",
        )
    if c.op in projections:
        return (
            "separate projections of one input each all-reduce their share of the input's gradient over tensor, "
            "where one fused matmul reduces once.",
            _FIX_PROJECTIONS,
        )
    if (
        term == "expert"
        or (c.kind == "all-to-all" and "expert" in c.axes)
        or (experts and "expert" in c.axes and not term)
    ):
        return _explain_expert(c)
    if c.kind == "all-gather" and not batch_only:
        return (
            f"an array split over {axes} is gathered whole for this op: the op (a reshape, an einsum, a norm or a "
            "lookup) or a constraint needs it whole, or a parameter is split one way and used another (a tied "
            "embedding: a lookup and a head).",
            "split the op's operands as the op uses them (the heads of a reshape evenly, a tied table once), "
            "or leave the activation's non-batch dimensions to the partitioner (sk.constrain only the batch).",
        )
    if c.kind == "all-gather" and term == "parameters":
        return (
            f"a weight gathered over {axes} beyond ZeRO's one gather per pass: in the backward pass at another "
            "split than the forward's (more bytes: the gradient's matmul wants it split another way), or once "
            "more (a regather, or a weight read by two ops).",
            "name the weight's axes as its matmuls use it, fuse projections gathered together, or recompute "
            "less (a remat policy that saves the gathered weights).",
        )
    if c.kind == "all-gather" and c.op.split(" (")[0].endswith("/top_k"):
        return (
            f"jax.lax.top_k becomes XLA's TopK custom call, which the partitioner does not split by rows: its "
            f"operand is gathered whole over {axes}.",
            "take the top k by a stable sort, which stays split by rows: shardkit.parallel.top_k_by_rows(x, k) "
            "(jnp.argsort(-x, axis=-1, stable=True)[..., :k]).",
        )
    if c.kind == "all-gather":
        return (
            f"an array split over {axes} (the batch: token ids or activations) is gathered whole for this op, "
            "so each device of the group holds every row.",
            "sk.constrain the op's operands to the batch split; for a lookup, split the table and the ids as "
            "the rules say.",
        )
    if c.kind == "all-reduce" and batch_only and c.payload_bytes <= 64:
        return (
            f"a few numbers reduced over {axes}: a statistic of the whole batch (the step's loss and its count "
            "of scored tokens, or a maximum over every row), each device having reduced its own rows.",
            "none needed: a few bytes a step, as every data-parallel step reduces its loss.",
        )
    if c.kind in ("all-reduce", "reduce-scatter") and batch_only and c.direction == "forward":
        return (
            f"an activation is reduced over {axes} in the forward pass: a parameter's split over a batch axis reached "
            "the activations (ZeRO-3 turned into tensor parallelism), or a statistic over the batch (BatchNorm).",
            "keep from_nnx/from_linen's boundaries on, or sk.constrain the activation's batch dimension; "
            "a batch statistic is expected.",
        )
    if term == "parameters" and experts and "expert" in c.axes and c.kind == "all-reduce":
        return (
            f"gradients all-reduced over {axes} beyond the bound, in a mixture of experts: an expert's weight used "
            "on every device (a loop over the experts' slices, w[e] for each e, or a weight gathered over expert) "
            "has its gradient computed everywhere and summed over expert, where each expert's gradient is its own "
            "group's rows.",
            FIX_EXPERTS,
        )
    if term == "parameters":
        return (
            f"gradients reduced over {axes} beyond ZeRO's reduce-scatter of every parameter: parameters kept whole "
            "(below fsdp_min_size, or not split over tensor) are all-reduced, twice a reduce-scatter's bytes.",
            "sk.Trainer(..., fsdp_min_size=0) splits small parameters too; name the tensor axes of parameters "
            "that should be split.",
        )
    if term == "tensor" and not _in_a_layer(c.op):
        return (
            "an all-reduce over tensor outside the layers: the head, the embedding or the loss reduces over a "
            "vocabulary split over tensor (the bound counts one for an embedding and one for a head).",
            "expected with the vocabulary split over tensor; keep 'vocab' whole (the rules) to trade it for memory.",
        )
    operands = _einsum_operands(c.op)
    if term == "tensor" and c.kind == "all-reduce" and operands >= 3:
        return (
            f"an einsum of {operands} operands, contracted pairwise: the pair contracted first sums a dimension "
            "split over tensor, so its intermediate is all-reduced where the whole product needs a smaller "
            "reduction.",
            "write it as two einsums so the dimension split over tensor is contracted last, at the smallest "
            "array (fold a per-token factor such as gates into one operand first).",
        )
    if term == "tensor" and megatron_sized(c, activation) and _combined(c.op) > 1:
        return (
            f"{_combined(c.op)} all-reduces over tensor XLA combined into one, of whole activations: more than "
            "Megatron's two forward and two backward in this layer (a norm, a softmax or a separate projection "
            "reduces a dimension split over tensor).",
            "split heads and MLP units only (not the model dimension), and fuse projections of one input.",
        )
    if term == "tensor" and activation and c.payload_bytes > 1.5 * activation:
        return (
            f"an all-reduce over tensor of {c.payload_bytes / activation:.1f}x a layer's activation: the reduction "
            "comes before an op that shrinks the array (an experts' combine, a pooling, a gather), which XLA does "
            "not reorder.",
            "contract the split dimension after the shrinking op (combine the experts' hidden units first, then "
            "project), or split experts over an expert axis rather than their units over tensor.",
        )
    if term == "tensor":
        return (
            "more all-reduces over tensor in this layer than Megatron's two forward and two backward: a norm, a "
            "softmax or a projection reduces a dimension split over tensor.",
            "split heads and MLP units only (not the model dimension), and fuse projections of one input.",
        )
    if c.kind == "all-to-all":
        return (
            f"an all-to-all over {axes}: XLA changed which dimension is split (experts dispatched, or a reshape "
            "of a split dimension).",
            "expected of expert parallelism; elsewhere, split the reshaped dimension evenly.",
        )
    return (
        f"XLA's partitioner inserted it over {axes}; no pattern shardkit knows.",
        "sk.constrain the op's output to the sharding you want.",
    )
