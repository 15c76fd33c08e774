"""MODE 4: the CUDA-core weight-only GEMV over int32 words (INT4 / INT8 / FP8 weights, M <= 4 rows).

The weights are repacked once into interleaved words (``interleave_words``, cached beside the weight by
``_ilv_cached``), streamed with 16-byte loads, decoded per code into fp32 (or, ``PACKED``, by the packed
fp16 dot of ``wo_packed``), and reduced once per thread; split-K is finished inside the kernel by the last
program of each tile (``_gemv_finish``, shared with MODE 5). ``_launch_gemv4`` is the host side.
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from ..ops.linear.triton import ACTIVATIONS, _act_mul
from ..ops.pdl import GEMV_PREWAIT, pdl_enabled, pdl_launch, pdl_release, pdl_wait
from ._splitk import arrival_counters
from .wo_packed import _gemv4_x, _packed_rows
from .wo_tiles import _INTERPRET, _num_sms

# ----------------------------------------------------------------------------------------------
# MODE 4: streaming word GEMV (M <= 4): few channels per program, long K tiles, software-pipelined
# ----------------------------------------------------------------------------------------------
# Why a CUDA-core kernel: at M = 1 the tl.dot modes waste the tensor cores on one row. Each thread
# keeps a private accumulator per (row, word) it owns for the whole K loop; lanes are reduced once.
# (An earlier word GEMV over the stored byte order, 128 channels x one group per tile, had its
# 16-byte loads split into 4-byte ones by a per-word mask and measured 1.2-1.4x slower; removed.)
# MODE 4 is the layout of the bf16 skinny GEMV (ops.linear), which streams at the copy bandwidth:
# BLOCK_N channels (clamped into range, so full tiles need no mask) x BLOCK_KW words spanning many
# groups, 16-byte loads, the K loop pipelined by Triton (num_stages), per-word scales gathered from
# L1. Codes become floats without a convert or a subtract: the code goes into the top mantissa bits
# of 1.0, ``1 + q / 2**BITS`` (exact), and ``sum_k (q - z) x = 2**BITS * (sum_k v x - c sum_k x)``
# with ``c = 1 + z / 2**BITS`` is applied once per word; per code that is a shift, one mask-or and
# one FMA. The high half of each int4 word is shifted down once so every per-code shift is a left
# shift (which the compiler may issue on the FMA pipe). With PDL the first two tiles are loaded before
# the wait (``ops.pdl.GEMV_PREWAIT``) and decoded ahead of the loop. FP8 batch-1 step, with the bf16 GEMV
# and MODE 6 doing the same: none vs one tile 2.737 -> 2.607 ms, one vs two 2.622 -> 2.562 (two calls;
# results/h200/sweeps/probe_bs1_gemv_prewait_{peel,tiles}.json).


# Up to this many rows MODE 4 (the CUDA-core GEMV over int32 words) can run.
GEMV_M_MAX = 4


@triton.jit
def _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N,
                 SPLIT_K: tl.constexpr, NSPLIT: tl.constexpr):
    """Store ``acc [BLOCK_M, BLOCK_N]``; with split-K the last program of a column tile to arrive
    sums the fp32 partials (no second launch: at decode a launch costs as much as the GEMV)."""
    pid_n = tl.program_id(0)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K:
        pid_k = tl.program_id(1)
        mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + mn, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == NSPLIT - 1:
            tot = tl.zeros_like(acc)
            for s in tl.static_range(NSPLIT):  # unrolled: every split's load in flight at once
                tot += tl.load(ws_ptr + s * M * N + mn, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            # ready for the next launch (graph replays too); the launch's end publishes it
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_zeros(BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Four per-thread fp32 accumulators ``[BLOCK_N, BLOCK_KW]``, one per row."""
    return (tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32), tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32),
            tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32), tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32))


@triton.jit
def _gemv_add(a0, a1, a2, a3, p0, p1, p2, p3, s, BLOCK_M: tl.constexpr, SCALED: tl.constexpr):
    """``a_r += p_r * s`` (``a_r += p_r`` unless SCALED) for the rows ``r < BLOCK_M``."""
    if SCALED:
        a0 += p0 * s
        if BLOCK_M > 1:
            a1 += p1 * s
        if BLOCK_M > 2:
            a2 += p2 * s
            a3 += p3 * s
    else:
        a0 += p0
        if BLOCK_M > 1:
            a1 += p1
        if BLOCK_M > 2:
            a2 += p2
            a3 += p3
    return a0, a1, a2, a3


