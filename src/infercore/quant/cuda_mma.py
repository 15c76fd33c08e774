"""MODE 9: weight-only matmuls for 1-16 activation rows in CUDA C++ (``wo_mma.cu``, compiled at first use by
NVRTC through torch), INT4 (group-wise scale + zero point), emulated FP8 (per-channel or 128x128 block scales) and
4-bit codebook weights (``LUT_KINDS``: bitsandbytes NF4 with its fp32 absmax, MXFP4 / NVFP4 with their block scale
bytes; the codes looked up by byte permutes, :func:`repack_nf4` / :func:`repack_fp4`).

Why a CUDA kernel beside the Triton ones: at 9-16 rows the Triton / Gluon fragment kernels (MODE 6 / 7) hold each
warp's decode chain, B fragments and split-K bookkeeping in ~190 registers, ~10 warps per SM, and stall on load
latency (docs/quantization.md). Here eight warps of a CTA share one activation tile per K step (ldmatrix from a
swizzled shared-memory stage), the weights stream through a cp.async ring of 16 KB units, and the grid is one
stream-K wave: every CTA streams the same number of units, and only the CTAs that share a channel block exchange
fp32 partials (written over a sentinel pattern and polled: no flag, fence or atomic).

Layouts (all made once per weight by :func:`repack_int4` / :func:`repack_fp8`, kept while the weight lives):

* unit ``u = nb * KT + kt``: channels ``[nb BN, (nb + 1) BN)`` x K ``[kt 128, (kt + 1) 128)``, words in the order
  ``[warp][j][lane 32][4 words]``. ``BN`` = warps x m16 tiles per warp x 16 (:data:`LAYOUT`, by default 8 x 2 x 16 =
  256 for INT4 and 8 x 1 x 16 = 128 for FP8: 16 KB units; the ``warps`` / ``mt`` arguments pick another, e.g. 7 x 1
  for 112-channel units, which the dispatcher does not use yet). :func:`unpack_int4` /
  :func:`unpack_fp8` invert it (the CPU tests check the round trip and the nibble / byte map the kernel decodes);
* per unit ``BN`` 32-bit scale words ``[warp][8 channels g][tile]`` (one vector load per lane): INT4 the fp32
  scale with its low 4 mantissa bits replaced by the zero point (relative error <= 2^-19), FP8 the fp32 scale.
  Tile ``t`` of a warp holds channels ``t * 8 + g``.

The kernel needs K % 128 == 0, INT4 groups that are multiples of 128 (or per channel), FP8 block scales of 128 (or
per channel), bf16 / fp16 activations with 16-byte aligned rows. ``available()`` is False without CUDA sm80+ or
NVRTC (``torch.cuda._compile_kernel``); callers then keep the Triton kernels.
"""

from __future__ import annotations

import ctypes
import math
import os
import warnings
import weakref
from pathlib import Path

import torch

from .formats import FP4Weight, FP8Weight, IntWeight, NF4Weight
from .fp4 import unpack_nibbles

BK = 128
UNIT_BYTES = 16384  # the largest unit (8 warps x 2 m16 tiles INT4, 8 x 1 FP8): a CTA's partial-sum slots fit in it
MAX_M = 16
MAX_CTAS_PER_SM = 4
_SRC = Path(__file__).with_name("wo_mma.cu")

# Launch shape, measured on the H200 (benchmarks/probe_mma_wo.py, probe_mma_variants.py): cp.async ring depth, CTAs
# per SM and K parts per unit (KSPLIT: 2 = 16 warps, each pair splitting a unit's K).
STAGES = {"int4": 4, "fp8": 4, "nf4": 4, "mxfp4": 4, "nvfp4": 4}
CTAS_PER_SM = {"int4": 1, "fp8": 1, "nf4": 1, "mxfp4": 1, "nvfp4": 1}
KSPLIT = {"int4": 1, "fp8": 1, "nf4": 1, "mxfp4": 1, "nvfp4": 1}
LUT_KINDS = ("nf4", "mxfp4", "nvfp4")  # 4-bit codes looked up in a 16-entry table (``lut_tables``)

ENABLED = os.environ.get("INFERCORE_WO_CUDA", "1") != "0"

