"""Triton W8A8 kernels: the fused per-token activation quantizer and the scaled 8-bit GEMM.

* ``_act_quant_kernel`` -- one program per token: (optional) divide by SmoothQuant factors, zero
  the outlier channels, absmax over the rest, quantize to INT8 (round half away from zero) or
  FP8 e4m3, and gather the raw outlier values into a dense ``[M, n_out]`` side tensor -- one read
  of ``x`` for the statistics and one for the codes.
* ``_scaled_mm_kernel`` -- ``y = (A_q @ W_q^T) * s_x[m] * s_w[n] (+ X_out @ W_out^T) (+ bias)``.
  INT8 operands accumulate in int32 (exact), FP8 e4m3 operands in fp32 (native FP8 tensor cores,
  sm89+). Operands arrive through host TMA descriptors when their strides allow (else pointer
  loads). With outliers (MixQ) the int32 tile is dequantized to fp32 first and the outlier
  channels run as a short bf16/fp16 dot loop accumulating onto that same fp32 tile, so only one
  accumulator is ever live and no second pass over ``y`` is needed; that loop has its own
  shallow pipeline (``MMConfig.out_stages``) so its 16-bit tiles never set the shared-memory peak.
  Optionally persistent (one program per SM, grouped tile order) and with a TMA store of C.
* Launch configs come from :data:`MM_CONFIGS` by kernel variant and M bucket (no autotuning:
  first calls cost one compile, not a sweep); ``benchmarks/sweep_w8a8.py`` fills the table.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .formats import Int8Weight
from .naive import ACT_SCALE_EPS

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _act_quant_kernel(
    x_ptr, smooth_ptr, mask_ptr, idx_ptr, q_ptr, s_ptr, xo_ptr,
    K, n_out, stride_xm, stride_qm, stride_om,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_OUTLIERS: tl.constexpr,
    EPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + m * stride_xm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        kmask = offs < K
        v = tl.load(x_row + offs, mask=kmask, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            v = v / tl.load(smooth_ptr + offs, mask=kmask, other=1.0)
        if HAS_OUTLIERS:
            v = tl.where(tl.load(mask_ptr + offs, mask=kmask, other=0) != 0, 0.0, v)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0), EPS) / QMAX
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        kmask = offs < K
        v = tl.load(x_row + offs, mask=kmask, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            v = v / tl.load(smooth_ptr + offs, mask=kmask, other=1.0)
        if HAS_OUTLIERS:
            v = tl.where(tl.load(mask_ptr + offs, mask=kmask, other=0) != 0, 0.0, v)
        v = v / scale
        if IS_FP8:
            q = tl.clamp(v, -QMAX, QMAX).to(tl.float8e4nv)
        else:
            r = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
            q = tl.clamp(r, -127.0, 127.0).to(tl.int8)
        tl.store(q_ptr + m * stride_qm + offs, q, mask=kmask)
    if HAS_OUTLIERS:
        for j0 in range(0, n_out, BLOCK_O):
            offs_o = j0 + tl.arange(0, BLOCK_O)
            omask = offs_o < n_out
            idx = tl.load(idx_ptr + offs_o, mask=omask, other=0)
            xv = tl.load(x_row + idx, mask=omask, other=0.0)
            tl.store(xo_ptr + m * stride_om + offs_o, xv, mask=omask)


def per_token_quant_triton(
    x: torch.Tensor, *, act: str = "int8", smooth: torch.Tensor | None = None,
    outlier_idx: torch.Tensor | None = None, outlier_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as :func:`infercore.quant.naive.per_token_quant_ref`.

    ``outlier_mask`` (uint8 ``[K]``, 1 on outlier channels) may be passed to skip building it.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    is_fp8 = act == "fp8"
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if is_fp8 else torch.int8, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    has_out = outlier_idx is not None and outlier_idx.numel() > 0
    if has_out:
        n_out = outlier_idx.numel()
        if outlier_mask is None:
            outlier_mask = torch.zeros(k, dtype=torch.uint8, device=x.device)
            outlier_mask[outlier_idx.long()] = 1
        xo = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    else:
        n_out, xo = 0, None
    if m == 0:
        return q, s, xo
    dummy = s
    _act_quant_kernel[(m,)](
        x, smooth if smooth is not None else dummy, outlier_mask if has_out else dummy,
        outlier_idx if has_out else dummy, q, s, xo if has_out else dummy,
        k, n_out, x.stride(0), q.stride(0), xo.stride(0) if has_out else 0,
        QMAX=448.0 if is_fp8 else 127.0, IS_FP8=is_fp8, HAS_SMOOTH=smooth is not None,
        HAS_OUTLIERS=has_out, EPS=ACT_SCALE_EPS,
        BLOCK_K=min(triton.next_power_of_2(k), 64 if _INTERPRET else 2048), BLOCK_O=32,
        num_warps=1 if _INTERPRET else 8,
    )
    return q, s, xo


class MMConfig(NamedTuple):
    """One launch configuration of :func:`_scaled_mm_kernel` (paste sweep results as these)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    warps: int = 8
    stages: int = 4
    tma: bool = True  # host TMA descriptors for A, B (and the outliers) when strides allow
    block_o: int = 64  # outlier-channel step of the MixQ loop
    # Pipeline depth of the outlier loop alone. Its 16-bit tiles are twice the bytes of the 8-bit
    # main-loop tiles, so at the main loop's depth they set the shared-memory peak (128x256 s4 with
    # BLOCK_O 64 would need as much as the whole main loop); 2 keeps them well under it.
    out_stages: int = 2
    # One program per SM walking the tiles in grouped order; the main loop's next-tile loads then
    # overlap this tile's epilogue (the K loop is flattened into the tile loop without outliers).
    persistent: bool = False
    tma_c: bool = False  # store C through a TMA descriptor (needs N * itemsize % 16 == 0)


