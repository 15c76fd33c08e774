"""MODE 8: INT4 fragment words (``triton_frag.pack_int4``, the layout MODE 6 / 7 read) decoded into the A operand
of Hopper's asynchronous warpgroup MMA (wgmma), the activations its B operand in shared memory (Gluon, sm90+).

Why: MODE 7's one-warp programs issue ``mma.sync`` and wait on each, so a warp is idle while its MMAs and loads
are in flight, and at 9-16 rows (two B fragments, 191 registers) ~10 warps fit per SM: it is bound by latency,
not bytes or instructions (docs/quantization.md). Here one warpgroup (4 warps) owns four 64-channel blocks over a
K range; warp ``w`` decodes block ``4 pid + w`` exactly as MODE 7 does (one LOP3 per register pair: ``128 + q``
bf16, ``1024 + q`` fp16), and the four warps' tile ``c`` fragments form the 64-row A operand of one
``wgmma.m64n16k16`` that runs while the next tile is decoded. The activations of the program's K range are
staged once in shared memory in the fragments' K order (one read of them per program) and are the wgmma's B
operand; their per-group sums are taken at the same time. Per group the four tiles' chained products go to
temporaries, and ``scale * (acc - (base + zero) * sum(x))`` adds them into the accumulators (fp32, as MODE 6 / 7).
Weights arrive by TMA (one 4 KB copy per block and group) into a ring of ``STAGES`` groups. Split-K partials are
summed by the last program of a channel range to arrive at its counter.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..ops.pdl import pdl_release, pdl_wait
from . import triton_frag as TF
from ._splitk import arrival_counters
from .gluon_frag import descriptor

GROUP_BYTES = gl.constexpr(8 * 32 * 4 * 4)  # one group (8 chunks) of one 64-channel block
# wgmma m64n16k16: 4 warps x 16 rows (channels), 16 columns (activation rows)
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
# A fragment [64, 16] as [warp, row+8, g, k+8, t, k+1]: thread (warp w, lane 4 g + t) holds rows 16 w + g (+ 8),
# K 2 t (+ 1, + 8): the broadcast of one word per thread to its 8 elements
P6 = gl.constexpr(gl.BlockedLayout([1, 2, 1, 2, 1, 2], [1, 1, 8, 1, 4, 1], [4, 1, 1, 1, 1, 1], [5, 1, 3, 4, 2, 0]))
L3 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 32, 1], [4, 1, 1], [2, 1, 0]))  # words [warp, lane, tile]
L4 = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [1, 1, 32, 1], [4, 1, 1, 1], [3, 2, 1, 0]))


def decode_asm(f16: bool) -> str:
    """One INT4 word -> the four A registers of its tile (register ``r``: nibbles ``r``, ``r + 4`` as
    ``base + q``)."""
    magic = "0x64006400" if f16 else "0x43004300"
    return "{ .reg .b32 t;\n" + "".join(
        (f"and.b32 ${r}, $4, 0x000F000F;\n" if r == 0 else f"shr.b32 t, $4, {4 * r};\nand.b32 ${r}, t, 0x000F000F;\n")
        + f"or.b32 ${r}, ${r}, {magic};\n" for r in range(4)) + "}"


@gluon.jit
def _a_operand(wt, ASM: gl.constexpr, F16: gl.constexpr):
    """The A operand ``[64, 16]`` of one tile from its words ``[4 warps, 32 lanes]`` (one per thread)."""
    LW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(5, P6)))  # [warp, g, t]
    w = gl.convert_layout(gl.reshape(wt, [4, 8, 4]), LW, assert_trivial=True)
    w6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(w, 1), 3), 5) + gl.zeros([4, 2, 8, 2, 4, 2], gl.int32, P6)
    w2 = gl.convert_layout(gl.reshape(w6, [64, 16]), gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2),
                           assert_trivial=True)
    if F16:
        a = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [w2], dtype=gl.float16, is_pure=True,
                                      pack=8)
    else:
        a = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [w2], dtype=gl.bfloat16, is_pure=True,
                                      pack=8)
    return a


@gluon.jit
def _chunk_words(v, r: gl.constexpr):
    """Chunk ``r`` of the four blocks' words ``[4, 32, 4]`` from one ring stage ``v [4, 8, 32, 4]``."""
    return gl.convert_layout(gl.reshape(v.slice(r, 1, dim=1).load(L4), [4, 32, 4]), L3)


