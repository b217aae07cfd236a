"""A user's sort-and-grouped-matmul experts, found in the traced program and run as routed pairs.

MegaBlocks-style JAX code sorts every (token, choice) pair of the batch by expert (``argsort``),
gathers the tokens' rows in that order, runs them through ``jax.lax.ragged_dot`` grouped matmuls
(``bincount`` of the experts as group sizes) and scatters the outputs back to pair order. Under an
``expert`` axis XLA's partitioner runs that sort, gather and scatter over the whole batch, and the
grouped matmuls with every expert's weights: 5 to 18 times the bytes expert parallelism moves.

Yet the values do not depend on the sort: pair ``p``'s output is the row-wise function ``F`` of the
section (the grouped matmuls and what lies between them) on token ``h(p)``'s row under expert
``K[p]``. :func:`find_sections` proves that from the program:

1. ``order`` is an argsort of the keys ``K (P,)``, which are a ``top_k``'s (or ``argmax``'s)
   indices over ``E`` experts, so every key is an expert;
2. the rows are a gather of a tokens array ``X (N, ...)`` at ``h(order)``, ``h`` elementwise;
3. the group sizes are the histogram of ``K`` (a scatter-add of ones at ``K``);
4. from the gathered rows to the scattered values every operation acts on each row alone
   (elementwise, within a row, a matmul with a weight shared by all rows, or a grouped matmul of
   an expert weight with those group sizes);
5. the values are scattered at ``s(order)`` with ``s`` elementwise and ``s(iota) = iota``.

The indices ``h`` and ``s`` are evaluated on ``iota`` at trace time, so ``Y[p] = F(X[h(p)], K[p])``
holds for every value of the keys. :func:`run_section` then computes ``Y`` as shardkit's own
sorted dispatch does (:func:`shardkit.parallel.sorted_experts.routed_pairs`): each device sorts its
own pairs, one all-to-all takes them to their experts' devices, ``F`` runs there on the rows of
its local experts (the section's own operations, re-evaluated at the new row count with the local
weights and group sizes), and one all-to-all brings them back. Nothing is dropped: with pairs of
a ``top_k`` (a token reaches an expert once) a device sends each other at most its tokens x
``min(k, E / n)`` rows, else all its pairs.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def moe(w, x):  # (N, D) tokens, top-1 of 4 experts, sorted, grouped, put back
  ...     keys = jax.lax.top_k(x @ w["router"], 1)[1].reshape(-1)
  ...     order = jnp.argsort(keys)
  ...     out = jax.lax.ragged_dot(x[order], w["experts"], jnp.bincount(keys, length=4))
  ...     return jnp.zeros_like(out).at[order].set(out)
  >>> w = {"router": jnp.ones((3, 4)), "experts": jnp.ones((4, 3, 2))}
  >>> closed = jax.make_jaxpr(moe)(w, jnp.ones((8, 3)))
  >>> [s.n_experts for s in find_sections(closed.jaxpr, {closed.jaxpr.invars[0]: 0}).values()]
  [4]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var
from jax.sharding import Mesh, PartitionSpec

from shardkit.core.partition import varying_axes, varying_over
from shardkit.parallel.embedding_gradients import var_dtype, var_shape
from shardkit.parallel.grouped_matmul import grouped_matmul
from shardkit.parallel.sorted_experts import _Split, by_expert, routed_pairs, slots_per_destination

# Operations on each element alone (their other operands scalars).
_ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "rem", "max", "min", "pow", "integer_pow", "exp", "exp2", "log", "log1p", "expm1"}
    | {"tanh", "logistic", "erf", "erfc", "erf_inv", "neg", "sign", "abs", "sqrt", "rsqrt", "cbrt", "square"}
    | {"sin", "cos", "tan", "atan2", "floor", "ceil", "round", "is_finite", "select_n", "clamp", "nextafter"}
    | {"convert_element_type", "reduce_precision", "copy", "copy_p", "ne", "eq", "lt", "le", "gt", "ge"}
    | {"and", "or", "not", "xor"}
)
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"})
# Calls whose inner program is checked and evaluated in place (the call itself is inlined).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}
_CALLS |= {"remat2": "jaxpr", "checkpoint": "jaxpr"}
# A jaxpr variable (jax.extend.core.Var), typed loosely: its aval's shape is not in JAX's types.
JVar = Any
# Parameters that hold an output's shape, whose rows become the new row count.
_SHAPE_PARAMS = ("shape", "new_sizes", "limit_indices", "slice_sizes")


@dataclasses.dataclass(frozen=True, eq=False)
class Section:
    """A sort-and-grouped-matmul section: ``out[p] = F(tokens[source[p]], K[p])``.

    ``choices`` is the ``(..., k)`` top-k indices the keys flatten when ``source[p] = p // k``
    (a token's choices are distinct experts), else None (``k`` is then 1: each pair alone).
    ``eqns`` compute ``result`` from ``rows`` (``m`` of them), ``sizes``, the expert ``weights``
    (``{var: expert dimension}``) and ``inputs`` (values without a row dimension)."""

    out: JVar
    tokens: JVar
    source: np.ndarray
    keys: JVar
    choices: JVar | None
    k: int
    rows: JVar
    sizes: JVar
    result: JVar
    eqns: tuple[JaxprEqn, ...]
    weights: Mapping[JVar, int]
    inputs: tuple[JVar, ...]
    n_experts: int
    m: int


def find_sections(jaxpr: Jaxpr, expert_dims: Mapping[JVar, int]) -> dict[JVar, Section]:
    """The sections of ``jaxpr`` (this level, not inside its calls), by the variable they write.

    Args:
      jaxpr: a traced program.
      expert_dims: ``{var: dimension}``: the values that are expert weights and their expert dimension.

    Returns:
      ``{output: Section}`` (the value the section writes back in pair order); empty where no
      section is proved.
    """
    if not any(e.primitive.name == "ragged_dot_general" for e in jaxpr.eqns):
        return {}  # no grouped matmul at this level: nothing to prove
    outer = {*jaxpr.invars, *jaxpr.constvars, *(v for e in jaxpr.eqns for v in e.outvars)}
    jaxpr = _helpers_inlined(jaxpr)
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    found: dict[JVar, Section] = {}
    for eqn in jaxpr.eqns:
        argsort = _argsort(eqn, producers)
        section = None if argsort is None else _section(jaxpr, producers, *argsort, expert_dims)
        if section is None:
            continue
        # What the placement reads and writes must be values of this level, not of a helper.
        reads = [section.out, section.tokens, section.keys, *section.weights, *section.inputs]
        if all(v in outer for v in reads) and (section.choices is None or section.choices in outer):
            found[section.out] = section
    return found


def _helpers_inlined(jaxpr: Jaxpr) -> Jaxpr:
    """``jaxpr`` with each call of a helper without matmuls (``jnp.take``, ``jnp.where``,
    ``argsort``, ``clip``) replaced by its equations, its inputs and outputs renamed to the call's."""
    eqns: list[JaxprEqn] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in ("pjit", "jit") or eqn.params["jaxpr"].consts or _has_matmul(_inner(eqn).jaxpr):
            eqns.append(eqn)
            continue
        inner = _helpers_inlined(eqn.params["jaxpr"].jaxpr)
        # JAX reuses one traced helper for every call alike: each call's values get fresh names.
        rename: dict[Any, Any] = {v: Var(v.aval) for e in inner.eqns for v in e.outvars}
        rename |= dict(zip(inner.invars, eqn.invars, strict=True))
        for inner_out, out in zip(inner.outvars, eqn.outvars, strict=True):
            if isinstance(inner_out, Var) and inner_out not in inner.invars:
                rename[inner_out] = out
            else:  # an input or a literal handed straight out: keep the call
                eqns.append(eqn)
                break
        else:
            eqns += [_renamed(e, rename) for e in inner.eqns]
    return jaxpr.replace(eqns=eqns)


def _renamed(eqn: JaxprEqn, rename: Mapping[Any, Any]) -> JaxprEqn:
    sub = lambda v: rename.get(v, v) if isinstance(v, Var) else v
    return eqn.replace(invars=[sub(v) for v in eqn.invars], outvars=[sub(v) for v in eqn.outvars])


def _has_matmul(jaxpr: Jaxpr) -> bool:
    return any(
        e.primitive.name in ("dot_general", "ragged_dot_general")
        or (e.primitive.name in _CALLS and _has_matmul(_inner(e).jaxpr))
        for e in jaxpr.eqns
    )


def run_section(
    section: Section, read: Callable[[JVar], Any], mesh: Mesh, axis: str, token_axes: Sequence[str]
) -> jax.Array | None:
    """The section's output computed by routed pairs (see the module's docstring), or None where
    the mesh cannot split it (the tokens' rows not divisible over ``axis``, or the experts)."""
    x = read(section.tokens)
    n_tokens, feature_shape = x.shape[0], x.shape[1:]
    shape = dict(mesh.shape)
    n = shape.get(axis, 1)
    if any(t == jax.sharding.AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types):
        return None  # inside another island (a pipeline's stages): as traced
    count = n_tokens if section.choices is not None else len(section.source)
    # The pairs are independent: every device takes its own, over the tokens' axes first and
    # then the others but a pipeline's (tensor=2,expert=4 on the zoo's: 1.44x -> 1.22x the bound).
    rows_over: list[str] = []
    for a in [*token_axes, *(a for a in mesh.axis_names if a not in token_axes and a != "stage")]:
        if shape.get(a, 1) > 1 and count % (math.prod(shape[b] for b in rows_over) * shape[a]) == 0:
            rows_over.append(a)
    if n == 1 or axis not in rows_over or section.n_experts % n:
        return None
    if section.choices is not None:
        tokens, experts = x, read(section.choices).reshape(n_tokens, section.k)
    else:
        tokens, experts = x[section.source], read(section.keys).reshape(-1, 1)
    tokens = tokens.reshape(tokens.shape[0], -1)
    per_device = tokens.shape[0] // math.prod(shape[a] for a in rows_over)
    split = _Split(mesh, PartitionSpec(tuple(rows_over)), tuple(rows_over), n, None, axis)
    slots = slots_per_destination(1, per_device, experts.shape[1], section.n_experts, n, None)
    weight_vars = list(section.weights)
    rows_spec = PartitionSpec(tuple(rows_over), None)
    weight_specs = [_expert_spec(len(var_shape(v)), section.weights[v], axis) for v in weight_vars]

    def body(tokens: jax.Array, experts: jax.Array, weights: list[jax.Array], inputs: list[jax.Array]) -> jax.Array:
        # Every operand differs over the rows' axes, once here, so each weight's gradient is
        # reduced over them once, at the section's end.
        weights = [varying_over(w, rows_over) for w in weights]
        inputs = [varying_over(v, rows_over) for v in inputs]

        def experts_here(grouped: jax.Array, sizes: jax.Array, which: jax.Array) -> jax.Array:
            env: dict[JVar, Any] = dict(zip(weight_vars, weights, strict=True))
            env |= dict(zip(section.inputs, inputs, strict=True))
            env[section.rows] = grouped.reshape(grouped.shape[0], *feature_shape)
            env[section.sizes] = sizes.astype(var_dtype(section.sizes))
            _evaluate(section.eqns, env, section.m, grouped.shape[0], mesh)
            out = env[section.result]
            return out.reshape(out.shape[0], -1)

        run = lambda rows, slot_expert, local: by_expert(rows, slot_expert, local, experts_here)
        out, _ = routed_pairs(tokens, experts, section.n_experts, split, slots, run)
        return out.reshape(-1, out.shape[-1])

    out = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows_spec, rows_spec, weight_specs, [PartitionSpec()] * len(section.inputs)),
        out_specs=rows_spec,
    )(tokens, experts, [read(v) for v in weight_vars], [read(v) for v in section.inputs])
    return out.reshape(var_shape(section.out)).astype(var_dtype(section.out))