# Per kernel variant, per M bucket (upper bound of M, ascending; the last covers everything).
# INT8 at large M runs two CTAs per SM on 128x128 tiles: Triton keeps a wgmma with an int32
# accumulator synchronous (its pipeliner only makes fp32-accumulating dots async: the compiled INT8
# loop waits for every MMA group, "pendings = 0", where FP8 keeps one in flight), and a second
# resident CTA hides that wait -- 1343 vs 1221 TOP/s for the best one-CTA tile (128x256).
# Picked by benchmarks/sweep_w8a8.py on an H200 (results/h200/sweeps/sweep_w8a8.json, 2026-11-30,
# N=14336 K=4096 at M=1, 16, 128, 2048). Pointer loads beat TMA at M <= 128: with one or a few
# row tiles the kernel is weight-bandwidth bound and the TMA box round trips add latency.
MM_CONFIGS: dict[str, list[tuple[int, MMConfig]]] = {
    # From benchmarks/sweep_w8a8.py on the H200 (benchmarks/results/h200/sweeps/sweep_w8a8.json),
    # N=14336, K=4096; the comment is the measured time at the M of that row.
    "int8": [
        (8, MMConfig(16, 64, 256, 1, 4, 4)),  # 25.5 us at M=1
        (64, MMConfig(16, 64, 256, 1, 4, 4, tma=False)),  # 24.8 us at M=16
        (256, MMConfig(64, 128, 128, 8, 4, 4, tma=False)),  # 29.1 us at M=128
        # Two CTAs per SM (sweeps/sweep_w8a8_2cta.json): 179.1 us at M=2048 vs 199.3 us for the best
        # one-CTA tile (128x256 persistent) in the same run.
        (1 << 62, MMConfig(128, 128, 128, 16, 4, 3)),
    ],
    "fp8": [
        (8, MMConfig(16, 64, 128, 1, 4, 6, tma=False)),  # 28.8 us at M=1
        (64, MMConfig(16, 64, 256, 1, 4, 4, tma=False)),  # 25.6 us at M=16
        (256, MMConfig(64, 128, 128, 8, 4, 4, tma=False)),  # 27.8 us at M=128
        (1 << 62, MMConfig(128, 256, 128, 8, 8, 3, persistent=True, tma_c=True)),  # 167.9 us at M=2048
    ],
    "mixed": [
        (8, MMConfig(16, 64, 256, 1, 4, 4, tma=False)),  # 28.6 us at M=1
        (64, MMConfig(16, 64, 256, 1, 4, 4, tma=False)),  # 26.3 us at M=16
        (256, MMConfig(64, 128, 128, 8, 4, 4, tma=False)),  # 31.5 us at M=128
        (1 << 62, MMConfig(128, 128, 128, 16, 4, 3)),  # 194.1 us at M=2048 (sweeps/sweep_w8a8_2cta.json)
    ],
}
# The interpreter runs ~1 ms per program: tiny tiles. Tests pass ``config=`` to reach the TMA path.
_INTERP_CONFIG = MMConfig(16, 16, 32, 2, 4, 1, tma=False, block_o=16)


def pick_config(variant: str, m: int) -> MMConfig:
    """The table entry for ``variant`` ("int8" | "fp8" | "mixed") at ``M = m``."""
    if _INTERPRET:
        return _INTERP_CONFIG
    for bound, cfg in MM_CONFIGS[variant]:
        if m <= bound:
            return cfg
    return MM_CONFIGS[variant][-1][1]


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row tiles sweep the columns together so their B tiles stay in L2.
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    return pid_m, pid_n


