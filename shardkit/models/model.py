"""Model: what shardkit needs of a Flax model, whatever API it was written in.

A :class:`Model` is a pure ``init(key) -> params`` and ``apply(params, inputs, key) -> outputs``
over a plain params pytree (nested dicts of arrays), plus the logical axis names of every
parameter. A model that keeps state besides its parameters (``nnx.BatchNorm``'s running
statistics, Linen's ``batch_stats``) has ``state_init`` and ``state_apply`` instead of a usable
``apply``; :func:`apply_model` calls either kind. :func:`from_nnx`, :func:`from_linen` and
:func:`annotate` (regex rules) build one.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import errors as flax_errors
from flax import linen as nn
from flax import nnx

from shardkit.core.errors import ModelError, short_repr
from shardkit.core.partition import Axes, RegexRule, linen_axes, nnx_axes, path_str, regex_axes
from shardkit.models.boundaries import batch_in_flight, constrain_outputs, linen_boundaries, nnx_boundaries

Params = Any


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static jit argument
class Model:
    """A model as a pure function pair plus the logical axes of its parameters.

    Attributes:
      init: ``key -> params``; run under ``jit`` with output shardings, so it must be pure.
      apply: ``(params, inputs, key_or_None) -> outputs``; ``key`` drives dropout (None: off).
      axes: tree of :class:`shardkit.core.partition.Axes` matching ``params``.
      name: shown in tables.
      info: facts reports use when known: ``layers``, ``dim`` (hidden size) and
        ``matmul_params`` (parameters used in matmuls, for model FLOPs).
      stages: how the model splits into pipeline stages (None: it cannot be pipelined).
      notes: warnings about the model's annotations (e.g. regex rules that matched nothing),
        listed by reports.
      state_init: ``key -> state``, the model's non-trainable state (running statistics), a
        tree of arrays; None for a model that has none.
      state_apply: ``(params, state, inputs, key_or_None) -> (outputs, state)``: a training call
        (a key) returns the updated state; an evaluating one (None) reads the state and returns
        it unchanged.
      axis_names: named axes the model's own collectives use, as models written for ``pmap``
        do (``BatchNorm(axis_name="batch")``); :func:`with_axis_names` binds each to an axis of
        size 1 around ``init`` and ``apply``, since under ``jit`` every array is already the
        global one (a batch mean is the whole batch's).
    """

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, Any, jax.Array | None], Any]
    axes: Any
    name: str = "model"
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stages: Stages | None = None
    notes: tuple[str, ...] = ()
    state_init: Callable[[jax.Array], Any] | None = None
    state_apply: Callable[[Params, Any, Any, jax.Array | None], tuple[Any, Any]] | None = None
    axis_names: tuple[str, ...] = ()

    def abstract_params(self, seed: int = 0) -> Params:
        """Shapes and dtypes of the parameters (``ShapeDtypeStruct`` tree); allocates nothing."""
        return jax.eval_shape(self.init, jax.random.key(seed))

    def abstract_model_state(self, seed: int = 0) -> Any:
        """Shapes and dtypes of the non-trainable state (None for a model without any)."""
        return None if self.state_init is None else jax.eval_shape(self.state_init, jax.random.key(seed))


def apply_model(model: Model, params: Params, state: Any, inputs: Any, key: jax.Array | None) -> tuple[Any, Any]:
    """``(outputs, state)`` of one call of any model: ``state_apply`` for a model with state (the
    new state keeps the old one's dtypes), ``apply`` for one without (``state`` passes through)."""
    if model.state_apply is None:
        return model.apply(params, inputs, key), state
    outputs, new = model.state_apply(params, state, inputs, key)
    return outputs, jax.tree.map(lambda n, o: n.astype(o.dtype), new, state)


def with_axis_names(fn: Callable[..., Any], names: Sequence[str]) -> Callable[..., Any]:
    """``fn`` with each of ``names`` bound to a mapped axis of size 1, so that collectives a
    model written for ``pmap`` calls over them (``lax.pmean(x, "batch")``) run, as identities.

    Under ``jit`` the model sees global arrays: a mean over the batch dimension is already the
    whole batch's mean, which is what the ``pmap`` author's ``pmean`` over devices computed.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = with_axis_names(lambda x: jax.lax.pmean(x.mean(), "batch"), ["batch"])
      >>> float(f(jnp.arange(4.0)))
      1.5
    """
    if not names:
        return fn

    def bound(*args: Any) -> Any:
        mapped = fn
        for name in names:
            mapped = jax.vmap(mapped, in_axes=None, axis_size=1, axis_name=name)
        return jax.tree.map(lambda x: x.reshape(x.shape[len(names) :]), mapped(*args))

    return bound


_UNBOUND_AXIS = re.compile(r"unbound axis name: ([^\s.,;]+)")
_MISSING_RNG = re.compile(r'needs PRNG for "([^"]+)"')


def names_needed(
    trace: Callable[[Sequence[str], Sequence[str]], Any], label: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The named axes and the RNG streams ``trace(axis_names, rng_names)`` needs: it is run with
    none, then with each name its errors report missing added (an unbound axis ``NameError``,
    Flax's ``InvalidRngError``), until it traces. A Linen module shows both only when it runs
    (``BatchNorm(axis_name=...)``, ``self.make_rng("noise")``).

    Returns:
      ``(axis_names, rng_names)``, each in the order found.
    """
    axes: list[str] = []
    rngs: list[str] = []
    for _ in range(16):
        try:
            trace(tuple(axes), tuple(rngs))
            return tuple(axes), tuple(rngs)
        except (NameError, flax_errors.InvalidRngError) as e:
            pattern, found_in = (_UNBOUND_AXIS, axes) if isinstance(e, NameError) else (_MISSING_RNG, rngs)
            found = pattern.search(str(e))
            if found is None or found.group(1) in found_in:
                raise
            found_in.append(found.group(1))
    raise ModelError(
        f"Model {label} needs more than 16 named axes and RNG streams ({axes}, {rngs}); shardkit provides up to 16."
    )


def linen_rngs(key: jax.Array, names: Sequence[str]) -> dict[str, jax.Array]:
    """The RNG streams of a Linen call: ``dropout`` is the step's key, and each other stream the
    module asks for (``self.make_rng("noise")``) is ``fold_in(key, i + 1)``, ``i`` its place in
    ``names``.

    Example:
      >>> import jax
      >>> sorted(linen_rngs(jax.random.key(0), ["noise"]))
      ['dropout', 'noise']
    """
    return {"dropout": key, **{name: jax.random.fold_in(key, i + 1) for i, name in enumerate(names)}}


def _stateful_apply(label: str) -> Callable[[Params, Any, jax.Array | None], Any]:
    """``Model.apply`` of a model with state: refuses, naming the call that takes the state."""

    def apply(params: Params, inputs: Any, key: jax.Array | None) -> Any:
        raise ModelError(
            f"Model {label} keeps state besides its parameters (running statistics), so apply(params, inputs, key) "
            "cannot run it. Fix: call shardkit.models.model.apply_model(model, params, state, inputs, key), or "
            "model.state_apply(params, state, inputs, key), with the train state's .model_state."
        )

    return apply


def model_facts(model: Model) -> dict[str, Any]:
    """``model.info``, with ``layers``, ``dim`` and ``matmul_params`` inferred from the
    parameters' names and shapes where the model did not give them.

    - ``dim``: the most common size of dimensions named ``embed``;
    - ``layers``: the size of a ``layers`` dimension, else the number of numbered submodules
      on the parameter paths (``layers/3/...``, ``block_3/...``);
    - ``matmul_params``: parameters of two or more dimensions, less an input embedding table
      (named ``vocab`` x ``embed``) when another ``vocab`` parameter is the output head.

    Example:
      >>> import shardkit as sk
      >>> facts = model_facts(sk.models.GPTConfig.preset("tiny").model())
      >>> facts["layers"], facts["dim"]
      (2, 64)
    """
    info = dict(model.info)
    if {"layers", "dim", "matmul_params"} <= info.keys():
        return info
    shapes = jax.tree_util.tree_flatten_with_path(model.abstract_params())[0]
    axes = jax.tree.leaves(model.axes, is_leaf=lambda x: isinstance(x, Axes))
    rows = [(path_str(p), tuple(leaf.shape), ax.names or ()) for (p, leaf), ax in zip(shapes, axes, strict=True)]
    embed = collections.Counter(n for _, shape, names in rows for n, name in zip(shape, names) if name == "embed")
    info.setdefault("dim", embed.most_common(1)[0][0] if embed else 0)
    stacked = [n for _, shape, names in rows for n, name in zip(shape, names) if name == "layers"]
    numbered: dict[str, set[str]] = collections.defaultdict(set)
    for path, _, _ in rows:
        for prefix, index in re.findall(r"(?:^|/)([A-Za-z_]*?)_?(\d+)(?=/)", path):
            numbered[prefix].add(index)
    info.setdefault("layers", stacked[0] if stacked else max((len(v) for v in numbered.values()), default=0))
    matrices = [(shape, names) for _, shape, names in rows if len(shape) >= 2]
    vocab = [math.prod(shape) for shape, names in matrices if "vocab" in names]
    table = [math.prod(shape) for shape, names in matrices if tuple(names) == ("vocab", "embed")]
    untied_table = table[0] if table and len(vocab) > 1 else 0
    info.setdefault("matmul_params", sum(math.prod(shape) for shape, _ in matrices) - untied_table)
    return info


@dataclasses.dataclass(frozen=True, eq=False)
class Stages:
    """How a model splits into pipeline stages: ``head(body(embed(inputs)))`` equals ``apply``.

    Attributes:
      layers: the top-level key of ``params`` that holds the stacked layers (every leaf has a
        leading layer dimension); a stage runs ``body`` with a contiguous slice of it.
      embed: ``(params, inputs, key) -> x``, the activation entering the first layer
        (e.g. ``(B, T) tokens -> (B, T, D)``).
      body: ``(params, x, key, first_layer) -> (x, aux_loss)``: the layers in
        ``params[layers]`` (whatever their number), numbered from ``first_layer`` (so dropout
        draws the same bits as the whole model); ``aux_loss`` is their share of any
        auxiliary loss (0 if none).
      head: ``(params, x) -> outputs``, as ``apply`` returns them less the auxiliary loss.
      n_layers: ``L``, the size of the layer dimension.
    """

    layers: str
    embed: Callable[[Params, Any, jax.Array | None], jax.Array]
    body: Callable[[Params, jax.Array, jax.Array | None, jax.Array], tuple[jax.Array, jax.Array]]
    head: Callable[[Params, jax.Array], Any]
    n_layers: int


LINEN_EVAL_WRITES = """\
Model {name} writes its state {collections} when evaluated: {error}
Fix: give the flag that makes it read its running statistics, as eval_kwargs={{'train': False}}
(and train_kwargs={{'train': True}}), with your argument's name.
"""


def from_nnx(
    make: Callable[[nnx.Rngs], nnx.Module] | nnx.Module,
    *,
    name: str | None = None,
    info: Mapping[str, Any] | None = None,
    stacked_layers: str | None = None,
    boundaries: bool = True,
    train_kwargs: Mapping[str, Any] | None = None,
    eval_kwargs: Mapping[str, Any] | None = None,
) -> Model:
    """Wrap a Flax NNX model.

    Pass a constructor ``rngs -> module`` so that parameters are created already sharded, inside
    a jitted init (an existing module instance also works: its values are resharded from where
    they are). The module's ``__call__(inputs, rngs=None)`` gets ``rngs`` (:func:`nnx_rngs`) when
    the step has a key, if it accepts ``rngs``. RNG streams the module stores, as Flax's own
    examples write dropout (``nnx.Dropout(0.1, rngs=rngs)``), are not training state: at each
    call stream ``i`` is keyed ``fold_in(key, i)`` (:func:`stream_values`), so the bits depend on
    the seed and the step, not on the layout. Without a key (evaluation) any module runs as
    ``nnx.view(module, deterministic=True)``, as ``model.eval()`` would; in a training step
    submodules that leave ``deterministic`` unset get ``False``, as after ``model.train()``.
    Other variables (``nnx.BatchNorm``'s running statistics, any ``nnx.Variable`` that is not a
    parameter) are the model's state (:attr:`Model.state_init`): a training step updates them
    (``use_running_average`` left unset becomes False, as after ``model.train()``) and evaluation
    reads them (``use_running_average=True``, as after ``model.eval()``). A module whose
    ``__call__`` takes a flag (``train: bool``) gets ``train_kwargs`` in a training step and
    ``eval_kwargs`` when evaluated, as :func:`from_linen` does.

    Shardings come from the parameters' metadata: :func:`shardkit.logical` names, or Flax's own
    ``nnx.with_partitioning`` names (mesh axes are used as such, other names resolve through
    the rules; see :mod:`shardkit.core.partition`).

    With ``boundaries`` (the default) every submodule call runs in a named scope of its path and
    its batched outputs are constrained (:mod:`shardkit.models.boundaries`), so a model that constrains
    none of its activations still gets the layout's collectives (ZeRO-3 under ``fsdp``). A
    model that constrains its own activations everywhere may turn it off.

    Pipeline parallelism needs to know where the layers are: pass ``stacked_layers``, the
    attribute holding the layers stacked along a leading ``layers`` axis (``nnx.vmap``), and give
    the module three methods that compose to ``__call__``: ``embed_inputs(inputs, key)``,
    ``run_layers(x, key, first_layer) -> (x, aux_loss)`` and ``head(x)``, where ``key`` is the
    one dropout key ``__call__`` draws from its ``rngs`` (see :class:`shardkit.models.GPT`).

    Example:
      >>> import shardkit as sk
      >>> model = sk.from_nnx(lambda rngs: sk.models.MLP(sk.models.MLPConfig(), rngs=rngs))
    """
    if not (isinstance(make, nnx.Module) or callable(make)):
        raise ModelError(
            f"from_nnx takes a function of rngs that builds the module (lambda rngs: MyModel(..., rngs=rngs)) or a "
            f"module, got {short_repr(make)}."
        )
    instance = make if isinstance(make, nnx.Module) else None
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: instance if instance is not None else make(nnx.Rngs(0)))
    graphdef, abstract_params, abstract_streams, rest = nnx.split(abstract, nnx.Param, nnx.RngState, ...)  # type: ignore[misc]
    label = name or type(abstract).__name__
    kept = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(rest))[0]  # the model's state
    kinds = nnx.Any(*{type(v) for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))})
    streams = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract_streams))[0]
    for what, found, fix in (
        ("RNG streams", streams, "take `rngs` in __call__ and pass it on (nnx.Dropout(...)(x, rngs=rngs))"),
        ("state besides its parameters", kept, "normalize without running statistics (nnx.LayerNorm, nnx.RMSNorm)"),
    ):
        if found and stacked_layers is not None:
            raise ModelError(
                f"Model {label} stores {what} ({path_str(found[0][0])}), which pipeline stages cannot split. "
                f"Fix: {fix}, or drop stacked_layers and the stage axis."
            )
    takes_rngs = "rngs" in inspect.signature(type(abstract).__call__).parameters
    training, evaluating = _call_kwargs(label, train_kwargs, eval_kwargs)

    def init(key: jax.Array) -> Params:
        if instance is not None:
            return nnx.to_pure_dict(nnx.state(instance, nnx.Param))
        with nnx.use_eager_sharding(False):
            module = make(nnx.Rngs(key))
        return nnx.to_pure_dict(nnx.state(module, nnx.Param))

    def call(module: nnx.Module, inputs: Any, key: jax.Array | None) -> Any:
        kwargs = evaluating if key is None else training
        if takes_rngs:
            return module(inputs, rngs=None if key is None else nnx_rngs(key), **kwargs)
        return module(inputs, **kwargs)

    def run(params: Params, state: Any, inputs: Any, key: jax.Array | None) -> tuple[Any, nnx.Module]:
        values = [params, *([stream_values(streams, key)] if streams else []), *([state] if kept else [])]
        module = nnx.merge(graphdef, *values)
        if key is None:  # no key, no randomness, the running statistics read: as model.eval() would
            module = nnx.view(module, deterministic=True, use_running_average=True, raise_if_not_found=False)
        else:
            _train_unset(module)
        if not boundaries:
            return call(module, inputs, key), module
        with batch_in_flight(inputs), nnx_boundaries(module):
            return constrain_outputs(call(module, inputs, key), (inputs,)), module

    names = _nnx_axis_names(abstract)

    def apply(params: Params, inputs: Any, key: jax.Array | None) -> Any:
        return with_axis_names(lambda p, x, k: run(p, None, x, k)[0], names)(params, inputs, key)

    def state_init(key: jax.Array) -> Any:
        if instance is not None:
            return nnx.to_pure_dict(nnx.state(instance, kinds))
        with nnx.use_eager_sharding(False):
            module = make(nnx.Rngs(key))
        return nnx.to_pure_dict(nnx.state(module, kinds))

    def stateful_call(params: Params, state: Any, inputs: Any, key: jax.Array | None) -> tuple[Any, Any]:
        outputs, module = run(params, state, inputs, key)
        if key is None:
            return outputs, state
        new = nnx.to_pure_dict(nnx.state(module, kinds))
        if _paths(new) != _paths(state):
            raise ModelError(
                f"Model {label} changed the structure of its state during a call (variables added or removed). "
                "Fix: create every non-parameter variable in __init__."
            )
        return outputs, new

    state_apply = with_axis_names(stateful_call, names)

    axes = _plain_dict(nnx_axes(abstract_params))
    stages = None if stacked_layers is None else _nnx_stages(graphdef, abstract, stacked_layers, label)
    if not kept:
        return Model(init, apply, axes, label, dict(info or {}), stages, axis_names=names)
    stateful = Model(init, _stateful_apply(label), axes, label, dict(info or {}), stages, axis_names=names)
    return dataclasses.replace(stateful, state_init=state_init, state_apply=state_apply)


def nnx_rngs(key: jax.Array) -> nnx.Rngs:
    """The ``rngs`` an NNX ``__call__`` gets in a training step: a ``dropout`` stream keyed by the
    step's key, and a default stream (``fold_in(key, 1)``) that serves any other name the module
    draws from (``rngs.noise()``)."""
    return nnx.Rngs(jax.random.fold_in(key, 1), dropout=key)


def _nnx_axis_names(module: nnx.Module) -> tuple[str, ...]:
    """The named axes that submodules reduce over (``nnx.BatchNorm(axis_name="batch")``, written
    for ``pmap`` or ``shard_map``), in order of first appearance."""
    names: list[str] = []
    for _, sub in nnx.iter_modules(module):
        given = vars(sub).get("axis_name")
        for name in (given,) if isinstance(given, str) else given if isinstance(given, tuple) else ():
            if isinstance(name, str) and name not in names:
                names.append(name)
    return tuple(names)


_TRAIN_FLAGS = {"deterministic": False, "use_running_average": False}


def _train_unset(module: nnx.Module) -> None:
    """Set the mode flags that submodules leave unset (``None``) as ``model.train()`` would before a
    training loop: ``deterministic=False`` (``nnx.MultiHeadAttention`` with dropout needs one or the
    other) and ``use_running_average=False``; an explicit value stays. ``module`` is this call's
    merged copy."""
    for _, sub in nnx.iter_modules(module):
        for flag, value in _TRAIN_FLAGS.items():
            if vars(sub).get(flag, False) is None:
                setattr(sub, flag, value)


def stream_values(streams: Sequence[tuple[Any, Any]], key: jax.Array | None) -> dict[str, Any]:
    """Values for an NNX module's stored RNG streams (``nnx.Dropout(..., rngs=rngs)``) at one call.

    Stream ``i`` (ordered by its path, as a tuple of strings: ``("dropout1", "rngs")`` before
    ``("dropout2", "rngs")``) gets the key ``fold_in(key, i)`` (split into one key per layer for
    a stream of stacked layers, ``nnx.vmap``) and a count of 0, so a step's
    random bits depend on the step's key alone, as when ``rngs`` are passed in: the streams are
    not training state, and a restarted run draws what the first one drew.

    Args:
      streams: ``(path, abstract leaf)`` pairs of the module's ``nnx.RngState`` (flattened pure dict).
      key: the call's key, or None (no randomness; any key will do, the module is deterministic).

    Returns:
      A nested pure dict for ``nnx.merge``.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> abstract = nnx.eval_shape(lambda: nnx.Dropout(0.5, rngs=nnx.Rngs(0)))
      >>> pairs = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(abstract, nnx.RngState)))[0]
      >>> sorted(stream_values(pairs, jax.random.key(1))["rngs"])
      ['count', 'key']
    """
    if key is None:
        key = jax.random.key(0)
    elif not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    owner = [tuple(str(p.key) for p in path[:-1]) for path, _ in streams]  # the stream of each leaf
    index = {o: i for i, o in enumerate(sorted(set(owner)))}
    values: dict[str, Any] = {}
    for (path, leaf), stream in zip(streams, owner, strict=True):
        if path[-1].key == "count":
            value = jax.numpy.zeros(leaf.shape, leaf.dtype)
        else:
            value = jax.random.fold_in(key, index[stream])
            if leaf.shape:  # a stream of stacked layers (nnx.vmap, nnx.split_rngs): one key per layer
                value = jax.random.split(value, math.prod(leaf.shape)).reshape(leaf.shape)
            if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                value = jax.random.key_data(value)
        node = values
        for part in path[:-1]:
            node = node.setdefault(part.key, {})
        node[path[-1].key] = value
    return values


def _nnx_stages(graphdef: Any, abstract: nnx.Module, layers: str, label: str) -> Stages:
    """The pipeline pieces of an NNX module that follows the protocol in :func:`from_nnx`."""
    missing = [m for m in ("embed_inputs", "run_layers", "head") if not callable(getattr(abstract, m, None))]
    held = getattr(abstract, layers, None)
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(held, nnx.Param))) if isinstance(held, nnx.Module) else []
    if missing or not leaves:
        raise ModelError(
            f"Model {label} cannot be split into pipeline stages: "
            + (f"it lacks the method(s) {', '.join(missing)}" if missing else f"it has no stacked layers at {layers!r}")
            + ". Fix: stack the layers with nnx.vmap in one attribute and define embed_inputs, run_layers and "
            "head (see shardkit.models.GPT), or drop the stage axis from the layout."
        )

    def base_key(key: jax.Array | None) -> jax.Array | None:
        return None if key is None else nnx.Rngs(dropout=key).dropout()  # what __call__ draws

    def embed(params: Params, inputs: Any, key: jax.Array | None) -> jax.Array:
        return nnx.merge(graphdef, params).embed_inputs(inputs, base_key(key))

    def body(params: Params, x: jax.Array, key: jax.Array | None, first: jax.Array) -> tuple[jax.Array, jax.Array]:
        return nnx.merge(graphdef, params).run_layers(x, base_key(key), first)

    def head(params: Params, x: jax.Array) -> Any:
        return nnx.merge(graphdef, params).head(x)

    return Stages(layers, embed, body, head, int(leaves[0].shape[0]))


def _paths(tree: Any) -> list[str]:
    """The leaves' paths of ``tree``, in order: two trees of the same structure have the same."""
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _plain_dict(tree: Any) -> Any:
    """An NNX ``State`` (a mapping) as nested plain dicts, leaves unchanged."""
    if isinstance(tree, Mapping):
        return {k: _plain_dict(v) for k, v in tree.items()}
    return tree


def from_linen(
    module: nn.Module,
    *example_inputs: Any,
    name: str | None = None,
    info: Mapping[str, Any] | None = None,
    boundaries: bool = True,
    train_kwargs: Mapping[str, Any] | None = None,
    eval_kwargs: Mapping[str, Any] | None = None,
) -> Model:
    """Wrap a Flax Linen module.

    Shardings come from its boxes: ``nn.with_logical_partitioning`` names resolve through the
    rules; ``nn.with_partitioning`` names mesh axes, used as such.

    Args:
      module: the Linen module.
      example_inputs: one input for ``module.init``, shaped like what the loss passes to the
        model (shapes only matter; e.g. ``jnp.zeros((2, 16))``).
      name: shown in tables.
      info: facts reports use (see :class:`Model`); inferred from the parameters when absent.
      boundaries: constrain every submodule's batched outputs (:mod:`shardkit.models.boundaries`).
      train_kwargs: keyword arguments of ``__call__`` in a training step (and at ``init``), for a
        module written as ``__call__(self, x, train: bool)``: ``{"train": True}``.
      eval_kwargs: the same when evaluating (no dropout key): ``{"train": False}``.

    Collections a training call reads and writes back (``nn.BatchNorm``'s ``batch_stats``) are the
    model's state (:attr:`Model.state_init`): a training step applies the module with them
    mutable and keeps what it wrote; evaluation reads them (give ``eval_kwargs`` that make the
    module use its running averages, else evaluating raises ``ModelError``). Collections it only
    appends to (``sow``) are dropped. Named axes a module written for ``pmap`` reduces over
    (``nn.BatchNorm(axis_name="batch")``) are bound to axes of size 1 (:func:`with_axis_names`),
    and RNG streams besides ``dropout`` (``self.make_rng("noise")``) are keyed from the step's key
    (:func:`linen_rngs`); both are found by tracing ``init`` and one training call here.

    Example:
      >>> import flax.linen as nn, jax.numpy as jnp
      >>> model = from_linen(nn.Dense(4), jnp.zeros((1, 8)))
    """
    label = name or type(module).__name__
    training, evaluating = _call_kwargs(label, train_kwargs, eval_kwargs)
    if len(example_inputs) != 1:
        raise ModelError(
            f"from_linen({label}, ...) takes one example input, shaped like what the loss passes to the model; got "
            f"{len(example_inputs)}. Fix: give other arguments of __call__ by keyword, as train_kwargs={{'train': "
            "True}, eval_kwargs={'train': False}."
        )

    streams: tuple[str, ...] = ()  # RNG streams besides dropout, found by the trace below

    def init_all(key: jax.Array) -> Any:  # every collection
        return module.init({"params": key, **linen_rngs(key, streams)}, *example_inputs, **training)

    def call(variables: Any, inputs: Any, key: jax.Array | None, mutable: Sequence[str]) -> Any:
        rngs = None if key is None else linen_rngs(key, streams)
        kwargs = evaluating if key is None else training
        if not boundaries:
            return module.apply(variables, inputs, rngs=rngs, mutable=list(mutable) or False, **kwargs)
        with batch_in_flight(inputs), linen_boundaries():
            out = module.apply(variables, inputs, rngs=rngs, mutable=list(mutable) or False, **kwargs)
            if mutable:
                return constrain_outputs(out[0], (inputs,)), out[1]
            return constrain_outputs(out, (inputs,))

    traced: dict[str, Any] = {}

    def trace(names: Sequence[str], rng_names: Sequence[str]) -> None:
        """Every collection's shapes after init and after a training call that may write them all
        (Flax's BatchNorm reaches its ``axis_name`` only when applied, not at init)."""
        nonlocal streams
        streams, key = tuple(rng_names), jax.random.key(0)
        traced["variables"] = variables = jax.eval_shape(with_axis_names(init_all, names), key)
        others = sorted(set(variables) - {"params"})
        training_call = with_axis_names(lambda v: call(v, example_inputs[0], key, others), names)
        out = jax.eval_shape(training_call, variables)  # run always: init need not reach every name
        traced["updated"] = out[1] if others else {}

    try:
        names, streams = names_needed(trace, label)
    except TypeError as e:
        if "argument" not in str(e):
            raise
        raise ModelError(
            f"{label}.init with the example input failed: {e}. Fix: pass the other arguments of __call__ as "
            "train_kwargs={'train': True}, eval_kwargs={'train': False} (your names and values)."
        ) from e
    variables, updated = traced["variables"], traced["updated"]
    init = with_axis_names(lambda key: nn.meta.unbox(init_all(key)["params"]), names)
    apply = with_axis_names(lambda params, inputs, key: call({"params": params}, inputs, key, ()), names)
    # State: the collections a training call reads and writes back in the same structure; those it
    # only appends to (sow intermediates, growing at each call) are left out, and sow stores nothing.
    kept = tuple(c for c in sorted(updated) if c in variables and _paths(updated[c]) == _paths(variables[c]))
    axes = linen_axes(variables["params"])
    if not kept:
        return Model(init, apply, axes, label, dict(info or {}), axis_names=names)

    def state_init(key: jax.Array) -> Any:
        made = init_all(key)
        return {c: nn.meta.unbox(made[c]) for c in kept}

    def state_apply(params: Params, state: Any, inputs: Any, key: jax.Array | None) -> tuple[Any, Any]:
        if key is not None:
            outputs, updated = call({"params": params, **state}, inputs, key, kept)
            return outputs, {c: updated[c] for c in kept}
        try:
            return call({"params": params, **state}, inputs, None, ()), state
        except flax_errors.ModifyScopeVariableError as e:
            raise ModelError(LINEN_EVAL_WRITES.format(name=label, collections=list(kept), error=e)) from None

    bound_init, bound_apply = with_axis_names(state_init, names), with_axis_names(state_apply, names)
    refusing, facts = _stateful_apply(label), dict(info or {})
    return Model(init, refusing, axes, label, facts, state_init=bound_init, state_apply=bound_apply, axis_names=names)


def _call_kwargs(
    label: str, train_kwargs: Mapping[str, Any] | None, eval_kwargs: Mapping[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword arguments of a training call and of an evaluating one, checked."""
    for what, given in (("train_kwargs", train_kwargs), ("eval_kwargs", eval_kwargs)):
        if given is not None and not (isinstance(given, Mapping) and all(isinstance(k, str) for k in given)):
            raise ModelError(f"{what} for {label} must map argument names to values, got {short_repr(given)}.")
    return dict(train_kwargs or {}), dict(eval_kwargs or {})


def annotate(model: Model, patterns: Sequence[RegexRule], *, override: bool = True, strict: bool = False) -> Model:
    """Give a model's parameters logical names (or specs) from regex rules on their paths.

    The model's own annotations stay where no rule matches; a parameter with neither its own
    names nor a matching rule is an error (nothing is left unsharded by accident).

    Args:
      model: the model to annotate.
      patterns: ``[(regex, names | PartitionSpec | None), ...]``, first match wins
        (see :func:`shardkit.core.partition.regex_axes`).
      override: rules replace the names of the parameters they match (default); with False
        they only fill parameters the model left unannotated.
      strict: a rule that matches no parameter is an error; by default it is a warning, kept
        in ``model.notes`` and listed by the report (one rule list can serve two variants).

    Example:
      >>> import flax.linen as nn, jax.numpy as jnp
      >>> m = annotate(from_linen(nn.Dense(8), jnp.zeros((1, 4))),
      ...              [(r"kernel$", ("embed", "mlp")), (r"bias$", ("mlp",))])
      >>> str(m.axes["kernel"])
      '(embed, mlp)'
    """
    axes, unused = regex_axes(model.abstract_params(), patterns, model.axes, override=override, strict=strict)
    notes = [f"regex rule {p!r} matched no parameter of {model.name}" for p in unused]
    for note in notes:
        warnings.warn(note + " (pass strict=True to make this an error)", stacklevel=2)
    return dataclasses.replace(model, axes=axes, notes=(*model.notes, *notes))


def from_functions(
    init: Callable[[jax.Array], Params],
    apply: Callable[[Params, Any, jax.Array | None], Any],
    patterns: Sequence[RegexRule],
    *,
    name: str = "model",
) -> Model:
    """A model from plain JAX functions, its parameters named by regex rules."""
    return annotate(Model(init, apply, None, name), patterns)
