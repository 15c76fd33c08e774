"""CUDA kernels of ``quant.nf4_matmul``: 4-bit codes into a 16-value codebook with fp32 absmax blocks (bitsandbytes
NF4 / FP4, :class:`~infercore.quant.NF4Weight`).

* Up to :data:`DEQUANT_M_MIN` rows: one tiled ``tl.dot`` kernel decodes each weight tile in registers (the byte's two
  nibbles split and joined in K order, each code's codebook value picked from the 16 values held as scalars by a tree
  of selects on its bits, times its block's absmax, rounded to x's dtype: the values of ``w.dequantize(x.dtype)``)
  and multiplies it by the activation tile; fp32 accumulation, no weight copy.
* From :data:`DEQUANT_M_MIN` rows (16-bit x): the whole weight decoded to x's dtype in one pass (the same values),
  then the library GEMM (cuBLAS through torch), as the other weight-only formats do past ~100 rows
  (``quant/triton_dequant.py``).

First H100 run (a gather from the codebook in memory per weight): M=1 803 us against bf16's 47 at 14336 x 4096
(``benchmarks/results/h200/sweeps/nf4_gather_h100.json``); the select tree replaced it. ``DEQUANT_M_MIN`` and the
tile sizes are guesses from the other formats' sweeps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import NF4Weight

DEQUANT_M_MIN = 128  # rows from which the weight is decoded once and multiplied by the library GEMM (16-bit x)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _lookup16(q, lut_ptr):
    """``lut[q]`` for 4-bit codes ``q`` (int32 tensor): the 16 table values loaded once as scalars and picked by a tree
    of 15 selects on the code's bits (the gather from memory per weight it replaced ran 17x bf16's time at one row on
    an H100; this form is not yet timed)."""
    t0, t1, t2, t3 = tl.load(lut_ptr + 0), tl.load(lut_ptr + 1), tl.load(lut_ptr + 2), tl.load(lut_ptr + 3)
    t4, t5, t6, t7 = tl.load(lut_ptr + 4), tl.load(lut_ptr + 5), tl.load(lut_ptr + 6), tl.load(lut_ptr + 7)
    t8, t9, t10, t11 = tl.load(lut_ptr + 8), tl.load(lut_ptr + 9), tl.load(lut_ptr + 10), tl.load(lut_ptr + 11)
    t12, t13, t14, t15 = tl.load(lut_ptr + 12), tl.load(lut_ptr + 13), tl.load(lut_ptr + 14), tl.load(lut_ptr + 15)
    b0, b1, b2, b3 = (q & 1) != 0, (q & 2) != 0, (q & 4) != 0, (q & 8) != 0
    l0 = tl.where(b0, t1, t0)
    l1 = tl.where(b0, t3, t2)
    l2 = tl.where(b0, t5, t4)
    l3 = tl.where(b0, t7, t6)
    l4 = tl.where(b0, t9, t8)
    l5 = tl.where(b0, t11, t10)
    l6 = tl.where(b0, t13, t12)
    l7 = tl.where(b0, t15, t14)
    m0 = tl.where(b1, l1, l0)
    m1 = tl.where(b1, l3, l2)
    m2 = tl.where(b1, l5, l4)
    m3 = tl.where(b1, l7, l6)
    return tl.where(b3, tl.where(b2, m3, m2), tl.where(b2, m1, m0))


@triton.jit
def _lut4_tile(qw_ptr, am_ptr, lut_ptr, rows, n_mask, k0, K, stride_qn, stride_an, BS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_K]``: ``lut[code] * absmax`` of columns ``k0 ...`` of ``rows`` (0 past K / N)."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(qw_ptr + rows * stride_qn + offs_b[None, :], mask=n_mask[:, None] & (2 * offs_b[None, :] < K),
                other=0).to(tl.int32)
    q = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_N, BLOCK_K])  # byte j: codes 2j, 2j + 1
    v = _lookup16(q, lut_ptr)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    s = tl.load(am_ptr + rows * stride_an + (offs_k // BS)[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K),
                other=0.0)
    return v * s


@triton.jit
def _dequant_lut4_kernel(qw_ptr, am_ptr, lut_ptr, y_ptr, N, K, stride_qn, stride_an, stride_yn, BS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``y[n, k] = lut[q[n, k]] * absmax[n, k // BS]`` (fp32, rounded once to y's dtype)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    w = _lut4_tile(qw_ptr, am_ptr, lut_ptr, rows, n_mask, k0, K, stride_qn, stride_an, BS, BLOCK_N, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(y_ptr + rows * stride_yn + offs_k[None, :], w.to(y_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (offs_k[None, :] < K))


@triton.jit
def _lut4_gemm_kernel(x_ptr, qw_ptr, am_ptr, lut_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_an, stride_ym,
                      BS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """``y [M, N] = x [M, K] @ (lut[q] * absmax)^T``, each weight tile decoded to x's dtype, fp32 accumulation."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask, m_mask = offs_n < N, offs_m < M
    rows = offs_n.to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _lut4_tile(qw_ptr, am_ptr, lut_ptr, rows, n_mask, k0, K, stride_qn, stride_an, BS, BLOCK_N, BLOCK_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                     mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        if IEEE:
            acc += tl.dot(xt, tl.trans(w.to(xt.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(w.to(xt.dtype)))
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def dequant_nf4_triton(w: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """``w.dequantize(dtype)`` (fp32 / fp16 / bf16; another dtype raises ``TypeError``) in one pass, on ``w``'s
    device."""
    if dtype not in _FLOATS:
        raise TypeError(f"dequant_nf4_triton: dtype must be torch.float32, float16 or bfloat16, got {dtype}")
    n, k = w.shape
    y = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    block_k = min(128, w.blocksize)
    grid = (triton.cdiv(n, 32), triton.cdiv(k, block_k))
    _dequant_lut4_kernel[grid](w.qweight, w.absmax, w.codebook, y, n, k, w.qweight.stride(0), w.absmax.stride(0),
                               y.stride(0), BS=w.blocksize, BLOCK_N=32, BLOCK_K=block_k)
    return y


def nf4_matmul_triton(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.nf4_matmul`` on CUDA: ``x [M, K]`` (fp32 / fp16 / bf16) ``@ dequant(w)^T (+ bias)`` -> ``[M, N]`` in
    ``x.dtype`` (module docstring). Arguments are checked by the op."""
    m, k = x.shape
    n = w.shape[0]
    qw, am, lut = w.qweight.contiguous(), w.absmax.contiguous(), w.codebook.contiguous()
    if m >= DEQUANT_M_MIN and x.dtype in (torch.float16, torch.bfloat16):
        y = x @ dequant_nf4_triton(NF4Weight(qw, am, lut, w.blocksize, w.quant_type), x.dtype).t()
    else:
        x = x.contiguous()
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        block_m = 16 if m <= 16 else 32
        grid = (triton.cdiv(n, 64), triton.cdiv(m, block_m))
        _lut4_gemm_kernel[grid](x, qw, am, lut, y, m, n, k, x.stride(0), qw.stride(0), am.stride(0), y.stride(0),
                                BS=w.blocksize, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=64,
                                BLOCK_K=64)
    return y if bias is None else (y.float() + bias.float()).to(x.dtype)
