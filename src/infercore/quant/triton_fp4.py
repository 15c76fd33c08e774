"""Triton kernels for FP4 e2m1 weights with block scales (:class:`FP4Weight`, MXFP4 / NVFP4), decoded in
registers with integer operations only (no FP4 or FP8 instruction, so they run on sm80 and Hopper alike).

* ``_fp4_gemv_kernel`` -- up to :data:`GEMV_M_MAX` rows (K a multiple of 32): a CUDA-core GEMV over the codes
  repacked once into interleaved int32 words (:func:`fp4_words`, cached beside the weight by the INT4 GEMV's repack
  cache): three integer operations and one FMA a code and row, each block's products summed in registers and scaled
  once.
* ``_fp4_kernel`` -- more rows: the stored codes read as words, decoded the same way, times the block scale, in the
  activation dtype -> ``tl.dot`` (fp32 accumulation).
* MODE 9 (``cuda_mma`` with ``FP4``; :data:`MMA_ROWS`, when :data:`MMA` is on, the default) -- the codes looked up
  in the e2m1 table by byte permutes straight into the MMA's A registers, times the block scales in the 16-bit type
  (exact).
* ``_fp4_dequant_kernel`` -- from :data:`DECODE_MIN_M` rows the weight is decoded once into the activation dtype and
  cuBLAS multiplies (a transient ``[N, K]`` weight per call), as the INT4 / FP8 weight-only paths do at prefill sizes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import cuda_mma as CM
from . import wo_gemv
from .formats import FP4Weight
from .fp4 import e2m1_decode, unpack_nibbles
from .repacks import packed
from .triton_dequant import _fp8_e4m3_bits_to_f32
from .wo_gemv import _gemv_rows, _ilv_cached
from .wo_tiles import (
    _INTERPRET,
    _check_x,
    _configs,
    _dot_precision,
    _gemm_tile,
    _m_bucket,
    _prune_m,
    _store_tile,
    _x_tile,
)

GEMV_M_MAX = 4
DECODE_MIN_M = 96
# rows MODE 9 takes (``cuda_mma`` with ``FP4``: sm80+ with NVRTC, K % 128 == 0, bf16 activations for MXFP4, bf16 /
# fp16 for NVFP4). 14336 x 4096 bf16 on an H200 (sweeps/mode9_lut_h200.json): MXFP4 3 / 8 / 16 rows 21.8 / 21.7 /
# 24.4 us against the tiled kernel's 30.8 / 35.3 / 35.4, NVFP4 25.7 / 26.8 / 27.6 against 38.7 / 55.5 / 55.0; at 1-2
# rows the GEMV is as fast or faster (MXFP4 16.3 / 21.3 against 21.6 / 21.7, NVFP4 15.8 / 23.8 against 25.2 / 26.0).
# INFERCORE_FP4_MMA=0 turns it off
MMA_ROWS = (3, 16)
MMA = os.environ.get("INFERCORE_FP4_MMA", "1") == "1"


@triton.jit
def _codes_to_f32(byte):
    """uint8 code pairs -> (low, high) nibbles as fp32 values times 2**-14 (``quant.fp4``'s emulated decode)."""
    b = byte.to(tl.int16)
    lo = (((b & 8) << 12) | ((b & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _block_scale(sb, gscale, NV: tl.constexpr, FOLD_EXP: tl.constexpr = 14):
    """Scale bytes -> fp32 block scales times ``2**FOLD_EXP`` (the decode's fold): e8m0 ``2**(e - 127)`` (built as
    the fp32 with exponent field ``e + FOLD_EXP``, so the byte 0 does not read as 0) or e4m3 times the tensor's
    ``gscale``."""
    if NV:
        return _fp8_e4m3_bits_to_f32(sb) * 2.0**120 * (gscale * 2.0**FOLD_EXP)
    return ((sb.to(tl.int32) + FOLD_EXP) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ilv_code(w, J: tl.constexpr):
    """Code ``J`` (bits ``4J .. 4J + 3``) of int32 words as fp32 equal to its value times 2**-126: the nibble to
    the top, an arithmetic shift by 6 puts its magnitude under the exponent's low bits and the top mantissa bit
    (e = 0: fp32's subnormals, exact) and keeps the sign in bit 31; the mask clears the sign's copies."""
    if J < 7:
        t = w << (28 - 4 * J)
    else:
        t = w
    return ((t >> 6) & -2118123520).to(tl.float32, bitcast=True)  # mask 0x81C00000


@triton.jit
def _store_gemv_rows(y_ptr, a0, a1, a2, a3, M, stride_ym, offs_n, n_mask, MR: tl.constexpr, BLOCK_N: tl.constexpr):
    """The GEMVs' end: row r's partial sums ``a<r> [BLOCK_N, *]`` summed over their last axis, rows ``< min(M, MR)``
    stored to ``y[r, offs_n]`` (the FP4 and NF4 GEMVs)."""
    acc, offs_m, m_mask = _gemv_rows(a0, a1, a2, a3, M, MR, BLOCK_N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _word_tile(w_rows, kw, nw, EVEN: tl.constexpr):
    """The GEMVs' words ``kw`` of each row (0 past ``nw`` words unless EVEN), streamed once (evict first)."""
    if EVEN:
        w = tl.load(w_rows + kw[None, :], eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + kw[None, :], mask=(kw < nw)[None, :], other=0, eviction_policy="evict_first")
    return w


@triton.jit
def _rows_fma(p0, p1, p2, p3, v, x_ptr, r1, r2, r3, k, K, EVEN: tl.constexpr, MR: tl.constexpr):
    """The GEMVs' per-code step: ``p<r> += v * x[row r, k]`` for the first MR of four rows (row 0 at offset 0)."""
    p0 = _fp4_row_fma(p0, v, x_ptr, 0, k, K, EVEN)
    if MR > 1:
        p1 = _fp4_row_fma(p1, v, x_ptr, r1, k, K, EVEN)
    if MR > 2:
        p2 = _fp4_row_fma(p2, v, x_ptr, r2, k, K, EVEN)
        p3 = _fp4_row_fma(p3, v, x_ptr, r3, k, K, EVEN)
    return p0, p1, p2, p3


@triton.jit
def _group_sums(a, p, sc, f, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """``a + (the sums of p [BLOCK_N, BLOCK_W] over each group of 4 words) * f * sc``."""
    return a + (tl.sum(tl.reshape(p, [BLOCK_N, BLOCK_W // 4, 4]), axis=2) * f) * sc


def gemv_launches(extra: tuple = ()) -> list[triton.Config]:
    """The FP4 GEMV's launch list (fresh objects per autotuner), then ``extra``; the NF4 GEMV shares its loop."""
    return [
        # the five best of 80 at 14336 x 4096, M = 1, MXFP4 on an H100 (16.7-17.1 us; the worst 41.1 us;
        # results/h200/sweeps/sweep_fp4_gemv_h100.json)
        triton.Config({"BLOCK_N": 8, "BLOCK_W": 512}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 8, "BLOCK_W": 256}, num_warps=2, num_stages=1),
        triton.Config({"BLOCK_N": 4, "BLOCK_W": 512}, num_warps=2, num_stages=3),
        triton.Config({"BLOCK_N": 8, "BLOCK_W": 256}, num_warps=2, num_stages=3),
        triton.Config({"BLOCK_N": 4, "BLOCK_W": 128}, num_warps=1, num_stages=1),
        *extra,
    ]


@triton.jit
def _fp4_row_fma(p, v, x_ptr, row, k, K, EVEN: tl.constexpr):
    if EVEN:
        x = tl.load(x_ptr + row + k)
    else:
        x = tl.load(x_ptr + row + k, mask=k < K, other=0.0)
    return p + v * x.to(tl.float32)


@triton.autotune(
    configs=_configs(gemv_launches(), triton.Config({"BLOCK_N": 4, "BLOCK_W": 8}, num_warps=4)),
    key=["M", "N", "K", "NV"],
)
@triton.heuristics({"EVEN": lambda a: (a["K"] // 8) % a["BLOCK_W"] == 0})
@triton.jit
def _fp4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, gscale,
    NV: tl.constexpr, BS: tl.constexpr, MR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    EVEN: tl.constexpr,  # K / 8 is whole tiles of BLOCK_W words: no masks
):  # fmt: skip
    # ``w``: the codes as int32 words in the interleaved layout of ``fp4_words`` (within each group of 32 codes,
    # word ``i`` of 4 holds codes ``i + 4 j`` at bits ``4 j``): a thread's 16-byte load is 4 words of whole
    # groups, and code ``j`` of consecutive words sits at consecutive K, so each activation load is a vector in
    # the weights' layout. A group is one MXFP4 block or two NVFP4 blocks (codes ``j < 4`` and ``j >= 4`` of its
    # words), whose two scale bytes are read as one int16: the block sums and their scales keep the words'
    # layout in every thread (no exchange through shared memory). Per code: three integer operations
    # (``_ilv_code``) and one FMA a row; a block's products are summed in registers and scaled once. A product
    # below 2**-126 (|value * x| < 1 before the 2**126 returns) is an fp32 subnormal: its rounding error stays
    # under 2**-24 times the block scale, far under the output's rounding.
    NH: tl.constexpr = 32 // BS  # blocks per group of 32 codes
    JH: tl.constexpr = 8 // NH  # codes of a word in one block
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: full tiles need no mask
    offs_w = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
    offs_b = tl.arange(0, BLOCK_W // 4)
    a0 = tl.zeros([BLOCK_N, BLOCK_W // 4], dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    nw = K // 8
    w_rows = w_ptr + rows[:, None] * stride_wn
    if NV:
        s_rows = s_ptr.to(tl.pointer_type(tl.int16)) + rows[:, None] * (stride_sn // 2)
    else:
        s_rows = s_ptr + rows[:, None] * stride_sn
    r1 = tl.minimum(1, M - 1) * stride_xm  # rows past M re-read row M - 1 (the store masks them)
    r2 = tl.minimum(2, M - 1) * stride_xm
    r3 = tl.minimum(3, M - 1) * stride_xm
    for w0 in range(0, nw, BLOCK_W):
        kw = w0 + offs_w
        w = _word_tile(w_rows, kw, nw, EVEN)
        k0 = ((kw // 4) * 32 + kw % 4)[None, :]  # K of each word's code 0
        kb = w0 // 4 + offs_b
        for h in tl.static_range(NH):
            p0 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
            p1 = p0
            p2 = p0
            p3 = p0
            for jj in tl.static_range(JH):
                v = _ilv_code(w, h * JH + jj)
                k = k0 + 4 * (h * JH + jj)
                p0, p1, p2, p3 = _rows_fma(p0, p1, p2, p3, v, x_ptr, r1, r2, r3, k, K, EVEN, MR)
            if h == 0:  # the scales after the first codes' loads (as early, they cost a layout exchange)
                if EVEN:
                    sg = tl.load(s_rows + kb[None, :])
                else:
                    sg = tl.load(s_rows + kb[None, :], mask=(kb < nw // 4)[None, :], other=0)
            if NV:
                sc = _block_scale((sg.to(tl.int32) >> (8 * h)) & 0xFF, gscale, NV, 26)
            else:
                sc = _block_scale(sg, gscale, NV, 26)
            a0 = _group_sums(a0, p0, sc, 2.0**100, BLOCK_N, BLOCK_W)
            if MR > 1:
                a1 = _group_sums(a1, p1, sc, 2.0**100, BLOCK_N, BLOCK_W)
            if MR > 2:
                a2 = _group_sums(a2, p2, sc, 2.0**100, BLOCK_N, BLOCK_W)
                a3 = _group_sums(a3, p3, sc, 2.0**100, BLOCK_N, BLOCK_W)
    _store_gemv_rows(y_ptr, a0, a1, a2, a3, M, stride_ym, offs_n, n_mask, MR, BLOCK_N)


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight ``[R, C]`` tensors -> ``[R, C * 8]`` with ``v_j`` at columns ``8 c + j``."""
    a = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    b = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    t = tl.join(a, b)
    return tl.reshape(t, [t.shape[0], t.shape[1] * 8])


@triton.autotune(
    configs=_configs(
        [
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        ],
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2}, num_warps=4),
    ),
    key=["M_BUCKET", "N", "K", "NV"],
    prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw: _prune_m(cfgs, {**nargs, **kw})},
)
@triton.jit
def _fp4_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, M_BUCKET, stride_xm, stride_qn, stride_sn, stride_ym, gscale,
    NV: tl.constexpr, BS: tl.constexpr, DOT_PRECISION: tl.constexpr, F16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # The stored codes read as int32 words (word w: K = 8w .. 8w + 7, code j at bits 4j), each code decoded by
    # ``_ilv_code`` (value * 2**-126) and multiplied by its block scale times 2**66, so the dot operand is the weight
    # times 2**-60 (normal in bf16 / fp32 for any block scale from 2**-65 up); the 2**60 returns after the K
    # loop. F16 (fp16 activations, a narrower range): the weight itself, from two folds of 2**63.
    NBLK: tl.constexpr = BLOCK_K // BS
    BW: tl.constexpr = BLOCK_K // 8
    offs_m, offs_n, m_mask, n_mask, rows_x = _gemm_tile(M, N, stride_xm, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_rows = q_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_qn // 4)
    offs_w = tl.arange(0, BW)
    blk = tl.arange(0, NBLK)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    nw = K // 8
    for w0 in range(0, nw, BW):
        kw = w0 + offs_w
        wd = tl.load(w_rows + kw[None, :], mask=(kw < nw)[None, :], other=0)  # [BN, BW]
        v = _join8(_ilv_code(wd, 0), _ilv_code(wd, 1), _ilv_code(wd, 2), _ilv_code(wd, 3), _ilv_code(wd, 4),
                   _ilv_code(wd, 5), _ilv_code(wd, 6), _ilv_code(wd, 7))  # [BN, BLOCK_K]
        kb = w0 // (BS // 8) + blk
        sb = tl.load(s_ptr + rows[:, None] * stride_sn + kb[None, :], mask=(kb < K // BS)[None, :], other=0)
        v3 = tl.reshape(v, [BLOCK_N, NBLK, BS])
        if F16:
            w3 = (v3 * 2.0**63) * _block_scale(sb, gscale, NV, 63)[:, :, None]
        else:
            w3 = v3 * _block_scale(sb, gscale, NV, 66)[:, :, None]
        a = _x_tile(x_ptr, rows_x, m_mask, w0 * 8, K, BLOCK_K)
        wk = tl.reshape(w3, [BLOCK_N, BLOCK_K]).to(a.dtype)
        acc = tl.dot(a, tl.trans(wk), acc, input_precision=DOT_PRECISION)
    if not F16:
        acc = acc * 2.0**60
    _store_tile(y_ptr, acc, offs_m, m_mask, offs_n, n_mask, stride_ym)


@triton.jit
def _fp4_dequant_kernel(q_ptr, s_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn, gscale, NV: tl.constexpr,
                        BS: tl.constexpr, BLOCK_N: tl.constexpr, NBLK: tl.constexpr):
    HB: tl.constexpr = BS // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * NBLK + tl.arange(0, NBLK)
    j = tl.arange(0, HB)[None, None, :]
    rows = offs_n.to(tl.int64)
    bmask = (offs_n < N)[:, None] & (blk < K // BS)[None, :]
    byte = tl.load(q_ptr + rows[:, None, None] * stride_qn + blk[None, :, None] * HB + j, mask=bmask[:, :, None],
                   other=0)
    sb = tl.load(s_ptr + rows[:, None] * stride_sn + blk[None, :], mask=bmask, other=0)
    lo, hi = _codes_to_f32(byte)
    w = tl.reshape(tl.join(lo, hi), [BLOCK_N, NBLK, BS]) * _block_scale(sb, gscale, NV)[:, :, None]
    k = blk[None, :, None] * BS + tl.arange(0, BS)[None, None, :]
    tl.store(w_ptr + rows[:, None, None] * stride_wn + k, w.to(w_ptr.dtype.element_ty), mask=bmask[:, :, None])


def fp4_dequantize_triton(w: FP4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[N, K]`` weight in ``dtype`` (one kernel)."""
    n, k = w.shape
    out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    bn, nblk = (16, 2) if _INTERPRET else (32, 8)
    grid = (triton.cdiv(n, bn), triton.cdiv(k // w.block, nblk))
    _fp4_dequant_kernel[grid](w.qweight, w.scales, out, n, k, w.qweight.stride(0), w.scales.stride(0), out.stride(0),
                              w.global_scale, NV=w.fmt == "nvfp4", BS=w.block, BLOCK_N=bn, NBLK=nblk)
    return out


def fp4_words(w: FP4Weight) -> torch.Tensor:
    """The codes of ``w`` as int32 words ``[N, K / 8]`` in the GEMV's interleaved layout: within each group of 32
    codes (4 words; one MXFP4 block, two NVFP4 blocks), word ``i`` holds codes ``i + 4 j`` at bits ``4 j``."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"w: the GEMV's words need K a multiple of 32, got {k}")
    codes = unpack_nibbles(w.qweight).to(torch.int64).view(n, k // 32, 8, 4).transpose(2, 3)
    words = (codes << (4 * torch.arange(8, device=codes.device))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(n, k // 8).contiguous()


def _gemv_ok(w: FP4Weight) -> bool:
    """The GEMV reads whole groups of 32 codes, and NVFP4's two scale bytes of a group as one int16."""
    n, k = w.shape
    s = w.scales
    return k % 32 == 0 and (w.fmt == "mxfp4" or (s.stride(1) == 1 and s.stride(0) % 2 == 0
                                                  and s.data_ptr() % 2 == 0))


def _run_mma(x: torch.Tensor, w: FP4Weight) -> torch.Tensor | None:
    """MODE 9's product when it takes this call (:data:`MMA_ROWS`, :func:`cuda_mma.available`, the kernel compiles),
    else None. The repack and the table operand are made on the first eager call and kept while the weight lives
    (none during a CUDA-graph capture: the Triton kernels then take the call)."""
    lo, hi = MMA_ROWS
    m, kind = x.shape[0], w.fmt
    if not (MMA and wo_gemv.REPACK and lo <= m <= hi and CM.fp4_ok(w) and CM.available(x)):
        return None
    if (kind == "mxfp4" and x.dtype != torch.bfloat16) or not CM.compiles(kind, x.dtype, x.device, m > 8):
        return None
    p = packed(w.qweight, ("mode9-fp4",), lambda: CM.repack_fp4(w))
    ys = w.global_scale if kind == "nvfp4" else 1.0
    book = lambda: e2m1_decode(torch.arange(16, dtype=torch.uint8, device=x.device))  # noqa: E731 (the 16 values)
    tables = packed(w.qweight, ("mode9-fp4-tables", x.dtype), lambda: CM.lut_tables(book(), x.dtype, ys))
    if p is None or tables is None:
        return None
    return CM.matmul(x, kind, p[0], p[1], w.shape[0], w.shape[1], tables=tables)


def fp4_matmul_triton(x: torch.Tensor, w: FP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32) times the FP4 weight ``w`` (logical ``[N, K]``) -> ``[M, N]`` in ``x.dtype``;
    ``bias``: optional ``[N]``."""
    n, k = w.shape
    x = _check_x("fp4_matmul_triton", x, k)
    m = x.shape[0]
    nv = w.fmt == "nvfp4"
    if m >= DECODE_MIN_M and x.dtype != torch.float32:
        return F.linear(x, fp4_dequantize_triton(w, x.dtype), None if bias is None else bias.to(x.dtype))
    y = None if _INTERPRET or m == 0 else _run_mma(x, w)
    if y is not None:
        return y if bias is None else y + bias.to(y.dtype)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # the GEMV's words, made once and kept beside the codes (wo_gemv's repack cache: INFERCORE_WO_REPACK=0 declines
    # them, and a CUDA-graph capture does not make them); without them the tiled kernel takes these rows too
    words = _ilv_cached(w.qweight, lambda: fp4_words(w)) if m <= GEMV_M_MAX and _gemv_ok(w) else None
    if words is not None:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _fp4_gemv_kernel[grid](x, words, w.scales, y, m, n, k, x.stride(0), words.stride(0), w.scales.stride(0),
                               y.stride(0), w.global_scale, NV=nv, BS=w.block, MR=triton.next_power_of_2(m))
    else:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _fp4_kernel[grid](x, w.qweight, w.scales, y, m, n, k, _m_bucket(m), x.stride(0), w.qweight.stride(0),
                          w.scales.stride(0), y.stride(0), w.global_scale, NV=nv, BS=w.block,
                          DOT_PRECISION=_dot_precision(x.dtype), F16=x.dtype == torch.float16)  # fmt: skip
    return y if bias is None else y + bias.to(y.dtype)

