"""Mixture of experts: top-k routing, capacity with token dropping, load-balancing loss.

GShard-style dispatch: each sequence is a routing group; a one-hot dispatch tensor puts every
kept token into a slot of its experts' buffers, ``einsum`` gathers the buffers, the experts run,
and a weighted combine brings the outputs back. Each device dispatches its own rows in the
experts' island (:func:`shardkit.parallel.sorted_experts.experts_island`, shared with the
sorted dispatch): one all-to-all over ``expert`` takes the buffers to their experts' devices
and one brings them back, and under ``tensor`` the island chooses the cheaper use of it.
Routing depends on each sequence alone, so every layout routes (and drops) exactly the same
tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.core.errors import InputError, ModelError
from shardkit.core.partition import logical
from shardkit.parallel.sorted_experts import (
    Weights,
    einsum_split,
    experts_island,
    once_over,
    row_capacity,
    sorted_experts,
)

# How a layer's tokens reach its experts: GShard's one-hot einsums, or sorted rows and grouped matmuls.
DISPATCHES = ("einsum", "sorted")


def top_k_by_rows(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last dimension (the same values and indices, ties to the lower
    index), in a form whose rows stay where they are split.

    XLA turns ``lax.top_k`` into a ``TopK`` custom call that the SPMD partitioner does not split:
    a (B, T, E) router output split over ``data`` is gathered whole on every device (measured,
    jax 0.10.2: one all-gather per layer). A stable sort of the last dimension is split by rows.

    Args:
      x: ``(..., N)`` values.
      k: how many of the largest to keep, ``1 <= k <= N``.

    Returns:
      ``(values (..., k), indices (..., k))``, largest first.

    Example:
      >>> values, indices = top_k_by_rows(jnp.array([[1.0, 3.0, 3.0, 2.0]]), 2)
      >>> values.tolist(), indices.tolist()
      ([[3.0, 3.0]], [[1, 2]])
    """
    indices = jnp.argsort(-x, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(x, indices, axis=-1), indices


class Routing(NamedTuple):
    """Where a batch's tokens went, as :func:`route_tokens` decided.

    Attributes:
      dispatch: ``(G, S, E, C)`` in {0, 1}: token ``s`` of group ``g`` in slot ``c`` of expert ``e``
        (None where the tokens were dispatched sorted).
      combine: ``(G, S, E, C)``: the gate weight of each kept assignment (likewise).
      aux_loss: the load-balancing loss (Switch/GShard form: ``E * sum_e f_e * P_e`` of the
        first choices' fractions and the mean router probabilities, 1.0 when balanced).
      tokens_per_expert: ``(E,)`` (token, choice) pairs routed to each expert, kept or not.
      dropped: ``()`` the fraction of (token, choice) pairs that found their expert full.
    """

    dispatch: jax.Array | None
    combine: jax.Array | None
    aux_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array


class ExpertLoad(NamedTuple):
    """A mixture-of-experts model's auxiliary output: its load-balancing loss and where its
    tokens went, per layer (what a step's metrics report: ``expert_tokens_min``/``_max``, the
    (token, choice) pairs the least and the most loaded expert got, and ``dropped_fraction``).

    Attributes:
      loss: ``()`` the weighted load-balancing loss (added to the model's loss).
      tokens: ``(L, E)`` (token, choice) pairs routed to each expert of each layer.
      dropped: ``(L,)`` pairs that found their expert full.
      pairs: ``(L,)`` pairs routed (tokens x top_k).
    """

    loss: jax.Array
    tokens: jax.Array
    dropped: jax.Array
    pairs: jax.Array


def load_apart(outputs: Any) -> tuple[Any, dict[str, jax.Array]]:
    """A model's outputs with a mixture of experts' :class:`ExpertLoad`
    replaced by its loss (what a loss adds), and the load as sums over layers (empty for others)."""
    if isinstance(outputs, tuple) and len(outputs) == 2 and isinstance(outputs[1], ExpertLoad):
        load = outputs[1]
        sums = {"expert_tokens": load.tokens, "expert_dropped": load.dropped.sum(), "expert_pairs": load.pairs.sum()}
        return (outputs[0], load.loss), sums
    return outputs, {}


def route_tokens(
    logits: jax.Array,
    top_k: int,
    capacity: int,
    score: str = "softmax",
    bias: jax.Array | None = None,
    *,
    normalize: bool = True,
    scale: float = 1.0,
    groups: tuple[int, int] = (1, 1),
) -> Routing:
    """Top-k routing with a per-expert capacity, first choices first (later tokens are dropped).

    Args:
      logits: router logits ``(G, S, E)`` for ``G`` groups of ``S`` tokens.
      top_k: experts per token.
      capacity: slots per expert and group.
      score: ``"softmax"`` (Mixtral, GShard, Qwen3-MoE, gpt-oss) or ``"sigmoid"`` (DeepSeek-V3)
        of the logits.
      bias: ``(E,)`` added to the scores to choose the experts, not to weigh them: DeepSeek-V3's
        auxiliary-loss-free balancing (:func:`balance_bias` updates it from the load).
      normalize: the chosen experts' scores rescaled to sum to 1 (else the scores as they are:
        Qwen3-MoE's ``norm_topk_prob=false``).
      scale: the weights multiplied by it (DeepSeek-V3's ``routed_scaling_factor``).
      groups: ``(n_group, topk_group)``: the experts split into ``n_group`` equal groups, each
        scored by the sum of its two best, and a token chooses among the ``topk_group`` best
        groups' experts only (DeepSeek-V3's group-limited routing; ``(1, 1)``: no limit).

    Returns:
      A :class:`Routing`; the chosen experts' (normalised, scaled) scores weigh their outputs.

    Example:
      >>> r = route_tokens(jnp.array([[[5.0, -5.0, 3.0, 3.0]]]), 1, 1, "sigmoid", groups=(2, 1))
      >>> r.dispatch[0, 0, :, 0].tolist()  # expert 0 scores most, but its group {0, 1} sums less than {2, 3}
      [0.0, 0.0, 1.0, 0.0]
    """
    experts, gates, probs = choose_experts(logits, top_k, score, bias, normalize=normalize, scale=scale, groups=groups)
    return _slotted(experts, gates, probs, capacity)


def _slotted(experts: jax.Array, gates: jax.Array, probs: jax.Array, capacity: int) -> Routing:
    """The :class:`Routing` of a choice ``experts (G, S, k)`` with ``capacity`` slots per expert and group."""
    g, s, top_k = experts.shape
    dispatch, combine, kept = _slot_masks(experts, gates, probs.shape[-1], capacity)
    dropped = 1.0 - kept / (g * s * top_k)
    return Routing(dispatch, combine, *_load(experts, probs), dropped)


def _slot_masks(
    experts: jax.Array, gates: jax.Array, n_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dispatch, combine (G, S, E, C), kept ())``: the one-hot slots of a choice
    ``experts (G, S, k)`` weighted by ``gates`` (for the combine), and the pairs that found one."""
    one_slot, kept = _choice_slots(experts, n_experts, capacity)
    dispatch = one_slot.sum(axis=2)  # (G, S, E, C)
    combine = (one_slot * gates[..., None, None]).sum(axis=2)  # (G, S, E, C)
    return dispatch, combine, kept


def _choice_slots(experts: jax.Array, n_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """``(one_slot (G, S, k, E, C), kept ())``: each (token, choice) pair's one-hot slot among
    its expert's ``capacity`` (all zeros where it found none), and how many found one."""
    g, s, top_k = experts.shape
    choice = jax.nn.one_hot(experts, n_experts, dtype=jnp.int32)  # (G, S, k, E)
    # Slots are filled by all first choices (in token order), then all second choices, ...
    order = choice.transpose(0, 2, 1, 3).reshape(g, top_k * s, n_experts)
    slot = (jnp.cumsum(order, axis=1) - 1).reshape(g, top_k, s, n_experts).transpose(0, 2, 1, 3)  # (G, S, k, E)
    kept = choice * (slot < capacity)
    one_slot = jax.nn.one_hot(jnp.where(kept > 0, slot, -1), capacity, dtype=jnp.float32)  # (G, S, k, E, C)
    return one_slot, kept.sum()


def choose_experts(
    logits: jax.Array,
    top_k: int,
    score: str = "softmax",
    bias: jax.Array | None = None,
    *,
    normalize: bool = True,
    scale: float = 1.0,
    groups: tuple[int, int] = (1, 1),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each token's top-k experts and their gates, with no capacity (:func:`route_tokens`'s choice).

    Args:
      logits: router logits ``(..., E)``.
      top_k, score, bias, normalize, scale, groups: as :func:`route_tokens` takes them.

    Returns:
      ``(experts (..., k) int, gates (..., k), probs (..., E))``: the chosen experts, best first,
      the weights of their outputs, and every expert's score.

    Example:
      >>> experts, gates, _ = choose_experts(jnp.array([[0.0, 2.0, 1.0]]), 2)
      >>> experts.tolist(), round(float(gates.sum()), 6)
      ([[1, 2]], 1.0)
    """
    if score not in ("softmax", "sigmoid"):
        raise InputError(f"route_tokens: score={score!r}; choose 'softmax' or 'sigmoid'.")
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)  # (..., E)
    chooser = probs if bias is None else probs + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if groups != (1, 1):
        chooser = _best_groups_only(chooser, *groups)
    _, experts = top_k_by_rows(chooser, top_k)  # (..., k)
    gates = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:  # sigmoid scores may all be ~0: DeepSeek-V3's reference adds 1e-20 to the sum
        gates = gates / (gates.sum(axis=-1, keepdims=True) + (1e-20 if score == "sigmoid" else 0.0))
    if scale != 1.0:
        gates = gates * scale
    return experts, gates, probs


def _load(experts: jax.Array, probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(aux_loss, tokens_per_expert (E,))`` of a choice ``experts (..., k)`` among ``probs (..., E)``."""
    e = probs.shape[-1]
    lead = tuple(range(probs.ndim - 1))
    first = jax.nn.one_hot(experts[..., 0], e, dtype=jnp.float32)  # (..., E)
    shares = probs / probs.sum(axis=-1, keepdims=True)  # sigmoid scores as a distribution too
    aux = e * jnp.sum(first.mean(axis=lead) * shares.mean(axis=lead))
    routed = jax.nn.one_hot(experts, e, dtype=jnp.int32).sum(axis=tuple(range(experts.ndim)))  # (E,)
    return aux, routed


def _best_groups_only(chooser: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """``chooser (G, S, E)`` with the experts outside each token's ``topk_group`` best groups set
    to -inf; a group's score is the sum of its two best experts' (one, for groups of one)."""
    *lead, e = chooser.shape
    if e % n_group or not 1 <= topk_group <= n_group:
        raise InputError(
            f"route_tokens: {e} experts in n_group={n_group} groups keeping topk_group={topk_group}; n_group must "
            f"divide the experts and 1 <= topk_group <= n_group."
        )
    grouped = chooser.reshape(*lead, n_group, e // n_group)
    best, _ = top_k_by_rows(grouped, min(2, e // n_group))
    _, kept = top_k_by_rows(best.sum(axis=-1), topk_group)  # (G, S, topk_group)
    keep = jax.nn.one_hot(kept, n_group, dtype=jnp.bool_).any(axis=-2)  # (G, S, n_group)
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(chooser.shape)


def route(logits: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dispatch, combine, aux_loss)`` of softmax top-k routing with capacity (:func:`route_tokens`).

    Args:
      logits: router logits (G, S, E) for G groups of S tokens.
      top_k: experts per token.
      capacity: slots per expert and group.

    Returns:
      dispatch (G, S, E, C) in {0, 1}; combine (G, S, E, C), the gate weights of the kept
      assignments; the load-balancing loss (1.0 when balanced).
    """
    r = route_tokens(logits, top_k, capacity)
    assert r.dispatch is not None and r.combine is not None  # route_tokens always fills them
    return r.dispatch, r.combine, r.aux_loss


def balance_bias(bias: jax.Array, tokens_per_expert: jax.Array, rate: float = 1e-3) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's score bias moved by ``rate``
    toward an even load, down for experts above their layer's mean load and up for those below.
    Applied outside the gradient, after each step.

    Args:
      bias: ``(..., E)`` score biases (a layer's, or a stack of layers').
      tokens_per_expert: ``(..., E)`` the (token, choice) pairs each expert was routed.
      rate: how far each bias moves.

    Returns:
      ``(..., E)`` the moved biases, in ``bias``'s dtype.

    Example:
      >>> (balance_bias(jnp.zeros(4), jnp.array([10, 2, 4, 0])) * 1000).round().tolist()
      [-1.0, 1.0, 0.0, 1.0]
    """
    load = tokens_per_expert.astype(jnp.float32)
    step = rate * jnp.sign(load - load.mean(axis=-1, keepdims=True))
    return (bias - step).astype(bias.dtype)


def moe_layer(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    top_k: int = 2,
    capacity_factor: float = 1.25,
    dropless: bool = False,
    score: str = "softmax",
    bias: jax.Array | None = None,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    router_bias: jax.Array | None = None,
    in_bias: jax.Array | None = None,
    out_bias: jax.Array | None = None,
    normalize: bool = True,
    scale: float = 1.0,
    groups: tuple[int, int] = (1, 1),
    dispatch: str = "einsum",
) -> tuple[jax.Array, Routing]:
    """A mixture of experts as one call: routing, dispatch, the experts, combine, under any layout.

    ``dispatch="einsum"`` (GShard): each row is a routing group (so every layout routes and drops
    the same tokens). The experts run on ``(E, B, C, D)`` buffers of their routed tokens, in the
    experts' island (:func:`shardkit.parallel.sorted_experts.experts_island`): under an
    ``expert`` axis the buffers go to their experts' devices and back with one all-to-all each
    way (the bound's four a layer with the backward pass); under ``tensor`` the experts' hidden
    units split there (one reduction at the tokens' size) or, where that moves less, each tensor
    rank dispatches its own rows. Dropless, every expert holds every token of its row.

    ``dispatch="sorted"``: each device sorts its (token, choice) pairs by expert and runs grouped
    matmuls on ``top_k`` rows a token (:mod:`shardkit.parallel.sorted_experts`), the memory of
    dropless routing at any sequence length; a capacity there bounds the rows a device sends
    each expert device.

    Args:
      x: ``(B, T, D)`` tokens.
      router: ``(D, E)`` router weights.
      w_in: ``(E, D, F)`` experts' input weights, or ``(E, D, 2, F)`` for gated units
        (``activation(x W_gate) * x W_up``).
      w_out: ``(E, F, D)`` experts' output weights.
      top_k: experts per token, ``1 <= top_k <= E``.
      capacity_factor: slots per expert, as a multiple of an even share (``T x top_k / E``) of its
        row; tokens beyond an expert's slots are dropped (their output is 0). ``> 0``.
      dropless: a slot for every token of the row at every expert: nothing is dropped.
      score: ``"softmax"`` or ``"sigmoid"`` router scores.
      bias: ``(E,)`` score bias that chooses experts without weighing them (auxiliary-loss-free
        balancing; :func:`balance_bias`).
      activation: the experts' nonlinearity.
      glu: ``(gate, up) -> hidden`` of gated units, in place of ``activation(gate) * up``
        (gpt-oss's clamped SwiGLU).
      router_bias: ``(E,)`` added to the router logits (gpt-oss).
      in_bias, out_bias: the experts' biases, ``(E, 2, F)`` (or ``(E, F)``) and ``(E, D)``.
      normalize, scale, groups: how the chosen experts' scores weigh them (:func:`route_tokens`).
      dispatch: ``"einsum"`` or ``"sorted"`` (see above).

    Returns:
      ``(y (B, T, D), routing)``: :class:`Routing` with the load-balancing loss, the pairs
      routed to each expert and the fraction dropped (its ``dispatch`` and ``combine`` None
      when sorted).

    Example:
      >>> k = jax.random.split(jax.random.key(0), 4)
      >>> x = jax.random.normal(k[0], (2, 8, 16))
      >>> y, r = moe_layer(x, jax.random.normal(k[1], (16, 4)), jax.random.normal(k[2], (4, 16, 2, 32)),
      ...                  jax.random.normal(k[3], (4, 32, 16)), top_k=2, capacity_factor=2.0)
      >>> y.shape, r.tokens_per_expert.shape, int(r.tokens_per_expert.sum())
      ((2, 8, 16), (4,), 32)
    """
    _check_layer(x, router, w_in, w_out, top_k, capacity_factor, dispatch)
    factor = None if dropless else capacity_factor
    with jax.named_scope("router"):
        logits = x.astype(jnp.float32) @ router.astype(jnp.float32)  # (B, T, E)
        if router_bias is not None:
            logits = logits + router_bias.astype(jnp.float32)
        experts, gates, probs = choose_experts(
            logits, top_k, score, bias, normalize=normalize, scale=scale, groups=groups
        )  # (B, T, k)
    if dispatch == "sorted":
        with jax.named_scope("experts"):
            y, dropped = sorted_experts(
                x,
                experts,
                gates,
                w_in,
                w_out,
                capacity_factor=factor,
                activation=activation,
                glu=glu,
                in_bias=in_bias,
                out_bias=out_bias,
            )
        return y.astype(x.dtype), Routing(None, None, *_load(experts, probs), dropped / experts.size)
    with jax.named_scope("router"):
        routing = _slotted(experts, gates, probs, row_capacity(x.shape[1], top_k, router.shape[-1], factor))
    assert routing.dispatch is not None and routing.combine is not None
    with jax.named_scope("experts"):
        split = einsum_split(x, top_k, w_in, w_out, factor)
        weights = (w_in, w_out, in_bias, out_bias)
        y, _ = experts_island(x, experts, gates, weights, split, factor, (activation, glu), _einsum_local)
    return y.astype(x.dtype), routing


def _experts_on_buffers(
    buffers: jax.Array,
    weights: Weights,
    activation: Callable[[jax.Array], jax.Array],
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None,
    hidden_axis: str | None = None,
) -> jax.Array:
    """The experts on their buffers ``(E, G, C, D)``: ``(E, G, C, D)``. ``hidden_axis``: the
    manual axis the hidden units are split over (the output bias then added on its rank 0 only)."""
    w_in, w_out, in_bias, out_bias = weights
    dtype = buffers.dtype
    if w_in.ndim == 4:
        h = jnp.einsum("egcd,edxf->egcxf", buffers, w_in.astype(dtype))  # (E, G, C, 2, F)
        if in_bias is not None:
            h = h + in_bias.astype(dtype)[:, None, None]
        gate, up = h[..., 0, :], h[..., 1, :]
        h = glu(gate, up) if glu is not None else activation(gate) * up  # (E, G, C, F)
    else:
        h = jnp.einsum("egcd,edf->egcf", buffers, w_in.astype(dtype))
        h = activation(h if in_bias is None else h + in_bias.astype(dtype)[:, None, None])  # (E, G, C, F)
    out = jnp.einsum("egcf,efd->egcd", h, w_out.astype(dtype))  # (E, G, C, D)
    if out_bias is not None:  # on empty slots too: their combine weight is 0
        out = out + once_over(out_bias.astype(dtype)[:, None, None], hidden_axis)
    return out


def _einsum_local(
    x: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    weights: Weights,
    n_experts: int,
    split: Any,
    capacity_factor: float | None,
    activation: Callable[[jax.Array], jax.Array],
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None,
) -> tuple[jax.Array, jax.Array]:
    """One device's GShard dispatch in the experts' island: its rows' ``x (b, T, D)`` into every
    expert's slots, one all-to-all to the experts' devices, the experts, one back, the combine.
    Returns ``(y (b, T, D), dropped ())``, the pairs of its rows that found no slot."""
    b, t, _ = x.shape
    k = experts.shape[-1]
    one_slot, kept = _choice_slots(experts, n_experts, row_capacity(t, k, n_experts, capacity_factor))
    one_slot = one_slot.astype(x.dtype)  # (b, T, k, E, C)
    buffers = jnp.einsum("gskec,gsd->egcd", one_slot, x)  # (E, b, C, D)
    if split.experts_over > 1:  # (E / n, n b, C, D): each expert device gets its experts' slots of every row
        buffers = jax.lax.all_to_all(buffers, split.axis, split_axis=0, concat_axis=1, tiled=True)
    out = _experts_on_buffers(buffers, weights, activation, glu, split.hidden_axis)
    if split.experts_over > 1:
        out = jax.lax.all_to_all(out, split.axis, split_axis=1, concat_axis=0, tiled=True)
    # Each choice's output, then weighed: under the hidden units' split the gates' gradient is
    # then reduced over tensor at (b, T, k), not at the (b, T, E, C) of a combine tensor.
    chosen = jnp.einsum("gskec,egcd->gskd", one_slot, out)
    y = jnp.einsum("gskd,gsk->gsd", chosen, gates.astype(x.dtype))
    return y, (b * t * k - kept).astype(jnp.float32)


def _check_layer(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    top_k: int,
    capacity_factor: float,
    dispatch: str = "einsum",
) -> None:
    """Refuse a layer that cannot route, naming the fix (before anything is computed)."""
    e = router.shape[-1]
    if dispatch not in DISPATCHES:
        raise InputError(f"moe_layer: dispatch={dispatch!r}; choose one of {', '.join(map(repr, DISPATCHES))}.")
    if not 1 <= top_k <= e:
        raise InputError(f"moe_layer: top_k={top_k} experts per token out of {e}; choose top_k between 1 and {e}.")
    if capacity_factor <= 0:
        raise InputError(
            f"moe_layer: capacity_factor={capacity_factor} leaves no slot for any token; choose one > 0 "
            "(1.25 is usual), or dropless=True."
        )
    d = x.shape[-1]
    shapes = {"router": (router.shape, (d, e)), "w_in": (w_in.shape[:2], (e, d)), "w_out": (w_out.shape[::2], (e, d))}
    wrong = {name: got for name, (got, want) in shapes.items() if tuple(got) != want}
    if x.ndim != 3 or wrong or w_out.shape[1] != w_in.shape[-1]:
        raise InputError(
            f"moe_layer: x {tuple(x.shape)} (B, T, D), router {tuple(router.shape)} (D, E), w_in "
            f"{tuple(w_in.shape)} (E, D, F) or (E, D, 2, F), w_out {tuple(w_out.shape)} (E, F, D) do not agree"
            f"{' (' + ', '.join(wrong) + ')' if wrong else ''}; fix the shapes to those."
        )


@dataclasses.dataclass(frozen=True)
class Router:
    """How a :class:`MoE` chooses and weighs its experts beyond top-k (the families differ here).

    Attributes:
      score: ``"softmax"`` or ``"sigmoid"`` of the router logits.
      normalize: the chosen scores rescaled to sum to 1.
      scale: the weights multiplied by it (DeepSeek-V3's ``routed_scaling_factor``).
      groups: ``(n_group, topk_group)`` of group-limited routing (:func:`route_tokens`).
      logit_bias: a trained ``(E,)`` bias on the logits (gpt-oss).
      score_bias: an ``(E,)`` bias that chooses without weighing (DeepSeek-V3's
        ``e_score_correction_bias``), moved by :func:`balance_bias`, not by gradients.
      balance_rate: auxiliary-loss-free balancing: after each optimizer step the score bias
        moves by this much toward an even load (:func:`balance_bias`; DeepSeek-V3 trains with
        0.001, then 0). 0: the bias stays as it is. Needs ``score_bias``.

    Example:
      >>> Router(score="sigmoid", score_bias=True, balance_rate=1e-3).balance_rate
      0.001
    """

    score: str = "softmax"
    normalize: bool = True
    scale: float = 1.0
    groups: tuple[int, int] = (1, 1)
    logit_bias: bool = False
    score_bias: bool = False
    balance_rate: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.balance_rate, (int, float)) or self.balance_rate < 0:
            raise ModelError(
                f"Router: balance_rate={self.balance_rate!r} must be a number >= 0 (DeepSeek-V3 trains with 0.001)."
            )
        if self.balance_rate and not self.score_bias:
            raise ModelError(
                f"Router: balance_rate={self.balance_rate} moves a score bias the router does not have; set "
                "score_bias=True (or balance_rate=0 and balance with aux_loss_weight)."
            )


def clamped_swiglu(limit: float, alpha: float) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """gpt-oss's gated unit: ``(up + 1) * g * sigmoid(alpha g)``, the gate clamped above at
    ``limit`` and ``up`` to ``[-limit, limit]``.

    Example:
      >>> round(float(clamped_swiglu(7.0, 1.702)(jnp.array([10.0]), jnp.array([-9.0]))[0]), 3)  # (-7 + 1) x ~7
      -42.0
    """

    def glu(gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))

    return glu


class MoE(nnx.Module):
    """SwiGLU experts behind a top-k router. ``(B, T, D) -> ((B, T, D), ExpertLoad)`` (one layer's:
    a scalar loss, ``(E,)`` tokens, scalar dropped and routed pairs).

    ``dropless``: no token is dropped, and the result is that of routing each token to its top-k
    experts with no capacity at all. ``dispatch``: ``"einsum"`` (GShard's buffers: dropless,
    every expert has a slot for every token of its group, memory and FLOPs of ``E / top_k``
    times the even share) or ``"sorted"`` (the default: grouped matmuls on ``top_k`` rows a
    token, the same tokens dropped; see :func:`moe_layer`). ``router``: how experts
    are chosen and weighed (:class:`Router`); ``expert_bias``: biases on the experts' units and
    outputs; ``glu``: the gated unit (default ``silu(gate) * up``).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        capacity_factor: float,
        param_dtype: str,
        rngs: nnx.Rngs,
        dropless: bool = False,
        router: Router = Router(),
        expert_bias: bool = False,
        glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
        dispatch: str = "sorted",
    ):
        init, dt = nnx.initializers.lecun_normal(), jnp.dtype(param_dtype)
        zeros = nnx.initializers.zeros
        self.router = nnx.Param(logical(init, ("embed", None))(rngs.params(), (dim, n_experts), dt))
        if router.logit_bias:
            self.router_bias = nnx.Param(logical(zeros, (None,))(rngs.params(), (n_experts,), dt))
        if router.score_bias:
            self.score_bias = nnx.Param(logical(zeros, (None,))(rngs.params(), (n_experts,), dt))
        gate_up_init = nnx.initializers.lecun_normal(in_axis=1, out_axis=(2, 3), batch_axis=(0,))
        self.w_gate_up = nnx.Param(
            logical(gate_up_init, ("experts", "embed", None, "mlp"))(rngs.params(), (n_experts, dim, 2, hidden), dt)
        )
        down_init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.w_down = nnx.Param(
            logical(down_init, ("experts", "mlp", "embed"))(rngs.params(), (n_experts, hidden, dim), dt)
        )
        if expert_bias:
            b_gate_up = logical(zeros, ("experts", None, "mlp"))(rngs.params(), (n_experts, 2, hidden), dt)
            self.b_gate_up = nnx.Param(b_gate_up)
            self.b_down = nnx.Param(logical(zeros, ("experts", "embed"))(rngs.params(), (n_experts, dim), dt))
        self.top_k, self.capacity_factor, self.n_experts = top_k, capacity_factor, n_experts
        self.dropless, self.routing, self.glu = dropless, router, glu
        self.dispatch = dispatch

    def __call__(self, x: jax.Array) -> tuple[jax.Array, ExpertLoad]:
        optional = lambda name: getattr(self, name)[...] if hasattr(self, name) else None
        y, routing = moe_layer(
            x,
            self.router[...],
            self.w_gate_up[...],
            self.w_down[...],
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            dropless=self.dropless,
            score=self.routing.score,
            bias=optional("score_bias"),
            glu=self.glu,
            router_bias=optional("router_bias"),
            in_bias=optional("b_gate_up"),
            out_bias=optional("b_down"),
            normalize=self.routing.normalize,
            scale=self.routing.scale,
            groups=self.routing.groups,
            dispatch=self.dispatch,
        )
        pairs = jnp.asarray(x.shape[0] * x.shape[1] * self.top_k, jnp.float32)
        load = ExpertLoad(
            routing.aux_loss, routing.tokens_per_expert.astype(jnp.float32), routing.dropped * pairs, pairs
        )
        return y, load
