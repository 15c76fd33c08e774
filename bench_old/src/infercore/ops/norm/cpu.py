"""CPU fast path of RMSNorm: the native kernel (``ops.moe.cpu_native``, residual add included) where it builds,
else ATen's fused ``rms_norm`` instead of five elementwise ops.

Same math as the reference (fp32 statistics and weight multiply, one rounding at the end).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...devices import register
from ..moe import cpu_native


def _native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.numel() > 0 and weight.numel() == x.shape[-1] and cpu_native.layer_ops_apply(x)
            and cpu_native.layer_ops_apply(weight))


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0) -> torch.Tensor:
    if _native(x, weight):
        return cpu_native.rms_norm(x, weight, eps, offset)[0]
    if offset == 0.0 and weight.dtype == x.dtype:
        # ATen's fused kernel accumulates in fp32 and rounds once, as the reference does.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    w = weight.float() + offset
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    if _native(x, weight) and cpu_native.layer_ops_apply(x, residual) and residual.shape == x.shape:
        return cpu_native.rms_norm(x, weight, eps, offset, residual=residual)
    new_residual = x + residual
    return rms_norm_cpu(new_residual, weight, eps=eps, offset=offset), new_residual


def _on_cpu(cap) -> bool:
    return cap.device_type == "cpu"


register("rms_norm", "cpu", rms_norm_cpu, priority=5, available=_on_cpu)
register("fused_add_rms_norm", "cpu", fused_add_rms_norm_cpu, priority=5, available=_on_cpu)
