"""Experts on tokens sorted by expert: grouped matmuls
(:func:`shardkit.parallel.grouped_matmul.grouped_matmul`) on each device's routed rows, moved to
their experts' devices with one all-to-all each way.

GShard's einsum dispatch (:func:`shardkit.parallel.experts.moe_layer`) pads every expert to its
capacity: dropless, that is every token of the row at every expert, ``E x T`` rows and a one-hot
mask of ``T x E x T`` numbers a row, which grows with the square of the sequence. Here a layer
holds ``top_k`` rows per token instead (MaxText's sparse path, Megatron-Core's all-to-all
dispatcher, DeepSpeed-MoE), in a ``shard_map`` over the mesh:

1. each device sorts its (token, choice) pairs by expert and lays them out per destination
   device: ``n`` blocks of ``C`` slots (``n`` the ``expert`` axis, ``C`` the slots a device may
   send another);
2. one all-to-all over ``expert`` brings each device the rows of its ``E / n`` experts, which it
   sorts by expert and runs through two grouped matmuls. Under ``tensor`` the experts' hidden
   units are split over it (one reduction at the tokens' size after the combine), or, where
   that moves more (:func:`shardkit.parallel.expert_tensor.experts_under_tensor`, from the
   sizes), the tokens' rows are split over it instead and the experts' weights gathered there:
   each tensor rank then dispatches ``1/t`` of the tokens;
3. one all-to-all back, and each token sums its experts' outputs weighted by its gates.

The island (:func:`experts_island`: the ``shard_map``, the experts' weights as each device
computes with them, the choice of how to use ``tensor``) also runs GShard's einsum dispatch
(:func:`shardkit.parallel.experts.moe_layer`), with that dispatch's own local part.

A capacity drops the pairs GShard's einsum dispatch drops (each expert has ``factor x T x
top_k / E`` slots in each row, first choices first), so both dispatches compute the same thing
on every layout; dropless, nothing is dropped. ``C`` is static (XLA needs static shapes;
``jax.lax.ragged_all_to_all``, which would send only the rows routed, is not implemented by
XLA:CPU) (:func:`slots_per_destination`): with a capacity, the slots of the experts on the
destination, the einsum dispatch's buffers and bytes; dropless, the most a device's pairs can
fill there, ``rows x T x min(top_k, E / n)``, up to ``n`` times the pairs routed.

Example:
  >>> import jax, jax.numpy as jnp
  >>> k = jax.random.split(jax.random.key(0), 3)
  >>> x = jax.random.normal(k[0], (2, 8, 16))
  >>> experts = jax.random.randint(k[1], (2, 8, 2), 0, 4)
  >>> gates = jnp.full((2, 8, 2), 0.5)
  >>> w_in, w_out = jnp.ones((4, 16, 2, 8)), jax.random.normal(k[2], (4, 8, 16))
  >>> y, dropped = sorted_experts(x, experts, gates, w_in, w_out)
  >>> y.shape, int(dropped)
  ((2, 8, 16), 0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shardkit.core.partition import current_rules
from shardkit.core.rules import entry_axes, resolve
from shardkit.parallel.expert_tensor import dispatch_bytes, experts_under_tensor
from shardkit.parallel.grouped_matmul import grouped_matmul


@dataclasses.dataclass(frozen=True)
class _Split:
    """How the experts' part runs on the mesh: the axes that split the tokens, the expert axis's
    size (1: no exchange) and the axis splitting the experts' hidden units (or None)."""

    mesh: Mesh | None
    token_spec: PartitionSpec
    token_axes: tuple[str, ...]
    experts_over: int
    hidden_axis: str | None
    axis: str = "expert"
    # Token axes that split the weights' model dimension (ZeRO-3's fsdp): gathered inside, so the
    # backward pass reduce-scatters the weights' gradients over them.
    embed_axes: tuple[str, ...] = ()


