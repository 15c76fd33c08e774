"""Mamba2 SSD over a state pool: chunked scan (prefill, ragged) and selective state update (decode).

See :mod:`.naive` for the recurrence and the layouts.
"""

from __future__ import annotations

import math

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import mamba_chunk_scan_ref, selective_state_update_ref

__all__ = ["mamba_chunk_scan_", "selective_state_update_"]


def _check(op, x, dt, A, B, C, state_pool, D, z, dt_bias, dt_limit, state_slots, batch=None):
    """``batch``: the number of sequences (ragged prefill), or None for one per token of x (decode)."""
    V.floating(op, "x", x)
    V.ndim(op, "x", x, 3, "[tokens, heads, head_dim]")
    T, H, P = x.shape
    if batch is None:
        batch = T
    V.floating(op, "dt", dt)
    if dt.shape != (T, H):
        raise ValueError(f"{op}: dt must be [{T}, {H}], got {tuple(dt.shape)}")
    V.floating(op, "A", A)
    if A.shape != (H,):
        raise ValueError(f"{op}: A must be [{H}], got {tuple(A.shape)}")
    for name, t in (("B", B), ("C", C)):
        V.floating(op, name, t)
        V.ndim(op, name, t, 3, "[tokens, groups, state_dim]")
        V.dim_at_least_one(op, name, t, 1, "groups")
    if B.shape != C.shape or B.shape[0] != T or H % B.shape[1]:
        raise ValueError(
            f"{op}: B and C must be [{T}, G, N] with H={H} a multiple of G, "
            f"got {tuple(B.shape)} and {tuple(C.shape)}"
        )
    N = B.shape[2]
    V.floating(op, "state_pool", state_pool)
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (H, P, N):
        raise ValueError(
            f"{op}: state_pool must be [num_slots, {H}, {P}, {N}], got {tuple(state_pool.shape)}"
        )
    V.dim_at_least_one(op, "state_pool", state_pool, 0, "num_slots")
    for name, t, shape in (("D", D, (H,)), ("dt_bias", dt_bias, (H,)), ("z", z, (T, H, P))):
        if t is not None:
            V.floating(op, name, t)
            if t.shape != shape:
                raise ValueError(f"{op}: {name} must be {list(shape)}, got {tuple(t.shape)}")
    if not (isinstance(dt_limit, tuple) and len(dt_limit) == 2 and 0 <= dt_limit[0] < dt_limit[1]):
        raise ValueError(f"{op}: dt_limit must be a (low, high) tuple with 0 <= low < high, got {dt_limit!r}")
    V.integer(op, "state_slots", state_slots, (torch.int32,))
    if state_slots.shape != (batch,):
        raise ValueError(f"{op}: state_slots must be int32 [{batch}], got {tuple(state_slots.shape)}")
    V.same_device(op, "x", x, dt=dt, A=A, B=B, C=C, state_pool=state_pool, D=D, z=z, dt_bias=dt_bias,
                  state_slots=state_slots)  # fmt: skip


def mamba_chunk_scan_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_pool: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """Mamba2 SSD over a ragged batch (prefill); final states written to the slots.

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]`` (raw, before ``dt_bias`` / softplus); A: ``[H]`` (negative).
        B, C: ``[T, G, N]``, ``H % G == 0``.
        state_pool: ``[num_slots, H, P, N]`` (fp32 recommended).
        cu_seqlens: int32 ``[B + 1]``; state_slots: int32 ``[B]`` distinct, a negative slot marks a
            padding sequence as in decode (zero state in, ``has_initial_state`` ignored, outputs still
            computed, no state write); has_initial_state: bool ``[B]`` (False starts from zeros).
        D: ``[H]`` skip connection; z: ``[T, H, P]`` gate (``y *= silu(z)``); dt_bias: ``[H]``;
        dt_softplus: apply softplus to ``dt + dt_bias``; dt_limit: clamp of the step.

    Returns:
        ``[T, H, P]`` in ``x.dtype``.
    """
    op = "mamba_chunk_scan_"
    nb = V.ragged_batch(op, cu_seqlens, has_initial_state)
    _check(op, x, dt, A, B, C, state_pool, D, z, dt_bias, dt_limit, state_slots, nb)
    V.same_device(op, "x", x, cu_seqlens=cu_seqlens)
    dt_softplus = V.flag(op, "dt_softplus", dt_softplus)
    return dispatch(op, x.device)(
        x, dt, A, B, C, state_pool, cu_seqlens=cu_seqlens, state_slots=state_slots,
        has_initial_state=has_initial_state, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
    )  # fmt: skip


def selective_state_update_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_pool: torch.Tensor,
    *,
    state_slots: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """One Mamba2 decode step: ``x [B, H, P]`` (one token per sequence), states updated in place.
    Arguments as in :func:`mamba_chunk_scan_` with ``T = B``; a negative slot marks a padding row
    (CUDA-graph batch buckets): zero state in, no state write. Returns ``[B, H, P]`` in ``x.dtype``."""
    op = "selective_state_update_"
    _check(op, x, dt, A, B, C, state_pool, D, z, dt_bias, dt_limit, state_slots)
    dt_softplus = V.flag(op, "dt_softplus", dt_softplus)
    return dispatch(op, x.device)(
        x, dt, A, B, C, state_pool, state_slots=state_slots, D=D, z=z, dt_bias=dt_bias,
        dt_softplus=dt_softplus, dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
    )  # fmt: skip


register("mamba_chunk_scan_", "reference", mamba_chunk_scan_ref)
register("selective_state_update_", "reference", selective_state_update_ref)
