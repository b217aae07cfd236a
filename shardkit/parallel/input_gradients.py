"""One reduction for the input gradient of several projections of one input, as Megatron reduces.

A layer that projects one input ``x`` with separate weights (``q`` and ``kv``, ``gate`` and ``up``,
Linen's ``query``, ``key`` and ``value``) gets ``dx = dq @ Wq.T + dkv @ Wkv.T`` in the backward
pass. Under ``tensor`` the weights are split on their output features, so each product is a
partial sum over ``tensor``, and XLA's partitioner all-reduces each product before the sum: one
all-reduce per projection where Megatron, whose layers fuse the projections, reduces once. XLA's
GPU pipeline can re-associate ``all-reduce(a) + all-reduce(b)`` afterwards; its CPU pipeline
cannot, and neither pass sees a model whose sum is not adjacent to both reductions.

:func:`reduce_input_gradients_once` rewrites the traced gradient computation instead: where an
input's cotangent is the sum of products of cotangents with weights split over ``tensor`` on a
contracted dimension, it becomes one product of the concatenated cotangents with the concatenated
weights. Each operand is first reshaped to ``(t, k / t)`` on the contracted features, the split
dimension first, so every device concatenates its own shards and nothing moves: the
partitioner then sees one contraction split over ``tensor`` and reduces once. The arithmetic is
the same sum in another order (float rounding differs at the last bit); the forward pass and the
weights' gradients are untouched.

Only weights whose splitting is known are rewritten: parameters reached from the step's inputs
through casts, nested ``jit``, ``remat`` and ``scan`` (a scanned stack loses its leading
dimension), read from the sharding plan. Anything else is evaluated as traced.

The same pass reduces each embedding table's gradient onto its shards
(:mod:`shardkit.parallel.embedding_gradients`): a scatter into zeros at the positions a lookup
gathered from a parameter's table.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def loss(w, x):
  ...     return (jnp.tanh(x @ w["q"]).sum() + jnp.sin(x @ w["kv"]).sum())
  >>> w = {"q": jnp.ones((4, 8)), "kv": jnp.ones((4, 4))}
  >>> x = jnp.ones((2, 4))
  >>> splits = lambda w, x: ({"q": (1, 2), "kv": (1, 2)}, None)  # output features over tensor=2
  >>> once = reduce_input_gradients_once(jax.grad(loss, argnums=1), splits)
  >>> bool(jnp.allclose(once(w, x), jax.grad(loss, argnums=1)(w, x)))
  True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var
from jax.sharding import PartitionSpec

from shardkit.parallel.embedding_gradients import Tables, table_gradient, var_dtype, var_shape

# Per dimension of a value: into how many contiguous blocks ``tensor`` splits it (1: whole);
# None where the value is not a known weight.
Split = tuple[int, ...] | None

# Primitives that hand their operand on unchanged in layout: a weight stays a weight. Not a sharding
# constraint: it may gather what the plan split (shardkit's GPT gathers its table's features).
_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
# Primitives whose inner program is evaluated again, rewritten, when it holds a sum to rewrite.
_INNER = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}


@dataclass(frozen=True)
class _Member:
    """One product ``cotangent x weight`` of a sum: the dot, which operand is the weight (0 or 1),
    the weight's contracted dimension split over ``tensor`` and into how many blocks."""

    dot: JaxprEqn
    weight: int
    split_dim: int
    factor: int


@dataclass(frozen=True)
class _Sum:
    """A sum of products to compute as one: its members, its other addends, the equation that
    writes the sum (``root``) and the splitting factor."""

    members: tuple[_Member, ...]
    others: tuple[Any, ...]
    root: JaxprEqn
    factor: int


@dataclass
class _Plan:
    """What to rewrite in one program: the sums by their root equation, the equations they
    replace, and the inner programs (by equation) that hold sums of their own."""

    tables: Tables | None = None
    sums: dict[int, _Sum] = field(default_factory=dict)
    replaced: set[int] = field(default_factory=set)
    scatters: dict[int, PartitionSpec] = field(default_factory=dict)  # table gradients, by their sharding
    inner: dict[int, _Plan] = field(default_factory=dict)
    out_splits: list[Split] = field(default_factory=list)
    out_indices: list[PartitionSpec | None] = field(default_factory=list)  # outputs that index a known table

    @property
    def empty(self) -> bool:
        return not self.sums and not self.scatters and not self.inner


