"""Pure-PyTorch Mamba2 SSD: the per-token recurrence (the specification) and the chunked scan.

Per head ``h`` with state ``S [P, N]`` and per-token step ``dt_t = softplus(dt_t + dt_bias)``
(clamped to ``dt_limit``)::

    S = exp(dt_t * A_h) * S + dt_t * x_t B_t^T
    y_t = S C_t + D_h * x_t              (then y_t *= silu(z_t) if z is given)

Layouts (tokens first, ragged): ``x [T, H, P]``, ``dt [T, H]``, ``A [H]`` (negative),
``B, C [T, G, N]`` with ``H % G == 0`` (head ``h`` reads group ``h // (H // G)``), ``D [H]``,
``dt_bias [H]``, ``z [T, H, P]``; states ``[num_slots, H, P, N]`` indexed by int32 slots.
Math in fp32; output in ``x.dtype``.
"""

from __future__ import annotations

import torch


def _dt(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    lo, hi = dt_limit
    if lo > 0 or hi != float("inf"):
        dt = dt.clamp(lo, hi)
    return dt


def _expand(BC: torch.Tensor, H: int) -> torch.Tensor:
    return BC.float().repeat_interleave(H // BC.shape[-2], dim=-2)


def ssd_recurrent(x, dt, A, B, C, state, *, D, z, dt_bias, dt_softplus, dt_limit):
    """One sequence token by token (the spec). Returns ``(y [L, H, P] fp32, final state fp32)``."""
    L, H, P = x.shape
    dt = _dt(dt, dt_bias, dt_softplus, dt_limit)
    B, C = _expand(B, H), _expand(C, H)
    S = state.float().clone() if state is not None else x.new_zeros(H, P, B.shape[-1], dtype=torch.float32)
    y = torch.empty(L, H, P, dtype=torch.float32, device=x.device)
    xf = x.float()
    for t in range(L):
        S = (
            S * torch.exp(dt[t] * A.float())[:, None, None]
            + (dt[t][:, None] * xf[t])[:, :, None] * B[t][:, None, :]
        )
        y[t] = torch.einsum("hpn,hn->hp", S, C[t])
    if D is not None:
        y = y + D.float()[:, None] * xf
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    return y, S


def ssd_chunked(x, dt, A, B, C, state, *, D, z, dt_bias, dt_softplus, dt_limit, chunk_size=64):
    """One sequence in chunks (the SSD "state space dual" form): within a chunk the output is a
    masked, decayed ``(C B^T)`` matmul; chunks hand the state on. Same results as
    :func:`ssd_recurrent`."""
    L, H, P = x.shape
    dt = _dt(dt, dt_bias, dt_softplus, dt_limit)
    B, C = _expand(B, H), _expand(C, H)
    N = B.shape[-1]
    S = state.float().clone() if state is not None else x.new_zeros(H, P, N, dtype=torch.float32)
    xf = x.float()
    y = torch.empty(L, H, P, dtype=torch.float32, device=x.device)
    for s in range(0, L, chunk_size):
        e = min(L, s + chunk_size)
        a = (dt[s:e] * A.float()).transpose(0, 1)  # [H, c] log decay per step
        cum = a.cumsum(-1)
        causal = torch.ones(e - s, e - s, dtype=torch.bool, device=x.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, i, j]
        cb = torch.einsum("ihn,jhn->hij", C[s:e], B[s:e]) * decay
        xdt = (xf[s:e] * dt[s:e][:, :, None]).transpose(0, 1)  # [H, c, P]
        y_intra = cb @ xdt  # [H, c, P]
        y_inter = torch.einsum("hpn,ihn->hip", S, C[s:e]) * cum.exp()[:, :, None]
        y[s:e] = (y_intra + y_inter).transpose(0, 1)
        tail = (cum[:, -1:] - cum).exp()  # decay from step j to the chunk end
        S = S * cum[:, -1].exp()[:, None, None] + torch.einsum("hj,hjp,jhn->hpn", tail, xdt, B[s:e])
    if D is not None:
        y = y + D.float()[:, None] * xf
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    return y, S


def mamba_chunk_scan_ref(
    x,
    dt,
    A,
    B,
    C,
    state_pool,
    *,
    cu_seqlens,
    state_slots,
    has_initial_state,
    D,
    z,
    dt_bias,
    dt_softplus,
    dt_limit,
):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    bounds, slots, init = cu_seqlens.tolist(), state_slots.tolist(), has_initial_state.tolist()
    for b, slot in enumerate(slots):
        s, e = bounds[b], bounds[b + 1]
        # A negative slot is a padding sequence (as in decode): zero state in, no state write. Python's
        # negative indexing would otherwise read and overwrite the pool's last slot.
        y, S = ssd_chunked(
            x[s:e], dt[s:e], A, B[s:e], C[s:e], state_pool[slot] if init[b] and slot >= 0 else None,
            D=D, z=None if z is None else z[s:e], dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        )  # fmt: skip
        out[s:e] = y.to(x.dtype)
        if slot >= 0:
            state_pool[slot] = S.to(state_pool.dtype)
    return out


def selective_state_update_ref(
    x, dt, A, B, C, state_pool, *, state_slots, D, z, dt_bias, dt_softplus, dt_limit
):
    slots = state_slots.long()
    valid = slots >= 0  # a negative slot is a padding row: zero state, no state write
    H = x.shape[1]
    dt = _dt(dt, dt_bias, dt_softplus, dt_limit)  # [Bt, H]
    Bm, Cm = _expand(B, H), _expand(C, H)  # [Bt, H, N]
    S = state_pool[slots.clamp(min=0)].float() * valid[:, None, None, None]
    xf = x.float()
    S = S * torch.exp(dt * A.float())[:, :, None, None] + (dt[:, :, None] * xf)[..., None] * Bm[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", S, Cm)
    if D is not None:
        y = y + D.float()[:, None] * xf
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    state_pool[slots[valid]] = S[valid].to(state_pool.dtype)
    return y.to(x.dtype)
