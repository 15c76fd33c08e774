"""Triton attention with per-key scores (FlashTensor's two-kernel split): no ``[T, T]`` tensor anywhere.

Layout: q ``[T, Hq, D]``, k/v ``[T, Hk, D]``, sequences concatenated (``cu_seqlens`` int32 ``[B+1]``),
each causal over its own tokens; the head_dim axis contiguous.

K1 (``_fwd_kernel``) is a flash-attention forward: one program owns ``BLOCK_M`` queries of one
(sequence, query head), streams ``BLOCK_N``-key tiles with an fp32 online softmax (base 2, the scale
folded into the exponent), writes the output and the row log-sum-exp ``lse[h, i]`` (fp32, base 2, in
units of the scaled score: ``p[i, h, j] = exp2(s_ij * scale * log2(e) - lse[h, i])``). Tiles entirely
below the block's first query need no mask; only the diagonal band pays for it. Query blocks run
last-first so the longest (causal) programs start in the first wave.

K2 (``_key_scores_kernel``) owns ``BLOCK_N`` keys of one (sequence, KV head): it loads the key tile once,
then, for each query head of the group (or a ``1/split`` share of them), walks the query tiles that can
see those keys (``i >= j``, and only the last ``score_window`` queries when given), recomputes
``k q^T``, normalizes it with the stored LSE and sums the probabilities over the queries in registers.
Key tile 0 sees every query, so key tiles run first-first. With ``split > 1`` the group's query heads
are spread over ``split`` programs (more, shorter programs: GQA at a short context has few key tiles
per head) whose partial sums ``[T, Hk, split]`` are added afterwards.

Softcap (``softcap * tanh(s / softcap)``, tanh as ``2 sigmoid(2x) - 1``) applies in both kernels
before the softmax. Token offsets are int64 (a ragged batch may span more than 2**31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import capability, register, triton_interpreter

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

# Launch configs per head-dim bucket, chosen for the H200 in bf16 without measurement of this op (the
# benchmark, benchmarks/bench_attn_scores.py, sweeps alternatives and reports the best).
#   fwd:    K1, BLOCK_M queries x BLOCK_N keys.
#   scores: K2, BLOCK_N keys (the MMA's M side, kept in registers) x BLOCK_M queries per step.
TUNING = {
    64: {"fwd": {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
         "scores": {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3}},
    # head_dim 128: the best of the H200 sweep at 4k and 8k tokens (results/h200/attn_scores.json, "sweep"): K1
    # warp-specialized 128 x 128 tiles (0.30-0.32 ms at 4k against 0.34 for 128 x 64 plain); K2 64 x 128 (all
    # queries) or, with a SnapKV window, 32 x 128 with 4 warps and 4 stages (0.02-0.05 ms).
    128: {"fwd": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "warp_spec": True,
                  "maxnreg": 232},
          "scores": {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 3},
          "scores_window": {"block_m": 32, "block_n": 128, "num_warps": 4, "num_stages": 4}},
    256: {"fwd": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2},
          "scores": {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 2}},
}  # fmt: skip
_INTERPRETER_CONFIG = {"fwd": {"block_m": 16, "block_n": 16}, "scores": {"block_m": 16, "block_n": 16, "split": 1}}
_SMEM_BUDGET = 160 * 1024  # below Hopper's 227 KB per block, with room for layout conversions
_WAVES = 4  # K2 splits a GQA group over programs until the grid holds this many programs per SM


@triton.jit
def _capped(s, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw ``q . k`` -> softcapped score in log2 units (only with softcap; without, the callers fold the
    scale into one multiply)."""
    if HAS_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * (s * scale) / softcap) - 1.0) * _LOG2E
    return s


