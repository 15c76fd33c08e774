"""Triton routed MoE experts: grouped GEMMs over the (token, expert) pairs sorted by expert.

Host side (torch, no sync, static shapes): the ``T * k`` pairs are sorted by expert id; per-expert
counts (a scatter-add) and their exclusive prefix sum give each expert's slice of the sorted list.
Two kernels, each over a grid of (expert, output tile); a program whose expert got no token exits
at once:

* ``_moe_gate_up_kernel``: for its expert's pairs, in chunks of ``BLOCK_M`` rows, gathers the
  tokens' rows of ``x``, multiplies by the expert's gate and up rows of this tile (two
  accumulators, K loop over ``H``) and stores ``silu(gate) * up`` (fp32 math) for the tile into an
  intermediate ``[T * k, I]`` at the pairs' sorted positions;
* ``_moe_down_kernel``: the intermediate rows times the expert's ``down`` tile, scaled by each
  pair's routing weight, stored at the pair's own index in ``[T * k, H]`` (fp32).

The ``k`` rows of a token are then summed (``view(T, k, H).sum(1)``). Each routed expert's weights
are read once per call (per chunk of ``BLOCK_M`` of its tokens, the rest from L2); only routed
products are computed, against every expert on every token in the dense form.

Decode sizes (:func:`use_gemv`: few pairs, against many experts) take a sort-free GEMV path instead: the sort, the
scatter-add, the prefix sum and the final sum are five small launches per layer, and the grouped
grid leaves most programs idle (one per expert and tile, ``k`` experts routed). Two kernels:

* ``_moe_gemv_gate_up_kernel``, a program per (pair, ``BLOCK_N`` intermediate columns): the pair's
  expert is ``ids[pair]``, its token ``pair // k``; it reduces the token's row against the gate and
  up rows of those columns (fp32 FMA, no tensor cores: one row) and stores ``silu(gate) * up``;
* ``_moe_gemv_down_kernel``, a program per (token, ``BLOCK_N`` output columns): the ``k`` pairs of
  the token in slot order, each pair's down rows times its intermediate row, scaled by the routing
  weight and summed in fp32 in registers, stored once in ``x.dtype``: no ``[T * k, H]`` partials.

A token routed twice to one expert reads that expert twice (from L2 the second time); beyond a few
tokens per step the grouped path reads each expert once and wins.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...devices import register
from .naive import scale_blocks

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the two kernels; tokens per expert are few at decode.
_GPU_CFG = {"gate_up": (16, 64, 128, 4, 3), "down": (16, 64, 128, 4, 3)}
_INTERP_CFG = {"gate_up": (16, 16, 32, 4, 1), "down": (16, 16, 32, 4, 1)}
# From MBLOCK_MIN_ROWS (token, expert) pairs per expert on average (prefill), a program per (block of BLOCK_M of an
# expert's rows, tile) with tensor-core-sized tiles, instead of one program walking all of its expert's rows in
# 16-row chunks: at 4096 tokens of DeepSeek-V2-Lite's 64 experts (384 rows each) that walk is 24 chunks in series
# on 16 x 64 tiles. (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), then the GROUP_M swizzle; fp32 halves BLOCK_K (the
# same shared memory). H100 tile sweep at 4096 tokens (results/h100/moe_prefill.json, "sweep"): these two were the
# best of five each at the DeepSeek-V2-Lite, Qwen3-30B-A3B and Mixtral expert shapes (down within 0.1% at Mixtral).
# From 16 rows per expert the blocks beat the walk (Mixtral at 64 tokens: 42.1 vs 29.6 TFLOP/s; Qwen3-30B-A3B at 256:
# 33.2 vs 28.9; Qwen3-Next's 512 experts at 1024 tokens, 20 rows: 1309 vs 2059 us, results/h100/moe.json and
# sweeps/moe_expert_loop_only.json); at 12 and below they did not (Qwen3-30B-A3B at 192 tokens: 23.5 vs 27.7,
# sweeps/moe_prefill_small_sizes.json).
MBLOCK_MIN_ROWS = int(os.environ.get("INFERCORE_MOE_MBLOCK_MIN_ROWS", "16"))
_MBLOCK_CFG = {"gate_up": (128, 128, 64, 8, 3), "down": (128, 256, 64, 8, 3)}
_MBLOCK_INTERP_CFG = {"gate_up": (16, 16, 32, 4, 1), "down": (16, 16, 32, 4, 1)}
MBLOCK_GROUP_M = 8


@triton.jit
def _expert_span(counts_ptr, offsets_ptr, ends_ptr, E, NUM_N, LOOP_M: tl.constexpr, E_P2: tl.constexpr,
                 BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    """This program's expert, how many (token, slot) pairs it got, where they start in the sorted list, the rows
    ``[m_first, m_end)`` of them it multiplies and its output tile.

    ``LOOP_M``: grid (expert, tile), the program walks all its expert's rows. Otherwise a 1-D grid of (row block,
    tile) in ``GROUP_M`` swizzle: block ``b``'s expert is the number of experts whose blocks end at or before it
    (``ends`` = inclusive prefix sum of ``cdiv(count, BLOCK_M)``); blocks past the last one get no rows."""
    if LOOP_M:
        e = tl.program_id(0)
        cnt = tl.load(counts_ptr + e)
        return e, cnt, tl.load(offsets_ptr + e), 0, cnt, tl.program_id(1)
    pid = tl.program_id(0)
    num_m = tl.num_programs(0) // NUM_N
    in_group = GROUP_M * NUM_N
    first_m = (pid // in_group) * GROUP_M
    group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group
    pid_n = (pid % in_group) // group
    idx = tl.arange(0, E_P2)
    ends = tl.load(ends_ptr + idx, mask=idx < E, other=2147483647)
    e = tl.sum((ends <= pid_m).to(tl.int32), 0)
    live = e < E
    e_safe = tl.minimum(e, E - 1)
    cnt = tl.where(live, tl.load(counts_ptr + e_safe), 0)
    first_block = tl.load(ends_ptr + e_safe) - tl.cdiv(cnt, BLOCK_M)
    m_first = (pid_m - first_block) * BLOCK_M
    return e_safe, cnt, tl.load(offsets_ptr + e_safe), m_first, tl.minimum(m_first + BLOCK_M, cnt), pid_n


@triton.jit
def _chunk(order_ptr, start, cnt, m0, BLOCK_M: tl.constexpr):
    """Rows ``m0 .. m0 + BLOCK_M`` of an expert's slice of the sorted pairs: their positions, mask
    and pair indices (``token * top_k + slot``)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    r_mask = rows < cnt
    return rows, r_mask, tl.load(order_ptr + start + rows, mask=r_mask, other=0)


