"""LoRA: low-rank adapters on a frozen base (Hu et al., 2021), in peft's vocabulary.

Each targeted projection ``y = x W`` becomes ``y = x W + (alpha / r) (x A) B`` with ``A`` of
shape ``(in, r)`` and ``B`` of ``(r, out)``; ``B`` starts at zero, so a new adapter changes
nothing until it trains. Only ``A`` and ``B`` train: the model marks its parameters trainable by
path (:attr:`shardkit.Model.trainable`), and the trainer computes no gradient and keeps no
optimizer state for the rest.

Targets are named as peft and Hugging Face name the projections of a decoder layer
(:data:`TARGETS`). In shardkit's GPT, ``A`` takes the input dimension's logical name from its
base weight and ``B`` the output dimensions' (``embed`` -> ``fsdp``, heads and MLP units ->
``tensor``), so an adapter is split as its base weight is under every layout.

Example:
  >>> import shardkit as sk
  >>> cfg = sk.models.GPTConfig.preset("tiny", lora=LoRA(rank=4, alpha=8, targets=("q_proj", "v_proj")))
  >>> sorted(k for k in cfg.model().abstract_params()["blocks"]["attn"] if k.startswith("lora"))
  ['lora_q_a', 'lora_q_b', 'lora_v_a', 'lora_v_b']
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardkit.core.errors import ModelError
from shardkit.core.partition import _FLAX_NAMES_KEY
from shardkit.models.dropout import dropout
from shardkit.models.model import Model

# The projections of a decoder layer, as peft's target_modules name them, and the short name
# of each in shardkit's GPT parameters (``lora_q_a``, ``lora_q_b``).
TARGETS: dict[str, str] = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
PREFIX = "lora_"


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters: rank ``r``, scale ``alpha / r``, on the projections ``targets``.

    Attributes:
      rank: ``r``, the adapters' inner size (>= 1).
      alpha: the scale's numerator (peft's ``lora_alpha``).
      targets: peft's ``target_modules`` among :data:`TARGETS`.
      dropout: peft's ``lora_dropout``: in training, the input of each adapter is dropped at
        this rate (the base projection sees it whole). In shardkit's GPT and NNX models the bits
        come from the step's key and follow the rows, so they are the same on any layout; a
        Linen model draws them from its ``dropout`` stream as its own ``nn.Dropout`` would.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ModelError(f"LoRA rank={self.rank!r}: give a whole number >= 1 (peft's r; 8 or 16 are common).")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ModelError(f"LoRA alpha={self.alpha!r}: give a number > 0 (peft's lora_alpha; often 2 x rank).")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ModelError(f"LoRA dropout={self.dropout!r}: give a probability in [0, 1).")
        targets = tuple(self.targets) if not isinstance(self.targets, str) else (self.targets,)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            raise ModelError(
                f"LoRA targets {list(targets)}: {unknown or 'none given'} not among {list(TARGETS)} "
                "(the projections of a decoder layer, as peft's target_modules name them)."
            )
        object.__setattr__(self, "targets", tuple(sorted(set(targets), key=list(TARGETS).index)))

    @property
    def scale(self) -> float:
        """``alpha / rank``, what ``(x A) B`` is multiplied by."""
        return float(self.alpha) / self.rank

    def targets_any(self, names: Sequence[str]) -> bool:
        return any(t in self.targets for t in names)


def is_adapter(path: str) -> bool:
    """Whether a parameter path (``blocks/attn/lora_q_a``) is a LoRA adapter's."""
    return path.rsplit("/", 1)[-1].startswith(PREFIX)


# -- LoRA on any NNX model ---------------------------------------------------------------------

_ADAPTED: dict[type, type] = {}


def _einsum_parts(spec: str) -> tuple[str, str, str]:
    """``"BTD,NDH->BTNH"`` -> its input, kernel and output subscripts."""
    operands, out = spec.replace(" ", "").split("->")
    x, kernel = operands.split(",")
    return x, kernel, out


