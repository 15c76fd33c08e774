"""Triton gated delta rule: the decode kernel, the token-serial kernel, and registration.

* decode (:func:`fused_recurrent_gated_delta_rule_`): one program per (sequence, value head, block
  of value columns) loads its ``[K, BLOCK_V]`` slice of the slot's state (the only large traffic:
  64 KB per head at K = V = 128 in fp32), applies one token -- decay, delta-rule write, read-out --
  and stores it back in place. Splitting the value dim keeps many programs (and loads) in flight;
  the slice's rows are contiguous, so loads are 16-byte vectors.
* prefill (:func:`chunk_gated_delta_rule_`): the chunked tensor-core kernels of :mod:`.chunk`.
* :func:`serial_gated_delta_rule_`: the token-serial recurrence over a ragged batch (exact, kept as
  a cross-check of the chunked kernels and registered as ``"triton_serial"``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register, triton_interpreter

from .chunk import chunk_gated_delta_rule_ as _chunk_prefill


@triton.jit
def _gdr_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr,
    scale, HK, HV, K, V,
    sq_t, sq_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h, ss_slot, ss_h, ss_k,
    L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    init = tl.load(init_ptr + b) != 0
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = ks < K
    vmask = vs < V
    smask = kmask[:, None] & vmask[None, :]
    s_ptrs = state_ptr + slot * ss_slot + hv * ss_h + ks[:, None] * ss_k + vs[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
    S = tl.where(init, S, 0.0)  # a fresh sequence ignores whatever its slot held
    for t in range(start, end):
        q = tl.load(q_ptr + t * sq_t + hk * sq_h + ks, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * sq_t + hk * sq_h + ks, mask=kmask, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + t * sv_t + hv * sv_h + vs, mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * sg_t + hv).to(tl.float32)
        beta = tl.load(beta_ptr + t * sb_t + hv).to(tl.float32)
        S = S * tl.exp(g)
        pred = tl.sum(S * k[:, None], axis=0)
        delta = (v - pred) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * (q * scale)[:, None], axis=0)
        tl.store(o_ptr + t * so_t + hv * so_h + vs, o.to(o_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)


def _launch(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale, use_qk_l2norm):
    # The kernel addresses state rows with unit stride; a strided pool goes through a copy.
    if state_pool.stride(-1) != 1:
        tmp = state_pool.contiguous()
        out = _launch_contiguous(
            q, k, v, g, beta, tmp, cu_seqlens, state_slots, has_initial_state, scale, use_qk_l2norm
        )
        state_pool.copy_(tmp)
        return out
    return _launch_contiguous(
        q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale, use_qk_l2norm
    )


def _launch_contiguous(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale, use_qk_l2norm):
    T, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty_like(v)
    B = state_slots.shape[0]
    if B == 0:
        return o
    BLOCK_K = triton.next_power_of_2(K)
    BLOCK_V = min(triton.next_power_of_2(V), max(16, 8192 // BLOCK_K))
    grid = (B, HV, triton.cdiv(V, BLOCK_V))
    _gdr_recurrent_kernel[grid](
        q, k, v, g, beta, o, state_pool, cu_seqlens, state_slots, has_initial_state.to(torch.int8),
        float(scale), HK, HV, K, V,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        L2NORM=use_qk_l2norm, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V,
    )  # fmt: skip
    return o


@triton.jit
def _gdr_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slot_ptr,
    scale, HK, HV, K, V,
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sb_b, so_b, so_h, ss_slot, ss_h, ss_k,
    L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = ks < K
    vmask = vs < V
    smask = kmask[:, None] & vmask[None, :]
    # The state load is issued first: it is the only one that matters for time.
    s_ptrs = state_ptr + slot * ss_slot + hv * ss_h + ks[:, None] * ss_k + vs[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + b * sq_b + hk * sq_h + ks, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * sk_b + hk * sk_h + ks, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + hv * sv_h + vs, mask=vmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * sg_b + hv).to(tl.float32)
    beta = tl.load(beta_ptr + b * sb_b + hv).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * (q * scale)[:, None], axis=0)
    tl.store(o_ptr + b * so_b + hv * so_h + vs, o.to(o_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)


def decode_config(K: int, V: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of the decode kernel: a ``[K, BLOCK_V]`` fp32 slice of about 32 KB
    per program (64 registers a thread at 4 warps). Measured on an H200 at K = V = 128, batch 256:
    BLOCK_V 64 / 4 warps 3.64 TB/s, 32 / 4 warps 3.16, 128 / 4 warps 3.10 (fla-core 2.84)."""
    block_k = triton.next_power_of_2(K)
    return min(triton.next_power_of_2(V), max(16, 8192 // block_k)), 4


def decode_launch(
    q, k, v, g, beta, state_pool, state_slots, scale, use_qk_l2norm, *, block_v=None, num_warps=None
):  # fmt: skip
    """Launch the decode kernel; ``block_v``/``num_warps`` override :func:`decode_config` (benchmarks)."""
    B, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    o = torch.empty_like(v)
    if B == 0:
        return o
    pool = state_pool if state_pool.stride(-1) == 1 else state_pool.contiguous()
    bv, nw = decode_config(K, V)
    bv, nw = block_v or bv, num_warps or nw
    extra = {} if triton_interpreter() else {"num_warps": nw}
    _gdr_decode_kernel[(B, HV, triton.cdiv(V, bv))](
        q, k, v, g, beta, o, pool, state_slots, float(scale), HK, HV, K, V,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), pool.stride(0), pool.stride(1), pool.stride(2),
        L2NORM=use_qk_l2norm, BLOCK_K=triton.next_power_of_2(K), BLOCK_V=bv, **extra,
    )  # fmt: skip
    if pool is not state_pool:
        state_pool.copy_(pool)
    return o


def serial_gated_delta_rule_(
    q, k, v, g, beta, state_pool, *, cu_seqlens, state_slots, has_initial_state, scale, use_qk_l2norm
):
    """Token-serial prefill over a ragged batch (exact fp32 recurrence; state_pool updated in place)."""
    return _launch(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, has_initial_state, scale, use_qk_l2norm)


def chunk_gated_delta_rule_(
    q, k, v, g, beta, state_pool, *, cu_seqlens, state_slots, has_initial_state, scale, use_qk_l2norm
):
    """See :func:`infercore.ops.gated_delta.chunk_gated_delta_rule_` (chunked kernels, chunk 64)."""
    return _chunk_prefill(
        q, k, v, g, beta, state_pool, cu_seqlens=cu_seqlens, state_slots=state_slots,
        has_initial_state=has_initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


def fused_recurrent_gated_delta_rule_(q, k, v, g, beta, state_pool, *, state_slots, scale, use_qk_l2norm):
    """See :func:`infercore.ops.gated_delta.fused_recurrent_gated_delta_rule_`."""
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g, beta))
    return decode_launch(q, k, v, g, beta, state_pool, state_slots, scale, use_qk_l2norm)


_available = lambda cap: cap.is_cuda and cap.triton
register("chunk_gated_delta_rule_", "triton", chunk_gated_delta_rule_, priority=10, available=_available)
register("chunk_gated_delta_rule_", "triton_serial", serial_gated_delta_rule_, priority=5, available=_available)
register(
    "fused_recurrent_gated_delta_rule_",
    "triton",
    fused_recurrent_gated_delta_rule_,
    priority=10,
    available=_available,
)
