"""The NNX adapter: a Flax NNX module (or a function of ``rngs`` that builds one) as a
:class:`~shardkit.models.model.Model`.

:func:`from_nnx` reads the module once, abstractly (``nnx.eval_shape``), into its parts
(:class:`NnxParts`: graph, parameters, stored RNG streams, other state) and builds the model's
functions from them (:class:`NnxCall`): parameters created inside a jitted init, RNG streams keyed
from the step's key (:func:`stream_values`), train and eval modes as ``model.train()`` and
``model.eval()`` set them, submodule calls bounded (:mod:`shardkit.models.boundaries`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from shardkit.core.errors import ModelError, short_repr
from shardkit.core.partition import nnx_axes, path_str
from shardkit.models.boundaries import batch_in_flight, constrain_outputs, nnx_boundaries
from shardkit.models.model import Model, Params, Stages, call_kwargs, leaf_paths, refusing_apply, with_axis_names


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
    parts = NnxParts.of(make)
    label = name or type(parts.abstract).__name__
    if stacked_layers is not None:
        parts.refuse_stage_split(label)
    training, evaluating = call_kwargs(label, train_kwargs, eval_kwargs)
    takes_rngs = "rngs" in inspect.signature(type(parts.abstract).__call__).parameters
    calls = NnxCall(parts, label, takes_rngs, boundaries, training, evaluating)
    names = _nnx_axis_names(parts.abstract)
    axes = _plain_dict(nnx_axes(parts.abstract_params))
    stages = None if stacked_layers is None else _nnx_stages(parts.graphdef, parts.abstract, stacked_layers, label)
    facts = dict(info or {})
    if not parts.kept:
        return Model(parts.init, with_axis_names(calls.apply, names), axes, label, facts, stages, axis_names=names)
    stateful = Model(parts.init, refusing_apply(label), axes, label, facts, stages, axis_names=names)
    state_apply = with_axis_names(calls.stateful, names)
    return dataclasses.replace(stateful, state_init=parts.state_init, state_apply=state_apply)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: its bound methods are traced functions
class NnxParts:
    """An NNX module read abstractly: what :func:`from_nnx` builds a model from.

    Attributes:
      make: the function of ``rngs`` that builds the module, or None for a module given whole.
      instance: the module given whole, or None.
      abstract: the module's abstract copy (shapes only).
      graphdef: its graph, for ``nnx.merge``.
      abstract_params: its ``nnx.Param`` state.
      streams: ``(path, leaf)`` of its stored RNG streams (``nnx.Dropout(..., rngs=rngs)``).
      kept: ``(path, leaf)`` of its other state (running statistics): the model's state.
      kinds: the variable types of that state, as an NNX filter.
    """

    make: Callable[[nnx.Rngs], nnx.Module] | None
    instance: nnx.Module | None
    abstract: nnx.Module
    graphdef: Any
    abstract_params: Any
    streams: list[tuple[Any, Any]]
    kept: list[tuple[Any, Any]]
    kinds: Any

    @classmethod
    def of(cls, make: Callable[[nnx.Rngs], nnx.Module] | nnx.Module) -> NnxParts:
        """Read ``make`` (a builder or a module) once, abstractly."""
        instance = make if isinstance(make, nnx.Module) else None
        with nnx.use_eager_sharding(False):
            build = (lambda: instance) if instance is not None else (lambda: make(nnx.Rngs(0)))
            abstract = nnx.eval_shape(build)
        graphdef, params, streams, rest = nnx.split(abstract, nnx.Param, nnx.RngState, ...)  # type: ignore[misc]
        kinds = nnx.Any(*{type(v) for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))})
        return cls(
            None if instance is not None else make,
            instance,
            abstract,
            graphdef,
            params,
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(streams))[0],
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(rest))[0],
            kinds,
        )

    def refuse_stage_split(self, label: str) -> None:
        """Refuse pipeline stages of a module that stores RNG streams or state besides parameters."""
        pass_rngs = "take `rngs` in __call__ and pass it on (nnx.Dropout(...)(x, rngs=rngs))"
        no_statistics = "normalize without running statistics (nnx.LayerNorm, nnx.RMSNorm)"
        if any("lora_dropout" in path_str(path) for path, _ in self.streams):
            pass_rngs = "LoRA(dropout=0.0): adapter dropout across pipeline stages is for shardkit's GPT"
        for what, found, fix in (
            ("RNG streams", self.streams, pass_rngs),
            ("state besides its parameters", self.kept, no_statistics),
        ):
            if found:
                raise ModelError(
                    f"Model {label} stores {what} ({path_str(found[0][0])}), which pipeline stages cannot split. "
                    f"Fix: {fix}, or drop stacked_layers and the stage axis."
                )

    def _built(self, key: jax.Array) -> nnx.Module:
        if self.instance is not None:
            return self.instance
        with nnx.use_eager_sharding(False):
            return self.make(nnx.Rngs(key))  # type: ignore[misc]

    def init(self, key: jax.Array) -> Params:
        """The parameters, as a nested pure dict (inside a jitted init: born sharded)."""
        return nnx.to_pure_dict(nnx.state(self._built(key), nnx.Param))

    def state_init(self, key: jax.Array) -> Any:
        """The model's state besides its parameters (running statistics)."""
        return nnx.to_pure_dict(nnx.state(self._built(key), self.kinds))


