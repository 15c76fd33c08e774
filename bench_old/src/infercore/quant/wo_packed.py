"""MODE 4's packed fp16 dot (INT4 and FP8 weights, M <= 4 rows of 16-bit activations) and the activation
loads MODE 4 shares with it: one inline-PTX block per step decodes a thread's 4 words once for all rows
(``_packed_rows``, used by ``wo_gemv._gemv4_tile``; CPU tests run the PTX through ``_packed_asm``'s text).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gemv4_x(x_ptr, row, k, K, XMASK: tl.constexpr):
    """``x[row, k]`` as fp32 for code positions ``k [1, BLOCK_KW]`` (2-D, so the load lands in the
    weight tile's layout); XMASK: some ``k`` may be >= K (weights padded past K)."""
    if XMASK:
        f = tl.load(x_ptr + row + k, mask=k < K, other=0)
    else:
        f = tl.load(x_ptr + row + k)
    return f.to(tl.float32)


# PACKED MODE 4 (INT4 and FP8, M <= 4): a thread's 4 consecutive words decoded into packed fp16 pairs and
# multiplied with packed FMAs into one fp16x2 sum per row, 16 (INT4) / 8 (FP8) products per lane; the lanes add
# in fp32. The activations are fp16 pairs scaled by a power of two per 4 words and row (``_x_pow2``).
#   INT4: one LOP3 per pair puts q under the exponent of 64 or of 4 (64 + q / 16, 4 + q / 16: exact; one shift
#         per word), one packed subtract of the same with z gives (q - z) / 16 exactly.
#   FP8 : the e4m3 byte's sign to bit 15 of a half, its other 7 bits to bits 7-13: the value times 2**-8, exact
#         (bytes 1 and 3 sit at the halves' tops already; bytes 0 and 2 are shifted there).
# One asm block decodes a word once for all rows.
_PK_WORDS = 4  # words per packed step: a thread's own, of one scale group


def _packed_asm(fp8: bool, rows: int) -> str:
    """The packed dot's PTX over a step's ``_PK_WORDS`` words and ``rows`` rows. Operands: ``$0 .. $(rows - 1)``
    the fp32 sums, then the words, then each row's fp16x2 activation pairs, word by word (INT4: pairs ``j = 0..3`` of
    codes ``j``, ``j + 4``; FP8: bytes 1 and 3, then bytes 0 and 2), then for INT4 the zero pairs of nibbles
    at bits 0-3 (``64 + z / 16``) and 4-7 (``4 + z / 16``) of each half. A nibble at bits 4-7 needs no shift:
    under the exponent of 4 its place value is already 1/16."""
    per, words = (2 if fp8 else 4), _PK_WORDS
    w0, x0 = rows, rows + words
    mz0, mz1 = f"${x0 + rows * words * per}", f"${x0 + rows * words * per + 1}"
    acc = ["a"] if rows == 1 else [f"a{r}" for r in range(rows)]
    lines = ["{", f".reg .b32 t, v, {', '.join(acc)}{', s' if fp8 else ''};", ".reg .b16 lo, hi;",
             ".reg .f32 flo, fhi;"]
    for i in range(words):
        w = f"${w0 + i}"
        if fp8:
            steps = [[f"shr.u32 t, {w}, 1;", f"and.b32 s, {w}, 0x80008000;"],
                     [f"shl.b32 t, {w}, 7;", f"shl.b32 s, {w}, 8;", "and.b32 s, s, 0x80008000;"]]
            steps = [pre + ["lop3.b32 v, t, 0x3F803F80, s, 0xEA;"] for pre in steps]
        else:
            steps = []
            for j in range(4):
                src, (mask, magic, mz) = (w if j < 2 else "t"), (("0x000F000F", "0x54005400", mz0) if j % 2 == 0
                                                                else ("0x00F000F0", "0x44004400", mz1))
                steps.append([f"lop3.b32 v, {src}, {mask}, {magic}, 0xEA;", f"sub.rn.f16x2 v, v, {mz};"])
            lines.append(f"shr.u32 t, {w}, 8;")
        for j, step in enumerate(steps):
            lines += step
            for r, a in enumerate(acc):
                x = f"${x0 + (r * words + i) * per + j}"
                lines.append(f"mul.rn.f16x2 {a}, v, {x};" if i == j == 0 else f"fma.rn.f16x2 {a}, v, {x}, {a};")
    for r, a in enumerate(acc):
        lines += [f"mov.b32 {{lo, hi}}, {a};", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;",
                  f"add.f32 ${r}, flo, fhi;"]
    lines.append("}")
    return "\n".join(lines)


_PK_I4_1 = tl.constexpr(_packed_asm(False, 1))

_PK_I4_2 = tl.constexpr(_packed_asm(False, 2))

_PK_I4_4 = tl.constexpr(_packed_asm(False, 4))

_PK_F8_1 = tl.constexpr(_packed_asm(True, 1))

_PK_F8_2 = tl.constexpr(_packed_asm(True, 2))

_PK_F8_4 = tl.constexpr(_packed_asm(True, 4))


def _packed_cons(fp8: bool, rows: int) -> str:
    """The asm's constraints: the fp32 sums, then the words, the pairs (16 / 8 a row), INT4's zero pairs."""
    return ",".join(["=f"] * rows + ["r"] * (_PK_WORDS * (1 + rows * (2 if fp8 else 4)) + (0 if fp8 else 2)))


_PKC_I4_1, _PKC_I4_2, _PKC_I4_4 = (tl.constexpr(_packed_cons(False, r)) for r in (1, 2, 4))

_PKC_F8_1, _PKC_F8_2, _PKC_F8_4 = (tl.constexpr(_packed_cons(True, r)) for r in (1, 2, 4))


@triton.jit
def _split4(t):
    """``t [R, C]`` -> 4 tensors ``[R, C / 4]``: elements ``4 i + p`` for ``p < 4`` (a thread's own words)."""
    e, o = tl.split(tl.reshape(t, [t.shape[0], t.shape[1] // 4, 2, 2]))
    a, c = tl.split(e)
    b, d = tl.split(o)
    return a, b, c, d


@triton.jit
def _absmax4(x):
    a, b, c, d = _split4(x)
    return tl.maximum(tl.maximum(tl.abs(a), tl.abs(b)), tl.maximum(tl.abs(c), tl.abs(d)))


@triton.jit
def _pairs4(lo, hi, sc):
    """fp16x2 pairs ``(lo * sc, hi * sc)`` of each of the 4 word columns (``_split4``) of ``lo``, ``hi``."""
    l0, l1, l2, l3 = _split4(lo)
    h0, h1, h2, h3 = _split4(hi)
    return _f16x2(l0 * sc, h0 * sc), _f16x2(l1 * sc, h1 * sc), _f16x2(l2 * sc, h2 * sc), _f16x2(l3 * sc, h3 * sc)


@triton.jit
def _x_pow2(mx):
    """For the largest |x| ``mx`` of a 4-word step: the power of two bringing it into [2**10, 2**11) and its
    inverse (``2**(137 - e)`` for the biased exponent ``e >= 11``). fp16 then holds every x of the step to
    2**-24 of that max, and the products per lane stay below 2**15 (INT4: 16 of |q - z| / 16 < 1; FP8: 8 of
    |e4m3| * 2**-8 <= 1.75)."""
    e = tl.maximum((mx.to(tl.int32, bitcast=True) >> 23) & 0xFF, 11)
    return ((264 - e) << 23).to(tl.float32, bitcast=True), ((e - 10) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _int4_row(x_ptr, row, k, K, ILV: tl.constexpr, XMASK: tl.constexpr):
    """A row's activations for INT4's packed step: 16 fp16x2 pairs (word-major) and the inverse scale."""
    xa = _gemv4_x(x_ptr, row, k, K, XMASK)
    xb = _gemv4_x(x_ptr, row, k + ILV, K, XMASK)
    xc = _gemv4_x(x_ptr, row, k + ILV * 2, K, XMASK)
    xd = _gemv4_x(x_ptr, row, k + ILV * 3, K, XMASK)
    xe = _gemv4_x(x_ptr, row, k + ILV * 4, K, XMASK)
    xf = _gemv4_x(x_ptr, row, k + ILV * 5, K, XMASK)
    xg = _gemv4_x(x_ptr, row, k + ILV * 6, K, XMASK)
    xh = _gemv4_x(x_ptr, row, k + ILV * 7, K, XMASK)
    sc, inv = _x_pow2(tl.maximum(tl.maximum(tl.maximum(_absmax4(xa), _absmax4(xb)),
                                            tl.maximum(_absmax4(xc), _absmax4(xd))),
                                 tl.maximum(tl.maximum(_absmax4(xe), _absmax4(xf)),
                                            tl.maximum(_absmax4(xg), _absmax4(xh)))))
    a0, a1, a2, a3 = _pairs4(xa, xe, sc)  # pair 0 (codes 0, 4) of words 0..3
    b0, b1, b2, b3 = _pairs4(xb, xf, sc)
    c0, c1, c2, c3 = _pairs4(xc, xg, sc)
    d0, d1, d2, d3 = _pairs4(xd, xh, sc)
    return a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3, inv


@triton.jit
def _fp8_row(x_ptr, row, k, K, ILV: tl.constexpr, XMASK: tl.constexpr):
    """A row's activations for FP8's packed step: 8 fp16x2 pairs (word-major: bytes 1 and 3, then 0 and 2)
    and the inverse scale."""
    x0 = _gemv4_x(x_ptr, row, k, K, XMASK)
    x1 = _gemv4_x(x_ptr, row, k + ILV, K, XMASK)
    x2 = _gemv4_x(x_ptr, row, k + ILV * 2, K, XMASK)
    x3 = _gemv4_x(x_ptr, row, k + ILV * 3, K, XMASK)
    sc, inv = _x_pow2(tl.maximum(tl.maximum(_absmax4(x0), _absmax4(x1)), tl.maximum(_absmax4(x2), _absmax4(x3))))
    b0, b1, b2, b3 = _pairs4(x1, x3, sc)
    a0, a1, a2, a3 = _pairs4(x0, x2, sc)
    return b0, a0, b1, a1, b2, a2, b3, a3, inv


@triton.jit
def _row_pairs(x_ptr, row, k, K, FP8: tl.constexpr, ILV: tl.constexpr, XMASK: tl.constexpr):
    """``_fp8_row`` or ``_int4_row``: the row's fp16x2 pairs, then the inverse scale."""
    if FP8:
        p = _fp8_row(x_ptr, row, k, K, ILV, XMASK)
    else:
        p = _int4_row(x_ptr, row, k, K, ILV, XMASK)
    return p


@triton.jit
def _packed_rows(w, x_ptr, k, K, M, stride_xm, s, mz, mz1, a0, a1, a2, a3, FP8: tl.constexpr, ILV: tl.constexpr,
                 XMASK: tl.constexpr, BLOCK_M: tl.constexpr):
    """``a_r += s * sum_k c_k x[r, k]`` over each 4 consecutive words of ``w [R, C]`` for rows ``r < BLOCK_M``
    (rows past M re-read row M - 1), in one ``_packed_asm`` block per step: INT4 (``c = (q - z) / 16``; int32
    words of 8 codes, nibble ``j`` at bits ``4 j``, one group; ``mz`` / ``mz1 [R, C / 4]`` the fp16x2 pairs of
    ``64 + z / 16`` / ``4 + z / 16``) or FP8 (``c = e4m3 * 2**-8``; words of 4 bytes; ``mz``, ``mz1`` unused).
    ``s [R, C / 4]`` the group / block scales (FP8 per-channel: 1)."""
    NP: tl.constexpr = 8 if FP8 else 16  # fp16x2 activation pairs per row and step
    ws = _split4(w)
    p = _row_pairs(x_ptr, 0, k, K, FP8, ILV, XMASK)
    ops = ws + p[:NP]
    if BLOCK_M > 1:
        q = _row_pairs(x_ptr, tl.minimum(1, M - 1) * stride_xm, k, K, FP8, ILV, XMASK)
        ops = ops + q[:NP]
    if BLOCK_M > 2:
        u = _row_pairs(x_ptr, tl.minimum(2, M - 1) * stride_xm, k, K, FP8, ILV, XMASK)
        v = _row_pairs(x_ptr, tl.minimum(3, M - 1) * stride_xm, k, K, FP8, ILV, XMASK)
        ops = ops + u[:NP] + v[:NP]
    if not FP8:
        ops = ops + (mz, mz1)
    if BLOCK_M == 1:
        r0 = tl.inline_asm_elementwise(_PK_F8_1 if FP8 else _PK_I4_1, _PKC_F8_1 if FP8 else _PKC_I4_1, ops,
                                       dtype=tl.float32, is_pure=True, pack=1)
    elif BLOCK_M == 2:
        r0, r1 = tl.inline_asm_elementwise(_PK_F8_2 if FP8 else _PK_I4_2, _PKC_F8_2 if FP8 else _PKC_I4_2, ops,
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        a1 += r1 * (s * q[NP])
    else:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(_PK_F8_4 if FP8 else _PK_I4_4, _PKC_F8_4 if FP8 else _PKC_I4_4, ops,
                                                   dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                   is_pure=True, pack=1)
        a1 += r1 * (s * q[NP])
        a2 += r2 * (s * u[NP])
        a3 += r3 * (s * v[NP])
    a0 += r0 * (s * p[NP])
    return a0, a1, a2, a3


@triton.jit
def _f16x2(lo, hi):
    """fp32 ``lo``, ``hi`` as one fp16x2 register (int32; ``lo`` in the low half)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True,
                                     pack=1)