@triton.jit
def _w_tile(ptrs, mask, s_e, rows, offs_k, stride_sn, stride_sk, S_BN, S_BK, W_SCALE: tl.constexpr, DT: tl.constexpr,
            EVICT: tl.constexpr = ""):  # fmt: skip
    """A weight tile ``[rows, offs_k]`` in ``DT``: as stored (16-bit / fp32 weights, or int8 / fp8 codes whose
    per-channel scales (``W_SCALE`` 1) the caller applies to the products), or codes times their block scales
    (``W_SCALE`` 2: ``s_e[row // S_BN, k // S_BK]``)."""
    w = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=EVICT)
    if W_SCALE == 2:
        s = tl.load(s_e + (rows // S_BN).to(tl.int64)[:, None] * stride_sn + (offs_k // S_BK)[None, :] * stride_sk,
                    mask=mask, other=0.0)  # fmt: skip
        w = w.to(tl.float32) * s
    return w.to(DT)


@triton.jit
def _chan_scale(s_e, rows, mask, stride_sn):
    """The per-channel scales (``W_SCALE`` 1) of ``rows``."""
    return tl.load(s_e + rows.to(tl.int64) * stride_sn, mask=mask, other=0.0)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, order_ptr, counts_ptr, offsets_ptr, ends_ptr, inter_ptr, extra_ptr,
    s_ptr, stride_se, stride_sn, stride_sk, S_BN, S_BK,
    H, I, TOPK, E, NUM_N,
    stride_xm, stride_we, stride_wn, stride_im, stride_em,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_EXTRA: tl.constexpr, LOOP_M: tl.constexpr, E_P2: tl.constexpr, GROUP_M: tl.constexpr,
    RELU2: tl.constexpr = False,  # ungated relu(up) ** 2: w holds the up rows alone
    W_SCALE: tl.constexpr = 0,  # 0: weights as x; 1: int8 / fp8 codes, per-channel scales; 2: block scales
):  # fmt: skip
    e, cnt, start, m_first, m_end, pid_n = _expert_span(counts_ptr, offsets_ptr, ends_ptr, E, NUM_N, LOOP_M, E_P2,
                                                        BLOCK_M, GROUP_M)  # fmt: skip
    if cnt > 0:
        DT: tl.constexpr = x_ptr.dtype.element_ty
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        g_rows = w_e + offs_n.to(tl.int64)[:, None] * stride_wn
        u_rows = w_e + (I + offs_n).to(tl.int64)[:, None] * stride_wn
        for m0 in range(m_first, m_end, BLOCK_M):
            rows, r_mask, pair = _chunk(order_ptr, start, cnt, m0, BLOCK_M)
            x_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_xm
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < H
                a = tl.load(x_rows + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                wm = n_mask[:, None] & k_mask[None, :]
                if RELU2:
                    wu = _w_tile(g_rows + offs_k[None, :], wm, s_e, offs_n, offs_k, stride_sn, stride_sk, S_BN, S_BK,
                                 W_SCALE, DT)  # fmt: skip
                    acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
                else:
                    wg = _w_tile(g_rows + offs_k[None, :], wm, s_e, offs_n, offs_k, stride_sn, stride_sk, S_BN, S_BK,
                                 W_SCALE, DT)  # fmt: skip
                    wu = _w_tile(u_rows + offs_k[None, :], wm, s_e, I + offs_n, offs_k, stride_sn, stride_sk, S_BN,
                                 S_BK, W_SCALE, DT)  # fmt: skip
                    acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
                    acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
            if W_SCALE == 1:
                if RELU2:
                    acc_u = acc_u * _chan_scale(s_e, offs_n, n_mask, stride_sn)[None, :]
                else:
                    acc_g = acc_g * _chan_scale(s_e, offs_n, n_mask, stride_sn)[None, :]
                    acc_u = acc_u * _chan_scale(s_e, I + offs_n, n_mask, stride_sn)[None, :]
            if HAS_EXTRA:  # fp32 [rows, 2I] added before the activation (the experts' LoRA), by inter row
                e_rows = extra_ptr + (start + rows).to(tl.int64)[:, None] * stride_em
                em = r_mask[:, None] & n_mask[None, :]
                acc_g += tl.load(e_rows + offs_n[None, :], mask=em, other=0.0)
                acc_u += tl.load(e_rows + (I + offs_n)[None, :], mask=em, other=0.0)
            if RELU2:
                r = tl.maximum(acc_u, 0.0)
                y = r * r
            else:
                y = acc_g * tl.sigmoid(acc_g) * acc_u
            dst = inter_ptr + (start + rows).to(tl.int64)[:, None] * stride_im + offs_n[None, :]
            tl.store(dst, y.to(inter_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, w_ptr, order_ptr, counts_ptr, offsets_ptr, ends_ptr, rw_ptr, out_ptr, extra_ptr,
    s_ptr, stride_se, stride_sn, stride_sk, S_BN, S_BK,
    H, I, E, NUM_N,
    stride_im, stride_we, stride_wn, stride_om, stride_em,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_EXTRA: tl.constexpr, LOOP_M: tl.constexpr, E_P2: tl.constexpr, GROUP_M: tl.constexpr,
    W_SCALE: tl.constexpr = 0,  # as in _moe_gate_up_kernel
):  # fmt: skip
    e, cnt, start, m_first, m_end, pid_n = _expert_span(counts_ptr, offsets_ptr, ends_ptr, E, NUM_N, LOOP_M, E_P2,
                                                        BLOCK_M, GROUP_M)  # fmt: skip
    if cnt > 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        s_e = s_ptr + e.to(tl.int64) * stride_se
        for m0 in range(m_first, m_end, BLOCK_M):
            rows, r_mask, pair = _chunk(order_ptr, start, cnt, m0, BLOCK_M)
            a_rows = inter_ptr + (start + rows).to(tl.int64)[:, None] * stride_im
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < I
                a = tl.load(a_rows + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                w = _w_tile(w_rows + offs_k[None, :], n_mask[:, None] & k_mask[None, :], s_e, offs_n, offs_k,
                            stride_sn, stride_sk, S_BN, S_BK, W_SCALE, inter_ptr.dtype.element_ty)  # fmt: skip
                acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
            if W_SCALE == 1:
                acc = acc * _chan_scale(s_e, offs_n, n_mask, stride_sn)[None, :]
            if HAS_EXTRA:  # fp32 [rows, H] added before the routing weight, by inter row
                e_rows = extra_ptr + (start + rows).to(tl.int64)[:, None] * stride_em
                acc += tl.load(e_rows + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            rw = tl.load(rw_ptr + pair, mask=r_mask, other=0.0).to(tl.float32)
            dst = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(dst, acc * rw[:, None], mask=r_mask[:, None] & n_mask[None, :])


# The GEMV path serves at most GEMV_MAX_PAIRS (token, expert) pairs, and at most half as many as there are experts
# (with few experts a step's tokens share them, and the grouped path reads each once). H200 tile sweep
# (results/h200/sweeps/sweep_moe_gemv.json, bf16, cold experts), GEMV vs grouped: Qwen3-30B-A3B experts 33 vs 51 us
# at 1 token, 137 vs 151 at 8 (64 pairs); Qwen3-Next 27 vs 64 at 1, 126 vs 148 at 8; Mixtral 186 vs 220 at 1, even at
# 2, 552 vs 437 at 4 (8 pairs for 8 experts: the grouped path's side of the rule).
GEMV_MAX_PAIRS = int(os.environ.get("INFERCORE_MOE_GEMV_MAX_PAIRS", "64"))
# (BLOCK_N, BLOCK_K, warps) of each kernel, by tokens (1, or 2 and more): narrow column blocks for one token (more
# programs over the k experts' rows), 16 columns from two tokens on (best or within 3% of it at every shape swept).
_GEMV_CFG = {1: {"gate_up": (2, 512, 4), "down": (2, 512, 4)}, 2: {"gate_up": (16, 256, 8), "down": (16, 256, 8)}}
_GEMV_INTERP_CFG = {n: {"gate_up": (4, 16, 1), "down": (4, 16, 1)} for n in (1, 2)}


def use_gemv(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether :func:`moe_experts_triton` takes the GEMV path for this routing size."""
    pairs = tokens * top_k
    return 0 < pairs <= GEMV_MAX_PAIRS and 2 * pairs <= num_experts


@triton.jit
def _moe_gemv_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, inter_ptr, extra_ptr,
    s_ptr, stride_se, stride_sn, stride_sk, S_BN, S_BK,
    H, I, TOPK, E, OFFSET,
    stride_xm, stride_we, stride_wn, stride_im, stride_em,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_EXTRA: tl.constexpr,
    RELU2: tl.constexpr = False,  # ungated relu(up) ** 2: w holds the up rows alone
    W_SCALE: tl.constexpr = 0,  # as in _moe_gate_up_kernel
):  # fmt: skip
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64) - OFFSET
    if (e < 0) | (e >= E):  # an expert held elsewhere (expert parallelism): the down kernel skips the pair
        return
    x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    g_rows = w_e + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = w_e + (I + offs_n).to(tl.int64)[:, None] * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        wm = n_mask[:, None] & k_mask[None, :]
        if RELU2:
            acc_u += _w_tile(g_rows + offs_k[None, :], wm, s_e, offs_n, offs_k, stride_sn, stride_sk, S_BN, S_BK,
                             W_SCALE, tl.float32, "evict_first") * a  # fmt: skip
        else:
            acc_g += _w_tile(g_rows + offs_k[None, :], wm, s_e, offs_n, offs_k, stride_sn, stride_sk, S_BN, S_BK,
                             W_SCALE, tl.float32, "evict_first") * a  # fmt: skip
            acc_u += _w_tile(u_rows + offs_k[None, :], wm, s_e, I + offs_n, offs_k, stride_sn, stride_sk, S_BN, S_BK,
                             W_SCALE, tl.float32, "evict_first") * a  # fmt: skip
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if W_SCALE == 1:
        if RELU2:
            u = u * _chan_scale(s_e, offs_n, n_mask, stride_sn)
        else:
            g = g * _chan_scale(s_e, offs_n, n_mask, stride_sn)
            u = u * _chan_scale(s_e, I + offs_n, n_mask, stride_sn)
    if HAS_EXTRA:  # fp32 [pairs, 2I] added before the activation (the experts' LoRA)
        e_row = extra_ptr + pair.to(tl.int64) * stride_em
        g += tl.load(e_row + offs_n, mask=n_mask, other=0.0)
        u += tl.load(e_row + I + offs_n, mask=n_mask, other=0.0)
    if RELU2:
        r = tl.maximum(u, 0.0)
        y = r * r
    else:
        y = g * tl.sigmoid(g) * u
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + offs_n, y.to(inter_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_gemv_down_kernel(
    inter_ptr, w_ptr, ids_ptr, rw_ptr, out_ptr, extra_ptr,
    s_ptr, stride_se, stride_sn, stride_sk, S_BN, S_BK,
    H, I, E, OFFSET,
    stride_im, stride_we, stride_wn, stride_om, stride_em,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_EXTRA: tl.constexpr,
    W_SCALE: tl.constexpr = 0,  # as in _moe_gate_up_kernel
):  # fmt: skip
    tok = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOPK):  # the token's pairs in slot order: a fixed summation order
        pair = tok * TOPK + j
        e = tl.load(ids_ptr + pair).to(tl.int64) - OFFSET
        if (e >= 0) & (e < E):
            w_rows = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
            s_e = s_ptr + e * stride_se
            a_row = inter_ptr + pair.to(tl.int64) * stride_im
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < I
                a = tl.load(a_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
                acc += _w_tile(w_rows + offs_k[None, :], n_mask[:, None] & k_mask[None, :], s_e, offs_n, offs_k,
                               stride_sn, stride_sk, S_BN, S_BK, W_SCALE, tl.float32, "evict_first") * a  # fmt: skip
            d = tl.sum(acc, axis=1)
            if W_SCALE == 1:
                d = d * _chan_scale(s_e, offs_n, n_mask, stride_sn)
            if HAS_EXTRA:  # fp32 [pairs, H] added before the routing weight
                d += tl.load(extra_ptr + pair.to(tl.int64) * stride_em + offs_n, mask=n_mask, other=0.0)
            out += d * tl.load(rw_ptr + pair).to(tl.float32)
    tl.store(out_ptr + tok.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _lora_rows_kernel(ids_ptr, slots_ptr, live_ptr, rows_ptr, order_ptr, P, TOPK, E, OFFSET,
                      HAS_ORDER: tl.constexpr, HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``rows[i] = slots[pair // TOPK] * E + (ids[pair] - OFFSET)`` for the pair of row ``i`` (``order[i]``, or ``i``),
    -1 where the token has no adapter, its slot is not live or the expert is held elsewhere: one launch for what is
    a dozen torch ops."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < P
    pair = tl.load(order_ptr + i, mask=m, other=0).to(tl.int64) if HAS_ORDER else i.to(tl.int64)
    e = tl.load(ids_ptr + pair, mask=m, other=0).to(tl.int64) - OFFSET
    s = tl.load(slots_ptr + pair // TOPK, mask=m, other=-1).to(tl.int64)
    ok = (s >= 0) & (e >= 0) & (e < E)
    if HAS_LIVE:
        ok = ok & (tl.load(live_ptr + s, mask=m & ok, other=0) != 0)
    tl.store(rows_ptr + i, tl.where(ok, s * E + e, -1), mask=m)


# (token, expert) pairs from which the experts' LoRA takes the grouped (SGMV) kernels; below, per-pair BGMV. Shapes
# only, so graph-safe. Each pair's LoRA row is slot * E + expert: at decode sizes nearly every pair has its own, so a
# tile of 16 pairs shares nothing. None: the lora ops' own threshold (ops.lora.triton.GROUPED_MIN_TOKENS).
LORA_GROUPED_MIN_PAIRS: int | None = 1 << 30


class _LoRARows:
    """The experts' LoRA of one call (``ops.moe.MoELoRA``) over the intermediate's rows: ``rows`` [R] the pair of
    each row (None: row = pair), their LoRA rows ``c`` (``slot * E + expert`` or -1) and the two fp32 extras the
    kernels add: :meth:`gate_up` before the activation, :meth:`down` (from the activated rows) before the routing
    weight. Only ``ops.lora_shrink`` / ``ops.lora_expand_`` launches: no sync, CUDA-graph safe."""

    def __init__(self, lora, ids: torch.Tensor, num_experts: int, expert_offset: int | None,
                 rows: torch.Tensor | None) -> None:
        self.lora, self.k = lora, ids.shape[1]
        self.rows = rows
        P = ids.numel()
        self.c = torch.empty(P, dtype=torch.int64, device=ids.device)
        if P:
            flat = ids.reshape(-1)
            _lora_rows_kernel[(triton.cdiv(P, 256),)](
                flat if flat.is_contiguous() else flat.contiguous(), lora.slots,
                lora.slots if lora.live is None else lora.live, self.c,
                flat if rows is None else rows, P, self.k, num_experts, expert_offset or 0,
                HAS_ORDER=rows is not None, HAS_LIVE=lora.live is not None, BLOCK=256,
            )  # fmt: skip

    def gate_up(self, x: torch.Tensor, inter_dim: int) -> torch.Tensor:
        from ..lora.triton import lora_expand_, lora_shrink

        lo = self.lora
        T, H = x.shape
        xr = (x.unsqueeze(1).expand(T, self.k, H).reshape(-1, H) if self.rows is None
              else x.index_select(0, self.rows.long() // self.k))
        extra = torch.zeros(len(self.c), 2 * inter_dim, dtype=torch.float32, device=x.device)
        g = self._grouped()
        s = lora_shrink(xr.to(lo.a_gate_up.dtype).contiguous(), lo.a_gate_up, self.c, grouped=g)
        return lora_expand_(extra, s, lo.b_gate_up, self.c, slice_bounds=(inter_dim,), grouped=g)

    def down(self, inter: torch.Tensor, hidden: int) -> torch.Tensor:
        from ..lora.triton import lora_expand_, lora_shrink

        lo = self.lora
        extra = torch.zeros(len(self.c), hidden, dtype=torch.float32, device=inter.device)
        g = self._grouped()
        s = lora_shrink(inter.to(lo.a_down.dtype).contiguous(), lo.a_down, self.c, grouped=g)
        return lora_expand_(extra, s, lo.b_down, self.c, grouped=g)

    def _grouped(self) -> bool | None:
        return None if LORA_GROUPED_MIN_PAIRS is None else len(self.c) >= LORA_GROUPED_MIN_PAIRS


def _scale_args(scale: torch.Tensor | None, w: torch.Tensor) -> tuple[dict, tuple]:
    """The kernels' scale operands for weights ``w [E, N, K]``: ``(constexprs, (s, stride_se, stride_sn, stride_sk,
    S_BN, S_BK))``. None: weights in x's dtype (W_SCALE 0, ``w`` as a placeholder pointer); ``[E, N]``: per-channel
    (W_SCALE 1); ``[E, ceil(N / bn), ceil(K / bk)]``: blocks of ``bn x bk`` (W_SCALE 2)."""
    if scale is None:
        return {}, (w, 0, 0, 0, 1, 1)
    if scale.ndim == 2:
        return {"W_SCALE": 1}, (scale, scale.stride(0), scale.stride(1), 0, 1, 1)
    bn, bk = scale_blocks(w.shape, scale)
    return {"W_SCALE": 2}, (scale, scale.stride(0), scale.stride(1), scale.stride(2), bn, bk)


def moe_experts_gemv(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    expert_offset: int | None = None, *, lora=None, activation: str = "silu",
    gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode-size path (see the module docstring): no sort, two launches. Same arguments and result as
    :func:`moe_experts_triton`."""
    T, topk = ids.shape
    E, rows, H = gate_up.shape
    relu2 = activation == "relu2"
    inter_dim = rows if relu2 else rows // 2
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    flat = ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    # rows of pairs held elsewhere are never written: zeros under LoRA, whose shrink reads every row
    alloc = torch.zeros if lora is not None and expert_offset is not None else torch.empty
    inter = alloc((T * topk, inter_dim), dtype=x.dtype, device=x.device)
    cfgs = (_GEMV_INTERP_CFG if _INTERPRET else _GEMV_CFG)[min(T, 2)]
    bn, bk, warps = cfgs["gate_up"]
    extra = {} if _INTERPRET else {"num_warps": warps}
    offset = expert_offset or 0
    lr = None if lora is None else _LoRARows(lora, ids, E, expert_offset, None)
    add = inter if lr is None else lr.gate_up(x, inter_dim)  # any tensor when there is nothing to add
    sc, sa = _scale_args(gate_up_scale, gate_up)
    _moe_gemv_gate_up_kernel[(T * topk, triton.cdiv(inter_dim, bn))](
        x, gate_up, flat, inter, add, *sa, H, inter_dim, topk, E, offset, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), inter.stride(0), add.stride(0), BLOCK_N=bn, BLOCK_K=bk, HAS_EXTRA=lr is not None,
        **({"RELU2": True} if relu2 else {}), **sc, **extra,
    )  # fmt: skip
    bn, bk, warps = cfgs["down"]
    extra = {} if _INTERPRET else {"num_warps": warps}
    add = inter if lr is None else lr.down(inter, H)
    sc, sa = _scale_args(down_scale, down)
    _moe_gemv_down_kernel[(T, triton.cdiv(H, bn))](
        inter, down, flat, rw, out, add, *sa, H, inter_dim, E, offset, inter.stride(0), down.stride(0),
        down.stride(1), out.stride(0), add.stride(0),
        TOPK=topk, BLOCK_N=bn, BLOCK_K=bk, HAS_EXTRA=lr is not None, **sc, **extra,
    )  # fmt: skip
    return out


def moe_experts_triton(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    expert_offset: int | None = None, *, lora=None, activation: str = "silu",
    gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`infercore.ops.moe.moe_experts_routed` (arguments checked there). Decode sizes (:func:`use_gemv`)
    run :func:`moe_experts_gemv`; the rest the grouped kernels below. ``activation="relu2"``: ``gate_up`` holds the
    up rows alone and the first kernel stores ``relu(up) ** 2`` (the constexpr ``RELU2``)."""
    T, topk = ids.shape
    if use_gemv(T, topk, gate_up.shape[0] if expert_offset is None else 10**9):
        return moe_experts_gemv(x, gate_up, down, weights, ids, expert_offset, lora=lora, activation=activation,
                                gate_up_scale=gate_up_scale, down_scale=down_scale)  # fmt: skip
    E, rows, H = gate_up.shape
    relu2 = activation == "relu2"
    inter_dim = rows if relu2 else rows // 2
    P = T * topk
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if P == 0:
        return out.zero_()
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    flat = ids.reshape(-1).to(torch.int32)  # int32 keys: half the radix-sort passes of int64
    if expert_offset is not None:  # pairs of experts held elsewhere sort last, into a bin no program reads
        flat = flat - expert_offset
        flat = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.argsort(flat, stable=True).to(torch.int32)  # sorted position -> pair index
    counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.long(), torch.ones(P, dtype=torch.int32, device=x.device))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    rw = weights.reshape(-1).contiguous()
    alloc = torch.zeros if lora is not None and expert_offset is not None else torch.empty
    inter = alloc((P, inter_dim), dtype=x.dtype, device=x.device)
    # skipped pairs' rows are never written: zeros then, so the final sum adds nothing for them
    out_pairs = (torch.empty if expert_offset is None else torch.zeros)((P, H), dtype=torch.float32, device=x.device)
    loop_m = P < MBLOCK_MIN_ROWS * E
    if loop_m:
        cfgs = _INTERP_CFG if _INTERPRET else _GPU_CFG
    else:
        cfgs = _MBLOCK_INTERP_CFG if _INTERPRET else _MBLOCK_CFG
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # the intermediate's rows are the pairs in sorted order (row i = pair order[i]); so are the LoRA extras'
    lr = None if lora is None else _LoRARows(lora, ids, E, expert_offset, order)
    for kernel, n_dim in (("gate_up", inter_dim), ("down", H)):
        bm, bn, bk, warps, stages = cfgs[kernel]
        if not loop_m and x.element_size() == 4 and not _INTERPRET:
            bk //= 2
        num_n = triton.cdiv(n_dim, bn)
        if loop_m:
            grid, ends = (E, num_n), counts
        else:  # row blocks: at most cdiv(P, bm) + E of them (one partial block per expert); the rest exit
            ends = torch.cumsum((counts[:E] + (bm - 1)) // bm, 0, dtype=torch.int32)
            grid = ((triton.cdiv(P, bm) + min(E, P)) * num_n,)
        meta = dict(DOT_PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_EXTRA=lr is not None,
                    LOOP_M=loop_m, E_P2=triton.next_power_of_2(E), GROUP_M=MBLOCK_GROUP_M,
                    **({} if _INTERPRET else {"num_warps": warps, "num_stages": stages}))  # fmt: skip
        if kernel == "gate_up":
            add = inter if lr is None else lr.gate_up(x, inter_dim)  # any tensor when there is nothing to add
            sc, sa = _scale_args(gate_up_scale, gate_up)
            _moe_gate_up_kernel[grid](
                x, gate_up, order, counts, offsets, ends, inter, add, *sa, H, inter_dim, topk, E, num_n,
                x.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0), add.stride(0),
                **meta, **({"RELU2": True} if relu2 else {}), **sc,
            )  # fmt: skip
        else:
            add = inter if lr is None else lr.down(inter, H)
            sc, sa = _scale_args(down_scale, down)
            _moe_down_kernel[grid](
                inter, down, order, counts, offsets, ends, rw, out_pairs, add, *sa, H, inter_dim, E, num_n,
                inter.stride(0), down.stride(0), down.stride(1), out_pairs.stride(0), add.stride(0), **meta, **sc,
            )  # fmt: skip
    return out_pairs.view(T, topk, H).sum(1).to(x.dtype)


register(
    "moe_experts_routed", "triton", moe_experts_triton, priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)  # fmt: skip
