"""RMSNorm and fused residual-add + RMSNorm."""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import fused_add_rms_norm_ref, rms_norm_ref

__all__ = ["fused_add_rms_norm", "rms_norm"]


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
    V.floating(op, "x", x)
    V.min_ndim(op, "x", x, 1, "[..., hidden]")
    V.floating(op, "weight", weight)
    V.ndim(op, "weight", weight, 1, "[hidden]")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: weight has {weight.shape[0]} elements but x has hidden size {x.shape[-1]}")
    V.same_device(op, "x", x, weight=weight)
    V.number(op, "eps", eps, nonneg=True)
    V.number(op, "offset", offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Root-mean-square norm over the last dimension.

    Args:
        x: ``[..., H]`` fp32/fp16/bf16.
        weight: ``[H]`` any float dtype.
        eps: added to the mean square before the reciprocal square root.
        offset: the weight is used as ``offset + weight`` (Gemma stores ``w`` and scales by ``1 + w``:
            pass ``offset=1.0``).

    Returns:
        ``[..., H]`` in ``x.dtype``; ``y = x * rsqrt(mean(x^2) + eps) * (offset + weight)``, computed in fp32.
    """
    _check("rms_norm", x, weight, eps, offset)
    return dispatch("rms_norm", x.device)(x, weight, eps=float(eps), offset=float(offset))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add followed by RMSNorm: the pre-norm transformer block's glue.

    Args:
        x: ``[..., H]`` fp32/fp16/bf16 (the sub-layer output).
        residual: same shape and dtype as ``x`` (the residual stream).
        weight, eps, offset: as in :func:`rms_norm`.

    Returns:
        ``(y, new_residual)`` where ``new_residual = x + residual`` rounded to ``x.dtype`` and
        ``y = rms_norm(new_residual)``. Inputs are not modified.
    """
    op = "fused_add_rms_norm"
    _check(op, x, weight, eps, offset)
    V.floating(op, "residual", residual)
    V.same_dtype(op, "residual", residual, "x", x)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
    V.same_device(op, "x", x, residual=residual)
    return dispatch(op, x.device)(x, residual, weight, eps=float(eps), offset=float(offset))


register("rms_norm", "reference", rms_norm_ref)
register("fused_add_rms_norm", "reference", fused_add_rms_norm_ref)
