"""Gated delta rule (Gated DeltaNet linear attention) over a ragged batch with a state pool.

* :func:`chunk_gated_delta_rule_` -- prefill: a ragged batch of sequences, each starting from its
  slot's state (or zeros), processed in chunks; final states written back to the slots.
* :func:`fused_recurrent_gated_delta_rule_` -- decode: one token per sequence, states updated in
  place.

See :mod:`.naive` for the recurrence and the layouts.
"""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import chunk_gated_delta_rule_ref, fused_recurrent_gated_delta_rule_ref

__all__ = ["chunk_gated_delta_rule_", "fused_recurrent_gated_delta_rule_"]


def _check(op, q, k, v, g, beta, state_pool, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.floating(op, name, t)
        V.ndim(op, name, t, 3, "[tokens, heads, head_dim]")
    V.same_dtype(op, "k", k, "q", q)
    V.same_dtype(op, "v", v, "q", q)
    if k.shape != q.shape:
        raise ValueError(f"{op}: k has shape {tuple(k.shape)} but q has {tuple(q.shape)}")
    V.dim_at_least_one(op, "q", q, 1, "heads")
    T, hk, dk = q.shape
    if v.shape[0] != T:
        raise ValueError(f"{op}: v has {v.shape[0]} tokens but q has {T}")
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"{op}: v heads ({hv}) must be a multiple of q/k heads ({hk})")
    for name, t in (("g", g), ("beta", beta)):
        V.floating(op, name, t)
        if t.shape != (T, hv):
            raise ValueError(f"{op}: {name} must be [tokens, v_heads] = {(T, hv)}, got {tuple(t.shape)}")
    V.floating(op, "state_pool", state_pool, (torch.float32, torch.float16, torch.bfloat16))
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (hv, dk, dv):
        raise ValueError(
            f"{op}: state_pool must be [num_slots, v_heads, k_dim, v_dim] = [*, {hv}, {dk}, {dv}], "
            f"got {tuple(state_pool.shape)}"
        )
    V.dim_at_least_one(op, "state_pool", state_pool, 0, "num_slots")
    V.same_device(op, "q", q, k=k, v=v, g=g, beta=beta, state_pool=state_pool)
    return dk**-0.5 if scale is None else V.number(op, "scale", scale, positive=True)


def _slots(op, state_slots, n, device):
    V.integer(op, "state_slots", state_slots, (torch.int32,))
    if state_slots.shape != (n,):
        raise ValueError(f"{op}: state_slots must be int32 [{n}], got shape {tuple(state_slots.shape)}")
    if state_slots.device != device:
        raise ValueError(f"{op}: state_slots is on {state_slots.device} but q is on {device}")


def chunk_gated_delta_rule_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Gated delta rule over a ragged batch (prefill); updates ``state_pool`` in place.

    Args:
        q, k: ``[T, Hk, K]`` fp32/fp16/bf16, tokens of all sequences back to back.
        v: ``[T, Hv, V]`` same dtype; ``Hv % Hk == 0`` (value head ``h`` reads key head
            ``h // (Hv // Hk)``).
        g: ``[T, Hv]`` log-space decay (``<= 0``), any float dtype (used in fp32).
        beta: ``[T, Hv]`` write strength in ``[0, 1]``.
        state_pool: ``[num_slots, Hv, K, V]`` (fp32 recommended); slot ``state_slots[b]`` holds
            sequence ``b``'s state on entry (if ``has_initial_state[b]``) and its final state on exit.
        cu_seqlens: int32 ``[B + 1]``, sequence ``b`` is tokens ``[cu[b], cu[b+1])``.
        state_slots: int32 ``[B]``, distinct slots; a negative slot marks a padding sequence, as in
            decode: it starts from a zero state (``has_initial_state`` ignored), its outputs are still
            computed, and it writes no state.
        has_initial_state: bool ``[B]``; False starts from zeros (the slot's content is ignored).
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm: L2-normalize q and k per head first (Qwen3-Next does).

    Returns:
        ``[T, Hv, V]`` in ``v.dtype``.
    """
    op = "chunk_gated_delta_rule_"
    scale = _check(op, q, k, v, g, beta, state_pool, scale)
    B = V.ragged_batch(op, cu_seqlens, has_initial_state)
    _slots(op, state_slots, B, q.device)
    V.same_device(op, "q", q, cu_seqlens=cu_seqlens)
    use_qk_l2norm = V.flag(op, "use_qk_l2norm", use_qk_l2norm)
    return dispatch(op, q.device)(
        q, k, v, g, beta, state_pool, cu_seqlens=cu_seqlens, state_slots=state_slots,
        has_initial_state=has_initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


def fused_recurrent_gated_delta_rule_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    *,
    state_slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """One decode step of the gated delta rule; updates each sequence's state slot in place.

    Args:
        q, k: ``[B, Hk, K]``; v ``[B, Hv, V]``; g, beta ``[B, Hv]`` -- one token per sequence.
        state_pool: ``[num_slots, Hv, K, V]``; state_slots: int32 ``[B]``, distinct slots; a
            negative slot marks a padding row (CUDA-graph batch buckets): it starts from a zero
            state and writes none.
        scale, use_qk_l2norm: as in :func:`chunk_gated_delta_rule_`.

    Returns:
        ``[B, Hv, V]`` in ``v.dtype``.
    """
    op = "fused_recurrent_gated_delta_rule_"
    scale = _check(op, q, k, v, g, beta, state_pool, scale)
    _slots(op, state_slots, q.shape[0], q.device)
    use_qk_l2norm = V.flag(op, "use_qk_l2norm", use_qk_l2norm)
    return dispatch(op, q.device)(
        q, k, v, g, beta, state_pool, state_slots=state_slots, scale=scale, use_qk_l2norm=use_qk_l2norm
    )


register("chunk_gated_delta_rule_", "reference", chunk_gated_delta_rule_ref)
register("fused_recurrent_gated_delta_rule_", "reference", fused_recurrent_gated_delta_rule_ref)
