"""Pure-PyTorch gated RMSNorm (Qwen3-Next's and Mamba2's output norm).

``norm_before_gate=True`` (Qwen3-Next): ``y = rms_norm(x) * weight * silu(gate)``.
``norm_before_gate=False`` (Mamba2): ``y = rms_norm(x * silu(gate)) * weight``.
The mean square is taken over groups of ``group_size`` channels of the last dim (the whole last
dim when ``group_size`` is None). Math in fp32; output in ``x.dtype``.
"""

from __future__ import annotations

import torch


def gated_rms_norm_ref(x, gate, weight, *, eps, group_size, norm_before_gate):
    H = x.shape[-1]
    gs = group_size or H
    xf = x.float()
    act = torch.nn.functional.silu(gate.float())
    if not norm_before_gate:
        xf = xf * act
    xg = xf.reshape(*x.shape[:-1], H // gs, gs)
    xf = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    y = xf * weight.float()
    if norm_before_gate:
        y = y * act
    return y.to(x.dtype)
