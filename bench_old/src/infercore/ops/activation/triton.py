"""Triton gated activations: ``act(gate) * up`` for ``x = [gate, up]`` along the last dim.

Each program handles one row-chunk: it reads ``BLOCK`` gate and ``BLOCK`` up values and writes
``BLOCK`` outputs, so the op moves exactly 1.5x the input bytes. Math in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register
from infercore.ops.pdl import pdl_enabled, pdl_launch, pdl_release, pdl_wait

_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
_INV_SQRT_2: tl.constexpr = tl.constexpr(0.7071067811865476)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    y_ptr,
    d,
    stride_x,
    stride_y,
    ACT: tl.constexpr,  # 0 silu, 1 gelu (tanh approximation), 2 gelu (exact, erf)
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        # tanh(z) = 2*sigmoid(2z) - 1: no libdevice call, so it also runs under the interpreter.
        z = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * _INV_SQRT_2))
    tl.store(y_ptr + row * stride_y + cols, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, act: int) -> torch.Tensor:
    two_d = x.shape[-1]
    d = two_d // 2
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    BLOCK = min(triton.next_power_of_2(max(d, 1)), 1024)
    if x2.shape[0] > 0 and d > 0:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(d, BLOCK))](
            x2, y, d, x2.stride(0), y.stride(0), ACT=act, BLOCK=BLOCK, num_warps=4, **pdl_launch(pdl_enabled(x2))
        )
    return y.reshape(*x.shape[:-1], d)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``; x ``[..., 2d]`` -> ``[..., d]`` in x.dtype."""
    return _launch(x, 0)


def gelu_and_mul(x: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` with ``approximate`` in ``{"tanh", "none"}``."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate: expected 'tanh' or 'none', got {approximate!r}")
    return _launch(x, 1 if approximate == "tanh" else 2)


_available = lambda cap: cap.is_cuda and cap.triton
register("silu_and_mul", "triton", silu_and_mul, priority=10, available=_available)
register("gelu_and_mul", "triton", gelu_and_mul, priority=10, available=_available)
