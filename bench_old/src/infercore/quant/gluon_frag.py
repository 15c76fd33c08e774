"""MODE 7: MODE 6's fragment layouts (``triton_frag.pack_int4`` / ``pack_fp8``) streamed by TMA (Hopper, Gluon).

Why: MODE 6 keeps its loads in flight in registers (two iterations ahead), so each warp has ~4 KB
outstanding and the kernel is bound by load latency: ~0.95 us per iteration per warp and a ~6 us
fixed cost at 14336x4096, M=1 (docs/quantization.md). Here each program's warps share a channel block
(64 channels INT4, 32 FP8) and a range of K groups; the tensor-memory accelerator copies each group's
4 KB of fragment words into a ring of ``STAGES`` shared-memory buffers (one instruction per group, no
registers held while in flight), so a program has ``STAGES`` groups outstanding from its first
instruction (before the PDL wait: weights only). A warp reads its chunks back with one 16-byte shared
load each (each lane its own fragment words, the layout MODE 6 loads from global memory), decodes and
multiplies them with MODE 6's inline PTX (``triton_frag.int4_asm`` / ``fp8_asm``). Split-K partials finish as
in MODE 6 (the last program of a channel block to arrive at its counter sums them, all loads in flight at
once); for INT4 at M <= 2 with one warp per program by the tagged finish (``_tag_finish``): no fence and
no counter, each partial carries the launch's epoch and the last split's program reads them until current; and
otherwise at 8 splits or fewer by the ready-flag finish: each split but the last stores its partials and sets its
flag (a release), the last split's program keeps its own partials in registers, waits for the flags (``_wait_ready``)
and sums (0.1-2.6 us faster than the counter at 3-16 rows, the counter's fence and arrival round trip off the last
program's path).

The INT4 scale / zero-point words and the activations' B fragments are loaded into registers one group
ahead (1/16 of the bytes, mostly L2 hits). Measured on the H200 (docs/quantization.md): INT4 with one warp
per program beats MODE 6 on 14336x4096 and the merged gate_up at M <= 4, MODEs 4 / 5 on 14336x4096 at M 5-16,
on down at M 1-16 and on qkv at M 1-8 when each program has 4 groups or fewer (``triton_wo.MODE7_TUNED``; 11.05 us
at M=1 with the tagged finish); it loses on o_proj at M=1; FP8 loses to MODEs 4 / 5 everywhere (config-only).
GPU-only (sm90+: TMA, mbarriers, Gluon).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..ops.pdl import pdl_release, pdl_wait
from . import triton_frag as TF
from ._splitk import arrival_counters, tagged_buffers

GROUP_BYTES = gl.constexpr(8 * 32 * 4 * 4)  # one group of one channel block (8 chunks)


@gluon.jit
def _x_frag(x8, xrow, xmask, grp, q):
    """B fragments (one int64 per lane) of chunk ``q [W, 1, 1]`` of group ``grp``: ``[W, 32, 1]``."""
    return gl.load(x8 + (xrow + grp * 32 + q), mask=xmask, other=0)


@gluon.jit
def _group_x(x8, xrow, xmask, grp, wq, W: gl.constexpr):
    """The B fragments of a group's chunks ``r W + w`` for each warp ``w`` (``wq``), r < 8 / W."""
    x0 = _x_frag(x8, xrow, xmask, grp, wq)
    x1 = x0
    x2 = x0
    x3 = x0
    x4 = x0
    x5 = x0
    x6 = x0
    x7 = x0
    if W <= 4:
        x1 = _x_frag(x8, xrow, xmask, grp, wq + W)
    if W <= 2:
        x2 = _x_frag(x8, xrow, xmask, grp, wq + 2 * W)
        x3 = _x_frag(x8, xrow, xmask, grp, wq + 3 * W)
    if W == 1:
        x4 = _x_frag(x8, xrow, xmask, grp, wq + 4)
        x5 = _x_frag(x8, xrow, xmask, grp, wq + 5)
        x6 = _x_frag(x8, xrow, xmask, grp, wq + 6)
        x7 = _x_frag(x8, xrow, xmask, grp, wq + 7)
    return x0, x1, x2, x3, x4, x5, x6, x7


@gluon.jit
def _group_loads(x8, xrow, xmask, xrow2, xmask2, szp, grp, wq, NB: gl.constexpr, W: gl.constexpr,
                 FP8: gl.constexpr):
    """Group ``grp``'s register operands: its INT4 scale / zero-point words ``[W, 32, 4]`` (FP8: ``szp``, zeros)
    and B fragments."""
    if FP8:
        sz = szp
    else:
        sz = gl.load(szp + grp * 32)
    xa = _group_x(x8, xrow, xmask, grp, wq, W)
    if NB == 2:
        xb = _group_x(x8, xrow2, xmask2, grp, wq, W)
    else:
        xb = xa
    return sz, xa, xb


