"""Writing new keys/values into the paged KV cache."""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import write_kv_cache_ref

__all__ = ["write_kv_cache_"]


def write_kv_cache_(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token ``t``'s key/value at flat slot ``slot_mapping[t]`` of the caches, in place.

    Args:
        k, v: ``[T, Hk, D]`` fp32/fp16/bf16.
        k_cache, v_cache: ``[num_pages, page_size, Hk, D]``, contiguous; values are cast to their dtype.
        slot_mapping: ``[T]`` int32; ``slot = page * page_size + offset_in_page``, ``-1`` skips the token.
            Slots must be distinct (duplicate slots give an unspecified winner).
    """
    op = "write_kv_cache_"
    V.floating(op, "k", k)
    V.ndim(op, "k", k, 3, "[tokens, kv_heads, head_dim]")
    V.floating(op, "v", v)
    if v.shape != k.shape:
        raise ValueError(f"{op}: v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    V.tensor(op, "k_cache", k_cache)
    V.tensor(op, "v_cache", v_cache)
    if not k_cache.is_floating_point():
        raise TypeError(f"{op}: k_cache must be a floating tensor, got {k_cache.dtype}")
    V.ndim(op, "k_cache", k_cache, 4, "[num_pages, page_size, kv_heads, head_dim]")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"{op}: k_cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {tuple(k.shape[1:])}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"{op}: v_cache ({tuple(v_cache.shape)}, {v_cache.dtype}) must match k_cache "
            f"({tuple(k_cache.shape)}, {k_cache.dtype})"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: k_cache and v_cache must be contiguous")
    V.integer(op, "slot_mapping", slot_mapping, (torch.int32,))
    V.ndim(op, "slot_mapping", slot_mapping, 1, "[tokens]")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"{op}: slot_mapping has {slot_mapping.shape[0]} entries but k has {k.shape[0]} tokens"
        )
    V.same_device(op, "k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    dispatch(op, k.device)(k, v, k_cache, v_cache, slot_mapping)


register("write_kv_cache_", "reference", write_kv_cache_ref)
