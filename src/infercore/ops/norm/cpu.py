"""CPU fast path of RMSNorm: ATen's fused ``rms_norm`` instead of five elementwise ops.

Same math as the reference (fp32 statistics and weight multiply, one rounding at the end).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...devices import register


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0) -> torch.Tensor:
    if offset == 0.0 and weight.dtype == x.dtype:
        # ATen's fused kernel accumulates in fp32 and rounds once, as the reference does.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    w = weight.float() + offset
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_cpu(new_residual, weight, eps=eps, offset=offset), new_residual


def _on_cpu(cap) -> bool:
    return cap.device_type == "cpu"


register("rms_norm", "cpu", rms_norm_cpu, priority=5, available=_on_cpu)
register("fused_add_rms_norm", "cpu", fused_add_rms_norm_cpu, priority=5, available=_on_cpu)