@gluon.jit
def _chain(w0, w1, w2, w3, sz, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, acc, zero, NB: gl.constexpr,
           NW: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr):
    """``NW`` (1, 2 or 4) INT4 chunks of one group: MODE 6's ``_chain_step`` (``int4_asm(NB, words=NW)``: MMAs
    chained, one scale), or its ``_frag_step`` for one chunk."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    if NW == 1:
        return TF._frag_step(w0, sz, xa0, xb0, a0, a1, a2, a3, a4, a5, a6, a7, zero, False, False, NB, ASM, CONS)
    return TF._chain_step(w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, sz, a0, a1, a2, a3, a4, a5, a6, a7,
                          zero, NB, NW, ASM, CONS)


@gluon.jit
def _fp8_step(w, xa, xb, acc, zero, NB: gl.constexpr, ASM: gl.constexpr, CONS: gl.constexpr):
    """One FP8 chunk (one int64 word per tile) through MODE 6's ``_frag_step`` (``fp8_asm(NB)``), straight into
    the accumulators."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    return TF._frag_step(w, zero, xa, xb, a0, a1, a2, a3, a4, a5, a6, a7, zero, True, False, NB, ASM, CONS)


@gluon.jit
def _fp8_group(w0, w1, w2, w3, w4, w5, w6, w7, xa, xb, acc, zero, NB: gl.constexpr, RPW: gl.constexpr,
               ASM: gl.constexpr, CONS: gl.constexpr):
    """A warp's ``RPW`` chunks of one FP8 group."""
    acc = _fp8_step(w0, xa[0], xb[0], acc, zero, NB, ASM, CONS)
    if RPW >= 2:
        acc = _fp8_step(w1, xa[1], xb[1], acc, zero, NB, ASM, CONS)
    if RPW >= 4:
        acc = _fp8_step(w2, xa[2], xb[2], acc, zero, NB, ASM, CONS)
        acc = _fp8_step(w3, xa[3], xb[3], acc, zero, NB, ASM, CONS)
    if RPW == 8:
        acc = _fp8_step(w4, xa[4], xb[4], acc, zero, NB, ASM, CONS)
        acc = _fp8_step(w5, xa[5], xb[5], acc, zero, NB, ASM, CONS)
        acc = _fp8_step(w6, xa[6], xb[6], acc, zero, NB, ASM, CONS)
        acc = _fp8_step(w7, xa[7], xb[7], acc, zero, NB, ASM, CONS)
    return acc


