"""Scatter of this step's K/V into the paged cache."""

from __future__ import annotations

import torch

from .quant import write_kv_cache_quantized_ref


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
    num_pages, page_size, hk, d = k_cache.shape
    # A view (not reshape) so the write lands in the caller's storage.
    k_flat = k_cache.view(num_pages * page_size, hk, d)
    v_flat = v_cache.view(num_pages * page_size, hk, d)
    # -1 marks tokens whose KV is not stored (e.g. padding of a captured batch, or already cached).
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, v[keep].to(v_cache.dtype))