def _split_of(x: jax.Array, n_experts: int, hidden: int, axis: str, whole_rows: bool) -> _Split:
    """Read the split from the rules in force (:func:`shardkit.core.partition.use_sharding`);
    ``whole_rows``: keep each row's tokens on one device (a capacity ranks a row's pairs)."""
    context = current_rules()
    inside_manual = any(t == jax.sharding.AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types)
    if context is None or inside_manual:
        # Outside any layout, or inside another island (a pipeline's stages): the whole part here,
        # its arrays split as XLA splits them around it.
        return _Split(None, PartitionSpec(), (), 1, None, axis)
    mesh, rules = context
    shape = dict(mesh.shape)
    names = ("batch", None if whole_rows else "seq", None)
    spec = resolve(names, x.shape, rules, shape, what="mixture-of-experts tokens")
    token_axes = tuple(a for entry in spec for a in entry_axes(entry))
    n = shape.get(axis, 1)
    # The exchange needs each expert device to hold its own tokens; tokens whole over the expert
    # axis (or experts it does not divide) leave every device computing every expert instead.
    experts_over = n if n > 1 and axis in token_axes and n_experts % n == 0 else 1
    t = shape.get("tensor", 1)
    hidden_axis = "tensor" if t > 1 and "tensor" not in token_axes and hidden % t == 0 else None
    token_spec = PartitionSpec(*spec, *([None] * (3 - len(spec))))
    embed = resolve(("embed",), (x.shape[-1],), rules, shape, what="experts' model dimension", allow_replicate=True)
    embed_axes = tuple(a for a in entry_axes(embed[0] if len(embed) else None) if a in token_axes and a != axis)
    return _Split(mesh, token_spec, token_axes, experts_over, hidden_axis, axis, embed_axes)


def row_capacity(tokens_per_row: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int:
    """Slots of each expert in each row: ``ceil(factor x T x top_k / E)`` (GShard's), or ``T``
    dropless (a token chooses an expert at most once, so no expert overflows)."""
    if capacity_factor is None:
        return tokens_per_row
    return max(1, math.ceil(capacity_factor * tokens_per_row * top_k / n_experts))


def slots_per_destination(
    rows: int, tokens_per_row: int, top_k: int, n_experts: int, devices: int, capacity_factor: float | None
) -> int:
    """``C``: the rows one device sends each of ``devices`` expert devices from its ``rows`` rows.

    With a capacity, the slots of the experts there, ``rows x E / devices x``
    :func:`row_capacity` (the einsum dispatch's buffers). Dropless, the most its pairs can fill
    there, ``rows x T x min(top_k, E / devices)``: a token chooses an expert at most once.

    Example:
      >>> slots_per_destination(1, 1024, 8, 256, 8, None), slots_per_destination(1, 1024, 8, 256, 8, 1.25)
      (8192, 1280)
    """
    local = n_experts // devices
    if capacity_factor is None:
        return rows * tokens_per_row * min(top_k, local)
    return rows * local * row_capacity(tokens_per_row, top_k, n_experts, capacity_factor)


def kept_by_capacity(experts: jax.Array, capacity: int) -> jax.Array:
    """``(B, T, k)`` bool: each (token, choice) pair that finds a slot among its expert's
    ``capacity`` in its row, the slots filled by all first choices in token order, then all
    second choices, ... (GShard's order, :func:`shardkit.parallel.experts.route_tokens`'s).

    Example:
      >>> kept_by_capacity(jnp.array([[[0, 1], [0, 1], [0, 2]]]), 2).tolist()  # expert 0's third first choice drops
      [[[True, True], [True, True], [False, True]]]
    """
    b, t, k = experts.shape
    by_choice = experts.transpose(0, 2, 1).reshape(b, k * t)  # first choices in token order, then second ...
    order = jnp.argsort(by_choice, axis=-1, stable=True)
    grouped = jnp.take_along_axis(by_choice, order, axis=-1)
    # A pair's slot: its place among the row's pairs of the same expert.
    starts = jax.vmap(lambda g: jnp.searchsorted(g, g, side="left"))(grouped)
    slot_sorted = jnp.arange(k * t)[None, :] - starts
    slot = jnp.zeros_like(slot_sorted).at[jnp.arange(b)[:, None], order].set(slot_sorted)
    return (slot < capacity).reshape(b, k, t).transpose(0, 2, 1)


def sorted_experts(
    x: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    capacity_factor: float | None = None,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    in_bias: jax.Array | None = None,
    out_bias: jax.Array | None = None,
    axis: str = "expert",
) -> tuple[jax.Array, jax.Array]:
    """The experts' outputs for routed tokens, dispatched sorted (see the module's docstring).

    Args:
      x: ``(B, T, D)`` tokens.
      experts: ``(B, T, k)`` int, the experts each token chose.
      gates: ``(B, T, k)`` the weights of their outputs.
      w_in: ``(E, D, 2, F)`` gated units' input weights (gate, up), or ``(E, D, F)``.
      w_out: ``(E, F, D)``.
      capacity_factor: None for dropless, else the slots a device may send another as a
        multiple of an even share (:func:`slots_per_destination`).
      activation, glu: the experts' unit, as :func:`shardkit.parallel.experts.moe_layer` takes them.
      in_bias: ``(E, 2, F)`` or ``(E, F)``; out_bias: ``(E, D)``.
      axis: the mesh axis the experts are split over.

    Returns:
      ``(y (B, T, D), dropped ())``: the weighted sum of each token's experts' outputs, and the
      (token, choice) pairs dropped over the whole batch (0 dropless).
    """
    n_experts, hidden = w_in.shape[0], w_in.shape[-1]
    split = _split_of(x, n_experts, hidden, axis, whole_rows=capacity_factor is not None)
    split = _rows_over_tensor(
        split, x, experts.shape[-1], n_experts, w_in.size + w_out.size, capacity_factor, slots_per_destination
    )
    unit = (activation, glu)
    return experts_island(x, experts, gates, (w_in, w_out, in_bias, out_bias), split, capacity_factor, unit, _local)


# One device's part of a mixture: ``local(x, experts, gates, weights, n_experts, split,
# capacity_factor, activation, glu) -> (y, dropped)``, its tokens in and out.
LocalExperts = Callable[..., tuple[jax.Array, jax.Array]]
Weights = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]


