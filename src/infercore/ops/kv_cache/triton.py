"""Triton paged KV-cache write: scatter this step's K/V rows into their cache slots.

Layout: ``k``/``v`` ``[T, Hk, D]``; caches ``[num_pages, page_size, Hk, D]``; ``slot_mapping`` int32
``[T]`` with ``slot = page * page_size + offset`` and ``-1`` meaning "no slot" (padding tokens).
One program moves one token's K and V rows (all heads), casting to the cache dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    Hk,
    D,
    PAGE,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE
        off = slot % PAGE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < Hk) & (offs_d[None, :] < D)
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kc = kc_ptr + page * stride_kcp + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        vc = vc_ptr + page * stride_vcp + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv_cache_(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[T, Hk, D]`` into ``k_cache``/``v_cache`` ``[P, page_size, Hk, D]`` in place.

    ``slot_mapping`` int32 ``[T]``; rows whose slot is ``-1`` are skipped. Cache last dims must be
    contiguous (they are views of the engine's pool, written in place).
    """
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
    T, Hk, D = k.shape
    if T == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    slot_mapping = slot_mapping.contiguous()
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, Hk, D, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(Hk), BLOCK_D=triton.next_power_of_2(D), num_warps=4,
    )  # fmt: skip


register(
    "write_kv_cache_",
    "triton",
    write_kv_cache_,
    priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)