def reduce_input_gradients_once(
    fn: Callable[..., Any], splits_of: Callable[..., Any], tables: Tables | None = None
) -> Callable[..., Any]:
    """``fn`` with the input gradients of split projections of one input reduced once.

    Args:
      fn: a function that computes gradients (``jax.grad`` of a loss, or a step's gradients).
      splits_of: ``splits_of(*args)`` -> a tree like ``args`` whose leaves are tuples (per
        dimension of that argument, into how many contiguous blocks ``tensor`` splits it) or None
        for arguments that are not weights. A None subtree stands for all its leaves.
      tables: where given, each embedding table's gradient (a scatter into zeros at the positions
        a lookup gathered from a parameter) is also reduced onto its shards
        (:mod:`shardkit.parallel.embedding_gradients`).

    Returns:
      A function with ``fn``'s signature and results (equal up to float rounding).
    """

    def once(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        leaves = jax.tree.leaves(args)
        splits = _flat_leaves(splits_of(*args), args)
        consts = [None] * len(closed.jaxpr.constvars)
        table_specs = _flat_leaves(tables.specs_of(*args), args) if tables else []
        plan = _plan(closed.jaxpr, consts + splits, tables, consts + table_specs)
        outs = _evaluate(closed.jaxpr, plan, closed.consts, leaves)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return once


def _flat_leaves(tree: Any, args: Any) -> list[Any]:
    """One entry of ``tree`` (a split, a ``PartitionSpec`` or None; ``tree`` is shaped like
    ``args``, a None subtree standing for all its leaves) per leaf of ``args``. A subtree whose
    leaves do not match its argument's gives None for each: nothing is rewritten there."""
    out: list[Any] = []
    for sub_tree, sub_args in zip(tree, args, strict=True):
        n = len(jax.tree.leaves(sub_args))
        flat = (
            [] if sub_tree is None else jax.tree.leaves(sub_tree, is_leaf=lambda s: s is None or isinstance(s, tuple))
        )
        out.extend(flat if len(flat) == n else [None] * n)
    return out


def _plan(
    jaxpr: Jaxpr,
    in_splits: Sequence[Split],
    tables: Tables | None = None,
    in_tables: Sequence[Any] = (),
    in_indices: Sequence[Any] = (),
) -> _Plan:
    """Which sums of one program (and of its inner programs) to compute as one product, and which
    table gradients to reduce onto their shards.

    ``in_tables``: per input, the sharding of the parameter it is (None: not one);
    ``in_indices``: per input, the sharding of the table it holds gathered positions of."""
    plan = _Plan(tables)
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    inputs = list(jaxpr.constvars) + list(jaxpr.invars)
    known: dict[Var, Split] = {v: s for v, s in zip(inputs, in_splits) if s}
    params: dict[Var, PartitionSpec] = {v: s for v, s in zip(inputs, in_tables) if s is not None}
    indices: dict[Var, PartitionSpec] = {v: s for v, s in zip(inputs, in_indices) if s is not None}
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        first = None if not eqn.invars or isinstance(eqn.invars[0], Literal) else eqn.invars[0]
        if name in _PASS_THROUGH and first is not None:
            if first in known:
                known[eqn.outvars[0]] = known[first]
            if first in params:
                params[eqn.outvars[0]] = params[first]
        elif name in _INNER and _INNER[name] in eqn.params:
            inner_jaxpr = _open(eqn.params[_INNER[name]])
            pad = [None] * len(inner_jaxpr.constvars)
            inner = _plan(
                inner_jaxpr,
                pad + [_get(known, v) for v in eqn.invars],
                tables,
                pad + [_get(params, v) for v in eqn.invars],
                pad + [_get(indices, v) for v in eqn.invars],
            )
            _note_inner(plan, known, i, eqn, inner)
            indices.update({v: s for v, s in zip(eqn.outvars, inner.out_indices) if s is not None})
        elif name == "scan":
            inner = _plan(eqn.params["jaxpr"].jaxpr, _scan_in_splits(eqn, known), tables)
            _note_inner(plan, known, i, eqn, inner, scan=True)
        elif name == "gather" and first is not None and first in params and not isinstance(eqn.invars[1], Literal):
            indices[eqn.invars[1]] = params[first]  # positions looked up in a parameter's table
        elif name == "scatter-add" and tables is not None and _get(indices, eqn.invars[1]) is not None:
            spec = tables.spec_for(
                eqn, producer.get(first) if first is not None else None, _get(indices, eqn.invars[1])
            )
            if spec is not None:
                plan.scatters[i] = spec
    _find_sums(jaxpr, known, plan)
    plan.out_splits = [_get(known, v) for v in jaxpr.outvars]
    plan.out_indices = [_get(indices, v) for v in jaxpr.outvars]
    return plan


def _get(info: dict[Var, Any], v: Any) -> Any:
    return None if isinstance(v, Literal) else info.get(v)


def _open(program: Any) -> Jaxpr:
    return program.jaxpr if isinstance(program, ClosedJaxpr) else program


def _scan_in_splits(eqn: JaxprEqn, known: dict[Var, Split]) -> list[Split]:
    """A scan's constants keep their splits, each stacked input loses its leading dimension, the
    carry is nobody's weight."""
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    body = eqn.params["jaxpr"]
    splits: list[Split] = [None] * len(body.jaxpr.constvars)
    for j, v in enumerate(eqn.invars):
        s = _get(known, v)
        if j < n_consts:
            splits.append(s)
        elif j < n_consts + n_carry:
            splits.append(None)
        else:
            splits.append(s[1:] if s and s[0] == 1 else None)
    return splits


def _note_inner(plan: _Plan, known: dict[Var, Split], i: int, eqn: JaxprEqn, inner: _Plan, scan: bool = False) -> None:
    """Record an inner program's rewrites, and the weights it hands back (a scan's stacked
    outputs gain a leading whole dimension)."""
    if not inner.empty:
        plan.inner[i] = inner
    outs: list[Split] = list(inner.out_splits)
    if scan:
        n_carry = eqn.params["num_carry"]
        carried: list[Split] = [None] * n_carry
        outs = carried + [(1, *s) if s else None for s in outs[n_carry:]]
    for v, s in zip(eqn.outvars, outs):
        if s:
            known[v] = s


def _find_sums(jaxpr: Jaxpr, known: dict[Var, Split], plan: _Plan) -> None:
    """Sums (trees of ``add_any``) of two or more products of a cotangent with a known weight."""
    producer = {v: (i, e) for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    users: dict[Var, list[JaxprEqn]] = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, Literal):
                users.setdefault(v, []).append(e)
    uses = {v: len(u) for v, u in users.items()}
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            uses[v] = uses.get(v, 0) + 1

    def single_use_by(v: Any, name: str) -> tuple[int, JaxprEqn] | None:
        if isinstance(v, Literal) or uses.get(v) != 1 or v not in producer:
            return None
        i, e = producer[v]
        return (i, e) if e.primitive.name == name else None

    def is_inner_add(v: Var) -> bool:
        return uses.get(v) == 1 and [e.primitive.name for e in users.get(v, [])] == ["add_any"]

    for root_index, root in enumerate(jaxpr.eqns):
        if root.primitive.name != "add_any" or is_inner_add(root.outvars[0]):
            continue
        adds, leaves = [], []
        stack = list(root.invars)
        while stack:
            v = stack.pop()
            inner_add = single_use_by(v, "add_any")
            if inner_add:
                adds.append(inner_add[0])
                stack.extend(inner_add[1].invars)
            else:
                leaves.append(v)
        found = _members(leaves, known, single_use_by)
        if found is None:
            continue
        factor, group, others = found
        plan.sums[root_index] = _Sum(tuple(m for _, m in group), tuple(others), root, factor)
        plan.replaced.update([root_index, *adds, *(i for i, _ in group)])


def _members(
    leaves: list[Any], known: dict[Var, Split], single_use_by: Callable
) -> tuple[int, list[tuple[int, _Member]], list[Any]] | None:
    """The largest set (two or more) of addends that are products of a cotangent with a weight
    split over ``tensor`` on one contracted dimension, with the same shape of result: ``(factor,
    [(equation index, member)], other addends)``; None when there is none."""
    groups: dict[tuple, list[tuple[int, _Member]]] = {}
    for v in leaves:
        found = single_use_by(v, "dot_general")
        member = _member(found[1], known) if found else None
        if member is not None:
            groups.setdefault(_compatibility(member), []).append((found[0], member))
    if not groups:
        return None
    group = max(groups.values(), key=len)
    if len(group) < 2:
        return None
    in_group = {m.dot.outvars[0] for _, m in group}
    return group[0][1].factor, group, [v for v in leaves if isinstance(v, Literal) or v not in in_group]


def _member(dot: JaxprEqn, known: dict[Var, Split]) -> _Member | None:
    """The dot as a member: exactly one operand a known weight, no batch dimensions, exactly one
    of the weight's contracted dimensions split."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dot.params["dimension_numbers"]
    if lhs_b or rhs_b:
        return None
    sides = [_get(known, v) for v in dot.invars]
    if (sides[0] is None) == (sides[1] is None):
        return None
    weight = 0 if sides[0] else 1
    split = sides[weight]
    assert split is not None
    contracted = (lhs_c, rhs_c)[weight]
    split_dims = [d for d in contracted if split[d] > 1]
    if len(split_dims) != 1 or any(split[d] > 1 for d in range(len(split)) if d not in contracted):
        return None
    factor = split[split_dims[0]]
    if math.prod(var_shape(dot.invars[weight])[d] for d in contracted) % factor:
        return None
    return _Member(dot, weight, split_dims[0], factor)


def _compatibility(m: _Member) -> tuple:
    """Members that can share one product: same factor, weight side, free shapes, result type
    and dot options."""
    (lhs_c, rhs_c), _ = m.dot.params["dimension_numbers"]
    w, ct = m.dot.invars[m.weight], m.dot.invars[1 - m.weight]
    w_c, ct_c = (lhs_c, rhs_c) if m.weight == 0 else (rhs_c, lhs_c)
    w_free = tuple(s for d, s in enumerate(var_shape(w)) if d not in w_c)
    ct_free = tuple(s for d, s in enumerate(var_shape(ct)) if d not in ct_c)
    params = m.dot.params
    return (
        m.factor,
        m.weight,
        w_free,
        ct_free,
        str(var_dtype(m.dot.outvars[0])),
        str(var_dtype(ct)),
        str(var_dtype(w)),
        str(params.get("precision")),
        str(params.get("preferred_element_type")),
    )


def _evaluate(jaxpr: Jaxpr, plan: _Plan, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate ``jaxpr`` as :func:`jax.core.eval_jaxpr` does, computing each planned sum as one
    product and evaluating inner programs with sums of their own rewritten."""
    env: dict[Var, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args), strict=True):
        env[v] = x
    for i, eqn in enumerate(jaxpr.eqns):
        if i in plan.replaced and i not in plan.sums:
            continue
        # A sum is named after its first product's op, so reports attribute it to the user's module.
        source = plan.sums[i].members[0].dot.source_info if i in plan.sums else eqn.source_info
        name_stack = source_info_util.current_name_stack() + source.name_stack
        with source_info_util.user_context(source.traceback, name_stack=name_stack), eqn.ctx.manager:
            if i in plan.sums:
                outs = [_one_product(plan.sums[i], read)]
            elif i in plan.scatters:
                assert plan.tables is not None
                outs = [table_gradient(eqn, plan.scatters[i], plan.tables, read(eqn.invars[1]), read(eqn.invars[2]))]
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                if i in plan.inner:
                    params = _rewritten_params(eqn, params, plan.inner[i])
                    args_in = [read(v) for v in eqn.invars]
                    outs = bind_retraced(eqn, params, args_in)
                else:
                    ans = eqn.primitive.bind(*[read(v) for v in eqn.invars], **params)
                    outs = ans if eqn.primitive.multiple_results else [ans]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _rewritten_params(eqn: JaxprEqn, params: dict[str, Any], inner: _Plan) -> dict[str, Any]:
    """The equation's parameters with its inner program re-traced through :func:`_evaluate`."""
    return retraced_params(eqn, params, lambda jaxpr, consts, xs: _evaluate(jaxpr, inner, consts, xs))


