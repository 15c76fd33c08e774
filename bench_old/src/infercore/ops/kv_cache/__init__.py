"""Writing new keys/values into the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...devices import accepts, dispatch, implementation, register
from .. import _validate as V
from .naive import write_kv_cache_ref
from .quant import check_kv_scales, dequantize_paged_kv, is_quantized_kv

__all__ = ["dequantize_paged_kv", "is_quantized_kv", "scale_aware", "write_kv_cache_"]


def write_kv_cache_(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store token ``t``'s key/value at flat slot ``slot_mapping[t]`` of the caches, in place.

    Args:
        k, v: ``[T, Hk, D]`` fp32/fp16/bf16.
        k_cache, v_cache: ``[num_pages, page_size, Hk, D]`` with a contiguous head_dim axis (other
            strides are free: the hybrid pool hands each layer a page-strided view); values are cast
            to their dtype, or, for int8 / float8_e4m3fn caches, quantized (see
            ``ops/kv_cache/quant.py``).
        slot_mapping: ``[T]`` int32; ``slot = page * page_size + offset_in_page``, ``-1`` skips the token.
            Slots must be distinct (duplicate slots give an unspecified winner).
        k_scale, v_scale: fp32 ``[num_pages, page_size, Hk]``, required exactly when the caches are
            int8/fp8; each written token gets ``scale = amax_D |x| / qmax`` per head.
    """
    op = "write_kv_cache_"
    V.floating(op, "k", k)
    V.ndim(op, "k", k, 3, "[tokens, kv_heads, head_dim]")
    V.floating(op, "v", v)
    if v.shape != k.shape:
        raise ValueError(f"{op}: v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    V.tensor(op, "k_cache", k_cache)
    V.tensor(op, "v_cache", v_cache)
    if not (k_cache.is_floating_point() or is_quantized_kv(k_cache.dtype)):
        raise TypeError(f"{op}: k_cache must be a floating, int8 or float8_e4m3fn tensor, got {k_cache.dtype}")
    V.ndim(op, "k_cache", k_cache, 4, "[num_pages, page_size, kv_heads, head_dim]")
    V.dim_at_least_one(op, "k_cache", k_cache, 0, "num_pages")
    V.dim_at_least_one(op, "k_cache", k_cache, 1, "page_size")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"{op}: k_cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {tuple(k.shape[1:])}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"{op}: v_cache ({tuple(v_cache.shape)}, {v_cache.dtype}) must match k_cache "
            f"({tuple(k_cache.shape)}, {k_cache.dtype})"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{op}: k_cache and v_cache need a contiguous head_dim axis (stride 1)")
    V.integer(op, "slot_mapping", slot_mapping, (torch.int32,))
    V.ndim(op, "slot_mapping", slot_mapping, 1, "[tokens]")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"{op}: slot_mapping has {slot_mapping.shape[0]} entries but k has {k.shape[0]} tokens"
        )
    V.same_device(op, "k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if check_kv_scales(op, k_cache, v_cache, k_scale, v_scale):
        scale_aware(op, k.device)(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    else:
        dispatch(op, k.device)(k, v, k_cache, v_cache, slot_mapping)


def scale_aware(op: str, device: torch.device | str) -> Callable:
    """The implementation of ``op`` that :func:`~infercore.devices.dispatch` picks, or the reference
    when that one takes no ``k_scale``/``v_scale`` (an implementation written before quantized KV).

    For ops over quantized caches (``write_kv_cache_``, ``rope_and_write_kv``,
    ``paged_attention_decode``): a fast path that cannot read scales falls back to the reference
    rather than misreading codes.
    """
    fn = dispatch(op, device)
    return fn if accepts(fn, "k_scale") else implementation(op, "reference")


register("write_kv_cache_", "reference", write_kv_cache_ref)