@triton.jit
def _load_rows(base, rows, stride, offs_d, rmask, dmask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """``[len(rows), BLOCK_D]`` tile of a ``[tokens, ..., D]`` tensor; ``base`` points at the sequence's
    first token and the head. Unmasked tiles lie inside the sequence and, with EVEN_D, load unpredicated."""
    ptrs = base + rows.to(tl.int64)[:, None] * stride + offs_d[None, :]
    if MASKED:
        if EVEN_D:
            t = tl.load(ptrs, mask=rmask[:, None], other=0.0)
        else:
            t = tl.load(ptrs, mask=rmask[:, None] & dmask[None, :], other=0.0)
    else:
        if EVEN_D:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=dmask[None, :], other=0.0)
    return t


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, offs_m, j0, L, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, dmask,
              qk_scale, scale, softcap,
              MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
              DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Online-softmax update of (acc, l, m) with the key/value tile at ``j0``."""
    kpos = j0 + offs_n
    nmask = kpos < L
    k = _load_rows(k_base, kpos, stride_kt, offs_d, nmask, dmask, MASKED, EVEN_D)
    s = _capped(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale, softcap, HAS_SOFTCAP)
    if MASKED:
        s = tl.where((kpos[None, :] <= offs_m[:, None]) & nmask[None, :], s, float("-inf"))
    if HAS_SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # scale > 0: it commutes with the max
    if MASKED:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_new)
    if HAS_SOFTCAP:
        p = tl.exp2(s - m_new[:, None])
    else:
        p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_rows(v_base, kpos, stride_vt, offs_d, nmask, dmask, MASKED, EVEN_D)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, out_ptr, lse_ptr,
    qk_scale, scale, softcap,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    NUM_HEADS, GROUP,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    h = tl.program_id(0) % NUM_HEADS
    b = tl.program_id(0) // NUM_HEADS
    start = tl.load(cu_ptr + b)
    L = tl.load(cu_ptr + b + 1) - start
    m0 = pid_m * BLOCK_M
    if m0 >= L:
        return
    kvh = h // GROUP
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < L
    dmask = offs_d < HEAD_DIM
    start64 = start.to(tl.int64)
    q = _load_rows(q_ptr + start64 * stride_qt + h * stride_qh, offs_m, stride_qt, offs_d, mmask, dmask, True,
                   EVEN_D)  # fmt: skip
    k_base = k_ptr + start64 * stride_kt + kvh * stride_kh
    v_base = v_ptr + start64 * stride_vt + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys j <= m0 are visible to every query of the block: whole tiles of them need no mask. The band
    # up to the block's last query (or the sequence end) is masked.
    c_mid = (m0 + 1) // BLOCK_N * BLOCK_N
    c_hi = tl.minimum(m0 + BLOCK_M, L)
    for j0 in tl.range(0, c_mid, BLOCK_N, warp_specialize=WARP_SPEC):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, offs_m, j0, L, k_base, v_base, stride_kt, stride_vt, offs_n,
                                  offs_d, dmask, qk_scale, scale, softcap, False, HAS_SOFTCAP, EVEN_D,
                                  DOT_PRECISION)  # fmt: skip
    for j0 in range(c_mid, c_hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, offs_m, j0, L, k_base, v_base, stride_kt, stride_vt, offs_n,
                                  offs_d, dmask, qk_scale, scale, softcap, True, HAS_SOFTCAP, EVEN_D,
                                  DOT_PRECISION)  # fmt: skip

    # Every valid row saw at least its own key, so l_i > 0 there; rows past the end are not stored.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    rows = (start + offs_m).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])  # fmt: skip
    tl.store(lse_ptr + h.to(tl.int64) * stride_lh + rows, m_i + tl.log2(l_safe), mask=mmask)


@triton.jit
def _score_tile(acc, k, kpos, i0, L, q_lo, q_base, lse_base, stride_qt, offs_m, offs_d, dmask,
                qk_scale, scale, softcap,
                MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Add the probabilities of the query tile at ``i0`` to each key's sum ``acc [BLOCK_N]``."""
    qpos = i0 + offs_m
    qmask = qpos < L
    q = _load_rows(q_base, qpos, stride_qt, offs_d, qmask, dmask, MASKED, EVEN_D)
    if MASKED:
        lse = tl.load(lse_base + qpos, mask=qmask, other=0.0)
    else:
        lse = tl.load(lse_base + qpos)
    st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N keys, BLOCK_M queries]
    if HAS_SOFTCAP:
        p = tl.exp2(_capped(st, scale, softcap, HAS_SOFTCAP) - lse[None, :])
    else:
        p = tl.exp2(st * qk_scale - lse[None, :])
    if MASKED:
        # Queries past the sequence end, before the key (causal) or before the observation window count
        # nothing. (Keys past the end see only such queries; their sums are not stored.)
        counted = (qpos[None, :] >= kpos[:, None]) & qmask[None, :]
        if HAS_WINDOW:
            counted = counted & (qpos[None, :] >= q_lo)
        p = tl.where(counted, p, 0.0)
    return acc + tl.sum(p, axis=1)