def retraced_params(
    eqn: JaxprEqn, params: dict[str, Any], evaluate: Callable[[Jaxpr, Sequence[Any], Sequence[Any]], list[Any]]
) -> dict[str, Any]:
    """The parameters of a call-like or scan equation with its inner program re-traced by
    ``evaluate(jaxpr, consts, args)`` (an interpreter that rewrites as it goes); bind them with
    :func:`bind_retraced`."""
    key = "jaxpr" if eqn.primitive.name == "scan" else _INNER[eqn.primitive.name]
    program = params[key]
    closed = program if isinstance(program, ClosedJaxpr) else ClosedJaxpr(program, ())
    avals = [v.aval for v in closed.jaxpr.invars]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals]
    traced = jax.make_jaxpr(lambda *xs: evaluate(closed.jaxpr, closed.consts, xs))(*specs)
    if isinstance(program, ClosedJaxpr):
        return {**params, key: traced}
    if traced.consts:  # an open inner program takes no constants: they become leading inputs
        return {**params, key: traced, "_consts": traced.consts}
    return {**params, key: traced.jaxpr}


def bind_retraced(eqn: JaxprEqn, params: dict[str, Any], args: list[Any]) -> list[Any]:
    """Bind ``eqn``'s primitive with :func:`retraced_params`' parameters to ``args``."""
    consts = params.pop("_consts", None)
    if consts is not None:
        from jax._src.interpreters import partial_eval as pe

        key = _INNER[eqn.primitive.name]
        params[key] = pe.convert_constvars_jaxpr(params[key].jaxpr)
        args = [*consts, *args]
    ans = eqn.primitive.bind(*args, **params)
    return ans if eqn.primitive.multiple_results else [ans]


