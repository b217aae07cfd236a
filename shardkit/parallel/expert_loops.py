"""A Python loop over the experts, found in the traced program and computed as one stacked mixture.

A first version of a mixture often reads each expert's weights by index and sums the outputs::

    out = jnp.zeros_like(x)
    for e in range(E):
        out = out + mlp(x, w_in[e], w_out[e]) * gates[..., e:e + 1]

Traced, that is ``E`` copies of one computation, each on a slice of the stacked expert weights.
Under an ``expert`` axis each slice lives on one expert group, so XLA's partitioner moves every
expert's weights to every device and sums their gradients over ``expert``: the weights' bytes,
where expert parallelism moves the tokens' (2 to 7 times the bound on the zoo's loop).

:func:`find_loops` re-rolls the loop: it matches the ``E`` copies equation by equation (the same
operation and parameters, operands that are the same value, the copies' own values, or slices at
the copy's index of one array), starting from the slices ``w[e]`` of an expert weight, and finds
the sum that folds their results. :func:`stacked_term` is the copy's computation vectorised over
the experts (``jax.vmap``) on the whole weights and the stacked slices: the dense mixture
``(B, T, D) x (E, D, F)``, which the experts' placement keeps on the ``expert`` axis. The sum is
then one reduction over the experts (the same terms, added in another order: float rounding may
differ in the last bits).

Example:
  >>> import jax, jax.numpy as jnp
  >>> def looped(w, x):
  ...     out = jnp.zeros_like(x)
  ...     for e in range(4):
  ...         out = out + jnp.tanh(x @ w[e])
  ...     return out
  >>> closed = jax.make_jaxpr(looped)(jnp.ones((4, 3, 3)), jnp.ones((2, 3)))
  >>> [loop.experts for loop in find_loops(closed.jaxpr, {closed.jaxpr.invars[0]: 0}).values()]
  [4]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from shardkit.parallel.embedding_gradients import var_shape

# A jaxpr variable (jax.extend.core.Var), typed loosely: its aval's shape is not in JAX's types.
JVar = Any


@dataclasses.dataclass(frozen=True)
class _Indexed:
    """A slice ``src[..., e, ...]`` of one array at index ``e`` of dimension ``dim`` (kept as a
    size-1 dimension unless ``squeezed``)."""

    src: JVar
    dim: int
    squeezed: bool
    index: int


@dataclasses.dataclass(frozen=True, eq=False)
class Loop:
    """A re-rolled loop: ``out = init + sum_e term_e`` with ``term_e`` copy ``e`` of ``eqns``.

    ``eqns`` compute ``term`` (copy 0's); ``stacked`` are copy 0's operands that are slices at the
    copy's index (``{var: (source, dimension, squeezed)}``), ``shared`` the operands every copy
    reads. ``init`` is the fold's first addend (None: the terms alone)."""

    out: JVar
    init: JVar | None
    term: JVar
    eqns: tuple[JaxprEqn, ...]
    stacked: Mapping[JVar, tuple[JVar, int, bool]]
    shared: tuple[JVar, ...]
    experts: int


def find_loops(jaxpr: Jaxpr, expert_dims: Mapping[JVar, int]) -> dict[JVar, Loop]:
    """The loops over experts of ``jaxpr`` (this level), by the variable holding their sum.

    Args:
      jaxpr: a traced program.
      expert_dims: ``{var: dimension}``: the values that are expert weights and their expert dimension.

    Returns:
      ``{sum: Loop}``; empty where no loop is matched.
    """
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    indexed = {v: i for v in producers if (i := _indexed(v, producers)) is not None}
    seeds = {v: i for v, i in indexed.items() if i.src in expert_dims and i.dim == expert_dims[i.src]}
    if not seeds:
        return {}
    experts = {var_shape(i.src)[i.dim] for i in seeds.values()}
    # Hash-consing: a value's position is what computes it, over the positions of its operands;
    # the copies' values at one position are the same function of their copy's inputs.
    position: dict[JVar, tuple[Hashable, int]] = {}
    for v, i in seeds.items():
        position[v] = (("seed", i.src, i.dim, i.squeezed), i.index)
    chain_eqn: dict[JVar, JaxprEqn] = {}
    for eqn in jaxpr.eqns:
        if not any(isinstance(a, Var) and a in position for a in eqn.invars):
            continue
        key = _key(eqn, position, indexed)
        if key is None:
            continue
        signature, copy = key
        for j, out in enumerate(eqn.outvars):
            position[out] = ((signature, j), copy)
            chain_eqn[out] = eqn
    members: dict[Hashable, dict[int, JVar]] = {}
    for v, (pos, copy) in position.items():
        members.setdefault(pos, {})[copy] = v
    consumers: dict[JVar, list[JaxprEqn]] = {}
    for eqn in jaxpr.eqns:
        for a in eqn.invars:
            if isinstance(a, Var):
                consumers.setdefault(a, []).append(eqn)
    found: dict[JVar, Loop] = {}
    for n in experts:
        for copies in members.values():
            if sorted(copies) != list(range(n)):
                continue
            folded = _fold([copies[e] for e in range(n)], consumers)
            if folded is None:
                continue
            out, init = folded
            loop = _loop(copies[0], out, init, n, position, members, chain_eqn, indexed, seeds)
            if loop is not None:
                found[out] = loop
    return found


def stacked_term(
    loop: Loop, read: Callable[[JVar], Any]
) -> tuple[Callable[..., jax.Array], list[Any], list[int | None]]:
    """``(fn, args, axes)``: ``fn(*args)`` is every copy's term stacked ``(E, ...)``; ``axes`` says
    where each argument's experts are (0 for the stacked, None for the shared)."""
    stacked_vars = list(loop.stacked)
    args = stacked_slices(loop.stacked, read)
    args += [read(v) for v in loop.shared]
    inputs = [*stacked_vars, *loop.shared]

    def term(*xs: Any) -> Any:
        env: dict[JVar, Any] = dict(zip(inputs, xs, strict=True))
        for eqn in loop.eqns:
            vals = [a.val if isinstance(a, Literal) else env[a] for a in eqn.invars]
            outs = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
            for out, value in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs], strict=True):
                env[out] = value
        return env[loop.term]

    axes: list[int | None] = [0] * len(stacked_vars) + [None] * len(loop.shared)
    return jax.vmap(term, in_axes=tuple(axes)), args, axes


