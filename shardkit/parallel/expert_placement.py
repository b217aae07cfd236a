"""Experts computed where they live, in any mixture of experts: the traced forward pass with each
expert matmul's expert dimension kept on the ``expert`` mesh axis.

Under an ``expert`` axis each device holds ``E / n`` experts' weights and ``1 / n`` of its group's
rows. Left alone, XLA's partitioner often meets a matmul of tokens with a stacked expert weight
by gathering the weights over ``expert`` (ZeRO-3 over the experts: three times their bytes every
step), or by all-reducing the output, where expert parallelism moves the tokens instead.
:func:`place_experts` wraps a model's forward pass: it traces it, finds every matmul that reads
an expert weight (a parameter with an ``experts`` dimension, through casts, reshapes, slices
and into jit, remat and scan bodies), and constrains the expert dimension of its token operand
and of its output to the ``expert`` axis, every other dimension left to the partitioner. So:

- einsum dispatch (GShard's ``(E, G, C, D) x (E, D, F)``, the expert dimension a batch
  dimension): the buffers go to their experts with an all-to-all and come back with one;
- a dense mixture (``(B, T, D) x (E, D, F) -> (B, T, E, F)``): each expert group gathers its
  rows and reduce-scatters the gated sum, the bytes such a mixture needs;
- an expert weight split over a row axis (``fsdp``) is gathered for its matmuls, as ZeRO-3
  does, where XLA would reduce a grouped matmul's or a dense mixture's output over that axis;
- ``jax.lax.top_k`` (XLA's TopK custom call, which the partitioner runs on whole rows) is
  computed by a stable sort that stays split by rows (:func:`top_k_by_rows`): the same values
  and indices;
- under ``tensor``, an expert matmul's rows are split over ``tensor`` and its weight gathered
  there, where that moves fewer bytes (from the traced sizes) than reducing the routed buffers
  over ``tensor`` as splitting the experts' hidden units does;
- that split of the rows reaches the layers around the experts, whose weights XLA then gathers
  over ``tensor`` too. A matmul whose weight is split over ``tensor`` on its output features
  (Megatron's column-parallel layers) and larger than a row group's tokens keeps its output
  split there (its tokens gathered, fewer bytes than its weight).

Two styles no constraint can place are rewritten, where the traced program proves the rewrite
computes the same values: a sort of the whole batch's pairs with grouped matmuls runs as routed
pairs (:mod:`shardkit.parallel.sorted_sections`), and a Python loop over the experts as one
stacked mixture (:mod:`shardkit.parallel.expert_loops`).

Otherwise only shardings change: the values are the traced program's, and its remat and scan structure is
kept (inner programs are re-traced with the constraints inside). A program without expert
matmuls runs as traced.

Example:
  >>> import jax, jax.numpy as jnp
  >>> mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> def moe(params, x):  # a dense mixture: every expert runs every token
  ...     return jnp.einsum("btd,edf->btf", x, params["w"])
  >>> placed = place_experts(moe, {0: 0}, mesh)
  >>> params, x = {"w": jnp.ones((8, 4, 2))}, jnp.ones((16, 3, 4))
  >>> bool(jnp.allclose(jax.jit(placed)(params, x), moe(params, x)))
  True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax._src import source_info_util
from jax.extend.core import Jaxpr, Literal
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.parallel.embedding_gradients import var_shape
from shardkit.parallel.expert_loops import Loop, find_loops, stacked_term
from shardkit.parallel.expert_scans import ScannedLoop, find_scans, scan_outputs, stacked_body
from shardkit.parallel.experts import top_k_by_rows
from shardkit.parallel.input_gradients import bind_retraced, retraced_params
from shardkit.parallel.sorted_sections import find_sections, run_section

# Operations that hand an operand's values on with its dimensions in the same order (a weight
# keeps its expert dimension where it was).
_SAME_DIMS = frozenset(
    {"convert_element_type", "copy", "copy_p", "reduce_precision", "sharding_constraint", "slice", "dynamic_slice"}
)
_MATMULS = frozenset({"dot_general", "ragged_dot_general"})
_CASTS = frozenset({"convert_element_type", "copy", "copy_p"})
# Inner programs re-traced with constraints inside (their operands map one to one to its inputs).
_INNER = frozenset({"pjit", "jit", "closed_call", "remat2", "checkpoint"})


def place_experts(
    fn: Callable[..., Any],
    expert_dims: Mapping[int, int],
    mesh: Mesh,
    axis: str = "expert",
    grouped_specs: Mapping[int, PartitionSpec] | None = None,
    token_axes: Sequence[str] | None = None,
    tensor_dims: Mapping[int, int] | None = None,
) -> Callable[..., Any]:
    """``fn`` with the expert dimension of each expert matmul constrained to mesh axis ``axis``.

    Args:
      fn: a function whose first argument is the parameters (``apply(params, inputs, key)``).
      expert_dims: ``{leaf index: dimension}`` of the expert weights among the parameters'
        leaves in tree order: which of their dimensions indexes the experts.
      mesh: the mesh the step runs on.
      axis: the mesh axis the experts are split over.
      grouped_specs: ``{leaf index: spec}``: how a matmul reads each expert weight: its stored
        split without the axes that split the rows (ZeRO-3's gather). Left alone, XLA's
        partitioner reduces a grouped matmul's (``jax.lax.ragged_dot``) or a dense mixture's
        output over a row axis that splits the weight (ZeRO-3 turned into tensor parallelism).
      token_axes: the mesh axes that split the tokens' rows (default: ``axis`` alone), over
        which a sort-and-grouped-matmul section runs (:mod:`shardkit.parallel.sorted_sections`).
      tensor_dims: ``{leaf index: dimension}`` of the parameters split over ``tensor``: which
        dimension it splits (the Megatron layers kept so where the experts' rows split there).

    Returns:
      A function of the same arguments and results.
    """

    def placed(params: Any, *rest: Any) -> Any:
        flat, tree = jax.tree.flatten((params, *rest))
        n_params = len(jax.tree.leaves(params))
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
        closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*shapes)
        dims = [expert_dims.get(i) if i < n_params else None for i in range(len(flat))]
        specs = [(grouped_specs or {}).get(i) if i < n_params else None for i in range(len(flat))]
        tensor = [(tensor_dims or {}).get(i) if i < n_params else None for i in range(len(flat))]
        walk = _Placement(mesh, axis, tuple(token_axes) if token_axes is not None else (axis,))
        outs = walk.evaluate(closed.jaxpr, closed.consts, flat, dims, specs, tensor)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return placed


class _Placement:
    """Evaluates a jaxpr as traced, with the expert constraints placed; tracks, for each value
    that is (a view of) an expert weight, which of its dimensions indexes the experts."""

    def __init__(self, mesh: Mesh, axis: str, token_axes: tuple[str, ...]):
        self.mesh, self.axis, self.token_axes, self.placed = mesh, axis, token_axes, 0
        # Of the program being evaluated: the routed experts' outputs (their expert dimension),
        # and the expert weights as a grouped matmul reads them (through casts) with that split.
        self.routed: dict[Any, int] = {}
        self.grouped: dict[Any, PartitionSpec] = {}
        # Of the program being evaluated: the dimension ``tensor`` splits of each view of a
        # parameter split there.
        self.tensor: dict[Any, int] = {}

    def constrain(self, x: jax.Array, dim: int, axis: str | None = "") -> jax.Array:
        """``x`` with dimension ``dim`` split over the experts' axis (or over ``axis``; None: whole)."""
        return self._split(x, {dim: self.axis if axis == "" else axis})

    def evaluate(
        self,
        jaxpr: Jaxpr,
        consts: Sequence[Any],
        args: Sequence[Any],
        dims: Sequence[int | None],
        specs: Sequence[PartitionSpec | None],
        tensor: Sequence[int | None] | None = None,
    ) -> list:
        """``jaxpr`` evaluated with the constraints placed; an inner program's evaluation leaves
        the outer one's state as it found it. ``tensor``: the dimension of each input that
        ``tensor`` splits (None: none)."""
        outer = self.routed, self.grouped, self.tensor
        self.routed = {}
        self.grouped = {v: spec for v, spec in zip(jaxpr.invars, specs, strict=True) if spec is not None}
        self.tensor = {v: d for v, d in zip(jaxpr.invars, tensor or [None] * len(args), strict=True) if d is not None}
        try:
            return self._evaluate(jaxpr, consts, args, dims)
        finally:
            self.routed, self.grouped, self.tensor = outer

    def _evaluate(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], dims: Sequence[int | None]) -> list:
        env: dict[Any, Any] = {}
        # Expert dimensions of views of expert weights.
        where: dict[Any, int] = {}
        read = lambda v: v.val if isinstance(v, Literal) else env[v]
        for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), [*consts, *args], strict=True):
            env[v] = x
        for v, d in zip(jaxpr.invars, dims, strict=True):
            if d is not None:
                where[v] = d
        views = _expert_views(jaxpr, where) if where else {}
        sections = find_sections(jaxpr, views) if views else {}
        loops = find_loops(jaxpr, views) if views else {}
        scans = find_scans(jaxpr, views) if views else {}
        for eqn in jaxpr.eqns:
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                rewritten = self._rewritten(eqn, sections, loops, scans, read, views)
                outs = (
                    rewritten
                    if rewritten is not None
                    else self._equation(eqn, [read(v) for v in eqn.invars], [_get(where, v) for v in eqn.invars])
                )
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
            _follow(eqn, where)
            _follow(eqn, self.tensor)
            _follow(eqn, self.routed, elementwise=True)
            cast_of = _get(self.grouped, eqn.invars[0]) if eqn.primitive.name in _CASTS else None
            if cast_of is not None:
                self.grouped[eqn.outvars[0]] = cast_of
        return [read(v) for v in jaxpr.outvars]

    def _rewritten(
        self,
        eqn: Any,
        sections: dict[Any, Any],
        loops: dict[Any, Loop],
        scans: dict[int, ScannedLoop],
        read: Callable[[Any], Any],
        views: dict,
    ) -> list[jax.Array] | None:
        """The outputs of ``eqn`` where it ends a section of sorted experts, a loop over the
        experts or is a scan over them, computed as routed pairs or as one stacked mixture; else None."""
        out = eqn.outvars[0] if eqn.outvars else None
        if out in sections:
            routed = run_section(sections[out], read, self.mesh, self.axis, self.token_axes)
            if routed is None:
                return None
            self.placed += 1
            return [routed]
        if out in loops:
            loop = loops[out]
            fn, args, axes = stacked_term(loop, read)
            inputs = [*loop.stacked, *loop.shared]
            sources = [loop.stacked[v] if axis == 0 else None for v, axis in zip(inputs, axes, strict=True)]
            (terms,) = self._stacked(fn, args, sources, views)
            total = terms.sum(0)
            return [total if loop.init is None else read(loop.init) + total]
        if id(eqn) in scans:
            scan = scans[id(eqn)]
            steps, step_args, step_sources = stacked_body(scan, read)
            return scan_outputs(scan, read, self._stacked(steps, step_args, step_sources, views))
        return None

    def _stacked(
        self, fn: Callable[..., Any], args: list[Any], sources: list[tuple[Any, int, bool] | None], views: dict
    ) -> list[jax.Array]:
        """``fn(*args)`` (a loop's steps vectorised over the experts) evaluated with the experts
        placed; ``sources[i]`` is where argument ``i`` was stacked from (its experts first), if it was."""
        closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
        dims = [0 if s is not None and _get(views, s[0]) == s[1] else None for s in sources]
        specs = [self._stacked_spec(s) if d is not None and s is not None else None for s, d in zip(sources, dims)]
        return self.evaluate(closed.jaxpr, closed.consts, args, dims, specs)

    def _stacked_spec(self, stacked: tuple[Any, int, bool]) -> PartitionSpec | None:
        """How a matmul reads a loop's stacked weight (experts first): its grouped split moved."""
        src, dim, squeezed = stacked
        spec = _get(self.grouped, src)
        if spec is None:
            return None
        entries = list(tuple(spec)) + [None] * (len(var_shape(src)) - len(tuple(spec)))
        entries.insert(0, entries.pop(dim))
        if not squeezed:
            entries.insert(dim + 1, None)
        return PartitionSpec(*entries)

    def _equation(self, eqn: Any, args: list[Any], dims: list[int | None]) -> list[Any]:
        name = eqn.primitive.name
        params = eqn.primitive.get_bind_params(eqn.params)
        if name in _MATMULS:  # an expert weight read as its matmuls read it: gathered from the row axes
            args = [self._gathered(x, v) if i < 2 else x for i, (x, v) in enumerate(zip(args, eqn.invars, strict=True))]
        if name == "dot_general" and (dims[0] is not None) != (dims[1] is not None):
            return [self._dot(eqn, args, dims)]
        if name == "dot_general" and (column := self._column_parallel(eqn, args)) is not None:
            out = eqn.primitive.bind(*args, **params)
            return [self.constrain(out, column, "tensor")]
        if name == "dot_general":
            # Routed experts' outputs leave the experts (a combine): back to the tokens' split
            # first, so the backward pass finds them there too.
            args = [
                x if _get(self.routed, v) is None else self.constrain(x, self.routed[v], None)
                for x, v in zip(args, eqn.invars, strict=True)
            ]
        if name == "top_k":
            values, indices = top_k_by_rows(args[0], int(eqn.params["k"]))
            return [values, indices.astype(eqn.outvars[1].aval.dtype)]
        if name in _INNER or name == "scan":
            specs = [_get(self.grouped, v) for v in eqn.invars]
            tensor = [_get(self.tensor, v) for v in eqn.invars]
            inner_dims = _scan_dims(eqn, dims) if name == "scan" else dims
            inner_specs = _scan_dims(eqn, specs) if name == "scan" else specs
            inner_tensor = _scan_dims(eqn, tensor) if name == "scan" else tensor
            if any(d is not None for d in [*inner_dims, *inner_specs, *inner_tensor]) or name == "scan":
                rewritten = self._inner(eqn, params, inner_dims, inner_specs, inner_tensor)
                if rewritten is not None:
                    return bind_retraced(eqn, rewritten, args)
        ans = eqn.primitive.bind(*args, **params)
        return list(ans) if eqn.primitive.multiple_results else [ans]

    def _gathered(self, x: jax.Array, v: Any) -> jax.Array:
        spec = _get(self.grouped, v)
        if spec is None:
            return x
        self.placed += 1
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _dot(self, eqn: Any, args: list[Any], dims: list[int | None]) -> jax.Array:
        """A matmul of tokens with an expert weight, its expert dimension kept on the axis."""
        weight = 0 if dims[0] is not None else 1
        d = dims[weight]
        assert d is not None
        (contract, batch) = eqn.params["dimension_numbers"]
        tokens = args[1 - weight]
        out_dim = None
        token_dim = None
        if d in batch[weight]:
            i = list(batch[weight]).index(d)
            token_dim = batch[1 - weight][i]
            out_dim = i
            self.routed[eqn.outvars[0]] = i
        elif d not in contract[weight]:
            out_dim = _free_out_dim(eqn, weight, d)
        if out_dim is not None and (rows := self._rows_over_tensor(eqn, args, weight)) is not None:
            return self._dot_rows_over_tensor(eqn, args, weight, d, token_dim, out_dim, rows)
        if token_dim is not None:
            tokens = self.constrain(tokens, token_dim)
        operands = [args[0], tokens] if weight == 0 else [tokens, args[1]]
        out = eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params(eqn.params))
        return out if out_dim is None else self.constrain(out, out_dim)

    def _row_devices(self) -> int:
        """Devices the tokens' rows are split over (a row group is the tokens of ``1 /`` this)."""
        return math.prod(dict(self.mesh.shape).get(a, 1) for a in self.token_axes)

    def _column_parallel(self, eqn: Any, args: list[Any]) -> int | None:
        """The output dimension to keep split over ``tensor`` where ``eqn`` is a column-parallel
        matmul (a weight split over ``tensor`` on a free dimension, the other operand no weight's
        view) whose weight outweighs a row group's tokens; else None.

        Where the experts' rows split over ``tensor`` (:meth:`_rows_over_tensor`), XLA carries
        that split through the layers around them and meets their Megatron matmuls by gathering
        the weights over ``tensor`` (and again in the backward pass). Gathering the tokens instead,
        as Megatron's sequence parallelism does, moves the tokens' bytes in place of the
        weight's: the cheaper is kept (the attention of small heads keeps the weights gathered)."""
        if dict(self.mesh.shape).get("tensor", 1) == 1:
            return None
        split = [_get(self.tensor, v) for v in eqn.invars[:2]]
        (contract, batch) = eqn.params["dimension_numbers"]
        for w in (0, 1):
            d, tokens = split[w], args[1 - w]
            if d is None or split[1 - w] is not None or d in contract[w] or d in batch[w]:
                continue
            if args[w].size * args[w].dtype.itemsize >= tokens.size * tokens.dtype.itemsize / self._row_devices():
                return _free_out_dim(eqn, w, d)
        return None

    def _rows_over_tensor(self, eqn: Any, args: list[Any], weight: int) -> tuple[int, int] | None:
        """``(token dimension, output dimension)`` to split over ``tensor`` in place of the
        experts' hidden units, where that moves fewer bytes; else None.

        Split over their hidden units, an expert matmul's partial sums (or its input's gradient)
        are reduced over ``tensor`` at the routed buffers' size, twice a matmul (forward and
        backward; k x capacity x the tokens' for GShard's buffers). Split over the rows instead,
        the expert weights are gathered over ``tensor`` and their gradients reduce-scattered:
        about three times the weights an expert group holds. The cheaper is chosen here, from
        the traced sizes (Megatron-Core's expert tensor parallelism of 1 where it wins)."""
        t = dict(self.mesh.shape).get("tensor", 1)
        if t == 1:
            return None
        (contract, batch) = eqn.params["dimension_numbers"]
        tok = 1 - weight
        tokens, out = args[tok], eqn.outvars[0].aval
        free = [k for k in range(tokens.ndim) if k not in contract[tok] and k not in batch[tok]]
        splittable = [k for k in free if tokens.shape[k] % t == 0]
        if not splittable:
            return None
        n = dict(self.mesh.shape).get(self.axis, 1)
        weight_bytes = args[weight].size * args[weight].dtype.itemsize / n  # an expert group's
        row_devices = self._row_devices()
        routed_bytes = max(tokens.size * tokens.dtype.itemsize, math.prod(out.shape) * out.dtype.itemsize)
        routed_bytes /= row_devices
        if 3 * weight_bytes >= 2 * routed_bytes:
            return None
        k = max(splittable, key=lambda k: tokens.shape[k])
        return k, _free_out_dim(eqn, tok, k)

    def _dot_rows_over_tensor(
        self, eqn: Any, args: list[Any], weight: int, d: int, token_dim: int | None, out_dim: int, rows: tuple[int, int]
    ) -> jax.Array:
        """The expert matmul with its weight whole but for the experts, its tokens' rows split
        over ``tensor`` (and their experts over the axis, where it is a batch dimension)."""
        w, tokens = args[weight], args[1 - weight]
        w = self._split(w, {d: self.axis}, whole=True)
        tokens = self._split(tokens, {rows[0]: "tensor"} | ({token_dim: self.axis} if token_dim is not None else {}))
        operands = [w, tokens] if weight == 0 else [tokens, w]
        out = eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params(eqn.params))
        return self._split(out, {out_dim: self.axis, rows[1]: "tensor"})

    def _split(self, x: jax.Array, axes: Mapping[int, str | None], whole: bool = False) -> jax.Array:
        """``x`` constrained with dimension ``k`` over ``axes[k]``, the others whole or left alone."""
        rest = None if whole else PartitionSpec.UNCONSTRAINED
        spec = [axes.get(k, rest) for k in range(x.ndim)]
        self.placed += 1
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def _inner(
        self,
        eqn: Any,
        params: dict[str, Any],
        dims: list[int | None],
        specs: list[PartitionSpec | None],
        tensor: list[int | None],
    ) -> dict[str, Any] | None:
        """The equation's parameters with its inner program re-traced with constraints inside,
        or None where it places none."""
        before = self.placed
        rewritten = retraced_params(
            eqn, params, lambda jaxpr, consts, xs: self.evaluate(jaxpr, consts, xs, dims, specs, tensor)
        )
        return None if self.placed == before else rewritten