def _adapter_shapes(module: Any) -> tuple[tuple[int, ...], tuple[int, ...], Callable[[Any, Any, Any], Any]]:
    """``(A's input dims, B's output dims, delta(x, a, b))`` for an ``nnx.Linear`` or
    ``nnx.Einsum``: ``x`` contracted with A over the kernel's input dimensions to ``r``, then
    B to the kernel's output dimensions, laid out as the module's own output."""
    kernel = module.kernel[...]
    if isinstance(module, nnx.Linear):
        shape = kernel.shape[kernel.ndim - 2 :]
        return shape[:1], shape[1:], lambda x, a, b: (x @ a) @ b
    x_spec, k_spec, out_spec = _einsum_parts(module.einsum_str)
    letters = set(x_spec + k_spec + out_spec)
    r = next(c for c in "rRzZqQ" if c not in letters)  # the adapters' inner dimension
    contracted = "".join(c for c in k_spec if c in x_spec and c not in out_spec)
    produced = "".join(c for c in k_spec if c in out_spec)
    rest = "".join(c for c in x_spec if c not in contracted)
    sizes = dict(zip(k_spec, kernel.shape[kernel.ndim - len(k_spec) :], strict=True))
    to_r, from_r = f"{x_spec},{contracted}{r}->{rest}{r}", f"{rest}{r},{r}{produced}->{out_spec}"

    def delta(x: Any, a: Any, b: Any) -> Any:
        return jnp.einsum(from_r, jnp.einsum(to_r, x, a), b)

    return tuple(sizes[c] for c in contracted), tuple(sizes[c] for c in produced), delta


class AdapterDropout(nnx.Dropout):
    """peft's ``lora_dropout`` on an NNX adapter's input: an ``nnx.Dropout`` (train and eval modes
    as ``model.train()`` / ``nnx.view(..., deterministic=True)`` set them) whose bits are drawn by
    :func:`shardkit.models.dropout.dropout`, so they follow the rows: the same on any layout and
    when a step vmaps over each device's rows to reduce gradients once."""

    def __call__(self, inputs: Any, *, deterministic: bool | None = None, rngs: Any = None) -> Any:
        off = self.deterministic if deterministic is None else deterministic
        if off or self.rate == 0.0:
            return inputs
        return dropout(inputs, self.rate, self.rngs())


def _adapter_dropout(rate: float, stack: tuple[int, ...], index: int) -> AdapterDropout:
    """An :class:`AdapterDropout` with its own RNG stream, keyed by the adapter's ``index`` (in a
    shardkit step each call's key comes from the step's key alone; the model's ``rngs`` are
    left alone, so the adapters initialize as without dropout). Stacked layers get one key per
    layer, so ``nnx.scan`` gives each layer its own mask."""
    module = AdapterDropout(rate)
    key = jax.random.key(index)
    keys = jax.random.split(key, math.prod(stack)).reshape(stack) if stack else key
    module.rngs = nnx.RngStream(keys, tag="dropout")
    return module