@gluon.jit
def _chunk_mma(v, xs, i, q: gl.constexpr, t0, t1, t2, t3, ASM: gl.constexpr, F16: gl.constexpr,
               DEPTH: gl.constexpr):
    """Chunk ``q`` of the program's ``i``-th group: the four tiles' wgmmas (words from ring stage ``v``, B the
    staged activations' chunk) chained onto ``t0 .. t3`` (started at ``q = 0``); then, but for the last chunk, a wait
    until only ``DEPTH`` chunks' wgmmas are in flight, which frees the A registers of the chunks before them."""
    words = _chunk_words(v, q)
    b = xs.index(8 * i + q).permute((1, 0))
    p, r = gl.split(gl.reshape(words, [4, 32, 2, 2]))  # tiles (0, 2) and (1, 3)
    w0, w2 = gl.split(p)
    w1, w3 = gl.split(r)
    t0 = warpgroup_mma(_a_operand(w0, ASM, F16), b, t0, use_acc=q > 0, is_async=True)
    t1 = warpgroup_mma(_a_operand(w1, ASM, F16), b, t1, use_acc=q > 0, is_async=True)
    t2 = warpgroup_mma(_a_operand(w2, ASM, F16), b, t2, use_acc=q > 0, is_async=True)
    t3 = warpgroup_mma(_a_operand(w3, ASM, F16), b, t3, use_acc=q > 0, is_async=True)
    if q < 7:
        t0, t1, t2, t3 = warpgroup_mma_wait(4 * DEPTH, deps=[t0, t1, t2, t3])
    return t0, t1, t2, t3


@gluon.jit
def _group_bits(sz_ptr):
    """A group's int32 scale / zero-point bits ``[64]`` of each row's channel for the four tiles (``sz_ptr``: tile 0's;
    the group's word ``[g, c]``, low half rows g, high half g + 8)."""
    return gl.load(sz_ptr), gl.load(sz_ptr + 2), gl.load(sz_ptr + 4), gl.load(sz_ptr + 6)


@gluon.jit
def _scaled(acc, tmp, bits, xsum, BASE: gl.constexpr):
    """``acc + scale * (tmp - (BASE + zero) * xsum)`` for one tile (``bits``: :func:`_group_bits`)."""
    scale = gl.expand_dims((bits & -16).to(gl.float32, bitcast=True), 1)
    zero = gl.expand_dims((bits & 15).to(gl.float32), 1)
    return acc + scale * (tmp - (BASE + zero) * xsum)


@gluon.jit
def _channels(c, cb):
    """Output channels ``[64, 1]`` of tile ``c``'s rows and activation rows ``[1, 16]``."""
    r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, ACC)), 1)
    m = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, ACC)), 0)
    return (cb * 4 + r // 16) * 64 + 16 * c + r % 16, m


@gluon.jit
def _store_tile(dst, a, c: gl.constexpr, cb, sp, M, N, stride, TO_WS: gl.constexpr):
    n, m = _channels(c, cb)
    mask = (m < M) & (n < N)
    if TO_WS:
        gl.store(dst + sp.to(gl.int64) * M * N + m * N + n, a, mask=mask)
    else:
        gl.store(dst + m * stride + n, a.to(dst.dtype.element_ty), mask=mask)


@gluon.jit
def _sum_tile(ws_ptr, y_ptr, c, cb, M, N, stride_ym, NSPLIT: gl.constexpr):
    n, m = _channels(c, cb)
    mask = (m < M) & (n < N)
    tot = gl.zeros([64, 16], gl.float32, ACC)
    for s in gl.static_range(NSPLIT):
        tot += gl.load(ws_ptr + s * M * N + m * N + n, mask=mask, other=0.0, cache_modifier=".cg")
    gl.store(y_ptr + m * stride_ym + n, tot.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _ax4(n: gl.constexpr, d: gl.constexpr, L: gl.constexpr):
    """``arange(n)`` along dimension ``d`` of a 4-D layout ``L`` (size 1 elsewhere)."""
    if d == 0:
        r = gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L)))), 1), 2), 3)
    elif d == 1:
        r = gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L)))), 0), 2), 3)
    elif d == 2:
        r = gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L)))), 0), 1), 3)
    else:
        r = gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L)))), 0), 1), 2)
    return r


