"""MODE 6: small-M weight-only GEMV/GEMM whose weights are stored as MMA fragments (M <= 16).

Why: the other small-M kernels (``triton_wo`` MODE 4 / 5) are latency-bound well short of the
weight bandwidth. MODE 4 spends ~5 instructions per code on CUDA cores; MODE 5 decodes on the
tensor-core path but its decoded tile goes through shared memory to reach the dot-operand layout.
Here the weights are repacked once so that the 16 bytes a thread loads are *already* its operand
fragments of ``mma.sync.m16n8k16`` (the arrangement Marlin uses), so a loaded word is decoded in
registers and fed to the MMA by inline PTX: no shared memory and no layout conversion in the K loop.

Layout (``pack_int4`` / ``pack_fp8``; ``C`` channel tiles of 16 output channels per program):

* A program owns ``16 C`` output channels (64 for INT4, 32 for FP8) and a range of K steps of 128
  (a *group*: INT4 group sizes are multiples of 128). A group is 8 MMA *chunks* of 16 K.
* Thread ``lane = 4 g + t`` of the warp that handles chunk ``q`` holds, per channel tile, the A
  fragment of channels ``g`` and ``g + 8`` at the chunk's logical K ``2t, 2t+1, 2t+8, 2t+9``:
  one int32 word for INT4 (8 nibbles: pair ``j`` = nibbles ``j``, ``j + 4`` = register ``a_j``), one
  int64 for FP8 (8 bytes). Words are ordered ``[channel block, group, chunk, lane, tile]``, so a
  program's iteration reads one contiguous block and each thread one 16-byte vector.
* Within a group, chunk ``q``'s logical K ``{2t, 2t+1, 2t+8, 2t+9}`` sits at physical K
  ``32 t + 4 q + {0, 1, 2, 3}``: lane ``(g, t)``'s activations for all 8 chunks are the 32
  consecutive values ``x[g, 128 grp + 32 t : + 32]``, so its B fragment is one 8-byte load.

Decode (two codes per instruction, exact): INT4 ``((w >> 4j) & 0x000F000F) | MAGIC`` is
``B + q`` (B = 128 in bf16, 1024 in fp16) in both halves; a packed 16-bit FMA with ``-(B + z)``
leaves ``q - z`` exactly, and the group scale (fp32, carrying z in its 4 low mantissa bits: one
8-byte word per lane for channels g and g + 8) is applied per chunk by 4 FMAs. FP8 e4m3: the
byte's sign to bit 15 and its other 7 bits under the 16-bit float's exponent LSB (the value times
2**-120 in bf16, 2**-8 in fp16, folded into the scale), accumulated straight into the MMA's C;
per-channel scales apply once at the end, 128x128 block scales per chunk. No FP8 instruction is
used, so the FP8 path runs on sm80 too.

The K loop keeps ``DEPTH`` (1 or 2) iterations of loads in flight in loop-carried registers (ptxas
sinks a one-ahead prefetch to the end of the loop body, hence DEPTH 2); DEPTH 3 is DEPTH 2 unrolled three
ways, without the register moves that rotate the two sets at the loop's end (-16% instructions, +36
registers: it wins under a ``MAXNREG`` 128 cap on the INT4 MLP shapes at M=1, 2-5%,
results/h200/sweeps/probe_frag_depth.json). With PDL the weights and scales
of those first DEPTH iterations are loaded before waiting for the previous kernel (``PREWAIT``; the
activations after it): W4A16 batch-1 step 2.758 -> 2.722 ms
(results/h200/sweeps/probe_bs1_mode6_prewait.json). Triton stages loads that feed
no ``tl.dot`` through shared memory (cp.async) only when the loop names ``num_stages``
(``tl.range(..., num_stages=S)``); that variant, 2-5 iterations in flight, measured slower than this
one on every Llama-8B shape, INT4 and FP8, M = 1 / 4 / 16 (commit fccaab0,
results/h200/sweeps/sweep_frag_pipe_{int4,fp8}.json), as did MODE 4 staged the same way. The warps
of a program take different chunks (K), so their partial sums are added once at the end; split-K
programs land fp32 partials in a workspace that the last program of each channel block sums (one
launch). ``ACT`` fuses the gated activation of a merged ``[gate; up]`` weight: the repack
puts gate rows in the first half of each program's channel tiles and the matching up rows in the
second, so both halves of an output meet in one thread.

Measured on the H200 (docs/quantization.md, results/h200/quant_wo_mode6_one_mma.json): faster than
MODEs 4 / 5 for INT4 at M <= 4 on the 8B MLP and qkv shapes and on the merged gate_up up to M = 16
(dispatched by ``triton_wo.MODE6_TUNED``), slower for FP8, at M = 16 elsewhere and on 4096x4096.

``_frag_kernel`` with ``WN`` (config ``"WN": 1``) is the same computation with the warps splitting N instead of
K: each warp owns a channel block and every chunk of its K range, so there is no cross-warp sum and
each warp stores its own outputs or split-K partials (the split grows by the warp count instead);
an iteration's REPS words then share one group, so one ``int4_asm(words=REPS)`` call chains their
MMAs. INT4 14336x4096 M=1 14.0 us (15.2 with two MMAs per word, 19.1 with the warps splitting K;
results/h200/quant_wo_dispatch.json); dispatched where it won.

The kernel is GPU-only (inline PTX; sm80+). ``emulate`` replays the fragment arithmetic in torch
(the PTX fragment tables written out independently of the packers) so the CPU tests check the
layouts bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..devices import capability
from ..ops.linear.triton import ACTIVATIONS, _act_mul
from ..ops.pdl import GEMV_PREWAIT, pdl_enabled, pdl_launch, pdl_release, pdl_wait
from ._splitk import arrival_counters
from .repacks import _PACKS, packed  # noqa: F401 (the repack cache, shared with the CPU path)

KSTEP = 128  # K per group step: 8 chunks of 16
MAX_M = 16


# ----------------------------------------------------------------------------------------------
# Inline PTX, generated per variant (the strings are constexpr arguments of the kernel)
# ----------------------------------------------------------------------------------------------


def _mma(dtype: str, d: str, a: str, b: str, c: str) -> str:
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32 {{{d}}}, {{{a}}}, {{{b}}}, {{{c}}};"


def _ops(first: int, n: int) -> list[str]:
    return [f"${i}" for i in range(first, first + n)]


def int4_asm(nb: int, f16: bool, words: int = 1) -> tuple[str, str]:
    """INT4 step for ``words`` words of one group (the same scales): operands
    ``acc'[4 nb] <- (w[words], sz, x[words * nb], acc[4 nb], zero)``.

    ``w`` b32 words; ``sz`` b64: the fp32 scales of channels g (low half) and g + 8 (high half), each
    carrying its zero point in the 4 low mantissa bits (a relative change below 2**-19); ``x`` b64 per
    word and B fragment (word-major; rows g, g + 8 of x); ``zero`` an fp32 0. The zero point is
    subtracted from the decoded pairs in 16-bit float, exactly: ``fma(B + q, 1, -(B + z)) = q - z``
    (|q - z| <= 15), one packed instruction per register, so each B fragment takes one MMA. (It used
    to be a second MMA with the constant A fragment ``-(B + z)``: twice the tensor-core work.) The
    words' MMAs chain in one fp32 accumulator, so the group scale costs 4 FMAs per B fragment per
    call, not per word."""
    ty = "f16" if f16 else "bf16"
    magic = "0x64006400" if f16 else "0x43004300"
    neg = "0xE400E400" if f16 else "0xC300C300"  # -(B + z): B's pattern with the sign set, z below
    one = "0x3C003C00" if f16 else "0x3F803F80"
    n_out = 4 * nb
    ws = _ops(n_out, words)
    sz = f"${n_out + words}"
    xs = _ops(n_out + words + 1, words * nb)
    acc = _ops(n_out + words + 1 + words * nb, n_out)
    zero = f"${n_out + words + 1 + words * nb + n_out}"
    lines = [
        "{",
        ".reg .b32 a0, a1, a2, a3, t, z0, z1, s0, s1, b0, b1, one;",
        ".reg .f32 d0, d1, d2, d3, d4, d5, d6, d7, f0, f1;",
        f"mov.b64 {{s0, s1}}, {sz};",
        "mov.b32 f0, s0;",
        "mov.b32 f1, s1;",
        f"mov.b32 one, {one};",
        "prmt.b32 t, s0, 0, 0x4040;",
        f"lop3.b32 z0, t, 0x000F000F, {neg}, 0xEA;",
        "prmt.b32 t, s1, 0, 0x4040;",
        f"lop3.b32 z1, t, 0x000F000F, {neg}, 0xEA;",
    ]
    for r, w in enumerate(ws):
        for j in range(4):  # a0, a2: channel g (zero point z0); a1, a3: channel g + 8 (z1)
            src = w if j == 0 else "t"
            if j:
                lines.append(f"shr.u32 t, {w}, {4 * j};")
            lines += [f"lop3.b32 a{j}, {src}, 0x000F000F, {magic}, 0xEA;",
                      f"fma.rn.{ty}x2 a{j}, a{j}, one, z{j % 2};"]
        for i in range(nb):
            d = ", ".join(f"d{4 * i + k}" for k in range(4))
            c = f"{zero}, {zero}, {zero}, {zero}" if r == 0 else d
            lines += [f"mov.b64 {{b0, b1}}, {xs[r * nb + i]};", _mma(ty, d, "a0, a1, a2, a3", "b0, b1", c)]
    for o in range(n_out):  # rows g (c0, c1) use the scale of channel g, rows g + 8 (c2, c3) g + 8's
        lines.append(f"fma.rn.f32 ${o}, d{o}, f{(o % 4) // 2}, {acc[o]};")
    lines.append("}")
    cons = ",".join(["=f"] * n_out + ["r"] * words + ["l"] + ["l"] * (words * nb) + ["f"] * n_out + ["f"])
    return "\n".join(lines), cons


def fp8_asm(nb: int, f16: bool, block_scale: bool) -> tuple[str, str]:
    """FP8 step for one int64 (8 e4m3 codes): ``acc'[4 nb] <- (w, x[nb], acc[4 nb][, sb, zero])``;
    with ``block_scale`` the chunk's product is scaled by ``sb`` (fp32) before it is accumulated."""
    ty = "f16" if f16 else "bf16"
    # the 7 exponent/mantissa bits: under bf16's exponent LSB (bit 4) or fp16's (bit 7)
    shift, field = ("1", "0x3F803F80") if f16 else ("4", "0x07F007F0")
    n_out = 4 * nb
    w = f"${n_out}"
    xs = _ops(n_out + 1, nb)
    acc = _ops(n_out + 1 + nb, n_out)
    lines = [
        "{",
        ".reg .b32 w0, w1, t, u, a0, a1, a2, a3, b0, b1, b2, b3;",
        ".reg .f32 d0, d1, d2, d3, d4, d5, d6, d7;",
        f"mov.b64 {{w0, w1}}, {w};",
    ]
    for h in (0, 1):  # word h -> a[2h] (bytes 0, 2: channel g) and a[2h + 1] (bytes 1, 3: channel g + 8)
        lines += [
            f"shl.b32 t, w{h}, 8;",
            f"shr.u32 u, t, {shift};",
            f"and.b32 u, u, {field};",
            f"lop3.b32 a{2 * h}, t, 0x80008000, u, 0xEA;",
            f"shr.u32 u, w{h}, {shift};",
            f"and.b32 u, u, {field};",
            f"lop3.b32 a{2 * h + 1}, w{h}, 0x80008000, u, 0xEA;",
        ]
    if block_scale:
        sb, zero = f"${n_out + 1 + nb + n_out}", f"${n_out + 2 + nb + n_out}"
    for i in range(nb):
        lines.append(f"mov.b64 {{b{2 * i}, b{2 * i + 1}}}, {xs[i]};")
        outs = ", ".join(f"${4 * i + r}" for r in range(4))
        accs = ", ".join(acc[4 * i:4 * i + 4])
        if block_scale:
            d = ", ".join(f"d{4 * i + r}" for r in range(4))
            lines.append(_mma(ty, d, "a0, a1, a2, a3", f"b{2 * i}, b{2 * i + 1}", f"{zero}, {zero}, {zero}, {zero}"))
            for r in range(4):
                lines.append(f"fma.rn.f32 ${4 * i + r}, d{4 * i + r}, {sb}, {acc[4 * i + r]};")
        else:
            lines.append(_mma(ty, outs, "a0, a1, a2, a3", f"b{2 * i}, b{2 * i + 1}", accs))
    lines.append("}")
    cons = ["=f"] * n_out + ["l"] + ["l"] * nb + ["f"] * n_out + (["f", "f"] if block_scale else [])
    return "\n".join(lines), ",".join(cons)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _x_frag(x8, xrow, grp, q, xmask):
    """The B fragment (4 activations as one int64) of chunk ``q`` of group ``grp`` per thread row."""
    return tl.load(x8 + (xrow + grp * 32 + q), mask=xmask, other=0)[:, None]


