"""Gated activations of the MLP (``act(gate) * up`` on a fused ``[gate, up]`` projection)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # fp32 math, one rounding at the end: what the fused kernel does in registers.
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_and_mul_ref(x: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate=approximate) * up).to(x.dtype)
