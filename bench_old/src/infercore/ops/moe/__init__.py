"""Routed experts of a sparse MoE layer: ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])``.

The Triton implementation (``triton.py``) sorts the (token, expert) pairs by expert on the device and
runs one program per (expert, output tile) over only that expert's tokens, so it reads each
routed expert's weights once, computes only the routed products and never syncs with the host
(CUDA-graph safe).
"""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import check_moe_args, moe_experts_ref

__all__ = ["moe_experts_routed"]


def moe_experts_routed(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    *, expert_offset: int | None = None,
) -> torch.Tensor:
    """Top-k routed SiLU-gated experts.

    Args:
        x: ``[T, H]`` fp32/fp16/bf16. gate_up: ``[E, 2I, H]`` (gate rows, then up rows); down:
            ``[E, H, I]``; both in ``x.dtype`` (HF transformers 5 layout).
        weights: ``[T, k]`` routing weights (any float dtype); ids: ``[T, k]`` int32/int64 expert ids
            in ``[0, E)``. All on one device. The id values are not checked (that would read them
            on the host, a sync a CUDA graph cannot hold); an id outside ``[0, E)`` is undefined.
        expert_offset: expert parallelism: ``gate_up`` / ``down`` hold the experts
            ``[expert_offset, expert_offset + E)`` of a larger set, ``ids`` are global, and pairs routed to an
            expert outside that range are skipped (the result is this holder's share of the sum).

    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    op = "moe_experts_routed"
    check_moe_args(op, x, gate_up, down, weights, ids)
    V.dim_at_least_one(op, "gate_up", gate_up, 0, "num_experts (E)")  # down has the same E
    V.floating(op, "x", x)
    V.same_device(op, "x", x, gate_up=gate_up, down=down, weights=weights, ids=ids)
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise TypeError(f"{op}: gate_up / down must have x's dtype {x.dtype}, got {gate_up.dtype} / {down.dtype}")
    if not weights.is_floating_point():
        raise TypeError(f"{op}: weights must be a floating tensor, got {weights.dtype}")
    if expert_offset is None:
        return dispatch(op, x.device)(x, gate_up, down, weights, ids)
    if isinstance(expert_offset, bool) or not isinstance(expert_offset, int) or expert_offset < 0:
        raise ValueError(f"{op}: expert_offset must be an int >= 0 or None, got {expert_offset!r}")
    return dispatch(op, x.device)(x, gate_up, down, weights, ids, expert_offset)


register("moe_experts_routed", "reference", moe_experts_ref)
