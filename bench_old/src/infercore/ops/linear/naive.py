"""Pure-PyTorch skinny linear (the specification the Triton GEMV is tested against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..activation.naive import gelu_and_mul_ref, silu_and_mul_ref


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      act: str | None = None) -> torch.Tensor:  # fmt: skip
    # F.linear (then the gated activation of ops.activation) is the contract: the kernel must
    # agree with it up to fp32-accumulation rounding.
    y = F.linear(x, weight, bias)
    if act is None:
        return y
    if act == "silu":
        return silu_and_mul_ref(y)
    return gelu_and_mul_ref(y, approximate="tanh" if act == "gelu_tanh" else "none")
