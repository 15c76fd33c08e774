"""Triton Mamba2 SSD: a fused recurrent kernel serving the ragged scan and the decode update.

One program per (sequence, head, block of head-dim rows) keeps its ``[BLOCK_P, N]`` slice of the
state in registers and walks the sequence's tokens (fp32), reading and writing the slot once.
Decode is the same kernel over length-1 sequences. A chunked SSD kernel (tensor-core ``C B^T``
blocks) would be faster for long prefills; this one is exact and token-serial per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register


@triton.jit
def _ssd_recurrent_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, y_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr,
    H, G, P, N, dt_lo, dt_hi,
    sx_t, sx_h, sdt_t, sb_t, sb_g, ss_slot, ss_h, ss_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    CLAMP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    grp = h // (H // G)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    init = tl.load(init_ptr + b) != 0
    ps = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    pmask = ps < P
    nmask = ns < N
    smask = pmask[:, None] & (nmask & (ns * 0 + slot >= 0))[None, :]  # negative slot: padding, no state access
    s_ptrs = state_ptr + slot * ss_slot + h * ss_h + ps[:, None] * ss_p + ns[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
    S = tl.where(init, S, 0.0)  # a fresh sequence ignores whatever its slot held
    A = tl.load(a_ptr + h).to(tl.float32)
    D = 0.0
    if HAS_D:
        D = tl.load(d_ptr + h).to(tl.float32)
    dtb = 0.0
    if HAS_DTB:
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(start, end):
        dt = tl.load(dt_ptr + t * sdt_t + h).to(tl.float32) + dtb
        if SOFTPLUS:
            # softplus without overflow: log1p(exp(x)) = max(x, 0) + log(1 + exp(-|x|))
            dt = tl.maximum(dt, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(dt)))
        if CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        x = tl.load(x_ptr + t * sx_t + h * sx_h + ps, mask=pmask, other=0.0).to(tl.float32)
        Bv = tl.load(b_ptr + t * sb_t + grp * sb_g + ns, mask=nmask, other=0.0).to(tl.float32)
        Cv = tl.load(c_ptr + t * sb_t + grp * sb_g + ns, mask=nmask, other=0.0).to(tl.float32)
        S = S * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(S * Cv[None, :], axis=1) + D * x
        if HAS_Z:
            z = tl.load(z_ptr + t * sx_t + h * sx_h + ps, mask=pmask, other=0.0).to(tl.float32)
            y = y * (z / (1.0 + tl.exp(-z)))
        tl.store(y_ptr + t * sx_t + h * sx_h + ps, y.to(y_ptr.dtype.element_ty), mask=pmask)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)


def _launch(x, dt, A, B, C, state_pool, cu, slots, init, D, z, dt_bias, dt_softplus, dt_limit):
    # The kernel addresses state rows with unit stride; a strided pool goes through a copy.
    if state_pool.stride(-1) != 1:
        tmp = state_pool.contiguous()
        out = _launch_contiguous(x, dt, A, B, C, tmp, cu, slots, init, D, z, dt_bias, dt_softplus, dt_limit)
        state_pool.copy_(tmp)
        return out
    return _launch_contiguous(
        x, dt, A, B, C, state_pool, cu, slots, init, D, z, dt_bias, dt_softplus, dt_limit
    )


def _launch_contiguous(x, dt, A, B, C, state_pool, cu, slots, init, D, z, dt_bias, dt_softplus, dt_limit):
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    z = z.contiguous() if z is not None else None
    y = torch.empty_like(x)
    nb = slots.shape[0]
    if nb == 0:
        return y
    BLOCK_N = triton.next_power_of_2(N)
    BLOCK_P = min(triton.next_power_of_2(P), max(8, 8192 // BLOCK_N))
    lo, hi = dt_limit
    _ssd_recurrent_kernel[(nb, H, triton.cdiv(P, BLOCK_P))](
        x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A,
        y, state_pool, cu, slots, init.to(torch.int8), H, G, P, N, float(lo), float(min(hi, 3.0e38)),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None, SOFTPLUS=dt_softplus,
        CLAMP=lo > 0 or hi != float("inf"), BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return y


def mamba_chunk_scan_(
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
    """See :func:`infercore.ops.mamba.mamba_chunk_scan_` (state_pool last dim contiguous)."""
    return _launch(x, dt, A, B, C, state_pool, cu_seqlens, state_slots, has_initial_state, D, z, dt_bias,
                   dt_softplus, dt_limit)  # fmt: skip


def selective_state_update_(x, dt, A, B, C, state_pool, *, state_slots, D, z, dt_bias, dt_softplus, dt_limit):
    """See :func:`infercore.ops.mamba.selective_state_update_`."""
    nb = x.shape[0]
    cu = torch.arange(nb + 1, dtype=torch.int32, device=x.device)
    init = torch.ones(nb, dtype=torch.bool, device=x.device)
    return _launch(x, dt, A, B, C, state_pool, cu, state_slots, init, D, z, dt_bias, dt_softplus, dt_limit)


_available = lambda cap: cap.is_cuda and cap.triton
register("mamba_chunk_scan_", "triton", mamba_chunk_scan_, priority=10, available=_available)
register("selective_state_update_", "triton", selective_state_update_, priority=10, available=_available)