@gluon.jit
def _wgmma_frag_kernel(
    w_desc, x_ptr, s_ptr, ws_ptr, y_ptr, cnt_ptr,
    M, N, G, groups_per_split, stride_xm, stride_ym,
    STAGES: gl.constexpr, GPS: gl.constexpr, SPLIT_K: gl.constexpr, NSPLIT: gl.constexpr, ASM: gl.constexpr,
    BASE: gl.constexpr, DEPTH: gl.constexpr = 1, USE_PDL: gl.constexpr = False,
):
    """Grid ``(N / 256, split)``, one warpgroup per program: channel blocks ``4 pid0 .. 4 pid0 + 3`` over the
    ``<= GPS`` groups of K split ``pid1``. ``w_desc``: :func:`gluon_frag.descriptor` of the words; ``s``: the
    int64 scale / zero-point words ``[N/64, G, 8, 4]``; ``ws``: fp32 partials ``[split, M, N]`` (split-K)."""
    DT: gl.constexpr = x_ptr.dtype.element_ty
    F16: gl.constexpr = DT == gl.float16
    FLAT4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    XL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    CH: gl.constexpr = GPS * 8  # chunks (16 K each) of the staged activations
    pdl_release(USE_PDL)
    cb = gl.program_id(0)
    sp = gl.program_id(1)
    g0 = sp * groups_per_split
    n_grp = gl.minimum(groups_per_split, G - g0)

    wbuf = gl.allocate_shared_memory(gl.int32, [STAGES * 4, 8, 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # the weights of the first STAGES groups, before the PDL wait
        mbarrier.expect(bars.index(s), 4 * GROUP_BYTES, pred=s < n_grp)
        for w in gl.static_range(4):
            tma.async_copy_global_to_shared(w_desc, [((cb * 4 + w) * G + g0 + s) * 8, 0], bars.index(s),
                                            wbuf.index(s * 4 + w), pred=s < n_grp)
    view = wbuf._reinterpret(gl.int32, [STAGES, 4, 8, 32, 4], FLAT4)  # [stage, block, chunk, lane, tile]

    # activations [chunk, row, 16 K] in the fragments' K order: K 32 t + 4 q + j of group i is column
    # 2 t + j (j < 2) or 8 + 2 t + j - 2 of chunk 8 i + q; loaded 4 K at a time, summed per group
    LX: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [4, 1, 1, 1], [3, 2, 1, 0])
    xc = _ax4(CH, 0, LX)
    xn = _ax4(16, 1, LX)
    xt = _ax4(4, 2, LX)
    xj = _ax4(4, 3, LX)
    xi = xc // 8
    xs = gl.allocate_shared_memory(DT, [CH, 16, 16], XL)
    sums = gl.allocate_shared_memory(gl.float32, [GPS, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    pdl_wait(USE_PDL)
    xv = gl.load(x_ptr + (xn * stride_xm + (g0 + xi) * 128 + 32 * xt + 4 * (xc % 8) + xj),
                 mask=(xn < M) & (xi < n_grp) & (xj >= 0) & (xt >= 0), other=0.0)  # [CH, 16, 4 t, 4 j]
    xsum = gl.sum(gl.reshape(gl.sum(gl.sum(xv.to(gl.float32), axis=3), axis=2), [GPS, 8, 16]), axis=1)
    sums.store(xsum)
    sums = sums._reinterpret(gl.float32, [GPS, 16], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # rows indexed below
    xk = gl.reshape(gl.permute(gl.reshape(xv, [CH, 16, 4, 2, 2]), (0, 1, 3, 2, 4)), [CH * 16, 16])
    xs._reinterpret(DT, [CH * 16, 16], XL).store(xk)  # (16-row tiles: whole periods of the 32-byte swizzle)
    fence_async_shared()
    gl.thread_barrier()

    srow = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    # int32 scale / zero-point bits of row r's channel: block 4 cb + r // 16, g = r % 8, half (r // 8) % 2
    szp = s_ptr.to(gl.pointer_type(gl.int32)) + ((cb * 4 + srow // 16) * G * 32 + (srow % 8) * 4) * 2 + (srow // 8) % 2
    zero = gl.zeros([64, 16], gl.float32, ACC)
    a0 = zero
    a1 = zero
    a2 = zero
    a3 = zero
    nbits = _group_bits(szp + g0 * 64)
    for i in range(n_grp):
        bits = nbits
        nbits = _group_bits(szp + (g0 + gl.minimum(i + 1, n_grp - 1)) * 64)
        st = i % STAGES
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        v = view.index(st)
        t0, t1, t2, t3 = _chunk_mma(v, xs, i, 0, zero, zero, zero, zero, ASM, F16, DEPTH)
        t0, t1, t2, t3 = _chunk_mma(v, xs, i, 1, t0, t1, t2, t3, ASM, F16, DEPTH)
        t0, t1, t2, t3 = _chunk_mma(v, xs, i, 2, t0, t1, t2, t3, ASM, F16, DEPTH)
        t0, t1, t2, t3 = _chunk_mma(v, xs, i, 3, t0, t1, t2, t3, ASM, F16, DEPTH)
        t0, t1, t2, t3 = _chunk_mma(v, xs, i, 4, t0, t1, t2, t3, ASM, F16, DEPTH)
        t0, t1, t2, t3 = _chunk_mma(v, xs, i, 5, t0, t1, t2, t3, ASM, F16, DEPTH)
        t0, t1, t2, t3 = _chunk_mma(v, xs, i, 6, t0, t1, t2, t3, ASM, F16, DEPTH)
        t0, t1, t2, t3 = _chunk_mma(v, xs, i, 7, t0, t1, t2, t3, ASM, F16, DEPTH)
        gl.thread_barrier()  # every warp has read stage st
        fence_async_shared()
        refill = i + STAGES < n_grp
        mbarrier.expect(bars.index(st), 4 * GROUP_BYTES, pred=refill)
        for w in gl.static_range(4):
            tma.async_copy_global_to_shared(w_desc, [((cb * 4 + w) * G + g0 + i + STAGES) * 8, 0], bars.index(st),
                                            wbuf.index(st * 4 + w), pred=refill)
        t0, t1, t2, t3 = warpgroup_mma_wait(0, deps=[t0, t1, t2, t3])
        xg = gl.expand_dims(sums.index(i).load(gl.SliceLayout(0, ACC)), 0)
        a0 = _scaled(a0, t0, bits[0], xg, BASE)
        a1 = _scaled(a1, t1, bits[1], xg, BASE)
        a2 = _scaled(a2, t2, bits[2], xg, BASE)
        a3 = _scaled(a3, t3, bits[3], xg, BASE)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    if SPLIT_K:
        _store_tile(ws_ptr, a0, 0, cb, sp, M, N, 0, True)
        _store_tile(ws_ptr, a1, 1, cb, sp, M, N, 0, True)
        _store_tile(ws_ptr, a2, 2, cb, sp, M, N, 0, True)
        _store_tile(ws_ptr, a3, 3, cb, sp, M, N, 0, True)
        gl.thread_barrier()  # every thread's partial is written before the release below
        done = gl.atomic_add(cnt_ptr + cb, 1, sem="acq_rel", scope="gpu")
        if done == NSPLIT - 1:
            for c in range(4):  # (a loop at run time: one tile's partials in registers at a time)
                _sum_tile(ws_ptr, y_ptr, c, cb, M, N, stride_ym, NSPLIT)
            gl.atomic_xchg(cnt_ptr + cb, 0, sem="relaxed", scope="gpu")
    else:
        _store_tile(y_ptr, a0, 0, cb, sp, M, N, stride_ym, False)
        _store_tile(y_ptr, a1, 1, cb, sp, M, N, stride_ym, False)
        _store_tile(y_ptr, a2, 2, cb, sp, M, N, stride_ym, False)
        _store_tile(y_ptr, a3, 3, cb, sp, M, N, stride_ym, False)


SMEM_MAX = 200 * 1024  # shared memory one program may take (the H100 / H200 allow 227 KB)
_ASM: dict[bool, str] = {}


def check_config(cfg: dict) -> tuple[int, int, int]:
    """``(STAGES, SPLIT, DEPTH)`` of a MODE 8 config, validated (``ValueError`` naming the key)."""
    stages, split, depth = cfg.get("STAGES", 2), cfg.get("SPLIT", 1), cfg.get("DEPTH", 1)
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 7:
        raise ValueError(f"config: MODE 8's DEPTH (chunks of wgmmas in flight) must be an int in [1, 7], got {depth!r}")
    if not isinstance(stages, int) or isinstance(stages, bool) or not 1 <= stages <= 8:
        raise ValueError(f"config: MODE 8's STAGES (groups in flight per program) must be an int in [1, 8], "
                         f"got {stages!r}")
    if not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise ValueError(f"config: MODE 8's SPLIT (K splits) must be an int >= 1, got {split!r}")
    return stages, split, depth


def launch(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, n: int, cfg: dict, desc=None) -> torch.Tensor:
    """``x [M, K]`` (bf16/fp16, M <= 16, CUDA sm90+) times INT4 fragment words (``triton_frag.pack_int4``:
    ``words [N/64, G, 8, 32, 4]``, ``sz [N/64, G, 8, 4]``) -> ``[M, N]`` in ``x.dtype``. ``cfg``: STAGES (groups
    in flight per program), SPLIT (K splits, clamped to the groups); ``desc``: ``gluon_frag.descriptor(words)``."""
    stages, split, depth = check_config(cfg)
    TF.check_operands(x, "int4", words, n, sz, None, min_arch=9, mode=8)
    blocks, gk = words.shape[0], words.shape[1]
    if blocks % 4:
        raise ValueError(f"words: MODE 8 takes four 64-channel blocks per program; {n} channels make {blocks} blocks")
    m = x.shape[0]
    split = min(split, gk)
    per = triton.cdiv(gk, split)
    split = triton.cdiv(gk, per)
    gps = triton.next_power_of_2(per)
    smem = stages * 4 * 4096 + gps * 8 * 512 + gps * 64
    if smem > SMEM_MAX:
        raise ValueError(f"config: MODE 8 at STAGES={stages} with {per} groups per split needs {smem} bytes of shared "
                         f"memory (> {SMEM_MAX}); raise SPLIT or lower STAGES")
    f16 = x.dtype == torch.float16
    if f16 not in _ASM:
        _ASM[f16] = decode_asm(f16)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = arrival_counters(x.device, blocks // 4) if split > 1 else y
    use_pdl = TF.pdl_enabled(x)
    _wgmma_frag_kernel[(blocks // 4, split)](
        desc if desc is not None else descriptor(words), x, sz, ws, y, cnt,
        m, n, gk, per, x.stride(0), y.stride(0),
        STAGES=stages, GPS=gps, SPLIT_K=split > 1, NSPLIT=split, ASM=_ASM[f16], BASE=1024.0 if f16 else 128.0,
        DEPTH=depth, num_warps=4, **TF.pdl_launch(use_pdl),
    )
    return y