@triton.jit
def _gemv_rows(a0, a1, a2, a3, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row sums of the per-thread accumulators as ``[BLOCK_M, BLOCK_N]``, with the row offsets and mask."""
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = tl.where(offs_m[:, None] == 0, tl.sum(a0, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 1, tl.sum(a1, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 2, tl.sum(a2, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 3, tl.sum(a3, axis=1)[None, :], acc)
    return acc, offs_m, offs_m < M


@triton.jit
def _gemv4_fma(p0, p1, p2, p3, x0, x1, x2, x3, v, x_ptr, k, K, M, stride_xm, XMASK: tl.constexpr,
               XSUM: tl.constexpr, BLOCK_M: tl.constexpr):
    """``p_r += v * x[r, k]`` for rows ``r < BLOCK_M`` (rows past M re-read row M - 1; the store masks
    them); XSUM: also ``x_r += x[r, k]`` (the per-word activation sums of the INT decode)."""
    xv = _gemv4_x(x_ptr, 0, k, K, XMASK)
    p0 += v * xv
    if XSUM:
        x0 += xv
    if BLOCK_M > 1:
        xv = _gemv4_x(x_ptr, tl.minimum(1, M - 1) * stride_xm, k, K, XMASK)
        p1 += v * xv
        if XSUM:
            x1 += xv
    if BLOCK_M > 2:
        xv = _gemv4_x(x_ptr, tl.minimum(2, M - 1) * stride_xm, k, K, XMASK)
        p2 += v * xv
        xv3 = _gemv4_x(x_ptr, tl.minimum(3, M - 1) * stride_xm, k, K, XMASK)
        p3 += v * xv3
        if XSUM:
            x2 += xv
            x3 += xv3
    return p0, p1, p2, p3, x0, x1, x2, x3


@triton.jit
def _gemv4_add(a0, a1, a2, a3, p0, p1, p2, p3, x0, x1, x2, x3, c, s, BLOCK_M: tl.constexpr):
    """``a_r += (p_r - c * x_r) * s`` for the rows ``r < BLOCK_M``."""
    a0 += (p0 - c * x0) * s
    if BLOCK_M > 1:
        a1 += (p1 - c * x1) * s
    if BLOCK_M > 2:
        a2 += (p2 - c * x2) * s
        a3 += (p3 - c * x3) * s
    return a0, a1, a2, a3


@triton.jit
def _word_load(ptrs, kw, kw_end, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """Per-word values ``[BLOCK_N, BLOCK_KW]`` at ``ptrs``; unless EVEN, words at or past ``kw_end``
    read 0 (their codes, scales and zero points then contribute nothing)."""
    if EVEN:
        if EVICT:  # the weights, streamed once per call
            v = tl.load(ptrs, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs)
    else:
        if EVICT:
            v = tl.load(ptrs, mask=(kw < kw_end)[None, :], other=0, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs, mask=(kw < kw_end)[None, :], other=0)
    return v


@triton.jit
def _gemv4_tile(w, kw, kw_end, x_ptr, s_rows, z_rows, a0, a1, a2, a3, K, M, stride_xm, FP8: tl.constexpr,
                BITS: tl.constexpr, ILV: tl.constexpr, SCALE_WORDS: tl.constexpr, SCALE_ROWS: tl.constexpr,
                HAS_ZEROS: tl.constexpr, EVEN: tl.constexpr, XMASK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, PACKED: tl.constexpr = False):
    """One K tile of MODE 4: the loaded words ``w [BLOCK_N, BLOCK_KW]`` at word positions ``kw``, decoded
    and multiplied into the per-thread accumulators ``a_r`` (see ``_gemv4_kernel``). PACKED: ``_packed_rows`` in
    packed fp16 instead of one fp32 FMA per code and row."""
    CPW: tl.constexpr = 32 // BITS
    FIELD: tl.constexpr = ((1 << BITS) - 1) << (23 - BITS)  # the top BITS mantissa bits
    k = ((kw // ILV) * (ILV * CPW) + kw % ILV)[None, :]  # K position of each word's code 0
    p0, p1, p2, p3 = _gemv_zeros(BLOCK_N, BLOCK_KW)
    x0, x1, x2, x3 = _gemv_zeros(1, BLOCK_KW)
    if PACKED:  # a thread's 4 consecutive words share one scale group (SCALE_WORDS % 4 == 0)
        kwp = tl.max(tl.reshape(kw, [BLOCK_KW // 4, 4]), axis=1)
        g = (kwp // SCALE_WORDS)[None, :]
        if FP8:
            if SCALE_ROWS != 0:
                s = _word_load(s_rows + g, kwp, kw_end, EVEN, False).to(tl.float32)
            else:  # per-channel scales, after the K loop
                s = tl.full([1, BLOCK_KW // 4], 1.0, tl.float32)
            a0, a1, a2, a3 = _packed_rows(w, x_ptr, k, K, M, stride_xm, s, 0, 0, a0, a1, a2, a3, True, ILV, XMASK,
                                          BLOCK_M)
        else:
            s = _word_load(s_rows + g, kwp, kw_end, EVEN, False).to(tl.float32)
            if HAS_ZEROS:  # 64 + z / 16 and 4 + z / 16 in both halves (integer zero points 0..15)
                zi = _word_load(z_rows + g, kwp, kw_end, EVEN, False).to(tl.int32) * 65537
                mz = 0x54005400 | zi
                mz1 = 0x44004400 | (zi << 4)
            else:
                mz = tl.full([BLOCK_N, BLOCK_KW // 4], 0x54085408, tl.int32)
                mz1 = tl.full([BLOCK_N, BLOCK_KW // 4], 0x44804480, tl.int32)
            a0, a1, a2, a3 = _packed_rows(w, x_ptr, k, K, M, stride_xm, s, mz, mz1, a0, a1, a2, a3, False, ILV,
                                          XMASK, BLOCK_M)
    elif FP8:
        for j in tl.static_range(4):
            # byte j to the top, arithmetic shift by 4, mask: the fp32 pattern of e4m3 * 2**-120
            if j < 3:
                t = w << (24 - 8 * j)
            else:
                t = w
            v = ((t >> 4) & -2014314496).to(tl.float32, bitcast=True)  # mask 0x87F00000
            p0, p1, p2, p3, x0, x1, x2, x3 = _gemv4_fma(p0, p1, p2, p3, x0, x1, x2, x3, v, x_ptr, k + ILV * j,
                                                        K, M, stride_xm, XMASK, False, BLOCK_M)
        if SCALE_ROWS != 0:
            s = _word_load(s_rows + (kw // SCALE_WORDS)[None, :], kw, kw_end, EVEN, False)
            a0, a1, a2, a3 = _gemv_add(a0, a1, a2, a3, p0, p1, p2, p3, s, BLOCK_M, True)
        else:
            a0, a1, a2, a3 = _gemv_add(a0, a1, a2, a3, p0, p1, p2, p3, 1.0, BLOCK_M, False)
    else:
        w = w.to(tl.uint32, bitcast=True)
        hi = w >> 16
        for j in tl.static_range(CPW):
            # code j into the top mantissa bits of 1.0: v = 1 + q / 2**BITS exactly
            if BITS * j < 16:
                t = w << (23 - BITS - BITS * j)
            else:
                t = hi << (23 - BITS - (BITS * j - 16))
            v = ((t & FIELD) | 0x3F800000).to(tl.float32, bitcast=True)
            p0, p1, p2, p3, x0, x1, x2, x3 = _gemv4_fma(p0, p1, p2, p3, x0, x1, x2, x3, v, x_ptr, k + ILV * j,
                                                        K, M, stride_xm, XMASK, True, BLOCK_M)
        g = (kw // SCALE_WORDS)[None, :]
        s = _word_load(s_rows + g, kw, kw_end, EVEN, False).to(tl.float32)
        # sum_k (q - z) x = 2**BITS * (sum_k v x - c * sum_k x), c = 1 + z / 2**BITS (2**BITS after the loop)
        if HAS_ZEROS:
            c = 1.0 + _word_load(z_rows + g, kw, kw_end, EVEN, False).to(tl.float32) * (1.0 / (1 << BITS))
        else:
            c = 1.0 + (2 ** (BITS - 1)) / (1 << BITS)
        a0, a1, a2, a3 = _gemv4_add(a0, a1, a2, a3, p0, p1, p2, p3, x0, x1, x2, x3, c, s, BLOCK_M)
    return a0, a1, a2, a3


@triton.jit
def _gemv4_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, ws_ptr, y_ptr, cnt_ptr,
    M, N, K, KW, kw_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym,
    FP8: tl.constexpr, BITS: tl.constexpr, ILV: tl.constexpr, SCALE_WORDS: tl.constexpr,
    SCALE_ROWS: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
    XMASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    ACT: tl.constexpr = 0, PREWAIT: tl.constexpr = 0, USE_PDL: tl.constexpr = False, PACKED: tl.constexpr = False,
    NSPLIT: tl.constexpr = 1,
):
    """MODE 4 GEMV, ``M <= 4``: ``qw`` int32 words ``[N, KW]`` in the interleaved layout of
    ``_ilv_words`` (word ``i`` of each block of ``ILV`` words holds codes ``i + ILV * j`` at bits
    ``BITS * j``), so code ``j`` of consecutive words is consecutive in K and x loads are vectors.

    INT (``FP8`` False): scales ``[N, *]`` (one per ``SCALE_WORDS`` words), zero points likewise or
    ``2**(BITS-1)``. FP8: e4m3 bytes; ``SCALE_ROWS`` 0: per-channel scales ``[N]`` applied after the
    K loop; else ``[cdiv(N, SCALE_ROWS), *]`` block scales, one per ``SCALE_WORDS`` words.
    Grid ``(cdiv(N, BLOCK_N), split)``; ``EVEN``: every split is whole tiles of ``BLOCK_KW`` words;
    ``XMASK``: the weights are padded past K.

    ``ACT`` (``ops.linear.triton.ACTIVATIONS``; no split-K): ``qw`` is a merged ``[gate; up]`` weight
    (``N = 2D``), a program streams gate row ``c`` and up row ``D + c`` side by side, and ``y [M, D]``
    gets ``act(gate) * up`` (the gated-MLP epilogue, as in ``ops.linear``'s GEMV).
    """
    pdl_release(USE_PDL)
    r = tl.arange(0, BLOCK_N)
    if ACT != 0:
        c_out = tl.program_id(0) * (BLOCK_N // 2) + r // 2
        rows = tl.minimum(c_out, N // 2 - 1) + (r % 2) * (N // 2)
        offs_n = rows
        n_mask = c_out < N // 2
    else:
        offs_n = tl.program_id(0) * BLOCK_N + r
        n_mask = offs_n < N
        rows = tl.minimum(offs_n, N - 1)  # clamped: full tiles need no mask
    kw_start = tl.program_id(1) * kw_per_split
    kw_end = tl.minimum(kw_start + kw_per_split, KW)
    offs_kw = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_KW), BLOCK_KW), BLOCK_KW)
    w_rows = qw_ptr + rows.to(tl.int64)[:, None] * stride_qn
    # PREWAIT (with PDL): the first 1 or 2 tiles' weights stream in while the previous kernel finishes.
    # A second tile past the split's end is read at the last whole tile instead (EVEN) or masked, and
    # never consumed.
    if PREWAIT >= 1:
        w_first = _word_load(w_rows + (kw_start + offs_kw)[None, :], kw_start + offs_kw, kw_end, EVEN, True)
    if PREWAIT >= 2:
        kw2 = kw_start + BLOCK_KW + offs_kw
        if EVEN:
            kw2 = tl.minimum(kw_start + BLOCK_KW, kw_end - BLOCK_KW) + offs_kw
        w_second = _word_load(w_rows + kw2[None, :], kw2, kw_end, EVEN, True)
    pdl_wait(USE_PDL)
    if FP8 and SCALE_ROWS != 0:
        s_rows = s_ptr + (rows // SCALE_ROWS).to(tl.int64)[:, None] * stride_sn
    else:
        s_rows = s_ptr + rows.to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + rows.to(tl.int64)[:, None] * stride_sn
    a0, a1, a2, a3 = _gemv_zeros(BLOCK_N, BLOCK_KW // 4 if PACKED else BLOCK_KW)  # PACKED: one per 4 words
    kb0 = kw_start
    if PREWAIT >= 1:  # the tiles loaded before the wait are consumed here; the loop takes the rest
        a0, a1, a2, a3 = _gemv4_tile(w_first, kw_start + offs_kw, kw_end, x_ptr, s_rows, z_rows, a0, a1, a2, a3, K, M,
                                     stride_xm, FP8, BITS, ILV, SCALE_WORDS, SCALE_ROWS, HAS_ZEROS, EVEN, XMASK,
                                     BLOCK_M, BLOCK_N, BLOCK_KW, PACKED)
        kb0 = kw_start + BLOCK_KW
    if PREWAIT >= 2:
        if kb0 < kw_end:
            a0, a1, a2, a3 = _gemv4_tile(w_second, kb0 + offs_kw, kw_end, x_ptr, s_rows, z_rows, a0, a1, a2, a3, K,
                                         M, stride_xm, FP8, BITS, ILV, SCALE_WORDS, SCALE_ROWS, HAS_ZEROS, EVEN,
                                         XMASK, BLOCK_M, BLOCK_N, BLOCK_KW, PACKED)
        kb0 = kb0 + BLOCK_KW
    for kb in tl.range(kb0, kw_end, BLOCK_KW):
        kw = kb + offs_kw
        w = _word_load(w_rows + kw[None, :], kw, kw_end, EVEN, True)
        a0, a1, a2, a3 = _gemv4_tile(w, kw, kw_end, x_ptr, s_rows, z_rows, a0, a1, a2, a3, K, M, stride_xm, FP8, BITS,
                                     ILV, SCALE_WORDS, SCALE_ROWS, HAS_ZEROS, EVEN, XMASK, BLOCK_M, BLOCK_N, BLOCK_KW,
                                     PACKED)
    acc, offs_m, m_mask = _gemv_rows(a0, a1, a2, a3, M, BLOCK_M, BLOCK_N)
    if FP8:
        if SCALE_ROWS == 0:
            acc = acc * tl.load(s_ptr + rows)[None, :]
        if PACKED:
            acc = acc * 256.0  # the fp16 decode is e4m3 * 2**-8
        else:
            acc = acc * 1.329227995784916e36  # 2**120, exact
    else:
        acc = acc * (1 << BITS)
    if ACT != 0:
        g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        out = _act_mul(g, u, y_ptr, ACT)
        cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & (cols < N // 2)[None, :])
    else:
        _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N, SPLIT_K, NSPLIT)


def _gemv_split(n_tiles: int, kw: int, bkw: int, device: torch.device, split: int) -> tuple[int, int]:
    """Split count and words per split: ~2 programs per SM unless ``split`` is given (> 0)."""
    if split <= 0:
        split = 1
        while split < 16 and n_tiles * split < 2 * _num_sms(device) and kw // (2 * split) >= 4 * bkw:
            split *= 2
    per = triton.cdiv(triton.cdiv(kw, split), bkw) * bkw
    return triton.cdiv(kw, per), per


# Codes per interleave block of the MODE 4 layout (a group smaller than this is its own block).
ILV_CODES = 128

# id(qweight) -> (weak reference to qweight, its MODE 4 words); entries leave with their qweight.
_ILV_CACHE: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def interleave_words(codes: torch.Tensor, bits: int, ilv_codes: int) -> torch.Tensor:
    """Codes ``[N, Kc]`` (ints ``< 2**bits``, ``Kc`` a multiple of ``ilv_codes``) -> int32 words
    ``[N, Kc * bits / 32]`` in the MODE 4 layout: within each block of ``ilv_codes`` codes, word ``i``
    holds codes ``i + (ilv_codes * bits / 32) * j`` at bits ``bits * j``."""
    if bits not in (4, 8):
        raise ValueError(f"bits: must be 4 or 8, got {bits!r}")
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise TypeError(f"codes: expected a 2-D integer tensor, got {getattr(codes, 'shape', type(codes))}")
    cpw = 32 // bits
    n, kc = codes.shape
    if ilv_codes <= 0 or kc % ilv_codes or ilv_codes % cpw:
        raise ValueError(f"codes: {kc} columns do not split into blocks of {ilv_codes} codes of {bits} bits")
    c = codes.to(torch.int64).reshape(n, kc // ilv_codes, cpw, ilv_codes // cpw).transpose(2, 3)
    words = (c << (torch.arange(cpw, device=codes.device, dtype=torch.int64) * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32).reshape(n, -1).contiguous()


# The MODE 4 and MODE 6 repacks keep a second copy of each weight that runs them (0.5 B/param for INT4,
# 1 B/param for INT8/FP8). ``INFERCORE_WO_REPACK=0`` (or setting this False) trades that memory for speed:
# decode-sized calls then take the tensor-core paths (MODE 5, else MODE 2) on the stored layout.
REPACK = os.environ.get("INFERCORE_WO_REPACK", "1") != "0"


def _ilv_cached(qweight: torch.Tensor, make) -> torch.Tensor | None:
    """The MODE 4 words of ``qweight`` (made once, kept while ``qweight`` lives); None when repacking is
    off (:data:`REPACK`) and none exist, or while a CUDA graph is being captured and they were not made
    yet (the capture must not allocate them)."""
    key = id(qweight)
    hit = _ILV_CACHE.get(key)
    if hit is not None and hit[0]() is qweight:
        return hit[1]
    if not REPACK or (qweight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    words = make()
    _ILV_CACHE[key] = (weakref.ref(qweight), words)
    weakref.finalize(qweight, _ILV_CACHE.pop, key, None)
    return words


def _pad_codes(codes: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -codes.shape[1] % multiple
    return torch.nn.functional.pad(codes, (0, pad)) if pad else codes


# MODE 4's packed fp16 dot (``_packed_rows``) where it can run: 16-bit activations, CUDA,
# not the interpreter (inline PTX), scale groups of whole 4-word steps. By default where the H200 measured it
# faster (PACKED_DEFAULT: kind, BLOCK_M); a config's "PACKED" overrides; ``INFERCORE_WO_PACKED=0`` turns the
# default off.
PACKED_DOT = os.environ.get("INFERCORE_WO_PACKED", "1") != "0"

PACKED_DEFAULT = {("int4", 1), ("int4", 2), ("fp8", 1), ("fp8", 2)}


def _packed_ok(x: torch.Tensor, meta: dict) -> bool:
    return ((meta["FP8"] or meta["BITS"] == 4) and meta["SCALE_WORDS"] % 4 == 0 and x.shape[0] <= GEMV_M_MAX
            and x.is_cuda and not _INTERPRET and x.dtype in (torch.bfloat16, torch.float16))


def _launch_gemv4(x: torch.Tensor, words: torch.Tensor, n: int, cfg: dict, s: torch.Tensor, z: torch.Tensor,
                  stride_sn: int, act: str | None = None, **meta) -> torch.Tensor:
    """Run the MODE 4 GEMV; ``cfg["BLOCK_K"]`` counts codes per tile. With ``act`` the gated
    epilogue (``[M, n // 2]``; one K split, BLOCK_N rounded up to even)."""
    m, k = x.shape
    kw = words.shape[1]
    cpw = 32 // meta["BITS"]
    bn = cfg["BLOCK_N"]
    bkw = max(4, cfg["BLOCK_K"] // cpw)
    if act is not None:  # a program owns bn // 2 gate/up row pairs, all of K
        bn += bn % 2
        tiles, n_out = triton.cdiv(n // 2, bn // 2), n // 2
        split, per = 1, triton.cdiv(kw, bkw) * bkw
    else:
        tiles, n_out = triton.cdiv(n, bn), n
        split, per = _gemv_split(tiles, kw, bkw, x.device, cfg.get("SPLIT", 0))
        cfg["SPLIT"] = split
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = arrival_counters(x.device, tiles) if split > 1 else y
    even = kw % per == 0 and per % bkw == 0
    use_pdl = pdl_enabled(x)
    # (PACKED's per-thread step needs 4 consecutive words per thread and row: BLOCK_KW >= 128 x warps)
    block_m = triton.next_power_of_2(m)
    default = PACKED_DOT and ("fp8" if meta["FP8"] else "int4", block_m) in PACKED_DEFAULT
    packed = bool(cfg.get("PACKED", default)) and _packed_ok(x, meta) and bkw >= 128 * cfg["num_warps"]
    _gemv4_kernel[(tiles, split)](
        x, words, s, z, ws, y, cnt, m, n, k, kw, per, x.stride(0), words.stride(0), stride_sn, y.stride(0),
        SPLIT_K=split > 1, NSPLIT=split, EVEN=even, XMASK=(not even) or kw * cpw > k, BLOCK_M=block_m,
        BLOCK_N=bn, BLOCK_KW=bkw, ACT=ACTIVATIONS[act], PREWAIT=GEMV_PREWAIT if use_pdl else 0, PACKED=packed,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1), **meta, **pdl_launch(use_pdl),
    )
    return y
