"""Triton rotary embedding, alone or fused with the paged KV-cache write.

``cos_sin_cache`` is ``[max_positions, rotary_dim]`` (first half cos, second half sin); the first
``rotary_dim`` dims of each head rotate, the rest pass through (partial rotary). Instead of
permuting registers, every lane also loads its rotation partner (``d +- rotary_dim/2`` for neox,
``d ^ 1`` for interleaved); the second read hits L1, so each row still costs one DRAM read.

The fused kernel rotates q into a new tensor and writes the rotated k and the untouched v straight
into their cache slots: k never round-trips through DRAM, which saves a launch and ``2*T*Hk*D``
element reads+writes per layer compared with ``apply_rope`` followed by ``write_kv_cache_``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register
from infercore.ops.pdl import pdl_enabled, pdl_launch, pdl_release, pdl_wait

from ..kv_cache.quant import write_kv_cache_quantized_ref
from ..kv_cache.triton import QUANT_FP8, QUANT_NONE, native_fp8_store, quant_mode, quantize_rows
from .fused import rope_and_write_kv_cache_reference  # noqa: F401  (registers the reference)


@triton.jit
def rope_lanes(cs_ptr, pos, stride_cs, ROT, offs_d, IS_NEOX: tl.constexpr):
    """Per head-dim lane ``offs_d`` at position ``pos``: whether it rotates (``d < ROT``), its rotation
    partner, the partner's sign, and fp32 cos / sin, so ``out = x cos + sign x[partner] sin`` (neox:
    halves; else interleaved pairs). Shared with the decode kernel's fused RoPE."""
    half = ROT // 2
    rot = offs_d < ROT
    if IS_NEOX:
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        sign = tl.where(first, -1.0, 1.0)
        ci = tl.where(first, offs_d, offs_d - half)
    else:
        partner = offs_d ^ 1
        sign = tl.where((offs_d % 2) == 0, -1.0, 1.0)
        ci = offs_d // 2
    cos = tl.load(cs_ptr + pos * stride_cs + ci, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + half + ci, mask=rot, other=0.0).to(tl.float32)
    return rot, partner, sign, cos, sin