@triton.jit
def _key_scores_kernel(
    q_ptr, k_ptr, cu_ptr, lse_ptr, part_ptr, heads_ptr,
    qk_scale, scale, softcap, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lh, stride_pt, stride_ht,
    NUM_KV_HEADS, GROUP, SPLIT,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    STORE_HEADS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    si = pid % SPLIT
    kvh = (pid // SPLIT) % NUM_KV_HEADS
    b = pid // (SPLIT * NUM_KV_HEADS)
    start = tl.load(cu_ptr + b)
    L = tl.load(cu_ptr + b + 1) - start
    n0 = tl.program_id(1) * BLOCK_N
    if n0 >= L:
        return
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kpos = n0 + offs_n
    nmask = kpos < L
    dmask = offs_d < HEAD_DIM
    start64 = start.to(tl.int64)
    k = _load_rows(k_ptr + start64 * stride_kt + kvh * stride_kh, kpos, stride_kt, offs_d, nmask, dmask, True,
                   EVEN_D)  # fmt: skip

    # Query tiles that count: from the first query that sees key n0 (and is in the window) to the end.
    # Unmasked in the middle: tiles wholly at or after the tile's last key, inside the window, before L.
    if HAS_WINDOW:
        q_lo = tl.maximum(L - window, 0)
    else:
        q_lo = 0
    i_lo = tl.maximum(n0, q_lo) // BLOCK_M * BLOCK_M
    i_mid = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1, q_lo), BLOCK_M) * BLOCK_M
    i_full = L // BLOCK_M * BLOCK_M
    band_end = tl.minimum(i_mid, tl.cdiv(L, BLOCK_M) * BLOCK_M)
    tail_start = tl.maximum(i_mid, i_full)

    heads = GROUP // SPLIT
    h0 = kvh * GROUP + si * heads
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    rows = start64 + kpos
    for g in range(0, heads):
        h = h0 + g
        q_base = q_ptr + start64 * stride_qt + h * stride_qh
        lse_base = lse_ptr + h.to(tl.int64) * stride_lh + start64
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i0 in range(i_lo, band_end, BLOCK_M):
            acc = _score_tile(acc, k, kpos, i0, L, q_lo, q_base, lse_base, stride_qt, offs_m, offs_d, dmask,
                              qk_scale, scale, softcap, True, HAS_WINDOW, HAS_SOFTCAP, EVEN_D,
                              DOT_PRECISION)  # fmt: skip
        for i0 in range(i_mid, i_full, BLOCK_M):
            acc = _score_tile(acc, k, kpos, i0, L, q_lo, q_base, lse_base, stride_qt, offs_m, offs_d, dmask,
                              qk_scale, scale, softcap, False, HAS_WINDOW, HAS_SOFTCAP, EVEN_D,
                              DOT_PRECISION)  # fmt: skip
        for i0 in range(tail_start, L, BLOCK_M):
            acc = _score_tile(acc, k, kpos, i0, L, q_lo, q_base, lse_base, stride_qt, offs_m, offs_d, dmask,
                              qk_scale, scale, softcap, True, HAS_WINDOW, HAS_SOFTCAP, EVEN_D,
                              DOT_PRECISION)  # fmt: skip
        if STORE_HEADS:
            tl.store(heads_ptr + rows * stride_ht + h, acc, mask=nmask)
        total += acc
    tl.store(part_ptr + rows * stride_pt + kvh * SPLIT + si, total, mask=nmask)


