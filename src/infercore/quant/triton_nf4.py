"""CUDA kernels of ``quant.nf4_matmul``: 4-bit codes into a 16-value codebook with fp32 absmax blocks (bitsandbytes
NF4 / FP4, :class:`~infercore.quant.NF4Weight`).

A code's value is found one of three ways (``LUT`` 1 / 2 / 0 in the kernels):

* **fp16 byte permutes** (16-bit activations on a GPU): the codebook rounded to fp16, its low and high bytes held in
  eight registers (two 8-byte halves of 16 entries each), and four codes of a word looked up at once by ``prmt``
  (whose selector nibbles are the codes): a permute per half and byte, a byte mask from the codes' top bits picks
  the half, two more permutes pair the bytes into fp16 values -- about 4.5 instructions a code. bitsandbytes' own
  kernels round the codebook to the activation dtype; fp16 keeps 3 more bits than bf16.
* **fp32 byte permutes** (the weight decode on a GPU): the fp32 codebook's four byte planes looked up the same way,
  then a 4 x 4 byte transpose: exactly the codebook, so the decode is bit for bit ``w.dequantize(dtype)``.
* **select tree** (fp32 activations, the interpreter): the 16 fp32 values held as scalars and picked by 15 selects
  on the code's bits (about 15 instructions a code): exactly the codebook.

Kernels:

* up to :data:`GEMV_M_MAX` rows (blocksize a multiple of 32): ``_nf4_gemv_kernel``, a CUDA-core GEMV over the codes
  repacked once into the FP4 GEMV's interleaved words (kept beside the weight, ``wo_gemv``'s repack cache), each
  block's products summed in registers and scaled once by its absmax;
* more rows: ``_nf4_kernel``, the stored codes read as int32 words, decoded, times the absmax, in x's dtype ->
  ``tl.dot`` (fp32 accumulation);
* from :data:`DEQUANT_M_MIN` rows (16-bit x): the whole weight decoded to x's dtype in one pass (the values of
  ``w.dequantize(x.dtype)``), then the library GEMM (cuBLAS through torch);
* :data:`MMA_ROWS` (3-16 rows, 16-bit x, when :data:`MMA` is on, the default): MODE 9, ``cuda_mma``'s CUDA kernel
  with ``NF4``, the codes looked up by the same byte permutes straight into the MMA's A registers.

14336 x 4096 on an H100, bf16 x (``benchmarks/results/h200/sweeps/nf4_prmt_h100.json``): one row 21.9 us (bf16
47.0, bitsandbytes' ``matmul_4bit`` 28.7), 16 rows 41.6 (41.2, 67.3), 2048 rows 391.8 (338.1, 401.2). The first CUDA
form (one tiled kernel, a select tree) ran 549 us at one row (``sweeps/nf4_select_tiled_h100.json``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import cuda_mma as CM
from . import naive, wo_gemv
from .formats import NF4Weight
from .repacks import packed
from .triton_fp4 import _group_sums, _join8, _rows_fma, _store_gemv_rows, _word_tile, gemv_launches
from .wo_gemv import _ilv_cached, interleave_words
from .wo_tiles import (
    _INTERPRET,
    _configs,
    _dot_precision,
    _gemm_tile,
    _m_bucket,
    _mm_cfg,
    _prune_m,
    _store_tile,
    _x_tile,
)

# rows the GEMV takes: at 3-4 rows its 4-row form ran 45.1 / 45.7 us against the tiled kernel's 42.8 / 42.8
# (14336 x 4096, H100; sweeps/nf4_prmt_h100_select_decode.json, nf4_prmt_h100_gemv_max2.json)
GEMV_M_MAX = 2
# rows from which the weight is decoded once and multiplied by the library GEMM (16-bit x); at 14336 x 4096 on an
# H100 the tiled kernel took 92 / 149 us at 96 / 256 rows (sweeps/nf4_prmt_h100_tiled_large_m.json), decode (then a
# select tree) + cuBLAS 136 / 139 (nf4_prmt_h100_select_decode.json); the byte-permute decode made the latter 111 at
# 192 rows, 113 at 256 (nf4_prmt_h100.json)
DEQUANT_M_MIN = 192
# rows MODE 9 takes (``cuda_mma``, the CUDA stream-K tensor-core kernel with ``NF4``: sm80+ with NVRTC, 16-bit
# activations, K % 128 == 0, absmax blocks of 64 or a multiple of 128). 14336 x 4096 bf16 on an H200
# (sweeps/mode9_lut_h200.json): 1 / 2 / 3 / 16 rows 20.0 / 19.9 / 20.2 / 22.6 us against the GEMV's 21.7 / 26.3 and the
# tiled kernel's 43.3 / 42.0 (bf16 33.4 / 30.2 / 30.2 / 30.7); at 32 rows it is not taken (one 16-row tile).
# From one row it made the 8B shape's batch-1 decode slower end to end, though: 195.7 tok/s against 244.2 with the
# GEMV at 1-2 rows (H100; sweeps/e2e_quant_fp4_nf4_mode9_h100.json vs e2e_quant_nf4_h100.json), so 1-2 rows stay
# on the GEMV, as for FP4. INFERCORE_NF4_MMA=0 turns it off
MMA_ROWS = (3, 16)
MMA = os.environ.get("INFERCORE_NF4_MMA", "1") == "1"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# Eight codes of a word (code j at bits 4j) -> eight fp32 values; $8 the word, $9-$12 the low bytes of the fp16
# codebook (entries 4i .. 4i + 3 in register i), $13-$16 the high bytes. For each 4 codes: ``s & 0x7777`` selects
# within a half (prmt's generic mode: selector nibble bit 3 would sign-fill), the mask byte is 0xff where the code
# is 8 or more (prmt of {0, 0x80808080} with nibbles 0xc + i or i: a sign fill of 0x80 or a zero byte).
_PRMT8_SRC = """{
.reg .b32 s, q, t, u, m, la, lb, ha, hb, lo, hi, p, z, e;
.reg .b16 a0, a1;
mov.b32 z, 0;
mov.b32 e, 0x80808080;
""" + "".join(f"""
{"mov.b32 s, $8;" if half == 0 else "shr.u32 s, $8, 16;"}
and.b32 q, s, 0x7777;
and.b32 t, s, 0x8888;
shr.u32 u, t, 1;
or.b32 u, u, t;
or.b32 u, u, 0x3210;
prmt.b32 m, z, e, u;
prmt.b32 la, $9, $10, q;
prmt.b32 lb, $11, $12, q;
prmt.b32 ha, $13, $14, q;
prmt.b32 hb, $15, $16, q;
xor.b32 lb, lb, la;
and.b32 lb, lb, m;
xor.b32 lo, la, lb;
xor.b32 hb, hb, ha;
and.b32 hb, hb, m;
xor.b32 hi, ha, hb;
prmt.b32 p, lo, hi, 0x5140;
mov.b32 {{a0, a1}}, p;
cvt.f32.f16 ${4 * half}, a0;
cvt.f32.f16 ${4 * half + 1}, a1;
prmt.b32 p, lo, hi, 0x7362;
mov.b32 {{a0, a1}}, p;
cvt.f32.f16 ${4 * half + 2}, a0;
cvt.f32.f16 ${4 * half + 3}, a1;
""" for half in (0, 1)) + "}"
_PRMT8 = tl.constexpr(_PRMT8_SRC)
_PRMT8_CONS = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 9))


def _prmt8_f32() -> str:
    """The exact form: the fp32 codebook's four byte planes (16 registers, $9 + 4p + i: byte p of entries 4i .. 4i + 3),
    each plane looked up as above, then a 4 x 4 byte transpose (8 permutes) makes the four codes' fp32 bits."""
    body = ["{", ".reg .b32 s, q, t, u, m, a, b, z, e, p0, p1, p2, p3, c0, c1, c2, c3;", "mov.b32 z, 0;",
            "mov.b32 e, 0x80808080;"]
    for half in (0, 1):
        body += ["mov.b32 s, $8;" if half == 0 else "shr.u32 s, $8, 16;", "and.b32 q, s, 0x7777;",
                 "and.b32 t, s, 0x8888;", "shr.u32 u, t, 1;", "or.b32 u, u, t;", "or.b32 u, u, 0x3210;",
                 "prmt.b32 m, z, e, u;"]
        for p in range(4):
            r = 9 + 4 * p
            body += [f"prmt.b32 a, ${r}, ${r + 1}, q;", f"prmt.b32 b, ${r + 2}, ${r + 3}, q;", "xor.b32 b, b, a;",
                     "and.b32 b, b, m;", f"xor.b32 p{p}, a, b;"]
        o = 4 * half
        body += ["prmt.b32 c0, p0, p1, 0x5140;", "prmt.b32 c1, p0, p1, 0x7362;", "prmt.b32 c2, p2, p3, 0x5140;",
                 "prmt.b32 c3, p2, p3, 0x7362;", f"prmt.b32 ${o}, c0, c2, 0x5410;",
                 f"prmt.b32 ${o + 1}, c0, c2, 0x7632;", f"prmt.b32 ${o + 2}, c1, c3, 0x5410;",
                 f"prmt.b32 ${o + 3}, c1, c3, 0x7632;"]
    return "\n".join(body + ["}"])


_PRMT8_F32 = tl.constexpr(_prmt8_f32())
_PRMT8_F32_CONS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 17))


