"""Rotary position embeddings: the inverse frequencies of each scaling a checkpoint may ask for.

The frequencies depend only on the config and the head size, so they are computed here in NumPy
and enter the compiled program as constants (:func:`shardkit.models.gpt.rotary`).

Scalings (``rope_type`` in Hugging Face's ``rope_parameters`` / ``rope_scaling``):

- ``default``: ``theta ** (-2i / K)`` for ``i < K / 2`` (Su et al. 2021).
- ``linear``: the default frequencies divided by ``factor`` (position interpolation).
- ``llama3``: Llama 3.1's: wavelengths longer than ``original_max_seq / low_freq_factor`` are
  divided by ``factor``, shorter than ``original_max_seq / high_freq_factor`` kept, and the band
  between interpolated smoothly.

Others (``yarn``, ``dynamic``, ``longrope``) are refused by the importer, never approximated.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from shardkit.core.errors import ModelError

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are scaled (see the module docstring).

    Example:
      >>> RopeScaling("llama3", factor=8.0, original_max_seq=8192).kind
      'llama3'
    """

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_TYPES:
            raise ModelError(f"RopeScaling: kind={self.kind!r}; shardkit computes {', '.join(ROPE_TYPES)}.")
        if self.factor <= 0:
            raise ModelError(f"RopeScaling: factor={self.factor} must be > 0.")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ModelError(
                f"RopeScaling: llama3 needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}."
            )


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """``(K/2,)`` float32 inverse frequencies of rotary embeddings over a head of ``K`` dims.

    Example:
      >>> inverse_frequencies(4, 10000.0).tolist()
      [1.0, 0.009999999776482582]
    """
    freqs = np.float32(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    if scaling is None or scaling.kind == "default":
        return freqs
    if scaling.kind == "linear":
        return (freqs / np.float32(scaling.factor)).astype(np.float32)
    # llama3: computed in float64, then rounded once.
    f = freqs.astype(np.float64)
    wavelen = 2 * math.pi / f
    low_wavelen = scaling.original_max_seq / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq / scaling.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, f / scaling.factor, f)
    smooth = (scaling.original_max_seq / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def angles(seq_len: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin`` of each position's angles, each ``(1, T, 1, K/2)`` float32 (broadcast over
    batch and heads)."""
    a = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]  # (T, K/2)
    return np.cos(a)[None, :, None, :], np.sin(a)[None, :, None, :]
