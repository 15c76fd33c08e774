"""Large-M weight-only matmuls: decode the whole weight to x's dtype in one Triton pass, then cuBLAS.

Why: the fused weight-only GEMM (``wo_tiles._wq_gemm_kernel`` / ``_fp8_wo_kernel``) decodes every
weight tile once per M tile, in the K loop of a ``tl.dot`` kernel that reaches ~140 (INT4) / ~290
(FP8) TFLOP/s at M = 2048 on the H200 (results/h200/quant.json), 3-6x bf16 cuBLAS's time. Past a
hundred or two rows the weight bytes no longer bound the product, so decoding once (``N x K`` values:
54 us INT4, 50 us FP8 for a 14336x4096 weight) and running the bf16 / fp16 GEMM on the library kernel
wins: at M = 2048, 351 vs 1750 us (INT4) and 354 vs 750 us (FP8) against bf16 cuBLAS's 327 / 324 us
(results/h200/quant_wo_large_m.json). The same
switch as vLLM's AWQ path (dequantize + matmul from 256 tokens). Cost: a transient ``[N, K]`` weight
in x's dtype per call (235 MB for the 8B gate_up), from the caching allocator.

The decode is the formats' own ``dequantize()`` arithmetic in fp32 and rounds once to the output
dtype, so it equals ``w.dequantize(dtype)`` bit for bit (INT: ``(q - z) * s``; FP8: the e4m3 value by
the integer decode, times its channel or 128x128 block scale). ``DEQUANT_M_MIN`` rows and up take
this path (96 INT4, 192 FP8, measured; INT8 never; ``INFERCORE_WO_DEQUANT_M`` sets both, 0 turns it off).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .formats import FP8Weight, IntWeight

_ENV = os.environ.get("INFERCORE_WO_DEQUANT_M")
if _ENV is not None and not _ENV.isdigit():
    raise ValueError(f"INFERCORE_WO_DEQUANT_M: expected a non-negative integer, got {_ENV!r}")
# From this many rows (16-bit activations) the weight-only matmuls decode the weight and call cuBLAS: INT4
# from 96 (it beat the tiled GEMM on every shape measured there, results/h200/quant_wo_mid_m.json; below 65
# rows the small-M kernel serves INT4), FP8 from 192 (the smallest M from which it won on every 8B MLP shape,
# quant_wo_large_m.json). INT8 weights keep the tiled GEMM (not measured). INFERCORE_WO_DEQUANT_M sets both
# (0: never).
DEQUANT_M_MIN: dict[str, int] = {"int4": 96, "fp8": 192} if _ENV is None else {"int4": int(_ENV), "fp8": int(_ENV)}


def use_dequant(x: torch.Tensor, kind: str) -> bool:
    """Whether a weight-only matmul over ``x [M, K]`` with ``kind`` ("int4" / "int8" / "fp8") weights takes
    the decode + library GEMM path."""
    return 0 < DEQUANT_M_MIN.get(kind, 0) <= x.shape[0] and x.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _fp8_e4m3_bits_to_f32(b):
    """uint8 e4m3 -> fp32 equal to the e4m3 value times 2**-120 (two shifts, no FP8 instruction)."""
    x = b.to(tl.int32)
    bits = ((x & 0x80) << 24) | ((x & 0x7F) << 20)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_int_kernel(
    qw_ptr, s_ptr, z_ptr, y_ptr, N, K, stride_qn, stride_sn, stride_yn,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, ONE_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``y[n, k] = (q[n, k] - z[n, k // GROUP]) * s[n, k // GROUP]`` for ``k < K`` (fp32, rounded once).
    ``ONE_GROUP``: every tile lies inside one group, so a row's scale / zero point load once per tile."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_k[None, :] < K)
    rows = offs_n.to(tl.int64)[:, None]
    if BITS == 4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(qw_ptr + rows * stride_qn + offs_b[None, :], mask=n_mask[:, None] & (2 * offs_b[None, :] < K),
                    other=0).to(tl.int32)
        q = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_N, BLOCK_K]).to(tl.float32)  # byte j: codes 2j, 2j+1
    else:
        q = tl.load(qw_ptr + rows * stride_qn + offs_k[None, :], mask=mask, other=0).to(tl.float32)
    if ONE_GROUP:
        g = k0 // GROUP
        s = tl.load(s_ptr + rows * stride_sn + g, mask=n_mask[:, None], other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + rows * stride_sn + g, mask=n_mask[:, None], other=0).to(tl.float32)
        else:
            z = 2.0 ** (BITS - 1)
    else:
        gk = offs_k // GROUP
        s = tl.load(s_ptr + rows * stride_sn + gk[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + rows * stride_sn + gk[None, :], mask=mask, other=0).to(tl.float32)
        else:
            z = 2.0 ** (BITS - 1)
    w = (q - z) * s
    tl.store(y_ptr + rows * stride_yn + offs_k[None, :], w.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_fp8_kernel(
    qw_ptr, s_ptr, y_ptr, N, K, stride_qn, stride_sn, stride_yn,
    SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``y[n, k] = e4m3(q[n, k]) * scale`` (channel scale, or the 128x128 block's), fp32, rounded once."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_k[None, :] < K)
    rows = offs_n.to(tl.int64)[:, None]
    b = tl.load(qw_ptr + rows * stride_qn + offs_k[None, :], mask=mask, other=0)
    v = _fp8_e4m3_bits_to_f32(b) * 1.329227995784916e36  # times 2**120: the e4m3 value (exact)
    if SCALE_BLOCK == 0:
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    else:
        s = tl.load(s_ptr + (offs_n // SCALE_BLOCK).to(tl.int64)[:, None] * stride_sn
                    + (offs_k // SCALE_BLOCK)[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + rows * stride_yn + offs_k[None, :], (v * s).to(y_ptr.dtype.element_ty), mask=mask)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtype(fn: str, dtype) -> None:
    if dtype not in _FLOATS:
        raise TypeError(f"{fn}: dtype must be torch.float32, float16 or bfloat16, got {dtype}")


def dequant_int_triton(w: IntWeight, dtype: torch.dtype) -> torch.Tensor:
    """``w.dequantize(dtype)``: INT4 / INT8 codes (any group size) -> ``[N, in_features]`` in ``dtype``
    (fp32 / fp16 / bf16; another dtype raises ``TypeError``), on ``w``'s device, in one pass."""
    _check_dtype("dequant_int_triton", dtype)
    n, k = w.shape
    y = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    zeros = w.zeros if w.zeros is not None else w.scales
    g = w.group_size
    per_row = w.scales.shape[1] == 1
    # Tiles of 128 codes, or of one group when groups are smaller powers of two, so that a row's scale and
    # zero point load once per tile (else, odd group sizes, per code).
    small_pow2 = 16 <= g < 128 and g & (g - 1) == 0
    block_k = g if small_pow2 and not per_row else 128
    one_group = per_row or g % block_k == 0
    grid = (triton.cdiv(n, 32), triton.cdiv(k, block_k))
    _dequant_int_kernel[grid](
        w.qweight, w.scales, zeros, y, n, k, w.qweight.stride(0), w.scales.stride(0), y.stride(0),
        BITS=w.bits, GROUP=g, HAS_ZEROS=w.zeros is not None, ONE_GROUP=one_group, BLOCK_N=32, BLOCK_K=block_k,
    )
    return y


def dequant_fp8_triton(w: FP8Weight, dtype: torch.dtype) -> torch.Tensor:
    """``w.dequantize(dtype)``: e4m3 bytes ``[N, K]`` with channel or 128x128 block scales -> ``[N, K]`` in
    ``dtype`` (fp32 / fp16 / bf16; another dtype raises ``TypeError``), in one pass (integer e4m3 decode:
    no FP8 instruction, sm80 too)."""
    _check_dtype("dequant_fp8_triton", dtype)
    n, k = w.shape
    y = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    block = 0 if w.block_size is None else w.block_size
    stride_s = w.scales.stride(0) if block else 1
    grid = (triton.cdiv(n, 32), triton.cdiv(k, 128))
    _dequant_fp8_kernel[grid](
        w.qweight, w.scales, y, n, k, w.qweight.stride(0), stride_s, y.stride(0),
        SCALE_BLOCK=block, BLOCK_N=32, BLOCK_K=128,
    )
    return y
