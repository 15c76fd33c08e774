"""Triton paged prefill attention: ragged batch, causal, cached prefix / chunked prefill.

Layout: q ``[T, Hq, D]`` (sequences concatenated, ``cu_seqlens_q`` int32 ``[B+1]``); caches
``[num_pages, page_size, Hk, D]``; ``block_table`` int32 ``[B, max_pages]``; ``seq_lens`` int32 ``[B]``
counts each sequence's keys *including* this step's queries, which sit at its last ``q_len``
positions (everything before them is a cached prefix, so chunked prefill needs nothing special).

Flash-attention forward: one program owns ``BLOCK_M`` queries of one (sequence, query head), streams
``BLOCK_N``-key tiles gathered through the block table, and keeps an fp32 online softmax (base 2,
scale folded into one multiply). The key loop is split in two: tiles entirely below the first query
of the block need no mask, only the diagonal band pays for causal/window masking. The grid puts
(sequence, head) on the fast axis and walks query blocks last-first, so every head's longest (causal)
block starts in the first wave and the tail holds only short ones. Per-key cache offsets are int32 when
the cache allows it (the KV head goes into the base pointer). Warp specialization and TMA are switched
by the config; see ``_VARIANT_DEFAULTS``.

With this step's keys/values passed as contiguous ragged ``k``/``v`` ``[T, Hk, D]`` (as FlashAttention's
varlen and FlashInfer's ragged prefill take them), only the cached prefix ``[0, seq_len - q_len)`` is
gathered through the block table; the new tokens' tiles are plain row blocks of k/v, aligned to the
first new token and read with TMA descriptors (``tma``), which is what Triton's warp specialization
pipelines best. Without them, every key comes from the cache.

Attention sinks (``sinks [Hq]`` fp32, GPT-OSS; compile-time ``HAS_SINKS``) join each row's softmax denominator
once, after the key loops: ``l = l * 2^(m - m') + 2^(sink * log2e - m')`` with ``m' = max(m, sink * log2e)`` and the
accumulator rescaled alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from infercore.devices import register, triton_interpreter

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

# Tuning knobs per head-dim bucket (H200, bf16); `benchmarks/sweep_prefill_attn.py` explores the D=128
# one. Besides tile sizes, a config may carry the kernel variant switches (see `_VARIANT_DEFAULTS`).
TUNING = {
    64: {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    128: {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "warp_spec": True, "maxnreg": 232},
    256: {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2},
}
# With this step's K/V passed contiguously (the model's path); buckets not listed use `TUNING`.
# Both 128 entries: best of benchmarks/sweep_prefill_attn.py on the H200 (results/h200/prefill_attn.json;
# a register cap of 232 per thread measured 0.3-2% faster than none).
TUNING_NEW_KV = {
    128: {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "warp_spec": True, "tma": True,
          "maxnreg": 232},
}

# Variant switches (each a constexpr of the kernel). The H200 sweep (results/h200/prefill_attn.json) also
# measured a hand-pipelined QK^T, the block-fastest grid order, forced int64 offsets and a
# warp-specialized cached-prefix loop: none was faster, so they were removed.
#   warp_spec    `tl.range(..., warp_specialize=True)` on the interior loop (producer/consumer warps): the
#                new tokens' loop with k/v given, else the paged loop; only some Triton builds accept it
#                for pointer (non-TMA) loads, so it stays opt-in.
#   tma          with the new tokens' contiguous k/v given: read them through TMA tensor descriptors
#                (Hopper's bulk copies, which Triton's warp specialization pairs with best); off = pointer
#                loads of the same rows. The cached prefix always goes through the block table.
_VARIANT_DEFAULTS = {"warp_spec": False, "tma": True}
_LAUNCH_KEYS = {"block_m", "block_n", "num_warps", "num_stages", "maxnreg"}


@triton.jit
def _kv_rows(bt_row, j0, offs_n, seq_len, PAGE: tl.constexpr, MASKED: tl.constexpr, OFF64: tl.constexpr):
    """Key positions of the tile at ``j0``, their validity, and (page, row-in-page) of each key."""
    kpos = j0 + offs_n
    nmask = kpos < seq_len
    if MASKED:
        page = tl.load(bt_row + kpos // PAGE, mask=nmask, other=0)
    else:
        page = tl.load(bt_row + kpos // PAGE)
    if OFF64:
        page = page.to(tl.int64)
    return kpos, nmask, page, kpos % PAGE


@triton.jit
def _load_kv(c_ptr, page, row, stride_p, stride_s, offs_d, nmask, dmask,
             MASKED: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    # c_ptr already points at this KV head. Interior tiles lie below seq_len and, with EVEN_D, the loads
    # carry no predicate at all.
    ptrs = c_ptr + (page * stride_p + row * stride_s)[:, None] + offs_d[None, :]
    if MASKED:
        if EVEN_D:
            t = tl.load(ptrs, mask=nmask[:, None], other=0.0)
        else:
            t = tl.load(ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)
    else:
        if EVEN_D:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=dmask[None, :], other=0.0)
    return t


@triton.jit
def _scores(q, k, kpos, nmask, q_pos, scale, softcap, window,
            MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Raw scores ``q k^T``; with softcap already capped and in log2 units, masked with -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * (s * scale) / softcap) - 1.0) * _LOG2E
    if MASKED:
        visible = (kpos[None, :] <= q_pos[:, None]) & nmask[None, :]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _softmax_pv(acc, l_i, m_i, s, v, qk_scale,
                MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Online-softmax update of (acc, l, m) with the score tile ``s`` and its value tile ``v``."""
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
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # Accumulating inside the dot lets the MMA read the rescaled accumulator directly.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _tile(acc, l_i, m_i, q, q_pos, seq_len, j0, kc_ptr, vc_ptr, bt_row, offs_n, offs_d, dmask,
          stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, scale, softcap, window,
          PAGE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
          DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr, OFF64: tl.constexpr):  # fmt: skip
    kpos, nmask, page, row = _kv_rows(bt_row, j0, offs_n, seq_len, PAGE, MASKED, OFF64)
    k = _load_kv(kc_ptr, page, row, stride_kp, stride_ks, offs_d, nmask, dmask, MASKED, EVEN_D)
    s = _scores(q, k, kpos, nmask, q_pos, scale, softcap, window, MASKED, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION)
    v = _load_kv(vc_ptr, page, row, stride_vp, stride_vs, offs_d, nmask, dmask, MASKED, EVEN_D)
    return _softmax_pv(acc, l_i, m_i, s, v, qk_scale, MASKED, HAS_SOFTCAP, DOT_PRECISION)


