"""KV-cache quantization: FP8 (e4m3) and INT8 keys/values with per-(token, head) fp32 scales.

Layouts follow ``infercore.ops.write_kv_cache_``: new keys/values ``[T, Hk, D]``; caches
``[num_pages, page_size, Hk, D]`` in int8 or float8_e4m3fn; scale caches
``[num_pages, page_size, Hk]`` fp32; ``slot_mapping`` int32 ``[T]`` (``page * page_size + offset``,
``-1`` = skip). A scale per (token, head) costs 4 bytes per ``D`` values (3% at D=128) and keeps
one large head from flattening the others.

The math lives in ``infercore.ops.kv_cache.quant`` (ops sit below quant and the KV-write and
attention kernels implement the same formula); this module is the user-facing entry. To run a model
on a quantized cache, allocate it with ``infercore.kv.allocate_kv_caches(..., kv_cache_dtype="int8"
| "fp8")``: the write ops quantize and the decode attention kernels read the codes directly.
"""

from __future__ import annotations

import torch

from ..ops.kv_cache.quant import (
    KV_QUANT_DTYPES,
    check_kv_scales,
    dequantize_kv_ref,
    quantize_kv_ref,
    write_kv_cache_quantized_ref,
)

KV_DTYPES = KV_QUANT_DTYPES


def quantize_kv(x: torch.Tensor, *, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` -> ``(q [T, H, D] int8 | float8_e4m3fn, scale fp32 [T, H])``, ``x ~= q * scale``."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: expected one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x: expected a floating [T, H, D] tensor, got {tuple(x.shape)} {x.dtype}")
    return quantize_kv_ref(x, KV_DTYPES[kv_dtype])


def dequantize_kv(
    q: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: ``q [..., D]`` times ``scale [...]`` -> ``dtype``."""
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"scale: expected shape {tuple(q.shape[:-1])}, got {tuple(scale.shape)}")
    return dequantize_kv_ref(q, scale, dtype)


def write_quantized_kv_cache_(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Quantize ``k``/``v`` ``[T, Hk, D]`` and scatter codes and scales into paged caches, in place.

    The reference of ``infercore.ops.write_kv_cache_(..., k_scale=, v_scale=)`` (which dispatches to
    the Triton kernel on GPUs).
    """
    if k_cache.dtype not in KV_DTYPES.values() or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache/v_cache: expected int8 or float8_e4m3fn caches, got {k_cache.dtype}")
    if k_scale.shape != k_cache.shape[:-1] or v_scale.shape != v_cache.shape[:-1]:
        raise ValueError("k_scale/v_scale: expected [num_pages, page_size, Hk] matching the caches")
    if slot_mapping.dtype != torch.int32 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping: expected int32 [{k.shape[0]}]")
    check_kv_scales("write_quantized_kv_cache_", k_cache, v_cache, k_scale, v_scale)
    write_kv_cache_quantized_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