def stacked_slices(stacked: Mapping[JVar, tuple[JVar, int, bool]], read: Callable[[JVar], Any]) -> list[Any]:
    """Each of ``stacked``'s sources (``{slice: (array, dimension, squeezed)}``) with that
    dimension first, ``(E, ...)``: copy (or step) ``e``'s slice is its row ``e``, kept as a size-1
    dimension where the slice kept it."""
    out = []
    for src, dim, squeezed in stacked.values():
        x = jnp.moveaxis(read(src), dim, 0)
        out.append(x if squeezed else jnp.expand_dims(x, dim + 1))
    return out


def _indexed(v: JVar, producers: Mapping[JVar, JaxprEqn]) -> _Indexed | None:
    """``v`` as a slice at one index of one dimension (``slice`` of size 1, then maybe ``squeeze``)."""
    eqn = producers.get(v)
    squeezed = False
    if eqn is not None and eqn.primitive.name == "squeeze" and len(eqn.params["dimensions"]) == 1:
        squeezed, dim_squeezed = True, eqn.params["dimensions"][0]
        eqn = producers.get(eqn.invars[0]) if isinstance(eqn.invars[0], Var) else None
    if eqn is None or eqn.primitive.name != "slice" or not isinstance(eqn.invars[0], Var):
        return None
    src_shape = var_shape(eqn.invars[0])
    start, limit, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
    if strides is not None and any(s != 1 for s in strides):
        return None
    cut = [d for d in range(len(src_shape)) if (start[d], limit[d]) != (0, src_shape[d])]
    if len(cut) != 1 or limit[cut[0]] - start[cut[0]] != 1 or (squeezed and dim_squeezed != cut[0]):
        return None
    return _Indexed(eqn.invars[0], cut[0], squeezed, start[cut[0]])


