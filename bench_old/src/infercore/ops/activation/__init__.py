"""Gated MLP activations: SiLU (Llama, SwiGLU) and GELU (Gemma, GeGLU)."""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import gelu_and_mul_ref, silu_and_mul_ref

__all__ = ["GATED_ACTS", "gated_act_and_mul", "gelu_and_mul", "silu_and_mul"]

# The gated activations by the names the fused-epilogue kernels take (``act=``).
GATED_ACTS = ("silu", "gelu_tanh", "gelu")


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


def gated_act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """:func:`silu_and_mul` (``act="silu"``) or :func:`gelu_and_mul` (``"gelu_tanh"``, ``"gelu"`` = erf) of
    ``x [..., 2 * d]`` -> ``[..., d]`` in ``x.dtype``; ``ValueError`` for another ``act``."""
    if act == "silu":
        return silu_and_mul(x)
    if act not in GATED_ACTS:
        raise ValueError(f"gated_act_and_mul: act must be one of {GATED_ACTS}, got {act!r}")
    return gelu_and_mul(x, approximate="tanh" if act == "gelu_tanh" else "none")


register("silu_and_mul", "reference", silu_and_mul_ref)
register("gelu_and_mul", "reference", gelu_and_mul_ref)
