"""Triton chunked gated delta rule (prefill): the WY / UT-transform form on tensor cores.

The token recurrence of :mod:`.naive` is regrouped into chunks of ``C`` tokens (64 on the GPU).
With ``gc`` the within-chunk cumulative log decay, ``A[i, j] = beta_i k_i.k_j exp(gc_i - gc_j)``
(strictly lower) and ``T = (I + A)^-1``, the chunk's delta-rule writes collapse to

    w = T (beta k exp(gc)),   u = T (beta v)                          (kernel 1, per chunk)
    v_new = u - w S,   S <- exp(gc_last) S + (k exp(gc_last - gc))^T v_new   (kernel 2, chunk scan)
    o = scale (exp(gc) q S + (q k^T * decay, causal) v_new)           (kernel 3, per chunk)

Kernels 1 and 3 run one program per (chunk, head [, value block]) over all chunks of the ragged
batch; only kernel 2 walks the chunks of a sequence in order (one program per sequence, value head
and value block), so its latency is the critical path. ``T`` is built by forward substitution on
the 16x16 diagonal blocks (all blocks at once: 15 row steps), then the off-diagonal blocks come from
the block Neumann series ``(I + N)^-1 D`` with ``N = D L_off`` nilpotent (``N^(C/16) = 0``).

Matmul operands are in the input dtype (bf16 on the GPU), accumulation in fp32; the chunk states
``h`` and ``v_new`` are kept in the input dtype between kernels, the running state in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import triton_interpreter

_SUB = tl.constexpr(16)  # diagonal block size of the triangular solve (smallest tl.dot tile)


def _configs(options: list[dict], warps_stages: list[tuple[int, int]]) -> list[triton.Config]:
    cfgs = [triton.Config(o, num_warps=w, num_stages=s) for o in options for (w, s) in warps_stages]
    # The interpreter runs a single config (autotuning several fails there).
    return cfgs[:1] if triton_interpreter() else cfgs


@triton.jit
def _l2norm_rows(x):
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.autotune(configs=_configs([{}], [(4, 1), (8, 1), (4, 2)]), key=["K", "V", "BLOCK_K", "BLOCK_V", "C"])
@triton.jit
def _wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, info_ptr, cu_ptr, gc_ptr, w_ptr, u_ptr,
    HK, HV, K, V,
    sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, sgc_t, sw_t, sw_h, su_t, su_h,
    L2NORM: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): gc = cumsum(g); w, u of the WY form (see module docstring)."""
    cid = tl.program_id(0)
    hv = tl.program_id(1)
    seq = tl.load(info_ptr + 2 * cid)
    if seq < 0:
        return
    t0 = tl.load(info_ptr + 2 * cid + 1).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    hk = hv // (HV // HK)
    rs = tl.arange(0, C)
    rows = t0 + rs
    rmask = rows < end
    ks = tl.arange(0, BLOCK_K)
    vs = tl.arange(0, BLOCK_V)
    kmask = ks < K
    vmask = vs < V

    g = tl.load(g_ptr + rows * sg_t + hv, mask=rmask, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, axis=0)
    tl.store(gc_ptr + rows * sgc_t + hv, gc, mask=rmask)
    beta = tl.load(beta_ptr + rows * sb_t + hv, mask=rmask, other=0.0).to(tl.float32)

    k = tl.load(k_ptr + rows[:, None] * sk_t + hk * sk_h + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                other=0.0)  # fmt: skip
    if L2NORM:
        k = _l2norm_rows(k.to(tl.float32)).to(k_ptr.dtype.element_ty)
    kb = (k.to(tl.float32) * beta[:, None]).to(k.dtype)
    # Masking the exponent (not the product) keeps exp() of the upper triangle from overflowing.
    lower = rs[:, None] > rs[None, :]
    A = tl.dot(kb, tl.trans(k))
    A = tl.where(lower, A * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)

    # D = inverse of the block diagonal of (I + A), 16x16 blocks, all blocks in the same 15 steps:
    # row r of every block at once. Rows above r are final (D is unit lower), so
    # D[i, :] = e_i - sum_j A[i, j] D[j, :] over j in i's block; since D is block diagonal, summing
    # a_j * D[j, :] over all j keeps each block's columns separate.
    blk_r = rs[:, None] // _SUB
    blk_c = rs[None, :] // _SUB
    same_blk = blk_r == blk_c
    eye = (rs[:, None] == rs[None, :]).to(tl.float32)
    D = eye
    for r in tl.static_range(1, _SUB):
        # a[j] = A[16 * block(j) + r, j]: row r of each diagonal block, gathered into one vector
        sel = rs[:, None] == (blk_c * _SUB + r)
        a = tl.sum(tl.where(sel & same_blk, A, 0.0), axis=0)
        s = tl.sum(a[:, None] * D, axis=0)
        upd = ((rs[:, None] % _SUB) == r) & same_blk
        D = tl.where(upd, eye - s[None, :], D)
    if C > _SUB:
        # (I + A)^-1 = (I + N)^-1 D with N = D A_off strictly block lower: the series stops at N^(C/16 - 1).
        A_off = tl.where(same_blk, 0.0, A)
        N = tl.dot(D, A_off, input_precision=DOT_PREC)
        Tm = D - tl.dot(N, D, input_precision=DOT_PREC)
        if C > 2 * _SUB:
            N2 = tl.dot(N, N, input_precision=DOT_PREC)
            Tm += tl.dot(N2, D, input_precision=DOT_PREC)
            Tm -= tl.dot(tl.dot(N2, N, input_precision=DOT_PREC), D, input_precision=DOT_PREC)
    else:
        Tm = D
    Tm = Tm.to(k.dtype)

    kd = (k.to(tl.float32) * (beta * tl.exp(gc))[:, None]).to(k.dtype)
    w = tl.dot(Tm, kd)
    tl.store(w_ptr + rows[:, None] * sw_t + hv * sw_h + ks[None, :], w.to(w_ptr.dtype.element_ty),
             mask=rmask[:, None] & kmask[None, :])  # fmt: skip
    v = tl.load(v_ptr + rows[:, None] * sv_t + hv * sv_h + vs[None, :], mask=rmask[:, None] & vmask[None, :],
                other=0.0)  # fmt: skip
    vb = (v.to(tl.float32) * beta[:, None]).to(v.dtype)
    u = tl.dot(Tm.to(v.dtype), vb)
    tl.store(u_ptr + rows[:, None] * su_t + hv * su_h + vs[None, :], u.to(u_ptr.dtype.element_ty),
             mask=rmask[:, None] & vmask[None, :])  # fmt: skip


