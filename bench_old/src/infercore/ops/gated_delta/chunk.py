"""Triton chunked gated delta rule (prefill): the WY / UT-transform form on tensor cores.

The token recurrence of :mod:`.naive` is regrouped into chunks of ``C`` tokens (64 on the GPU).
With ``gc`` the within-chunk cumulative log decay, ``A[i, j] = beta_i k_i.k_j exp(gc_i - gc_j)``
(strictly lower) and ``T = (I + A)^-1``, the chunk's delta-rule writes collapse to

    T = (I + A)^-1                                                    (kernel 1 "kkt", per chunk)
    w = T (beta k exp(gc)),   u = T (beta v)                          (kernel 2 "wu", per chunk)
    v_new = u - w S,   S <- exp(gc_last) S + (k exp(gc_last - gc))^T v_new   (kernel 3 "state", scan)
    o = scale (exp(gc) q S + (q k^T * decay, causal) v_new)           (kernel 4 "output", per chunk)

Kernels 1, 2 and 4 run one program per (chunk, head [, value block]) over all chunks of the ragged
batch; only kernel 3 walks the chunks of a sequence in order (one program per sequence, value head
and value block), so its latency is the critical path.

Kernel 1 works on 16-row blocks: ``A``'s ``C/16`` diagonal blocks are inverted by forward
substitution (16x16 tiles, all independent), and the off-diagonal blocks of ``T`` follow from
``T_ij = -T_ii sum_{j <= m < i} A_im T_mj`` (16x16 dots). ``T`` goes to memory in the input dtype;
kernel 2 then multiplies it into ``k`` and ``v`` tiled over the head dims, so no program holds a
whole chunk of ``k`` and ``v`` plus ``T`` at once. With ``use_qk_l2norm`` the key norms enter as
per-row scales (``rn = 1/|k|``, stored by kernel 1), so later kernels need no row reductions on k.

Matmul operands are in the input dtype (bf16 on the GPU: tensor cores, fp32 accumulation); the
fp32 16x16 dots of the inverse use tf32 for bf16 inputs and exact fp32 ("ieee") for fp32 inputs.
``h`` (chunk entry states), ``v_new``, ``w``, ``u`` and ``T`` are kept in the input dtype between
kernels; the running state is fp32. Tile offsets are 32-bit (only per-program bases are 64-bit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from infercore.devices import triton_interpreter

_SUB = tl.constexpr(16)  # row block of the triangular solve (smallest tl.dot tile)

# Launch parameters per kernel. ``state`` BV None = pick from the program count (see _state_bv).
# Keys other than num_warps / num_stages are kernel constexprs.
DEFAULT_PREFILL_CONFIG: dict[str, dict] = {
    "kkt": {"num_warps": 4, "num_stages": 1},
    "wu": {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 2},
    "state": {"BV": None, "num_warps": 4, "num_stages": 2},
    "output": {"BV": 64, "num_warps": 4, "num_stages": 2},
}


@triton.jit
def _inv_unit_lower16(A):
    """``(I + A)^-1`` of a strictly lower 16x16 fp32 tile, by forward substitution on the rows of
    ``M = (I + A)^-1 - I``: ``M[i] = a + sum_j a_j M[j]`` with ``a = -A[i]``."""
    r = tl.arange(0, _SUB)
    M = -A
    for i in tl.static_range(2, _SUB):
        sel = r[:, None] == i
        a = -tl.sum(tl.where(sel, A, 0.0), axis=0)
        a += tl.sum(a[:, None] * M, axis=0)
        M = tl.where(sel, a[None, :], M)
    return M + (r[:, None] == r[None, :]).to(tl.float32)


@triton.jit
def _rows16(k_base, g_base, b_base, blk, n, sk_t, sg_t, sb_t, K, BLOCK_K: tl.constexpr):
    """Rows ``16 blk ..`` of a chunk: k ``[16, BLOCK_K]`` (input dtype), g and beta (fp32)."""
    r = blk * _SUB + tl.arange(0, _SUB)
    m = r < n
    ks = tl.arange(0, BLOCK_K)
    k = tl.load(k_base + r[:, None] * sk_t + ks[None, :], mask=m[:, None] & (ks < K)[None, :], other=0.0)
    g = tl.load(g_base + r * sg_t, mask=m, other=0.0).to(tl.float32)
    beta = tl.load(b_base + r * sb_t, mask=m, other=0.0).to(tl.float32)
    return k, g, beta


@triton.jit
def _rnorm(k, L2NORM: tl.constexpr):
    kf = k.to(tl.float32)
    if L2NORM:
        r = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) + 1e-6)
    else:
        r = tl.sum(kf * 0.0, axis=1) + 1.0  # a row vector in the reduction's layout
    return r


@triton.jit
def _l2norm_rows(x):
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _a_block(ki, kj, ci, rnj, gci, gcj, DIAG: tl.constexpr, PREC: tl.constexpr):
    """Block (i, j) of A: ``ci k_i.k_j rn_j exp(gc_i - gc_j)``, strictly lower on the diagonal."""
    a = tl.dot(ki, tl.trans(kj), input_precision=PREC)
    if DIAG:
        r = tl.arange(0, _SUB)
        lower = r[:, None] > r[None, :]
        # Masking the exponent (not the product) keeps exp() of the upper triangle from overflowing.
        e = tl.exp(tl.where(lower, gci[:, None] - gcj[None, :], 0.0))
        a = tl.where(lower, a * ci[:, None] * rnj[None, :] * e, 0.0)
    else:
        a = a * ci[:, None] * rnj[None, :] * tl.exp(gci[:, None] - gcj[None, :])
    return a


@triton.jit
def _store16(base, X, bi, bj, n, s_t):
    r = bi * _SUB + tl.arange(0, _SUB)
    c = bj * _SUB + tl.arange(0, _SUB)
    tl.store(base + r[:, None] * s_t + c[None, :], X.to(base.dtype.element_ty), mask=(r < n)[:, None])


@triton.jit
def _chunk_program(info_ptr, cu_ptr, HK, HV, C: tl.constexpr):
    """The (global chunk, value head) of a program on a ``(chunks, HV, ...)`` grid: ``(cid, seq, t0,
    n, hv, hk)`` -- the chunk's sequence (-1: a padding chunk, the program has nothing to do), its
    first token (int64) and length (int32, at most ``C``; see :func:`chunk_layout`), the value head
    and its key head. A padding chunk's row holds in-range values, so the loads are safe."""
    cid = tl.program_id(0)
    hv = tl.program_id(1)
    seq = tl.load(info_ptr + 2 * cid)
    t0 = tl.load(info_ptr + 2 * cid + 1).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    return cid, seq, t0, tl.minimum(end - t0, C).to(tl.int32), hv, hv // (HV // HK)