def _expert_spec(ndim: int, dim: int, axis: str) -> PartitionSpec:
    spec: list[Any] = [None] * ndim
    spec[dim] = axis
    return PartitionSpec(*spec)


# -- finding a section -------------------------------------------------------------------------


def _argsort(eqn: JaxprEqn, producers: Mapping[JVar, JaxprEqn]) -> tuple[JVar, JVar] | None:
    """``(keys, order)`` where ``eqn`` is an argsort: a sort of 1-D keys with an iota
    (``jnp.argsort``'s helper is inlined before this is asked)."""
    if eqn.primitive.name == "sort" and _sorts_with_iota(eqn, producers) and isinstance(eqn.invars[0], Var):
        return eqn.invars[0], eqn.outvars[1]
    return None


def _sorts_with_iota(eqn: JaxprEqn, producers: Mapping[JVar, JaxprEqn]) -> bool:
    if eqn.primitive.name != "sort" or eqn.params["num_keys"] != 1 or len(eqn.invars) != 2:
        return False
    keys, index = eqn.invars
    iota = producers.get(index) if isinstance(index, Var) else None
    return (
        len(var_shape(keys)) == 1
        and iota is not None
        and iota.primitive.name == "iota"
        and iota.params["dimension"] == 0
        and tuple(iota.params["shape"]) == tuple(var_shape(keys))
    )


