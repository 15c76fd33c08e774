"""Triton gated delta rule: the decode kernel, and registration of both Triton implementations.

* decode (:func:`fused_recurrent_gated_delta_rule_`): one program per (sequence, value head, block
  of value columns) loads its ``[K, BLOCK_V]`` slice of the slot's state (the only large traffic:
  64 KB per head at K = V = 128 in fp32), applies one token -- decay, delta-rule write, read-out --
  and stores it back in place. Splitting the value dim keeps many programs (and loads) in flight;
  the slice's rows are contiguous, so loads are 16-byte vectors.
* prefill: the chunked tensor-core kernels of :mod:`.chunk` (:func:`.chunk.chunk_gated_delta_rule_`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register, triton_interpreter

from .chunk import chunk_gated_delta_rule_


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
    # A negative slot marks a padding row (CUDA-graph buckets): its state is neither read nor written.
    # (The slot test is broadcast to a vector: the interpreter rejects a scalar & block mask.)
    smask = kmask[:, None] & (vmask & (vs * 0 + slot >= 0))[None, :]
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


def fused_recurrent_gated_delta_rule_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    *,
    state_slots: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Decode kernel; arguments, layouts and result as in
    :func:`infercore.ops.gated_delta.fused_recurrent_gated_delta_rule_` (already validated there).

    ``block_v`` / ``num_warps`` (powers of two) override :func:`decode_config` (benchmark sweeps).
    Token and head strides are free; a last dim with stride != 1 (inputs or pool) goes through a copy.
    """
    for name, x in (("block_v", block_v), ("num_warps", num_warps)):
        if x is not None and (not isinstance(x, int) or x < 1 or x & (x - 1)):
            raise ValueError(f"fused_recurrent_gated_delta_rule_: {name} must be a power of two, got {x!r}")
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g, beta))
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


_available = lambda cap: cap.is_cuda and cap.triton
register("chunk_gated_delta_rule_", "triton", chunk_gated_delta_rule_, priority=10, available=_available)
register(
    "fused_recurrent_gated_delta_rule_",
    "triton",
    fused_recurrent_gated_delta_rule_,
    priority=10,
    available=_available,
)