def _free_out_dim(eqn: Any, operand: int, dim: int) -> int:
    """The output dimension of matmul ``eqn`` that free dimension ``dim`` of its operand becomes
    (dot_general's output: batch dimensions, then the left operand's free ones, then the right's)."""
    (contract, batch) = eqn.params["dimension_numbers"]
    free = [k for k in range(eqn.invars[operand].aval.ndim) if k not in contract[operand] and k not in batch[operand]]
    lhs_free = eqn.invars[0].aval.ndim - len(contract[0]) - len(batch[0])
    return len(batch[0]) + (lhs_free if operand == 1 else 0) + free.index(dim)


def _expert_views(jaxpr: Jaxpr, where: dict[Any, int]) -> dict[Any, int]:
    """The expert dimension of every view of an expert weight in ``jaxpr``, from its inputs'."""
    views = dict(where)
    for eqn in jaxpr.eqns:
        _follow(eqn, views)
    return views


def _follow(eqn: Any, where: dict[Any, int], elementwise: bool = False) -> None:
    """Record where an expert dimension went through ``eqn``: through views (a weight's cast,
    slice, transpose, squeeze, reshape of later dimensions), and with ``elementwise`` through
    operations whose operands are scalars or shaped as their one output (an activation)."""
    if not eqn.outvars or not eqn.invars:
        return
    out, name = eqn.outvars[0], eqn.primitive.name
    d = _get(where, eqn.invars[0])
    moved = None if d is None else _through_view(eqn, d)
    if moved is not None:
        where[out] = moved
    elif elementwise and len(eqn.outvars) == 1 and name not in _MATMULS:
        shape = out.aval.shape
        if all(getattr(v.aval, "shape", ()) in ((), shape) for v in eqn.invars):
            found = (_get(where, v) for v in eqn.invars)
            d = next((k for k in found if k is not None), None)
            if d is not None:
                where[out] = d