def _section(
    jaxpr: Jaxpr, producers: Mapping[JVar, JaxprEqn], keys: JVar, order: JVar, expert_dims: Mapping[JVar, int]
) -> Section | None:
    pairs = var_shape(keys)[0]
    experts = _expert_count(keys, producers)
    if experts is None:
        return None
    n_experts, choices = experts
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "gather" or not _gathers_rows(eqn):
            continue
        source = evaluated_on_iota(eqn.invars[1], order, producers, pairs)
        tokens = eqn.invars[0]
        if source is None or not isinstance(tokens, Var) or source.min() < 0 or source.max() >= var_shape(tokens)[0]:
            continue
        found = _segment(jaxpr, producers, eqn.outvars[0], order, keys, n_experts, expert_dims)
        if found is None:
            continue
        out, result, sizes, eqns, weights, inputs = found
        k = 1
        if choices is not None:
            k = var_shape(choices)[-1]
            if var_shape(tokens)[0] * k != pairs or not np.array_equal(source, np.arange(pairs) // k):
                choices, k = None, 1
        rows = eqn.outvars[0]
        return Section(
            out, tokens, source, keys, choices, k, rows, sizes, result, eqns, weights, inputs, n_experts, m=pairs
        )
    return None


def _expert_count(keys: JVar, producers: Mapping[JVar, JaxprEqn]) -> tuple[int, JVar | None] | None:
    """``(E, choices)`` where the keys are a ``top_k``'s indices over ``E`` (flattened from the
    ``(..., k)`` choices), or an ``argmax``'s over ``E`` (choices None); else None."""
    v = keys
    while isinstance(v, Var) and v in producers:
        eqn = producers[v]
        name = eqn.primitive.name
        if name == "top_k" and v is eqn.outvars[1]:
            return var_shape(eqn.invars[0])[-1], v
        if name == "argmax" and tuple(eqn.params["axes"]) == (len(var_shape(eqn.invars[0])) - 1,):
            return var_shape(eqn.invars[0])[-1], None
        if name not in ("reshape", "convert_element_type", "squeeze") or not isinstance(eqn.invars[0], Var):
            return None
        v = eqn.invars[0]
    return None


def _gathers_rows(eqn: JaxprEqn) -> bool:
    """A gather of whole rows ``X[i]`` of ``X (N, ...)`` at ``(P, 1)`` indices."""
    dn = eqn.params["dimension_numbers"]
    x, index = eqn.invars
    return (
        len(var_shape(index)) == 2
        and var_shape(index)[1] == 1
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and tuple(dn.offset_dims) == tuple(range(1, len(var_shape(x))))
        and not dn.operand_batching_dims
        and tuple(eqn.params["slice_sizes"]) == (1, *var_shape(x)[1:])
    )


def evaluated_on_iota(
    v: Any, order: JVar, producers: Mapping[JVar, JaxprEqn], pairs: int, root_values: np.ndarray | None = None
) -> np.ndarray | None:
    """``(P,)``: ``v``, an elementwise function of ``order`` (then a ``(P, 1)`` column), evaluated
    where ``order`` is ``iota`` (or ``root_values``); None where it is not one."""
    chain = _elementwise_chain(v, order, producers)
    if chain is None:
        return None
    env: dict[JVar, Any] = {order: np.arange(pairs, dtype=var_dtype(order)) if root_values is None else root_values}
    with jax.ensure_compile_time_eval():
        for eqn in chain:
            args = [_literal(a) if isinstance(a, Literal) else env[a] for a in eqn.invars]
            outs = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
            for out, value in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs], strict=True):
                env[out] = value
    return np.asarray(env[v]).reshape(-1)