def experts_island(
    x: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    weights: Weights,
    split: _Split,
    capacity_factor: float | None,
    unit: tuple[Callable[[jax.Array], jax.Array], Callable[[jax.Array, jax.Array], jax.Array] | None],
    local: LocalExperts,
) -> tuple[jax.Array, jax.Array]:
    """``local``, each device's part of a mixture, run in a ``shard_map`` laid out as ``split``
    says: tokens, experts and gates split as ``split.token_spec``, the weights over the expert
    axis (and ``split.hidden_axis`` on their hidden units), gathered inside over the axes that
    split their model dimension. Outside a layout (``split.mesh`` None), ``local`` on everything.

    Args:
      x, experts, gates: ``(B, T, D)``, ``(B, T, k)``, ``(B, T, k)``, as :func:`sorted_experts`.
      weights: ``(w_in, w_out, in_bias, out_bias)``, as :func:`sorted_experts` takes them.
      split: from :func:`_split_of` (and :func:`_rows_over_tensor`).
      capacity_factor: passed to ``local``.
      unit: ``(activation, glu)``, passed to ``local``.
      local: one device's part (:data:`LocalExperts`).

    Returns:
      ``(y (B, T, D), dropped ())``, ``local``'s, summed over the devices.
    """
    n_experts = weights[0].shape[0]

    def body(x, experts, gates, w_in, w_out, in_bias, out_bias):
        here = _weights_here(split, (w_in, 1), (w_out, 2), (in_bias, None), (out_bias, 1))
        if split.hidden_axis:
            # The tokens become per-tensor-rank here, so the backward pass reduces their gradient
            # over tensor at the tokens' size (not at the routed rows', k x capacity times it).
            x = jax.lax.pcast(x, split.hidden_axis, to="varying")
        y, dropped = local(x, experts, gates, here, n_experts, split, capacity_factor, *unit)
        if split.hidden_axis:
            y = jax.lax.psum(y, split.hidden_axis)
        if split.token_axes:
            dropped = jax.lax.psum(dropped, split.token_axes)
        return y, dropped

    if split.mesh is None:
        return body(x, experts, gates, *weights)
    w_in, _, in_bias, out_bias = weights
    ex = split.axis if split.experts_over > 1 else None
    h, m = split.hidden_axis, split.embed_axes or None
    w_in_spec = PartitionSpec(ex, m, None, h) if w_in.ndim == 4 else PartitionSpec(ex, m, h)
    bias_spec = None if in_bias is None else PartitionSpec(ex, *([None] * (in_bias.ndim - 2)), h)
    out_bias_spec = None if out_bias is None else PartitionSpec(ex, m)
    tokens = split.token_spec
    return jax.shard_map(
        body,
        mesh=split.mesh,
        in_specs=(tokens, tokens, tokens, w_in_spec, PartitionSpec(ex, h, m), bias_spec, out_bias_spec),
        out_specs=(tokens, PartitionSpec()),
    )(x, experts, gates, *weights)


