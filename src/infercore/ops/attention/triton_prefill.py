"""Triton paged prefill attention: ragged batch, causal, cached prefix / chunked prefill.

Layout: q ``[T, Hq, D]`` (sequences concatenated, ``cu_seqlens_q`` int32 ``[B+1]``); caches
``[num_pages, page_size, Hk, D]``; ``block_table`` int32 ``[B, max_pages]``; ``seq_lens`` int32 ``[B]``
counts each sequence's keys *including* this step's queries, which sit at its last ``q_len``
positions (everything before them is a cached prefix, so chunked prefill needs nothing special).

Flash-attention forward: one program owns ``BLOCK_M`` queries of one (sequence, query head), streams
``BLOCK_N``-key tiles gathered through the block table, and keeps an fp32 online softmax (base 2,
scale folded into one multiply). The key loop is split in two: tiles entirely below the first query
of the block need no mask, only the diagonal band pays for causal/window masking. Programs walk the
query blocks last-first so the longest (causal) ones start early and the tail stays short.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register, triton_interpreter

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

# Tuning knobs per head-dim bucket (H200, bf16); `benchmarks/bench_ops.py --sweep prefill` explores the
# D=128 one (128x128 tiles, 8 warps, 3 stages measured best of 6 configs, 2026-11-30).
TUNING = {
    64: {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    128: {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    256: {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2},
}


@triton.jit
def _tile(
    acc, l_i, m_i, q, q_pos, seq_len, j0, kc_ptr, vc_ptr, bt_row, offs_n, offs_d, dmask,
    stride_kp, stride_ks, stride_vp, stride_vs, k_head, v_head,
    qk_scale, scale, softcap, window,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    kpos = j0 + offs_n
    if MASKED:
        nmask = kpos < seq_len
        page = tl.load(bt_row + kpos // PAGE, mask=nmask, other=0).to(tl.int64)
        kvmask = nmask[:, None] & dmask[None, :]
    else:
        # Interior tiles lie entirely below seq_len: no key mask (and dmask folds away when
        # HEAD_DIM == BLOCK_D), so the loads carry no per-element predicate.
        page = tl.load(bt_row + kpos // PAGE).to(tl.int64)
        kvmask = dmask[None, :]
    row = kpos % PAGE
    k = tl.load(kc_ptr + (page * stride_kp + row * stride_ks + k_head)[:, None] + offs_d[None, :],
                mask=kvmask, other=0.0)  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * (s * scale) / softcap) - 1.0) * _LOG2E
    if MASKED:
        visible = (kpos[None, :] <= q_pos[:, None]) & nmask[None, :]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    if HAS_SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    else:
        # Raw scores stay unscaled: the scale folds into the row max (scale > 0) and into one FMA
        # inside exp2 below, saving a full multiply pass over the [BLOCK_M, BLOCK_N] tile.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    if MASKED:
        # A row may see no key of this tile (window, or rows past the sequence end): keep exp2 finite.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    if HAS_SOFTCAP:
        p = tl.exp2(s - m_new[:, None])
    else:
        p = tl.exp2(s * qk_scale - m_new[:, None])
    v = tl.load(vc_ptr + (page * stride_vp + row * stride_vs + v_head)[:, None] + offs_d[None, :],
                mask=kvmask, other=0.0)  # fmt: skip
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # Accumulating inside the dot lets the MMA read the rescaled accumulator directly.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr,
    qk_scale, scale, softcap, window,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # position of the first query of this sequence
    kvh = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < q_len
    dmask = offs_d < HEAD_DIM
    q_pos = ctx + offs_m
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0).to(kc_ptr.dtype.element_ty)  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh

    first_q = ctx + pid_m * BLOCK_M
    hi = tl.minimum(first_q + BLOCK_M, seq_len)  # one past the last query position of the block
    if HAS_WINDOW:
        lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
        for j0 in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _tile(
                acc, l_i, m_i, q, q_pos, seq_len, j0, kc_ptr, vc_ptr, bt_row, offs_n, offs_d, dmask,
                stride_kp, stride_ks, stride_vp, stride_vs, k_head, v_head, qk_scale, scale, softcap, window,
                PAGE, True, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION,
            )  # fmt: skip
    else:
        # Keys < first_q + 1 are visible to every query of the block: no mask needed there.
        mid = (first_q + 1) // BLOCK_N * BLOCK_N
        for j0 in range(0, mid, BLOCK_N):
            acc, l_i, m_i = _tile(
                acc, l_i, m_i, q, q_pos, seq_len, j0, kc_ptr, vc_ptr, bt_row, offs_n, offs_d, dmask,
                stride_kp, stride_ks, stride_vp, stride_vs, k_head, v_head, qk_scale, scale, softcap, window,
                PAGE, False, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION,
            )  # fmt: skip
        for j0 in range(mid, hi, BLOCK_N):
            acc, l_i, m_i = _tile(
                acc, l_i, m_i, q, q_pos, seq_len, j0, kc_ptr, vc_ptr, bt_row, offs_n, offs_d, dmask,
                stride_kp, stride_ks, stride_vp, stride_vs, k_head, v_head, qk_scale, scale, softcap, window,
                PAGE, True, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION,
            )  # fmt: skip

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])  # fmt: skip


_SMEM_BUDGET = 200 * 1024  # below Hopper's 227 KB per block, with room for the compiler's scratch


def _fit_shared_memory(cfg: dict, block_d: int, elem: int) -> dict:
    """Shrink a tuned config (tuned for bf16) until the pipelined K/V tiles fit in shared memory,
    e.g. for fp32 caches or head_dim 256: fewer stages first, then narrower key tiles. (Q stays in
    registers as the MMA's A operand; 128x128 bf16 tiles with 3 stages measured fine on the H200.)"""

    def need(c):
        return 2 * c["num_stages"] * c["block_n"] * block_d * elem

    while need(cfg) > _SMEM_BUDGET and (cfg["num_stages"] > 2 or cfg["block_n"] > 16):
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        else:
            cfg["block_n"] //= 2
    return cfg


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Causal prefill attention over the paged cache; see the module docstring for layouts.

    ``max_seqlen_q`` sizes the launch grid; when None it is read from ``cu_seqlens_q`` (one device
    sync, so pass it inside CUDA graphs). Returns ``[T, Hq, D]`` in ``q.dtype``.
    """
    T, Hq, D = q.shape
    page_size, Hk = k_cache.shape[1], k_cache.shape[2]
    # Any page size works (pages are looked up per key); powers of two make // and % shifts.
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q <= 0:
        return out.zero_()
    block_d = max(triton.next_power_of_2(D), 16)
    if triton_interpreter():
        cfg = {"block_m": 16, "block_n": 16}
        extra = {}
    else:
        cfg = _fit_shared_memory(dict(TUNING[min(max(block_d, 64), 256)]), block_d, k_cache.element_size())
        extra = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    block_m = cfg["block_m"]
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(max_seqlen_q, block_m), Hq, B)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, out,
        scale * _LOG2E.value, scale, softcap or 1.0, sliding_window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        Hq // Hk, D,
        PAGE=page_size, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        DOT_PRECISION=precision, **extra,
    )  # fmt: skip
    return out


register(
    "paged_attention_prefill", "triton", paged_attention_prefill, priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)  # fmt: skip