@triton.jit
def _frag_iter_loads(wp, it, pb, G, offs_r, offs_c, warp, x8, xrow, xmask, xrow2, xmask2, sz_rows, s_ptr, zero,
                     FP8: tl.constexpr, BSCALE: tl.constexpr, NB: tl.constexpr, R: tl.constexpr, CT: tl.constexpr,
                     WARPS: tl.constexpr, REPS: tl.constexpr, GPI: tl.constexpr, LOAD_W: tl.constexpr = True,
                     LOAD_X: tl.constexpr = True):
    """The loads of iteration ``it`` (issued one iteration ahead): the words ``[R, CT]`` of up to 4
    repetitions (repetition r holds chunk ``r * WARPS + warp``) with their B fragments (x rows g, and
    g + 8 when NB == 2), and the scales of its (up to 2) groups: INT4 scale / zero-point words, FP8
    128x128 block scales (else ``zero``). Slots a smaller REPS does not use repeat the first (dead
    values the compiler drops). ``LOAD_W`` / ``LOAD_X`` False: the weights and scales / the activations
    are left out (zeros, for a caller that loads the two parts on either side of the PDL wait)."""
    base = wp + it * (GPI * 8 * 32 * CT)
    w0, xa0, xb0 = _frag_load(base, 0, offs_r, offs_c, warp, it, x8, xrow, xmask, xrow2, xmask2, NB, R, CT, WARPS, GPI,
                              LOAD_W, LOAD_X)
    w1, xa1, xb1 = w0, xa0, xb0
    w2, xa2, xb2 = w0, xa0, xb0
    w3, xa3, xb3 = w0, xa0, xb0
    if REPS > 1:
        w1, xa1, xb1 = _frag_load(base, 1, offs_r, offs_c, warp, it, x8, xrow, xmask, xrow2, xmask2, NB, R, CT,
                                  WARPS, GPI, LOAD_W, LOAD_X)
    if REPS > 2:
        w2, xa2, xb2 = _frag_load(base, 2, offs_r, offs_c, warp, it, x8, xrow, xmask, xrow2, xmask2, NB, R, CT,
                                  WARPS, GPI, LOAD_W, LOAD_X)
        w3, xa3, xb3 = _frag_load(base, 3, offs_r, offs_c, warp, it, x8, xrow, xmask, xrow2, xmask2, NB, R, CT,
                                  WARPS, GPI, LOAD_W, LOAD_X)
    if FP8:
        if BSCALE and LOAD_W:
            s0 = tl.load(s_ptr + (pb * G + it * GPI) * CT + offs_c)[None, :] + zero
            s1 = tl.load(s_ptr + (pb * G + it * GPI + (GPI - 1)) * CT + offs_c)[None, :] + zero
        else:
            s0 = zero
            s1 = zero
    else:
        sz = s_ptr.to(tl.pointer_type(tl.int64)) + sz_rows + (it * GPI) * (8 * CT)
        if LOAD_W:
            s0 = tl.load(sz)
            if GPI > 1:
                s1 = tl.load(sz + 8 * CT)
            else:
                s1 = s0
        else:
            s0 = tl.zeros(sz.shape, dtype=tl.int64)
            s1 = s0
    return w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, s0, s1


@triton.jit
def _frag_load(base, rep: tl.constexpr, offs_r, offs_c, warp, it, x8, xrow, xmask, xrow2, xmask2, NB: tl.constexpr,
               R: tl.constexpr, CT: tl.constexpr, WARPS: tl.constexpr, GPI: tl.constexpr, LOAD_W: tl.constexpr,
               LOAD_X: tl.constexpr):
    grp = it * GPI + rep * WARPS // 8
    q = (rep * WARPS + warp) % 8
    ptrs = base + (rep * R + offs_r)[:, None] * CT + offs_c[None, :]
    if LOAD_W:
        w = tl.load(ptrs, eviction_policy="evict_first")
    else:
        w = tl.zeros(ptrs.shape, dtype=base.dtype.element_ty)
    if LOAD_X:
        xa = _x_frag(x8, xrow, grp, q, xmask)
        xb = xa
        if NB == 2:
            xb = _x_frag(x8, xrow2, grp, q, xmask2)
    else:
        xa = tl.zeros([R, 1], dtype=tl.int64)
        xb = xa
    return w, xa, xb


