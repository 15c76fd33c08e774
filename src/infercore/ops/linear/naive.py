"""Pure-PyTorch skinny linear (the specification the Triton GEMV is tested against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # F.linear is the contract: the kernel must agree with it up to fp32-accumulation rounding.
    return F.linear(x, weight, bias)