@triton.jit
def rotate_heads(x_ptr, stride_h, H, D, offs_h, offs_d, partner, rot, sign, cos, sin):
    """Rotated ``[BLOCK_H, BLOCK_D]`` fp32 tile of one token's heads ``offs_h < H`` (rows ``stride_h``
    apart from ``x_ptr``), plus its mask. Shared with the decode kernel's fused RoPE."""
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    base = x_ptr + offs_h[:, None] * stride_h
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    out = tl.where(rot[None, :], x * cos[None, :] + sign[None, :] * xp * sin[None, :], x)
    return out, mask


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    Hq, Hk, D, ROT, PAGE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    stride_ksp, stride_kss, stride_vsp, stride_vss,
    IS_NEOX: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    KEEP_K: tl.constexpr,  # with WRITE_CACHE: also store the rotated k to ko
    QUANT: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    rot, partner, sign, cos, sin = rope_lanes(cs_ptr, pos, stride_cs, ROT, offs_d, IS_NEOX)

    offs_hq = tl.arange(0, BLOCK_HQ)
    q, qmask = rotate_heads(
        q_ptr + t * stride_qt, stride_qh, Hq, D, offs_hq, offs_d, partner, rot, sign, cos, sin
    )
    qo = qo_ptr + t * stride_qot + offs_hq[:, None] * stride_qoh + offs_d[None, :]
    tl.store(qo, q.to(qo_ptr.dtype.element_ty), mask=qmask)

    offs_hk = tl.arange(0, BLOCK_HK)
    k, kmask = rotate_heads(
        k_ptr + t * stride_kt, stride_kh, Hk, D, offs_hk, offs_d, partner, rot, sign, cos, sin
    )
    if WRITE_CACHE:
        if KEEP_K:
            ko = ko_ptr + t * stride_kot + offs_hk[:, None] * stride_koh + offs_d[None, :]
            tl.store(ko, k.to(ko_ptr.dtype.element_ty), mask=kmask)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE
            off = slot % PAGE
            kc = (
                kc_ptr
                + page * stride_kcp
                + off * stride_kcs
                + offs_hk[:, None] * stride_kch
                + offs_d[None, :]
            )
            v = tl.load(v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :], mask=kmask,
                        other=0.0)  # fmt: skip
            vc = (
                vc_ptr
                + page * stride_vcp
                + off * stride_vcs
                + offs_hk[:, None] * stride_vch
                + offs_d[None, :]
            )
            if QUANT == 0:
                tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=kmask)
                tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=kmask)
            else:
                # Quantize the k the unfused ops would write (rounded to k's dtype), so codes and
                # scales match the reference composition.
                kr = k.to(k_ptr.dtype.element_ty).to(tl.float32)
                kq, ks = quantize_rows(tl.where(kmask, kr, 0.0), QUANT)
                vq, vs = quantize_rows(v.to(tl.float32), QUANT)
                hmask = offs_hk < Hk
                tl.store(kc, kq.to(kc_ptr.dtype.element_ty), mask=kmask)
                tl.store(vc, vq.to(vc_ptr.dtype.element_ty), mask=kmask)
                tl.store(ks_ptr + page * stride_ksp + off * stride_kss + offs_hk, ks, mask=hmask)
                tl.store(vs_ptr + page * stride_vsp + off * stride_vss + offs_hk, vs, mask=hmask)
    else:
        ko = ko_ptr + t * stride_kot + offs_hk[:, None] * stride_koh + offs_d[None, :]
        tl.store(ko, k.to(ko_ptr.dtype.element_ty), mask=kmask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale=None, v_scale=None,
            keep_k=False):
    T, Hq, D = q.shape
    Hk = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    cos_sin_cache = _last_dim_contiguous(cos_sin_cache)
    positions = positions.contiguous()
    q_out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    write = k_cache is not None
    mode = quant_mode(k_cache.dtype) if write else QUANT_NONE
    if mode != QUANT_NONE and k_scale is None:
        raise ValueError(f"rope_and_write_kv_cache_: a {k_cache.dtype} cache needs k_scale/v_scale")
    ks, vs = (k_scale, v_scale) if mode else (q_out, q_out)  # unused pointers when not quantized
    if write:
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
        v = _last_dim_contiguous(v)
        slot_mapping = slot_mapping.contiguous()
        k_out = torch.empty((T, Hk, D), dtype=k.dtype, device=k.device) if keep_k else None
        ko, kc, vc, slots, vv = (k_out if keep_k else q_out), k_cache, v_cache, slot_mapping, v
    else:
        k_out = torch.empty((T, Hk, D), dtype=k.dtype, device=k.device)
        ko, kc, vc, slots, vv = k_out, k_out, k_out, positions, k  # cache args unused
    if T > 0:
        _rope_kernel[(T,)](
            q, k, vv, positions, cos_sin_cache, q_out, ko, kc, vc, ks, vs, slots,
            Hq, Hk, D, rot, kc.shape[1] if write else 1,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
            q_out.stride(0), q_out.stride(1), ko.stride(0), ko.stride(1), cos_sin_cache.stride(0),
            kc.stride(0), kc.stride(1), kc.stride(2) if write else 0,
            vc.stride(0), vc.stride(1), vc.stride(2) if write else 0,
            ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
            IS_NEOX=bool(is_neox), WRITE_CACHE=write, KEEP_K=write and keep_k, QUANT=mode,
            BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hk),
            BLOCK_D=triton.next_power_of_2(D), num_warps=4, **pdl_launch(pdl_enabled(q)),
        )  # fmt: skip
    return q_out, k_out


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` at ``positions`` ``[T]``; returns new tensors."""
    return _launch(q, k, None, positions, cos_sin_cache, None, None, None, is_neox)


def rope_and_write_kv_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    return_k: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, write rotated k and v into the paged caches; returns the rotated q, or with ``return_k``
    ``(q_rot, k_rot)`` from the same kernel (a prefill that reads this step's K/V from contiguous tensors: one launch
    instead of ``apply_rope`` then ``write_kv_cache_``).

    q ``[T, Hq, D]``, k/v ``[T, Hk, D]``, caches ``[P, page_size, Hk, D]``, ``slot_mapping`` int32
    ``[T]`` (``-1`` skips the cache write of that token; its q is still rotated). int8 /
    float8_e4m3fn caches are quantized on write with fp32 ``k_scale``/``v_scale`` ``[P, page_size, Hk]``.
    """
    if quant_mode(k_cache.dtype) == QUANT_FP8 and not native_fp8_store(q.device):
        # No e4m3 conversion in Triton before sm89: rotate here, quantize with torch.
        q_rot, k_rot = _launch(q, k, None, positions, cos_sin_cache, None, None, None, is_neox)
        write_kv_cache_quantized_ref(k_rot, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return (q_rot, k_rot) if return_k else q_rot
    q_rot, k_rot = _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale,
                           keep_k=return_k)
    return (q_rot, k_rot) if return_k else q_rot


_available = lambda cap: cap.is_cuda and cap.triton
register("apply_rope", "triton", apply_rope, priority=10, available=_available)
register("rope_and_write_kv", "triton", rope_and_write_kv_cache_, priority=10, available=_available)