@dataclasses.dataclass(frozen=True, eq=False)
class NnxCall:
    """One call of the module from pure values: merged, set to train or eval mode, bounded."""

    parts: NnxParts
    label: str
    takes_rngs: bool
    boundaries: bool
    training: dict[str, Any]
    evaluating: dict[str, Any]

    def _call(self, module: nnx.Module, inputs: Any, key: jax.Array | None) -> Any:
        kwargs = self.evaluating if key is None else self.training
        if self.takes_rngs:
            return module(inputs, rngs=None if key is None else nnx_rngs(key), **kwargs)
        return module(inputs, **kwargs)

    def run(self, params: Params, state: Any, inputs: Any, key: jax.Array | None) -> tuple[Any, nnx.Module]:
        """The outputs, and the merged module (whose state a training call updated)."""
        parts = self.parts
        streams = [stream_values(parts.streams, key)] if parts.streams else []
        module = nnx.merge(parts.graphdef, params, *streams, *([state] if parts.kept else []))
        if key is None:  # no key, no randomness, the running statistics read: as model.eval() would
            module = nnx.view(module, deterministic=True, use_running_average=True, raise_if_not_found=False)
        else:
            _train_unset(module)
        if not self.boundaries:
            return self._call(module, inputs, key), module
        with batch_in_flight(inputs), nnx_boundaries(module):
            return constrain_outputs(self._call(module, inputs, key), (inputs,)), module

    def apply(self, params: Params, inputs: Any, key: jax.Array | None) -> Any:
        """``Model.apply`` of a module without state."""
        return self.run(params, None, inputs, key)[0]

    def stateful(self, params: Params, state: Any, inputs: Any, key: jax.Array | None) -> tuple[Any, Any]:
        """``Model.state_apply``: the outputs and the state a training call leaves (evaluation keeps it)."""
        outputs, module = self.run(params, state, inputs, key)
        if key is None:
            return outputs, state
        new = nnx.to_pure_dict(nnx.state(module, self.parts.kinds))
        if leaf_paths(new) != leaf_paths(state):
            raise ModelError(
                f"Model {self.label} changed the structure of its state during a call (variables added or removed). "
                "Fix: create every non-parameter variable in __init__."
            )
        return outputs, new


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


def _plain_dict(tree: Any) -> Any:
    """An NNX ``State`` (a mapping) as nested plain dicts, leaves unchanged."""
    if isinstance(tree, Mapping):
        return {k: _plain_dict(v) for k, v in tree.items()}
    return tree