def _elementwise_chain(v: Any, root: JVar, producers: Mapping[JVar, JaxprEqn]) -> list[JaxprEqn] | None:
    """The equations computing ``v`` from ``root`` alone (in an order that computes each operand
    first), each elementwise (its other operands literals), the last maybe a reshape or broadcast
    to a ``(P, 1)`` column; None otherwise."""
    chain: list[JaxprEqn] = []
    seen: set[JVar] = {root}

    def visit(u: Any, last: bool) -> bool:
        if isinstance(u, Literal):
            return len(var_shape(u)) == 0
        if u in seen:
            return True
        eqn = producers.get(u)
        if eqn is None or len(eqn.outvars) != 1:
            return False
        shaped = last and eqn.primitive.name in ("reshape", "broadcast_in_dim") and var_shape(u)[1:] == (1,)
        if not (shaped or eqn.primitive.name in _ELEMENTWISE or _elementwise_call(eqn)):
            return False
        if not all(visit(a, False) for a in eqn.invars):
            return False
        seen.add(u)
        chain.append(eqn)
        return True

    return chain if visit(v, True) and v is not root else None


def _elementwise_call(eqn: JaxprEqn) -> bool:
    key = _CALLS.get(eqn.primitive.name)
    if key is None:
        return False
    inner = _inner(eqn)
    return all(e.primitive.name in _ELEMENTWISE or _elementwise_call(e) for e in inner.jaxpr.eqns)