def _adapted_class(cls: type) -> type:
    """A subclass whose ``__call__`` adds ``(alpha / r) (x A) B`` to the module's own output."""
    if cls not in _ADAPTED:
        original = cls.__call__

        def __call__(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, x, *args, **kwargs)
            a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
            dropped = self.lora_dropout(x) if self.lora_dropout is not None else x  # peft: the adapter's input only
            return out + self.lora_delta(dropped, a, b) * jnp.asarray(self.lora_scale, x.dtype)

        _ADAPTED[cls] = type(cls)(f"LoRA{cls.__name__}", (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _ADAPTED[cls]


def add_adapters(module: nnx.Module, lora: LoRA, targets: str, rngs: nnx.Rngs) -> list[str]:
    """Give each ``nnx.Linear`` / ``nnx.Einsum`` of ``module`` whose path matches ``targets`` (a
    regex, ``re.search``) LoRA adapters ``lora_a`` and ``lora_b``, named as its kernel's input and
    output dimensions. A module created by ``nnx.vmap`` (layers stacked for ``nnx.scan``) has
    leading stacked dimensions on its kernel; its adapters get the same ones, named alike, so
    the scan slices them layer by layer. Returns the adapted paths (an error when none matches)."""
    adapted: list[str] = []
    candidates: list[str] = []
    for path, sub in nnx.iter_modules(module):
        name = "/".join(str(p) for p in path)
        if isinstance(sub, (nnx.Linear, nnx.Einsum)):
            candidates.append(name)
        if not isinstance(sub, (nnx.Linear, nnx.Einsum)) or not re.search(targets, name):
            continue
        ins, outs, delta = _adapter_shapes(sub)
        meta = sub.kernel.get_metadata()
        kernel_shape = sub.kernel[...].shape
        names = tuple(meta.get(_FLAX_NAMES_KEY) or (None,) * len(kernel_shape))
        stacked = len(kernel_shape) - (2 if isinstance(sub, nnx.Linear) else len(_einsum_parts(sub.einsum_str)[1]))
        stack, stack_names, names = kernel_shape[:stacked], names[:stacked], names[stacked:]
        in_names, out_names = names[: len(ins)], names[len(names) - len(outs) :]
        if isinstance(sub, nnx.Einsum):  # the kernel's own order: input letters and output letters
            _, k_spec, out_spec = _einsum_parts(sub.einsum_str)
            by_letter = dict(zip(k_spec, names, strict=True))
            x_spec = _einsum_parts(sub.einsum_str)[0]
            in_names = tuple(by_letter[c] for c in k_spec if c in x_spec and c not in out_spec)
            out_names = tuple(by_letter[c] for c in k_spec if c in out_spec)
        extra = {k: v for k, v in meta.items() if k != _FLAX_NAMES_KEY}  # shardkit's marker, eager_sharding
        fan_in = tuple(range(stacked, stacked + len(ins)))
        a_init = nnx.initializers.variance_scaling(
            1 / 3, "fan_in", "uniform", in_axis=fan_in, out_axis=-1, batch_axis=tuple(range(stacked))
        )
        dtype = sub.kernel[...].dtype
        a = a_init(rngs.params(), (*stack, *ins, lora.rank), dtype)
        b = jnp.zeros((*stack, lora.rank, *outs), dtype)
        target: Any = sub
        a_meta: dict[str, Any] = {**extra, _FLAX_NAMES_KEY: (*stack_names, *in_names, None)}
        b_meta: dict[str, Any] = {**extra, _FLAX_NAMES_KEY: (*stack_names, None, *out_names)}
        target.lora_a, target.lora_b = nnx.Param(a, **a_meta), nnx.Param(b, **b_meta)
        target.lora_delta, target.lora_scale = delta, lora.scale
        target.lora_dropout = _adapter_dropout(lora.dropout, stack, len(adapted)) if lora.dropout else None
        target.__class__ = _adapted_class(type(sub))
        adapted.append(name)
    if not adapted:
        raise ModelError(
            f"LoRA targets {targets!r} match no nnx.Linear or nnx.Einsum of {type(module).__name__}; "
            f"{_its_paths(candidates)} (re.search on them)."
        )
    return adapted


def _its_paths(paths: list[str] | set[str], shown: int = 6) -> str:
    """What a targets error shows: some of the model's own adaptable module paths."""
    if not paths:
        return "it has none (LoRA adapts Linear/Einsum and Dense/DenseGeneral modules)"
    ordered = sorted(paths)
    more = f", ... ({len(ordered)} in all)" if len(ordered) > shown else ""
    return f"its paths are {', '.join(repr(p) for p in ordered[:shown])}{more}"


def with_lora(make: Any, *example_inputs: Any, targets: str, lora: LoRA | None = None, **adapter_kwargs: Any) -> Model:
    """Your model with LoRA adapters on the frozen base; only the adapters train.

    - NNX (``make``: ``rngs -> module``): :func:`shardkit.from_nnx` of it with adapters on every
      ``nnx.Linear`` / ``nnx.Einsum`` whose module path (``layers/0/attn/q``) matches ``targets``;
    - Linen (``make``: a module, then its example inputs): :func:`shardkit.from_linen` of it with
      adapters on every ``nn.Dense`` / ``nn.DenseGeneral`` whose path
      (``block_0/attention/query``) matches.

    Args:
      make: an NNX constructor or a Linen module.
      example_inputs: a Linen module's example inputs (none for NNX).
      targets: a regex over module paths (``re.search``).
      lora: rank and alpha (its ``targets`` unused); default ``LoRA()`` (r=8, alpha 16).
      **adapter_kwargs: as ``from_nnx`` / ``from_linen`` take them.

    Returns:
      The :class:`~shardkit.Model`; each adapted module holds ``lora_a`` ``(in..., r)`` and
      ``lora_b`` ``(r, out...)``, named as its kernel's input and output dimensions (so split as
      the kernel is), and ``(alpha / r) (x A) B`` is added to its output.

    Example:
      >>> from flax import nnx
      >>> model = with_lora(lambda rngs: nnx.Linear(4, 8, rngs=rngs), targets=".*", lora=LoRA(rank=2))
      >>> {k: v.shape for k, v in model.abstract_params().items() if k.startswith("lora")}
      {'lora_a': (4, 2), 'lora_b': (2, 8)}
    """
    from flax import linen as nn

    if isinstance(make, nn.Module):
        return _with_lora_linen(make, *example_inputs, targets=targets, lora=lora, **adapter_kwargs)
    if example_inputs:
        raise ModelError("with_lora: example inputs are for a Linen module; an NNX model takes rngs -> module.")
    from shardkit.models.nnx_adapter import from_nnx

    settings = lora or LoRA()

    def build(rngs: nnx.Rngs) -> nnx.Module:
        module = make(rngs)
        add_adapters(module, settings, targets, rngs)
        return module

    model = from_nnx(build, **adapter_kwargs)
    return dataclasses.replace(model, trainable=is_adapter)


# -- LoRA on any Linen model -------------------------------------------------------------------

# Whether the Linen call running now trains (the step gave it a key): adapter dropout then applies.
_LINEN_TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("linen_lora_training", default=False)


def _linen_interceptor(lora: LoRA, targets: str, adapted: set[str], seen: set[str]) -> Callable[..., Any]:
    """An ``nn.intercept_methods`` interceptor that gives each ``nn.Dense`` / ``nn.DenseGeneral``
    whose module path matches ``targets`` adapters ``lora_a`` / ``lora_b`` (created as its own
    parameters, named as its kernel's dimensions) and adds ``(alpha / r) (x A) B`` to its output."""
    from flax import linen as nn

    def intercept(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.DenseGeneral)):
            return out
        path = "/".join(str(p) for p in (module.scope.path if module.scope is not None else ()))
        seen.add(path)
        if not re.search(targets, path):
            return out
        x = args[0]
        contracted = (-1,) if isinstance(module, nn.Dense) else tuple(np.atleast_1d(module.axis).tolist())
        contracted = tuple(c % x.ndim for c in contracted)
        ins = tuple(x.shape[c] for c in contracted)
        produced = 1 if isinstance(module, nn.Dense) else len(np.atleast_1d(module.features))
        outs = out.shape[out.ndim - produced :]
        kernel: Any = module.get_variable("params", "kernel")
        names = tuple(getattr(kernel, "names", None) or (None,) * (len(ins) + len(outs)))
        a_names, b_names = (*names[: len(ins)], None), (None, *names[len(names) - len(outs) :])
        fan_in = tuple(range(len(ins)))
        a_init: Any = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=fan_in, out_axis=-1)
        b_init: Any = nn.initializers.zeros
        if isinstance(kernel, nn.LogicallyPartitioned):  # named as the kernel is: logical names, or mesh axes
            a_init, b_init = (
                nn.with_logical_partitioning(a_init, a_names),
                nn.with_logical_partitioning(b_init, b_names),
            )
        elif isinstance(kernel, nn.Partitioned):
            a_init, b_init = nn.with_partitioning(a_init, a_names), nn.with_partitioning(b_init, b_names)
        a = nn.meta.unbox(module.param("lora_a", a_init, (*ins, lora.rank), out.dtype))
        b = nn.meta.unbox(module.param("lora_b", b_init, (lora.rank, *outs), out.dtype))
        adapted.add(path)
        batch = [d for d in range(x.ndim) if d not in contracted]
        if lora.dropout and _LINEN_TRAINING.get():
            if module.scope is None or not module.scope.has_rng("dropout"):
                raise ModelError(
                    f"LoRA dropout on {path!r}: the 'dropout' RNG does not reach it (nn.scan and nn.vmap pass only "
                    "the RNGs their split_rngs names). Fix: split_rngs={'params': True, 'dropout': True} on the "
                    "scan, or LoRA(dropout=0.0)."
                )
            x = dropout(x, lora.dropout, module.make_rng("dropout"))
        xa = jnp.tensordot(x, a.astype(x.dtype), axes=(contracted, tuple(range(len(ins)))))  # (batch..., r)
        xa = xa.transpose(*range(len(batch)), len(batch))
        delta = (xa @ b.astype(x.dtype).reshape(lora.rank, -1)).reshape(*xa.shape[:-1], *outs)
        return out + delta * jnp.asarray(lora.scale, out.dtype)

    return intercept


