"""Triton gated RMSNorm: one program per (row, group); statistics in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, g_ptr, w_ptr, y_ptr, H, GS, eps,
    NORM_BEFORE_GATE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    cols = grp * GS + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GS
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(g_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    if not NORM_BEFORE_GATE:
        x = x * act
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / GS + eps)
    y = x * inv * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_BEFORE_GATE:
        y = y * act
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float, group_size: int | None,
    norm_before_gate: bool,
) -> torch.Tensor:  # fmt: skip
    """See :func:`infercore.ops.gated_norm.gated_rms_norm`. x, gate ``[..., H]``; weight ``[H]``."""
    H = x.shape[-1]
    gs = group_size or H
    x2 = x.reshape(-1, H).contiguous()
    g2 = gate.reshape(-1, H).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _gated_rms_norm_kernel[(x2.shape[0], H // gs)](
            x2, g2, weight.contiguous(), y, H, gs, float(eps),
            NORM_BEFORE_GATE=norm_before_gate, BLOCK=triton.next_power_of_2(gs),
        )  # fmt: skip
    return y.reshape(x.shape)


register(
    "gated_rms_norm", "triton", gated_rms_norm, priority=10, available=lambda cap: cap.is_cuda and cap.triton
)