@triton.autotune(
    configs=_configs([{"BV": 32}, {"BV": 64}], [(4, 2), (4, 3), (8, 2)]),
    key=["K", "V", "BLOCK_K", "C"],
)
@triton.jit
def _state_kernel(
    k_ptr, w_ptr, u_ptr, gc_ptr, h_ptr, vn_ptr, state_ptr, final_ptr, cu_ptr, coff_ptr, slot_ptr, init_ptr,
    HK, HV, K, V,
    sk_t, sk_h, sw_t, sw_h, su_t, su_h, sgc_t, sh_c, sh_h, sh_k, svn_t, svn_h,
    ss_slot, ss_h, ss_k, sf_b, sf_h, sf_k,
    L2NORM: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, value block): walk the chunks, store each chunk's entry state
    ``h``, ``v_new = u - w h``, and write the final state to ``final`` (fp32)."""
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    c0 = tl.load(coff_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    init = tl.load(init_ptr + b) != 0
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BV + tl.arange(0, BV)
    rs = tl.arange(0, C)
    kmask = ks < K
    vmask = vs < V
    smask = kmask[:, None] & vmask[None, :]
    h = tl.load(state_ptr + slot * ss_slot + hv * ss_h + ks[:, None] * ss_k + vs[None, :], mask=smask, other=0.0)
    h = tl.where(init, h.to(tl.float32), 0.0)  # a fresh sequence ignores whatever its slot held
    n = tl.cdiv(end - start, C)
    for c in range(0, n):
        t0 = start + c * C
        rows = t0 + rs
        rmask = rows < end
        tl.store(h_ptr + (c0 + c) * sh_c + hv * sh_h + ks[:, None] * sh_k + vs[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=smask)  # fmt: skip
        w = tl.load(w_ptr + rows[:, None] * sw_t + hv * sw_h + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)  # fmt: skip
        u = tl.load(u_ptr + rows[:, None] * su_t + hv * su_h + vs[None, :], mask=rmask[:, None] & vmask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        v_new = u - tl.dot(w, h.to(w.dtype))
        tl.store(vn_ptr + rows[:, None] * svn_t + hv * svn_h + vs[None, :], v_new.to(vn_ptr.dtype.element_ty),
                 mask=rmask[:, None] & vmask[None, :])  # fmt: skip
        gc = tl.load(gc_ptr + rows * sgc_t + hv, mask=rmask, other=0.0)
        last = tl.minimum(end, t0 + C) - 1
        g_last = tl.load(gc_ptr + last * sgc_t + hv)
        k = tl.load(k_ptr + rows[:, None] * sk_t + hk * sk_h + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)  # fmt: skip
        if L2NORM:
            k = _l2norm_rows(k.to(tl.float32))
        kd = (k.to(tl.float32) * tl.where(rmask, tl.exp(g_last - gc), 0.0)[:, None]).to(w.dtype)
        h = h * tl.exp(g_last) + tl.dot(tl.trans(kd), v_new.to(w.dtype))
    tl.store(final_ptr + b * sf_b + hv * sf_h + ks[:, None] * sf_k + vs[None, :], h, mask=smask)


@triton.autotune(
    configs=_configs([{"BV": 64}, {"BV": 128}], [(4, 2), (8, 2)]),
    key=["K", "V", "BLOCK_K", "C"],
)
@triton.jit
def _output_kernel(
    q_ptr, k_ptr, gc_ptr, h_ptr, vn_ptr, o_ptr, info_ptr, cu_ptr,
    scale, HK, HV, K, V,
    sq_t, sq_h, sk_t, sk_h, sgc_t, sh_c, sh_h, sh_k, svn_t, svn_h, so_t, so_h,
    L2NORM: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head, value block): o = scale * (exp(gc) q h + (q k^T * decay) v_new)."""
    cid = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    seq = tl.load(info_ptr + 2 * cid)
    if seq < 0:
        return
    t0 = tl.load(info_ptr + 2 * cid + 1).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    hk = hv // (HV // HK)
    rs = tl.arange(0, C)
    rows = t0 + rs
    rmask = rows < end
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BV + tl.arange(0, BV)
    kmask = ks < K
    vmask = vs < V
    qk_mask = rmask[:, None] & kmask[None, :]
    q = tl.load(q_ptr + rows[:, None] * sq_t + hk * sq_h + ks[None, :], mask=qk_mask, other=0.0)
    k = tl.load(k_ptr + rows[:, None] * sk_t + hk * sk_h + ks[None, :], mask=qk_mask, other=0.0)
    if L2NORM:
        q = _l2norm_rows(q.to(tl.float32)).to(q_ptr.dtype.element_ty)
        k = _l2norm_rows(k.to(tl.float32)).to(k_ptr.dtype.element_ty)
    gc = tl.load(gc_ptr + rows * sgc_t + hv, mask=rmask, other=0.0)
    h = tl.load(h_ptr + cid * sh_c + hv * sh_h + ks[:, None] * sh_k + vs[None, :],
                mask=kmask[:, None] & vmask[None, :], other=0.0)  # fmt: skip
    o = tl.dot(q, h.to(q.dtype)) * tl.exp(gc)[:, None]
    causal = rs[:, None] >= rs[None, :]
    s = tl.dot(q, tl.trans(k))
    s = tl.where(causal, s * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    vn = tl.load(vn_ptr + rows[:, None] * svn_t + hv * svn_h + vs[None, :], mask=rmask[:, None] & vmask[None, :],
                 other=0.0)  # fmt: skip
    o += tl.dot(s.to(vn.dtype), vn)
    tl.store(o_ptr + rows[:, None] * so_t + hv * so_h + vs[None, :], (o * scale).to(o_ptr.dtype.element_ty),
             mask=rmask[:, None] & vmask[None, :])  # fmt: skip


def chunk_layout(cu_seqlens: torch.Tensor, num_tokens: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of a ragged batch, built on the device without a host sync.

    Returns ``(chunk_offsets int32 [B + 1], info int32 [N, 2])``: sequence ``b`` owns global chunks
    ``[off[b], off[b+1])``; row ``i`` of ``info`` is ``(sequence, first token)`` of chunk ``i``, or
    ``(-1, 0)`` past the last chunk. ``N = num_tokens // chunk_size + B`` bounds the chunk count.
    """
    B = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    n = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
    off = torch.zeros(B + 1, dtype=torch.long, device=cu.device)
    torch.cumsum(n, 0, out=off[1:])
    N = num_tokens // chunk_size + B
    idx = torch.arange(N, device=cu.device)
    seq = torch.searchsorted(off[1:], idx, right=True).clamp_(max=max(B - 1, 0))
    valid = idx < off[-1]
    first = cu[seq] + (idx - off[seq]) * chunk_size
    info = torch.stack([torch.where(valid, seq, -1), torch.where(valid, first, 0)], dim=1).to(torch.int32)
    return off.to(torch.int32), info


def chunk_gated_delta_rule_(
    q, k, v, g, beta, state_pool, *, cu_seqlens, state_slots, has_initial_state, scale, use_qk_l2norm,
    chunk_size: int = 64,
):  # fmt: skip
    """See :func:`infercore.ops.gated_delta.chunk_gated_delta_rule_`. ``chunk_size`` in {16, 32, 64}."""
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_gated_delta_rule_: chunk_size must be 16, 32 or 64, got {chunk_size}")
    C = chunk_size
    T, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    # Token and head strides are free (q, k, v are often views of one projection); the last dim is not.
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    dev = q.device
    BLOCK_K = max(16, triton.next_power_of_2(K))
    BLOCK_V = max(16, triton.next_power_of_2(V))
    coff, info = chunk_layout(cu_seqlens, T, C)
    N = info.shape[0]
    gc = torch.empty(T, HV, dtype=torch.float32, device=dev)
    w = torch.empty(T, HV, K, dtype=q.dtype, device=dev)
    u = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    # fp32 dots inside the solve: 3xTF32 keeps fp32 accuracy on tensor cores (ignored by the interpreter).
    _wy_kernel[(N, HV)](
        k, v, g, beta, info, cu_seqlens, gc, w, u, HK, HV, K, V,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), gc.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        L2NORM=use_qk_l2norm, C=C, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, DOT_PREC="tf32x3",
    )  # fmt: skip
    h = torch.empty(N, HV, K, V, dtype=q.dtype, device=dev)
    v_new = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    final = torch.empty(B, HV, K, V, dtype=torch.float32, device=dev)
    pool = state_pool if state_pool.stride(-1) == 1 else state_pool.contiguous()
    # The final state goes to a separate buffer (scattered into the pool below) so the kernel has
    # no side effect on its inputs and autotuning may rerun it.
    _state_kernel[lambda m: (B, HV, triton.cdiv(V, m["BV"]))](
        k, w, u, gc, h, v_new, pool, final, cu_seqlens, coff, state_slots, has_initial_state.to(torch.int8),
        HK, HV, K, V,
        k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1), gc.stride(0),
        h.stride(0), h.stride(1), h.stride(2), v_new.stride(0), v_new.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), final.stride(0), final.stride(1), final.stride(2),
        L2NORM=use_qk_l2norm, C=C, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    _output_kernel[lambda m: (N, HV, triton.cdiv(V, m["BV"]))](
        q, k, gc, h, v_new, o, info, cu_seqlens, float(scale), HK, HV, K, V,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), gc.stride(0), h.stride(0), h.stride(1), h.stride(2),
        v_new.stride(0), v_new.stride(1), o.stride(0), o.stride(1),
        L2NORM=use_qk_l2norm, C=C, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    state_pool.index_copy_(0, state_slots.long(), final.to(state_pool.dtype))
    return o