@triton.jit
def _frag_iter_mma(w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, s0, s1, a0, a1, a2, a3, a4, a5, a6, a7, zero,
                   FP8: tl.constexpr, BSCALE: tl.constexpr, NB: tl.constexpr, WARPS: tl.constexpr,
                   REPS: tl.constexpr, ASM: tl.constexpr, CONS: tl.constexpr, CHAIN: tl.constexpr = False):
    """The MMAs of one iteration's repetitions (repetition r is in group ``r * WARPS // 8`` of it).
    ``CHAIN`` (INT4, warps splitting N: every repetition in one group): one asm call for all of them
    (``int4_asm(words=REPS)``), whose MMAs chain before the group scale is applied once."""
    if CHAIN:
        return _chain_step(w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, s0, a0, a1, a2, a3, a4, a5, a6, a7,
                           zero, NB, REPS, ASM, CONS)
    a0, a1, a2, a3, a4, a5, a6, a7 = _frag_step(w0, s0, xa0, xb0, a0, a1, a2, a3, a4, a5, a6, a7, zero, FP8, BSCALE,
                                                NB, ASM, CONS)
    if REPS > 1:
        a0, a1, a2, a3, a4, a5, a6, a7 = _frag_step(w1, s0 if WARPS < 8 else s1, xa1, xb1, a0, a1, a2, a3, a4, a5,
                                                    a6, a7, zero, FP8, BSCALE, NB, ASM, CONS)
    if REPS > 2:
        a0, a1, a2, a3, a4, a5, a6, a7 = _frag_step(w2, s1, xa2, xb2, a0, a1, a2, a3, a4, a5, a6, a7, zero, FP8,
                                                    BSCALE, NB, ASM, CONS)
        a0, a1, a2, a3, a4, a5, a6, a7 = _frag_step(w3, s1, xa3, xb3, a0, a1, a2, a3, a4, a5, a6, a7, zero, FP8,
                                                    BSCALE, NB, ASM, CONS)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _chain_step(w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, s, a0, a1, a2, a3, a4, a5, a6, a7, zero,
                NB: tl.constexpr, REPS: tl.constexpr, ASM: tl.constexpr, CONS: tl.constexpr):
    """INT4 repetitions of one group through one ``int4_asm(nb, f16, REPS)`` call (REPS 2 or 4)."""
    if NB == 1:
        if REPS == 2:
            a0, a1, a2, a3 = tl.inline_asm_elementwise(ASM, CONS, [w0, w1, s, xa0, xa1, a0, a1, a2, a3, zero],
                                                       dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        else:
            a0, a1, a2, a3 = tl.inline_asm_elementwise(
                ASM, CONS, [w0, w1, w2, w3, s, xa0, xa1, xa2, xa3, a0, a1, a2, a3, zero], dtype=(tl.float32,) * 4,
                is_pure=True, pack=1)
    else:
        if REPS == 2:
            a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                ASM, CONS, [w0, w1, s, xa0, xb0, xa1, xb1, a0, a1, a2, a3, a4, a5, a6, a7, zero],
                dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                ASM, CONS, [w0, w1, w2, w3, s, xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3, a0, a1, a2, a3, a4, a5, a6, a7,
                            zero], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _frag_step(w, s, xa, xb, a0, a1, a2, a3, a4, a5, a6, a7, zero, FP8: tl.constexpr, BSCALE: tl.constexpr,
               NB: tl.constexpr, ASM: tl.constexpr, CONS: tl.constexpr):
    """One repetition's MMAs into the accumulators (``s``: the INT4 scale / zero-point words or the FP8
    block scale of the repetition's group)."""
    if FP8:
        if NB == 1:
            if BSCALE:
                a0, a1, a2, a3 = tl.inline_asm_elementwise(ASM, CONS, [w, xa, a0, a1, a2, a3, s, zero],
                                                           dtype=(tl.float32,) * 4, is_pure=True, pack=1)
            else:
                a0, a1, a2, a3 = tl.inline_asm_elementwise(ASM, CONS, [w, xa, a0, a1, a2, a3],
                                                           dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        else:
            if BSCALE:
                a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                    ASM, CONS, [w, xa, xb, a0, a1, a2, a3, a4, a5, a6, a7, s, zero], dtype=(tl.float32,) * 8,
                    is_pure=True, pack=1)
            else:
                a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                    ASM, CONS, [w, xa, xb, a0, a1, a2, a3, a4, a5, a6, a7], dtype=(tl.float32,) * 8,
                    is_pure=True, pack=1)
    else:
        if NB == 1:
            a0, a1, a2, a3 = tl.inline_asm_elementwise(ASM, CONS, [w, s, xa, a0, a1, a2, a3, zero],
                                                       dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                ASM, CONS, [w, s, xa, xb, a0, a1, a2, a3, a4, a5, a6, a7, zero], dtype=(tl.float32,) * 8,
                is_pure=True, pack=1)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _lane_sum(a, WARPS: tl.constexpr, CT: tl.constexpr):
    """``[32 WARPS, CT]`` -> ``[32, CT]``: the warps' partial sums (they took different chunks)."""
    return tl.sum(tl.reshape(a, [WARPS, 32, CT]), axis=0)


