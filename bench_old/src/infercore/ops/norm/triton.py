"""Triton RMSNorm kernels: plain and fused residual-add, with the Gemma ``(offset + w)`` weight.

One program normalises one row (``H`` up to a few tens of thousands fits one block); the row is
read once and written once, and the statistic is accumulated in fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register
from infercore.ops.pdl import pdl_enabled, pdl_launch, pdl_release, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    res_out_ptr,
    H,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset  # a weight: before the wait
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The new residual is rounded to the activation dtype (what the next layer will read),
        # and the norm is taken of that rounded value, exactly as the reference does.
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    tl.store(y_ptr + row * stride_y + cols, (xf * inv_rms * w).to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float):
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, H)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(y)
    else:
        r2, res_out = x2, y  # unused: HAS_RESIDUAL is a compile-time False
    weight = weight.contiguous()
    BLOCK = triton.next_power_of_2(H)
    # Wide rows want more warps so each thread keeps a few 16-byte vectors in registers.
    num_warps = min(max(BLOCK // 256, 1), 16)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, y, res_out, H,
            x2.stride(0), r2.stride(0), y.stride(0), res_out.stride(0),
            float(eps), float(offset),
            HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps, **pdl_launch(pdl_enabled(x2)),
        )  # fmt: skip
    y = y.reshape(x.shape)
    if residual is None:
        return y, None
    return y, res_out.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x / rms(x) * (offset + weight)`` over the last dim.

    x ``[..., H]`` fp32/fp16/bf16 (last dim contiguous or copied), weight ``[H]``; returns x.dtype.
    """
    return _launch(x, None, weight, eps, offset)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (x.dtype) and ``rms_norm(new_residual)`` in one pass.

    x, residual ``[..., H]`` of one dtype; returns ``(y, new_residual)``, both new tensors.
    """
    return _launch(x, residual, weight, eps, offset)


_available = lambda cap: cap.is_cuda and cap.triton
register("rms_norm", "triton", rms_norm, priority=10, available=_available)
register("fused_add_rms_norm", "triton", fused_add_rms_norm, priority=10, available=_available)