def _segment(
    jaxpr: Jaxpr,
    producers: Mapping[JVar, JaxprEqn],
    rows: JVar,
    order: JVar,
    keys: JVar,
    n_experts: int,
    expert_dims: Mapping[JVar, int],
) -> tuple[JVar, JVar, JVar, tuple[JaxprEqn, ...], dict[JVar, int], tuple[JVar, ...]] | None:
    """From the gathered ``rows`` forward to the scatter that puts them back in pair order:
    ``(out, result, sizes, equations, weights, inputs)``, or None where some step is not row-wise."""
    m = var_shape(rows)[0]
    row_vars: set[JVar] = {rows}
    descendants: set[JVar] = {rows}  # whatever the rows reach, rows or not (a mean over them)
    cone: list[JaxprEqn] = []
    start = next(i for i, e in enumerate(jaxpr.eqns) if rows in e.outvars) + 1
    for eqn in jaxpr.eqns[start:]:
        if any(isinstance(a, Var) and a in row_vars for a in eqn.invars):
            result = None
            if eqn.primitive.name == "scatter" and _scatters_back(eqn, order, producers, m, row_vars):
                result = eqn.invars[2]
            elif eqn.primitive.name == "gather" and _gathers_back(eqn, order, producers, m, row_vars):
                result = eqn.invars[0]
            if result is not None:
                needed = needed_for(cone, [result])
                found = _checked(needed, rows, result, eqn.outvars[0], producers, keys, n_experts, expert_dims)
                # An input computed from the rows themselves keeps the whole-batch program alive.
                return None if found is None or descendants.intersection(found[-1]) else found
            cone.append(eqn)
            row_vars.update(v for v in eqn.outvars if _has_rows(v, m))
        if any(isinstance(a, Var) and a in descendants for a in eqn.invars):
            descendants.update(eqn.outvars)
    return None


def _scatters_back(eqn: JaxprEqn, order: JVar, producers: Mapping[JVar, JaxprEqn], m: int, row_vars: set[JVar]) -> bool:
    dn = eqn.params["dimension_numbers"]
    operand, index, updates = eqn.invars
    if updates not in row_vars or operand in row_vars or var_shape(operand) != var_shape(updates):
        return False
    if (
        tuple(dn.inserted_window_dims) != (0,)
        or tuple(dn.scatter_dims_to_operand_dims) != (0,)
        or tuple(dn.update_window_dims) != tuple(range(1, len(var_shape(updates))))
        or dn.operand_batching_dims
    ):
        return False
    at = evaluated_on_iota(index, order, producers, m)
    return at is not None and np.array_equal(at, np.arange(m))