@gluon.jit
def _rows(j: gl.constexpr, pb, g, t, c, CT: gl.constexpr):
    """Batch rows and output channels of accumulator ``j`` (rows ``2t + j % 2 (+ 8 for j >= 4)``, channels
    ``16 c + g (+ 8 for j % 4 >= 2)`` of channel block ``pb``, ``16 CT`` channels)."""
    m = 2 * t + (j % 2) + 8 * (j // 4)
    n = pb * (16 * CT) + 16 * c + g + 8 * ((j % 4) // 2)
    return m, n


@gluon.jit
def _store_part(ws_ptr, y_ptr, a, j: gl.constexpr, pb, sp, M, N, stride_ym, g, t, c, TO_WS: gl.constexpr, s_ptr,
                CT: gl.constexpr, FP8: gl.constexpr, FOLD: gl.constexpr):
    m, n = _rows(j, pb, g, t, c, CT)
    mask = (m < M) & (n < N)
    if TO_WS:
        gl.store(ws_ptr + sp.to(gl.int64) * M * N + m * N + n, a, mask=mask)
    else:
        if FP8:  # per-channel scales (packed row order) and the decode's power of two
            a = a * gl.load(s_ptr + n, mask=mask, other=0.0) * FOLD
        gl.store(y_ptr + m * stride_ym + n, a.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _store_parts(ws_ptr, y_ptr, acc, pb, sp, M, N, stride_ym, g, t, c, TO_WS: gl.constexpr, s_ptr, CT: gl.constexpr,
                 FP8: gl.constexpr, FOLD: gl.constexpr, NB: gl.constexpr):
    """:func:`_store_part` of the four (``NB`` 1) or eight accumulators."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    _store_part(ws_ptr, y_ptr, a0, 0, pb, sp, M, N, stride_ym, g, t, c, TO_WS, s_ptr, CT, FP8, FOLD)
    _store_part(ws_ptr, y_ptr, a1, 1, pb, sp, M, N, stride_ym, g, t, c, TO_WS, s_ptr, CT, FP8, FOLD)
    _store_part(ws_ptr, y_ptr, a2, 2, pb, sp, M, N, stride_ym, g, t, c, TO_WS, s_ptr, CT, FP8, FOLD)
    _store_part(ws_ptr, y_ptr, a3, 3, pb, sp, M, N, stride_ym, g, t, c, TO_WS, s_ptr, CT, FP8, FOLD)
    if NB == 2:
        _store_part(ws_ptr, y_ptr, a4, 4, pb, sp, M, N, stride_ym, g, t, c, TO_WS, s_ptr, CT, FP8, FOLD)
        _store_part(ws_ptr, y_ptr, a5, 5, pb, sp, M, N, stride_ym, g, t, c, TO_WS, s_ptr, CT, FP8, FOLD)
        _store_part(ws_ptr, y_ptr, a6, 6, pb, sp, M, N, stride_ym, g, t, c, TO_WS, s_ptr, CT, FP8, FOLD)
        _store_part(ws_ptr, y_ptr, a7, 7, pb, sp, M, N, stride_ym, g, t, c, TO_WS, s_ptr, CT, FP8, FOLD)


@gluon.jit
def _act_mul(gv, uv, y_ptr, ACT: gl.constexpr):
    """``act(gate) * up`` in fp32, gate and up rounded to the output dtype first (as the unfused path)."""
    gv = gv.to(y_ptr.dtype.element_ty).to(gl.float32)
    uv = uv.to(y_ptr.dtype.element_ty).to(gl.float32)
    if ACT == 1:
        a = gv / (1.0 + gl.exp(-gv))
    elif ACT == 2:
        z = 0.7978845608028654 * (gv + 0.044715 * gv * gv * gv)
        a = gv / (1.0 + gl.exp(-2.0 * z))
    else:
        a = 0.5 * gv * (1.0 + gl.erf(gv * 0.7071067811865476))
    return a * uv


@gluon.jit
def _sum_load(ws_ptr, j: gl.constexpr, pb, NSPLIT: gl.constexpr, M, N, g, t, c, zero, CT: gl.constexpr):
    """``zero`` plus the first ``NSPLIT`` splits' partials of accumulator ``j``. The loop is unrolled so that every
    load is in flight at once (a loop over a run-time count waits for each before the next: one L2 round trip per
    split)."""
    m, n = _rows(j, pb, g, t, c, CT)
    mask = (m < M) & (n < N)
    tot = zero
    for s in gl.static_range(NSPLIT):
        tot += gl.load(ws_ptr + s * M * N + m * N + n, mask=mask, other=0.0, cache_modifier=".cg")
    return tot


@gluon.jit
def _sum_store(tot, y_ptr, j: gl.constexpr, pb, M, N, stride_ym, g, t, c, ACT: gl.constexpr, s_ptr,
               CT: gl.constexpr, FP8: gl.constexpr, FOLD: gl.constexpr):
    """Accumulator ``j``'s total, scaled (FP8) and stored; with ACT (rows packed with ``act=True``: tiles
    ``c < CT / 2`` of a block hold gate rows, ``c + CT / 2`` the matching up rows) the gated activation's output
    channel ``8 CT pb + 16 c + row``."""
    m, n = _rows(j, pb, g, t, c, CT)
    mask = (m < M) & (n < N)
    if FP8:
        tot = tot * gl.load(s_ptr + n, mask=mask, other=0.0) * FOLD
    if ACT != 0:
        H: gl.constexpr = CT // 2
        ga, ua = gl.split(gl.permute(gl.reshape(tot, [32, 2, H]), (0, 2, 1)))
        mm, _ = gl.split(gl.permute(gl.reshape(m + 0 * n, [32, 2, H]), (0, 2, 1)))
        o, _ = gl.split(gl.permute(gl.reshape(pb * (8 * CT) + 16 * c + g + 8 * ((j % 4) // 2) + 0 * m, [32, 2, H]),
                                   (0, 2, 1)))
        out = _act_mul(ga, ua, y_ptr, ACT)
        gl.store(y_ptr + mm * stride_ym + o, out.to(y_ptr.dtype.element_ty), mask=(mm < M) & (o < N // 2))
    else:
        gl.store(y_ptr + m * stride_ym + n, tot.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _sum_four(ws_ptr, y_ptr, j0: gl.constexpr, pb, NSPLIT: gl.constexpr, M, N, stride_ym, g, t, c, o0, o1, o2, o3,
              ACT: gl.constexpr, s_ptr, CT: gl.constexpr, FP8: gl.constexpr, FOLD: gl.constexpr):
    """Accumulators ``j0 .. j0 + 3`` finished: ``o0 .. o3`` plus the partials of the first ``NSPLIT`` splits, all
    loaded first, then stored."""
    t0 = _sum_load(ws_ptr, j0, pb, NSPLIT, M, N, g, t, c, o0, CT)
    t1 = _sum_load(ws_ptr, j0 + 1, pb, NSPLIT, M, N, g, t, c, o1, CT)
    t2 = _sum_load(ws_ptr, j0 + 2, pb, NSPLIT, M, N, g, t, c, o2, CT)
    t3 = _sum_load(ws_ptr, j0 + 3, pb, NSPLIT, M, N, g, t, c, o3, CT)
    _sum_store(t0, y_ptr, j0, pb, M, N, stride_ym, g, t, c, ACT, s_ptr, CT, FP8, FOLD)
    _sum_store(t1, y_ptr, j0 + 1, pb, M, N, stride_ym, g, t, c, ACT, s_ptr, CT, FP8, FOLD)
    _sum_store(t2, y_ptr, j0 + 2, pb, M, N, stride_ym, g, t, c, ACT, s_ptr, CT, FP8, FOLD)
    _sum_store(t3, y_ptr, j0 + 3, pb, M, N, stride_ym, g, t, c, ACT, s_ptr, CT, FP8, FOLD)


@gluon.jit
def _wait_ready(f_ptr, NREADY: gl.constexpr, W: gl.constexpr):
    """Until the ``NREADY`` (<= 32) flags at ``f_ptr`` are all set (~0.1 us between reads), then an acquire fence:
    the flagging programs' partials are visible to the loads after it."""
    LF: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    lane = gl.arange(0, 32, layout=LF)
    ready = gl.min(gl.load(f_ptr + lane, mask=lane < NREADY, other=1, volatile=True), axis=0)
    while ready == 0:
        gl.inline_asm_elementwise("nanosleep.u32 100;\nmov.u32 $0, 0;", "=r,r", [ready], dtype=gl.int32,
                                  is_pure=False, pack=1)
        ready = gl.min(gl.load(f_ptr + lane, mask=lane < NREADY, other=1, volatile=True), axis=0)
    gl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, 0;", "=r,r", [ready], dtype=gl.int32, is_pure=False,
                              pack=1)
    return lane


@gluon.jit
def _tag_store(w64, a, j: gl.constexpr, pb, sp, g, t, c, ep, M, NSPLIT: gl.constexpr, MB: gl.constexpr):
    """Accumulator ``j``'s rows ``< M`` as tagged partials: one 64-bit relaxed store per value, the fp32 bits
    low and this launch's epoch ``ep`` high, at ``[pb, sp, m, local channel]`` of ``[blocks, NSPLIT, MB, 64]``."""
    m, n = _rows(j, pb, g, t, c, 4)
    ptr = w64 + (((pb * NSPLIT + sp) * MB + m) * 64 + (n - pb * 64))
    word = (a.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF) | (ep.to(gl.int64) << 32)
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.gpu.global.b64 [$1], $2; }\n"
                              "mov.u32 $0, 0;", "=r,l,l,r", [ptr, word, (m < M).to(gl.int32)], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _tag_finish(w64, y_ptr, ep_ptr, a0, a1, a2, a3, pb, sp, ep, M, stride_ym, g, t, c, ACT: gl.constexpr,
                NSPLIT: gl.constexpr, MB: gl.constexpr):
    """The tagged split-K finish (INT4, M <= MB <= 2): no fence and no counter. Every program stores its partials
    tagged with the launch's epoch; the last split's program (the last to be dispatched) then reads all of its
    block's partials, again until every tag is this epoch (a stale tag: a store still on its way; it waits
    ~0.1 us between reads), sums them, writes ``y`` (or ``act(gate) * up``: local channels 32 + l are the up
    rows of gate rows l) and publishes the epoch for the next launch (which reads it after its PDL wait)."""
    _tag_store(w64, a0, 0, pb, sp, g, t, c, ep, M, NSPLIT, MB)
    _tag_store(w64, a1, 1, pb, sp, g, t, c, ep, M, NSPLIT, MB)
    _tag_store(w64, a2, 2, pb, sp, g, t, c, ep, M, NSPLIT, MB)
    _tag_store(w64, a3, 3, pb, sp, g, t, c, ep, M, NSPLIT, MB)
    if sp == NSPLIT - 1:
        gl.thread_barrier()  # this program's own partials, stored by other lanes, are visible below
        LF: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [1, 1, 1], [2, 1, 0])  # [row, l, half]
        fm = gl.expand_dims(gl.expand_dims(gl.arange(0, MB, layout=gl.SliceLayout(1, gl.SliceLayout(2, LF))), 1), 2)
        fl = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LF))), 0), 2)
        fh = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LF))), 0), 1)
        local = fh * 32 + fl
        base = w64 + ((pb * NSPLIT * MB + fm) * 64 + local)
        fmask = (fm < M) & (local >= 0)
        fresh = ep.to(gl.int64) << 32
        tot = gl.zeros([MB, 32, 2], gl.float32, LF)
        nbad = 1
        while nbad > 0:
            tot = gl.zeros([MB, 32, 2], gl.float32, LF)
            bad = gl.zeros([MB, 32, 2], gl.int32, LF)
            for s in gl.static_range(NSPLIT):
                w = gl.load(base + s * (MB * 64), mask=fmask, other=fresh, volatile=True)
                tot += (w & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True)
                bad += ((w >> 32).to(gl.int32) != ep).to(gl.int32)
            nbad = gl.sum(gl.sum(gl.sum(bad, axis=2), axis=1), axis=0)
            if nbad > 0:
                gl.inline_asm_elementwise("nanosleep.u32 100;\nmov.u32 $0, 0;", "=r,r", [nbad], dtype=gl.int32,
                                          is_pure=False, pack=1)
        lo, hi = gl.split(tot)  # local channels l and 32 + l
        rows = gl.max(gl.max(fm, axis=2), axis=1)  # [MB]
        row2 = gl.expand_dims(rows, 1)
        l2 = gl.expand_dims(gl.max(gl.max(fl, axis=2), axis=0), 0)  # [1, 32]
        omask = (row2 < M) & (l2 >= 0)
        if ACT != 0:
            out = _act_mul(lo, hi, y_ptr, ACT)
            gl.store(y_ptr + row2 * stride_ym + pb * 32 + l2, out.to(y_ptr.dtype.element_ty), mask=omask)
        else:
            gl.store(y_ptr + row2 * stride_ym + pb * 64 + l2, lo.to(y_ptr.dtype.element_ty), mask=omask)
            gl.store(y_ptr + row2 * stride_ym + pb * 64 + 32 + l2, hi.to(y_ptr.dtype.element_ty), mask=omask)
        gl.store(ep_ptr + pb, ep)


