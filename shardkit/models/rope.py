"""Rotary position embeddings: the inverse frequencies of each scaling a checkpoint may ask for.

The frequencies depend only on the config and the head size, so they are computed here in NumPy
and enter the compiled program as constants (:func:`shardkit.models.layers.rotary.rotary`).

Scalings (``rope_type`` in Hugging Face's ``rope_parameters`` / ``rope_scaling``):

- ``default``: ``theta ** (-2i / K)`` for ``i < K / 2`` (Su et al. 2021).
- ``linear``: the default frequencies divided by ``factor`` (position interpolation).
- ``llama3``: Llama 3.1's: wavelengths longer than ``original_max_seq / low_freq_factor`` are
  divided by ``factor``, shorter than ``original_max_seq / high_freq_factor`` kept, and the band
  between interpolated smoothly.
- ``yarn`` (Peng et al. 2023; gpt-oss, DeepSeek-V3, Kimi K2): dimensions that turn fewer than
  ``beta_slow`` times over ``original_max_seq`` positions are interpolated (divided by
  ``factor``), those turning more than ``beta_fast`` times kept, a linear ramp between; and the
  rotated vectors are multiplied by :func:`yarn_attention_factor` (``0.1 ln(factor) + 1``, or
  the ratio of two such terms with ``mscale`` / ``mscale_all_dim``).

Others (``dynamic``, ``longrope``) are refused by the importer, never approximated.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from shardkit.core.errors import ModelError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    # yarn: the ramp's bounds in rotations, the attention factor's terms (0: unset), and
    # whether the ramp's bounds are rounded to whole dimensions (transformers' truncate).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor: float = 0.0  # yarn: given outright (0: from factor and the mscales)

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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: RopeScaling | None) -> float:
    """What yarn multiplies the rotated queries and keys by (1.0 for every other scaling).

    Example:
      >>> round(yarn_attention_factor(RopeScaling("yarn", factor=4.0)), 6)
      1.138629
    """
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Yarn's blend of the extrapolated (kept) and interpolated (divided by ``factor``) frequencies."""

    def dimension(rotations: float) -> float:  # the dimension that turns ``rotations`` times in the original span
        return head_dim * math.log(scaling.original_max_seq / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp  # 1: extrapolate (keep), 0: interpolate
    periods = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    extrapolated, interpolated = np.float32(1) / periods, np.float32(1) / (np.float32(scaling.factor) * periods)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


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
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling)
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