def _through_view(eqn: Any, d: int) -> int | None:
    """The output dimension a view's input dimension ``d`` became (None: not a view, or gone)."""
    name, out = eqn.primitive.name, eqn.outvars[0]
    if name in _SAME_DIMS:
        return d
    if name == "transpose":
        return list(eqn.params["permutation"]).index(d)
    if name == "squeeze":
        dropped = eqn.params["dimensions"]
        return None if d in dropped else d - sum(1 for k in dropped if k < d)
    if name == "broadcast_in_dim":
        return eqn.params["broadcast_dimensions"][d]
    if name == "reshape":
        before, after = eqn.invars[0].aval.shape, out.aval.shape
        # The same leading dimensions up to and including the experts': still there.
        return d if tuple(before[: d + 1]) == tuple(after[: d + 1]) else None
    return None


def _get(where: dict[Any, Any], v: Any) -> Any:
    return None if isinstance(v, Literal) else where.get(v)


def _scan_dims(eqn: Any, dims: list[Any]) -> list[Any]:
    """A scan's constants keep their expert dimension (or split), each stacked input loses its
    leading dimension, the carry is nobody's weight."""
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    out: list[Any] = []
    for j, d in enumerate(dims):
        if j < n_consts:
            out.append(d)
        elif j < n_consts + n_carry or d is None or (isinstance(d, int) and d == 0):
            out.append(None)
        elif isinstance(d, int):
            out.append(d - 1)
        else:
            out.append(PartitionSpec(*tuple(d)[1:]))
    return out
