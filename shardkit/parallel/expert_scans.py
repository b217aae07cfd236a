"""A loop over the experts written as ``jax.lax.scan`` or ``jax.lax.fori_loop``, found in the traced
program and computed as one stacked mixture.

The rolled forms of :mod:`shardkit.parallel.expert_loops`' Python loop::

    def body(e, out):                       # fori_loop: the expert is the loop's counter
        return out + mlp(x, w_in[e], w_out[e]) * gates[..., e:e + 1]
    out = jax.lax.fori_loop(0, E, body, jnp.zeros_like(x))

    def body(out, w):                       # scan: the experts' weights are the scanned inputs
        w_in_e, w_out_e, gate_e = w
        return out + mlp(x, w_in_e, w_out_e) * gate_e[..., None], None
    out, _ = jax.lax.scan(body, jnp.zeros_like(x), (w_in, w_out, jnp.moveaxis(gates, -1, 0)))

Traced, each is one ``scan`` whose body reads one expert a step. Under an ``expert`` axis XLA's
partitioner cannot keep a step on the devices holding its expert: it moves each step's weights
(a dynamic slice of weights split over ``expert``) to every device, and sums every expert's
gradient over ``expert``.

:func:`find_scans` proves, from the scan's body, that its steps are independent terms of a sum:

- every carry is the loop's counter (``c + 1`` from a literal start), a running sum
  (``acc + term``, the term computed without any carry but the counter), or passed on unchanged;
- the per-step outputs (``ys``) read no carry but the counter;
- at least one expert weight is read a step at a time: scanned over its expert dimension, or
  a ``dynamic_slice`` of one expert at an index that evaluates to the step's number (JAX's
  indexing ``w[e]``, with its wrap-around of negative indices, is such an index).

:func:`stacked_body` is then the body vectorised over the steps (``jax.vmap``), with the dynamic
slices replaced by the whole arrays, experts first: the dense mixture ``(B, T, D) x (E, D, F)``,
which the experts' placement keeps on the ``expert`` axis. The sums become one reduction over
the experts (the same terms, added in another order: float rounding may differ in the last bits).

Example:
  >>> import jax, jax.numpy as jnp
  >>> def rolled(w, x):
  ...     body = lambda e, out: out + jnp.tanh(x @ w[e])
  ...     return jax.lax.fori_loop(0, 4, body, jnp.zeros_like(x))
  >>> closed = jax.make_jaxpr(rolled)(jnp.ones((4, 3, 3)), jnp.ones((2, 3)))
  >>> [scan.experts for scan in find_scans(closed.jaxpr, {closed.jaxpr.invars[0]: 0}).values()]
  [4]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var

from shardkit.parallel.embedding_gradients import var_dtype, var_shape
from shardkit.parallel.expert_loops import stacked_slices
from shardkit.parallel.sorted_sections import evaluated_on_iota, needed_for

# A jaxpr variable (jax.extend.core.Var), typed loosely: its aval's shape is not in JAX's types.
JVar = Any


@dataclasses.dataclass(frozen=True, eq=False)
class ScannedLoop:
    """A scan over the experts, re-rolled: step ``e``'s outputs are ``eqns`` on its inputs.

    ``stacked`` are the body's values that are step ``e``'s slice of an outer array
    (``{body var: (outer var, dimension, squeezed)}``); ``shared`` the body's inputs every step
    reads (``{body var: outer operand}``). ``carries[i]`` says what carry ``i`` is: ``("counter",
    start)``, ``("sum", term)`` (a body value) or ``("same", None)``; ``ys`` are the body's
    per-step outputs."""

    scan: JaxprEqn
    experts: int
    eqns: tuple[JaxprEqn, ...]
    stacked: Mapping[JVar, tuple[JVar, int, bool]]
    shared: Mapping[JVar, Any]
    counter: JVar | None
    carries: tuple[tuple[str, Any], ...]
    ys: tuple[Any, ...]


def find_scans(jaxpr: Jaxpr, expert_dims: Mapping[JVar, int]) -> dict[int, ScannedLoop]:
    """The scans over the experts at this level of ``jaxpr``, by ``id`` of their equation.

    Args:
      jaxpr: a traced program.
      expert_dims: ``{var: dimension}``: the values that are expert weights and their expert dimension.

    Returns:
      ``{id(scan equation): ScannedLoop}``; empty where no scan is one.
    """
    found: dict[int, ScannedLoop] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            loop = _scanned_loop(eqn, expert_dims)
            if loop is not None:
                found[id(eqn)] = loop
    return found


def stacked_body(
    loop: ScannedLoop, read: Callable[[JVar], Any]
) -> tuple[Callable[..., list[jax.Array]], list[Any], list[tuple[JVar, int, bool] | None]]:
    """``(fn, args, sources)``: ``fn(*args)`` is every step's sums' terms, then its ``ys``, each
    stacked ``(E, ...)``; ``sources[i]`` is ``(outer var, dimension, squeezed)`` for an argument
    stacked from an outer array (its experts first), None for the counter and the shared."""
    body = loop.scan.params["jaxpr"]
    stacked_vars = list(loop.stacked)
    args = stacked_slices(loop.stacked, read)
    inputs = list(stacked_vars)
    sources: list[tuple[JVar, int, bool] | None] = [loop.stacked[v] for v in stacked_vars]
    if loop.counter is not None:
        start = next(value for kind, value in loop.carries if kind == "counter")
        args.append(jnp.arange(start, start + loop.experts, dtype=var_dtype(loop.counter)))
        inputs.append(loop.counter)
        sources.append(None)
    shared = list(loop.shared)
    args += [_operand(loop.shared[v], read) for v in shared]
    inputs += shared
    sources += [None] * len(shared)
    results = [term for kind, term in loop.carries if kind == "sum"] + list(loop.ys)

    def step(*xs: Any) -> list[Any]:
        env: dict[JVar, Any] = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        env.update(zip(inputs, xs, strict=True))
        for eqn in loop.eqns:
            vals = [_operand(a, env.__getitem__) for a in eqn.invars]
            outs = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
            for out, value in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs], strict=True):
                env[out] = value
        return [_operand(r, env.__getitem__) for r in results]

    axes = tuple(0 if i < len(stacked_vars) + (loop.counter is not None) else None for i in range(len(args)))
    return jax.vmap(step, in_axes=axes), args, sources


def scan_outputs(loop: ScannedLoop, read: Callable[[JVar], Any], stacked: list[jax.Array]) -> list[Any]:
    """The scan's outputs from :func:`stacked_body`'s: each sum its start plus its terms' sum over
    the experts, the counter its end, an unchanged carry its start, the ``ys`` as stacked."""
    n_consts = loop.scan.params["num_consts"]
    sums = iter(stacked)
    outs: list[Any] = []
    for i, (kind, value) in enumerate(loop.carries):
        start = loop.scan.invars[n_consts + i]
        if kind == "counter":
            outs.append(jnp.asarray(value + loop.experts, dtype=var_dtype(start)))
        elif kind == "sum":
            outs.append(read(start) + next(sums).sum(0))
        else:
            outs.append(read(start))
    n_sums = sum(1 for kind, _ in loop.carries if kind == "sum")
    return outs + list(stacked[n_sums:])


def _operand(v: Any, read: Callable[[JVar], Any]) -> Any:
    return v.val if isinstance(v, Literal) else read(v)


def _scanned_loop(scan: JaxprEqn, expert_dims: Mapping[JVar, int]) -> ScannedLoop | None:
    """``scan`` as a loop over the experts; None where its body is not one."""
    n_consts, n_carry, length = scan.params["num_consts"], scan.params["num_carry"], scan.params["length"]
    body = scan.params["jaxpr"].jaxpr
    consts_in = body.invars[:n_consts]
    carries_in = body.invars[n_consts : n_consts + n_carry]
    xs_in = body.invars[n_consts + n_carry :]
    outer = dict(zip(body.invars, scan.invars, strict=True))
    producers = {v: e for e in body.eqns for v in e.outvars}
    carries: list[tuple[str, Any]] = []
    counter = None
    for i, (c, out) in enumerate(zip(carries_in, body.outvars[:n_carry], strict=True)):
        start = scan.invars[n_consts + i]
        if out is c:
            carries.append(("same", None))
        elif (
            isinstance(step := _added_to(producers.get(out), c), Literal)
            and step.val == 1
            and isinstance(start, Literal)
            and np.issubdtype(var_dtype(c), np.integer)
        ):
            if counter is not None or scan.params["reverse"]:
                return None  # two counters, or one counting down the steps
            counter = c
            carries.append(("counter", int(start.val)))
        elif (term := _added_to(producers.get(out), c)) is not None:
            carries.append(("sum", term))
        else:
            return None
    ys = tuple(body.outvars[n_carry:])
    results = [term for kind, term in carries if kind == "sum"] + list(ys)
    others = {c for c in carries_in if c is not counter}
    if not results or _reads_any(results, others, producers):
        return None
    stacked: dict[JVar, tuple[JVar, int, bool]] = {}
    for x in xs_in:
        stacked[x] = (outer[x], 0, True)
    kept: list[JaxprEqn] = []
    first = next((value for kind, value in carries if kind == "counter"), 0)
    for eqn in needed_for(body.eqns, results):
        sliced = _slice_at_step(eqn, producers, counter, first, length)
        step_of = stacked.get(eqn.invars[0]) if eqn.primitive.name == "squeeze" else None
        if sliced is not None and sliced in consts_in:
            stacked[eqn.outvars[0]] = (outer[sliced], _sliced_dim(eqn), False)
        elif step_of is not None and not step_of[2] and tuple(eqn.params["dimensions"]) == (step_of[1],):
            # w[e] is a slice then a squeeze: the step's matrix itself, as a scan hands it over.
            stacked[eqn.outvars[0]] = (step_of[0], step_of[1], True)
        else:
            kept.append(eqn)
    steps_over_experts = any(
        isinstance(src, Var) and expert_dims.get(src) == dim and var_shape(src)[dim] == length
        for src, dim, _ in stacked.values()
    )
    if not steps_over_experts:
        return None
    read_inside = {a for e in kept for a in e.invars if isinstance(a, Var)} | {r for r in results if isinstance(r, Var)}
    stacked = {v: source for v, source in stacked.items() if v in read_inside}
    shared = {v: outer[v] for v in consts_in if v in read_inside}
    return ScannedLoop(scan, length, tuple(kept), stacked, shared, counter, tuple(carries), ys)


def _added_to(eqn: JaxprEqn | None, c: JVar) -> Any:
    """``t`` where ``eqn`` is ``c + t`` or ``t + c`` (``t`` not ``c``); else None."""
    if eqn is None or eqn.primitive.name != "add":
        return None
    a, b = eqn.invars
    if a is c and b is not c:
        return b
    if b is c and a is not c:
        return a
    return None


def _reads_any(results: list[Any], carries: set[JVar], producers: Mapping[JVar, JaxprEqn]) -> bool:
    """Whether any of ``results`` is computed from any of ``carries``."""
    seen: set[JVar] = set()
    todo = [r for r in results if isinstance(r, Var)]
    while todo:
        v = todo.pop()
        if v in carries:
            return True
        if v in seen or v not in producers:
            continue
        seen.add(v)
        todo += [a for a in producers[v].invars if isinstance(a, Var)]
    return False


def _slice_at_step(
    eqn: JaxprEqn, producers: Mapping[JVar, JaxprEqn], counter: JVar | None, start: int, length: int
) -> JVar | None:
    """The array ``eqn`` slices, where it is a ``dynamic_slice`` of one whole element at the step's
    number along one dimension of size ``length`` (every other start 0, every other size whole);
    else None."""
    if counter is None or eqn.primitive.name != "dynamic_slice" or not isinstance(eqn.invars[0], Var):
        return None
    src, starts = eqn.invars[0], eqn.invars[1:]
    shape, sizes = var_shape(src), eqn.params["slice_sizes"]
    cut = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if len(cut) != 1 or sizes[cut[0]] != 1 or shape[cut[0]] != length:
        return None
    steps = np.arange(start, start + length, dtype=var_dtype(counter))
    for d, index in enumerate(starts):
        want = np.arange(length) if d == cut[0] else np.zeros(length)
        values = _index_values(index, counter, producers, steps)
        if values is None or not np.array_equal(np.broadcast_to(values, (length,)), want):
            return None
    return src


def _index_values(
    index: Any, counter: JVar, producers: Mapping[JVar, JaxprEqn], steps: np.ndarray
) -> np.ndarray | None:
    """``index`` at each step (a function of the counter alone, or a constant); None otherwise."""
    if isinstance(index, Literal):
        return np.asarray(index.val).reshape(-1)
    if index is counter:
        return steps
    # Step by step: the chain may call jitted helpers (``jnp.remainder``) traced for a scalar.
    values = []
    for step in steps:
        value = evaluated_on_iota(index, counter, producers, 1, root_values=step)
        if value is None:
            return None
        values.append(value[0])
    return np.asarray(values)


def _sliced_dim(eqn: JaxprEqn) -> int:
    shape, sizes = var_shape(eqn.invars[0]), eqn.params["slice_sizes"]
    return next(d for d in range(len(shape)) if sizes[d] != shape[d])