def _gathers_back(eqn: JaxprEqn, order: JVar, producers: Mapping[JVar, JaxprEqn], m: int, row_vars: set[JVar]) -> bool:
    """``eqn`` reads the rows back in pair order: ``rows[argsort(order)]`` (MaxText's unsort),
    its index an elementwise function of the inverse permutation that is it on ``iota``."""
    operand, index = eqn.invars
    if operand not in row_vars or index in row_vars or not _gathers_rows(eqn):
        return False
    for root in _roots(index, producers):
        argsort = _argsort(producers[root], producers)
        if argsort is not None and argsort[0] is order:
            at = evaluated_on_iota(index, argsort[1], producers, m)
            return at is not None and np.array_equal(at, np.arange(m))
    return False


def _roots(v: Any, producers: Mapping[JVar, JaxprEqn]) -> list[JVar]:
    """The values ``v`` is computed from through elementwise steps and a final column reshape,
    the first not so computed (where an argsort would be)."""
    out, todo, seen = [], [v], set()
    while todo:
        u = todo.pop()
        if isinstance(u, Literal) or u in seen or u not in producers:
            continue
        seen.add(u)
        eqn = producers[u]
        name = eqn.primitive.name
        if name in _ELEMENTWISE or name in ("reshape", "broadcast_in_dim") or _elementwise_call(eqn):
            todo.extend(eqn.invars)
        else:
            out.append(u)
    return out


def needed_for(eqns: Sequence[JaxprEqn], results: Sequence[Any]) -> list[JaxprEqn]:
    """The equations of ``eqns`` that ``results`` depend on, in program order."""
    wanted, kept = {r for r in results if isinstance(r, Var)}, []
    for eqn in reversed(eqns):
        if any(v in wanted for v in eqn.outvars):
            kept.append(eqn)
            wanted.update(a for a in eqn.invars if isinstance(a, Var))
    return kept[::-1]


def _checked(
    eqns: list[JaxprEqn],
    rows: JVar,
    result: JVar,
    out: JVar,
    producers: Mapping[JVar, JaxprEqn],
    keys: JVar,
    n_experts: int,
    expert_dims: Mapping[JVar, int],
) -> tuple[JVar, JVar, JVar, tuple[JaxprEqn, ...], dict[JVar, int], tuple[JVar, ...]] | None:
    m = var_shape(rows)[0]
    row_vars: set[JVar] = {rows}
    produced = {v for e in eqns for v in e.outvars}
    weights: dict[JVar, int] = {}
    sizes: JVar | None = None
    pulled: list[JaxprEqn] = []
    for eqn in eqns:
        if eqn.primitive.name == "ragged_dot_general":
            lhs, rhs, group_sizes = eqn.invars
            dn = eqn.params["ragged_dot_dimension_numbers"]
            (contract, batch) = dn.dot_dimension_numbers
            if (
                lhs not in row_vars
                or tuple(dn.lhs_ragged_dimensions) != (0,)
                or batch != ((), ())
                or 0 in contract[0]
                or rhs not in expert_dims
                or tuple(dn.rhs_group_dimensions) != (expert_dims[rhs],)
                or eqn.params.get("group_offset") is not None
                or (sizes is not None and group_sizes is not sizes)
                or not _histogram(group_sizes, keys, producers, n_experts)
            ):
                return None
            sizes, weights[rhs] = group_sizes, expert_dims[rhs]
            row_vars.add(eqn.outvars[0])
            continue
        for a in eqn.invars:  # a value broadcast along the rows (a bias, zeros) comes along
            if isinstance(a, Var) and a not in row_vars and a not in produced and _has_rows(a, m):
                source = producers.get(a)
                if source is None or not _broadcast_along_rows(source):
                    return None
                pulled.append(source)
                row_vars.add(a)
        if not _row_wise(eqn, row_vars, m):
            return None
        row_vars.update(eqn.outvars)
    if sizes is None or result not in row_vars:
        return None
    eqns = pulled + eqns
    produced = {v for e in eqns for v in e.outvars}
    inputs = []
    for eqn in eqns:
        for a in eqn.invars:
            outside = isinstance(a, Var) and a not in produced and a is not rows and a is not sizes
            if outside and a not in weights and a not in inputs:
                inputs.append(a)
    return out, result, sizes, tuple(eqns), weights, tuple(inputs)


