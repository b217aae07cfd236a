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

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

from shardkit.core.errors import ModelError
from shardkit.core.partition import _FLAX_NAMES_KEY
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
      dropout: peft's ``lora_dropout``: in training, the input of each adapter of shardkit's GPT
        is dropped at this rate (the bits follow the rows, so they are the same on any layout);
        ``with_lora`` models apply none yet.
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
        return kernel.shape[:1], kernel.shape[1:], lambda x, a, b: (x @ a) @ b
    x_spec, k_spec, out_spec = _einsum_parts(module.einsum_str)
    letters = set(x_spec + k_spec + out_spec)
    r = next(c for c in "rRzZqQ" if c not in letters)  # the adapters' inner dimension
    contracted = "".join(c for c in k_spec if c in x_spec and c not in out_spec)
    produced = "".join(c for c in k_spec if c in out_spec)
    rest = "".join(c for c in x_spec if c not in contracted)
    sizes = dict(zip(k_spec, kernel.shape, strict=True))
    to_r, from_r = f"{x_spec},{contracted}{r}->{rest}{r}", f"{rest}{r},{r}{produced}->{out_spec}"

    def delta(x: Any, a: Any, b: Any) -> Any:
        return jnp.einsum(from_r, jnp.einsum(to_r, x, a), b)

    return tuple(sizes[c] for c in contracted), tuple(sizes[c] for c in produced), delta


def _adapted_class(cls: type) -> type:
    """A subclass whose ``__call__`` adds ``(alpha / r) (x A) B`` to the module's own output."""
    if cls not in _ADAPTED:
        original = cls.__call__

        def __call__(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, x, *args, **kwargs)
            a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
            return out + self.lora_delta(x, a, b) * jnp.asarray(self.lora_scale, x.dtype)

        _ADAPTED[cls] = type(cls)(f"LoRA{cls.__name__}", (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _ADAPTED[cls]


def add_adapters(module: nnx.Module, lora: LoRA, targets: str, rngs: nnx.Rngs) -> list[str]:
    """Give each ``nnx.Linear`` / ``nnx.Einsum`` of ``module`` whose path matches ``targets`` (a
    regex, ``re.search``) LoRA adapters ``lora_a`` and ``lora_b``, named as its kernel's input and
    output dimensions. Returns the adapted paths (an error when none matches)."""
    adapted = []
    for path, sub in nnx.iter_modules(module):
        name = "/".join(str(p) for p in path)
        if not isinstance(sub, (nnx.Linear, nnx.Einsum)) or not re.search(targets, name):
            continue
        ins, outs, delta = _adapter_shapes(sub)
        meta = sub.kernel.get_metadata()
        names = tuple(meta.get(_FLAX_NAMES_KEY) or (None,) * sub.kernel[...].ndim)
        in_names, out_names = names[: len(ins)], names[len(names) - len(outs) :]
        if isinstance(sub, nnx.Einsum):  # the kernel's own order: input letters and output letters
            _, k_spec, out_spec = _einsum_parts(sub.einsum_str)
            by_letter = dict(zip(k_spec, names, strict=True))
            x_spec = _einsum_parts(sub.einsum_str)[0]
            in_names = tuple(by_letter[c] for c in k_spec if c in x_spec and c not in out_spec)
            out_names = tuple(by_letter[c] for c in k_spec if c in out_spec)
        extra = {k: v for k, v in meta.items() if k != _FLAX_NAMES_KEY}  # shardkit's marker, eager_sharding
        fan_in = tuple(range(len(ins)))
        a_init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=fan_in, out_axis=-1)
        dtype = sub.kernel[...].dtype
        a = a_init(rngs.params(), (*ins, lora.rank), dtype)
        b = jnp.zeros((lora.rank, *outs), dtype)
        target: Any = sub
        a_meta: dict[str, Any] = {**extra, _FLAX_NAMES_KEY: (*in_names, None)}
        b_meta: dict[str, Any] = {**extra, _FLAX_NAMES_KEY: (None, *out_names)}
        target.lora_a, target.lora_b = nnx.Param(a, **a_meta), nnx.Param(b, **b_meta)
        target.lora_delta, target.lora_scale = delta, lora.scale
        target.__class__ = _adapted_class(type(sub))
        adapted.append(name)
    if not adapted:
        raise ModelError(
            f"LoRA targets {targets!r} match no nnx.Linear or nnx.Einsum of {type(module).__name__}; module paths "
            "look like 'layers/0/attn/q' (re.search on them)."
        )
    return adapted


def with_lora(
    make: Callable[[nnx.Rngs], nnx.Module], targets: str, lora: LoRA | None = None, **from_nnx_kwargs: Any
) -> Model:
    """Your NNX model with LoRA adapters on the frozen base: :func:`shardkit.from_nnx` of
    ``make`` with adapters on every ``nnx.Linear`` / ``nnx.Einsum`` whose module path matches
    ``targets``; only the adapters train.

    Args:
      make: ``rngs -> module``, as ``from_nnx`` takes it.
      targets: a regex over module paths (``r"attn/(q|v)_proj$"``).
      lora: rank, alpha (``targets`` there is unused); default ``LoRA()`` (r=8, alpha 16).
      **from_nnx_kwargs: as :func:`shardkit.from_nnx` takes them.

    Returns:
      The :class:`~shardkit.Model`, its adapters ``.../lora_a`` ``(in..., r)`` and
      ``.../lora_b`` ``(r, out...)`` named as their kernel's dimensions.

    Example:
      >>> import shardkit as sk
      >>> from flax import nnx
      >>> model = with_lora(lambda rngs: nnx.Linear(4, 8, rngs=rngs), targets=".*", lora=LoRA(rank=2))
      >>> {k: v.shape for k, v in model.abstract_params().items() if k.startswith("lora")}
      {'lora_a': (4, 2), 'lora_b': (2, 8)}
    """
    from shardkit.models.nnx_adapter import from_nnx

    settings = lora or LoRA()

    def build(rngs: nnx.Rngs) -> nnx.Module:
        module = make(rngs)
        add_adapters(module, settings, targets, rngs)
        return module

    model = from_nnx(build, **from_nnx_kwargs)
    return dataclasses.replace(model, trainable=is_adapter)
