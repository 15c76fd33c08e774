"""MODE 5: the tensor-core small-M weight-only kernel over the *stored* INT4 / FP8 bytes read as int32 words
(no repack, no extra memory), two codes decoded per instruction; split-K finished in the kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.pdl import pdl_enabled, pdl_launch, pdl_release, pdl_wait
from ._splitk import arrival_counters
from .wo_gemv import _gemv_finish
from .wo_tiles import (
    _chan,
    _dot_precision,
    _group_scale_zero,
    _row,
    _small_setup,
    _tile_dot,
    _tile_dot_acc,
    _x_tile,
)

# ----------------------------------------------------------------------------------------------
# MODE 5: tensor-core small-M kernel decoding stored int32 words two codes per instruction
# ----------------------------------------------------------------------------------------------
#
# The stored weights (INT4 bytes along K, or FP8 e4m3 bytes), read as int32 words, are turned into
# the dot operand with a few integer instructions per *pair* of codes: each 32-bit result holds two
# 16-bit float patterns, and that register is already what the MMA consumes (two K-adjacent
# operand elements), so the compiler emits no repacking. A word holds ``CPW`` codes (8 INT4, 4 FP8),
# ``k = CPW * i + p`` for code position ``p`` of word ``i``; pair ``j`` takes positions ``j`` (low half)
# and ``j + CPW / 2`` (high half):
#   INT4 : ((w >> 4j) & 0x000F000F) | MAGIC   -> MAGIC_BASE + q exactly (one shift, one LOP3;
#          bf16's 7-bit mantissa cannot hold a nibble left at bits 4-7, so every pair shifts)
#   FP8  : the e4m3 byte's sign to bit 15, its other 7 bits under the 16-bit float's exponent LSB
#          (value times 2**-120 in bf16, 2**-8 in fp16; the factor is folded into the scale)
# The activations are permuted to the same order (a register shuffle of a [16, BLOCK_K] tile), so
# the dot is a plain sum over K; INT4 zero points apply per step as ``z * sum(x)`` (no per-weight
# subtract). The main loop at the 128x128 tile is 3.1 (INT4) / 2.7 (FP8) instructions per code against
# 5.1 for MODE 4 and 6-9 for MODE 1/2 (benchmarks/sass_count.py, sm90); the tensor cores make
# M = 1..16 cost about the same. It is latency-bound nonetheless (docs/quantization.md, "Speed").


@triton.jit
def _pair_bits(w, J: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr, MAGIC: tl.constexpr):
    """Pair ``J`` of every word in ``w`` (int32) as two 16-bit float bit patterns in one int32."""
    if FP8:
        if J == 0:  # bytes 0 and 2 move to the top of each half
            t = w << 8
        else:  # bytes 1 and 3 already are
            t = w
        if F16:  # fp16: 7 bits from bit 7 (the value times 2**-8)
            bits = (t & -2147450880) | ((t >> 1) & 0x3F803F80)  # -2147450880 == 0x80008000
        else:  # bf16: 7 bits from bit 4 (the value times 2**-120)
            bits = (t & -2147450880) | ((t >> 4) & 0x07F007F0)
    else:
        bits = ((w >> (4 * J)) & 0x000F000F) | (MAGIC * 65537)
    return bits


@triton.jit
def _unpair(bits, like):
    """int32 ``[R, C]`` of 16-bit pairs -> ``[R, 2C]`` in ``like``'s dtype (low half first)."""
    lo = bits.to(tl.int16).to(like.dtype, bitcast=True)
    hi = (bits >> 16).to(tl.int16).to(like.dtype, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [bits.shape[0], bits.shape[1] * 2])


@triton.jit
def _x_pairs(a, NP: tl.constexpr, BLOCK_M: tl.constexpr, BKW: tl.constexpr):
    """``a [BLOCK_M, BKW * 2 * NP]`` -> NP tensors ``[BLOCK_M, 2 * BKW]``, the activations of each pair
    in the order ``_unpair`` gives (word-major, then low/high half). Returned as a tuple."""
    if NP == 2:
        x0, x1 = tl.split(tl.reshape(a, [BLOCK_M, BKW, 2, 2]))
        r = (tl.reshape(x0, [BLOCK_M, 2 * BKW]), tl.reshape(x1, [BLOCK_M, 2 * BKW]))
    else:
        e, o = tl.split(tl.reshape(a, [BLOCK_M, BKW, 2, 2, 2]))
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        r = (tl.reshape(x0, [BLOCK_M, 2 * BKW]), tl.reshape(x1, [BLOCK_M, 2 * BKW]),
             tl.reshape(x2, [BLOCK_M, 2 * BKW]), tl.reshape(x3, [BLOCK_M, 2 * BKW]))
    return r


