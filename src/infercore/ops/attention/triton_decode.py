"""Triton paged decode attention (one query token per sequence), flash-decoding style.

Layout: q ``[B, Hq, D]``; caches ``[num_pages, page_size, Hk, D]``; ``block_table`` int32
``[B, max_pages]``; ``seq_lens`` int32 ``[B]`` (the query sits at position ``seq_lens[b] - 1``).

Design:
- GQA packing: one program owns one (sequence, KV head, split) and all ``Hq / Hk`` query heads of
  that KV head, so each K/V tile is read from DRAM once per KV head rather than once per query head.
  The query heads form the M side of ``tl.dot`` (padded to 16 rows, the MMA minimum); decode is
  bandwidth-bound, so the padded rows cost nothing that matters.
- Split-K (flash-decoding): the key range of each sequence is cut into ``num_splits`` chunks that run
  as separate programs; each writes an fp32 partial output and its log-sum-exp, and a second kernel
  merges them. The split count depends only on static shapes (batch, KV heads, block-table width),
  never on sequence lengths read from the device, so the launch is CUDA-graph safe. It is a runtime
  argument, not a compile-time one: eager decode (hybrid models, batches past the captured sizes)
  sees a new batch size almost every step, and a constexpr split count compiled a new kernel for
  each (measured on the H200: one ~0.1 s compile per decode step of the hybrid benchmark,
  results/h200/sweeps/probe_hybrid_host.json).
- Keys are gathered row by row through the block table, so any power-of-two page size works and a
  tile may span several pages; a page of 16 tokens is still ``16 * D * 2`` contiguous bytes.
- With PDL (decode launches over <= 4 rows, ``ops/pdl.py``) each program reads its sequence length,
  block-table entries and the first tile's keys/values other than the newest row before waiting for
  the previous kernel (the RoPE / KV-write kernel, which writes only the newest row); the query and
  that row are read after. Batch-1 decode step of the 8B shape: 4.331 -> 4.314 ms bf16, 2.775 ->
  2.748 ms FP8 weight-only, 2.806 -> 2.754 ms W4A16 (results/h200/sweeps/probe_bs1_decode_prewait.json).
  Without PDL the kernel is the plain loop (``PREWAIT`` off).
- Sliding window / softcap are compile-time switches; softmax runs in base 2 with the scale and
  ``log2(e)`` folded into one multiply.
- Attention sinks (``sinks [Hq]`` fp32, GPT-OSS; compile-time ``HAS_SINKS``): one more term
  ``exp(sink)`` of each head's softmax denominator, with no value. It enters once, after the key loop:
  without split-K in the decode kernel (``l = l * 2^(m - m') + 2^(sink * log2e - m')`` with the running
  max ``m' = max(m, sink * log2e)``, the accumulator rescaled alike), with split-K in the merge kernel
  (a term of the merged denominator beside the splits' log-sum-exps), so no split counts it twice.
- Quantized KV (int8 / float8_e4m3fn codes, fp32 scale per (token, KV head) in
  ``[num_pages, page_size, Hk]``, see ``ops/kv_cache/quant.py``): tiles load as 1-byte codes (half the
  DRAM traffic of bf16) and convert to q's dtype in registers; the scales never touch the D axis.
  ``q . (c_j s_j) = s_j (q . c_j)`` scales the score columns, and ``sum_j p_j s_j c_j`` folds the V
  scale into ``p`` before the PV dot. int8 codes are exact in bf16/fp16. FP8 uses Triton's e4m3
  conversion where the GPU has it (sm89+); elsewhere the byte is reinterpreted as an fp16 bit
  pattern, ``(x & 0x80) << 8 | (x & 0x7F) << 7`` = value * 2**-8 (exact, subnormals included; the
  same trick as ``quant/wo_tiles.py``'s ``_fp8_as_operand``), with the 2**8 folded into the scales.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from infercore.devices import capability, register, triton_interpreter
from infercore.ops.pdl import pdl_enabled, pdl_launch, pdl_release, pdl_wait
from infercore.ops.rope.triton import _last_dim_contiguous, rope_lanes, rotate_heads

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

# Tuning knobs (H200, bf16, D=128); `benchmarks/bench_ops.py --sweep decode` explores them. Measured
# 2026-11-30 at batch 64 / ctx 4096 / 32:8 heads: block_n 64 with 4 warps is best (0.26 ms, 4.1 TB/s,
# 0.96-0.98x SDPA); 2 vs 3 stages and 1 vs 2 splits are within run-to-run noise there. At batch 1
# (8 KV heads, ~640 keys) the step is latency-bound: one 64-key tile per split (min_split_tokens 64)
# instead of ~4 sequential ones (256). Batch-1 decode of the 8B shape, two runs of one session with
# PDL on: 216.8 tok/s with 256 (results/h200/sweeps/decode_step_pdl.json), 227.5 with 64
# (results/h200/decode_step.json). 32 measured faster again at batch 1 (graph replay, 577 keys in a
# 640-key block table: bf16 4.071 -> 4.061 ms, FP8 weight-only 2.550 -> 2.524; 128: 4.124 / 2.605;
# results/h200/sweeps/probe_bs1_attn_min_split.json), although there the same 10 splits hold keys
# (chunks are 64-key aligned) and the other 10 programs are empty. W4A16 measured 0.5% slower with it
# (2.681 -> 2.696 ms, same file). It changes the split count only where batch x KV heads leaves the
# GPU short of programs (up to 6 sequences at that length). Merging
# the splits in the decode kernel (the last split of each sequence / KV head, by an arrival counter)
# instead of the merge kernel measured slower at batch 1:
# 219.9 vs 229.1 tok/s in one session (sweeps/decode_step_fused_merge.json vs
# sweeps/decode_step_merge_kernel.json; that kernel is in commit 5a7fa22), so the merge stays a
# second launch.
TUNING = {
    # With PDL, the first tile's rows older than this step are read before waiting for the
    # predecessor (the RoPE / KV-write kernel); INFERCORE_DECODE_PREWAIT=0 reads everything after.
    "prewait": os.environ.get("INFERCORE_DECODE_PREWAIT", "1") != "0",
    "block_n": 64,
    # 1-byte caches: keys per tile and warps per program, int8 (``_codes``) and FP8 (``_fp8``). With the operand
    # paths below (kv_v16, fp8_f16) 32 keys per warp measured best at b64 ctx4096, and fewer warps per program
    # (more programs per SM) better: int8 64 keys / 2 warps 225 us (128 / 4: 248; 32 / 1: 230), FP8 32 / 1 202 us
    # (64 / 2: 217; 128 / 4: 245), emulated FP8 32 / 1 217 us (64 / 2: 237; 128 / 4: 253); 64 keys on one warp
    # or 32 on two read 295-340 us (results/h200/sweeps/kvquant_grid4.json, kvquant_grid5.json).
    "block_n_codes": 64,
    "num_warps_codes": 2,
    "block_n_fp8": 32,
    "num_warps_fp8": 1,
    "num_warps": 4,
    "num_stages": 3,
    "target_programs_per_sm": 4,
    "min_split_tokens": 32,
    # Register cap of the fused RoPE variant launched without PDL (larger batches, where resident programs
    # matter): it needs ~165 registers against the plain kernel's 128 (offline sm90 compile); capped, it
    # spills 8-32 bytes. Even so the batch-256 step measured 5% slower fused (12.258 -> 12.874 ms,
    # results/h200/sweeps/probe_fused_rope_attention.json), which is why the Llama layer only fuses at
    # <= 4 sequences by default. 0: no cap.
    "fused_maxnreg": 128,
    # 1-byte caches on a GPU. Two alternating rounds at b64 ctx4096 (32/8 heads, d128, page 16, then with 128-key
    # tiles on 4 warps; results/h200/sweeps/kvquant_grid3.json, old -> new, bf16 cache 270 us):
    # - kv_v16: V converted to 16 bits in registers before its shared-memory staging (``_opaque16``). Triton
    #   otherwise stages the 1-byte codes and reads V (the PV dot's B operand, keys along K) back one byte per
    #   shared load, 128 loads a thread per 128-key tile. int8 280 -> 248 us.
    # - fp8_f16: fp16 dot operands for FP8 caches (bf16 q saturated to +-65504; e4m3 codes are exact in fp16):
    #   no fp16 -> bf16 step per element, and the emulated decode in four PTX instructions per four bytes
    #   (``_e4m3_bytes_to_f16_asm``). With kv_v16, native FP8 272 -> 245 us, emulated 327 -> 252 us.
    #   int8 stays on bf16 operands: Triton converts int8 to fp16 with I2F (268 us, sweeps/kvquant_grid.json).
    "kv_v16": True,
    "fp8_f16": True,
}


@triton.jit
def _decode_load(kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, bt_row, kpos, nmask, kvh, offs_d, dmask,
                 stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ksp, stride_kss,
                 stride_vsp, stride_vss, code_scale, q_dtype: tl.constexpr, PAGE: tl.constexpr,
                 KV_MODE: tl.constexpr, V16: tl.constexpr = False, F16: tl.constexpr = False):
    """K, V of keys ``kpos`` where ``nmask`` (masked keys: 0): the float cache's dtype, or quantized
    codes converted to ``q_dtype`` (fp16 with ``F16``) with their per-key scales (masked: 0). ``V16``: V is
    converted before its shared-memory staging (see ``_opaque16``)."""
    page = tl.load(bt_row + kpos // PAGE, mask=nmask, other=0).to(tl.int64)
    row = kpos % PAGE
    kvmask = nmask[:, None] & dmask[None, :]
    k_rows = page * stride_kp + row * stride_ks + kvh * stride_kh
    v_rows = page * stride_vp + row * stride_vs + kvh * stride_vh
    k = tl.load(kc_ptr + k_rows[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
    v = tl.load(vc_ptr + v_rows[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
    if KV_MODE == 0:
        k_sc = nmask.to(tl.float32)  # unused
        v_sc = k_sc
    else:
        if KV_MODE == 3:
            if F16:  # four bytes -> four fp16 in four ALU operations
                k = _e4m3_bytes_to_f16_asm(k)
                v = _e4m3_bytes_to_f16_asm(v)
            else:
                k = _e4m3_bytes_to_f16(k)
                v = _e4m3_bytes_to_f16(v)
        if F16:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        else:
            k = k.to(q_dtype)
            v = v.to(q_dtype)
        if V16:
            v = _opaque16(v)
        # Masked keys get scale 0: their scores are replaced by -inf below, their p by 0.
        k_sc = tl.load(ksc_ptr + page * stride_ksp + row * stride_kss + kvh, mask=nmask, other=0.0) * code_scale
        v_sc = tl.load(vsc_ptr + page * stride_vsp + row * stride_vss + kvh, mask=nmask, other=0.0) * code_scale
    return k, v, k_sc, v_sc


@triton.jit
def _decode_tile(q, k, v, k_sc, v_sc, nmask, m_i, l_i, acc, qk_scale, scale, softcap,
                 HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_MODE: tl.constexpr):
    """Online-softmax update of ``(m_i, l_i, acc)`` with one tile of keys (at least one unmasked)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if KV_MODE != 0:
        s = s * k_sc[None, :]
    if HAS_SOFTCAP:
        # softcap * tanh(x / softcap), tanh(z) = 2 sigmoid(2z) - 1 (no libdevice needed).
        s = softcap * (2.0 * tl.sigmoid(2.0 * (s * scale) / softcap) - 1.0) * _LOG2E
    else:
        s = s * qk_scale
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds at least one key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_MODE == 0:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    else:
        pv = p * v_sc[None, :]
        acc = tl.dot(pv.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _rope_new_token(q_ptr, kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, b, kvh, GROUP, HEAD_DIM,
                    offs_g, offs_d, dmask, start, end, seq_len, stride_qb, stride_qh, stride_knb, stride_knh,
                    stride_vnb, stride_vnh, stride_cs, ROT, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                    stride_vh, PAGE: tl.constexpr, IS_NEOX: tl.constexpr):
    """FUSE_ROPE: this program's query heads rotated (``[BLOCK_G, BLOCK_D]`` in q's dtype), and the new
    token's rotated key and value row of its KV head (``[BLOCK_D]`` in the cache dtype, rounded as the
    unfused RoPE / KV-write kernel rounds them). The one program whose key range holds the newest
    position writes that row into the cache slot (``slot_mapping``; -1 skips the write), for later steps."""
    pos = tl.load(pos_ptr + b).to(tl.int64)
    rot, partner, sign, cos, sin = rope_lanes(cs_ptr, pos, stride_cs, ROT, offs_d, IS_NEOX)
    q, _ = rotate_heads(q_ptr + b.to(tl.int64) * stride_qb + (kvh * GROUP) * stride_qh, stride_qh, GROUP, HEAD_DIM,
                        offs_g, offs_d, partner, rot, sign, cos, sin)  # fmt: skip
    q = q.to(q_ptr.dtype.element_ty)
    k_row = kn_ptr + b.to(tl.int64) * stride_knb + kvh * stride_knh
    kx = tl.load(k_row + offs_d, mask=dmask, other=0.0).to(tl.float32)
    kp = tl.load(k_row + partner, mask=dmask & rot, other=0.0).to(tl.float32)
    k_new = tl.where(rot, kx * cos + sign * kp * sin, kx).to(kc_ptr.dtype.element_ty)
    v_new = tl.load(vn_ptr + b.to(tl.int64) * stride_vnb + kvh * stride_vnh + offs_d, mask=dmask,
                    other=0.0).to(vc_ptr.dtype.element_ty)
    if (start <= seq_len - 1) & (seq_len - 1 < end):
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE
            off = slot % PAGE
            tl.store(kc_ptr + page * stride_kp + off * stride_ks + kvh * stride_kh + offs_d, k_new, mask=dmask)
            tl.store(vc_ptr + page * stride_vp + off * stride_vs + kvh * stride_vh + offs_d, v_new, mask=dmask)
    return q, k_new, v_new


# Arguments that change with the batch (the block table's width, the split count and the partials'
# strides that follow from it) are not specialized: Triton compiles a variant per value class (== 1,
# divisible by 16), and eager steps of new shapes -- a mixed step's decodes in a serving run -- compiled
# those variants mid-run.
@triton.jit(do_not_specialize=["stride_bt", "stride_lb", "stride_lh", "num_splits"])
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, seq_lens_ptr, bt_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, sinks_ptr,
    qk_scale, scale, softcap, window, code_scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ksp, stride_kss, stride_vsp, stride_vss,
    stride_bt, stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP, num_splits,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs, ROT,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: partials to mid_o / mid_lse for the merge kernel
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_MODE: tl.constexpr,  # 0 float cache, 1 int8, 2 fp8 (native convert), 3 fp8 bytes (emulated)
    PREWAIT: tl.constexpr = False,  # the first tile's older rows first (before pdl_wait; FUSE_ROPE: its RoPE)
    USE_PDL: tl.constexpr = False,
    FUSE_ROPE: tl.constexpr = False,  # q, k_new, v_new un-rotated: RoPE + this token's KV write here
    IS_NEOX: tl.constexpr = True,
    V16: tl.constexpr = False,  # 1-byte caches: V converted to 16 bits before its shared-memory staging
    F16: tl.constexpr = False,  # 1-byte caches: fp16 dot operands (q saturated to the fp16 range)
    HAS_SINKS: tl.constexpr = False,  # sinks_ptr [Hq] fp32: added here without SPLIT, by the merge kernel with it
):  # fmt: skip
    pdl_release(USE_PDL)
    if not PREWAIT:
        pdl_wait(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # PREWAIT: sequence lengths and block tables are filled before the step's first kernel, and cache
    # rows other than the newest one (position seq_len - 1, which this step's RoPE/KV-write kernel
    # writes) by earlier steps, so they are read before pdl_wait while the predecessor still runs.
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # Each split takes a BLOCK_N-aligned chunk of this sequence's visible keys [lo, seq_len).
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    dmask = offs_d < HEAD_DIM
    if PREWAIT:  # the first tile, all but the newest row (bt_row below is the same address, set
        # after the wait so that the kernel without PREWAIT keeps its old instruction order)
        kpos = start + offs_n
        k, v, k_sc, v_sc = _decode_load(kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, bt_ptr + b.to(tl.int64) * stride_bt, kpos,
                                        (kpos < end) & (kpos < seq_len - 1), kvh, offs_d, dmask, stride_kp, stride_ks,
                                        stride_kh, stride_vp, stride_vs, stride_vh, stride_ksp, stride_kss, stride_vsp,
                                        stride_vss, code_scale, q_ptr.dtype.element_ty, PAGE, KV_MODE, V16,
                                        F16)  # fmt: skip
        pdl_wait(USE_PDL)
    if FUSE_ROPE:
        q, k_new, v_new = _rope_new_token(q_ptr, kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, b, kvh,
                                          GROUP, HEAD_DIM, offs_g, offs_d, dmask, start, end, seq_len, stride_qb,
                                          stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs, ROT,
                                          stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE,
                                          IS_NEOX)
    else:
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        )
    if KV_MODE == 0:
        q = q.to(kc_ptr.dtype.element_ty)
    elif F16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    first = start
    if PREWAIT:
        first = start + BLOCK_N
        if start < end:
            kpos = start + offs_n
            newest = kpos == seq_len - 1
            if FUSE_ROPE:  # the newest row is this program's own rotated k and v
                k = tl.where(newest[:, None], k_new[None, :], k)
                v = tl.where(newest[:, None], v_new[None, :], v)
            elif start + BLOCK_N >= seq_len:  # this tile holds the newest row: read it now
                kn, vn, ksn, vsn = _decode_load(kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, bt_row, kpos, newest, kvh, offs_d,
                                                dmask, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                                                stride_vh, stride_ksp, stride_kss, stride_vsp, stride_vss,
                                                code_scale, q_ptr.dtype.element_ty, PAGE, KV_MODE, V16,
                                                F16)  # fmt: skip
                k = tl.where(newest[:, None], kn, k)
                v = tl.where(newest[:, None], vn, v)
                k_sc = tl.where(newest, ksn, k_sc)
                v_sc = tl.where(newest, vsn, v_sc)
            m_i, l_i, acc = _decode_tile(q, k, v, k_sc, v_sc, kpos < end, m_i, l_i, acc, qk_scale, scale, softcap,
                                         HAS_SOFTCAP, DOT_PRECISION, KV_MODE)
    loop_end = end
    if FUSE_ROPE:
        # The tile holding the newest row (the last one of the split that ends at seq_len) goes first,
        # so that k_new / v_new are dead before the K loop (kept live through it they cost ~60 registers
        # and half the resident programs); the order of tiles does not matter to the online softmax.
        last = start + (tl.maximum(end - 1 - start, 0) // BLOCK_N) * BLOCK_N
        if (end == seq_len) & (end > start) & (last >= first):
            loop_end = last
            kpos = last + offs_n
            nmask = kpos < end
            newest = kpos == seq_len - 1  # not in the cache yet from this kernel's view: use k_new / v_new
            k, v, k_sc, v_sc = _decode_load(kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, bt_row, kpos, nmask & ~newest,
                                            kvh, offs_d, dmask, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                                            stride_vh, stride_ksp, stride_kss, stride_vsp, stride_vss, code_scale,
                                            q_ptr.dtype.element_ty, PAGE, KV_MODE, V16, F16)  # fmt: skip
            k = tl.where(newest[:, None], k_new[None, :], k)
            v = tl.where(newest[:, None], v_new[None, :], v)
            m_i, l_i, acc = _decode_tile(q, k, v, k_sc, v_sc, nmask, m_i, l_i, acc, qk_scale, scale, softcap,
                                         HAS_SOFTCAP, DOT_PRECISION, KV_MODE)
    for j0 in range(first, loop_end, BLOCK_N):
        kpos = j0 + offs_n
        nmask = kpos < end
        k, v, k_sc, v_sc = _decode_load(kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, bt_row, kpos, nmask, kvh, offs_d, dmask,
                                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ksp,
                                        stride_kss, stride_vsp, stride_vss, code_scale, q_ptr.dtype.element_ty, PAGE,
                                        KV_MODE, V16, F16)
        m_i, l_i, acc = _decode_tile(q, k, v, k_sc, v_sc, nmask, m_i, l_i, acc, qk_scale, scale, softcap,
                                     HAS_SOFTCAP, DOT_PRECISION, KV_MODE)

    if HAS_SINKS and not SPLIT:
        # The sink joins the denominator once, after the loop (m_i is -inf for an empty range: l = 1, o = 0).
        sink = tl.load(sinks_ptr + heads, mask=gmask, other=0.0) * _LOG2E
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    _store_decode_out(acc, m_i, l_i, heads, gmask, offs_d, dmask, b, split, out_ptr, mid_o_ptr, mid_lse_ptr,
                      stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, SPLIT)


@triton.jit
def _store_decode_out(acc, m_i, l_i, heads, hmask, offs_d, dmask, b, split, out_ptr, mid_o_ptr, mid_lse_ptr,
                      stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                      SPLIT: tl.constexpr):  # fmt: skip
    """A decode program's end: ``acc / l`` into the output rows ``[b, heads, offs_d]`` (one split), or with ``SPLIT``
    as the split's fp32 partial and its base-2 log-sum-exp ``m + log2(l)`` for :func:`_merge_kernel`. Empty ranges
    (padding rows with seq_len 0, or a split past the end) produce zeros / lse -inf."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    omask = hmask[:, None] & dmask[None, :]
    if not SPLIT:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        base = b.to(tl.int64) * stride_mb + split * stride_ms
        tl.store(mid_o_ptr + base + heads[:, None] * stride_mh + offs_d[None, :], o, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=hmask)


# TUNING keys of the tile and warps per KV mode: 0 a 16-bit cache, 1 int8, 2 / 3 FP8 (native / emulated).
_TILE_KEYS = {0: ("block_n", "num_warps"), 1: ("block_n_codes", "num_warps_codes"),
              2: ("block_n_fp8", "num_warps_fp8"), 3: ("block_n_fp8", "num_warps_fp8")}


@triton.jit
def _opaque16(x):
    """``x`` (a 16-bit tensor) unchanged, through an opaque move. Placed after the 1-byte -> 16-bit conversion of V,
    it keeps Triton from moving the conversion behind the shared-memory staging of the dot operand: staged as 1-byte
    codes, V (the PV dot's B operand, keys along K) is read back with one narrow shared load per byte (128 a thread
    per 128-key tile); staged as 16 bits it is read with ``ldmatrix.trans`` (16 a thread)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def _e4m3_bytes_to_f16_asm(c):
    """:func:`_e4m3_bytes_to_f16` in PTX (GPU only): per four bytes two ``prmt`` place each byte in the high byte of a
    16-bit lane, then shift / mask / or build ``sign << 15 | (c & 0x7F) << 7``. Triton's own code for the int16 form
    measured ~6 instructions per byte (mostly PRMT / IMAD), this ~1."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t0, t1, u0, u1;\n"
        "prmt.b32 t0, $2, 0, 0x1404;\n"  # bytes [0, c0, 0, c1]
        "prmt.b32 t1, $2, 0, 0x3424;\n"  # bytes [0, c2, 0, c3]
        "shr.b32 u0, t0, 1;\n"
        "shr.b32 u1, t1, 1;\n"
        "and.b32 u0, u0, 0x3F803F80;\n"  # (c & 0x7F) << 7
        "and.b32 u1, u1, 0x3F803F80;\n"
        "and.b32 t0, t0, 0x80008000;\n"  # sign << 15
        "and.b32 t1, t1, 0x80008000;\n"
        "or.b32 $0, u0, t0;\n"
        "or.b32 $1, u1, t1; }",
        "=r,=r,r",
        [c],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _e4m3_bytes_to_f16(c):
    """uint8 e4m3 bytes -> fp16 equal to the e4m3 value times 2**-8 (exact, no FP8 instruction)."""
    x = c.to(tl.int16)
    return (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "num_splits"])
def _merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, sinks_ptr,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM, num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,  # sinks_ptr [Hq] fp32: one more term of the merged denominator
):  # fmt: skip
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < num_splits
    lse = tl.load(mid_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * _LOG2E
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    o = tl.load(mid_o_ptr + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                mask=smask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    denom = tl.sum(w, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_safe)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)  # fmt: skip


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _pick_splits(batch: int, kv_heads: int, max_ctx: int, device: torch.device) -> int:
    """Enough programs to fill the GPU, but never splits shorter than ``min_split_tokens``."""
    programs = max(batch * kv_heads, 1)
    want = triton.cdiv(TUNING["target_programs_per_sm"] * _num_sms(device), programs)
    cap = max(max_ctx // TUNING["min_split_tokens"], 1)
    return int(max(1, min(want, cap, 64)))


def _scale_strides(s: torch.Tensor, kv_mode: int) -> tuple[int, int]:
    return (s.stride(0), s.stride(1)) if kv_mode else (0, 0)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    fp8_emulation: bool | None = None,
    shared_seqs: bool = False,
    sinks: torch.Tensor | None = None,
    _rope: tuple | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache; see the module docstring for layouts.

    ``shared_seqs``: rows may be positions of one sequence (speculative verification run as decode rows,
    :attr:`AttentionMetadata.shared_seqs`), so a row reads keys this step wrote for other rows, not only its
    own newest one: the kernel then reads no cache row before its PDL wait.

    ``k_scale``/``v_scale`` fp32 ``[num_pages, page_size, Hk]`` are required for int8 /
    float8_e4m3fn caches. ``num_splits`` overrides the split-K factor (default: chosen from static
    shapes only); ``fp8_emulation`` forces (True) or forbids (False) the bit-trick FP8 decode
    (default: emulate where the GPU lacks native FP8). ``_rope`` (for :func:`rope_write_decode_attention`
    only): ``(k, v, positions, cos_sin_cache, slot_mapping, is_neox)`` of the new tokens, rotated and
    written by the kernel itself. ``sinks`` fp32 ``[Hq]``: per-head softmax sinks (see the module docstring).
    Returns ``[B, Hq, D]`` in ``q.dtype``; sequences with ``seq_lens == 0`` get zeros.
    """
    B, Hq, D = q.shape
    page_size, Hk = k_cache.shape[1], k_cache.shape[2]
    # Any page size works (pages are looked up per key); powers of two make // and % shifts.
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    group = Hq // Hk
    interp = triton_interpreter()
    if num_splits is None:
        num_splits = _pick_splits(B, Hk, block_table.shape[1] * page_size, q.device)
    block_d = max(triton.next_power_of_2(D), 16)
    block_g = max(triton.next_power_of_2(group), 16)
    mid_o, mid_lse = split_buffers(out, num_splits)
    kv_mode, code_scale = 0, 1.0
    if k_cache.dtype in (torch.int8, torch.float8_e4m3fn):
        if k_scale is None or v_scale is None:
            raise ValueError(f"paged_attention_decode: a {k_cache.dtype} cache needs k_scale/v_scale")
        kv_mode = 1
        if k_cache.dtype == torch.float8_e4m3fn:
            if fp8_emulation is None:
                fp8_emulation = q.device.type == "cuda" and not capability(q.device).native_fp8
            kv_mode = 3 if fp8_emulation else 2
            if fp8_emulation:
                k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
                code_scale = 256.0  # the fp16 bit pattern is the e4m3 value times 2**-8
    else:
        k_scale = v_scale = seq_lens  # unused pointers
    tile_key, warps_key = _TILE_KEYS[kv_mode]
    block_n = 16 if interp else TUNING[tile_key]
    dot_dtype = q.dtype if kv_mode else k_cache.dtype
    precision = "ieee" if dot_dtype == torch.float32 else "tf32"
    stages = TUNING["num_stages"]
    # Keep the pipelined K/V tiles within shared memory for wide heads or fp32 caches.
    while stages > 1 and 2 * stages * block_n * block_d * k_cache.element_size() > 160 * 1024:
        stages -= 1
    extra = {} if interp else {"num_warps": TUNING[warps_key], "num_stages": stages}
    use_pdl = pdl_enabled(q)
    if _rope is not None and not interp and not use_pdl and TUNING["fused_maxnreg"]:
        extra["maxnreg"] = TUNING["fused_maxnreg"]
    if _rope is None:  # unused pointers / strides
        fuse = {}
        kn = vn = pos = cs = slots = q
        rope_strides = (0, 0, 0, 0, 0, 0)
    else:
        kn, vn, pos, cs, slots, is_neox = _rope
        fuse = {"FUSE_ROPE": True, "IS_NEOX": bool(is_neox)}
        rope_strides = (kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cs.stride(0), cs.shape[-1])
    has_sinks = sinks is not None
    sinks_arg = sinks.contiguous() if has_sinks else out  # unused pointer without sinks
    _decode_kernel[(B, Hk, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, seq_lens, block_table, out, mid_o, mid_lse, sinks_arg,
        scale * _LOG2E.value, scale, softcap or 1.0, sliding_window or 0, code_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *_scale_strides(k_scale, kv_mode), *_scale_strides(v_scale, kv_mode), block_table.stride(0),
        out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        group, num_splits, kn, vn, pos, cs, slots, *rope_strides, D,
        PAGE=page_size, SPLIT=num_splits > 1, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        DOT_PRECISION=precision, KV_MODE=kv_mode,
        PREWAIT=(use_pdl or bool(fuse)) and TUNING["prewait"] and not shared_seqs, **fuse,
        V16=bool(kv_mode and not interp and TUNING["kv_v16"]),
        F16=bool(kv_mode in (2, 3) and not interp and TUNING["fp8_f16"] and q.dtype == torch.bfloat16),
        **({"HAS_SINKS": True} if has_sinks else {}), **extra, **pdl_launch(use_pdl),
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(mid_o, mid_lse, out, block_d, sinks=sinks_arg if has_sinks else None, use_pdl=use_pdl)
    return out


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partials of a decode launch writing ``out [B, H, D]``: fp32 ``[B, H, num_splits, D]`` outputs and
    ``[B, H, num_splits]`` log-sum-exps, or one-element placeholders when there is one split (unused pointers)."""
    B, H, D = out.shape
    if num_splits > 1:
        return (torch.empty((B, H, num_splits, D), dtype=torch.float32, device=out.device),
                torch.empty((B, H, num_splits), dtype=torch.float32, device=out.device))  # fmt: skip
    return out.new_empty((1, 1, 1, 1), dtype=torch.float32), out.new_empty((1, 1, 1), dtype=torch.float32)


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, block_d: int, *,
                 sinks: torch.Tensor | None = None, use_pdl: bool = False) -> None:  # fmt: skip
    """Launch :func:`_merge_kernel`: the splits of :func:`split_buffers` combined into ``out`` (``sinks`` fp32
    ``[H]``: one more term of each head's denominator)."""
    B, H, num_splits, D = mid_o.shape
    _merge_kernel[(B, H)](
        mid_o, mid_lse, out, out if sinks is None else sinks,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), D, num_splits,
        BLOCK_S=16 if num_splits <= 16 else max(64, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
        **({} if sinks is None else {"HAS_SINKS": True}), **pdl_launch(use_pdl),
    )  # fmt: skip


def rope_write_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_neox: bool = True,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE of the decode token's q / k, the write of its rotated k and its v into the paged cache,
    and decode attention, in the decode kernel (the RoPE / KV-write launch is gone; the split merge
    stays). The same result as ``rope_and_write_kv`` then ``paged_attention_decode``.

    q ``[B, Hq, D]``, k / v ``[B, Hk, D]`` un-rotated (the new token of each sequence, at position
    ``positions[b] = seq_lens[b] - 1``), ``slot_mapping`` ``[B]`` (-1: no cache write, e.g. padding
    rows), the rest as :func:`paged_attention_decode`. Float caches only (int8 / FP8 caches keep the
    unfused ops). ``sinks`` fp32 ``[Hq]``: per-head softmax sinks, as there."""
    # Shapes are checked by the public wrapper (ops.attention); models call this with their own.
    if k_cache.dtype in (torch.int8, torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"k_cache: rope_write_decode_attention takes float caches, got {k_cache.dtype}")
    k, v, cos_sin_cache = _last_dim_contiguous(k), _last_dim_contiguous(v), _last_dim_contiguous(cos_sin_cache)
    return paged_attention_decode(
        q, k_cache, v_cache, seq_lens=seq_lens, block_table=block_table, scale=scale, sliding_window=sliding_window,
        softcap=softcap, num_splits=num_splits, sinks=sinks,
        _rope=(k, v, positions.contiguous(), cos_sin_cache, slot_mapping.contiguous(), is_neox))  # fmt: skip


register(
    "paged_attention_decode", "triton", paged_attention_decode, priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)  # fmt: skip
register(
    "rope_write_decode_attention", "triton", rope_write_decode_attention, priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)  # fmt: skip