def _histogram(sizes: Any, keys: JVar, producers: Mapping[JVar, JaxprEqn], n_experts: int) -> bool:
    """``sizes`` counts the keys equal to each expert: a scatter-add of ones into ``E`` zeros at
    an elementwise function of the keys that is the identity on ``0 .. E - 1`` (``bincount``)."""
    v = sizes
    while isinstance(v, Var) and v in producers and producers[v].primitive.name == "convert_element_type":
        v = producers[v].invars[0]
    eqn = producers.get(v) if isinstance(v, Var) else None
    if eqn is None or eqn.primitive.name != "scatter-add" or var_shape(v) != (n_experts,):
        return False
    operand, index, updates = eqn.invars
    dn = eqn.params["dimension_numbers"]
    if (
        not _broadcast_of(operand, producers, 0)
        or not _broadcast_of(updates, producers, 1)
        or tuple(dn.update_window_dims) != ()
        or tuple(dn.inserted_window_dims) != (0,)
        or tuple(dn.scatter_dims_to_operand_dims) != (0,)
    ):
        return False
    pairs = var_shape(keys)[0]
    if pairs < n_experts:  # the keys' shape cannot hold every expert to check the index on
        return False
    experts = np.arange(pairs, dtype=var_dtype(keys)) % n_experts
    at = evaluated_on_iota(index, keys, producers, pairs, root_values=experts)
    return at is not None and np.array_equal(at, experts)


def _broadcast_of(v: Any, producers: Mapping[JVar, JaxprEqn], value: int) -> bool:
    eqn = producers.get(v) if isinstance(v, Var) else None
    if eqn is None or eqn.primitive.name != "broadcast_in_dim" or not isinstance(eqn.invars[0], Literal):
        return False
    return bool(np.all(np.asarray(eqn.invars[0].val) == value))


def _row_wise(eqn: JaxprEqn, row_vars: set[JVar], m: int) -> bool:
    """Whether ``eqn`` computes each row of its outputs from the same row of its row operands
    (``row_vars``) alone, its other operands without rows."""
    name, params = eqn.primitive.name, eqn.params
    ins = [a for a in eqn.invars if isinstance(a, Var) and a in row_vars]
    others = [a for a in eqn.invars if not (isinstance(a, Var) and a in row_vars)]
    outs_rows = all(_has_rows(v, m) for v in eqn.outvars)
    if not ins or not outs_rows:
        return False
    if name in _ELEMENTWISE:  # others scalars, or one row broadcast to all (JAX's (1, F) operands)
        return all(len(var_shape(a)) == 0 or var_shape(a)[0] == 1 for a in others)
    if others and name not in ("dot_general",) and name not in _CALLS:
        return False
    if name == "broadcast_in_dim":
        return params["broadcast_dimensions"][0] == 0
    if name == "reshape":
        return params.get("dimensions") is None
    if name == "squeeze":
        return 0 not in params["dimensions"]
    if name == "transpose":
        return params["permutation"][0] == 0
    if name in _REDUCTIONS:
        return 0 not in params["axes"]
    if name == "slice":
        strides = params.get("strides")
        return (
            params["start_indices"][0] == 0 and params["limit_indices"][0] == m and (strides is None or strides[0] == 1)
        )
    if name in ("concatenate", "split"):
        return params.get("dimension", params.get("axis")) != 0
    if name == "dot_general":
        (contract, batch) = params["dimension_numbers"]
        return (
            eqn.invars[0] in row_vars and eqn.invars[1] not in row_vars and 0 not in contract[0] and batch == ((), ())
        )
    if name in _CALLS:
        inner = _inner(eqn).jaxpr
        pairs = zip(inner.invars, eqn.invars, strict=True)
        inner_rows = {iv for iv, a in pairs if isinstance(a, Var) and a in row_vars}
        if any(iv not in inner_rows and _has_rows(iv, m) for iv in inner.invars):
            return False
        for e in inner.eqns:
            if any(isinstance(a, Var) and a in inner_rows for a in e.invars):
                if not _row_wise(e, inner_rows, m):
                    return False
                inner_rows.update(e.outvars)
            elif any(_has_rows(v, m) for v in e.outvars):
                if not _broadcast_along_rows(e):
                    return False
                inner_rows.update(e.outvars)
        return all(v in inner_rows for v in inner.outvars if isinstance(v, Var))
    return False


