"""Triton paged KV-cache write: scatter this step's K/V rows into their cache slots.

Layout: ``k``/``v`` ``[T, Hk, D]``; caches ``[num_pages, page_size, Hk, D]``; ``slot_mapping`` int32
``[T]`` with ``slot = page * page_size + offset`` and ``-1`` meaning "no slot" (padding tokens).
One program moves one token's K and V rows (all heads), casting to the cache dtype on store; for
int8 / float8_e4m3fn caches it quantizes each (token, head) row in registers and stores its fp32
scale into ``[num_pages, page_size, Hk]`` scale caches (``ops/kv_cache/quant.py`` is the spec).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import capability, register

from .quant import E4M3_MAX, INT8_MAX, SCALE_EPS, write_kv_cache_quantized_ref

# The spec's constants (ops/kv_cache/quant.py) as compile-time values of the kernels.
_INT8_MAX = tl.constexpr(INT8_MAX)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_SCALE_EPS = tl.constexpr(SCALE_EPS)

# QUANT constexpr of the kernels: 0 = cast, 1 = int8 codes, 2 = fp8 e4m3 codes.
QUANT_NONE, QUANT_INT8, QUANT_FP8 = 0, 1, 2


def quant_mode(dtype: torch.dtype) -> int:
    return {torch.int8: QUANT_INT8, torch.float8_e4m3fn: QUANT_FP8}.get(dtype, QUANT_NONE)


def native_fp8_store(device: torch.device) -> bool:
    """Triton converts to e4m3 (``fp8e4nv``) only on sm89+; older GPUs write FP8 KV with torch."""
    return device.type != "cuda" or capability(device).native_fp8


@triton.jit
def quantize_rows(x, QUANT: tl.constexpr):
    """fp32 ``[H, D]`` (masked lanes 0) -> (codes as fp32, already rounded/clamped; fp32 scale ``[H]``).

    Same formula as ``quantize_kv_ref``: ``scale = max(amax, eps) / qmax``, ``x / scale`` correctly
    rounded (div_rn), INT8 rounded half away from zero.
    """
    if QUANT == 1:
        qmax = _INT8_MAX
    else:
        qmax = _E4M3_MAX
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), _SCALE_EPS), qmax)
    c = tl.div_rn(x, scale[:, None])
    if QUANT == 1:
        c = tl.where(c >= 0, tl.floor(c + 0.5), tl.ceil(c - 0.5))
    return tl.minimum(tl.maximum(c, -qmax), qmax), scale


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    Hk, D, PAGE,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    stride_ksp, stride_kss, stride_vsp, stride_vss,
    QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE
        off = slot % PAGE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        hmask = offs_h < Hk
        mask = hmask[:, None] & (offs_d[None, :] < D)
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
        kc = kc_ptr + page * stride_kcp + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        vc = vc_ptr + page * stride_vcp + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        if QUANT == 0:
            tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)
        else:
            kq, ks = quantize_rows(k.to(tl.float32), QUANT)
            vq, vs = quantize_rows(v.to(tl.float32), QUANT)
            tl.store(kc, kq.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc, vq.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(ks_ptr + page * stride_ksp + off * stride_kss + offs_h, ks, mask=hmask)
            tl.store(vs_ptr + page * stride_vsp + off * stride_vss + offs_h, vs, mask=hmask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


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
    """Write ``k``/``v`` ``[T, Hk, D]`` into ``k_cache``/``v_cache`` ``[P, page_size, Hk, D]`` in place.

    ``slot_mapping`` int32 ``[T]``; rows whose slot is ``-1`` are skipped. Cache last dims must be
    contiguous (they are views of the engine's pool, written in place). int8 / float8_e4m3fn caches
    need ``k_scale``/``v_scale`` fp32 ``[P, page_size, Hk]`` (contiguous) and are quantized on write.
    """
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
    T, Hk, D = k.shape
    if T == 0:
        return
    mode = quant_mode(k_cache.dtype)
    if mode != QUANT_NONE and k_scale is None:
        raise ValueError(f"write_kv_cache_: a {k_cache.dtype} cache needs k_scale/v_scale")
    if mode == QUANT_FP8 and not native_fp8_store(k.device):
        write_kv_cache_quantized_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    slot_mapping = slot_mapping.contiguous()
    ks = k_scale if mode else k_cache  # unused pointers when not quantized
    vs = v_scale if mode else v_cache
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping, Hk, D, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        QUANT=mode, BLOCK_H=triton.next_power_of_2(Hk), BLOCK_D=triton.next_power_of_2(D), num_warps=4,
    )  # fmt: skip


register(
    "write_kv_cache_",
    "triton",
    write_kv_cache_,
    priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)