@gluon.jit
def _tma_frag_kernel(
    w_desc, x_ptr, s_ptr, ws_ptr, y_ptr, cnt_ptr, ep_ptr,
    M, N, G, groups_per_split, stride_xm, stride_ym,
    NB: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr, ACT: gl.constexpr,
    ASM: gl.constexpr, CONS: gl.constexpr, FP8: gl.constexpr = False, FOLD: gl.constexpr = 1.0,
    USE_PDL: gl.constexpr = False, NSPLIT: gl.constexpr = 1, TAG_MB: gl.constexpr = 0, FLAGS: gl.constexpr = False,
):
    """Grid ``(N / 64, split)``, ``W`` warps (1, 2, 4 or 8) per program: warp w takes chunks ``r W + w`` of
    each group, and their sums are added at the end. ``w_desc``: TMA descriptor of the fragment words
    viewed as ``[N/64 * G * 8, 128]`` int32 (block ``[8, 128]``: one group of one channel block); ``s``:
    the int64 scale / zero-point words ``[N/64, G, 8, 4]``; ``ws``: fp32 partials ``[split, M, N]`` (split-K
    or ACT) summed by the last program to arrive at ``cnt``, or with ``TAG_MB`` (1 or 2 rows, INT4, W = 1) the
    tagged int64 partials ``[N/64, split, TAG_MB, 64]`` and ``ep`` the blocks' epochs (``_tag_finish``).
    ``NSPLIT``: the split count; ``FLAGS``: the ready-flag finish (``cnt`` then holds a flag per block and split).
    FP8 (``pack_fp8``'s int64 words ``[N/32, G, 8, 32, 2]``, the same 4 KB per group of a 32-channel block): ``s``
    the fp32 per-channel scales (packed row order), applied with ``FOLD`` at the end."""
    RPW: gl.constexpr = 8 // W  # chunks per warp per group
    CT: gl.constexpr = 2 if FP8 else 4  # 16-channel tiles per block (a lane's 16 bytes per chunk)
    L3: gl.constexpr = gl.BlockedLayout([1, 1, CT], [1, 32, 1], [W, 1, 1], [2, 1, 0])  # [warp, lane, tile]
    LWL: gl.constexpr = gl.SliceLayout(2, L3)  # [warp, lane]
    L2: gl.constexpr = gl.SliceLayout(0, L3)  # [lane, tile] after the warps' sum
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    pdl_release(USE_PDL)
    pb = gl.program_id(0)
    sp = gl.program_id(1)
    g0 = sp * groups_per_split
    n_grp = gl.minimum(groups_per_split, G - g0)
    row0 = (pb * G + g0) * 8

    wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 8, 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # the weights of the first STAGES groups, before the PDL wait
        mbarrier.expect(bars.index(s), GROUP_BYTES, pred=s < n_grp)
        tma.async_copy_global_to_shared(w_desc, [row0 + s * 8, 0], bars.index(s), wbuf.index(s), pred=s < n_grp)
    view = wbuf._reinterpret(gl.int64 if FP8 else gl.int32, [STAGES * RPW, W, 32, CT], FLAT)

    # [W, 32, 1] lane / warp indices, [1, 1, 4] tiles
    lane = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, LWL)), 0), 2)
    wq = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, LWL)), 1), 2)
    c3 = gl.expand_dims(gl.expand_dims(gl.arange(0, CT, layout=gl.SliceLayout(0, L2)), 0), 0)
    g = lane // 4
    t = lane % 4
    x8 = x_ptr.to(gl.pointer_type(gl.int64))
    xrow = g * (stride_xm // 4) + 8 * t + 0 * wq
    xmask = (g < M) & (wq >= 0)
    xrow2 = (g + 8) * (stride_xm // 4) + 8 * t + 0 * wq
    xmask2 = (g + 8 < M) & (wq >= 0)
    if FP8:
        szp = gl.zeros([W, 32, CT], gl.int64, L3)  # (no scale words: per-channel scales at the end)
    else:
        szp = s_ptr.to(gl.pointer_type(gl.int64)) + (pb * G * 32 + g * 4 + c3 + 0 * wq)
    zero = gl.zeros([W, 32, CT], gl.float32, L3)
    acc = (zero, zero, zero, zero, zero, zero, zero, zero)
    pdl_wait(USE_PDL)
    if TAG_MB > 0:  # this launch's epoch of block pb (the previous launch's, published at its end, + 1)
        ep = gl.load(ep_ptr + pb, volatile=True) + 1
    else:
        ep = 0
    nxt = _group_loads(x8, xrow, xmask, xrow2, xmask2, szp, g0, wq, NB, W, FP8)
    for i in range(n_grp):
        cur = nxt
        nxt = _group_loads(x8, xrow, xmask, xrow2, xmask2, szp, g0 + gl.minimum(i + 1, n_grp - 1), wq, NB, W, FP8)
        st = i % STAGES
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        w0 = view.index(st * RPW).load(L3)
        w1 = w0
        w2 = w0
        w3 = w0
        w4 = w0
        w5 = w0
        w6 = w0
        w7 = w0
        if W <= 4:
            w1 = view.index(st * RPW + 1).load(L3)
        if W <= 2:
            w2 = view.index(st * RPW + 2).load(L3)
            w3 = view.index(st * RPW + 3).load(L3)
        if W == 1:
            w4 = view.index(st * RPW + 4).load(L3)
            w5 = view.index(st * RPW + 5).load(L3)
            w6 = view.index(st * RPW + 6).load(L3)
            w7 = view.index(st * RPW + 7).load(L3)
        fence_async_shared()  # the generic-proxy reads above before the TMA below rewrites the buffer
        refill = i + STAGES < n_grp
        mbarrier.expect(bars.index(st), GROUP_BYTES, pred=refill)
        tma.async_copy_global_to_shared(w_desc, [row0 + (i + STAGES) * 8, 0], bars.index(st), wbuf.index(st),
                                        pred=refill)
        sz, xa, xb = cur
        if FP8:
            acc = _fp8_group(w0, w1, w2, w3, w4, w5, w6, w7, xa, xb, acc, zero, NB, RPW, ASM, CONS)
        elif W == 1:
            acc = _chain(w0, w1, w2, w3, sz, xa[0], xa[1], xa[2], xa[3], xb[0], xb[1], xb[2], xb[3], acc, zero, NB,
                         4, ASM, CONS)
            acc = _chain(w4, w5, w6, w7, sz, xa[4], xa[5], xa[6], xa[7], xb[4], xb[5], xb[6], xb[7], acc, zero, NB,
                         4, ASM, CONS)
        else:
            acc = _chain(w0, w1, w2, w3, sz, xa[0], xa[1], xa[2], xa[3], xb[0], xb[1], xb[2], xb[3], acc, zero, NB,
                         RPW, ASM, CONS)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    r2 = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(1, L2)), 1)
    c2 = gl.expand_dims(gl.arange(0, CT, layout=gl.SliceLayout(0, L2)), 0)
    g2 = r2 // 4
    t2 = r2 % 4
    zero2 = gl.zeros([32, CT], gl.float32, L2)
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    a0 = gl.sum(a0, axis=0)
    a1 = gl.sum(a1, axis=0)
    a2 = gl.sum(a2, axis=0)
    a3 = gl.sum(a3, axis=0)
    if NB == 2:
        a4 = gl.sum(a4, axis=0)
        a5 = gl.sum(a5, axis=0)
        a6 = gl.sum(a6, axis=0)
        a7 = gl.sum(a7, axis=0)
    acc = (a0, a1, a2, a3, a4, a5, a6, a7)
    if TAG_MB > 0:
        _tag_finish(ws_ptr.to(gl.pointer_type(gl.int64)), y_ptr, ep_ptr, a0, a1, a2, a3, pb, sp, ep, M, stride_ym,
                    g2, t2, c2, ACT, NSPLIT, TAG_MB)
    elif FLAGS:  # the ready-flag finish (split-K): the last split's program sums, keeping its own partials
        if sp < NSPLIT - 1:
            _store_parts(ws_ptr, y_ptr, acc, pb, sp, M, N, stride_ym, g2, t2, c2, True, s_ptr, CT, FP8, FOLD, NB)
            gl.thread_barrier()  # every thread's partial is written before the release below
            gl.atomic_xchg(cnt_ptr + pb * NSPLIT + sp, 1, sem="release", scope="gpu")
        else:
            fl = _wait_ready(cnt_ptr + pb * NSPLIT, NSPLIT - 1, W)
            _sum_four(ws_ptr, y_ptr, 0, pb, NSPLIT - 1, M, N, stride_ym, g2, t2, c2, a0, a1, a2, a3, ACT, s_ptr, CT,
                      FP8, FOLD)
            if NB == 2:
                _sum_four(ws_ptr, y_ptr, 4, pb, NSPLIT - 1, M, N, stride_ym, g2, t2, c2, a4, a5, a6, a7, ACT, s_ptr,
                          CT, FP8, FOLD)
            gl.thread_barrier()  # (W > 1: every warp has seen the flags before they are cleared)
            gl.store(cnt_ptr + pb * NSPLIT + fl, fl * 0, mask=fl < NSPLIT - 1)
    else:
        VIA_WS: gl.constexpr = SPLIT_K or ACT != 0
        _store_parts(ws_ptr, y_ptr, acc, pb, sp, M, N, stride_ym, g2, t2, c2, VIA_WS, s_ptr, CT, FP8, FOLD, NB)
        if VIA_WS:
            gl.thread_barrier()  # every thread's partial is written before the release below
            if SPLIT_K:
                done = gl.atomic_add(cnt_ptr + pb, 1, sem="acq_rel", scope="gpu")
            else:
                done = NSPLIT - 1
            if done == NSPLIT - 1:
                _sum_four(ws_ptr, y_ptr, 0, pb, NSPLIT, M, N, stride_ym, g2, t2, c2, zero2, zero2, zero2, zero2, ACT,
                          s_ptr, CT, FP8, FOLD)
                if NB == 2:
                    _sum_four(ws_ptr, y_ptr, 4, pb, NSPLIT, M, N, stride_ym, g2, t2, c2, zero2, zero2, zero2, zero2,
                              ACT, s_ptr, CT, FP8, FOLD)
                if SPLIT_K:  # ready for the next launch (graph replays too); the launch's end publishes it
                    gl.atomic_xchg(cnt_ptr + pb, 0, sem="relaxed", scope="gpu")


