"""Model: what shardkit needs of a Flax model, whatever API it was written in.

A :class:`Model` is a pure ``init(key) -> params`` and ``apply(params, inputs, key) -> outputs``
over a plain params pytree (nested dicts of arrays), plus the logical axis names of every
parameter. A model that keeps state besides its parameters (``nnx.BatchNorm``'s running
statistics, Linen's ``batch_stats``) has ``state_init`` and ``state_apply`` instead of a usable
``apply``; :func:`apply_model` calls either kind. The adapters build one:
:func:`shardkit.models.nnx_adapter.from_nnx`, :func:`shardkit.models.linen_adapter.from_linen`,
and :func:`annotate` (regex rules) on either, or :func:`from_functions` on plain JAX functions.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from shardkit.core.errors import ModelError, short_repr
from shardkit.core.partition import Axes, RegexRule, path_str, regex_axes
from shardkit.models.kv_cache import Decoder

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
        ``matmul_params`` (parameters used in matmuls, for model FLOPs); ``unrolled_layers``:
        True where parameters stacked over ``layers`` run without a loop (the step then
        compiles as for unstacked layers, :attr:`shardkit.Trainer.loops_over_layers`).
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
      decoder: how the model continues text with a cache
        (:class:`shardkit.models.kv_cache.Decoder`; shardkit's GPT keeps keys and values); None:
        generation runs ``apply`` over whole rows.
      trainable: ``path -> bool`` for a model that trains some parameters only (LoRA adapters
        on a frozen base, :mod:`shardkit.models.lora`): the trainer computes no gradient and
        keeps no optimizer state for the others. None: every parameter trains.
      after_update: ``(params, sums) -> params``, run inside the step after the optimizer's
        update (skipped with it on a non-finite step): parameters moved outside the gradient
        from what the forward pass counted (``sums["expert_tokens"]``, ``(L, E)``, a mixture's
        load; DeepSeek-V3's auxiliary-loss-free balancing of its score biases). None: nothing.
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
    decoder: Decoder | None = None
    trainable: Callable[[str], bool] | None = None
    after_update: Callable[[Params, Mapping[str, jax.Array]], Params] | None = None

    def trainable_mask(self) -> Any:
        """A tree of bools shaped as the parameters: which train (all of them without
        :attr:`trainable`)."""
        shapes = self.abstract_params()
        trainable = self.trainable
        if trainable is None:
            return jax.tree.map(lambda _: True, shapes)
        return jax.tree_util.tree_map_with_path(lambda p, _: bool(trainable(path_str(p))), shapes)

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


def refusing_apply(label: str) -> Callable[[Params, Any, jax.Array | None], Any]:
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


def leaf_paths(tree: Any) -> list[str]:
    """The leaves' paths of ``tree``, in order: two trees of the same structure have the same."""
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def call_kwargs(
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
      >>> from shardkit.models.linen_adapter import from_linen
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


def with_frozen_base(model: Model) -> Model:
    """``model`` whose untrainable parameters (:attr:`Model.trainable`) pass through
    ``stop_gradient`` wherever it reads them (``apply``, ``state_apply`` and a pipeline's stages):
    autodiff computes no gradient for them (no weight-gradient matmul), only the input gradients
    the trainable ones need. Unchanged when every parameter trains."""
    trainable = model.trainable
    if trainable is None:
        return model

    def frozen(params: Params) -> Params:  # by path: a stage's slice of the tree is frozen alike
        keep = lambda p, x: x if trainable(path_str(p)) else jax.lax.stop_gradient(x)
        return jax.tree_util.tree_map_with_path(keep, params)

    apply, state_apply, stages = model.apply, model.state_apply, model.stages
    if stages is not None:
        embed, body, head = stages.embed, stages.body, stages.head
        stages = dataclasses.replace(
            stages,
            embed=lambda params, inputs, key: embed(frozen(params), inputs, key),
            body=lambda params, x, key, first: body(frozen(params), x, key, first),
            head=lambda params, x: head(frozen(params), x),
        )
    return dataclasses.replace(
        model,
        apply=lambda params, inputs, key: apply(frozen(params), inputs, key),
        state_apply=None
        if state_apply is None
        else (lambda params, state, inputs, key: state_apply(frozen(params), state, inputs, key)),
        stages=stages,
    )
