"""Gated RMSNorm: the output norm of Gated DeltaNet (Qwen3-Next) and Mamba2 mixers."""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import gated_rms_norm_ref

__all__ = ["gated_rms_norm"]


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """RMSNorm with a SiLU gate.

    Args:
        x: ``[..., H]`` fp32/fp16/bf16; gate: same shape (any float dtype); weight: ``[H]``.
        eps: added to the mean square.
        group_size: normalize over groups of this many channels (Mamba2 ``H / n_groups``);
            None = the whole last dim. Must divide ``H``.
        norm_before_gate: True -> ``rms_norm(x) * weight * silu(gate)`` (Qwen3-Next);
            False -> ``rms_norm(x * silu(gate)) * weight`` (Mamba2).

    Returns:
        ``[..., H]`` in ``x.dtype``, computed in fp32.
    """
    op = "gated_rms_norm"
    V.floating(op, "x", x)
    V.min_ndim(op, "x", x, 1, "[..., hidden]")
    V.floating(op, "gate", gate)
    if gate.shape != x.shape:
        raise ValueError(f"{op}: gate has shape {tuple(gate.shape)} but x has {tuple(x.shape)}")
    V.floating(op, "weight", weight)
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"{op}: weight must be [{H}], got {tuple(weight.shape)}")
    V.same_device(op, "x", x, gate=gate, weight=weight)
    V.number(op, "eps", eps, nonneg=True)
    if group_size is not None:
        if (
            isinstance(group_size, bool)
            or not isinstance(group_size, int)
            or group_size <= 0
            or H % group_size
        ):
            raise ValueError(f"{op}: group_size must be a positive divisor of {H}, got {group_size!r}")
    norm_before_gate = V.flag(op, "norm_before_gate", norm_before_gate)
    return dispatch(op, x.device)(
        x, gate, weight, eps=float(eps), group_size=group_size, norm_before_gate=norm_before_gate
    )


register("gated_rms_norm", "reference", gated_rms_norm_ref)
