"""MODE 6 with the warps splitting N, its weight words streamed through shared memory by TMA (Gluon).

Why: the register-fed MODE 6 (``triton_frag``) holds its in-flight weight words in registers (two
iterations, 4 KB a warp), so the register file caps the bytes in flight per SM and the kernel sits
~5.7 us above the time that only reading the bytes takes (results/h200/read_floor.json). Triton's own
pipeliner does not help (it couples the warps with CTA barriers: sweeps/sweep_frag_tma.json). Here
each program is ONE warp that owns a channel block and a K range (the WN layout), so it needs no CTA
barrier: it keeps ``STAGES - 1`` iterations of its words in flight in a shared-memory ring filled by
TMA (one mbarrier per slot), reads each slot back with one 16-byte shared load per thread and
repetition, and runs the same inline PTX as ``triton_frag`` (one MMA per word, INT4 words of a group
chained). Activations and scales are plain loads, one iteration ahead. Split-K partials go through
the fp32 workspace, summed by the channel block's last program (an arrival counter), as in MODE 6.

Same packed words and scales as ``triton_frag.pack_int4`` / ``pack_fp8`` (the WN order is the packed
order), one B fragment (M <= 8), no fused activation, per-channel FP8 scales or INT4 groups. GPU-only
(sm90: TMA and mbarriers).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from . import triton_frag as TF
from ._splitk import arrival_counters


@gluon.jit
def _x_frags(x8, xrow, xmask, grp, q0, REPS: gl.constexpr):
    """The B fragments (int64, ``[32, 1]``) of chunks ``q0 .. q0 + REPS - 1`` of group ``grp``."""
    xa0 = gl.expand_dims(gl.load(x8 + (xrow + grp * 32 + q0), mask=xmask, other=0), 1)
    xa1 = xa0
    xa2 = xa0
    xa3 = xa0
    if REPS > 1:
        xa1 = gl.expand_dims(gl.load(x8 + (xrow + grp * 32 + q0 + 1), mask=xmask, other=0), 1)
    if REPS > 2:
        xa2 = gl.expand_dims(gl.load(x8 + (xrow + grp * 32 + q0 + 2), mask=xmask, other=0), 1)
        xa3 = gl.expand_dims(gl.load(x8 + (xrow + grp * 32 + q0 + 3), mask=xmask, other=0), 1)
    return xa0, xa1, xa2, xa3


@gluon.jit
def _issue(wdesc, bars, ring, it, it1, row0, STAGES: gl.constexpr, ROWS: gl.constexpr):
    """Start the TMA of iteration ``it``'s words into ring slot ``it % STAGES`` (nothing past ``it1``)."""
    slot = it % STAGES
    pred = it < it1
    bar = bars.index(slot)
    mbarrier.expect(bar, wdesc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(wdesc, [row0 + it * ROWS, 0], bar, ring.index(slot), pred=pred)


@gluon.jit
def _gl_wn_kernel(x_ptr, s_ptr, ws_ptr, y_ptr, cnt_ptr, wdesc, M, N, G, iters_per_split, stride_xm, stride_ym,
                  FP8: gl.constexpr, REPS: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
                  FOLD: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr):
    """Grid ``(N / (16 CT), split)``, one warp a program: channel block ``pid 0``, K iterations (REPS chunks
    of one group each) ``[sp * iters_per_split, +iters_per_split)``."""
    CT: gl.constexpr = 2 if FP8 else 4
    ROWS: gl.constexpr = REPS * 32  # words rows (lane-major, CT wide) per iteration
    L: gl.constexpr = gl.BlockedLayout([1, CT], [32, 1], [1, 1], [1, 0])
    blk = gl.program_id(0)
    sp = gl.program_id(1)
    n_iters = G * 8 // REPS
    it0 = sp * iters_per_split
    it1 = gl.minimum(it0 + iters_per_split, n_iters)
    lane = gl.arange(0, 32, layout=gl.SliceLayout(1, L))
    offs_c = gl.arange(0, CT, layout=gl.SliceLayout(0, L))
    g = lane // 4
    t = lane % 4
    row0 = blk * (G * 8 * 32)

    ring = gl.allocate_shared_memory(wdesc.dtype, [STAGES, ROWS, CT], wdesc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _issue(wdesc, bars, ring, it0 + i, it1, row0, STAGES, ROWS)

    x8 = x_ptr.to(gl.pointer_type(gl.int64))
    xrow = g * (stride_xm // 4) + 8 * t
    xmask = g < M
    zero = gl.zeros([32, CT], gl.float32, layout=L)
    a0 = zero
    a1 = zero
    a2 = zero
    a3 = zero
    sz_rows = gl.expand_dims(blk * G * 8 + g, 1) * CT + gl.expand_dims(offs_c, 0)
    sz8 = s_ptr.to(gl.pointer_type(gl.int64))
    for k in range(0, it1 - it0):
        it = it0 + k
        # the slot read in the previous iteration is refilled: its shared loads are done (fence first)
        fence_async_shared()
        _issue(wdesc, bars, ring, it + STAGES - 1, it1, row0, STAGES, ROWS)
        c0 = it * REPS
        grp = c0 // 8
        xa0, xa1, xa2, xa3 = _x_frags(x8, xrow, xmask, grp, c0 % 8, REPS)
        sc = zero
        if not FP8:
            sc = gl.load(sz8 + sz_rows + grp * (8 * CT))
        slot = k % STAGES
        mbarrier.wait(bars.index(slot), (k // STAGES) & 1)
        buf = ring.index(slot)
        w0 = buf.slice(0, 32).load(L)
        if FP8:
            a0, a1, a2, a3 = gl.inline_asm_elementwise(ASM, CONS, [w0, xa0, a0, a1, a2, a3],
                                                       dtype=(gl.float32,) * 4, is_pure=True, pack=1)
            if REPS > 1:
                w1 = buf.slice(32, 32).load(L)
                a0, a1, a2, a3 = gl.inline_asm_elementwise(ASM, CONS, [w1, xa1, a0, a1, a2, a3],
                                                           dtype=(gl.float32,) * 4, is_pure=True, pack=1)
            if REPS > 2:
                w2 = buf.slice(64, 32).load(L)
                w3 = buf.slice(96, 32).load(L)
                a0, a1, a2, a3 = gl.inline_asm_elementwise(ASM, CONS, [w2, xa2, a0, a1, a2, a3],
                                                           dtype=(gl.float32,) * 4, is_pure=True, pack=1)
                a0, a1, a2, a3 = gl.inline_asm_elementwise(ASM, CONS, [w3, xa3, a0, a1, a2, a3],
                                                           dtype=(gl.float32,) * 4, is_pure=True, pack=1)
        else:
            if REPS == 4:
                w1 = buf.slice(32, 32).load(L)
                w2 = buf.slice(64, 32).load(L)
                w3 = buf.slice(96, 32).load(L)
                a0, a1, a2, a3 = gl.inline_asm_elementwise(
                    ASM, CONS, [w0, w1, w2, w3, sc, xa0, xa1, xa2, xa3, a0, a1, a2, a3, zero],
                    dtype=(gl.float32,) * 4, is_pure=True, pack=1)
            else:
                w1 = buf.slice(32, 32).load(L)
                a0, a1, a2, a3 = gl.inline_asm_elementwise(
                    ASM, CONS, [w0, w1, sc, xa0, xa1, a0, a1, a2, a3, zero], dtype=(gl.float32,) * 4,
                    is_pure=True, pack=1)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    # accumulator j: batch rows 2t + j % 2, channel 16 c + g + 8 (j // 2) of the block
    m0 = gl.expand_dims(2 * t, 1)
    n0 = blk * (16 * CT) + 16 * gl.expand_dims(offs_c, 0) + gl.expand_dims(g, 1)
    if SPLIT_K:
        wsp = ws_ptr + sp.to(gl.int64) * M * N
        gl.store(wsp + m0 * N + n0, a0, mask=(m0 < M) & (n0 < N))
        gl.store(wsp + (m0 + 1) * N + n0, a1, mask=(m0 + 1 < M) & (n0 < N))
        gl.store(wsp + m0 * N + n0 + 8, a2, mask=(m0 < M) & (n0 + 8 < N))
        gl.store(wsp + (m0 + 1) * N + n0 + 8, a3, mask=(m0 + 1 < M) & (n0 + 8 < N))
        gl.thread_barrier()
        nsplit = gl.num_programs(1)
        done = gl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
        if done == nsplit - 1:
            a0 = zero
            a1 = zero
            a2 = zero
            a3 = zero
            for s in range(0, nsplit):
                p = ws_ptr + s.to(gl.int64) * M * N
                a0 += gl.load(p + m0 * N + n0, mask=(m0 < M) & (n0 < N), other=0.0, cache_modifier=".cg")
                a1 += gl.load(p + (m0 + 1) * N + n0, mask=(m0 + 1 < M) & (n0 < N), other=0.0, cache_modifier=".cg")
                a2 += gl.load(p + m0 * N + n0 + 8, mask=(m0 < M) & (n0 + 8 < N), other=0.0, cache_modifier=".cg")
                a3 += gl.load(p + (m0 + 1) * N + n0 + 8, mask=(m0 + 1 < M) & (n0 + 8 < N), other=0.0,
                              cache_modifier=".cg")
            _store_y(y_ptr, s_ptr, a0, a1, a2, a3, m0, n0, M, N, stride_ym, FP8, FOLD)
            gl.atomic_xchg(cnt_ptr + blk, 0)  # ready for the next launch (graph replays too)
    else:
        _store_y(y_ptr, s_ptr, a0, a1, a2, a3, m0, n0, M, N, stride_ym, FP8, FOLD)


@gluon.jit
def _store_y(y_ptr, s_ptr, a0, a1, a2, a3, m0, n0, M, N, stride_ym, FP8: gl.constexpr, FOLD: gl.constexpr):
    """The four accumulators, scaled (FP8: per-channel scale and the decode's power of two), to ``y``."""
    if FP8:
        s_lo = gl.load(s_ptr + n0, mask=n0 < N, other=0.0)
        s_hi = gl.load(s_ptr + n0 + 8, mask=n0 + 8 < N, other=0.0)
        a0 = a0 * s_lo
        a1 = a1 * s_lo
        a2 = a2 * s_hi
        a3 = a3 * s_hi
    ty = y_ptr.dtype.element_ty
    gl.store(y_ptr + m0 * stride_ym + n0, (a0 * FOLD).to(ty), mask=(m0 < M) & (n0 < N))
    gl.store(y_ptr + (m0 + 1) * stride_ym + n0, (a1 * FOLD).to(ty), mask=(m0 + 1 < M) & (n0 < N))
    gl.store(y_ptr + m0 * stride_ym + n0 + 8, (a2 * FOLD).to(ty), mask=(m0 < M) & (n0 + 8 < N))
    gl.store(y_ptr + (m0 + 1) * stride_ym + n0 + 8, (a3 * FOLD).to(ty), mask=(m0 + 1 < M) & (n0 + 8 < N))


def _desc(frags: torch.Tensor, reps: int):
    """A TMA descriptor of the packed words as ``[rows, CT]`` with blocks of one iteration (``32 REPS`` rows)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    ct = frags.shape[-1]
    words = frags.view(-1, ct)
    gdt = gl.int32 if frags.dtype == torch.int32 else gl.int64
    layout = gl.NVMMASharedLayout.get_default_for([32 * reps, ct], gdt)
    return TensorDescriptor(words, list(words.shape), [ct, 1], [32 * reps, ct], layout)


_DESCS: dict = {}


def launch(x: torch.Tensor, kind: str, frags: torch.Tensor, n: int, cfg: dict, *, s: torch.Tensor,
           fold: float = 1.0) -> torch.Tensor:
    """``x [M, K]`` (bf16/fp16, M <= 8, CUDA sm90) times the packed weights of ``triton_frag.pack_int4`` /
    ``pack_fp8`` (per-channel FP8 scales) -> ``[M, N]``. ``cfg``: REPS (2 or 4), STAGES (>= 2), SPLIT."""
    m, kdim = x.shape
    if m > 8 or not TF.supported(x):
        raise ValueError(f"x: the TMA-fed kernel takes CUDA bf16/fp16 rows, M <= 8; got {tuple(x.shape)}")
    reps, stages = int(cfg.get("REPS", 4)), int(cfg.get("STAGES", 4))
    if reps not in (2, 4) or stages < 2:
        raise ValueError(f"config: REPS 2 or 4 and STAGES >= 2; got {cfg}")
    blocks, gk = frags.shape[0], frags.shape[1]
    iters = gk * 8 // reps
    split = max(1, min(int(cfg.get("SPLIT", 1)), iters))
    per = triton.cdiv(iters, split)
    split = triton.cdiv(iters, per)
    key = (frags.data_ptr(), tuple(frags.shape), reps)
    if key not in _DESCS:
        _DESCS[key] = (frags, _desc(frags, reps))
    wdesc = _DESCS[key][1]
    asm, cons = TF._asm(kind, 1, x.dtype == torch.float16, False, reps if kind == "int4" else 1)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = arrival_counters(x.device, blocks) if split > 1 else y
    _gl_wn_kernel[(blocks, split)](
        x, s, ws, y, cnt, wdesc, m, n, gk, per, x.stride(0), y.stride(0),
        FP8=kind == "fp8", REPS=reps, STAGES=stages, SPLIT_K=split > 1, FOLD=fold, ASM=asm, CONS=cons,
        num_warps=1,
    )
    return y
