"""Gated MLP activations: SiLU (Llama, SwiGLU) and GELU (Gemma, GeGLU)."""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import gelu_and_mul_ref, silu_and_mul_ref

__all__ = ["gelu_and_mul", "silu_and_mul"]


def _check(op: str, x: torch.Tensor) -> None:
    V.floating(op, "x", x)
    V.min_ndim(op, "x", x, 1, "[..., 2 * d]")
    if x.shape[-1] % 2:
        raise ValueError(f"{op}: x last dimension must be even ([gate, up]), got {x.shape[-1]}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate, up]``.

    Args:
        x: ``[..., 2 * d]`` fp32/fp16/bf16; the first half of the last dim is the gate.

    Returns:
        ``[..., d]`` in ``x.dtype`` (computed in fp32).
    """
    _check("silu_and_mul", x)
    return dispatch("silu_and_mul", x.device)(x)


def gelu_and_mul(x: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(gate) * up`` for ``x = [gate, up]``.

    Args:
        x: ``[..., 2 * d]`` fp32/fp16/bf16; the first half of the last dim is the gate.
        approximate: ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"`` (exact erf GELU).

    Returns:
        ``[..., d]`` in ``x.dtype`` (computed in fp32).
    """
    _check("gelu_and_mul", x)
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu_and_mul: approximate must be 'tanh' or 'none', got {approximate!r}")
    return dispatch("gelu_and_mul", x.device)(x, approximate=approximate)


register("silu_and_mul", "reference", silu_and_mul_ref)
register("gelu_and_mul", "reference", gelu_and_mul_ref)
