"""Rotary position embedding: the cos/sin cache builder and the pure-PyTorch rotation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

_SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")


def rope_inv_freq(
    *, rotary_dim: int, base: float, scaling: Mapping[str, Any] | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` fp32 and the attention factor that scales cos/sin.

    Mirrors ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (same fp32 arithmetic, so the
    caches agree bit for bit with HF's on the same device); ``seq_len`` is that function's argument
    (only longrope reads it).
    """
    rope_type = _rope_type(scaling)
    # HF builds the exponent from an int64 arange converted to fp32; keep that order of rounding.
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponent)
    attention_factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(rotary_dim, base, scaling)
    elif rope_type == "longrope":
        inv_freq, attention_factor = _longrope(exponent, base, scaling, seq_len)
    return inv_freq, attention_factor


def rope_cos_sin_cache_ref(
    *,
    rotary_dim: int,
    max_positions: int,
    base: float,
    scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    inv_freq, attention_factor = rope_inv_freq(rotary_dim=rotary_dim, base=base, scaling=scaling, seq_len=seq_len)
    # Angles in fp32 like HF (positions * inv_freq); folding YaRN's / LongRoPE's factor into the table means the
    # rotation itself needs no knowledge of the scaling type.
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    cache = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
    return cache.to(dtype=dtype, device=device)


def apply_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache.index_select(0, positions.long()).float().chunk(2, dim=-1)  # [T, rd/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rd = 2 * cos.shape[-1]
    xf = x[..., :rd].float()
    if is_neox:
        x1, x2 = xf[..., : rd // 2], xf[..., rd // 2 :]
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    rot = torch.cat([o1, o2], dim=-1) if is_neox else torch.stack([o1, o2], dim=-1).flatten(-2)
    if rd == x.shape[-1]:
        return rot.to(x.dtype)
    return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)


def _rope_type(scaling: Mapping[str, Any] | None) -> str:
    if scaling is None:
        return "default"
    # Old HF configs spell the key "type"; "rope_type" wins when both are present.
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED:
        raise ValueError(
            f"rope_cos_sin_cache: scaling rope_type {rope_type!r} is not supported; use one of {_SUPPORTED}"
        )
    return rope_type


def _llama3(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low_freq_factor = float(s["low_freq_factor"])
    high_freq_factor = float(s["high_freq_factor"])
    old_context_len = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) are interpolated by `factor`, short ones are kept,
    # and the band in between blends the two linearly in 1/wavelength.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    original_max = float(s["original_max_position_embeddings"])
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)
    truncate = bool(s.get("truncate", True))

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    # High-frequency dims (ramp = 0) keep their original frequency, low-frequency ones are interpolated.
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)


def _longrope(exponent: torch.Tensor, base: float, s: Mapping[str, Any], seq_len: int | None
              ) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k): per-frequency divisors, ``long_factor`` for a sequence longer than
    ``original_max_position_embeddings`` and ``short_factor`` otherwise (HF picks by ``seq_len``; None is short),
    and one attention factor for both sets: ``sqrt(1 + ln(factor) / ln(original))`` unless given."""
    original_max = float(s["original_max_position_embeddings"])
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        factor = float(s["factor"])
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    long = seq_len is not None and seq_len > original_max
    ext = torch.tensor(s["long_factor"] if long else s["short_factor"], dtype=torch.float32)
    # HF's order of operations: 1 / (ext * base ** exponent)
    return 1.0 / (ext * base**exponent), float(attention_factor)
