"""Causal depthwise conv1d against a per-request state pool: prefill (ragged) and decode update.

See :mod:`.naive` for the layouts and the formula.
"""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import causal_conv1d_prefill_ref, causal_conv1d_update_ref

__all__ = ["causal_conv1d_prefill_", "causal_conv1d_update_"]

ACTIVATIONS = (None, "silu")


def _check(op, x, weight, conv_state, bias, activation, state_slots, batch=None):
    """``batch``: the number of sequences (ragged prefill), or None for one per row of x (decode)."""
    V.floating(op, "x", x)
    V.ndim(op, "x", x, 2, "[tokens, channels]")
    if batch is None:
        batch = x.shape[0]
    V.floating(op, "weight", weight)
    V.ndim(op, "weight", weight, 2, "[channels, width]")
    C, W = weight.shape
    if x.shape[1] != C:
        raise ValueError(f"{op}: x has {x.shape[1]} channels but weight has {C}")
    if W < 2:
        raise ValueError(f"{op}: weight width must be >= 2, got {W}")
    V.floating(op, "conv_state", conv_state)
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (C, W - 1):
        raise ValueError(f"{op}: conv_state must be [num_slots, {C}, {W - 1}], got {tuple(conv_state.shape)}")
    V.dim_at_least_one(op, "conv_state", conv_state, 0, "num_slots")
    if bias is not None:
        V.floating(op, "bias", bias)
        if bias.shape != (C,):
            raise ValueError(f"{op}: bias must be [{C}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    V.integer(op, "state_slots", state_slots, (torch.int32,))
    if state_slots.shape != (batch,):
        raise ValueError(f"{op}: state_slots must be int32 [{batch}], got {tuple(state_slots.shape)}")
    V.same_device(op, "x", x, weight=weight, conv_state=conv_state, bias=bias, state_slots=state_slots)


def causal_conv1d_prefill_(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal conv over a ragged batch; each sequence continues from its slot's state.

    Args:
        x: ``[T, C]`` fp32/fp16/bf16, sequences back to back (``cu_seqlens`` int32 ``[B + 1]``).
        weight: ``[C, W]`` depthwise filters; bias: ``[C]`` or None.
        conv_state: ``[num_slots, C, W - 1]``, ``num_slots >= 1``; slot ``state_slots[b]`` (int32
            ``[B]``, distinct) supplies the ``W - 1`` inputs before the sequence when
            ``has_initial_state[b]`` (bool ``[B]``; zeros otherwise) and receives the sequence's last
            ``W - 1`` inputs. A negative slot marks a padding sequence, as in decode: zero history
            (``has_initial_state`` ignored), outputs still computed, no state write.
        activation: ``"silu"`` or None.

    Returns:
        ``[T, C]`` in ``x.dtype``.
    """
    op = "causal_conv1d_prefill_"
    B = V.ragged_batch(op, cu_seqlens, has_initial_state)
    _check(op, x, weight, conv_state, bias, activation, state_slots, B)
    V.same_device(op, "x", x, cu_seqlens=cu_seqlens, has_initial_state=has_initial_state)
    return dispatch(op, x.device)(
        x, weight, conv_state, cu_seqlens=cu_seqlens, state_slots=state_slots,
        has_initial_state=has_initial_state, bias=bias, activation=activation,
    )  # fmt: skip


def causal_conv1d_update_(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    *,
    state_slots: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step: ``x [B, C]`` (one token per sequence) against its state slot, which is
    shifted by one input in place. Other arguments as in :func:`causal_conv1d_prefill_`; a negative
    slot marks a padding row (CUDA-graph batch buckets): zero history, no state write.
    Returns ``[B, C]`` in ``x.dtype``."""
    op = "causal_conv1d_update_"
    _check(op, x, weight, conv_state, bias, activation, state_slots)
    return dispatch(op, x.device)(
        x, weight, conv_state, state_slots=state_slots, bias=bias, activation=activation
    )


register("causal_conv1d_prefill_", "reference", causal_conv1d_prefill_ref)
register("causal_conv1d_update_", "reference", causal_conv1d_update_ref)