def _fit_shared_memory(cfg: dict, rows: str, streamed: str, block_d: int, elem: int) -> dict:
    """Shrink a config (chosen for bf16) until its tiles fit in shared memory (fp32 inputs, head_dim 256):
    the ``rows`` tile held for the whole program plus ``num_stages`` pipelined ``streamed`` tiles (two of
    them, K and V, in K1). Fewer stages first, then narrower streamed tiles, then the held tile."""
    n_streamed = 2 if rows == "block_m" else 1

    def need(c):
        return (c[rows] + n_streamed * c.get("num_stages", 2) * c[streamed]) * block_d * elem

    while need(cfg) > _SMEM_BUDGET:
        if cfg.get("num_stages", 2) > 2:
            cfg["num_stages"] -= 1
        elif cfg[streamed] > 16:
            cfg[streamed] //= 2
        elif cfg[rows] > 16:
            cfg[rows] //= 2
        else:
            break
    return cfg


def default_config(q: torch.Tensor, k: torch.Tensor, B: int, max_seqlen: int, score_window: int | None) -> dict:
    """Launch configs of both kernels for these inputs (``{"fwd": {...}, "scores": {..., "split"}}``)."""
    block_d = max(triton.next_power_of_2(q.shape[2]), 16)
    if triton_interpreter():
        return {"fwd": dict(_INTERPRETER_CONFIG["fwd"]), "scores": dict(_INTERPRETER_CONFIG["scores"])}
    tuned = TUNING[min(max(block_d, 64), 256)]
    elem = q.element_size()
    fwd, sc = dict(tuned["fwd"]), dict(tuned.get("scores_window" if score_window is not None else "scores",
                                                   tuned["scores"]))
    if elem > 2 or block_d not in (64, 128):  # the tuned 16-bit tiles run as measured; shrink the others to fit
        fwd = _fit_shared_memory(fwd, "block_m", "block_n", block_d, elem)
        sc = _fit_shared_memory(sc, "block_n", "block_m", block_d, elem)
    # GQA at a short context has few key tiles per KV head: spread the group's query heads over more
    # programs until the grid fills the GPU a few times over (the causal work per key tile is uneven, so
    # more, shorter programs balance better). Windowed scores are cheap and even: one wave is enough.
    hq, hk = q.shape[1], k.shape[1]
    group = hq // hk
    target = capability(q.device).multiprocessors * (_WAVES if score_window is None else 1)
    base = B * hk * triton.cdiv(max(max_seqlen, 1), sc["block_n"])
    split = 1
    while split < group and base * split < target:
        split = next(s for s in range(split + 1, group + 1) if group % s == 0)
    sc["split"] = split
    if split > 1 and block_d == 128 and elem == 2 and score_window is None:
        # a GQA group spread over programs: 4 warps each (H200 sweep, Llama-3-8B shape: K2 0.217 vs 0.278 ms at 4k
        # tokens, 0.757 vs 1.011 at 8k, results/h200/sweeps/attn_scores_*_defaults.json)
        sc["num_warps"] = 4
    return {"fwd": fwd, "scores": sc}


def _launch_opts(cfg: dict) -> dict:
    return {k_: cfg[k_] for k_ in ("num_warps", "num_stages", "maxnreg") if k_ in cfg}


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (tf32 only matters for fp32 inputs, which get ieee)


def forward_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                     softcap: float | None, max_seqlen: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """K1 alone: ``(out [T, Hq, D] in q.dtype, lse [Hq, T] fp32)``, ``lse`` base 2 in units of the scaled
    score (see the module docstring). Inputs as in :func:`attention_with_key_scores` (head_dim contiguous,
    ``max_seqlen >= 1``); ``cfg``: ``{"block_m", "block_n", ["num_warps", "num_stages", "maxnreg",
    "warp_spec"]}``, ``warp_spec`` = Triton's warp specialization of the unmasked key loop (opt-in: not every
    Triton build takes it with pointer loads)."""
    T, Hq, D = q.shape
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Hq, T), dtype=torch.float32, device=q.device)
    grid = (cu_seqlens.shape[0] - 1) * Hq, triton.cdiv(max_seqlen, cfg["block_m"])
    _fwd_kernel[grid](
        q, k, v, cu_seqlens, out, lse,
        scale * _LOG2E.value, scale, 1.0 if softcap is None else softcap,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), Hq, Hq // k.shape[1],
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_D=max(triton.next_power_of_2(D), 16),
        HAS_SOFTCAP=softcap is not None, DOT_PRECISION=_precision(q.dtype), WARP_SPEC=cfg.get("warp_spec", False),
        **_launch_opts(cfg),
    )  # fmt: skip
    return out, lse