@triton.jit
def _fp16_bits(lut_ptr, i: tl.constexpr):
    return tl.load(lut_ptr + i).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _byte_table(lut_ptr, i0: tl.constexpr, HIGH: tl.constexpr):
    """The low (or high) bytes of the fp16 codebook entries ``i0 .. i0 + 3`` as one int32, entry ``i0 + j`` in byte
    ``j``."""
    sh: tl.constexpr = 8 if HIGH else 0
    r = (_fp16_bits(lut_ptr, i0) >> sh) & 0xFF
    r |= ((_fp16_bits(lut_ptr, i0 + 1) >> sh) & 0xFF) << 8
    r |= ((_fp16_bits(lut_ptr, i0 + 2) >> sh) & 0xFF) << 16
    return r | (((_fp16_bits(lut_ptr, i0 + 3) >> sh) & 0xFF) << 24)


@triton.jit
def _f32_plane(lut_ptr, i0: tl.constexpr, P: tl.constexpr):
    """Byte ``P`` of the fp32 codebook entries ``i0 .. i0 + 3`` as one int32, entry ``i0 + j`` in byte ``j``."""
    r = (tl.load(lut_ptr + i0).to(tl.int32, bitcast=True) >> (8 * P)) & 0xFF
    r |= ((tl.load(lut_ptr + i0 + 1).to(tl.int32, bitcast=True) >> (8 * P)) & 0xFF) << 8
    r |= ((tl.load(lut_ptr + i0 + 2).to(tl.int32, bitcast=True) >> (8 * P)) & 0xFF) << 16
    return r | (((tl.load(lut_ptr + i0 + 3).to(tl.int32, bitcast=True) >> (8 * P)) & 0xFF) << 24)


