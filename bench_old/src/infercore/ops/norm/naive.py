"""Pure-PyTorch RMSNorm (the specification the fast kernels are tested against)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0) -> torch.Tensor:
    # Statistics and the weight multiply stay in fp32 and only the result is rounded: rounding the
    # normalized activations before the weight multiply (as HF Llama does) loses bits in bf16.
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    y = xf * torch.rsqrt(var + eps)
    return (y * (weight.float() + offset)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    # The residual stream is carried in the activation dtype (as vLLM does), so the sum is rounded
    # before the norm reads it: the kernel must reproduce that rounding, not normalize an fp32 sum.
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps=eps, offset=offset), new_residual