def _key(
    eqn: JaxprEqn, position: Mapping[JVar, tuple[Hashable, int]], indexed: Mapping[JVar, _Indexed]
) -> tuple[Hashable, int] | None:
    """``(signature, copy)`` of an equation on copy values: the same signature for each copy's
    equation of one loop; None where its operands come from different copies."""
    copies: set[int] = set()
    operands: list[Hashable] = []
    for a in eqn.invars:
        if isinstance(a, Literal):
            operands.append(("literal", repr(a.val), str(a.aval)))
        elif a in position:
            pos, copy = position[a]
            copies.add(copy)
            operands.append(("copy", pos))
        elif a in indexed:
            i = indexed[a]
            copies.add(i.index)
            operands.append(("slice", i.src, i.dim, i.squeezed))
        else:
            operands.append(("shared", a))
    if len(copies) != 1:
        return None
    params = tuple(sorted((k, _hashable(v)) for k, v in eqn.params.items()))
    return (eqn.primitive.name, params, tuple(operands)), copies.pop()


def _hashable(value: Any) -> Hashable:
    if isinstance(value, Jaxpr | ClosedJaxpr):
        return ("jaxpr", str(value))
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def _fold(terms: list[JVar], consumers: Mapping[JVar, list[JaxprEqn]]) -> tuple[JVar, JVar | None] | None:
    """``(sum, init)`` where ``terms`` are added in order into one running sum (``init + t0 + t1
    + ...`` or ``t0 + t1 + ...``), each partial sum read by the next addition alone."""
    first = [e for e in consumers.get(terms[0], []) if e.primitive.name == "add"]
    if len(first) != 1:
        return None
    eqn = first[0]
    other = eqn.invars[1] if eqn.invars[0] is terms[0] else eqn.invars[0]
    init: JVar | None = other
    rest = terms[1:]
    if other is terms[1]:
        init, rest = None, terms[2:]
    if isinstance(init, Literal) or (init is not None and var_shape(init) != var_shape(terms[0])):
        return None
    acc = eqn.outvars[0]
    for t in rest:
        uses = consumers.get(acc, [])
        if len(uses) != 1 or uses[0].primitive.name != "add" or set(uses[0].invars) != {acc, t}:
            return None
        acc = uses[0].outvars[0]
    return acc, init


def _loop(
    term: JVar,
    out: JVar,
    init: JVar | None,
    n: int,
    position: Mapping[JVar, tuple[Hashable, int]],
    members: Mapping[Hashable, Mapping[int, JVar]],
    chain_eqn: Mapping[JVar, JaxprEqn],
    indexed: Mapping[JVar, _Indexed],
    seeds: Mapping[JVar, _Indexed],
) -> Loop | None:
    """Copy 0's equations that ``term`` depends on, each matched in every copy, and their inputs."""
    eqns: list[JaxprEqn] = []
    stacked: dict[JVar, tuple[JVar, int, bool]] = {}
    shared: list[JVar] = []
    seen: set[int] = set()

    def visit(v: Any) -> bool:
        if isinstance(v, Literal):
            return True
        i = indexed.get(v)
        if i is not None and i.src not in position:  # a slice of an array every copy slices
            if i.index != 0 or var_shape(i.src)[i.dim] != n:
                return False
            stacked[v] = (i.src, i.dim, i.squeezed)
            return True
        if v in chain_eqn:
            eqn = chain_eqn[v]
            if id(eqn) in seen:
                return True
            pos = position[v][0]
            if sorted(members.get(pos, {})) != list(range(n)):
                return False  # some copy lacks this step
            seen.add(id(eqn))
            if not all(visit(a) for a in eqn.invars):
                return False
            eqns.append(eqn)
            return True
        if v not in shared:
            shared.append(v)
        return True

    if not visit(term) or not eqns:
        return None
    if not any(v in seeds for v in stacked):  # no expert weight's slice: not a loop over the experts
        return None
    return Loop(out, init, term, tuple(eqns), stacked, tuple(shared), n)
