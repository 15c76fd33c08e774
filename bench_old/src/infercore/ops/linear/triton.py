"""Triton skinny GEMV/GEMM for decode: ``y = x @ W^T (+ bias)`` with few rows of ``x``.

At batch 1-16 a linear layer is a pure weight stream: each weight byte is read once and used
for at most 16 multiply-adds. cuBLAS picks tiles for larger M and leaves 20-60% of the HBM
bandwidth unused on the Llama-8B shapes with N = 4096-6144 (too few CTAs in flight). These
kernels exist only to keep enough 16-byte weight loads in flight on every SM:

* ``fma``: one program owns ``BLOCK_N`` weight rows x a K-range, loads ``[BLOCK_N, BLOCK_K]``
  tiles (K contiguous, so each thread issues 16-byte loads), multiplies by the ``BLOCK_M`` rows of
  x held in registers, and keeps an elementwise fp32 accumulator that is reduced over K once at
  the end (no cross-lane reduction inside the loop).
* ``dot``: the same weight stream but the product goes through ``tl.dot`` with M padded to 16
  (mma), for M = 8-16 where the elementwise accumulator would need too many registers.

Either variant can split K over ``SPLIT_K`` programs (grid axis 1) to get >= 4 programs per SM
on N = 4096; partial sums then go to an fp32 workspace ``[SPLIT_K, M, N]`` and a tiny second
kernel adds them (plus bias) and casts. Without split the bias and the cast are fused.

Layouts: ``x [M, K]`` (last dim contiguous), ``weight [N, K]`` row-major (nn.Linear), ``bias [N]``,
``y [M, N]`` in x.dtype. Accumulation is fp32 whatever the input dtype.

Gated-MLP epilogue (``act="silu" | "gelu_tanh" | "gelu"``): for a merged ``gate_up_proj`` weight
``[2D, K]`` (rows ``[0, D)`` gate, ``[D, 2D)`` up, the models' layout) each program streams gate row
``c`` and up row ``D + c`` side by side (interleaved in its tile) and writes ``act(g) * u`` ``[M, D]``
directly: ``ops.silu_and_mul``/``gelu_and_mul`` of the ``[M, 2D]`` GEMV output, without the extra
launch or the round trip. The activation is evaluated once per output element (in the consumer's
prologue it would be re-evaluated by every program of the down projection). g and u are rounded to
x.dtype first, as the unfused path stores them, so both paths agree to the last rounding.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from infercore.devices import register
from infercore.ops.pdl import GEMV_PREWAIT, pdl_enabled, pdl_launch, pdl_release, pdl_wait

from .naive import skinny_linear_ref


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. ``block_m`` is derived from M at launch (``fma``: next power of two
    of min(M, 4), more rows take more programs; ``dot``: 16), so a config serves its whole M bucket."""

    variant: str = "fma"  # "fma" | "dot"
    block_n: int = 4
    block_k: int = 512
    num_warps: int = 4
    split_k: int = 1
    evict_first: bool = True
    num_stages: int = 3

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# Tuned on an H200 (benchmarks/sweep_gemv.py; its "best" output pastes here). Key:
# (N, K, M-bucket) with M-bucket in 1, 2, 4, 8, 16. Value: (config, speedup over cuBLAS).
# H200, bf16, 2026 sweep (weights cold in L2, CUDA graph of many calls): the GEMV wins at M = 1
# (1.01-1.18x, o_proj most); at M >= 2 cuBLAS is as fast or faster except o_proj M = 8-16.
# Entries with speedup < 1 stay on purpose: they are the measured best config of *this* kernel,
# which the op (skinny_linear, pick_config) still launches when called; only the model-level swap
# (models.gpu_layout, through beats_cublas) leaves those shapes to cuBLAS.
TUNED: dict[tuple[int, int, int], tuple[GemvConfig, float]] = {
    (6144, 4096, 1): (GemvConfig("fma", 4, 1024, 4, 1), 1.078),
    (6144, 4096, 2): (GemvConfig("dot", 64, 128, 4, 4), 0.938),
    (6144, 4096, 4): (GemvConfig("dot", 64, 128, 4, 4), 0.951),
    (6144, 4096, 8): (GemvConfig("dot", 64, 128, 4, 4), 0.922),
    (6144, 4096, 16): (GemvConfig("dot", 32, 128, 4, 2), 0.94),
    (4096, 4096, 1): (GemvConfig("fma", 1, 2048, 4, 1), 1.185),
    (4096, 4096, 2): (GemvConfig("fma", 2, 1024, 4, 1, evict_first=False), 0.982),
    (4096, 4096, 4): (GemvConfig("dot", 64, 128, 4, 4), 0.987),
    (4096, 4096, 8): (GemvConfig("dot", 64, 128, 4, 4), 1.005),
    (4096, 4096, 16): (GemvConfig("dot", 64, 128, 4, 4), 1.029),
    (28672, 4096, 1): (GemvConfig("fma", 4, 1024, 4, 1), 1.014),
    (28672, 4096, 2): (GemvConfig("dot", 64, 128, 4, 1), 0.87),
    (28672, 4096, 4): (GemvConfig("dot", 64, 128, 4, 1), 0.891),
    (28672, 4096, 8): (GemvConfig("dot", 64, 128, 4, 1), 0.915),
    (28672, 4096, 16): (GemvConfig("dot", 32, 128, 4, 1), 0.993),
    (4096, 14336, 1): (GemvConfig("fma", 2, 1024, 4, 1), 1.038),
    (4096, 14336, 2): (GemvConfig("dot", 64, 128, 4, 4), 0.951),
    (4096, 14336, 4): (GemvConfig("dot", 64, 128, 4, 4), 0.982),
    (4096, 14336, 8): (GemvConfig("dot", 64, 128, 4, 4), 0.988),
    (4096, 14336, 16): (GemvConfig("dot", 32, 128, 4, 4), 0.994),
    (128256, 4096, 1): (GemvConfig("fma", 4, 1024, 4, 1), 1.049),
    (128256, 4096, 2): (GemvConfig("dot", 64, 128, 4, 1), 0.982),
    (128256, 4096, 4): (GemvConfig("dot", 64, 128, 4, 1), 0.983),
    (128256, 4096, 8): (GemvConfig("dot", 64, 128, 4, 1), 0.988),
    (128256, 4096, 16): (GemvConfig("dot", 64, 128, 4, 1), 1.03),
}

