"""Skinny linear ``y = x @ W^T (+ bias)`` for decode-sized M (1-16 rows), where the weight stream
is the whole cost and a GEMV kernel that keeps every SM's loads in flight beats cuBLAS."""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import skinny_linear_ref

__all__ = ["skinny_linear"]


ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  act: str | None = None) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` tuned for few rows of ``x``, optionally with the gated-MLP
    activation fused in.

    Args:
        x: ``[..., K]`` fp32/fp16/bf16; leading dims are flattened to M rows (the fast path is
            tuned for M <= 16 but any M is correct).
        weight: ``[N, K]`` in ``x.dtype``, nn.Linear layout (row-major, K contiguous).
        bias: optional ``[N]`` in ``x.dtype``.
        act: None, or ``"silu"`` / ``"gelu_tanh"`` / ``"gelu"`` (erf): ``weight`` is then a merged
            ``[gate; up]`` projection (N = 2D even, gate rows first) and the result is
            :func:`~infercore.ops.silu_and_mul` (or ``gelu_and_mul``) of the linear's output.

    Returns:
        ``[..., N]`` (``[..., N // 2]`` with ``act``) in ``x.dtype``; products accumulated in fp32.

    Raises:
        TypeError: a non-tensor, a non-float dtype, or mismatched dtypes. ValueError: a wrong rank,
        mismatched K/N, tensors on different devices, an unknown ``act`` or an odd N with ``act``.
    """
    op = "skinny_linear"
    V.floating(op, "x", x)
    V.min_ndim(op, "x", x, 1, "[..., K]")
    V.floating(op, "weight", weight)
    V.ndim(op, "weight", weight, 2, "[N, K]")
    V.same_dtype(op, "weight", weight, "x", x)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight [N, K] has K={weight.shape[1]} but x has K={x.shape[-1]}")
    if bias is not None:
        V.floating(op, "bias", bias)
        V.ndim(op, "bias", bias, 1, "[N]")
        V.same_dtype(op, "bias", bias, "x", x)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{op}: bias has {bias.shape[0]} elements but weight has N={weight.shape[0]} rows")
    V.same_device(op, "x", x, weight=weight, bias=bias)
    if act is not None:
        if act not in ACTIVATIONS:
            raise ValueError(f"{op}: act must be None or one of {ACTIVATIONS}, got {act!r}")
        if weight.shape[0] % 2:
            n = weight.shape[0]
            raise ValueError(f"{op}: weight [N, K] with act={act!r} needs an even N (gate; up), got N={n}")
        return dispatch(op, x.device)(x, weight, bias, act=act)
    return dispatch(op, x.device)(x, weight, bias)


register("skinny_linear", "reference", skinny_linear_ref)