def _has_rows(v: Any, m: int) -> bool:
    shape = var_shape(v)
    return bool(shape) and shape[0] == m


def _broadcast_along_rows(eqn: JaxprEqn) -> bool:
    """A value broadcast along new rows (zeros, a bias): the same in every row."""
    return eqn.primitive.name == "broadcast_in_dim" and 0 not in eqn.params["broadcast_dimensions"]


def _inner(eqn: JaxprEqn) -> ClosedJaxpr:
    program = eqn.params[_CALLS[eqn.primitive.name]]
    return program if isinstance(program, ClosedJaxpr) else ClosedJaxpr(program, ())


def _literal(a: Literal) -> Any:
    return np.asarray(a.val, dtype=var_dtype(a))


# -- evaluating a section at another row count -------------------------------------------------


def _evaluate(eqns: Sequence[JaxprEqn], env: dict[JVar, Any], m: int, rows: int, mesh: Mesh) -> None:
    """Evaluate ``eqns`` into ``env`` with ``rows`` rows where they were traced with ``m``; calls
    inlined, grouped matmuls as :func:`shardkit.parallel.grouped_matmul.grouped_matmul` (linear
    memory on every backend), operands made to differ over the same mesh axes."""
    platform = mesh.devices.flat[0].platform
    for eqn in eqns:
        args = [jnp.asarray(_literal(a)) if isinstance(a, Literal) else env[a] for a in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS:
            inner = _inner(eqn)
            inner_env: dict[JVar, Any] = dict(zip(inner.jaxpr.constvars, inner.consts, strict=True))
            inner_env |= dict(zip(inner.jaxpr.invars, args, strict=True))
            _evaluate(inner.jaxpr.eqns, inner_env, m, rows, mesh)
            outs = [jnp.asarray(_literal(v)) if isinstance(v, Literal) else inner_env[v] for v in inner.jaxpr.outvars]
        elif name == "ragged_dot_general" and _plain_grouped(eqn):
            lhs, rhs, sizes = _matched(args)
            outs = [grouped_matmul(lhs, rhs.astype(lhs.dtype), sizes, platform).astype(var_dtype(eqn.outvars[0]))]
        else:
            params = _resized(eqn, m, rows)
            ans = eqn.primitive.bind(*_matched(args), **eqn.primitive.get_bind_params(params))
            outs = list(ans) if eqn.primitive.multiple_results else [ans]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x


def _plain_grouped(eqn: JaxprEqn) -> bool:
    dn = eqn.params["ragged_dot_dimension_numbers"]
    return (
        len(var_shape(eqn.invars[0])) == 2
        and len(var_shape(eqn.invars[1])) == 3
        and dn.dot_dimension_numbers == (((1,), (1,)), ((), ()))
        and tuple(dn.rhs_group_dimensions) == (0,)
        and var_dtype(eqn.outvars[0]) == var_dtype(eqn.invars[0])
    )


def _resized(eqn: JaxprEqn, m: int, rows: int) -> dict[str, Any]:
    """``eqn``'s parameters with each shape's rows (``m``) now ``rows``."""
    if rows == m or not _has_rows(eqn.outvars[0], m):
        return eqn.params
    params = dict(eqn.params)
    for key in _SHAPE_PARAMS:
        shape = params.get(key)
        if shape is not None and len(shape) and shape[0] == m:
            params[key] = (rows, *tuple(shape)[1:])
    return params


def _matched(args: list[Any]) -> list[Any]:
    """``args`` made to differ over the same manual mesh axes (JAX's operations do this as they
    trace; a primitive bound directly does not)."""
    axes = frozenset().union(*(varying_axes(a) for a in args))
    return [varying_over(a, axes) for a in args]
