"""KV-cache quantization: FP8 (e4m3) and INT8 keys/values with per-(token, head) fp32 scales.

Layouts follow ``infercore.ops.write_kv_cache_``: new keys/values ``[T, Hk, D]``; caches
``[num_pages, page_size, Hk, D]`` in int8 or float8_e4m3fn; scale caches
``[num_pages, page_size, Hk]`` fp32; ``slot_mapping`` int32 ``[T]`` (``page * page_size + offset``,
``-1`` = skip). A scale per (token, head) costs 4 bytes per ``D`` values (3% at D=128) and keeps
one large head from flattening the others.
"""

from __future__ import annotations

import torch

from .fp8 import E4M3_MAX
from .naive import ACT_SCALE_EPS, round_half_away

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize_kv(x: torch.Tensor, *, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` -> ``(q [T, H, D] int8 | float8_e4m3fn, scale fp32 [T, H])``, ``x ~= q * scale``."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: expected one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x: expected a floating [T, H, D] tensor, got {tuple(x.shape)} {x.dtype}")
    xf = x.float()
    qmax = 127.0 if kv_dtype == "int8" else E4M3_MAX
    scale = xf.abs().amax(-1).clamp_min(ACT_SCALE_EPS) / qmax
    v = xf / scale[..., None]
    if kv_dtype == "int8":
        q = round_half_away(v).clamp(-127, 127).to(torch.int8)
    else:
        q = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_kv(
    q: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: ``q [..., D]`` times ``scale [...]`` -> ``dtype``."""
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"scale: expected shape {tuple(q.shape[:-1])}, got {tuple(scale.shape)}")
    return (q.float() * scale[..., None]).to(dtype)


def write_quantized_kv_cache_(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Quantize ``k``/``v`` ``[T, Hk, D]`` and scatter codes and scales into paged caches, in place."""
    if k_cache.dtype not in KV_DTYPES.values() or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache/v_cache: expected int8 or float8_e4m3fn caches, got {k_cache.dtype}")
    if k_scale.shape != k_cache.shape[:-1] or v_scale.shape != v_cache.shape[:-1]:
        raise ValueError("k_scale/v_scale: expected [num_pages, page_size, Hk] matching the caches")
    if slot_mapping.dtype != torch.int32 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping: expected int32 [{k.shape[0]}]")
    kv_dtype = "int8" if k_cache.dtype == torch.int8 else "fp8"
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, s = quantize_kv(x[keep], kv_dtype=kv_dtype)
        cache.view(-1, *cache.shape[2:])[slots] = q
        sc.view(-1, sc.shape[-1])[slots] = s