_LAYOUT = None


def descriptor(words: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of ``pack_int4``'s words ``[N/64, G, 8, 32, 4]`` (or ``pack_fp8``'s int64
    ``[N/32, G, 8, 32, 2]``) viewed as ``[blocks * G * 8, 128]`` int32, one group of one channel block
    (``[8, 128]``, 4 KB) per copy."""
    global _LAYOUT
    if _LAYOUT is None:
        _LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    flat = words.view(torch.int32).view(-1, 128)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [8, 128], _LAYOUT)


def check_config(cfg: dict) -> tuple[int, int, int]:
    """``(W, STAGES, SPLIT)`` of a MODE 7 config, validated (``ValueError`` naming the key)."""
    w, stages, split = cfg.get("W", 1), cfg.get("STAGES", 2), cfg.get("SPLIT", 1)
    if not isinstance(w, int) or isinstance(w, bool) or w not in (1, 2, 4, 8):
        raise ValueError(f"config: MODE 7's W (warps per program) must be 1, 2, 4 or 8, got {w!r}")
    if not isinstance(stages, int) or not 1 <= stages <= 8:
        raise ValueError(f"config: MODE 7's STAGES (groups in flight per program) must be an int in [1, 8], "
                         f"got {stages!r}")
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"config: MODE 7's SPLIT (K splits) must be an int >= 1, got {split!r}")
    if not isinstance(cfg.get("TAGGED", True), bool):
        raise ValueError(f"config: MODE 7's TAGGED (the tagged split-K finish at M <= 2) must be a bool, "
                         f"got {cfg['TAGGED']!r}")
    if not isinstance(cfg.get("FLAGS", True), bool):
        raise ValueError(f"config: MODE 7's FLAGS (the ready-flag split-K finish) must be a bool, got {cfg['FLAGS']!r}")
    return w, stages, split


def launch(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, n: int, cfg: dict, desc=None,
           act: str | None = None, kind: str = "int4", fold: float = 1.0) -> torch.Tensor:
    """``x [M, K]`` (bf16/fp16, M <= 16, CUDA sm90+) times fragment-packed weights -> ``[M, N]`` in ``x.dtype``
    (``[M, N/2]`` = ``act(gate) * up`` with ``act``: a merged ``[gate; up]`` weight packed with ``act=True``).
    ``kind`` "int4": ``words``, ``sz`` from ``triton_frag.pack_int4``; "fp8": ``words`` from
    ``triton_frag.pack_fp8``, ``sz`` the fp32 per-channel scales ``[N]`` in packed row order, ``fold`` the
    decode's power of two (2**120 bf16, 2**8 fp16). ``cfg``: W (warps per program, splitting each group's
    chunks), STAGES (groups in flight per program), SPLIT (K splits), optionally MAXNREG (a register cap per
    thread), TAGGED (default True: the tagged split-K finish where it applies) and FLAGS (default True: the
    ready-flag finish for the other split-K calls of <= 8 splits; False: the arrival counter); ``desc``:
    :func:`descriptor` of ``words`` (made here when None)."""
    w, stages, split = check_config(cfg)
    regs = TF.maxnreg_option(cfg)
    TF.check_operands(x, kind, words, n, sz, act, min_arch=9, mode=7)
    fp8 = kind == "fp8"
    blocks, gk = words.shape[0], words.shape[1]
    m = x.shape[0]
    nb = 1 if m <= 8 else 2
    split = min(split, gk)
    per = triton.cdiv(gk, split)
    split = triton.cdiv(gk, per)
    f16 = x.dtype == torch.float16
    asm, cons = TF._asm("fp8", nb, f16, False) if fp8 else TF._asm("int4", nb, f16, False, 8 // w if w > 1 else 4)
    code = TF.ACTIVATIONS[act]
    y = torch.empty((m, n // 2 if code else n), dtype=x.dtype, device=x.device)
    tag_mb = 0
    if not fp8 and w == 1 and split > 1 and m <= 2 and cfg.get("TAGGED", True):  # the tagged finish
        tag_mb = m
        ep, ws = tagged_buffers(x.device, blocks, split, m)
        cnt = y
    else:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 or code else y
        cnt = arrival_counters(x.device, blocks * split) if split > 1 else y
        ep = cnt
    # (at 16 splits and up the ready flags lost at 1-8 rows: results/h200/sweeps/probe_ready_flags.json)
    flags = tag_mb == 0 and 1 < split <= 8 and cfg.get("FLAGS", True)
    use_pdl = TF.pdl_enabled(x)
    _tma_frag_kernel[(blocks, split)](
        desc if desc is not None else descriptor(words), x, sz, ws, y, cnt, ep,
        m, n, gk, per, x.stride(0), y.stride(0),
        NB=nb, W=w, STAGES=stages, SPLIT_K=split > 1, ACT=code, ASM=asm, CONS=cons, FP8=fp8, FOLD=float(fold),
        NSPLIT=split, TAG_MB=tag_mb, FLAGS=flags,
        num_warps=w, **TF.pdl_launch(use_pdl), **regs,
    )
    return y