@triton.jit
def _kkt_kernel(
    k_ptr, g_ptr, beta_ptr, info_ptr, cu_ptr, gc_ptr, rn_ptr, ai_ptr,
    HK, HV, K,
    sk_t, sk_h, sg_t, sb_t, sgc_t, sai_t, sai_h,
    L2NORM: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): gc = cumsum(g), rn = 1/|k| (or 1), T = (I + A)^-1 (lower C x C)."""
    cid, seq, t0, n, hv, hk = _chunk_program(info_ptr, cu_ptr, HK, HV, C)
    if seq < 0:
        return
    k_base = k_ptr + t0 * sk_t + hk * sk_h
    g_base = g_ptr + t0 * sg_t + hv
    b_base = beta_ptr + t0 * sb_t + hv
    gc_base = gc_ptr + t0 * sgc_t + hv
    rn_base = rn_ptr + t0 * sgc_t + hv
    ai_base = ai_ptr + t0 * sai_t + hv * sai_h
    r16 = tl.arange(0, _SUB)

    k0, g0, b0 = _rows16(k_base, g_base, b_base, 0, n, sk_t, sg_t, sb_t, K, BLOCK_K)
    gc0 = tl.cumsum(g0, axis=0)
    rn0 = _rnorm(k0, L2NORM)
    tl.store(gc_base + r16 * sgc_t, gc0, mask=r16 < n)
    tl.store(rn_base + r16 * sgc_t, rn0, mask=r16 < n)
    X00 = _inv_unit_lower16(_a_block(k0, k0, b0 * rn0, rn0, gc0, gc0, True, PREC))
    _store16(ai_base, X00, 0, 0, n, sai_t)
    if C >= 32:
        k1, g1, b1 = _rows16(k_base, g_base, b_base, 1, n, sk_t, sg_t, sb_t, K, BLOCK_K)
        gc1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
        rn1 = _rnorm(k1, L2NORM)
        tl.store(gc_base + (16 + r16) * sgc_t, gc1, mask=16 + r16 < n)
        tl.store(rn_base + (16 + r16) * sgc_t, rn1, mask=16 + r16 < n)
        c1 = b1 * rn1
        A10 = _a_block(k1, k0, c1, rn0, gc1, gc0, False, PREC)
        X11 = _inv_unit_lower16(_a_block(k1, k1, c1, rn1, gc1, gc1, True, PREC))
        X10 = -tl.dot(X11, tl.dot(A10, X00, input_precision=PREC), input_precision=PREC)
        _store16(ai_base, X10, 1, 0, n, sai_t)
        _store16(ai_base, X11, 1, 1, n, sai_t)
    if C >= 64:
        k2, g2, b2 = _rows16(k_base, g_base, b_base, 2, n, sk_t, sg_t, sb_t, K, BLOCK_K)
        k3, g3, b3 = _rows16(k_base, g_base, b_base, 3, n, sk_t, sg_t, sb_t, K, BLOCK_K)
        gc2 = tl.cumsum(g2, axis=0) + (tl.sum(g0, axis=0) + tl.sum(g1, axis=0))
        gc3 = tl.cumsum(g3, axis=0) + (tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0))
        rn2 = _rnorm(k2, L2NORM)
        rn3 = _rnorm(k3, L2NORM)
        tl.store(gc_base + (32 + r16) * sgc_t, gc2, mask=32 + r16 < n)
        tl.store(gc_base + (48 + r16) * sgc_t, gc3, mask=48 + r16 < n)
        tl.store(rn_base + (32 + r16) * sgc_t, rn2, mask=32 + r16 < n)
        tl.store(rn_base + (48 + r16) * sgc_t, rn3, mask=48 + r16 < n)
        c2 = b2 * rn2
        c3 = b3 * rn3
        A20 = _a_block(k2, k0, c2, rn0, gc2, gc0, False, PREC)
        A21 = _a_block(k2, k1, c2, rn1, gc2, gc1, False, PREC)
        A30 = _a_block(k3, k0, c3, rn0, gc3, gc0, False, PREC)
        A31 = _a_block(k3, k1, c3, rn1, gc3, gc1, False, PREC)
        A32 = _a_block(k3, k2, c3, rn2, gc3, gc2, False, PREC)
        X22 = _inv_unit_lower16(_a_block(k2, k2, c2, rn2, gc2, gc2, True, PREC))
        X33 = _inv_unit_lower16(_a_block(k3, k3, c3, rn3, gc3, gc3, True, PREC))
        X21 = -tl.dot(X22, tl.dot(A21, X11, input_precision=PREC), input_precision=PREC)
        X20 = -tl.dot(
            X22, tl.dot(A20, X00, input_precision=PREC) + tl.dot(A21, X10, input_precision=PREC), input_precision=PREC
        )
        X32 = -tl.dot(X33, tl.dot(A32, X22, input_precision=PREC), input_precision=PREC)
        X31 = -tl.dot(
            X33, tl.dot(A31, X11, input_precision=PREC) + tl.dot(A32, X21, input_precision=PREC), input_precision=PREC
        )
        S30 = tl.dot(A30, X00, input_precision=PREC) + tl.dot(A31, X10, input_precision=PREC)
        X30 = -tl.dot(X33, S30 + tl.dot(A32, X20, input_precision=PREC), input_precision=PREC)
        _store16(ai_base, X20, 2, 0, n, sai_t)
        _store16(ai_base, X21, 2, 1, n, sai_t)
        _store16(ai_base, X22, 2, 2, n, sai_t)
        _store16(ai_base, X30, 3, 0, n, sai_t)
        _store16(ai_base, X31, 3, 1, n, sai_t)
        _store16(ai_base, X32, 3, 2, n, sai_t)
        _store16(ai_base, X33, 3, 3, n, sai_t)


@triton.jit
def _wu_kernel(
    k_ptr, v_ptr, beta_ptr, info_ptr, cu_ptr, gc_ptr, rn_ptr, ai_ptr, w_ptr, u_ptr,
    HK, HV, K, V,
    sk_t, sk_h, sv_t, sv_h, sb_t, sgc_t, sai_t, sai_h, sw_t, sw_h, su_t, su_h,
    C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): w = T (beta rn exp(gc) k), u = T (beta v), tiled over K and V."""
    cid, seq, t0, n, hv, hk = _chunk_program(info_ptr, cu_ptr, HK, HV, C)
    if seq < 0:
        return
    rs = tl.arange(0, C)
    rm = rs < n
    Tm = tl.load(ai_ptr + t0 * sai_t + hv * sai_h + rs[:, None] * sai_t + rs[None, :], mask=rm[:, None], other=0.0)
    # Only the lower triangle is ever written; the rest of the buffer is uninitialised.
    Tm = tl.where(rs[:, None] >= rs[None, :], Tm, 0.0).to(ai_ptr.dtype.element_ty)
    beta = tl.load(beta_ptr + t0 * sb_t + hv + rs * sb_t, mask=rm, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + t0 * sgc_t + hv + rs * sgc_t, mask=rm, other=0.0)
    rn = tl.load(rn_ptr + t0 * sgc_t + hv + rs * sgc_t, mask=rm, other=0.0)
    sw = beta * rn * tl.exp(gc)
    k_base = k_ptr + t0 * sk_t + hk * sk_h
    w_base = w_ptr + t0 * sw_t + hv * sw_h
    for kb in tl.static_range(0, BLOCK_K, BK):
        ks = kb + tl.arange(0, BK)
        m = rm[:, None] & (ks < K)[None, :]
        kt = tl.load(k_base + rs[:, None] * sk_t + ks[None, :], mask=m, other=0.0)
        kd = (kt.to(tl.float32) * sw[:, None]).to(kt.dtype)
        w = tl.dot(Tm.to(kt.dtype), kd, input_precision=PREC)
        tl.store(w_base + rs[:, None] * sw_t + ks[None, :], w.to(w_ptr.dtype.element_ty), mask=m)
    v_base = v_ptr + t0 * sv_t + hv * sv_h
    u_base = u_ptr + t0 * su_t + hv * su_h
    for vb in tl.static_range(0, BLOCK_V, BV):
        vs = vb + tl.arange(0, BV)
        m = rm[:, None] & (vs < V)[None, :]
        vt = tl.load(v_base + rs[:, None] * sv_t + vs[None, :], mask=m, other=0.0)
        vd = (vt.to(tl.float32) * beta[:, None]).to(vt.dtype)
        u = tl.dot(Tm.to(vt.dtype), vd, input_precision=PREC)
        tl.store(u_base + rs[:, None] * su_t + vs[None, :], u.to(u_ptr.dtype.element_ty), mask=m)