@triton.jit
def _tile_new(acc, l_i, m_i, q, q_rel, q_len, r0, k_ptr, v_ptr, k_desc, v_desc, tok0, col, offs_n, offs_d, dmask,
              stride_kt, stride_vt, qk_scale, scale, softcap, window,
              MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
              DTYPE: tl.constexpr):  # fmt: skip
    """One key tile of this step's own tokens, read from the contiguous ragged ``k``/``v`` ``[T, Hk, D]``.

    Positions are relative to the sequence's first query (``q_rel``, ``r0``): the causal/window masks are
    shift-invariant, and tiles aligned to the first new token make the diagonal band the same as in a
    fresh prompt whatever the cached length. ``k_ptr``/``v_ptr`` already point at (first token, KV head).
    """
    kpos = r0 + offs_n
    nmask = kpos < q_len
    if USE_TMA:
        # Rows past this sequence belong to the next one (or are zero-filled past T): the score mask
        # hides them, and they are finite, so p = 0 keeps them out of P @ V.
        k = k_desc.load([tok0 + r0, col]).to(DTYPE)
    else:
        k = _load_kv(k_ptr, kpos, 0, stride_kt, 0, offs_d, nmask, dmask, MASKED, EVEN_D).to(DTYPE)
    s = _scores(q, k, kpos, nmask, q_rel, scale, softcap, window, MASKED, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION)
    if USE_TMA:
        v = v_desc.load([tok0 + r0, col]).to(DTYPE)
    else:
        v = _load_kv(v_ptr, kpos, 0, stride_vt, 0, offs_d, nmask, dmask, MASKED, EVEN_D).to(DTYPE)
    return _softmax_pv(acc, l_i, m_i, s, v, qk_scale, MASKED, HAS_SOFTCAP, DOT_PRECISION)