# Programmatic dependent launch on sm90+ (``cuLaunchKernelEx``): the kernel may start while the previous kernel in
# the stream finishes, streaming its first weight units before ``griddepcontrol.wait``; everything the previous
# kernel may write (activations, outputs, the partial-sum slots) is touched only after the wait.
# INFERCORE_WO_PDL=0 turns it off.
PDL = os.environ.get("INFERCORE_WO_PDL", "1") != "0"

# Extra ``-D`` switches for every compile (benchmarks' timing probes, e.g. ``("PROBE=1",)``); also read from
# INFERCORE_WO_DEFINES (comma-separated), so a whole run (tests, benchmarks) can try a switch.
DEFINES: tuple = tuple(d for d in os.environ.get("INFERCORE_WO_DEFINES", "").split(",") if d)


# Unit layout per kind: ``(warps, mt)``, warps per K part and m16 channel tiles per warp (INT4; FP8 takes one).
LAYOUT = {"int4": (8, 2), "fp8": (8, 1), "nf4": (8, 2), "mxfp4": (8, 2), "nvfp4": (8, 2)}


def _layout(kind: str, warps: int | None, mt: int | None) -> tuple[int, int]:
    dw, dm = LAYOUT[kind]
    w = dw if warps is None else warps
    m = 1 if kind == "fp8" else (dm if mt is None else mt)
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 8:
        raise ValueError(f"warps: expected an int in [1, 8] or None, got {warps!r}")
    if isinstance(m, bool) or m not in (1, 2):
        raise ValueError(f"mt: expected 1 or 2 or None, got {mt!r}")
    return w, m


def block_n(kind: str, warps: int | None = None, mt: int | None = None) -> int:
    """Channels per unit: ``warps`` x ``mt`` m16 tiles (INT4) or ``warps`` x 1 (FP8); 256 / 128 by default."""
    w, m = _layout(kind, warps, mt)
    return 16 * w * m


def unit_bytes(kind: str, warps: int | None = None, mt: int | None = None) -> int:
    """Bytes of weight codes in one unit (``block_n`` channels x 128 K)."""
    return block_n(kind, warps, mt) * BK // (1 if kind == "fp8" else 2)


def scale_words(kind: str) -> int:
    """32-bit scale words per channel and unit: NF4 the absmax of each 64-K half, NVFP4 eight e4m3 bytes, MXFP4 four
    e8m0 bytes."""
    return 2 if kind in ("nf4", "nvfp4") else 1


# ------------------------------------------------------------------------------------------------
# Repacks (plain torch: run on the weight's device, tested on the CPU)
# ------------------------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0])) if rows > t.shape[0] else t


def _unit_groups(w: IntWeight, kt: int) -> torch.Tensor:
    """The quantization group of each unit's K range: ``int64 [KT]``."""
    if w.scales.shape[1] == 1:
        return torch.zeros(kt, dtype=torch.int64, device=w.scales.device)
    return torch.arange(kt, device=w.scales.device) * BK // w.group_size


def int4_ok(w: IntWeight) -> bool:
    """Whether :func:`repack_int4` can take ``w``: 4-bit codes, K padded to a multiple of 128, groups that are
    multiples of 128 (or one per channel), integer zero points below 16."""
    if not isinstance(w, IntWeight) or w.bits != 4 or w.padded_in_features % BK:
        return False
    return w.scales.shape[1] == 1 or w.group_size % BK == 0


