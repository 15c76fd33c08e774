"""CPU fast path of the gated activations: SiLU-and-mul through the native kernel (``ops.moe.cpu_native``) where it
builds; otherwise slices instead of chunk + copies. fp32 math for half-precision inputs, one rounding at the end
(as the reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...devices import register
from ..moe import cpu_native


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    if x.numel() > 0 and x.shape[-1] % 2 == 0 and cpu_native.layer_ops_apply(x):
        return cpu_native.silu_and_mul(x)
    d = x.shape[-1] // 2
    xf = x if x.dtype == torch.float32 else x.float()
    out = F.silu(xf[..., :d]).mul_(xf[..., d:])
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def gelu_and_mul_cpu(x: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    d = x.shape[-1] // 2
    xf = x if x.dtype == torch.float32 else x.float()
    out = F.gelu(xf[..., :d], approximate=approximate).mul_(xf[..., d:])
    return out if x.dtype == torch.float32 else out.to(x.dtype)


register("silu_and_mul", "cpu", silu_and_mul_cpu, priority=5, available=lambda cap: cap.device_type == "cpu")
register("gelu_and_mul", "cpu", gelu_and_mul_cpu, priority=5, available=lambda cap: cap.device_type == "cpu")