def _with_lora_linen(
    module: Any, *example_inputs: Any, targets: str, lora: LoRA | None = None, **from_linen_kwargs: Any
) -> Model:
    """:func:`with_lora` of a Linen module: ``from_linen`` run under the adapters' interceptor,
    and every later ``init`` and ``apply`` too."""
    from flax import linen as nn

    from shardkit.models.linen_adapter import from_linen

    settings, adapted, seen = lora or LoRA(), set[str](), set[str]()
    interceptor = _linen_interceptor(settings, targets, adapted, seen)
    with nn.intercept_methods(interceptor):  # the adapters exist when from_linen reads the parameters
        model = from_linen(module, *example_inputs, **from_linen_kwargs)
    if not adapted:
        raise ModelError(
            f"LoRA targets {targets!r} match no nn.Dense or nn.DenseGeneral of {type(module).__name__}; "
            f"{_its_paths(seen)} (re.search on them)."
        )

    def intercepted(fn: Callable[..., Any], keyed: bool = False) -> Callable[..., Any]:
        def call(*args: Any) -> Any:  # apply and state_apply take the step's key last (None: evaluating)
            training = _LINEN_TRAINING.set(keyed and args[-1] is not None)
            try:
                with nn.intercept_methods(interceptor):
                    return fn(*args)
            finally:
                _LINEN_TRAINING.reset(training)

        return call

    state_apply = None if model.state_apply is None else intercepted(model.state_apply, keyed=True)
    return dataclasses.replace(
        model,
        init=intercepted(model.init),
        apply=intercepted(model.apply, keyed=True),
        state_apply=state_apply,
        trainable=is_adapter,
    )