def repack_int4(w: IntWeight, warps: int | None = None, mt: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words int32 [U * BN * 16], scale_words int32 [U * BN])`` for ``wo_mma.cu`` (``BN = block_n("int4", warps,
    mt)``, ``U = ceil(N / BN) * Kp/128``)."""
    if not int4_ok(w):
        raise ValueError("w: MODE 9 needs INT4 codes with K % 128 == 0 and groups of a multiple of 128")
    nw, mt = _layout("int4", warps, mt)
    n, kp = w.qweight.shape[0], w.padded_in_features
    bn = block_n("int4", nw, mt)
    nb, kt = math.ceil(n / bn), kp // BK
    codes = _pad_rows(w.codes().to(torch.uint8), nb * bn)
    # n = nb*BN + warp*16 mt + p*16 + t*8 + nl;  k = kt*128 + j*(64 / mt) + slo*16 + khi*8 + c*2 + klo (word s mt + p
    # of the lane, s = j 4 / mt + slo, is component s mt + p % 4 of its uint4 j)
    c = codes.view(nb, nw, mt, 2, 8, kt, 2 * mt, 4 // mt, 2, 4, 2)
    # -> [nb, kt, warp, j, nl, c, slo, p | klo, t, khi]: word (s = 2j + slo, p) of lane 4 nl + c, nibble klo*4+t*2+khi
    c = c.permute(0, 5, 1, 6, 4, 9, 7, 2, 10, 3, 8).reshape(-1, 8).to(torch.int32)
    shifts = torch.arange(0, 32, 4, device=c.device, dtype=torch.int32)
    words = (c << shifts).sum(-1, dtype=torch.int32)  # int32 sums wrap: the nibbles never overlap
    groups = _unit_groups(w, kt)
    s = w.scales.float()[:, groups]  # [N, KT]
    z = w.zero_points()[:, groups]
    if not bool(((z == z.round()) & (z >= 0) & (z < 16)).all()):
        raise ValueError("w: MODE 9 needs integer zero points in [0, 15]")
    sw = (s.contiguous().view(torch.int32) & ~15) | z.to(torch.int32)
    sw = _pad_rows(sw, nb * bn).view(nb, nw, 2 * mt, 8, kt).permute(0, 4, 1, 3, 2)  # [nb, kt, warp, g, t]
    return words.contiguous(), sw.reshape(-1).contiguous()


def unpack_int4(words: torch.Tensor, scale_words: torch.Tensor, n: int, kp: int, warps: int | None = None,
                mt: int | None = None):
    """Inverse of :func:`repack_int4`: ``(codes int32 [N, Kp], scales fp32 [N, KT], zeros int32 [N, KT])`` (per
    unit), read the way the kernel reads them."""
    nw, mt = _layout("int4", warps, mt)
    bn = block_n("int4", nw, mt)
    nb, kt = math.ceil(n / bn), kp // BK
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    nib = (words.view(-1, 1) >> shifts) & 15
    c = nib.view(nb, kt, nw, 2 * mt, 8, 4, 4 // mt, mt, 2, 2, 2).permute(0, 2, 7, 9, 4, 1, 3, 6, 10, 5, 8)
    codes = c.reshape(nb * bn, kp)[:n]
    sw = scale_words.view(nb, kt, nw, 8, 2 * mt).permute(0, 2, 4, 3, 1).reshape(nb * bn, kt)[:n]
    return codes, (sw & ~15).view(torch.float32), sw & 15


def nf4_ok(w: NF4Weight) -> bool:
    """Whether :func:`repack_nf4` can take ``w``: K % 128 == 0, absmax blocks of 64 or a multiple of 128."""
    return (isinstance(w, NF4Weight) and w.shape[1] % BK == 0
            and (w.blocksize == 64 or w.blocksize % BK == 0))


# A word's nibble j of the INT4 layout moves to nibble _NF4_ORDER.index(j): pairs (j, j + 4) become adjacent.
_NF4_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _lut4_words(codes: torch.Tensor, nb: int, bn: int, nw: int, mt: int, kt: int) -> torch.Tensor:
    """The INT4 unit layout of 4-bit ``codes [N, K]`` with each word's nibbles reordered (:data:`_NF4_ORDER`)."""
    c = _pad_rows(codes, nb * bn).view(nb, nw, mt, 2, 8, kt, 2 * mt, 4 // mt, 2, 4, 2)
    c = c.permute(0, 5, 1, 6, 4, 9, 7, 2, 10, 3, 8).reshape(-1, 8)[:, list(_NF4_ORDER)].to(torch.int32)
    shifts = torch.arange(0, 32, 4, device=c.device, dtype=torch.int32)
    return (c << shifts).sum(-1, dtype=torch.int32)


def _lut4_codes(words: torch.Tensor, n: int, k: int, nb: int, bn: int, nw: int, mt: int) -> torch.Tensor:
    """Inverse of :func:`_lut4_words`: ``int32 [N, K]``."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    nib = ((words.view(-1, 1) >> shifts) & 15)[:, [_NF4_ORDER.index(j) for j in range(8)]]
    c = nib.reshape(nb, k // BK, nw, 2 * mt, 8, 4, 4 // mt, mt, 2, 2, 2).permute(0, 2, 7, 9, 4, 1, 3, 6, 10, 5, 8)
    return c.reshape(nb * bn, k)[:n]


def repack_nf4(w: NF4Weight, warps: int | None = None, mt: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words int32 [U * BN * 16], absmax fp32 [U * BN * 2])`` for ``wo_mma.cu`` with ``NF4``: the INT4 unit layout
    of the codes with each word's nibbles reordered (:data:`_NF4_ORDER`, so that a pair of adjacent nibbles is one MMA
    register), and per unit, channel lane group ``g`` and 64-K half ``h`` the absmax words ``[h][tile]``."""
    if not nf4_ok(w):
        raise ValueError("w: MODE 9 needs NF4 codes with K % 128 == 0 and absmax blocks of 64 or a multiple of 128")
    nw, mt = _layout("nf4", warps, mt)
    n, k = w.shape
    bn = block_n("nf4", nw, mt)
    nb, kt = math.ceil(n / bn), k // BK
    words = _lut4_words(unpack_nibbles(w.qweight), nb, bn, nw, mt, kt)
    half = (torch.arange(kt * 2, device=w.absmax.device) * (BK // 2)) // w.blocksize  # absmax block of each half
    s = _pad_rows(w.absmax.float()[:, half].contiguous(), nb * bn)  # [N, KT * 2]
    s = s.view(nb, nw, 2 * mt, 8, kt, 2).permute(0, 4, 1, 3, 5, 2)  # [nb, kt, warp, g, h, t]
    return words.contiguous(), s.reshape(-1).contiguous()


def unpack_nf4(words: torch.Tensor, absmax: torch.Tensor, n: int, k: int, warps: int | None = None,
               mt: int | None = None):
    """Inverse of :func:`repack_nf4`: ``(codes int32 [N, K], absmax fp32 [N, K / 64])`` (one per 64-K half)."""
    nw, mt = _layout("nf4", warps, mt)
    bn = block_n("nf4", nw, mt)
    nb, kt = math.ceil(n / bn), k // BK
    s = absmax.view(nb, kt, nw, 8, 2, 2 * mt).permute(0, 2, 5, 3, 1, 4).reshape(nb * bn, kt * 2)[:n]
    return _lut4_codes(words, n, k, nb, bn, nw, mt), s


def fp4_ok(w: FP4Weight) -> bool:
    """Whether :func:`repack_fp4` can take ``w``: MXFP4 / NVFP4 with K % 128 == 0."""
    return isinstance(w, FP4Weight) and w.shape[1] % BK == 0


def repack_fp4(w: FP4Weight, warps: int | None = None, mt: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words int32 [U * BN * 16], scale words int32 [U * BN * s])`` for ``wo_mma.cu`` with ``FP4`` (kind
    ``w.fmt``): the codes as :func:`repack_nf4` lays them out, and per unit, channel lane group ``g`` and slot ``t``
    the unit's scale bytes in K order (MXFP4 four e8m0 bytes, ``s = 1``; NVFP4 eight e4m3 bytes, ``s = 2``)."""
    if not fp4_ok(w):
        raise ValueError("w: MODE 9 needs FP4 codes with K % 128 == 0")
    kind = w.fmt
    nw, mt = _layout(kind, warps, mt)
    n, k = w.shape
    bn = block_n(kind, nw, mt)
    nb, kt = math.ceil(n / bn), k // BK
    words = _lut4_words(unpack_nibbles(w.qweight), nb, bn, nw, mt, kt)
    sw = scale_words(kind)
    b = _pad_rows(w.scales.contiguous(), nb * bn).view(nb, nw, 2 * mt, 8, kt, 4 * sw)
    b = b.permute(0, 4, 1, 3, 2, 5).contiguous()  # [nb, kt, warp, g, t, bytes]
    return words.contiguous(), b.view(torch.int32).reshape(-1).contiguous()


def unpack_fp4(words: torch.Tensor, sc_words: torch.Tensor, n: int, k: int, fmt: str, warps: int | None = None,
               mt: int | None = None):
    """Inverse of :func:`repack_fp4`: ``(codes int32 [N, K], scale bytes uint8 [N, K / block])``."""
    nw, mt = _layout(fmt, warps, mt)
    bn = block_n(fmt, nw, mt)
    nb, kt = math.ceil(n / bn), k // BK
    sw = scale_words(fmt)
    b = sc_words.view(torch.uint8).view(nb, kt, nw, 8, 2 * mt, 4 * sw)
    s = b.permute(0, 2, 4, 3, 1, 5).reshape(nb * bn, kt * 4 * sw)[:n]
    return _lut4_codes(words, n, k, nb, bn, nw, mt), s


def lut_tables(codebook: torch.Tensor, dtype: torch.dtype, y_scale: float = 1.0) -> torch.Tensor:
    """The kernel's table operand (int32 ``[9]`` on the codebook's device): the eight byte tables of the 16-entry
    ``codebook`` rounded to ``dtype`` (bf16 / fp16; the low bytes of entries 4i .. 4i + 3 in word i, entry 4i + j in
    byte j, the high bytes in word 4 + i), then the fp32 bits of ``y_scale`` (NVFP4's tensor scale). ``TypeError`` for
    another dtype, ``ValueError`` for a codebook that is not 16 floats."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    if not isinstance(codebook, torch.Tensor) or not codebook.is_floating_point() or codebook.numel() != 16:
        raise ValueError(f"codebook: expected a float tensor of 16 entries, got "
                         f"{getattr(codebook, 'dtype', type(codebook))} {tuple(getattr(codebook, 'shape', ()))}")
    bits = codebook.reshape(16).to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    planes = torch.stack([bits & 0xFF, bits >> 8]).view(2, 4, 4)  # [plane, word, byte]
    t = (planes << (8 * torch.arange(4, device=bits.device))).sum(-1).view(8)
    t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    ys = torch.tensor([y_scale], dtype=torch.float32).view(torch.int32).to(t.device)
    return torch.cat([t, ys])


def fp8_ok(w: FP8Weight) -> bool:
    """Whether :func:`repack_fp8` can take ``w``: K % 128 == 0, per-channel or 128x128 block scales."""
    return isinstance(w, FP8Weight) and w.shape[1] % BK == 0 and w.block_size in (None, 128)


def repack_fp8(w: FP8Weight, warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words int32 [U * BN * 32], scales fp32 [U * BN])`` for ``wo_mma.cu`` (``BN = block_n("fp8", warps)``,
    ``U = ceil(N / BN) * K/128``)."""
    if not fp8_ok(w):
        raise ValueError("w: MODE 9 needs FP8 weights with K % 128 == 0 and per-channel or 128x128 block scales")
    nw, _ = _layout("fp8", warps, None)
    n, k = w.shape
    bn = block_n("fp8", nw)
    nb, kt = math.ceil(n / bn), k // BK
    q = _pad_rows(w.qweight.view(torch.uint8), nb * bn)
    # n = nb*BN + warp*16 + p*8 + nl;  k = kt*128 + j*32 + slo*16 + khi*8 + c*2 + klo; byte khi*2 + klo
    b = q.view(nb, nw, 2, 8, kt, 4, 2, 2, 4, 2).permute(0, 4, 1, 5, 3, 8, 6, 2, 7, 9)
    words = b.reshape(-1, 4).contiguous().view(torch.int32).reshape(-1)
    if w.block_size is None:
        s = w.scales.float()[:, None].expand(n, kt)
    else:
        s = w.scales.float()[torch.arange(n, device=q.device) // 128][:, :kt]
    s = _pad_rows(s.contiguous(), nb * bn).view(nb, nw, 2, 8, kt).permute(0, 4, 1, 3, 2)  # [nb, kt, warp, g, p]
    return words.contiguous(), s.reshape(-1).contiguous()


def unpack_fp8(words: torch.Tensor, scales: torch.Tensor, n: int, k: int, warps: int | None = None):
    """Inverse of :func:`repack_fp8`: ``(bytes uint8 [N, K], scales fp32 [N, KT])``."""
    nw, _ = _layout("fp8", warps, None)
    bn = block_n("fp8", nw)
    nb, kt = math.ceil(n / bn), k // BK
    b = words.contiguous().view(torch.uint8).view(nb, kt, nw, 4, 8, 4, 2, 2, 2, 2)
    q = b.permute(0, 2, 7, 4, 1, 3, 6, 8, 5, 9).reshape(nb * bn, k)[:n]
    s = scales.view(nb, kt, nw, 8, 2).permute(0, 2, 4, 3, 1).reshape(nb * bn, kt)[:n]
    return q, s


# ------------------------------------------------------------------------------------------------
# Compile and launch
# ------------------------------------------------------------------------------------------------

_KERNELS: dict = {}
_BUFFERS: dict = {}
_LAUNCHED: dict = {}  # id(words) -> weakref: repacks launched before (their writes are long done)
_FAILED: dict = {}  # variant key -> the compile / load error, so a failing variant is tried once


def available(x: torch.Tensor) -> bool:
    """Whether MODE 9 can run activations ``x [M, K]``: enabled (``INFERCORE_WO_CUDA``), CUDA sm80+ with NVRTC,
    bf16 / fp16, ``1 <= M <= 16``, unit column stride, 16-byte aligned rows."""
    if not (ENABLED and x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not 1 <= x.shape[0] <= MAX_M or x.stride(1) != 1 or (x.stride(0) % 8 and x.shape[0] > 1):
        return False
    if x.data_ptr() % 16 or torch.cuda.get_device_capability(x.device)[0] < 8 or torch.version.hip:
        return False
    return hasattr(torch.cuda, "_compile_kernel")


def stage_bytes(kind: str, warps: int | None = None, mt: int | None = None) -> int:
    """Shared memory of one ring stage: the unit's weight words, scale words and 16 x 128 activation tile (at a
    256-byte aligned offset: the kernel's swizzle XORs the K step into the offset's bits 5-7)."""
    sz = 4 * block_n(kind, warps, mt) * scale_words(kind)
    return -(-(unit_bytes(kind, warps, mt) + sz) // 256) * 256 + 16 * BK * 2


def reduce_bytes(kind: str, rows16: bool, ksplit: int, warps: int | None = None, mt: int | None = None) -> int:
    """Shared memory where K part 1 hands its sums to part 0 (KSPLIT 2): one float4 per accumulator tile and
    thread."""
    nw, m = _layout(kind, warps, mt)
    return 0 if ksplit == 1 else m * (2 if rows16 else 1) * 16 * 32 * nw


def _occupancy(func, threads: int, smem: int) -> int:
    lib = torch.cuda._utils._get_gpu_runtime_library()
    n = ctypes.c_int(0)
    err = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), func, threads, ctypes.c_size_t(smem))
    if err != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed ({err})")
    return n.value


def _kernel(kind: str, dtype: torch.dtype, device: torch.device, rows16: bool, stages: int, ctas: int,
            ksplit: int = 1, warps: int | None = None, mt: int | None = None):
    """The compiled kernel, its shared memory and how many CTAs of it fit on one SM (cached per variant and
    device)."""
    nw, m = _layout(kind, warps, mt)
    key = (kind, dtype, device.index, rows16, stages, ctas, ksplit, nw, m, DEFINES)
    hit = _KERNELS.get(key)
    if hit is None:
        opts = [f"-DFP8={int(kind == 'fp8')}", f"-DNF4={int(kind == 'nf4')}",
                f"-DFP4={({'mxfp4': 1, 'nvfp4': 2}).get(kind, 0)}",
                f"-DACT_BF16={int(dtype == torch.bfloat16)}", f"-DSTAGES={stages}",
                f"-DROWS16={int(rows16)}", f"-DKSPLIT={ksplit}", f"-DNWARPS_N={nw}", f"-DMT4={m}",
                f"-DMIN_BLOCKS={ctas}", "-std=c++17", *(f"-D{d}" for d in DEFINES)]
        with torch.cuda.device(device):
            k = torch.cuda._compile_kernel(_SRC.read_text(), "wo_mma", nvcc_options=opts)
            smem = stages * stage_bytes(kind, nw, m) + reduce_bytes(kind, rows16, ksplit, nw, m)
            k.set_shared_memory_config(smem)
            hit = (k, smem, _occupancy(k.func, 32 * nw * ksplit, smem))
        _KERNELS[key] = hit
    return hit


def compiles(kind: str, dtype: torch.dtype, device: torch.device, rows16: bool, warps: int | None = None,
             mt: int | None = None) -> bool:
    """Whether the kernel variant for ``kind`` / ``dtype`` / ``rows16`` (9-16 rows) / unit layout compiles and
    loads on ``device`` with the launch table's shape. A failure (no NVRTC library, a driver that rejects the PTX, no
    CUDA) is warned about once and remembered, so callers can fall back to the Triton kernels without an error."""
    nw, m = _layout(kind, warps, mt)
    key = (kind, dtype, device, rows16, STAGES[kind], CTAS_PER_SM[kind], KSPLIT[kind], nw, m, DEFINES)
    if key in _FAILED:
        return False
    try:
        _kernel(kind, dtype, device, rows16, STAGES[kind], CTAS_PER_SM[kind], KSPLIT[kind], nw, m)
    except Exception as e:  # noqa: BLE001 (any failure to build means: use the other kernels)
        _FAILED[key] = e
        warnings.warn(f"MODE 9 ({kind}, {dtype}) cannot run on {device}: {e}; the Triton kernels take its calls",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def _partials(device: torch.device, ctas: int) -> torch.Tensor:
    """Per-device split partials (16 KB a CTA), all 0xFFFFFFFF (the kernel's "not written" sentinel) between
    launches: each launch's finishers write it back after reading."""
    hit = _BUFFERS.get(device.index)
    if hit is None or hit.numel() < ctas * UNIT_BYTES // 4:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MODE 9: its partial-sum buffer is made on an eager call, before graph capture")
        hit = torch.full((ctas * UNIT_BYTES // 4,), -1, dtype=torch.int32, device=device).view(torch.float32)
        _BUFFERS[device.index] = hit
    return hit


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


def _launch_pdl(func, grid: int, block: int, smem: int, stream: torch.cuda.Stream, args: list) -> None:
    """``cuLaunchKernelEx`` with programmatic stream serialization allowed (tensors -> pointers, ints -> int)."""
    keep = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in keep])
    attr = _LaunchAttr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttr.value.offset, (ctypes.c_int * 1)(1), 4)
    cfg = _LaunchConfig((ctypes.c_uint * 3)(grid, 1, 1), (ctypes.c_uint * 3)(block, 1, 1), smem,
                        ctypes.c_void_p(stream.cuda_stream), ctypes.pointer(attr), 1)
    lib = torch.cuda._utils._get_gpu_runtime_library()
    err = lib.cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
    if err != 0:
        raise RuntimeError(f"MODE 9: cuLaunchKernelEx failed ({err})")


def _launched_before(words: torch.Tensor) -> bool:
    """Whether ``words`` went through a launch already (and remember it). A repack's first launch may directly
    follow the kernels that wrote it, which an early (programmatic) launch would read before they finish."""
    ent = _LAUNCHED.get(id(words))
    if ent is not None and ent() is words:
        return True
    key = id(words)
    _LAUNCHED[key] = weakref.ref(words, lambda _: _LAUNCHED.pop(key, None))
    return False


def grid_size(units: int, sms: int, per_sm: int, occupancy: int) -> int:
    """One wave: at most ``occupancy`` CTAs per SM (all resident, so a finisher polling for partials cannot
    deadlock), never more CTAs than units."""
    return max(1, min(units, sms * min(per_sm, occupancy, MAX_CTAS_PER_SM)))


def matmul(x: torch.Tensor, kind: str, words: torch.Tensor, scales: torch.Tensor, n: int, kp: int, *,
           stages: int | None = None, ctas: int | None = None, ksplit: int | None = None,
           pdl: bool | None = None, warps: int | None = None, mt: int | None = None,
           grid: int | None = None, tables: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (bf16/fp16, :func:`available`) times a repacked weight (``kind`` ``"int4"`` / ``"fp8"`` /
    ``"nf4"`` / ``"mxfp4"`` / ``"nvfp4"``, logical ``[n, kp]``: ``words`` / ``scales`` from :func:`repack_int4` /
    :func:`repack_fp8` / :func:`repack_nf4` / :func:`repack_fp4`) -> ``[M, n]`` in ``x.dtype``. The codebook kinds
    (:data:`LUT_KINDS`) also take ``tables``, :func:`lut_tables` of their 16 values for ``x.dtype`` (int32 ``[9]``
    on x's device; MXFP4 bf16 ``x`` only). ``warps`` / ``mt`` name the repack's unit layout (:data:`LAYOUT` by
    default; they must be the ones the repack was made with). ``stages`` / ``ctas`` / ``ksplit`` / ``grid`` (CTAs,
    at most one wave) override the launch table; ``pdl`` the programmatic dependent launch (default: :data:`PDL` on
    sm90+; never on the first launch of a given ``words`` tensor, which may follow the kernels that wrote it: the
    weight is read before the launch's wait). Bad arguments raise ``ValueError`` naming them before anything is
    launched."""
    if kind not in STAGES:
        raise ValueError(f"kind: expected one of {sorted(STAGES)}, got {kind!r}")
    if isinstance(n, bool) or not isinstance(n, int) or not isinstance(kp, int) or n <= 0 or kp <= 0 or kp % BK:
        raise ValueError(f"n, kp: expected n > 0 and kp a positive multiple of {BK}, got {n!r}, {kp!r}")
    for name, v, lo, hi in (("stages", stages, 2, 8), ("ctas", ctas, 1, MAX_CTAS_PER_SM), ("ksplit", ksplit, 1, 2)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise ValueError(f"{name}: expected an int in [{lo}, {hi}] or None, got {v!r}")
    nw, mt = _layout(kind, warps, mt)
    bn = block_n(kind, nw, mt)
    units = math.ceil(n / bn) * (kp // BK)
    for name, t, dtype, numel in (("words", words, torch.int32, units * unit_bytes(kind, nw, mt) // 4),
                                  ("scales", scales, torch.float32 if kind in ("fp8", "nf4") else torch.int32,
                                   units * bn * scale_words(kind))):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {dtype} tensor of {numel} elements (the {kind} repack "
                             f"of an [{n}, {kp}] weight), got {getattr(t, 'dtype', type(t))} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if not isinstance(x, torch.Tensor) or not available(x):
        raise ValueError("x: MODE 9 needs a CUDA (sm80+, NVRTC) bf16/fp16 tensor [M <= 16, K] with unit column "
                         "stride and 16-byte aligned rows")
    if x.shape[1] != kp:
        raise ValueError(f"x: expected {kp} columns, got {x.shape[1]}")
    if words.device != x.device or scales.device != x.device:
        raise ValueError(f"words, scales: expected them on x's device {x.device}, got {words.device}, {scales.device}")
    if kind in LUT_KINDS and (not isinstance(tables, torch.Tensor) or tables.dtype != torch.int32
                              or tables.numel() != 9 or tables.device != x.device):
        raise ValueError(f"tables: {kind} needs lut_tables(codebook, x.dtype, ...), int32 [9] on x's device")
    if kind == "mxfp4" and x.dtype != torch.bfloat16:
        raise ValueError("x: MODE 9 takes MXFP4 with bf16 activations only")
    m = x.shape[0]
    st = STAGES[kind] if stages is None else stages
    per_sm = CTAS_PER_SM[kind] if ctas is None else ctas
    ks = KSPLIT[kind] if ksplit is None else ksplit
    k, smem, occ = _kernel(kind, x.dtype, x.device, m > 8, st, per_sm, ks, nw, mt)
    nb, kt = math.ceil(n / bn), kp // BK
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    g = grid_size(nb * kt, sms, per_sm, occ)
    if grid is not None:
        if isinstance(grid, bool) or not isinstance(grid, int) or not 1 <= grid <= g:
            raise ValueError(f"grid: expected an int in [1, {g}] (one wave, at most one CTA per unit) or None, "
                             f"got {grid!r}")
        g = grid
    ws = _partials(x.device, sms * MAX_CTAS_PER_SM)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ldx = x.stride(0) if m > 1 else kp
    args = [words, scales, x, y, ws, m, n, kt, nb, ldx] + ([tables] if kind in LUT_KINDS else [])
    stream = torch.cuda.current_stream(x.device)
    early = (PDL if pdl is None else pdl) and torch.cuda.get_device_capability(x.device)[0] >= 9
    if _launched_before(words) and early:
        _launch_pdl(k.func, g, 32 * nw * ks, smem, stream, args)
    else:
        k(grid=(g, 1, 1), block=(32 * nw * ks, 1, 1), args=args, shared_mem=smem, stream=stream)
    return y
