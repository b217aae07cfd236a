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
from collections.abc import Sequence

from shardkit.core.errors import ModelError

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
      dropout: peft's ``lora_dropout``, kept to be written back; shardkit applies none on the
        adapter path (a trainer warns when it is not 0).
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