# Untuned shapes: 4 rows x 512 K per program streams 4 KB per iteration per program; with
# N >= 4096 that is >= 1024 programs, several per SM.
DEFAULT = GemvConfig()
DEFAULT_DOT = GemvConfig(variant="dot", block_n=16, block_k=256, num_warps=4, split_k=1)

# The gated epilogue (``act=...``), keyed like TUNED by the *merged* weight's (N = 2D, K, M-bucket);
# the speedup is over cuBLAS ``F.linear`` followed by the ``*_and_mul`` kernel (both in one CUDA
# graph, so the saved launch counts). ``block_n`` counts weight rows (gate + up), so it is even.
# Untuned shapes fall back to TUNED's config for the merged shape (block_n rounded up to even).
TUNED_ACT: dict[tuple[int, int, int], tuple[GemvConfig, float]] = {
    # benchmarks/bench_decode_step.py on the H200 (results/h200/decode_step.json): 54.3 us vs 59.9 us
    # for cuBLAS + silu_and_mul.
    (28672, 4096, 1): (GemvConfig(variant="fma", block_n=2, block_k=1024, num_warps=4, split_k=1,
                                  evict_first=True, num_stages=3), 1.103),
}

ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2, "gelu": 3}
_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
_INV_SQRT_2: tl.constexpr = tl.constexpr(0.7071067811865476)


def m_bucket(m: int) -> int:
    """1, 2, 4, 8 or 16 (M above 16 shares the 16 bucket)."""
    b = 1
    while b < m and b < 16:
        b *= 2
    return b


def _tuned(n: int, k: int, m: int, act: str | None) -> tuple[GemvConfig, float] | None:
    # With act the fused-epilogue table wins where it has the shape; otherwise the plain GEMV's
    # entry for the merged weight serves (the epilogue streams the same bytes and saves a launch).
    b = m_bucket(m)
    hit = TUNED_ACT.get((n, k, b)) if act is not None else None
    return hit if hit is not None else TUNED.get((n, k, b))


def pick_config(n: int, k: int, m: int, act: str | None = None) -> GemvConfig:
    """Launch config for weight ``[n, k]`` and ``m`` rows (``act``: the gated epilogue, n = 2D):
    the tuned entry, else :data:`DEFAULT` (m <= 2) / :data:`DEFAULT_DOT`; with ``act`` an odd
    ``block_n`` is rounded up (it counts gate + up rows)."""
    hit = _tuned(n, k, m, act)
    cfg = hit[0] if hit is not None else (DEFAULT if m <= 2 else DEFAULT_DOT)
    if act is not None and cfg.block_n % 2:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n + 1)
    return cfg


