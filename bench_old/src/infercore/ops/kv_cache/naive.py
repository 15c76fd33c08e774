"""Scatter of this step's K/V into the paged cache."""

from __future__ import annotations

import torch

from .quant import paged_index, write_kv_cache_quantized_ref


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if k_scale is not None:
        # int8 / fp8 cache: quantize on write, one fp32 scale per (token, head) beside the codes.
        write_kv_cache_quantized_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return
    # -1 marks tokens whose KV is not stored (e.g. padding of a captured batch, or already cached).
    keep = slot_mapping >= 0
    page, off = paged_index(slot_mapping[keep], k_cache.shape[1])
    # Indexed stores write the caller's storage, whatever the caches' page strides.
    k_cache[page, off] = k[keep].to(k_cache.dtype)
    v_cache[page, off] = v[keep].to(v_cache.dtype)