@triton.jit
def _tables(lut_ptr, LUT: tl.constexpr):
    """The lookup's 16 operands: LUT 1 the eight fp16 byte tables (then zeros), LUT 2 the sixteen fp32 byte planes,
    LUT 0 the 16 fp32 codebook values."""
    if LUT == 1:
        z = tl.full((), 0, tl.int32)
        t = (_byte_table(lut_ptr, 0, False), _byte_table(lut_ptr, 4, False), _byte_table(lut_ptr, 8, False),
             _byte_table(lut_ptr, 12, False), _byte_table(lut_ptr, 0, True), _byte_table(lut_ptr, 4, True),
             _byte_table(lut_ptr, 8, True), _byte_table(lut_ptr, 12, True), z, z, z, z, z, z, z, z)
    elif LUT == 2:
        p = lut_ptr
        t = (_f32_plane(p, 0, 0), _f32_plane(p, 4, 0), _f32_plane(p, 8, 0), _f32_plane(p, 12, 0),
             _f32_plane(p, 0, 1), _f32_plane(p, 4, 1), _f32_plane(p, 8, 1), _f32_plane(p, 12, 1),
             _f32_plane(p, 0, 2), _f32_plane(p, 4, 2), _f32_plane(p, 8, 2), _f32_plane(p, 12, 2),
             _f32_plane(p, 0, 3), _f32_plane(p, 4, 3), _f32_plane(p, 8, 3), _f32_plane(p, 12, 3))
    else:
        t = (tl.load(lut_ptr + 0), tl.load(lut_ptr + 1), tl.load(lut_ptr + 2), tl.load(lut_ptr + 3),
             tl.load(lut_ptr + 4), tl.load(lut_ptr + 5), tl.load(lut_ptr + 6), tl.load(lut_ptr + 7),
             tl.load(lut_ptr + 8), tl.load(lut_ptr + 9), tl.load(lut_ptr + 10), tl.load(lut_ptr + 11),
             tl.load(lut_ptr + 12), tl.load(lut_ptr + 13), tl.load(lut_ptr + 14), tl.load(lut_ptr + 15))
    return t