def beats_cublas(n: int, k: int, m: int, act: str | None = None) -> bool:
    """Whether the tuning tables measured the kernel faster than cuBLAS for the shape (False if
    untuned); looks up the same entry as :func:`pick_config`."""
    hit = _tuned(n, k, m, act)
    return hit is not None and hit[1] > 1.0


@triton.jit
def _act_mul(g, u, y_ptr, ACT: tl.constexpr):
    # Round g and u to the output dtype first: the unfused path stores them in it before
    # *_and_mul reads them back, and the two paths should differ only by accumulation order.
    g = g.to(y_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(y_ptr.dtype.element_ty).to(tl.float32)
    if ACT == 1:
        a = g * tl.sigmoid(g)
    elif ACT == 2:
        # tanh(z) = 2*sigmoid(2z) - 1 (as ops.activation): no libdevice, so the interpreter runs it.
        z = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 * tl.sigmoid(2.0 * z))
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * _INV_SQRT_2))
    return a * u


@triton.jit
def _program_tile(w_ptr, N, k_per_split, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ACT: tl.constexpr):  # fmt: skip
    """Where the program (grid axes 0: weight-row block, 1: K split) streams from: its K offsets
    ``[BLOCK_K]`` and K start, its weight rows ``[BLOCK_N]`` (clamped into range, so full tiles need
    no mask) with their validity mask, and the pointers of its first weight tile ``[BLOCK_N, BLOCK_K]``.
    With ACT the tile interleaves gate row c (even slots) and up row D + c (odd slots), D = N // 2."""
    pid_n = tl.program_id(0)
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    r = tl.arange(0, BLOCK_N)
    if ACT != 0:
        d = N // 2
        c = pid_n * (BLOCK_N // 2) + r // 2
        rows = tl.minimum(c, d - 1) + (r % 2) * d
        ok = c < d
    else:
        n = pid_n * BLOCK_N + r
        rows = tl.minimum(n, N - 1)
        ok = n < N
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    return offs_k, k_lo, rows, ok, w_ptrs


@triton.jit
def _load_tile(ptrs, mask, EVEN: tl.constexpr, EVICT: tl.constexpr):
    # EVEN: the K range divides into whole tiles, so no mask. EVICT (the weight, streamed once per
    # call): "evict_first" keeps it from pushing activations and the partial sums out of L2.
    if EVEN:
        if EVICT:
            v = tl.load(ptrs, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs)
    else:
        if EVICT:
            v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def _store_row(out, m, M, rows, n_mask, pid_n, pid_k, b_ptr, y_ptr, ws_ptr, N, stride_ym,
               HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Row m of the program's result ``out [BLOCK_N]`` (one value per weight row in ``rows``)."""
    mask = n_mask & (rows * 0 + m < M)  # a tensor compare: the interpreter rejects a scalar mask
    if USE_WS:
        tl.store(ws_ptr + (pid_k * M + m).to(tl.int64) * N + rows, out, mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)
        if ACT != 0:
            g, u = tl.split(tl.reshape(out, (BLOCK_N // 2, 2)))
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            y = _act_mul(g, u, y_ptr, ACT)
            ok = (cols < N // 2) & (cols * 0 + m < M)
            tl.store(y_ptr + m.to(tl.int64) * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(y_ptr + m.to(tl.int64) * stride_ym + rows, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_fma_tile(w, x0, x1, x2, x3, k0, k_ok, acc0, acc1, acc2, acc3, EVEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """One weight tile ``w [BLOCK_N, BLOCK_K]`` times the rows' activations at K offset ``k0``, into the
    per-row 2-D accumulators."""
    w = w.to(tl.float32)
    acc0 += w * _load_tile(x0 + k0, k_ok, EVEN, False).to(tl.float32)[None, :]
    if BLOCK_M > 1:
        acc1 += w * _load_tile(x1 + k0, k_ok, EVEN, False).to(tl.float32)[None, :]
    if BLOCK_M > 2:
        acc2 += w * _load_tile(x2 + k0, k_ok, EVEN, False).to(tl.float32)[None, :]
        acc3 += w * _load_tile(x3 + k0, k_ok, EVEN, False).to(tl.float32)[None, :]
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["M"])
def _gemv_fma_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr, EVEN: tl.constexpr, EVICT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False, PREWAIT: tl.constexpr = 0,
):  # fmt: skip
    # Rows of x are unrolled by hand (BLOCK_M <= 4), each with its own 2-D accumulator over the
    # same weight tile: a 3-D [M, N, K] product made Triton shuffle the tile through shared memory.
    # PREWAIT (with PDL): the first 1 or 2 weight tiles are loaded before waiting for the previous
    # kernel (no kernel writes weights) and consumed ahead of the K loop.
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    offs_k, k_lo, rows, n_mask, w_ptrs = _program_tile(w_ptr, N, k_per_split, stride_wn, BLOCK_N, BLOCK_K, ACT)
    if PREWAIT >= 1:
        w_first = _load_tile(w_ptrs, (k_lo + offs_k < K)[None, :], EVEN, EVICT)
    if PREWAIT >= 2:  # past the split's end: re-read at its last whole tile (EVEN) or masked, never used
        k2 = BLOCK_K
        if EVEN:
            k2 = tl.minimum(BLOCK_K, k_per_split - BLOCK_K)
        w_second = _load_tile(w_ptrs + k2, (k_lo + k2 + offs_k < tl.minimum(K, k_lo + k_per_split))[None, :], EVEN,
                              EVICT)
    pdl_wait(USE_PDL)
    x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm + k_lo + offs_k
    x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm + k_lo + offs_k
    x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm + k_lo + offs_k
    x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm + k_lo + offs_k
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = 0
    if PREWAIT >= 1:
        acc0, acc1, acc2, acc3 = _gemv_fma_tile(w_first, x0, x1, x2, x3, 0, k_lo + offs_k < K, acc0, acc1, acc2, acc3,
                                                EVEN, BLOCK_M)
        w_ptrs += BLOCK_K
        k_first = BLOCK_K
    if PREWAIT >= 2:
        if BLOCK_K < k_per_split:
            acc0, acc1, acc2, acc3 = _gemv_fma_tile(w_second, x0, x1, x2, x3, BLOCK_K, k_lo + BLOCK_K + offs_k < K,
                                                    acc0, acc1, acc2, acc3, EVEN, BLOCK_M)
        w_ptrs += BLOCK_K
        k_first = 2 * BLOCK_K
    for k0 in range(k_first, k_per_split, BLOCK_K):
        k_ok = k_lo + k0 + offs_k < K
        w = _load_tile(w_ptrs, k_ok[None, :], EVEN, EVICT)
        acc0, acc1, acc2, acc3 = _gemv_fma_tile(w, x0, x1, x2, x3, k0, k_ok, acc0, acc1, acc2, acc3, EVEN, BLOCK_M)
        w_ptrs += BLOCK_K
    _store_row(tl.sum(acc0, axis=1), m0, M, rows, n_mask, pid_n, pid_k, b_ptr, y_ptr, ws_ptr, N, stride_ym,
               HAS_BIAS, USE_WS, ACT, BLOCK_N)  # fmt: skip
    if BLOCK_M > 1:
        _store_row(tl.sum(acc1, axis=1), m0 + 1, M, rows, n_mask, pid_n, pid_k, b_ptr, y_ptr, ws_ptr, N,
                   stride_ym, HAS_BIAS, USE_WS, ACT, BLOCK_N)  # fmt: skip
    if BLOCK_M > 2:
        _store_row(tl.sum(acc2, axis=1), m0 + 2, M, rows, n_mask, pid_n, pid_k, b_ptr, y_ptr, ws_ptr, N,
                   stride_ym, HAS_BIAS, USE_WS, ACT, BLOCK_N)  # fmt: skip
        _store_row(tl.sum(acc3, axis=1), m0 + 3, M, rows, n_mask, pid_n, pid_k, b_ptr, y_ptr, ws_ptr, N,
                   stride_ym, HAS_BIAS, USE_WS, ACT, BLOCK_N)  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr, EVEN: tl.constexpr, EVICT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k, k_lo, rows, n_mask, w_ptrs = _program_tile(w_ptr, N, k_per_split, stride_wn, BLOCK_N, BLOCK_K, ACT)
    pdl_wait(USE_PDL)
    m_mask = offs_m < M
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        k_ok = k_lo + k0 + offs_k < K
        w = _load_tile(w_ptrs, k_ok[None, :], EVEN, EVICT)
        xv = _load_tile(x_ptrs, k_ok[None, :], EVEN, False)
        # Padded x rows are duplicates of row M-1 (clamped), discarded at the store.
        acc = tl.dot(xv, tl.trans(w), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    omask = m_mask[:, None] & n_mask[None, :]
    if USE_WS:
        ws = ws_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + rows[None, :]
        tl.store(ws, acc, mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
            out = _act_mul(g, u, y_ptr, ACT)
            cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :]
            tl.store(y, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & (cols < N // 2)[None, :])
        else:
            y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + rows[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    # One lane per output element: N of them per row, or N // 2 (gate/up pairs) with ACT.
    n_out = N // 2 if ACT != 0 else N
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * n_out
    m = offs // n_out
    n = offs % n_out
    src = ws_ptr + m * N + n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(src + s * M * N, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if ACT != 0:
        up = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            up += tl.load(src + s * M * N + n_out, mask=mask, other=0.0)
        if HAS_BIAS:
            up += tl.load(b_ptr + n_out + n, mask=mask, other=0.0).to(tl.float32)
        acc = _act_mul(acc, up, y_ptr, ACT)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig,
         act: str | None = None) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N]`` in x.dtype with one explicit config.

    x, weight and bias share one dtype (fp32/fp16/bf16) and device; nothing but ``config.block_n``
    is checked here (the public ``ops.linear.skinny_linear`` validates its inputs).

    With ``act`` (``"silu"``, ``"gelu_tanh"``, ``"gelu"``) the weight is a merged ``[gate; up]``
    projection (N = 2D, even) and the result is ``act(gate) * up`` ``[M, D]``; ``config.block_n``
    must then be even (it counts gate + up rows). x and weight must have a contiguous last dim;
    fp32 inputs always take the ``fma`` variant (``tl.dot`` would round them to tf32).
    """
    M, K = x.shape
    N = weight.shape[0]
    code = ACTIVATIONS[act]
    n_out = N // 2 if code else N
    y = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        # Nothing to stream: y = bias (or 0), then the activation of it; the reference computes that.
        return skinny_linear_ref(x, weight, bias, act=act).to(x.dtype)
    if code and (config.block_n < 2 or config.block_n % 2):
        raise ValueError(f"gemv: act={act!r} needs an even block_n >= 2, got {config.block_n}")
    variant = "fma" if x.dtype == torch.float32 else config.variant
    use_pdl = pdl_enabled(x)
    extra = {}
    if variant == "dot":
        block_m, kernel = 16, _gemv_dot_kernel
    else:
        block_m, kernel = min(m_bucket(M), 4), _gemv_fma_kernel
        extra["PREWAIT"] = GEMV_PREWAIT if use_pdl else 0
    bk = config.block_k
    split = max(1, min(config.split_k, triton.cdiv(K, bk)))
    # Each split owns a whole number of BLOCK_K tiles, so only the last one can be ragged.
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    even = K % k_per_split == 0 and K % bk == 0
    use_ws = split > 1
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if use_ws else y
    b = bias if bias is not None else y
    rows_per_prog = config.block_n // 2 if code else config.block_n
    grid = (triton.cdiv(n_out, rows_per_prog), split, triton.cdiv(M, block_m))
    kernel[grid](
        x, weight, b, y, ws, M, N, K, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, USE_WS=use_ws, EVEN=even, EVICT=config.evict_first,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=bk, ACT=code,
        num_warps=config.num_warps, num_stages=config.num_stages, **extra, **pdl_launch(use_pdl),
    )  # fmt: skip
    if use_ws:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * n_out, block),)](
            ws, b, y, M, N, y.stride(0), SPLIT_K=split, HAS_BIAS=bias is not None, ACT=code, BLOCK=block,
            num_warps=4, **pdl_launch(use_pdl),
        )  # fmt: skip
    return y


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  act: str | None = None) -> torch.Tensor:  # fmt: skip
    """``F.linear`` for few rows: x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` -> ``[..., N]`` in x.dtype.

    With ``act`` the result is ``act_and_mul(F.linear(x, weight, bias))`` ``[..., N // 2]`` in one
    kernel (see :func:`gemv`). The launch config is :func:`pick_config`'s. The registered Triton
    implementation: inputs are validated by the public ``ops.linear.skinny_linear``.
    """
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    cfg = pick_config(weight.shape[0], K, x2.shape[0], act)
    y = gemv(x2, weight, bias, cfg, act)
    return y.reshape(*x.shape[:-1], y.shape[-1])


register("skinny_linear", "triton", skinny_linear, priority=10, available=lambda cap: cap.is_cuda and cap.triton)