def einsum_split(
    x: jax.Array, top_k: int, w_in: jax.Array, w_out: jax.Array, capacity_factor: float | None, axis: str = "expert"
) -> _Split:
    """The island's split for GShard's einsum dispatch of ``x (B, T, D)`` under the rules in
    force: each row whole on a device (a capacity ranks a row's pairs), and under ``tensor``
    the experts' hidden units split there or, where that moves less, the tokens' rows
    (:func:`_rows_over_tensor`, priced at the einsum's buffers: every expert's slots of each row)."""
    n_experts, hidden = w_in.shape[0], w_in.shape[-1]
    split = _split_of(x, n_experts, hidden, axis, whole_rows=True)
    return _rows_over_tensor(split, x, top_k, n_experts, w_in.size + w_out.size, capacity_factor, einsum_slots)


def einsum_slots(
    rows: int, tokens_per_row: int, top_k: int, n_experts: int, devices: int, capacity_factor: float | None
) -> int:
    """The rows GShard's einsum dispatch sends each of ``devices`` expert devices from ``rows``
    rows: every slot of the experts there, empty or not (``T`` a row each, dropless).

    Example:
      >>> einsum_slots(2, 16, 2, 4, 2, None), einsum_slots(2, 16, 2, 4, 2, 1.0)
      (64, 32)
    """
    return rows * (n_experts // devices) * row_capacity(tokens_per_row, top_k, n_experts, capacity_factor)


def _rows_over_tensor(
    split: _Split,
    x: jax.Array,
    top_k: int,
    n_experts: int,
    weight_size: int,
    capacity_factor: float | None,
    slots_of: Callable[[int, int, int, int, int, float | None], int],
) -> _Split:
    """``split`` with the tokens' rows (or, without a capacity, their positions) split over
    ``tensor`` in place of the experts' hidden units, where that moves fewer bytes: half the
    dispatch and a gather of the tokens and of an expert group's weights over ``tensor``,
    against the dispatch whole and a reduction at the tokens' size (both ways). ``slots_of``:
    the rows a device sends each expert device (:func:`slots_per_destination`'s arguments)."""
    if split.mesh is None or split.hidden_axis is None or split.experts_over == 1:
        return split
    shape = dict(split.mesh.shape)
    t, n = shape[split.hidden_axis], split.experts_over
    local = [x.shape[d] // math.prod(shape[a] for a in entry_axes(split.token_spec[d])) for d in range(2)]
    itemsize = x.dtype.itemsize
    slots = slots_of(local[0], local[1], top_k, n_experts, n, capacity_factor)
    dispatch = dispatch_bytes(n * slots * x.shape[-1] * itemsize, n)
    activation = local[0] * local[1] * x.shape[-1] * itemsize
    cheaper = experts_under_tensor(dispatch, activation, weight_size * itemsize / n, t)
    dims = [0] if capacity_factor is not None else [0, 1]  # a capacity ranks a row's pairs: rows whole
    dim = next((d for d in dims if local[d] % t == 0), None)
    if cheaper["expert"] == dispatch or dim is None:
        return split
    entries = list(split.token_spec)
    entries[dim] = (*entry_axes(entries[dim]), split.hidden_axis)
    return dataclasses.replace(
        split,
        token_spec=PartitionSpec(*entries),
        token_axes=(*split.token_axes, split.hidden_axis),
        hidden_axis=None,
    )


def _weights_here(split: _Split, *weights: tuple[jax.Array | None, int | None]) -> tuple[jax.Array | None, ...]:
    """The experts' weights, each given with its model dimension (None: it has none), as this
    device computes with them: gathered over the axes that split their model dimension (ZeRO-3;
    the backward pass reduce-scatters their gradients), and marked as differing over the other
    token axes here, once, so their gradients are reduced there at the layer's end rather than in
    every block of a grouped matmul's loop."""
    if split.mesh is None:
        return tuple(w for w, _ in weights)
    experts = {split.axis} if split.experts_over > 1 else set()
    out: list[jax.Array | None] = []
    for w, model_dim in weights:
        if w is not None and model_dim is not None and split.embed_axes:
            w = jax.lax.all_gather(w, split.embed_axes, axis=model_dim, tiled=True)
        # The axes a weight's shard already differs over are those its spec names.
        named = experts | (set(split.embed_axes) if model_dim is not None else set())
        elsewhere = tuple(a for a in split.token_axes if a not in named)
        out.append(jax.lax.pcast(w, elsewhere, to="varying") if w is not None and elsewhere else w)
    return tuple(out)


def _local(
    x: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    weights: Weights,
    n_experts: int,
    split: _Split,
    capacity_factor: float | None,
    activation: Callable[[jax.Array], jax.Array],
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None,
) -> tuple[jax.Array, jax.Array]:
    """One device's part: its tokens ``x (b, t, D)`` out, the rows of its experts in, both back."""
    b, t, d = x.shape
    k = experts.shape[-1]
    kept = None
    if capacity_factor is not None:
        kept = kept_by_capacity(experts, row_capacity(t, k, n_experts, capacity_factor)).reshape(b * t, k)
    c = slots_per_destination(b, t, k, n_experts, split.experts_over, capacity_factor)
    run = lambda rows, slot_expert, local: _grouped_experts(rows, slot_expert, local, weights, split, activation, glu)
    unsorted, sent = routed_pairs(x.reshape(b * t, d), experts.reshape(b * t, k), n_experts, split, c, run, kept)
    y = jnp.einsum("nkd,nk->nd", unsorted, gates.reshape(b * t, k).astype(unsorted.dtype))
    dropped = jnp.sum(~sent).astype(jnp.float32)
    return y.reshape(b, t, d), dropped


ExpertsRun = Callable[[jax.Array, jax.Array, int], jax.Array]


def routed_pairs(
    tokens: jax.Array,
    experts: jax.Array,
    n_experts: int,
    split: _Split,
    slots: int,
    run: ExpertsRun,
    kept: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One device's (token, choice) pairs through their experts, wherever the experts live.

    Args:
      tokens: ``(N, D)`` this device's tokens.
      experts: ``(N, k)`` int, the experts each token chose.
      n_experts: ``E``, over the whole mesh.
      split: how the experts are split (``split.experts_over`` devices over ``split.axis``).
      slots: ``C``, the rows this device may send each expert device (:func:`slots_per_destination`).
      run: ``run(rows (M, D), slot_expert (M,), local_experts) -> (M, D')``: the experts here
        on rows, each for local expert ``slot_expert`` (``local_experts``: an empty slot).
      kept: ``(N, k)`` bool, the pairs a capacity keeps (None: all).

    Returns:
      ``(outputs (N, k, D'), sent (N k,))``: each pair's expert output in token order (0 where it
      was dropped), and which pairs found a slot.
    """
    n_tokens, d = tokens.shape
    k, n = experts.shape[-1], split.experts_over
    local_experts = n_experts // n
    pairs = n_tokens * k
    kept_flat = jnp.ones((pairs,), bool) if kept is None else kept.reshape(pairs)
    chosen = jnp.where(kept_flat, experts.reshape(pairs), n_experts)  # dropped pairs sort last, to no device
    order = jnp.argsort(chosen, stable=True)  # (P,) pairs by expert, each token's choices in order
    by_expert = chosen[order]
    dest = by_expert // local_experts  # the device holding each pair's expert (n: dropped)
    per_dest = jnp.zeros((n + 1,), jnp.int32).at[dest].add(1)[:n]
    starts = jnp.cumsum(per_dest) - per_dest
    c = slots
    place = jnp.arange(pairs) - starts[jnp.minimum(dest, n - 1)]  # the pair's slot among those sent to its device
    sent = (dest < n) & (place < c)  # place < c holds for every kept pair, by C's choice
    # Slot j of destination e holds sorted pair starts[e] + j, if there is one.
    source = starts[:, None] + jnp.arange(c)[None, :]  # (n, C)
    filled = jnp.arange(c)[None, :] < jnp.minimum(per_dest, c)[:, None]
    source = jnp.where(filled, source, 0)
    rows = jnp.where(filled[..., None], tokens[order[source] // k], 0).astype(tokens.dtype)  # (n, C, D)
    # What each destination needs besides the rows: how many of them are for each of its experts.
    counts = jnp.zeros((n_experts + 1,), jnp.int32).at[by_expert].add(1)[:n_experts].reshape(n, local_experts)
    if n > 1:
        rows = jax.lax.all_to_all(rows, split.axis, 0, 0, tiled=True)
        counts = jax.lax.all_to_all(counts, split.axis, 0, 0, tiled=True)  # (n sources, E_l)
    # A source's rows come sorted by expert: slot j is for the expert whose count range holds j.
    ends = jnp.cumsum(counts, axis=-1)  # (n, E_l)
    slot_expert = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(c), side="right"))(ends)  # (n, C); E_l: empty
    out = run(rows.reshape(n * c, d), slot_expert.reshape(n * c), local_experts)
    out = out.reshape(n, c, out.shape[-1])
    if n > 1:
        out = jax.lax.all_to_all(out, split.axis, 0, 0, tiled=True)
    # Each pair reads its slot's output; the pairs back in token order.
    pair_out = jnp.where(sent[:, None], out[jnp.minimum(dest, n - 1), jnp.clip(place, 0, c - 1)], 0)  # (P, D'), sorted
    return pair_out[jnp.argsort(order)].reshape(n_tokens, k, -1), sent


def once_over(bias: jax.Array, hidden_axis: str | None) -> jax.Array:
    """An output bias as one device of the manual ``hidden_axis`` adds it (the others add 0):
    the partial sums over the hidden units are added up, so the bias is counted once."""
    if not hidden_axis:
        return bias
    return bias * (jax.lax.axis_index(hidden_axis) == 0).astype(bias.dtype)


def by_expert(rows: jax.Array, slot_expert: jax.Array, local_experts: int, fn: Callable[..., jax.Array]) -> jax.Array:
    """``fn(grouped (M, D), sizes (E_l,), which (M,)) -> (M, D')`` on ``rows`` sorted by their
    local expert (empty slots, ``local_experts``, last), its output put back in the rows' order,
    empty slots 0."""
    order = jnp.argsort(slot_expert, stable=True)
    grouped_expert = slot_expert[order]
    sizes = jnp.zeros((local_experts + 1,), jnp.int32).at[grouped_expert].add(1)[:local_experts]
    valid = (grouped_expert < local_experts)[:, None]
    out = fn(rows[order], sizes, jnp.minimum(grouped_expert, local_experts - 1))
    return jnp.where(valid, out, 0)[jnp.argsort(order)]


def _grouped_experts(
    rows: jax.Array,
    slot_expert: jax.Array,
    local_experts: int,
    weights: tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None],
    split: _Split,
    activation: Callable[[jax.Array], jax.Array],
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None,
) -> jax.Array:
    """``rows (M, D)``, each for local expert ``slot_expert`` (``local_experts``: an empty slot),
    through its expert: ``(M, D)`` in the same order (empty slots 0)."""
    w_in, w_out, in_bias, out_bias = weights
    d = rows.shape[-1]
    gated = w_in.ndim == 4
    f = w_in.shape[-1]
    w = w_in.astype(rows.dtype).reshape(local_experts, d, -1)
    platform = split.mesh.devices.flat[0].platform if split.mesh is not None else None

    def experts(grouped: jax.Array, sizes: jax.Array, which: jax.Array) -> jax.Array:
        h = grouped_matmul(grouped, w, sizes, platform)  # (M, 2F) or (M, F)
        if in_bias is not None:
            h = h + in_bias.astype(rows.dtype).reshape(local_experts, -1)[which]
        if gated:
            h = h.reshape(h.shape[0], 2, f)
            h = glu(h[:, 0], h[:, 1]) if glu is not None else activation(h[:, 0]) * h[:, 1]
        else:
            h = activation(h)
        out = grouped_matmul(h.astype(rows.dtype), w_out.astype(rows.dtype), sizes, platform)  # (M, D)
        if out_bias is not None:
            bias = out_bias.astype(rows.dtype)[which]
            out = out + once_over(bias, split.hidden_axis)
        return out

    return by_expert(rows, slot_expert, local_experts, experts)