@triton.jit
def _select16(q, t):
    """``t[q]`` for 4-bit codes ``q`` (int32) by a tree of selects on the code's bits."""
    b0, b1, b2, b3 = (q & 1) != 0, (q & 2) != 0, (q & 4) != 0, (q & 8) != 0
    m0 = tl.where(b1, tl.where(b0, t[3], t[2]), tl.where(b0, t[1], t[0]))
    m1 = tl.where(b1, tl.where(b0, t[7], t[6]), tl.where(b0, t[5], t[4]))
    m2 = tl.where(b1, tl.where(b0, t[11], t[10]), tl.where(b0, t[9], t[8]))
    m3 = tl.where(b1, tl.where(b0, t[15], t[14]), tl.where(b0, t[13], t[12]))
    return tl.where(b3, tl.where(b2, m3, m2), tl.where(b2, m1, m0))


@triton.jit
def _decode8(w, t, LUT: tl.constexpr):
    """The eight codes of int32 words ``w`` (code j at bits 4j) as fp32 codebook values (``_tables(.., LUT)``'s
    operands): LUT 1 the fp16-rounded values by byte permutes, LUT 2 the exact values by byte permutes, LUT 0 the
    exact values by select trees."""
    if LUT == 1:
        v = tl.inline_asm_elementwise(_PRMT8, _PRMT8_CONS, [w, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]],
                                      dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    elif LUT == 2:
        r = tl.inline_asm_elementwise(_PRMT8_F32, _PRMT8_F32_CONS, [w, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7],
                                      t[8], t[9], t[10], t[11], t[12], t[13], t[14], t[15]], dtype=(tl.int32,) * 8,
                                      is_pure=True, pack=1)
        v = (r[0].to(tl.float32, bitcast=True), r[1].to(tl.float32, bitcast=True), r[2].to(tl.float32, bitcast=True),
             r[3].to(tl.float32, bitcast=True), r[4].to(tl.float32, bitcast=True), r[5].to(tl.float32, bitcast=True),
             r[6].to(tl.float32, bitcast=True), r[7].to(tl.float32, bitcast=True))
    else:
        v = (_select16(w & 15, t), _select16((w >> 4) & 15, t), _select16((w >> 8) & 15, t),
             _select16((w >> 12) & 15, t), _select16((w >> 16) & 15, t), _select16((w >> 20) & 15, t),
             _select16((w >> 24) & 15, t), _select16((w >> 28) & 15, t))
    return v


