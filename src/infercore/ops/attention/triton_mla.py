"""Triton MLA decode (absorbed form) over a paged latent cache; see ``mla.py`` for the math and layouts.

One program owns one (sequence, block of ``BLOCK_H`` query heads, split). Per ``BLOCK_N``-key tile it gathers the
latent rows through the block table once, as two operands: ``c_kv`` ``[BLOCK_N, R]`` and ``k_pe`` ``[BLOCK_N, P]``
(R = kv_lora_rank, P = rope dim; each padded to a power of two on its own, so 512 + 64 costs no padding where the
generic kernel would pad 576 to 1024). Scores are ``q_lat c_kv^T + q_pe k_pe^T``; the same ``c_kv`` tile is the PV
product's value operand, so the latent is read from memory once per head block, not once as K and once as V.

The head block is 16 (the MMA's M minimum) for models of few heads, 64 for V2 / V3's 128 (``TUNING_WIDE``: 8 warps,
an fp32 accumulator ``[64, 512]`` of 128 registers a thread). The grid puts the head blocks on its fastest axis, so
the programs reading one sequence's latent run side by side and all but the first find it in L2. Split-K over the
keys (the count from static shapes only, so CUDA-graph safe) writes normalized fp32 partials and base-2
log-sum-exps that the generic decode's merge kernel combines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register, triton_interpreter

from .triton_decode import _LOG2E, _pick_splits, _store_decode_out, merge_splits, split_buffers

# Launch knobs (swept by benchmarks/bench_mla_decode.py over block_h 16 / 32 / 64, block_n 16 / 32 / 64, 4 / 8 warps,
# 2 / 3 stages at batch 64 x 4096 keys on an H100): 16 heads (V2-Lite) read fastest in 16-head blocks of 32 keys on 4
# warps (154.8 us); 128 heads (V2 / V3) in 64-head blocks of 64 keys on 8 warps, 3 stages (405.1 us), where fewer
# programs re-read each latent tile (results/h100/sweeps/mla_decode_sweep_h100.json). TUNING_WIDE serves 64 heads or
# more.
TUNING = {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}
TUNING_WIDE = {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 3}


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _mla_decode_kernel(
    q_ptr, kv_ptr, seq_lens_ptr, bt_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_bt, stride_ob, stride_oh,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    H, num_splits, R, P,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr = "tf32",  # "ieee" for fp32 inputs (exact products, as the generic kernel)
):  # fmt: skip
    hb = tl.program_id(0)  # fastest: the head blocks of one sequence run side by side and share its latent in L2
    b = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    rmask = offs_r < R
    pmask = offs_p < P
    offs_n = tl.arange(0, BLOCK_N)

    seq_len = tl.load(seq_lens_ptr + b)
    # Splits start on tile boundaries: chunk = whole tiles of ceil(seq_len / num_splits) keys.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_pe = tl.load(q_row + R + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        kpos = j0 + offs_n
        nmask = kpos < hi
        page = tl.load(bt_row + kpos // PAGE, mask=nmask, other=0)
        row = kv_ptr + page.to(tl.int64) * stride_kp + (kpos % PAGE) * stride_ks
        c = tl.load(row[:, None] + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
        pe = tl.load(row[:, None] + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION) + tl.dot(
            q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    _store_decode_out(acc, m_i, l_i, heads, hmask, offs_r, rmask, b, split, out_ptr, mid_o_ptr, mid_lse_ptr,
                      stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, SPLIT)


def paged_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`~infercore.ops.attention.mla.paged_mla_decode`. ``num_splits`` overrides
    the split-K factor (default: from static shapes), ``config`` the launch knobs of ``TUNING``."""
    B, H, D = q.shape
    R, P = kv_lora_rank, D - kv_lora_rank
    page_size = kv_cache.shape[1]
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache: the latent axis must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((B, H, R), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    cfg = {**(TUNING_WIDE if H >= 64 else TUNING), **(config or {})}
    interp = triton_interpreter()
    block_h = max(16, min(cfg["block_h"], triton.next_power_of_2(H)))
    head_blocks = triton.cdiv(H, block_h)
    if num_splits is None:
        num_splits = _pick_splits(B, head_blocks, block_table.shape[1] * page_size, q.device)
    block_r = max(triton.next_power_of_2(R), 16)
    block_p = max(triton.next_power_of_2(max(P, 1)), 16)
    mid_o, mid_lse = split_buffers(out, num_splits)
    extra = {} if interp else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    _mla_decode_kernel[(head_blocks, B, num_splits)](
        q, kv_cache, seq_lens, block_table, out, mid_o, mid_lse,
        scale * _LOG2E.value,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        H, num_splits, R, P,
        PAGE=page_size, SPLIT=num_splits > 1, BLOCK_H=block_h, BLOCK_N=16 if interp else cfg["block_n"],
        BLOCK_R=block_r, BLOCK_P=block_p, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **extra,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(mid_o, mid_lse, out, block_r)
    return out


register(
    "paged_mla_decode", "triton", paged_mla_decode, priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)  # fmt: skip