@triton.jit
def _state_kernel(
    k_ptr, w_ptr, u_ptr, gc_ptr, rn_ptr, h_ptr, vn_ptr, state_ptr, final_ptr, cu_ptr, coff_ptr, slot_ptr,
    init_ptr,
    HK, HV, K, V,
    sk_t, sk_h, sw_t, sw_h, su_t, su_h, sgc_t, sh_c, sh_h, sh_k, svn_t, svn_h,
    ss_slot, ss_h, ss_k, sf_b, sf_h, sf_k,
    C: tl.constexpr, BLOCK_K: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
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
    # A negative slot marks a padding sequence: zero initial state, the pool is not read.
    # (The slot test is broadcast to a vector: the interpreter rejects a scalar & block mask.)
    in_pool = smask & (vs * 0 + slot >= 0)[None, :]
    h = tl.load(state_ptr + slot * ss_slot + hv * ss_h + ks[:, None] * ss_k + vs[None, :], mask=in_pool, other=0.0)
    h = tl.where(init, h.to(tl.float32), 0.0)  # a fresh sequence ignores whatever its slot held
    nc = tl.cdiv(end - start, C)
    for c in range(0, nc):
        t0 = start + c * C
        n = tl.minimum(end - t0, C).to(tl.int32)
        rmask = rs < n
        tl.store(h_ptr + (c0 + c) * sh_c + hv * sh_h + ks[:, None] * sh_k + vs[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=smask)  # fmt: skip
        w = tl.load(w_ptr + t0 * sw_t + hv * sw_h + rs[:, None] * sw_t + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        u = tl.load(u_ptr + t0 * su_t + hv * su_h + rs[:, None] * su_t + vs[None, :],
                    mask=rmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        k = tl.load(k_ptr + t0 * sk_t + hk * sk_h + rs[:, None] * sk_t + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        gc = tl.load(gc_ptr + t0 * sgc_t + hv + rs * sgc_t, mask=rmask, other=0.0)
        rn = tl.load(rn_ptr + t0 * sgc_t + hv + rs * sgc_t, mask=rmask, other=0.0)
        g_last = tl.load(gc_ptr + (t0 + n - 1) * sgc_t + hv)
        v_new = u - tl.dot(w, h.to(w.dtype), input_precision=PREC)
        tl.store(vn_ptr + t0 * svn_t + hv * svn_h + rs[:, None] * svn_t + vs[None, :],
                 v_new.to(vn_ptr.dtype.element_ty), mask=rmask[:, None] & vmask[None, :])  # fmt: skip
        kd = (k.to(tl.float32) * tl.where(rmask, rn * tl.exp(g_last - gc), 0.0)[:, None]).to(w.dtype)
        h = h * tl.exp(g_last) + tl.dot(tl.trans(kd), v_new.to(w.dtype), input_precision=PREC)
    tl.store(final_ptr + b * sf_b + hv * sf_h + ks[:, None] * sf_k + vs[None, :], h, mask=smask)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, gc_ptr, rn_ptr, h_ptr, vn_ptr, o_ptr, info_ptr, cu_ptr,
    scale, HK, HV, K, V,
    sq_t, sq_h, sk_t, sk_h, sgc_t, sh_c, sh_h, sh_k, svn_t, svn_h, so_t, so_h,
    L2NORM: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head, value block): o = scale * (exp(gc) q h + (q k^T * decay) v_new)."""
    cid, seq, t0, n, hv, hk = _chunk_program(info_ptr, cu_ptr, HK, HV, C)
    vb = tl.program_id(2)
    if seq < 0:
        return
    rs = tl.arange(0, C)
    rmask = rs < n
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BV + tl.arange(0, BV)
    kmask = ks < K
    vmask = vs < V
    qk_mask = rmask[:, None] & kmask[None, :]
    q = tl.load(q_ptr + t0 * sq_t + hk * sq_h + rs[:, None] * sq_t + ks[None, :], mask=qk_mask, other=0.0)
    k = tl.load(k_ptr + t0 * sk_t + hk * sk_h + rs[:, None] * sk_t + ks[None, :], mask=qk_mask, other=0.0)
    gc = tl.load(gc_ptr + t0 * sgc_t + hv + rs * sgc_t, mask=rmask, other=0.0)
    if L2NORM:
        q = _l2norm_rows(q.to(tl.float32)).to(q_ptr.dtype.element_ty)
        rn = tl.load(rn_ptr + t0 * sgc_t + hv + rs * sgc_t, mask=rmask, other=0.0)
        k = (k.to(tl.float32) * rn[:, None]).to(k_ptr.dtype.element_ty)
    h = tl.load(h_ptr + cid * sh_c + hv * sh_h + ks[:, None] * sh_k + vs[None, :],
                mask=kmask[:, None] & vmask[None, :], other=0.0)  # fmt: skip
    o = tl.dot(q, h.to(q.dtype), input_precision=PREC) * tl.exp(gc)[:, None]
    causal = rs[:, None] >= rs[None, :]
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    s = tl.where(causal, s * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    vn = tl.load(vn_ptr + t0 * svn_t + hv * svn_h + rs[:, None] * svn_t + vs[None, :],
                 mask=rmask[:, None] & vmask[None, :], other=0.0)  # fmt: skip
    o += tl.dot(s.to(vn.dtype), vn, input_precision=PREC)
    tl.store(o_ptr + t0 * so_t + hv * so_h + rs[:, None] * so_t + vs[None, :], (o * scale).to(o_ptr.dtype.element_ty),
             mask=rmask[:, None] & vmask[None, :])  # fmt: skip


@triton.jit
def _scatter_final_kernel(
    final_ptr, pool_ptr, slot_ptr, K, V, sf_b, sf_h, sf_k, ss_slot, ss_h, ss_k, ss_v,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, block of key rows): ``pool[slot] = final[b]``; a negative slot
    (a padding sequence) writes nothing."""
    b = tl.program_id(0)
    hv = tl.program_id(1)
    kb = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:
        return
    ks = kb * BK + tl.arange(0, BK)
    vs = tl.arange(0, BV)
    m = (ks < K)[:, None] & (vs < V)[None, :]
    x = tl.load(final_ptr + b.to(tl.int64) * sf_b + hv * sf_h + ks[:, None] * sf_k + vs[None, :], mask=m)
    tl.store(pool_ptr + slot * ss_slot + hv * ss_h + ks[:, None] * ss_k + vs[None, :] * ss_v,
             x.to(pool_ptr.dtype.element_ty), mask=m)  # fmt: skip


def scatter_final_states(final: torch.Tensor, state_pool: torch.Tensor, state_slots: torch.Tensor) -> None:
    """``state_pool[state_slots[b]] = final[b]`` (``final`` contiguous fp32 ``[B, HV, K, V]``) except
    for negative (padding) slots, on the device: ``index_copy_`` faults on a negative index, and
    dropping those rows first would read the slots on the host (a sync)."""
    B, HV, K, V = final.shape
    if B == 0:
        return
    BV = triton.next_power_of_2(V)
    BK = min(triton.next_power_of_2(K), max(1, 4096 // BV))  # about 4k elements a program
    _scatter_final_kernel[(B, HV, triton.cdiv(K, BK))](
        final, state_pool, state_slots, K, V, final.stride(0), final.stride(1), final.stride(2),
        *state_pool.stride(), BK=BK, BV=BV,
    )  # fmt: skip


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


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _state_bv(B: int, HV: int, V: int, device: torch.device) -> int:
    """Widest value block that still gives about one program per SM: the scan is latency bound, so a
    single long sequence wants narrow blocks (more programs), a batch wants wide ones (fewer loads)."""
    block_v = max(16, triton.next_power_of_2(V))
    if device.type != "cuda" or triton_interpreter():
        return min(block_v, 32)
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    for bv in (64, 32):
        if bv <= block_v and B * HV * triton.cdiv(V, bv) >= sms:
            return bv
    return 16


def _launch_opts(cfg: dict) -> tuple[dict, dict]:
    """Split a kernel's config into (constexprs, launch options); the interpreter takes no options."""
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    opts = {} if triton_interpreter() else {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    return meta, opts


def prefill_stages(
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
    scale: float,
    use_qk_l2norm: bool,
    chunk_size: int = 64,
    config: dict[str, dict] | None = None,
) -> tuple[list[tuple[str, Callable[[], None]]], torch.Tensor, torch.Tensor]:
    """The prefill as four kernel launches over preallocated buffers (for benchmarks: each stage may
    be rerun alone once the earlier ones have run). Same arguments as :func:`chunk_gated_delta_rule_`;
    ``config`` overrides :data:`DEFAULT_PREFILL_CONFIG` per kernel (``{"wu": {"BK": 128}, ...}``).

    Returns ``(stages [(name, launch)], o [T, HV, V] in v.dtype, final [B, HV, K, V] fp32)``; the
    caller scatters ``final`` into the pool (:func:`scatter_final_states`: padding rows write none).
    """
    # q..has_initial_state are validated by the public wrapper; only this module's own knobs here.
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_gated_delta_rule_: chunk_size must be 16, 32 or 64, got {chunk_size}")
    cfg = {name: dict(c) for name, c in DEFAULT_PREFILL_CONFIG.items()}
    for name, c in (config or {}).items():
        # "PREC" of kkt overrides the precision of the inverse's fp32 dots (a benchmark sweep entry).
        allowed = set(DEFAULT_PREFILL_CONFIG.get(name, ())) | ({"PREC"} if name == "kkt" else set())
        if not allowed or not isinstance(c, dict) or not set(c) <= allowed:
            raise ValueError(
                f"chunk_gated_delta_rule_: config[{name!r}] must be a dict with keys in {sorted(allowed)} "
                f"(kernels {sorted(DEFAULT_PREFILL_CONFIG)}), got {c!r}"
            )
        cfg[name].update(c)
    C = chunk_size
    T, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    # Token and head strides are free (q, k, v are often views of one projection); the last dim is not.
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g, beta))
    dev = q.device
    o = torch.empty(v.shape, dtype=v.dtype, device=dev)
    final = torch.empty(B, HV, K, V, dtype=torch.float32, device=dev)
    if B == 0:
        return [], o, final
    # fp32 inputs get exact fp32 dots (the tests' tolerance); bf16/fp16 operands ignore the setting.
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    inv_prec = cfg["kkt"].pop("PREC", None) or prec
    BLOCK_K = max(16, triton.next_power_of_2(K))
    BLOCK_V = max(16, triton.next_power_of_2(V))
    coff, info = chunk_layout(cu_seqlens, T, C)
    N = info.shape[0]
    gc = torch.empty(T, HV, dtype=torch.float32, device=dev)
    rn = torch.empty(T, HV, dtype=torch.float32, device=dev)
    ai = torch.empty(T, HV, C, dtype=q.dtype, device=dev)
    w = torch.empty(T, HV, K, dtype=q.dtype, device=dev)
    u = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    h = torch.empty(N, HV, K, V, dtype=q.dtype, device=dev)
    v_new = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    pool = state_pool if state_pool.stride(-1) == 1 else state_pool.contiguous()
    init = has_initial_state.to(torch.int8)

    m_kkt, o_kkt = _launch_opts(cfg["kkt"])
    m_wu, o_wu = _launch_opts(cfg["wu"])
    m_wu["BK"] = min(m_wu["BK"], BLOCK_K)
    m_wu["BV"] = min(m_wu["BV"], BLOCK_V)
    m_st, o_st = _launch_opts(cfg["state"])
    m_st["BV"] = min(m_st["BV"] or _state_bv(B, HV, V, dev), BLOCK_V)
    m_out, o_out = _launch_opts(cfg["output"])
    m_out["BV"] = min(m_out["BV"], BLOCK_V)

    def kkt():
        _kkt_kernel[(N, HV)](
            k, g, beta, info, cu_seqlens, gc, rn, ai, HK, HV, K,
            k.stride(0), k.stride(1), g.stride(0), beta.stride(0), gc.stride(0), ai.stride(0), ai.stride(1),
            L2NORM=use_qk_l2norm, C=C, BLOCK_K=BLOCK_K, PREC=inv_prec, **m_kkt, **o_kkt,
        )  # fmt: skip

    def wu():
        _wu_kernel[(N, HV)](
            k, v, beta, info, cu_seqlens, gc, rn, ai, w, u, HK, HV, K, V,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0), gc.stride(0),
            ai.stride(0), ai.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
            C=C, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, PREC=prec, **m_wu, **o_wu,
        )  # fmt: skip

    def state():
        _state_kernel[(B, HV, triton.cdiv(V, m_st["BV"]))](
            k, w, u, gc, rn, h, v_new, pool, final, cu_seqlens, coff, state_slots, init, HK, HV, K, V,
            k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1), gc.stride(0),
            h.stride(0), h.stride(1), h.stride(2), v_new.stride(0), v_new.stride(1),
            pool.stride(0), pool.stride(1), pool.stride(2), final.stride(0), final.stride(1), final.stride(2),
            C=C, BLOCK_K=BLOCK_K, PREC=prec, **m_st, **o_st,
        )  # fmt: skip

    def output():
        _output_kernel[(N, HV, triton.cdiv(V, m_out["BV"]))](
            q, k, gc, rn, h, v_new, o, info, cu_seqlens, float(scale), HK, HV, K, V,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), gc.stride(0), h.stride(0), h.stride(1), h.stride(2),
            v_new.stride(0), v_new.stride(1), o.stride(0), o.stride(1),
            L2NORM=use_qk_l2norm, C=C, BLOCK_K=BLOCK_K, PREC=prec, **m_out, **o_out,
        )  # fmt: skip

    return [("kkt", kkt), ("wu", wu), ("state", state), ("output", output)], o, final


def chunk_gated_delta_rule_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, *, cu_seqlens: torch.Tensor, state_slots: torch.Tensor,
    has_initial_state: torch.Tensor, scale: float, use_qk_l2norm: bool,
    chunk_size: int = 64, config: dict[str, dict] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Chunked prefill; arguments, layouts and result as in
    :func:`infercore.ops.gated_delta.chunk_gated_delta_rule_` (already validated there), plus
    ``chunk_size`` in {16, 32, 64} and ``config`` (launch overrides, see :func:`prefill_stages`).
    ``o [T, Hv, V]`` in ``v.dtype``; final states are written into ``state_pool`` in place."""
    stages, o, final = prefill_stages(
        q, k, v, g, beta, state_pool, cu_seqlens=cu_seqlens, state_slots=state_slots,
        has_initial_state=has_initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
        config=config,
    )  # fmt: skip
    if not stages:
        return o
    for _, launch in stages:
        launch()
    # The final state goes to a separate buffer (scattered into the pool here) so no kernel has a
    # side effect on its inputs and any stage may be rerun.
    scatter_final_states(final, state_pool, state_slots)
    return o