@triton.jit
def _mm_tile(
    a_ptr, b_ptr, sa_ptr, sb_ptr, xo_ptr, wo_ptr, bias_ptr, c_ptr, pid_m, pid_n,
    M, N, K, n_out, stride_am, stride_bn, stride_om, stride_won, stride_cm,
    IS_INT8: tl.constexpr, HAS_OUTLIERS: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, TMA_OUT: tl.constexpr, TMA_C: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_O: tl.constexpr, OUT_STAGES: tl.constexpr,
):
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if not USE_TMA:
        # Wrapped row indices instead of row masks: duplicate rows are harmless (never stored)
        # and keep the operand loads unpredicated along M/N.
        rows_a = (offs_m % M).to(tl.int64)[:, None] * stride_am
        rows_b = (offs_n % N).to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if IS_INT8 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if USE_TMA:  # out-of-bounds boxes are zero-filled by the TMA unit
            a = a_ptr.load([off_m, k0])
            b = b_ptr.load([off_n, k0])
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(a_ptr + rows_a + offs_k[None, :])
                b = tl.load(b_ptr + rows_b + offs_k[None, :])
            else:
                # A float fill: an int literal cannot be cast to fp8e4nv (and 0.0 is exact in
                # int8 and e4m3 alike). Both operands are zeroed: e4m3 garbage may be NaN.
                k_mask = offs_k[None, :] < K
                a = tl.load(a_ptr + rows_a + offs_k[None, :], mask=k_mask, other=0.0)
                b = tl.load(b_ptr + rows_b + offs_k[None, :], mask=k_mask, other=0.0)
        # B is [N, K] row-major = K-major, the layout 8-bit wgmma requires for both operands.
        if IS_INT8:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    sa = tl.load(sa_ptr + offs_m, mask=m_mask, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=n_mask, other=0.0)
    # One fp32 tile from here on: the int32 accumulator dies before the outlier loop starts, so
    # the MixQ variant never holds two [BLOCK_M, BLOCK_N] accumulators (that spilled before).
    y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_OUTLIERS:
        # MixQ: the outlier channels are raw (unscaled) activations x raw weights, so they
        # accumulate straight onto the dequantized tile as a short extra K loop with its own,
        # shallower pipeline (its buffers reuse the main loop's shared memory, which is dead here).
        if TMA_OUT:
            for j0 in tl.range(0, n_out, BLOCK_O, num_stages=OUT_STAGES):
                xo = xo_ptr.load([off_m, j0])
                wo = wo_ptr.load([off_n, j0])
                y = tl.dot(xo, tl.trans(wo), y, input_precision=OUT_PRECISION)
        else:
            rows_o = (offs_m % M).to(tl.int64)[:, None] * stride_om
            rows_w = (offs_n % N).to(tl.int64)[:, None] * stride_won
            for j0 in tl.range(0, n_out, BLOCK_O, num_stages=OUT_STAGES):
                offs_j = j0 + tl.arange(0, BLOCK_O)
                j_mask = offs_j[None, :] < n_out
                xo = tl.load(xo_ptr + rows_o + offs_j[None, :], mask=j_mask, other=0.0)
                wo = tl.load(wo_ptr + rows_w + offs_j[None, :], mask=j_mask, other=0.0)
                y = tl.dot(xo, tl.trans(wo), y, input_precision=OUT_PRECISION)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if TMA_C:  # the TMA unit clips the rows/columns past M, N
        c_ptr.store([off_m, off_n], y.to(c_ptr.dtype))
    else:
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# M (and the persistent grid size, which follows M while the tiles are fewer than the SMs) is not
# specialized: no recompile when a batch size crosses 1 or a multiple of 16; N, K and the strides
# are, which is what the address math needs.
@triton.jit(do_not_specialize=["M", "num_progs"])
def _scaled_mm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, xo_ptr, wo_ptr, bias_ptr, c_ptr,
    M, N, K, n_out, num_progs,
    stride_am, stride_bn, stride_om, stride_won, stride_cm,
    IS_INT8: tl.constexpr, HAS_OUTLIERS: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, TMA_OUT: tl.constexpr, TMA_C: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_O: tl.constexpr, OUT_STAGES: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        # FLATTEN lets the pipeliner prefetch the next tile's K steps during this epilogue; with
        # outliers there are two inner loops, which the flattener does not take.
        for tile in tl.range(tl.program_id(0), num_m * num_n, num_progs, flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            _mm_tile(
                a_ptr, b_ptr, sa_ptr, sb_ptr, xo_ptr, wo_ptr, bias_ptr, c_ptr, pid_m, pid_n,
                M, N, K, n_out, stride_am, stride_bn, stride_om, stride_won, stride_cm,
                IS_INT8, HAS_OUTLIERS, HAS_BIAS, OUT_PRECISION, USE_TMA, TMA_OUT, TMA_C, EVEN_K,
                BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_O, OUT_STAGES,
            )
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        _mm_tile(
            a_ptr, b_ptr, sa_ptr, sb_ptr, xo_ptr, wo_ptr, bias_ptr, c_ptr, pid_m, pid_n,
            M, N, K, n_out, stride_am, stride_bn, stride_om, stride_won, stride_cm,
            IS_INT8, HAS_OUTLIERS, HAS_BIAS, OUT_PRECISION, USE_TMA, TMA_OUT, TMA_C, EVEN_K,
            BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_O, OUT_STAGES,
        )


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if _INTERPRET or device.type != "cuda":
        return 4  # a few programs, so the interpreter still walks several tiles per program
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Whether every 2-D tensor meets the TMA rules (unit inner stride, 16-byte rows and base)."""
    return all(t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in ts)


def w8a8_matmul_triton(
    qx: torch.Tensor, sx: torch.Tensor, w: Int8Weight, *, x_out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
    config: MMConfig | None = None,
) -> torch.Tensor:
    """Same contract as :func:`infercore.quant.naive.w8a8_matmul_ref`.

    ``qx`` ``[M, K]`` int8 or float8_e4m3fn (row-major), ``w.qweight`` ``[N, K]`` row-major
    (K-major for the tensor cores), ``x_out`` ``[M, n_out]`` and ``w.w_outlier`` ``[N, n_out]``.
    ``config`` overrides the per-M table :data:`MM_CONFIGS` (used by the sweep).
    """
    m, k = qx.shape
    n = w.shape[0]
    is_int8 = w.act == "int8"
    a = qx if qx.stride(1) == 1 else qx.contiguous()
    # FP8 travels as float8_e4m3fn so the loads feed the tensor cores directly; a uint8 load plus
    # an in-kernel bitcast kept the operands from the async shared-memory pipeline.
    b = w.qweight if is_int8 else w.qweight.view(torch.float8_e4m3fn)
    if not is_int8 and a.dtype != torch.float8_e4m3fn:
        a = a.view(torch.float8_e4m3fn)
    has_out = w.num_outliers > 0 and x_out is not None
    wo = w.w_outlier if has_out else None
    if has_out and x_out.dtype != wo.dtype:
        x_out = x_out.to(wo.dtype)
    if has_out and x_out.stride(1) != 1:
        x_out = x_out.contiguous()
    c = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    if m == 0:
        return c
    cfg = config or pick_config("mixed" if has_out else ("int8" if is_int8 else "fp8"), m)
    use_tma = cfg.tma and _tma_ok(a, b)
    tma_out = use_tma and has_out and _tma_ok(x_out, wo)
    if use_tma:
        a_arg = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_arg = TensorDescriptor.from_tensor(b, [cfg.block_n, cfg.block_k])
    else:
        a_arg, b_arg = a, b
    if tma_out:
        xo_arg = TensorDescriptor.from_tensor(x_out, [cfg.block_m, cfg.block_o])
        wo_arg = TensorDescriptor.from_tensor(wo, [cfg.block_n, cfg.block_o])
    else:
        xo_arg, wo_arg = (x_out, wo) if has_out else (sx, sx)
    tma_c = use_tma and cfg.tma_c and _tma_ok(c)
    c_arg = TensorDescriptor.from_tensor(c, [cfg.block_m, cfg.block_n]) if tma_c else c
    num_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    num_progs = min(num_tiles, _num_sms(c.device)) if cfg.persistent else num_tiles
    _scaled_mm_kernel[(num_progs,)](
        a_arg, b_arg, sx, w.scales, xo_arg, wo_arg, bias if bias is not None else sx, c_arg,
        m, n, k, w.num_outliers if has_out else 0, num_progs,
        a.stride(0), b.stride(0), x_out.stride(0) if has_out else 0,
        wo.stride(0) if has_out else 0, c.stride(0),
        IS_INT8=is_int8, HAS_OUTLIERS=has_out, HAS_BIAS=bias is not None,
        OUT_PRECISION="ieee" if has_out and x_out.dtype == torch.float32 else "tf32",
        USE_TMA=use_tma, TMA_OUT=tma_out, TMA_C=tma_c, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_O=cfg.block_o,
        OUT_STAGES=cfg.out_stages, GROUP_M=cfg.group_m,
        PERSISTENT=cfg.persistent, FLATTEN=cfg.persistent and not has_out,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return c
