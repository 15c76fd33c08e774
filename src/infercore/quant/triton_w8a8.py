"""Triton W8A8 kernels: the fused per-token activation quantizer and the scaled 8-bit GEMM.

* ``_act_quant_kernel`` -- one program per token: (optional) divide by SmoothQuant factors, zero
  the outlier channels, absmax over the rest, quantize to INT8 (round half away from zero) or
  FP8 e4m3, and gather the raw outlier values into a dense ``[M, n_out]`` side tensor -- one read
  of ``x`` for the statistics and one for the codes.
* ``_scaled_mm_kernel`` -- ``y = (A_q @ W_q^T) * s_x[m] * s_w[n] (+ X_out @ W_out^T) (+ bias)``.
  INT8 operands accumulate in int32 (exact), FP8 e4m3 operands in fp32 (native FP8 tensor cores,
  sm89+). With outliers (MixQ) the high-precision correction is a second, short dot loop in the
  same program, added in the epilogue: the INT8 main loop is untouched and no second output
  pass over ``y`` is needed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .formats import Int8Weight
from .naive import ACT_SCALE_EPS

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# INFERCORE_QUANT_AUTOTUNE=0 keeps only the first GPU config of each kernel (fast test runs).
_AUTOTUNE = os.environ.get("INFERCORE_QUANT_AUTOTUNE", "1") != "0"


def _mm_cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                         num_stages=stages)


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


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2}, num_warps=4)]
    configs = [
        _mm_cfg(128, 256, 128, 8, 3),
        _mm_cfg(128, 128, 128, 8, 4),
        _mm_cfg(256, 128, 128, 8, 3),
        _mm_cfg(64, 128, 128, 4, 4),
        _mm_cfg(16, 64, 256, 4, 4),
    ]
    return configs if _AUTOTUNE else configs[:1]


def _prune(configs, nargs):
    m = nargs["M_BUCKET"]
    out = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, m)]
    if m <= 64:  # skinny: only the small-M tiles
        out = [c for c in out if c.kwargs["BLOCK_M"] <= 64]
    return out or configs[:1]


@triton.autotune(
    configs=_configs(),
    key=["M_BUCKET", "N", "K", "IS_INT8", "HAS_OUTLIERS"],
    prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw: _prune(cfgs, {**nargs, **kw})},
)
@triton.jit
def _scaled_mm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, xo_ptr, wo_ptr, bias_ptr, c_ptr,
    M, N, K, n_out, M_BUCKET,
    stride_am, stride_bn, stride_om, stride_won, stride_cm,
    IS_INT8: tl.constexpr, HAS_OUTLIERS: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_PRECISION: tl.constexpr, BLOCK_O: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_a = offs_m.to(tl.int64)[:, None] * stride_am
    rows_b = offs_n.to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if IS_INT8 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k[None, :] < K
        a = tl.load(a_ptr + rows_a + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0)
        b = tl.load(b_ptr + rows_b + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0)
        if IS_INT8:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        else:  # FP8 operands travel as bytes (a zero byte is +0.0) and are reinterpreted here
            a8 = a.to(tl.float8e4nv, bitcast=True)
            acc = tl.dot(a8, tl.trans(b.to(tl.float8e4nv, bitcast=True)), acc)
    sa = tl.load(sa_ptr + offs_m, mask=m_mask, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_OUTLIERS:
        # MixQ epilogue: the few outlier channels as a short high-precision GEMM, same tile.
        acc_o = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        rows_o = offs_m.to(tl.int64)[:, None] * stride_om
        rows_w = offs_n.to(tl.int64)[:, None] * stride_won
        for j0 in range(0, n_out, BLOCK_O):
            offs_j = j0 + tl.arange(0, BLOCK_O)
            j_mask = offs_j[None, :] < n_out
            xo = tl.load(xo_ptr + rows_o + offs_j[None, :], mask=m_mask[:, None] & j_mask, other=0.0)
            wo = tl.load(wo_ptr + rows_w + offs_j[None, :], mask=n_mask[:, None] & j_mask, other=0.0)
            acc_o = tl.dot(xo, tl.trans(wo), acc_o, input_precision=OUT_PRECISION)
        y += acc_o
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8_matmul_triton(
    qx: torch.Tensor, sx: torch.Tensor, w: Int8Weight, *, x_out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Same contract as :func:`infercore.quant.naive.w8a8_matmul_ref`."""
    m, k = qx.shape
    n = w.shape[0]
    is_int8 = w.act == "int8"
    b = w.qweight  # int8, or uint8 e4m3 bytes
    a = qx if is_int8 else qx.view(torch.uint8)
    has_out = w.num_outliers > 0 and x_out is not None
    if has_out and x_out.dtype != w.w_outlier.dtype:
        x_out = x_out.to(w.w_outlier.dtype)
    c = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    if m == 0:
        return c
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    _scaled_mm_kernel[grid](
        a, b, sx, w.scales, x_out if has_out else sx, w.w_outlier if has_out else sx,
        bias if bias is not None else sx, c,
        m, n, k, w.num_outliers if has_out else 0, min(triton.next_power_of_2(m), 256),
        a.stride(0), b.stride(0), x_out.stride(0) if has_out else 0,
        w.w_outlier.stride(0) if has_out else 0, c.stride(0),
        IS_INT8=is_int8, HAS_OUTLIERS=has_out, HAS_BIAS=bias is not None,
        OUT_PRECISION="ieee" if has_out and x_out.dtype == torch.float32 else "tf32",
        BLOCK_O=32,
    )
    return c