def scores_from_lse(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, lse: torch.Tensor, *, scale: float,
                    softcap: float | None, score_window: int | None, max_seqlen: int, cfg: dict,
                    head_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """K2 alone: ``(key_scores [T, Hk] fp32, head_scores [T, Hq] fp32 or None)`` from K1's ``lse``.
    ``cfg``: ``{"block_m", "block_n", "split", ["num_warps", "num_stages"]}``; ``split`` must divide
    ``Hq / Hk`` (ValueError)."""
    T, Hq, D = q.shape
    Hk = k.shape[1]
    group = Hq // Hk
    split = cfg.get("split", 1)
    if isinstance(split, bool) or not isinstance(split, int) or split < 1 or group % split:
        raise ValueError(f"attention_with_key_scores: config split {split!r} must divide the group size {group}")
    key_scores = torch.empty((T, Hk), dtype=torch.float32, device=q.device)
    heads = torch.empty((T, Hq), dtype=torch.float32, device=q.device) if head_scores else None
    # Partial sums per (KV head, share of its query heads); with split 1 they are the key scores.
    part = key_scores if split == 1 else torch.empty((T, Hk * split), dtype=torch.float32, device=q.device)
    hs = heads if heads is not None else part  # a placeholder when per-head scores are not stored
    grid = (cu_seqlens.shape[0] - 1) * Hk * split, triton.cdiv(max_seqlen, cfg["block_n"])
    _key_scores_kernel[grid](
        q, k, cu_seqlens, lse, part, hs,
        scale * _LOG2E.value, scale, 1.0 if softcap is None else softcap, score_window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0), part.stride(0), hs.stride(0),
        Hk, group, split,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_D=max(triton.next_power_of_2(D), 16),
        HAS_WINDOW=score_window is not None and score_window < max_seqlen, HAS_SOFTCAP=softcap is not None,
        STORE_HEADS=heads is not None, DOT_PRECISION=_precision(q.dtype), **_launch_opts(cfg),
    )  # fmt: skip
    if split > 1:
        torch.sum(part.view(T, Hk, split), dim=-1, out=key_scores)
    return key_scores, heads


def attention_with_key_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    score_window: int | None = None,
    max_seqlen: int | None = None,
    head_scores: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton implementation of :func:`~infercore.ops.attention.scores.attention_with_key_scores` (arguments
    checked there; see the module docstring for the kernels): :func:`forward_with_lse`, then
    :func:`scores_from_lse`. Returns ``(out [T, Hq, D] in q.dtype, key_scores [T, Hk] fp32, head_scores
    [T, Hq] fp32 or None)``. ``max_seqlen``: when None, read from ``cu_seqlens`` (one sync). ``config``:
    explicit launch configs ``{"fwd": {...}, "scores": {...}}`` as those functions take them (tests, the
    benchmark's sweep); None = :func:`default_config`."""
    T, Hq, D = q.shape
    Hk = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    B = cu_seqlens.shape[0] - 1
    if max_seqlen is None and T > 0 and B > 0:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if T == 0 or B == 0 or max_seqlen <= 0:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
        heads = torch.zeros((T, Hq), dtype=torch.float32, device=q.device) if head_scores else None
        return out, torch.zeros((T, Hk), dtype=torch.float32, device=q.device), heads
    cfg = config if config is not None else default_config(q, k, B, max_seqlen, score_window)
    out, lse = forward_with_lse(q, k, v, cu_seqlens, scale=scale, softcap=softcap, max_seqlen=max_seqlen,
                                cfg=cfg["fwd"])  # fmt: skip
    key_scores, heads = scores_from_lse(q, k, cu_seqlens, lse, scale=scale, softcap=softcap,
                                        score_window=score_window, max_seqlen=max_seqlen, cfg=cfg["scores"],
                                        head_scores=head_scores)  # fmt: skip
    return out, key_scores, heads


register(
    "attention_with_key_scores", "triton", attention_with_key_scores, priority=10,
    available=lambda cap: cap.is_cuda and cap.triton,
)  # fmt: skip