@triton.jit
def _scaled(vk, am_rows, k0, K, BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decoded codes ``vk [BLOCK_N, BLOCK_K]`` (columns ``k0 ...``) times their blocks' absmax (0 past K)."""
    if BS >= BLOCK_K:
        w = vk * tl.load(am_rows + k0 // BS)  # [BLOCK_N, 1]: one block over the tile (k0 < K)
    else:
        NB: tl.constexpr = BLOCK_K // BS
        b = k0 // BS + tl.arange(0, NB)
        sc = tl.load(am_rows + b[None, :], mask=(b < K // BS)[None, :], other=0.0)
        w = tl.reshape(tl.reshape(vk, [BLOCK_N, NB, BS]) * sc[:, :, None], [BLOCK_N, BLOCK_K])
    return w


@triton.autotune(
    configs=_configs(
        gemv_launches((  # the FP4 GEMV's (same word layout and loop), then:
            # fewer words a thread: all eight byte tables stay in registers (offline sm90 compile, 6.4 - 7.0
            # instructions a code against 7.05)
            triton.Config({"BLOCK_N": 4, "BLOCK_W": 512}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_N": 8, "BLOCK_W": 256}, num_warps=4, num_stages=3),
            # smaller tiles for 4-row forms (GEMV_M_MAX > 2; the ones above spill there in an offline sm90 compile)
            triton.Config({"BLOCK_N": 4, "BLOCK_W": 256}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_N": 4, "BLOCK_W": 128}, num_warps=2, num_stages=3),
            triton.Config({"BLOCK_N": 2, "BLOCK_W": 256}, num_warps=2, num_stages=3),
        )),
        triton.Config({"BLOCK_N": 4, "BLOCK_W": 8}, num_warps=4),
    ),
    key=["M", "N", "K", "LUT"],
)
@triton.heuristics({"EVEN": lambda a: (a["K"] // 8) % a["BLOCK_W"] == 0})
@triton.jit
def _nf4_gemv_kernel(
    x_ptr, w_ptr, am_ptr, lut_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_an, stride_ym,
    BS: tl.constexpr, LUT: tl.constexpr, MR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    EVEN: tl.constexpr,  # K / 8 is whole tiles of BLOCK_W words: no masks
):  # fmt: skip
    # ``w``: the codes as int32 words, interleaved in groups of 32 codes (word i of 4 holds codes i + 4j at bits 4j),
    # so code j of consecutive words sits at consecutive K and each activation load is a vector. A group lies in one
    # absmax block (BS a multiple of 32): its products are summed in registers, then scaled once. K is whole groups.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: every row loads, the store masks
    offs_w = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
    offs_g = tl.arange(0, BLOCK_W // 4)
    t = _tables(lut_ptr, LUT)
    a0 = tl.zeros([BLOCK_N, BLOCK_W // 4], dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    nw = K // 8
    w_rows = w_ptr + rows[:, None] * stride_wn
    a_rows = am_ptr + rows[:, None] * stride_an
    r1 = tl.minimum(1, M - 1) * stride_xm  # rows past M re-read row M - 1
    r2 = tl.minimum(2, M - 1) * stride_xm
    r3 = tl.minimum(3, M - 1) * stride_xm
    for w0 in range(0, nw, BLOCK_W):
        kw = w0 + offs_w
        w = _word_tile(w_rows, kw, nw, EVEN)
        k0 = ((kw // 4) * 32 + kw % 4)[None, :]  # K of each word's code 0
        v = _decode8(w, t, LUT)
        p0 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        p1 = p0
        p2 = p0
        p3 = p0
        for j in tl.static_range(8):
            p0, p1, p2, p3 = _rows_fma(p0, p1, p2, p3, v[j], x_ptr, r1, r2, r3, k0 + 4 * j, K, EVEN, MR)
        g = w0 // 4 + offs_g
        if EVEN:
            sc = tl.load(a_rows + ((g * 32) // BS)[None, :])
        else:
            sc = tl.load(a_rows + ((g * 32) // BS)[None, :], mask=(g < nw // 4)[None, :], other=0.0)
        a0 = _group_sums(a0, p0, sc, 1.0, BLOCK_N, BLOCK_W)
        if MR > 1:
            a1 = _group_sums(a1, p1, sc, 1.0, BLOCK_N, BLOCK_W)
        if MR > 2:
            a2 = _group_sums(a2, p2, sc, 1.0, BLOCK_N, BLOCK_W)
            a3 = _group_sums(a3, p3, sc, 1.0, BLOCK_N, BLOCK_W)
    _store_gemv_rows(y_ptr, a0, a1, a2, a3, M, stride_ym, offs_n, n_mask, MR, BLOCK_N)


@triton.autotune(
    configs=_configs(
        # the FP4 tiled kernel's tiles and narrower ones (more programs at 8-64 rows)
        [_mm_cfg(*c) for c in ((16, 64, 128, 4, 3), (16, 32, 128, 4, 3), (16, 32, 256, 4, 3), (16, 16, 256, 2, 3),
                               (16, 128, 128, 4, 3), (32, 64, 128, 4, 3), (32, 32, 128, 4, 3), (64, 64, 128, 4, 3),
                               (64, 128, 64, 8, 3))],
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2}, num_warps=4),
    ),
    key=["M_BUCKET", "N", "K", "LUT"],
    prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw: _prune_m(cfgs, {**nargs, **kw})},
)
@triton.jit
def _nf4_kernel(
    x_ptr, q_ptr, am_ptr, lut_ptr, y_ptr, M, N, K, M_BUCKET, stride_xm, stride_qn, stride_an, stride_ym,
    BS: tl.constexpr, LUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # The stored codes read as int32 words (word w: K = 8w .. 8w + 7, code j at bits 4j), decoded, times the absmax
    # of each code's block, rounded to x's dtype -> tl.dot (codes past K: word 0 times absmax 0, x 0).
    BW: tl.constexpr = BLOCK_K // 8
    offs_m, offs_n, m_mask, n_mask, rows_x = _gemm_tile(M, N, stride_xm, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_rows = q_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_qn // 4)
    am_rows = am_ptr + rows[:, None] * stride_an
    offs_w = tl.arange(0, BW)
    t = _tables(lut_ptr, LUT)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    nw = K // 8
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + offs_w
        wd = tl.load(w_rows + kw[None, :], mask=(kw < nw)[None, :], other=0)  # [BN, BW]
        v = _decode8(wd, t, LUT)
        vk = _join8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7])  # [BN, BLOCK_K]
        a = _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K)
        wk = _scaled(vk, am_rows, k0, K, BS, BLOCK_N, BLOCK_K).to(a.dtype)
        acc = tl.dot(a, tl.trans(wk), acc, input_precision=DOT_PRECISION)
    _store_tile(y_ptr, acc, offs_m, m_mask, offs_n, n_mask, stride_ym)


@triton.jit
def _dequant_nf4_kernel(qw_ptr, am_ptr, lut_ptr, y_ptr, N, K, stride_qn, stride_an, stride_yn, BS: tl.constexpr,
                        LUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """``y[n, k] = lut[q[n, k]] * absmax[n, k // BS]`` (fp32, rounded once to y's dtype); BLOCK_W words of 8 codes
    along K per program (K a multiple of 8 * BLOCK_W)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    kw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    t = _tables(lut_ptr, LUT)
    wd = tl.load(qw_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_qn // 4) + kw[None, :])
    v = _decode8(wd, t, LUT)
    vk = _join8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7])
    k0 = tl.program_id(1) * (8 * BLOCK_W)
    w = _scaled(vk, am_ptr + rows[:, None] * stride_an, k0, K, BS, BLOCK_N, 8 * BLOCK_W)
    offs_k = k0 + tl.arange(0, 8 * BLOCK_W)
    tl.store(y_ptr + rows[:, None] * stride_yn + offs_k[None, :], w.to(y_ptr.dtype.element_ty), mask=n_mask[:, None])


def _words_ok(w: NF4Weight) -> bool:
    """The kernels read 4-byte words of whole 32-code groups; other weights (K not a multiple of 32, rows not 4-byte
    aligned) take the reference."""
    q = w.qweight
    return w.shape[1] % 32 == 0 and q.stride(1) == 1 and q.stride(0) % 4 == 0 and q.data_ptr() % 4 == 0


def dequant_nf4_triton(w: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """``w.dequantize(dtype)`` (fp32 / fp16 / bf16; another dtype raises ``TypeError``) in one pass, on ``w``'s
    device."""
    if dtype not in _FLOATS:
        raise TypeError(f"dequant_nf4_triton: dtype must be torch.float32, float16 or bfloat16, got {dtype}")
    if not _words_ok(w):
        return w.dequantize(dtype)
    n, k = w.shape
    y = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    block_w = 4 if _INTERPRET else (16 if k % 128 == 0 else 4)
    bn = 8 if _INTERPRET else 32
    grid = (triton.cdiv(n, bn), k // (8 * block_w))
    _dequant_nf4_kernel[grid](w.qweight, w.absmax, w.codebook, y, n, k, w.qweight.stride(0), w.absmax.stride(0),
                              y.stride(0), BS=w.blocksize, LUT=0 if _INTERPRET else 2, BLOCK_N=bn, BLOCK_W=block_w)
    return y


def _run_mma(x: torch.Tensor, w: NF4Weight) -> torch.Tensor | None:
    """MODE 9's product when it takes this call (:data:`MMA_ROWS`, :func:`cuda_mma.available`, a weight it can
    repack, the kernel compiles), else None. The repack and the byte tables are made on the first eager call and kept
    while the weight lives (none during a CUDA-graph capture: the Triton kernels then take the call)."""
    lo, hi = MMA_ROWS
    m = x.shape[0]
    if not (MMA and wo_gemv.REPACK and lo <= m <= hi and CM.nf4_ok(w) and CM.available(x)):
        return None
    if not CM.compiles("nf4", x.dtype, x.device, m > 8):
        return None
    p = packed(w.qweight, ("mode9-nf4",), lambda: CM.repack_nf4(w))
    tables = packed(w.qweight, ("mode9-nf4-tables", x.dtype), lambda: CM.lut_tables(w.codebook, x.dtype))
    if p is None or tables is None:
        return None
    return CM.matmul(x, "nf4", p[0], p[1], w.shape[0], w.shape[1], tables=tables)


def nf4_words(w: NF4Weight) -> torch.Tensor:
    """The codes of ``w`` as int32 words ``[N, K / 8]`` in the GEMV's interleaved layout (within each group of 32
    codes, word ``i`` holds codes ``i + 4j`` at bits ``4j``; the FP4 GEMV's layout)."""
    from .fp4 import unpack_nibbles

    return interleave_words(unpack_nibbles(w.qweight), bits=4, ilv_codes=32)


def nf4_matmul_triton(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.nf4_matmul`` on CUDA: ``x [M, K]`` (fp32 / fp16 / bf16) ``@ dequant(w)^T (+ bias)`` -> ``[M, N]`` in
    ``x.dtype`` (module docstring). Arguments are checked by the op; K not a multiple of 32 takes the reference."""
    m, k = x.shape
    n = w.shape[0]
    if not _words_ok(w):
        return naive.nf4_matmul_ref(x, w, bias)
    qw, am, book = w.qweight, w.absmax.contiguous(), w.codebook.contiguous()
    half = x.dtype in (torch.float16, torch.bfloat16)
    if m >= DEQUANT_M_MIN and half:
        return F.linear(x, dequant_nf4_triton(w, x.dtype), None if bias is None else bias.to(x.dtype))
    x = x.contiguous()
    y = None if _INTERPRET or m == 0 else _run_mma(x, w)
    if y is not None:
        return y if bias is None else (y.float() + bias.float()).to(x.dtype)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    lut = 1 if half and not _INTERPRET else 0
    words = _ilv_cached(qw, lambda: nf4_words(w)) if m <= GEMV_M_MAX and w.blocksize % 32 == 0 else None
    if words is not None:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _nf4_gemv_kernel[grid](x, words, am, book, y, m, n, k, x.stride(0), words.stride(0), am.stride(0),
                               y.stride(0), BS=w.blocksize, LUT=lut, MR=triton.next_power_of_2(m))
    else:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _nf4_kernel[grid](x, qw, am, book, y, m, n, k, _m_bucket(m), x.stride(0), qw.stride(0), am.stride(0),
                          y.stride(0), BS=w.blocksize, LUT=lut, DOT_PRECISION=_dot_precision(x.dtype))
    return y if bias is None else (y.float() + bias.float()).to(x.dtype)