def _one_product(s: _Sum, read: Callable[[Any], Any]) -> jax.Array:
    """``sum(cotangent_i x weight_i) + others`` as one contraction over the concatenated,
    ``(factor, k / factor)``-reshaped features: each device concatenates its own shards."""
    cts, ws = [], []
    for m in s.members:
        (lhs_c, rhs_c), _ = m.dot.params["dimension_numbers"]
        w, ct = read(m.dot.invars[m.weight]), read(m.dot.invars[1 - m.weight])
        w_c, ct_c = (lhs_c, rhs_c) if m.weight == 0 else (rhs_c, lhs_c)
        pairs = sorted(zip(w_c, ct_c), key=lambda p: (p[0] != m.split_dim, p[0]))  # the split one first
        w_order, ct_order = [p[0] for p in pairs], [p[1] for p in pairs]
        ct_free = [d for d in range(ct.ndim) if d not in ct_c]
        w_free = [d for d in range(w.ndim) if d not in w_c]
        k = math.prod(w.shape[d] for d in w_c)
        cts.append(
            jnp.transpose(ct, ct_free + ct_order).reshape(*(ct.shape[d] for d in ct_free), s.factor, k // s.factor)
        )
        ws.append(jnp.transpose(w, w_order + w_free).reshape(s.factor, k // s.factor, *(w.shape[d] for d in w_free)))
    first = s.members[0]
    n_free = cts[0].ndim - 2
    out = lax.dot_general(
        jnp.concatenate(cts, axis=-1),
        jnp.concatenate(ws, axis=1),
        (((n_free, n_free + 1), (0, 1)), ((), ())),
        precision=first.dot.params.get("precision"),
        preferred_element_type=first.dot.params.get("preferred_element_type"),
    )
    if first.weight == 0:  # the dot wrote the weight's free dimensions first
        out = jnp.transpose(out, [*range(n_free, out.ndim), *range(n_free)])
    out = out.astype(var_dtype(s.root.outvars[0]))
    for v in s.others:
        out = out + read(v)
    return out