@triton.jit
def _out_rows(j: tl.constexpr, blk, g, t, offs_c, CT: tl.constexpr):
    """Batch rows ``m [P, 1]`` and output channels ``n [P, CT]`` of accumulator ``j`` (``[P, CT]``): rows
    ``2t + j % 2 (+ 8 for j >= 4)``, channels ``16 c + g (+ 8 for j % 4 >= 2)`` of each row's channel
    block ``blk [P]`` (``16 CT`` channels)."""
    m = (2 * t + (j % 2) + 8 * (j // 4))[:, None]
    n = blk[:, None] * (16 * CT) + 16 * offs_c[None, :] + (g + 8 * ((j % 4) // 2))[:, None]
    return m, n


@triton.jit
def _acc_out(y_ptr, ws_ptr, a, j: tl.constexpr, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT: tl.constexpr,
             TO_WS: tl.constexpr, FP8_CHANNEL: tl.constexpr, FOLD: tl.constexpr):
    """Store accumulator ``j`` to split ``sp``'s workspace (fp32 ``[split, M, N]``) or, scaled, to ``y``."""
    m, n = _out_rows(j, blk, g, t, offs_c, CT)
    mask = (m < M) & (n < N)
    if TO_WS:
        tl.store(ws_ptr + sp.to(tl.int64) * M * N + m * N + n, a, mask=mask)
    else:
        if FP8_CHANNEL:
            a = a * tl.load(scale_ptr + n, mask=mask, other=0.0)
        tl.store(y_ptr + m * stride_ym + n, (a * FOLD).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _accs_out(y_ptr, ws_ptr, a0, a1, a2, a3, a4, a5, a6, a7, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr,
              CT: tl.constexpr, NB: tl.constexpr, TO_WS: tl.constexpr, FP8_CHANNEL: tl.constexpr, FOLD: tl.constexpr):
    """``_acc_out`` of every accumulator in use (``a4 .. a7``: the second B fragment, NB == 2)."""
    _acc_out(y_ptr, ws_ptr, a0, 0, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT, TO_WS, FP8_CHANNEL, FOLD)
    _acc_out(y_ptr, ws_ptr, a1, 1, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT, TO_WS, FP8_CHANNEL, FOLD)
    _acc_out(y_ptr, ws_ptr, a2, 2, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT, TO_WS, FP8_CHANNEL, FOLD)
    _acc_out(y_ptr, ws_ptr, a3, 3, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT, TO_WS, FP8_CHANNEL, FOLD)
    if NB == 2:
        _acc_out(y_ptr, ws_ptr, a4, 4, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT, TO_WS, FP8_CHANNEL, FOLD)
        _acc_out(y_ptr, ws_ptr, a5, 5, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT, TO_WS, FP8_CHANNEL, FOLD)
        _acc_out(y_ptr, ws_ptr, a6, 6, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT, TO_WS, FP8_CHANNEL, FOLD)
        _acc_out(y_ptr, ws_ptr, a7, 7, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr, CT, TO_WS, FP8_CHANNEL, FOLD)


@triton.jit
def _acc_load(ws_ptr, j: tl.constexpr, blk, NSPLIT: tl.constexpr, M, N, g, t, offs_c, P: tl.constexpr,
              CT: tl.constexpr):
    """The ``NSPLIT`` splits' partials of accumulator ``j`` summed; the loop is unrolled so that every load is in
    flight at once (a loop over a run-time count waits for each before the next: one L2 round trip per split)."""
    m, n = _out_rows(j, blk, g, t, offs_c, CT)
    mask = (m < M) & (n < N)
    tot = tl.zeros([P, CT], dtype=tl.float32)
    for s in tl.static_range(NSPLIT):
        tot += tl.load(ws_ptr + s * M * N + m * N + n, mask=mask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def _acc_total(tot, y_ptr, j: tl.constexpr, blk, M, N, stride_ym, g, t, offs_c, scale_ptr, P: tl.constexpr,
               CT: tl.constexpr, FP8_CHANNEL: tl.constexpr, FOLD: tl.constexpr, ACT: tl.constexpr):
    """Accumulator ``j``'s total (``_acc_load``) scaled and stored (with the gated epilogue: tiles ``c < CT/2``
    of a channel block hold gate rows, ``c + CT/2`` the matching up rows, ``_act_rows``, so output channel
    ``8 CT blk + 16 c + row`` is ``act(gate) * up``)."""
    m, n = _out_rows(j, blk, g, t, offs_c, CT)
    mask = (m < M) & (n < N)
    if FP8_CHANNEL:
        tot = tot * tl.load(scale_ptr + n, mask=mask, other=0.0)
    tot = tot * FOLD
    if ACT != 0:
        ga, ua = tl.split(tl.permute(tl.reshape(tot, [P, 2, CT // 2]), (0, 2, 1)))
        o = blk[:, None] * (8 * CT) + 16 * tl.arange(0, CT // 2)[None, :] + (g + 8 * ((j % 4) // 2))[:, None]
        out = _act_mul(ga, ua, y_ptr, ACT)
        tl.store(y_ptr + m * stride_ym + o, out.to(y_ptr.dtype.element_ty), mask=(m < M) & (o < N // 2))
    else:
        tl.store(y_ptr + m * stride_ym + n, tot.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _acc_four(y_ptr, ws_ptr, j0: tl.constexpr, blk, NSPLIT: tl.constexpr, M, N, stride_ym, g, t, offs_c, scale_ptr,
              P: tl.constexpr, CT: tl.constexpr, FP8_CHANNEL: tl.constexpr, FOLD: tl.constexpr, ACT: tl.constexpr):
    """Accumulators ``j0 .. j0 + 3`` finished: all their partials loaded first, then stored."""
    t0 = _acc_load(ws_ptr, j0, blk, NSPLIT, M, N, g, t, offs_c, P, CT)
    t1 = _acc_load(ws_ptr, j0 + 1, blk, NSPLIT, M, N, g, t, offs_c, P, CT)
    t2 = _acc_load(ws_ptr, j0 + 2, blk, NSPLIT, M, N, g, t, offs_c, P, CT)
    t3 = _acc_load(ws_ptr, j0 + 3, blk, NSPLIT, M, N, g, t, offs_c, P, CT)
    _acc_total(t0, y_ptr, j0, blk, M, N, stride_ym, g, t, offs_c, scale_ptr, P, CT, FP8_CHANNEL, FOLD, ACT)
    _acc_total(t1, y_ptr, j0 + 1, blk, M, N, stride_ym, g, t, offs_c, scale_ptr, P, CT, FP8_CHANNEL, FOLD, ACT)
    _acc_total(t2, y_ptr, j0 + 2, blk, M, N, stride_ym, g, t, offs_c, scale_ptr, P, CT, FP8_CHANNEL, FOLD, ACT)
    _acc_total(t3, y_ptr, j0 + 3, blk, M, N, stride_ym, g, t, offs_c, scale_ptr, P, CT, FP8_CHANNEL, FOLD, ACT)


@triton.jit
def _split_k_last(cnt_ptr, tile, SPLIT_K: tl.constexpr, NSPLIT: tl.constexpr):
    """Once this program's partials are written: whether it is the last of ``tile``'s ``NSPLIT`` split-K
    programs to arrive (the one that sums them; it resets the counter after)."""
    tl.debug_barrier()  # every thread's partial is written before the release below
    if SPLIT_K:
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    else:
        done = NSPLIT - 1
    return done == NSPLIT - 1


@triton.jit
def _epilogue(y_ptr, ws_ptr, cnt_ptr, a0, a1, a2, a3, a4, a5, a6, a7, tile, blk, sp, M, N, stride_ym, g, t, offs_c,
              scale_ptr, P: tl.constexpr, CT: tl.constexpr, NB: tl.constexpr, SPLIT_K: tl.constexpr, ACT: tl.constexpr,
              FP8_CHANNEL: tl.constexpr, FOLD: tl.constexpr, NSPLIT: tl.constexpr):
    """The accumulators ``[P, CT]`` (rows ``g``, ``t``, channel blocks ``blk``) to ``y``: straight, or (split-K,
    or the gated activation) through the workspace, the tile's last program adding them up."""
    if ACT == 0 and not SPLIT_K:
        _accs_out(y_ptr, ws_ptr, a0, a1, a2, a3, a4, a5, a6, a7, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr,
                  CT, NB, False, FP8_CHANNEL, FOLD)
    else:
        _accs_out(y_ptr, ws_ptr, a0, a1, a2, a3, a4, a5, a6, a7, blk, sp, M, N, stride_ym, g, t, offs_c, scale_ptr,
                  CT, NB, True, False, 1.0)
        if _split_k_last(cnt_ptr, tile, SPLIT_K, NSPLIT):
            _acc_four(y_ptr, ws_ptr, 0, blk, NSPLIT, M, N, stride_ym, g, t, offs_c, scale_ptr, P, CT, FP8_CHANNEL,
                      FOLD, ACT)
            if NB == 2:
                _acc_four(y_ptr, ws_ptr, 4, blk, NSPLIT, M, N, stride_ym, g, t, offs_c, scale_ptr, P, CT, FP8_CHANNEL,
                          FOLD, ACT)
            if SPLIT_K:  # ready for the next launch (graph replays too); the launch's end publishes it
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _k_loads(WN: tl.constexpr, wp, it, pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask, xrow2, xmask2, sz_rows,
             s_ptr, zero, FP8: tl.constexpr, BSCALE: tl.constexpr, NB: tl.constexpr, R: tl.constexpr,
             CT: tl.constexpr, WARPS: tl.constexpr, REPS: tl.constexpr, GPI: tl.constexpr, LOAD_W: tl.constexpr,
             LOAD_X: tl.constexpr):
    """Iteration ``it``'s loads in either kernel's layout; the WN layout's one scale word stands for both."""
    if WN:
        (w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, sc) = _wn_loads(
            wp, it * REPS, G, warp, lane, offs_c, x8, xrow, xmask, xrow2, xmask2, sz_rows, s_ptr, zero, FP8, BSCALE,
            NB, CT, REPS, LOAD_W, LOAD_X)
        return w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, sc, sc
    else:
        return _frag_iter_loads(wp, it, pb, G, offs_r, offs_c, warp, x8, xrow, xmask, xrow2, xmask2, sz_rows, s_ptr,
                                zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, LOAD_W, LOAD_X)


@triton.jit
def _set_mma(st, acc, zero, FP8: tl.constexpr, BSCALE: tl.constexpr, NB: tl.constexpr, WARPS: tl.constexpr,
             REPS: tl.constexpr, ASM: tl.constexpr, CONS: tl.constexpr, CHAIN: tl.constexpr):
    """``_frag_iter_mma`` of one iteration's load set ``st`` (the 14 values ``_k_loads`` returns) into the
    accumulators ``acc`` (a0 .. a7), as tuples."""
    return _frag_iter_mma(st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7], st[8], st[9], st[10], st[11],
                          st[12], st[13], acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], zero, FP8,
                          BSCALE, NB, WARPS, REPS, ASM, CONS, CHAIN)


@triton.jit
def _k_loop(WN: tl.constexpr, wp, pb, G, it0, it1, n_iters, offs_r, offs_c, warp, lane, x8, xrow, xmask, xrow2, xmask2,
            sz_rows, s_ptr, zero, FP8: tl.constexpr, BSCALE: tl.constexpr, NB: tl.constexpr, R: tl.constexpr,
            CT: tl.constexpr, WARPS: tl.constexpr, REPS: tl.constexpr, GPI: tl.constexpr, ASM: tl.constexpr,
            CONS: tl.constexpr, DEPTH: tl.constexpr, USE_PDL: tl.constexpr, PREWAIT: tl.constexpr):
    """Both kernels' K loop over iterations ``[it0, it1)``: the accumulators ``a0 .. a7`` (``[R, CT]``)."""
    a0 = tl.zeros([R, CT], dtype=tl.float32)
    a1 = tl.zeros([R, CT], dtype=tl.float32)
    a2 = tl.zeros([R, CT], dtype=tl.float32)
    a3 = tl.zeros([R, CT], dtype=tl.float32)
    a4 = tl.zeros([R, CT], dtype=tl.float32)
    a5 = tl.zeros([R, CT], dtype=tl.float32)
    a6 = tl.zeros([R, CT], dtype=tl.float32)
    a7 = tl.zeros([R, CT], dtype=tl.float32)
    # Software pipeline by hand: the loads of iterations it + 1 .. it + DEPTH are issued before iteration
    # it's MMAs (loop-carried registers), so each warp keeps DEPTH iterations in flight while it decodes.
    # (Staging them through shared memory with tl.range(num_stages) measured slower: see the module doc.)
    # PREWAIT (with PDL): the first DEPTH iterations' weights and scales are loaded before the wait (no
    # kernel of the step writes them), their activations after it.
    if not PREWAIT:
        pdl_wait(USE_PDL)
    (w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, s0, s1) = _k_loads(
        WN, wp, tl.minimum(it0, n_iters - 1), pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask, xrow2, xmask2,
        sz_rows, s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, True, not PREWAIT)
    # the set after it (DEPTH 2); with DEPTH 1 a copy of the first, never read
    (n0, n1, n2, n3, na0, na1, na2, na3, nb0, nb1, nb2, nb3, ns0, ns1) = (
        w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, s0, s1)
    if DEPTH >= 2:
        (n0, n1, n2, n3, na0, na1, na2, na3, nb0, nb1, nb2, nb3, ns0, ns1) = _k_loads(
            WN, wp, tl.minimum(it0 + 1, n_iters - 1), pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask, xrow2,
            xmask2, sz_rows, s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, True, not PREWAIT)
    if PREWAIT:
        pdl_wait(USE_PDL)
        (t0, t1, t2, t3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, t4, t5) = _k_loads(
            WN, wp, tl.minimum(it0, n_iters - 1), pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask, xrow2, xmask2,
            sz_rows, s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, False, True)
        (na0, na1, na2, na3, nb0, nb1, nb2, nb3) = (xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3)
        if DEPTH >= 2:
            (t0, t1, t2, t3, na0, na1, na2, na3, nb0, nb1, nb2, nb3, t4, t5) = _k_loads(
                WN, wp, tl.minimum(it0 + 1, n_iters - 1), pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask, xrow2,
                xmask2, sz_rows, s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, False, True)
    if DEPTH == 3:
        # DEPTH 2's pipeline unrolled three ways: set C is loaded before A's MMAs, A's registers take
        # iteration it + 3 once A is consumed, B's it + 4: two iterations stay in flight and nothing is
        # copied back at the loop's end (the two-set rotation below costs ~64 register moves per iteration).
        sa = (w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, s0, s1)
        sb = (n0, n1, n2, n3, na0, na1, na2, na3, nb0, nb1, nb2, nb3, ns0, ns1)
        acc = (a0, a1, a2, a3, a4, a5, a6, a7)
        for it in range(it0, it1, 3):
            sc = _k_loads(WN, wp, tl.minimum(it + 2, it1 - 1), pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask,
                          xrow2, xmask2, sz_rows, s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, True, True)
            acc = _set_mma(sa, acc, zero, FP8, BSCALE, NB, WARPS, REPS, ASM, CONS, WN and not FP8 and REPS > 1)
            sa = _k_loads(WN, wp, tl.minimum(it + 3, it1 - 1), pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask,
                          xrow2, xmask2, sz_rows, s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, True, True)
            if it + 1 < it1:
                acc = _set_mma(sb, acc, zero, FP8, BSCALE, NB, WARPS, REPS, ASM, CONS, WN and not FP8 and REPS > 1)
            sb = _k_loads(WN, wp, tl.minimum(it + 4, it1 - 1), pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask,
                          xrow2, xmask2, sz_rows, s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, True, True)
            if it + 2 < it1:
                acc = _set_mma(sc, acc, zero, FP8, BSCALE, NB, WARPS, REPS, ASM, CONS, WN and not FP8 and REPS > 1)
        return acc
    for it in range(it0, it1):
        (m0, m1, m2, m3, ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3, ms0, ms1) = _k_loads(
            WN, wp, tl.minimum(it + DEPTH, it1 - 1), pb, G, offs_r, offs_c, warp, lane, x8, xrow, xmask, xrow2,
            xmask2, sz_rows, s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, True, True)
        a0, a1, a2, a3, a4, a5, a6, a7 = _frag_iter_mma(
            w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, s0, s1, a0, a1, a2, a3, a4, a5, a6, a7, zero,
            FP8, BSCALE, NB, WARPS, REPS, ASM, CONS, WN and not FP8 and REPS > 1)
        if DEPTH == 2:  # rotate: the next set becomes current, the one just issued becomes next
            w0, w1, w2, w3, xa0, xa1, xa2, xa3 = n0, n1, n2, n3, na0, na1, na2, na3
            xb0, xb1, xb2, xb3, s0, s1 = nb0, nb1, nb2, nb3, ns0, ns1
            n0, n1, n2, n3, na0, na1, na2, na3 = m0, m1, m2, m3, ma0, ma1, ma2, ma3
            nb0, nb1, nb2, nb3, ns0, ns1 = mb0, mb1, mb2, mb3, ms0, ms1
        else:
            w0, w1, w2, w3, xa0, xa1, xa2, xa3 = m0, m1, m2, m3, ma0, ma1, ma2, ma3
            xb0, xb1, xb2, xb3, s0, s1 = mb0, mb1, mb2, mb3, ms0, ms1
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _frag_kernel(
    x_ptr, qw_ptr, s_ptr, ws_ptr, y_ptr, cnt_ptr,
    M, N, G, iters_per_split, stride_xm, stride_ym,
    FP8: tl.constexpr, NB: tl.constexpr, BSCALE: tl.constexpr, WARPS: tl.constexpr, REPS: tl.constexpr,
    SPLIT_K: tl.constexpr, ACT: tl.constexpr, FOLD: tl.constexpr, ASM: tl.constexpr, CONS: tl.constexpr,
    DEPTH: tl.constexpr = 1, USE_PDL: tl.constexpr = False, PREWAIT: tl.constexpr = False, WN: tl.constexpr = False,
    NSPLIT: tl.constexpr = 1,
):
    """MODE 6. Grid ``(N / (16 CT), split)``. ``qw``: fragment words (int32 INT4 / int64 FP8) of
    ``pack_int4`` / ``pack_fp8``; INT4: ``s`` int64 ``[N / 64, G, 8, 4]`` (scale / zero-point words of
    channels g, g + 8); FP8: ``s`` fp32 per-channel scales ``[N]`` (permuted like the rows) or, with BSCALE, the
    128x128 block scale of each channel tile and group ``[N / 32, G, 2]`` (``pack_fp8_block_scales``).
    ``G`` groups of 128 K; one iteration covers ``WARPS * REPS / 8`` groups (the warps and repetitions
    take consecutive chunks), and the warps' partial sums are added at the end.

    ``WN`` (the warps split N): grid ``(N / (16 CT WARPS), split)``; warp w of program (pb, sp) owns channel
    block ``pb * WARPS + w`` and takes every chunk of its K range, REPS chunks of one group per iteration,
    so there is no cross-warp sum: each warp stores its own outputs or split-K partials.
    """
    CT: tl.constexpr = 2 if FP8 else 4
    R: tl.constexpr = 32 * WARPS
    GPI: tl.constexpr = WARPS * REPS // 8
    pdl_release(USE_PDL)
    pb = tl.program_id(0)
    sp = tl.program_id(1)
    offs_r = tl.arange(0, R)
    lane = offs_r % 32
    g = lane // 4
    t = lane % 4
    warp = offs_r // 32
    offs_c = tl.arange(0, CT)
    if WN:
        blk = pb * WARPS + warp  # each row's channel block
        n_iters = G * 8 // REPS
        first = pb * WARPS
    else:
        n_iters = G // GPI
        first = pb
    it0 = sp * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, n_iters)
    if FP8:
        wp = qw_ptr.to(tl.pointer_type(tl.int64)) + first.to(tl.int64) * G * (8 * 32 * CT)
    else:
        wp = qw_ptr.to(tl.pointer_type(tl.int32)) + first.to(tl.int64) * G * (8 * 32 * CT)
    x8 = x_ptr.to(tl.pointer_type(tl.int64))
    xrow = g * (stride_xm // 4) + 8 * t  # int64 units: x[g, 32 t]
    xmask = g < M
    xrow2 = (g + 8) * (stride_xm // 4) + 8 * t
    xmask2 = g + 8 < M
    if WN and FP8:
        sz_rows = (blk * G)[:, None] * CT + offs_c[None, :]  # 128x128 block scales [N/32, G, 2] (BSCALE)
    elif WN:
        sz_rows = (blk * G * 8 + g)[:, None] * CT + offs_c[None, :]  # int64 scale / zero-point words
    else:
        sz_rows = (pb * G * 8 + g)[:, None] * CT + offs_c[None, :]  # int64 units of the scale / zero-point words
    zero = tl.zeros([R, CT], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = _k_loop(
        WN, wp, pb, G, it0, it1, n_iters, offs_r, offs_c, warp, lane, x8, xrow, xmask, xrow2, xmask2, sz_rows,
        s_ptr, zero, FP8, BSCALE, NB, R, CT, WARPS, REPS, GPI, ASM, CONS, DEPTH, USE_PDL, PREWAIT)
    FP8_CHANNEL: tl.constexpr = FP8 and not BSCALE
    if WN:
        _epilogue(y_ptr, ws_ptr, cnt_ptr, a0, a1, a2, a3, a4, a5, a6, a7, pb, blk, sp, M, N, stride_ym, g, t, offs_c,
                  s_ptr, R, CT, NB, SPLIT_K, ACT, FP8_CHANNEL, FOLD, NSPLIT)
    else:
        # The warps took different chunks (K) of the same channels: their partial sums add up first.
        r0 = _lane_sum(a0, WARPS, CT)
        r1 = _lane_sum(a1, WARPS, CT)
        r2 = _lane_sum(a2, WARPS, CT)
        r3 = _lane_sum(a3, WARPS, CT)
        r4, r5, r6, r7 = r0, r1, r2, r3  # (unused with one B fragment)
        if NB == 2:
            r4 = _lane_sum(a4, WARPS, CT)
            r5 = _lane_sum(a5, WARPS, CT)
            r6 = _lane_sum(a6, WARPS, CT)
            r7 = _lane_sum(a7, WARPS, CT)
        l32 = tl.arange(0, 32)
        _epilogue(y_ptr, ws_ptr, cnt_ptr, r0, r1, r2, r3, r4, r5, r6, r7, pb, pb + l32 * 0, sp, M, N, stride_ym,
                  l32 // 4, l32 % 4, offs_c, s_ptr, 32, CT, NB, SPLIT_K, ACT, FP8_CHANNEL, FOLD, NSPLIT)


@triton.jit
def _wn_loads(wb, c0, G, warp, lane, offs_c, x8, xrow, xmask, xrow2, xmask2, s_rows, s_ptr, zero,
              FP8: tl.constexpr, BSCALE: tl.constexpr, NB: tl.constexpr, CT: tl.constexpr, REPS: tl.constexpr,
              LOAD_W: tl.constexpr = True, LOAD_X: tl.constexpr = True):
    """The loads of chunks ``c0 .. c0 + REPS - 1`` (one group: REPS divides 8) of each warp's own channel
    block (warps split N): words ``[R, CT]`` per chunk, their B fragments, and the group's scale words
    (INT4 scale / zero point, FP8 128x128 block scales, else ``zero``). LOAD_W / LOAD_X as in
    ``_frag_iter_loads``."""
    grp = c0 // 8
    q0 = c0 % 8
    rows = (warp * (G * 8) + c0) * 32 + lane
    w0, xa0, xb0 = _wn_load(wb, rows, 0, offs_c, x8, xrow, xmask, xrow2, xmask2, grp, q0, NB, CT, LOAD_W, LOAD_X)
    w1, xa1, xb1 = w0, xa0, xb0
    w2, xa2, xb2 = w0, xa0, xb0
    w3, xa3, xb3 = w0, xa0, xb0
    if REPS > 1:
        w1, xa1, xb1 = _wn_load(wb, rows, 1, offs_c, x8, xrow, xmask, xrow2, xmask2, grp, q0, NB, CT, LOAD_W, LOAD_X)
    if REPS > 2:
        w2, xa2, xb2 = _wn_load(wb, rows, 2, offs_c, x8, xrow, xmask, xrow2, xmask2, grp, q0, NB, CT, LOAD_W, LOAD_X)
        w3, xa3, xb3 = _wn_load(wb, rows, 3, offs_c, x8, xrow, xmask, xrow2, xmask2, grp, q0, NB, CT, LOAD_W, LOAD_X)
    if FP8:
        if BSCALE and LOAD_W:
            sc = tl.load(s_ptr + s_rows + grp * CT) + zero
        else:
            sc = zero
    else:
        sz = s_ptr.to(tl.pointer_type(tl.int64)) + s_rows + grp * (8 * CT)
        if LOAD_W:
            sc = tl.load(sz)
        else:
            sc = tl.zeros(sz.shape, dtype=tl.int64)
    return w0, w1, w2, w3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, sc


@triton.jit
def _wn_load(wb, rows, rep: tl.constexpr, offs_c, x8, xrow, xmask, xrow2, xmask2, grp, q0, NB: tl.constexpr,
             CT: tl.constexpr, LOAD_W: tl.constexpr, LOAD_X: tl.constexpr):
    ptrs = wb + (rows + rep * 32).to(tl.int64)[:, None] * CT + offs_c[None, :]
    if LOAD_W:
        w = tl.load(ptrs, eviction_policy="evict_first")
    else:
        w = tl.zeros(ptrs.shape, dtype=wb.dtype.element_ty)
    if LOAD_X:
        xa = _x_frag(x8, xrow, grp, q0 + rep, xmask)
        xb = xa
        if NB == 2:
            xb = _x_frag(x8, xrow2, grp, q0 + rep, xmask2)
    else:
        xa = tl.zeros([rows.shape[0], 1], dtype=tl.int64)
        xb = xa
    return w, xa, xb


# ----------------------------------------------------------------------------------------------
# Packing (host, once per weight) and the torch emulation of the fragment arithmetic
# ----------------------------------------------------------------------------------------------


def _act_rows(n: int, block: int, device) -> torch.Tensor:
    """Row order that puts gate rows ``[pb*block/2, +block/2)`` then up rows ``D + same`` in block ``pb``."""
    d = n // 2
    h = block // 2
    pb = torch.arange(n // block, device=device)[:, None]
    i = torch.arange(h, device=device)[None, :]
    return torch.cat([pb * h + i, d + pb * h + i], dim=1).reshape(-1)


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
              act: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 codes ``[N, Kp]`` (0..15), fp32 ``scales`` / integer ``zeros`` ``[N, Kp / group]`` (None:
    symmetric, zero point 8) -> (words int32 ``[N/64, G, 8, 32, 4]``, scale / zero-point words int64
    ``[N/64, G, 8, 4]``: fp32 scales of channels g (low half) and g + 8, the zero point in each one's 4
    low mantissa bits). ``act``: rows reordered for the gated epilogue. Needs ``N % 64 == 0``
    (``N/2 % 32`` with ``act``), ``Kp % 128 == 0``, ``group % 128 == 0``."""
    n, kp = codes.shape
    if n % 64 or kp % KSTEP or group % KSTEP or (act and (n // 2) % 32):
        raise ValueError(f"pack_int4: shape {tuple(codes.shape)} / group {group} do not fit the fragment layout")
    rep = group // KSTEP
    s = scales.float().repeat_interleave(rep, dim=1)
    z = (torch.full_like(scales, 8.0) if zeros is None else zeros.float()).repeat_interleave(rep, dim=1)
    c = codes.to(torch.int64)
    if act:
        perm = _act_rows(n, 64, codes.device)
        c, s, z = c[perm], s[perm], z[perm]
    nbk, gk = n // 64, kp // KSTEP
    # codes [pb, c, hi, g, grp, t, q, j] -> [pb, grp, q, g, t, c, hi, j]; nibble hi + 2 (j // 2) + 4 (j % 2)
    c = c.view(nbk, 4, 2, 8, gk, 4, 8, 4).permute(0, 4, 6, 3, 5, 1, 2, 7)
    hi = torch.arange(2, device=c.device)[:, None]
    j = torch.arange(4, device=c.device)[None, :]
    shift = 4 * (hi + 2 * (j // 2) + 4 * (j % 2))
    words = (c << shift).sum(dim=(-2, -1))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(nbk, gk, 8, 32, 4)
    # scale / zero-point words [pb, grp, g, c, hi]
    bits = (s.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFF0) | z.to(torch.int64)
    bits = bits.view(nbk, 4, 2, 8, gk).permute(0, 4, 3, 1, 2)
    sz = bits[..., 0] | (bits[..., 1] << 32)
    return words.contiguous(), sz.contiguous()


def pack_fp8(qweight: torch.Tensor, act: bool = False) -> torch.Tensor:
    """e4m3 bytes ``[N, K]`` -> int64 fragments ``[N/32, K/128, 8, 32, 2]`` (``N % 32 == 0``,
    ``K % 128 == 0``; ``act``: rows reordered for the gated epilogue, ``N/2 % 16 == 0``)."""
    n, k = qweight.shape
    if n % 32 or k % KSTEP or (act and (n // 2) % 16):
        raise ValueError(f"pack_fp8: shape {tuple(qweight.shape)} does not fit the fragment layout")
    q = qweight.view(torch.uint8)
    if act:
        q = q[_act_rows(n, 32, q.device)]
    nbk, gk = n // 32, k // KSTEP
    # bytes [pb, c, hi, g, grp, t, q, j] -> [pb, grp, q, g, t, c, j, hi]: byte 2 j + hi of the int64
    q = q.reshape(nbk, 2, 2, 8, gk, 4, 8, 4).permute(0, 4, 6, 3, 5, 1, 7, 2).contiguous()
    return q.reshape(nbk, gk, 8, 32, 2, 8).view(torch.int64).reshape(nbk, gk, 8, 32, 2)


def pack_fp8_block_scales(scales: torch.Tensor, n: int, k: int, act: bool = False) -> torch.Tensor:
    """128x128 block scales ``[ceil(N/128), ceil(K/128)]`` -> the scale of each packed 16-row channel
    tile per group, fp32 ``[N/32, K/128, 2]`` (rows reordered like ``pack_fp8(act=act)``)."""
    rows = torch.arange(n, device=scales.device)
    if act:
        rows = rows[_act_rows(n, 32, scales.device)]
    tile_rows = rows[::16]  # a tile's 16 rows share one 128-row block
    sb = scales.float()[tile_rows // KSTEP][:, : k // KSTEP]  # [N/16, G]
    return sb.view(n // 32, 2, k // KSTEP).permute(0, 2, 1).contiguous()


# PTX fragment tables of mma.m16n8k16 (row-major A 16x16, column-major B 16x8, C 16x8), lane = 4 g + t.
def _a_frag(g: int, t: int) -> list[tuple[int, int]]:
    """(row, col) of A elements a0..a7 held by lane (g, t)."""
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
            (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]


def _b_frag(g: int, t: int) -> list[tuple[int, int]]:
    """(k, col) of B elements b0..b3 held by lane (g, t)."""
    return [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]


def _c_frag(g: int, t: int) -> list[tuple[int, int]]:
    """(row, col) of C elements c0..c3 held by lane (g, t)."""
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def emulate(x: torch.Tensor, frags: torch.Tensor, kind: str, n: int, s=None, fp8_scales=None,
            block_scales=None, f16: bool = False) -> torch.Tensor:
    """What MODE 6 computes (fp64 here), in packed row order, replayed lane by lane in torch from the
    packed words: each lane's registers decoded as the PTX decodes them, placed through the A/B/C
    fragment tables of mma.m16n8k16, multiplied, and stored through the kernel's output index map.
    ``kind`` "int4" (``s``, the scale / zero-point words of ``pack_int4``) or "fp8" (``fp8_scales`` per packed row or
    ``block_scales`` from ``pack_fp8_block_scales``; the 2**120 / 2**8 fold included). Slow: tests."""
    m, k = x.shape
    ct = 4 if kind == "int4" else 2
    nbk, gk = frags.shape[0], frags.shape[1]
    xf = torch.zeros(16, k, dtype=torch.float64)
    xf[:m] = x.double().cpu()
    y = torch.zeros(16, nbk * 16 * ct, dtype=torch.float64)
    fr = frags.cpu()
    for pb in range(nbk):
        for grp in range(gk):
            for q in range(8):
                # B: rows g of x for the first MMA, rows g + 8 for the second; logical k of the chunk
                # -> physical K 128 grp + 32 t' + 4 q + 2 (k // 8) + k % 2 with t' = (k % 8) // 2
                b = torch.zeros(16, 16, dtype=torch.float64)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    for kk, col in _b_frag(g, t):
                        phys = grp * KSTEP + 32 * ((kk % 8) // 2) + 4 * q + 2 * (kk // 8) + kk % 2
                        b[kk, col] = xf[col, phys]
                        b[kk, col + 8] = xf[col + 8, phys]
                for c in range(ct):
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    scale = torch.ones(16, dtype=torch.float64)
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        vals = _decode_lane(int(fr[pb, grp, q, lane, c]), kind, f16)
                        if kind == "int4":  # the scale words as the PTX reads them (z in the low bits)
                            word = int(s[pb, grp, g, c]) & ((1 << 64) - 1)
                            lo, hi = word & 0xFFFFFFFF, word >> 32
                            scale[g], scale[g + 8] = _f32(lo), _f32(hi)
                            zv = tuple(_h16((0xE400 if f16 else 0xC300) | (h & 0xF), f16) for h in (lo, hi))
                        for e, (r, col) in enumerate(_a_frag(g, t)):
                            # INT4: (B + q) + -(B + z), the packed FMA before the MMA (exact)
                            a[r, col] = vals[e] + (zv[r // 8] if kind == "int4" else 0.0)
                    d = (a * scale[:, None]) @ b  # [16 channels, 16 rows of x]
                    if block_scales is not None:
                        d = d * float(block_scales[pb, grp, c])
                    for lane in range(32):  # C fragments -> the kernel's store map (accumulator j)
                        g, t = divmod(lane, 4)
                        for half in range(2):
                            for j, (r, col) in enumerate(_c_frag(g, t)):
                                jj = j + 4 * half
                                row = 2 * t + (jj % 2) + 8 * (jj // 4)
                                ch = pb * 16 * ct + 16 * c + g + 8 * ((jj % 4) // 2)
                                y[row, ch] += d[r, col + 8 * half]
    if kind == "fp8":
        fold = 2.0**8 if f16 else 2.0**120
        if fp8_scales is not None:
            y = y * fp8_scales.double().cpu()[None, :]
        y = y * fold
    return y[:m, :n]


def _f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def _h16(bits: int, f16: bool) -> float:
    t = torch.tensor([bits], dtype=torch.int32).to(torch.int16)
    return t.view(torch.float16 if f16 else torch.bfloat16).item()


def _decode_lane(word: int, kind: str, f16: bool) -> list[float]:
    """A registers a0..a7 of one lane as values (INT4: ``B + q``; FP8: the e4m3 value times 2**-120
    (bf16) / 2**-8 (fp16)), from the word exactly as the PTX decodes it."""
    word &= (1 << 64) - 1
    if kind == "int4":
        magic = 0x6400 if f16 else 0x4300
        regs = []
        for j in range(4):
            v = (word >> (4 * j)) & 0x000F000F
            regs += [_h16((v & 0xFFFF) | magic, f16), _h16(((v >> 16) & 0xFFFF) | magic, f16)]
        return regs
    out = []
    for h in range(2):
        w = (word >> (32 * h)) & 0xFFFFFFFF
        for t in ((w << 8) & 0xFFFFFFFF, w):  # a[2h]: bytes 0, 2; a[2h+1]: bytes 1, 3
            if f16:
                bits = (t & 0x80008000) | ((t >> 1) & 0x3F803F80)
            else:
                bits = (t & 0x80008000) | ((t >> 4) & 0x07F007F0)
            out += [_h16(bits & 0xFFFF, f16), _h16(bits >> 16, f16)]
    return out


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

_ASM: dict[tuple, tuple[str, str]] = {}


def supported(x: torch.Tensor) -> bool:
    """Whether MODE 6 can take activations ``x [M, K]``: CUDA sm80+, bf16/fp16, ``M <= 16``, unit column
    stride, rows 8-byte aligned."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or x.shape[0] > MAX_M:
        return False
    if x.stride(-1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8:
        return False
    return capability(x.device).at_least(8)  # (cached per device: this runs on every decode-sized call)


def _asm(kind: str, nb: int, f16: bool, bscale: bool, words: int = 1) -> tuple[str, str]:
    """The kernel's inline PTX; ``words``: INT4 words per call (the WN layout's REPS, one group)."""
    key = (kind, nb, f16, bscale, words)
    if key not in _ASM:
        _ASM[key] = int4_asm(nb, f16, words) if kind == "int4" else fp8_asm(nb, f16, bscale)
    return _ASM[key]


def default_config(kind: str, n: int, k: int, m: int, num_sms: int) -> dict:
    """Launch config for shapes the sweep did not tune (``[N, K]`` weight, ``m`` rows, unused so far):
    4 warps x 4 repetitions, split-K until the programs cover the multiprocessors ~3 times while
    keeping >= 2 iterations per split."""
    warps, reps = 4, 4
    blocks = n // (64 if kind == "int4" else 32)
    iters = k // (KSTEP * warps * reps // 8)
    split = 1
    while blocks * split < 3 * num_sms and iters // (2 * split) >= 2:
        split *= 2
    return {"MODE": 6, "WARPS": warps, "REPS": reps, "SPLIT": split}


def m1_config(n: int, k: int, num_sms: int) -> dict:
    """INT4 at M=1 for shapes the sweep did not tune (from ``triton_wo.MODE6_MIN_N`` channels and
    ``MODE6_MIN_BYTES`` of codes): the tuned M=1 entries' kernel (the warps splitting N, DEPTH 3 under a
    128-register cap), split-K doubling until ~12 warps per multiprocessor while each split keeps >= 8
    iterations (14336x4096 -> 8, the lm_head's 128256 rows -> 1, 8192x8192 -> 16: the splits the H200
    probes measured fastest there, sweeps/probe_frag_depth.json, probe_lm_head.json, probe_untuned_int4.json)."""
    blocks = n // 64
    warps = 4 if blocks % 4 == 0 else 2 if blocks % 2 == 0 else 1
    iters = k // KSTEP * 8 // 4
    split = 1
    while blocks * split < 12 * num_sms and iters // (2 * split) >= 8:
        split *= 2
    return {"MODE": 6, "WN": 1, "WARPS": warps, "REPS": 4, "SPLIT": split, "DEPTH": 3, "MAXNREG": 128}


def maxnreg_option(cfg: dict) -> dict:
    """The launch option of a config's optional MAXNREG (a ptxas register cap per thread; 0 / absent:
    none), validated (``ValueError`` naming the key)."""
    maxnreg = cfg.get("MAXNREG") or 0
    if not isinstance(maxnreg, int) or isinstance(maxnreg, bool) or not (maxnreg == 0 or 32 <= maxnreg <= 255):
        raise ValueError(f"config: MAXNREG (registers per thread) must be an int in [32, 255], got {maxnreg!r}")
    return {"maxnreg": maxnreg} if maxnreg else {}


def check_operands(x: torch.Tensor, kind: str, frags: torch.Tensor, n: int, s: torch.Tensor, act: str | None,
                   bscale: bool = False, min_arch: int = 8, mode: int = 6) -> None:
    """``ValueError`` naming the argument unless the fragment kernels (MODE ``mode``) can take these operands:
    ``kind`` "int4" / "fp8"; ``frags`` from :func:`pack_int4` (int32 ``[N/64, K/128, 8, 32, 4]``) or
    :func:`pack_fp8` (int64 ``[N/32, K/128, 8, 32, 2]``) holding ``n`` channels; ``s`` int64 ``[N/64, K/128, 8,
    4]`` (INT4), fp32 ``[N]`` (FP8 per channel) or :func:`pack_fp8_block_scales` (``bscale``); ``x [M, K]``
    :func:`supported` on CUDA sm``min_arch``0+; ``act`` a gated activation or None."""
    if kind not in ("int4", "fp8"):
        raise ValueError(f"kind: expected 'int4' or 'fp8', got {kind!r}")
    ct = 4 if kind == "int4" else 2
    want = torch.int32 if kind == "int4" else torch.int64
    if frags.dtype != want or frags.dim() != 5 or tuple(frags.shape[2:]) != (8, 32, ct):
        raise ValueError(f"frags: expected {want} [N/{16 * ct}, K/128, 8, 32, {ct}], got {frags.dtype} "
                         f"{tuple(frags.shape)}")
    if n != frags.shape[0] * 16 * ct:
        raise ValueError(f"n: {n} does not match frags, which hold {frags.shape[0] * 16 * ct} channels")
    if kind == "int4":
        want_s = (torch.int64, (frags.shape[0], frags.shape[1], 8, 4))
    elif bscale:
        want_s = (torch.float32, (frags.shape[0], frags.shape[1], 2))
    else:
        want_s = (torch.float32, (n,))
    if s.dtype != want_s[0] or tuple(s.shape) != want_s[1]:
        raise ValueError(f"s: expected {want_s[0]} {list(want_s[1])}, got {s.dtype} {tuple(s.shape)}")
    if x.dim() != 2 or x.shape[1] != frags.shape[1] * KSTEP:
        raise ValueError(f"x: expected [M, {frags.shape[1] * KSTEP}], got {tuple(x.shape)}")
    if not supported(x) or not capability(x.device).at_least(min_arch):
        raise ValueError(f"x: MODE {mode} needs a CUDA (sm{min_arch}0+) bf16/fp16 tensor with M <= 16, unit column "
                         f"stride and 8-byte aligned rows; got {x.dtype} {tuple(x.shape)} on {x.device}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act: expected one of {sorted(a for a in ACTIVATIONS if a)} or None, got {act!r}")


def launch(x: torch.Tensor, kind: str, frags: torch.Tensor, n: int, cfg: dict, *, s: torch.Tensor,
           bscale: bool = False, fold: float = 1.0,
           act: str | None = None) -> torch.Tensor:
    """Run MODE 6: ``x [M, K]`` (bf16/fp16, M <= 16, CUDA) times packed weights -> ``[M, N]`` in
    ``x.dtype`` (``[M, N/2]`` with ``act``, a merged ``[gate; up]`` weight packed with ``act=True``).

    ``kind`` "int4": ``frags`` int32 ``[N/64, K/128, 8, 32, 4]`` and ``s`` int64 ``[N/64, K/128, 8, 4]``
    from :func:`pack_int4`; "fp8": ``frags`` int64 ``[N/32, K/128, 8, 32, 2]`` from :func:`pack_fp8`, ``s``
    fp32 per-channel scales ``[N]`` (packed row order) or, with ``bscale``, :func:`pack_fp8_block_scales`;
    ``fold`` the decode's power of two (2**120 bf16, 2**8 fp16). ``cfg``: WARPS, REPS, SPLIT, DEPTH, WN
    (1: the warps split N, ``_frag_kernel``'s ``WN``) and optionally MAXNREG (a register cap per thread
    for ptxas, which spills past it)."""
    check_operands(x, kind, frags, n, s, act, bscale)
    ct = 4 if kind == "int4" else 2
    m = x.shape[0]
    nb = 1 if m <= 8 else 2
    warps, reps = cfg["WARPS"], cfg["REPS"]
    wn = bool(cfg.get("WN", 0))
    gk = frags.shape[1]
    blocks = frags.shape[0]
    if wn:  # warps split N: each warp its own channel block, REPS chunks (of one group) per iteration
        if reps not in (1, 2, 4) or warps not in (1, 2, 4, 8):
            raise ValueError(f"config: with WN, WARPS in (1, 2, 4, 8) and REPS in (1, 2, 4); got {cfg}")
        if blocks % warps:
            raise ValueError(f"config: WN needs the {blocks} channel blocks of {16 * ct} to be a multiple of "
                             f"WARPS ({warps})")
        iters = gk * 8 // reps
    else:
        if reps not in (1, 2, 4) or warps not in (2, 4, 8) or warps * reps not in (8, 16):
            raise ValueError(f"config: WARPS in (2, 4, 8), REPS in (1, 2, 4), WARPS * REPS 8 or 16; got {cfg}")
        gpi = warps * reps // 8
        if gk % gpi:
            raise ValueError(f"config: {gk} groups of 128 are not a multiple of {gpi} per iteration")
        iters = gk // gpi
    split = max(1, min(int(cfg.get("SPLIT", 1)), iters))
    per = triton.cdiv(iters, split)
    split = triton.cdiv(iters, per)
    grid_n = blocks // warps if wn else blocks
    chain = reps if wn and kind == "int4" and reps > 1 else 1  # ``_frag_iter_mma``'s CHAIN
    asm, cons = _asm(kind, nb, x.dtype == torch.float16, bscale, chain)
    code = ACTIVATIONS[act]
    y = torch.empty((m, n // 2 if code else n), dtype=x.dtype, device=x.device)
    via_ws = split > 1 or code != 0
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if via_ws else y
    cnt = arrival_counters(x.device, grid_n) if split > 1 else y
    use_pdl = pdl_enabled(x)
    depth = int(cfg.get("DEPTH", 1))
    if depth not in (1, 2, 3):
        raise ValueError(f"config: DEPTH (1 or 2 iterations loaded ahead; 3: 2 without register rotation) must be "
                         f"1, 2 or 3, got {depth}")
    _frag_kernel[(grid_n, split)](
        x, frags, s, ws, y, cnt,
        m, n, gk, per, x.stride(0), y.stride(0),
        FP8=kind == "fp8", NB=nb, BSCALE=bscale, WARPS=warps, REPS=reps, SPLIT_K=split > 1, NSPLIT=split, ACT=code,
        FOLD=fold, ASM=asm, CONS=cons, DEPTH=depth, PREWAIT=use_pdl and GEMV_PREWAIT > 0, WN=wn, num_warps=warps,
        num_stages=1, **pdl_launch(use_pdl), **maxnreg_option(cfg),
    )
    return y


def int4_ok(x: torch.Tensor, w, act: str | None) -> bool:
    """Whether MODE 6 can run INT4 ``w`` (``formats.IntWeight``, logical ``[N, K]``) for ``x [M, K]``:
    4-bit codes, group a multiple of 128 (or one per channel), K unpadded and a multiple of 128,
    ``N % 64 == 0`` (``N/2 % 32`` with ``act``), and :func:`supported` ``x``."""
    n, k = w.shape
    kp = w.padded_in_features
    group_ok = w.group_size % KSTEP == 0 or w.scales.shape[1] == 1
    return (w.bits == 4 and group_ok and k == kp and kp % KSTEP == 0 and n % 64 == 0
            and (act is None or (n // 2) % 32 == 0) and supported(x))


def fp8_ok(x: torch.Tensor, w, act: str | None) -> bool:
    """Whether MODE 6 can run FP8 ``w`` (``formats.FP8Weight``, e4m3 ``[N, K]``) for ``x [M, K]``:
    ``K % 128 == 0``, ``N % 32 == 0`` (``N/2 % 16`` with ``act``), per-channel or 128x128 block
    scales, and :func:`supported` ``x``."""
    n, k = w.shape
    return (k % KSTEP == 0 and n % 32 == 0 and w.block_size in (None, KSTEP)
            and (act is None or (n // 2) % 16 == 0) and supported(x))


def gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper TMA API (MODE 7, ``gluon_frag``)."""
    global _GLUON
    if _GLUON is None:
        try:
            from . import gluon_frag  # noqa: F401

            _GLUON = True
        except ImportError:
            _GLUON = False
    return _GLUON


_GLUON: bool | None = None


def int4_matmul(x: torch.Tensor, w, cfg: dict, act: str | None = None) -> torch.Tensor | None:
    """``x [M, K]`` (bf16/fp16) times INT4 ``w`` (logical ``[N, K]``; :func:`int4_ok` holds) through
    MODE 6 (or MODE 7, ``gluon_frag``, when ``cfg["MODE"]`` is 7: the same words streamed by TMA) -> ``[M, N]``
    in ``x.dtype`` (``[M, N/2]`` = ``act(gate) * up`` with ``act``), or None when the repack cannot be made
    now (first call inside a CUDA-graph capture)."""
    group = w.group_size if w.scales.shape[1] != 1 else w.padded_in_features
    key = ("int4", act is not None)
    p = packed(w.qweight, key, lambda: pack_int4(w.codes(), w.scales, w.zeros, group, act is not None))
    if p is None:
        return None
    words, sz = p
    if cfg.get("MODE") == 7:
        from . import gluon_frag

        desc = packed(w.qweight, ("int4-tma", act is not None), lambda: gluon_frag.descriptor(words))
        return gluon_frag.launch(x, words, sz, w.shape[0], cfg, desc, act=act)
    return launch(x, "int4", words, w.shape[0], cfg, s=sz, act=act)


def fp8_matmul(x: torch.Tensor, w, cfg: dict, act: str | None = None) -> torch.Tensor | None:
    """``x [M, K]`` (bf16/fp16) times emulated-FP8 ``w`` (e4m3 ``[N, K]``; :func:`fp8_ok` holds) through
    MODE 6 (or MODE 7 with per-channel scales, ``cfg["MODE"]`` 7), shapes and None as in :func:`int4_matmul`."""
    n, k = w.shape
    fused = act is not None
    bscale = w.block_size is not None

    def make():
        frags = pack_fp8(w.qweight, fused)
        if bscale:
            s = pack_fp8_block_scales(w.scales, n, k, fused)
        else:
            s = w.scales.float()[_act_rows(n, 32, w.scales.device)] if fused else w.scales.float().contiguous()
        return frags, s

    p = packed(w.qweight, ("fp8", fused), make)
    if p is None:
        return None
    frags, s = p
    fold = 2.0**8 if x.dtype == torch.float16 else 2.0**120
    if cfg.get("MODE") == 7:
        if bscale:
            raise ValueError("config: MODE 7 runs FP8 weights with per-channel scales only (not 128x128 blocks)")
        from . import gluon_frag

        desc = packed(w.qweight, ("fp8-tma", fused), lambda: gluon_frag.descriptor(frags))
        return gluon_frag.launch(x, frags, s, n, cfg, desc, act=act, kind="fp8", fold=fold)
    return launch(x, "fp8", frags, n, cfg, s=s, bscale=bscale, fold=fold, act=act)