@triton.jit
def _words_small_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, ws_ptr, y_ptr, cnt_ptr,
    M, N, K, KW, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym,
    FP8: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,  # FP8: 0 per channel, else the block edge; INT4: unused
    MAGIC: tl.constexpr, MAGIC_BASE: tl.constexpr, FOLD: tl.constexpr,
    MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
    NSPLIT: tl.constexpr = 1,
):
    """MODE 5 small-M weight-only (INT4 group-wise or emulated FP8) on tensor cores. Grid
    ``(cdiv(N, BLOCK_N), SPLIT)`` as in ``_wq_small_kernel``, but split-K partials are summed inside
    the kernel by the last program of each channel tile (``_gemv_finish``), so a call is one launch.
    MODE 1 / 2: orientation as in ``_tile_dot``. ``stride_qn`` and ``KW`` count int32 words;
    ``BLOCK_K`` (codes) stays inside one group / scale block. ``EVEN``: every tile is whole (N, K per
    split and K are multiples of the tile), so loads carry no channel / K masks. One dot per pair
    (stacking the pairs into one operand measured 1.2-2.2x slower on the H200,
    sweeps/sweep_quant_wo_mode5_one_dot.json: the permutation is not
    free in registers)."""
    CPW: tl.constexpr = 4 if FP8 else 8
    NP: tl.constexpr = CPW // 2
    BKW: tl.constexpr = BLOCK_K // CPW
    pdl_release(USE_PDL)
    offs_n, n_mask, offs_m, m_mask, rows_w, rows_x, acc = _small_setup(M, N, stride_xm, stride_qn, MODE,
                                                                       BLOCK_M, BLOCK_N)
    pdl_wait(USE_PDL)  # before x: the previous kernel writes it
    wp = qw_ptr.to(tl.pointer_type(tl.int32))
    pid_k = tl.program_id(1)
    kw_start = pid_k * (k_per_split // CPW)
    kw_end = tl.minimum(kw_start + k_per_split // CPW, KW)
    for kw0 in range(kw_start, kw_end, BKW):
        k0 = kw0 * CPW
        offs_w = kw0 + tl.arange(0, BKW)
        if EVEN:
            w = tl.load(wp + rows_w + offs_w[None, :], eviction_policy="evict_first")
            a = tl.load(x_ptr + rows_x + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_mask[:, None], other=0.0)
        else:
            w = tl.load(wp + rows_w + offs_w[None, :], mask=n_mask[:, None] & (offs_w[None, :] < KW), other=0,
                        eviction_policy="evict_first")
            a = _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K)
        xs = _x_pairs(a, NP, BLOCK_M, BKW)
        part = _tile_dot(xs[0], _unpair(_pair_bits(w, 0, FP8, a.dtype == tl.float16, MAGIC), a), MODE,
                         DOT_PRECISION)
        for j in tl.static_range(1, NP):
            part = _tile_dot_acc(xs[j], _unpair(_pair_bits(w, j, FP8, a.dtype == tl.float16, MAGIC), a), part,
                                 MODE, DOT_PRECISION)
        if FP8:
            if SCALE_BLOCK != 0:
                sb = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_mask,
                             other=0.0)
                part = part * _chan(sb, MODE)
            acc += part
        else:
            s, z = _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, stride_sn, k0 // GROUP, HAS_ZEROS, 4, BLOCK_N)
            asum = tl.sum(a.to(tl.float32), axis=1)
            acc += (part - _chan(z + MAGIC_BASE, MODE) * _row(asum, MODE)) * _chan(s, MODE)
    if FP8:
        if SCALE_BLOCK == 0:
            acc = acc * _chan(tl.load(s_ptr + offs_n, mask=n_mask, other=0.0), MODE)
        acc = acc * FOLD
    if MODE == 2:
        acc = tl.trans(acc)
    _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N, SPLIT_K, NSPLIT)


def _launch_words(x: torch.Tensor, qweight: torch.Tensor, s: torch.Tensor, z: torch.Tensor, n: int, kdim: int,
                  cfg: dict, **meta) -> torch.Tensor:
    """Run MODE 5 over ``kdim`` stored codes per row (``x`` has ``meta K`` columns): one launch,
    split-K finished in the kernel."""
    m, k = x.shape
    cpw = 4 if meta["FP8"] else 8
    bk = cfg["BLOCK_K"]
    kps = triton.cdiv(triton.cdiv(kdim, cfg["SPLIT"]), bk) * bk
    split = triton.cdiv(kdim, kps)
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = arrival_counters(x.device, tiles) if split > 1 else y
    even = n % cfg["BLOCK_N"] == 0 and k == kdim and kdim % kps == 0 and kps % bk == 0
    _words_small_kernel[(tiles, split)](
        x, qweight, s, z, ws, y, cnt, m, n, k, kdim // cpw, kps, x.stride(0), qweight.stride(0) // 4, s.stride(0),
        y.stride(0), MODE=2, DOT_PRECISION=_dot_precision(x.dtype), EVEN=even, SPLIT_K=split > 1, NSPLIT=split,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 1), **meta, **pdl_launch(pdl_enabled(x)),
    )
    return y


def _words_ok(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """MODE 5 needs 16-bit activations and rows of whole, 4-byte aligned int32 words."""
    return (x.dtype in (torch.bfloat16, torch.float16) and qweight.stride(0) % 4 == 0
            and qweight.shape[1] % 4 == 0 and qweight.data_ptr() % 16 == 0 and qweight.stride(1) == 1)