@triton.jit(do_not_specialize=["stride_bt"])  # the block table width changes with the batch
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, cu_ptr, seq_lens_ptr, bt_ptr, out_ptr, kn_ptr, vn_ptr, k_desc, v_desc,
    qk_scale, scale, softcap, window,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    NUM_HEADS, GROUP,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OFF64: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    NEW_KV: tl.constexpr,
    USE_TMA: tl.constexpr,
    seqs_ptr,
    sinks_ptr,
    HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    h = tl.program_id(0) % NUM_HEADS
    b = tl.program_id(0) // NUM_HEADS
    # The grid covers these sequences: all of them (0 .. B - 1), or a mixed step's others when its decodes
    # went to the decode kernel. Always read, so both cases share one compiled variant: a separate one
    # compiled in the first split mixed step of a run, ~1.1 s of it (results/h200/sweeps/
    # hybrid_e2e_split_compiles.json).
    b = tl.load(seqs_ptr + b)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # position of the first query of this sequence
    kvh = h // GROUP
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

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
    # The KV head offset goes into the base pointer once, so the per-key offsets can stay int32
    # (OFF64 is off whenever the whole cache has fewer than 2**31 elements).
    kc_ptr += kvh.to(tl.int64) * stride_kh
    vc_ptr += kvh.to(tl.int64) * stride_vh

    # Keys read through the block table: [0, c_hi), all of them unmasked below c_mid. With new k/v that
    # is the cached prefix [0, ctx), whose keys precede every query, so only the tile holding ctx (the
    # length mask) needs one; else it runs to the block's last query and the diagonal band is masked.
    # With a window every tile is masked, from the first one holding a visible key.
    first_q = ctx + pid_m * BLOCK_M
    if NEW_KV:
        c_len = ctx
        c_hi = ctx
    else:
        c_len = seq_len
        c_hi = tl.minimum(first_q + BLOCK_M, seq_len)  # one past the last query position of the block
    if HAS_WINDOW:
        c_lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
        c_mid = c_lo
    else:
        c_lo = 0
        if NEW_KV:
            c_mid = ctx // BLOCK_N * BLOCK_N
        else:
            # Keys < first_q + 1 are visible to every query of the block: no mask needed there.
            c_mid = (first_q + 1) // BLOCK_N * BLOCK_N
    # Warp specialization goes on the paged path's interior loop only: with new k/v it covers their loop.
    if NEW_KV or not HAS_WINDOW:
        for j0 in tl.range(c_lo, c_mid, BLOCK_N, warp_specialize=WARP_SPEC and not NEW_KV):
            acc, l_i, m_i = _tile(
                acc, l_i, m_i, q, q_pos, c_len, j0, kc_ptr, vc_ptr, bt_row, offs_n, offs_d, dmask,
                stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, scale, softcap, window,
                PAGE, False, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, EVEN_D, OFF64,
            )  # fmt: skip
    for j0 in range(c_mid, c_hi, BLOCK_N):
        acc, l_i, m_i = _tile(
            acc, l_i, m_i, q, q_pos, c_len, j0, kc_ptr, vc_ptr, bt_row, offs_n, offs_d, dmask,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, scale, softcap, window,
            PAGE, True, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, EVEN_D, OFF64,
        )  # fmt: skip

    if NEW_KV:
        # This step's tokens from the contiguous k/v, in coordinates relative to the first query.
        tok0 = q_start
        kn_ptr += tok0.to(tl.int64) * stride_knt + kvh.to(tl.int64) * stride_knh
        vn_ptr += tok0.to(tl.int64) * stride_vnt + kvh.to(tl.int64) * stride_vnh
        col = kvh * HEAD_DIM
        m0 = pid_m * BLOCK_M
        n_hi = tl.minimum(m0 + BLOCK_M, q_len)
        if HAS_WINDOW:
            n_lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
            n_mid = n_lo
        else:
            n_lo = 0
            n_mid = (m0 + 1) // BLOCK_N * BLOCK_N
        for r0 in tl.range(n_lo, n_mid, BLOCK_N, warp_specialize=WARP_SPEC):
            acc, l_i, m_i = _tile_new(
                acc, l_i, m_i, q, offs_m, q_len, r0, kn_ptr, vn_ptr, k_desc, v_desc, tok0, col, offs_n,
                offs_d, dmask, stride_knt, stride_vnt, qk_scale, scale, softcap, window,
                False, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, EVEN_D, USE_TMA, kc_ptr.dtype.element_ty,
            )  # fmt: skip
        for r0 in range(n_mid, n_hi, BLOCK_N):
            acc, l_i, m_i = _tile_new(
                acc, l_i, m_i, q, offs_m, q_len, r0, kn_ptr, vn_ptr, k_desc, v_desc, tok0, col, offs_n,
                offs_d, dmask, stride_knt, stride_vnt, qk_scale, scale, softcap, window,
                True, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, EVEN_D, USE_TMA, kc_ptr.dtype.element_ty,
            )  # fmt: skip

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * _LOG2E
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])  # fmt: skip


_INT32_SPAN = 2**31  # caches spanning this many elements or more take int64 key offsets (tests lower it)
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
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    only_seqs: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal prefill attention over the paged cache; see the module docstring for layouts.

    q fp32/fp16/bf16 ``[T, Hq, D]``; float caches ``[num_pages, page_size, Hk, D]`` whose head_dim axis is
    contiguous (else ValueError); the public :func:`~infercore.ops.paged_attention_prefill` validates
    the rest. ``max_seqlen_q`` sizes the launch grid; when None it is read from ``cu_seqlens_q`` (one device
    sync, so pass it inside CUDA graphs). ``k``/``v`` ``[T, Hk, D]`` (ragged like q, last dim
    contiguous) are this step's new keys/values: when given, keys at positions ``>= seq_len - q_len``
    are read from them (contiguous rows, TMA where possible) and only the cached prefix goes through
    the block table. ``only_seqs`` (int32 ``[S]``): compute these sequences only (the launch grid covers
    them alone); the other rows of the result are left unwritten (a mixed step's decodes, which the
    caller runs through the decode kernel: ``split_decodes``). ``sinks`` fp32 ``[Hq]``: per-head softmax sinks.
    Returns ``[T, Hq, D]`` in ``q.dtype``.
    """
    T, Hq, D = q.shape
    # Any page size works (pages are looked up per key); powers of two make // and % shifts.
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k is not None:
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
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
        cfg = {"block_m": 16, "block_n": 16, "tma": False}
    else:
        bucket = min(max(block_d, 64), 256)
        tuned = TUNING_NEW_KV.get(bucket, TUNING[bucket]) if k is not None else TUNING[bucket]
        cfg = _fit_shared_memory(dict(tuned), block_d, k_cache.element_size())
    _launch(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, scale, sliding_window, softcap,
            max_seqlen_q, cfg, k=k, v=v, seqs=only_seqs, sinks=sinks)  # fmt: skip
    return out


_ALL_SEQS: dict[torch.device, torch.Tensor] = {}


def _all_seqs(n: int, device: torch.device) -> torch.Tensor:
    """int32 ``0 .. n - 1`` on ``device``: a view of a cached arange (grown by doubling)."""
    t = _ALL_SEQS.get(device)
    if t is None or t.numel() < n:
        t = torch.arange(max(2 * n, 256), dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ALL_SEQS[device] = t  # (one made during a graph capture belongs to the graph's pool)
    return t[:n]


def _tma_ok(t: torch.Tensor, D: int) -> bool:
    """Whether ``t [T, Hk, D]`` can be read through a 2-D TMA descriptor over ``[T, Hk * D]`` with
    ``[BLOCK_N, D]`` boxes: heads packed, head_dim a power of two, 16-byte aligned base and row stride."""
    es = t.element_size()
    return (
        TensorDescriptor is not None and (t.is_cuda or triton_interpreter())
        and D == triton.next_power_of_2(D) and D * es >= 16 and t.stride(2) == 1 and t.stride(1) == D
        and t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0
    )  # fmt: skip


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    max_seqlen_q: int,
    cfg: dict,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    seqs: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Launch the kernel with an explicit config: ``block_m``, ``block_n`` and optionally ``num_warps``,
    ``num_stages``, ``maxnreg`` and the variant switches of ``_VARIANT_DEFAULTS`` (the sweep and the
    variant tests call this directly). ``k``/``v``: the new tokens' contiguous K/V (see
    :func:`paged_attention_prefill`); ``tma`` then picks descriptor loads for them when the layout allows
    (else pointer loads). ``sinks``: fp32 ``[Hq]`` softmax sinks, or None."""
    Hq, D = q.shape[1], q.shape[2]
    page_size, Hk = k_cache.shape[1], k_cache.shape[2]
    B = seq_lens.shape[0]
    unknown = set(cfg) - _LAUNCH_KEYS - set(_VARIANT_DEFAULTS)
    if unknown:
        raise ValueError(f"paged_attention_prefill: unknown config keys {sorted(unknown)}")
    var = {**_VARIANT_DEFAULTS, **{k_: v_ for k_, v_ in cfg.items() if k_ in _VARIANT_DEFAULTS}}
    extra = {k_: cfg[k_] for k_ in ("num_warps", "num_stages", "maxnreg") if k_ in cfg}
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    block_d = triton.next_power_of_2(max(D, 16))
    n_m = triton.cdiv(max_seqlen_q, block_m)
    grid = ((B if seqs is None else seqs.shape[0]) * Hq, n_m)
    # int32 key offsets are exact when the farthest element of each cache is (strides, not numel: a
    # cache may be a view into a larger buffer).
    span = lambda t: sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    spans = [span(k_cache), span(v_cache)] + ([span(k), span(v)] if k is not None else [])
    off64 = max(spans) >= _INT32_SPAN
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    new_kv = k is not None
    use_tma = new_kv and var["tma"] and D == block_d and _tma_ok(k, D) and _tma_ok(v, D)
    if use_tma:
        # Host-side descriptors (passed by value, no device scratch allocator needed); 2-D over
        # [T, Hk * D] so one box is one (key tile, KV head).
        T = k.shape[0]
        k_desc = TensorDescriptor(k, [T, Hk * D], [k.stride(0), 1], [block_n, D])
        v_desc = TensorDescriptor(v, [T, Hk * D], [v.stride(0), 1], [block_n, D])
    else:
        k_desc = v_desc = q  # unused
    kn, vn = (k, v) if new_kv else (q, q)  # placeholders when there are no new K/V
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, out, kn, vn, k_desc, v_desc,
        scale * _LOG2E.value, scale, softcap or 1.0, sliding_window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        Hq, Hq // Hk, D,
        PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        DOT_PRECISION=precision, OFF64=off64, WARP_SPEC=var["warp_spec"], NEW_KV=new_kv, USE_TMA=use_tma,
        seqs_ptr=_all_seqs(B, q.device) if seqs is None else seqs,
        sinks_ptr=q if sinks is None else sinks.contiguous(), **({"HAS_SINKS": True} if sinks is not None else {}),
        **extra,
    )  # fmt: skip


register(
    "paged_attention_prefill", "triton", paged_attention_prefill, priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)  # fmt: skip
