"""CPU fast path of the INT4 / INT8 weight-only matmul (``quant.wq_matmul``) and of GGUF blocks
(``quant.gguf_matmul``): ATen's packed CPU kernels for bf16 activations, the weight repacked once and kept beside it
while it lives.

* INT4, group-wise (groups of 32-256, or per channel where K is a multiple of 32), any zero points, ``N % 16 == 0``:
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``. Its weight is ``(q - 8) * scale + zero`` per group, so ours,
  ``(q - z) * s``, is ``scale = s`` and ``zero = (8 - z) * s``, both rounded to bf16 as the kernel takes them.
* GGUF Q4_0 / Q4_1 (``N % 16 == 0``): the same kernel in groups of 32, ``scale = d`` and ``zero = 0`` (Q4_0) or
  ``m + 8 d`` (Q4_1).
* INT8, symmetric per output channel (the ``w8a16`` scheme): ``torch.ops.aten._weight_int8pack_mm`` over the
  signed codes ``q - 128`` (K padded with zeros to a multiple of 16: the kernel returns wrong sums for other K) and
  the bf16 scales.

Decode rows (up to :data:`NATIVE_Q4_MAX_ROWS`) of INT4 weights in groups of 32-256, GGUF Q4_0 / Q4_1 blocks and
symmetric per-channel INT8 weights take the native kernels of ``ops.moe.cpu_native`` instead where they run
vectorized (AVX512-BF16): :func:`native_q4` / :func:`native_q8`, operands made once beside the weight; the fused CPU
decoder layer reads the same operands. The GGUF formats no ATen kernel takes run the native kernels up to
:data:`DECODE_MIN_ROWS_Q8_0` rows: Q8_0 and Q6_K the INT8 one (their codes as bytes, Q6_K in groups of 16), Q4_K
the INT4 one (its sub-blocks as groups of 32), Q5_0, Q5_1 and Q5_K the INT4 one with a plane of fifth bits, with
their exact fp32 scales and zeros (``quant.gguf.affine_parts``). From :data:`DECODE_MIN_ROWS` rows (prefill chunks)
those same operands are decoded to bf16 a cache-sized slice at a time into the dense GEMM instead
(:func:`_decoded_matmul`).

FP8 e4m3 weights (``quant.fp8_wo_matmul``, per channel or 128 x 128 blocks): bf16 rows up to
:data:`FP8_NATIVE_MAX_ROWS` run the native e4m3 GEMV over the codes as stored (``cpu_native.linear_fp8``); more bf16
rows decode the weight to bf16 a slice at a time into the dense GEMM (``cpu_native.dequant_fp8_rows``).

4-bit codebook weights (bitsandbytes NF4 / FP4, ``quant.nf4_matmul``): bf16 rows up to :data:`NF4_NATIVE_MAX_ROWS`
run the native codebook GEMV (``cpu_native.linear_lut4``); more decode the weight to bf16 a slice at a time into the
dense GEMM (``cpu_native.dequant_lut4_rows``).

INT8 W8A8 (``quant.w8a8_matmul``): the int8 x int8 products through ATen's int8 GEMM (``torch._int_mm``), bit-equal
to the reference, which multiplies in float64.

Other formats, fp32 / fp16 activations (ATen vectorizes these kernels for bf16 activations only) and a torch
without these ops take the reference (dequantize, then matmul). On a 2-core AVX-512 machine the packed kernels beat
the reference at every row count measured and the bf16 ``F.linear`` of the dense weight at decode sizes;
``benchmarks/bench_cpu_quant.py``, ``benchmarks/results/cpu/cpu_quant.json`` (figures in ``docs/quantization.md``).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ..devices import register
from . import naive
from .formats import FP4Weight, FP8Weight, GGUFWeight, Int8Weight, IntWeight, NF4Weight
from .gguf import BLOCK_BYTES, QK, q4_parts
from .repacks import packed

INT4_GROUPS = (256, 128, 64, 32)  # group sizes the INT4 kernel takes (per-channel scales are repeated over one)


def _has(op: str) -> bool:
    return hasattr(torch.ops.aten, op)


def int4_group(w: IntWeight) -> int | None:
    """The kernel group size for INT4 weight ``w`` (its own, or for per-channel scales the largest of
    :data:`INT4_GROUPS` dividing K), or None where the INT4 kernel cannot take it."""
    if w.bits != 4 or w.qweight.shape[0] % 16:
        return None
    kp = w.padded_in_features
    if w.scales.shape[1] > 1:
        return w.group_size if w.group_size in INT4_GROUPS else None
    return next((g for g in INT4_GROUPS if kp % g == 0), None)


def _format(w) -> str | None:
    """``"int4"`` / ``"int8"`` / ``"gguf4"``: the packed kernel whose format ``w`` fits, else None."""
    if isinstance(w, GGUFWeight):
        return "gguf4" if w.qtype in ("q4_0", "q4_1") and w.raw.shape[0] % 16 == 0 else None
    if not isinstance(w, IntWeight):
        return None
    if int4_group(w) is not None:
        return "int4"
    return "int8" if w.bits == 8 and w.symmetric and w.scales.shape[1] == 1 else None


def cpu_kind(w: IntWeight | GGUFWeight) -> str | None:
    """``"int4"`` / ``"int8"`` / ``"gguf4"`` when a packed CPU kernel can take ``w`` and this torch has it, else
    None."""
    kind = _format(w)
    return kind if kind and _has("_weight_int8pack_mm" if kind == "int8" else "_weight_int4pack_mm_for_cpu") else None


def _pack4(codes: torch.Tensor, g: int, scale: torch.Tensor, zero: torch.Tensor):
    """The INT4 kernel's operands for ``w = (codes - 8) * scale + zero`` per group of ``g``: ``(packed codes, g,
    scales_and_zeros bf16 [K / g, N, 2])`` from codes ``[N, K]`` in [0, 16) and fp32 ``scale`` / ``zero``
    ``[N, K / g]``."""
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1), g, sz


def pack_int4(w: IntWeight) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(packed codes, group size, scales_and_zeros bf16 [Kp / group, N, 2])`` for the INT4 kernel."""
    g = int4_group(w) if isinstance(w, IntWeight) else None
    if g is None:
        raise ValueError("w: the CPU INT4 kernel needs 4-bit codes, N % 16 == 0 and groups of 32-256 (or per-channel "
                         "scales with K a multiple of 32)")
    reps = w.padded_in_features // g // w.scales.shape[1]  # > 1 only for per-channel scales
    s = w.scales.float().repeat_interleave(reps, 1)  # [N, Kp / g]
    z = w.zero_points().repeat_interleave(reps, 1)
    return _pack4(w.codes(), g, s, (8.0 - z) * s)


def pack_gguf4(w: GGUFWeight) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(packed codes, 32, scales_and_zeros bf16 [K / 32, N, 2])`` for GGUF Q4_0 / Q4_1 blocks (``w = nib d + m``,
    :func:`gguf.q4_parts`): ``scale = d``, ``zero = m + 8 d``."""
    if _format(w) != "gguf4":
        raise ValueError("w: the CPU INT4 kernel takes Q4_0 / Q4_1 blocks with N % 16 == 0")
    n = w.raw.shape[0]
    nib, d, m = q4_parts(w.raw.reshape(n, -1, BLOCK_BYTES[w.qtype]), w.qtype)
    return _pack4(nib.reshape(n, -1), QK, d, m + 8.0 * d)


def _int8_k(w: IntWeight) -> int:
    """K of the INT8 kernel's operands: Kp rounded up to 16 (it reads K in 16-wide steps: other K give wrong sums)."""
    return -(-w.padded_in_features // 16) * 16


def pack_int8(w: IntWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(signed codes int8 [N, K16], scales bf16 [N])`` for the INT8 kernel (K16: Kp rounded up to 16, the
    columns past Kp zero)."""
    if _format(w) != "int8":
        raise ValueError("w: the CPU INT8 kernel needs symmetric per-channel 8-bit weights")
    q = (w.codes() - 128).to(torch.int8)
    q = F.pad(q, (0, _int8_k(w) - q.shape[1])).contiguous()
    return q, w.scales[:, 0].to(torch.bfloat16).contiguous()


# Rows up to which INT4 weights in groups of 32-256, GGUF Q4_0 / Q4_1 blocks and symmetric per-channel INT8 weights
# run the native kernels (ops.moe.cpu_native.linear_q4 / linear_q8); more rows take ATen's INT4 / INT8 GEMMs (their
# operands are packed copies of the weight, made at the first such call).
NATIVE_Q4_MAX_ROWS = 4


def _native_packed(store: torch.Tensor, key: str, make, w):
    """``make(w)``'s operands, made once and kept beside ``store`` (the weight's tensor), where the native kernels run
    vectorized and ``store`` is on the CPU; else None."""
    from ..ops.moe import cpu_native

    if store.device.type != "cpu" or not cpu_native.q4_supported():
        return None
    return packed(store, ("cpu", key), lambda: make(w))


def native_q4(w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native INT4 kernels' operands for ``w`` (``cpu_native.pack_q4`` / ``pack_gguf_q4``: codes uint8
    ``[N, Kp / 2]``, scales-and-zeros fp32 ``[N, 2, Kp / g]``), made once and kept beside the weight; None where
    those kernels cannot take ``w`` or do not run vectorized here."""
    from ..ops.moe import cpu_native

    if isinstance(w, IntWeight):
        if w.bits != 4 or w.group_size not in cpu_native.Q4_GROUPS or w.padded_in_features % w.group_size:
            return None
        return _native_packed(w.qweight, "native4", cpu_native.pack_q4, w)
    if cpu_native.gguf_bits(w) == 4:
        return _native_packed(w.raw, "native4", cpu_native.pack_gguf_q4, w)
    return None


def native_q8(w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native INT8 kernels' operands for a symmetric per-channel 8-bit ``w`` or GGUF Q8_0 / Q5_0 / Q5_1 / Q5_K /
    Q6_K / "mixed" blocks (``cpu_native.pack_q8`` / ``pack_gguf_q8``: codes uint8 ``[N, Kp]``, scales-and-zeros fp32
    ``[N, 2, Kp / g]``), made once and kept beside the weight; None where those kernels cannot take ``w`` or do not
    run vectorized here."""
    from ..ops.moe import cpu_native

    if cpu_native.gguf_bits(w) == 8:
        return _native_packed(w.raw, "native8", cpu_native.pack_gguf_q8, w)
    if _format(w) == "int8":
        return _native_packed(w.qweight, "native8", cpu_native.pack_q8, w)
    if isinstance(w, FP4Weight):
        return _native_packed(w.qweight, "native8", pack_fp4_q8, w)
    return None


def pack_fp4_q8(w: FP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The native INT8 operands of FP4 e2m1 codes (MXFP4 / NVFP4): twice an e2m1 value is an integer in [-12, 12],
    so the codes become Q8_0-style bytes ``2 v + 128`` with ``d = block scale / 2`` per block of 32 / 16 (sz ``d``
    and ``-2304 d``, as ``cpu_native.pack_gguf_q8`` lays Q8_0 out): exact, one byte a weight (the FP4 bytes' twice)."""
    from .fp4 import e2m1_decode, unpack_nibbles

    q = (e2m1_decode(unpack_nibbles(w.qweight.cpu())) * 2).to(torch.int16) + 128
    d = w.block_scales().cpu() * 0.5
    return q.to(torch.uint8).contiguous(), torch.stack([d, -2304.0 * d], 1).contiguous()


def native_q5(w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native 5-bit kernels' operands for GGUF Q5_0 / Q5_1 / Q5_K blocks (``cpu_native.pack_gguf_q5``: codes
    uint8 ``[N, K / 2]``, scales, zeros and fifth bits fp32 ``[N, 3, K / 32]``), made once and kept beside the weight;
    None where those kernels cannot take ``w`` or do not run vectorized here."""
    from ..ops.moe import cpu_native

    if cpu_native.gguf_bits(w) == 5:
        return _native_packed(w.raw, "native5", cpu_native.pack_gguf_q5, w)
    return None


def native_operands(w) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(codes, sz, bits)``: :func:`native_q4`'s operands (``bits=4``), else :func:`native_q5`'s (``bits=5``), else
    :func:`native_q8`'s (``bits=8``), else None (no native kernel takes ``w`` here)."""
    for fn, bits in ((native_q4, 4), (native_q5, 5), (native_q8, 8)):
        ops = fn(w)
        if ops is not None:
            return (*ops, bits)
    return None


def _native_kernel(w, kind: str | None, rows: int):
    """``(native GEMV, its operands)`` for ``rows`` bf16 rows against ``w`` of packed-kernel ``kind``
    (:func:`cpu_kind`), or None: decode rows of INT4 / GGUF Q4_0 / Q4_1 / INT8 weights, and the GGUF formats no ATen
    kernel takes (Q8_0, Q5_*, K-quants) at every row count."""
    from ..ops.moe import cpu_native

    if kind in ("int4", "gguf4") and rows <= NATIVE_Q4_MAX_ROWS:
        ops = native_q4(w)
        return None if ops is None else (cpu_native.linear_q4, ops)
    if kind == "int8" and rows <= NATIVE_Q4_MAX_ROWS:
        ops = native_q8(w)
        return None if ops is None else (cpu_native.linear_q8, ops)
    if kind is None and isinstance(w, (GGUFWeight, FP4Weight)):
        ops = native_operands(w)
        fn = {4: cpu_native.linear_q4, 5: cpu_native.linear_q5, 8: cpu_native.linear_q8}
        return None if ops is None else (fn[ops[2]], ops[:2])
    return None


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``y (+ bias)`` in ``dtype``: the bias added in fp32 to the kernels' bf16 product."""
    return y if bias is None else (y.float() + bias.float()).to(dtype)


# From this many rows (prefill chunks), a weight the native kernels take is decoded to bf16 a slice at a time and
# multiplied by the dense GEMM (oneDNN), instead of the packed kernels: DECODE_MIN_ROWS (the GGUF formats
# ATen has no kernel for, from DECODE_MIN_ROWS_Q8_0), slices of about DECODE_SLICE_BYTES (kept in the cache between
# the decode and the GEMM; one scratch buffer per thread, reused). 2-core EPYC (benchmarks/probe_cpu_prefill_quant.py,
# results/cpu/sweeps/cpu_quant_decoded_prefill.json): at 32 rows 4096 x 4096 INT4 takes 5.6 vs 7.0 ms (GGUF Q8_0 at
# 16 rows 5.7 vs 7.0), at 256 rows 2.1x (INT4) to 4.4x (Q8_0) the packed kernels, within 15% of the dense bf16 GEMM;
# on SmolLM2's 3072 x 576 about even at 32 rows (0.67-0.81 vs 0.70-0.82 ms); its 512-token prefill 657 vs 903 ms.
# Below these rows the packed kernels were as fast or faster in ad-hoc timings (16 rows INT4: 3.3 vs 5.3 ms).
DECODE_MIN_ROWS = 32
DECODE_MIN_ROWS_Q8_0 = 16
DECODE_SLICE_BYTES = 4 << 20
_scratch = threading.local()


def _decoded_matmul(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [M, K]`` bf16 ``@ W^T`` -> ``[M, N]`` bf16 with ``W`` the bf16-rounded weight behind native operands
    (:func:`native_operands`; ``cpu_native.dequant_rows``), decoded one slice of rows at a time into a reused buffer,
    each slice through ``torch.mm``: the dequantizing reference's values (the weight rounded to bf16, a bf16 GEMM)."""
    from ..ops.moe import cpu_native

    kp = codes.shape[1] * (1 if bits == 8 else 2)
    return _sliced_matmul(x, codes.shape[0], kp, lambda r0, r1, slab: cpu_native.dequant_rows(codes, sz, bits, r0, r1,
                                                                                              slab))


def _sliced_matmul(x: torch.Tensor, n: int, kp: int, decode) -> torch.Tensor:
    """``x [M, K]`` bf16 ``@ W^T`` -> ``[M, N]`` bf16, ``W [n, kp]`` (``kp >= K``: x padded with zeros) made a slice
    of rows at a time by ``decode(r0, r1, slab)`` (bf16 rows ``[r0, r1)`` into ``slab``, returned) in a reused
    per-thread buffer of about :data:`DECODE_SLICE_BYTES`, each slice through ``torch.mm``."""
    xp = F.pad(x, (0, kp - x.shape[1])) if kp > x.shape[1] else x.contiguous()
    rows = min(n, max(16, DECODE_SLICE_BYTES // (2 * kp) // 16 * 16))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * kp:
        buf = _scratch.buf = torch.empty(rows * kp, dtype=torch.bfloat16)
    slab = buf[: rows * kp].view(rows, kp)
    # x W^T, each slice's columns written in place (row-major with the output's stride): the same GEMM as W x^T
    # followed by a transpose took 4x the time (SmolLM2's 3072 x 576 at 2000 rows: 2.8 vs 11.3 ms,
    # benchmarks/results/cpu/sweeps/cpu_prefill_gemm_forms.json)
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        torch.mm(xp, decode(r0, r1, slab).t(), out=y[:, r0:r1])
    return y


def _matmul(x: torch.Tensor, w, bias: torch.Tensor | None, reference):
    """``x [M, K] @ dequant(w).T (+ bias [N]) -> [M, N]``: for bf16 ``x`` the native kernels where
    :func:`_native_kernel` names one, from :data:`DECODE_MIN_ROWS` rows the weight decoded slice by slice into a
    dense GEMM (:func:`_decoded_matmul`), else the packed kernels where :func:`cpu_kind` allows, else
    ``reference``."""
    bf16_cpu = x.dtype == torch.bfloat16 and x.device.type == "cpu"
    kind = cpu_kind(w) if bf16_cpu else None
    if bf16_cpu and x.shape[0] >= (DECODE_MIN_ROWS_Q8_0 if kind is None else DECODE_MIN_ROWS):
        ops = native_operands(w)
        if ops is not None:
            return _with_bias(_decoded_matmul(x, *ops), bias, x.dtype)
    native = _native_kernel(w, kind, x.shape[0]) if bf16_cpu else None
    if native is not None:
        fn, ops = native
        return _with_bias(fn(x, *ops), bias, x.dtype)
    if kind is None:
        return reference(x, w, bias)
    if kind == "int8":
        kp = _int8_k(w)
        q, s = packed(w.qweight, ("cpu", "int8"), lambda: pack_int8(w))
    else:
        store, make = (w.raw, pack_gguf4) if kind == "gguf4" else (w.qweight, pack_int4)
        codes, g, sz = packed(store, ("cpu", kind), lambda: make(w))
        kp = sz.shape[0] * g
    xp = F.pad(x, (0, kp - x.shape[1])) if kp > x.shape[1] else x.contiguous()
    if kind == "int8":
        y = torch.ops.aten._weight_int8pack_mm(xp, q, s)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xp, codes, g, sz)
    return _with_bias(y, bias, x.dtype)


def wq_matmul_cpu(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.wq_matmul`` on the CPU: ``x [M, K]`` (fp32 / fp16 / bf16) times an INT4 / INT8 ``w`` of logical
    shape ``[N, K]`` (+ ``bias [N]``) -> ``[M, N]`` in ``x.dtype``; the packed kernels for bf16 ``x`` and the formats
    :func:`cpu_kind` names, else the reference. Arguments are checked by the op (``quant.wq_matmul``)."""
    return _matmul(x, w, bias, naive.wq_matmul_ref)


def gguf_matmul_cpu(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.gguf_matmul`` on the CPU: ``x [M, K]`` times GGUF blocks of logical shape ``[N, K]`` (+ ``bias [N]``)
    -> ``[M, N]`` in ``x.dtype``; with bf16 ``x`` the native or packed kernels (module docstring), else the reference.
    Arguments are checked by the op (``quant.gguf_matmul``)."""
    return _matmul(x, w, bias, naive.gguf_matmul_ref)


def _on_cpu(cap) -> bool:
    return cap.device_type == "cpu"


def fp4_matmul_cpu(x: torch.Tensor, w: FP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.fp4_matmul`` on the CPU: with bf16 ``x`` the native INT8 kernels over :func:`pack_fp4_q8`'s bytes
    (decode rows), or those bytes decoded slice by slice into a dense GEMM (from ``DECODE_MIN_ROWS_Q8_0`` rows), else
    the reference. Arguments are checked by the op."""
    return _matmul(x, w, bias, naive.fp4_matmul_ref)


# Rows up to which FP8 weights run the native e4m3 GEMV (cpu_native.linear_fp8: a pass over the weight serves 4 rows);
# more rows (prefill chunks) decode the weight to bf16 a slice at a time into the dense GEMM (_sliced_matmul).
FP8_NATIVE_MAX_ROWS = 8


def fp8_wo_matmul_cpu(x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.fp8_wo_matmul`` on the CPU: with bf16 ``x`` of up to :data:`FP8_NATIVE_MAX_ROWS` rows the native e4m3
    GEMV over the codes as stored (``cpu_native.linear_fp8``: each code decoded to its exact bf16, the products summed
    in fp32 and scaled per row or per 128 x 128 block; no copy of the weight), where it runs vectorized; with more bf16
    rows the weight decoded to bf16 (code times scale, rounded) a slice at a time into the dense GEMM
    (``cpu_native.dequant_fp8_rows``); else the reference. Arguments are checked by the op."""
    from ..ops.moe import cpu_native

    if (x.dtype == torch.bfloat16 and x.shape[0] <= FP8_NATIVE_MAX_ROWS and w.block_size in (None, 128)
            and w.qweight.device.type == "cpu" and cpu_native.q4_supported()):
        y = cpu_native.linear_fp8(x, w.qweight, w.scales.float(), w.block_size)
        return _with_bias(y, bias, x.dtype)
    if (x.dtype == torch.bfloat16 and w.block_size in (None, 128) and w.qweight.device.type == "cpu"
            and cpu_native.q4_supported()):
        codes, scales = w.qweight.contiguous(), w.scales.float().contiguous()
        y = _sliced_matmul(x, codes.shape[0], codes.shape[1], lambda r0, r1, slab: cpu_native.dequant_fp8_rows(
            codes, scales, w.block_size, r0, r1, slab))
        return _with_bias(y, bias, x.dtype)
    return naive.fp8_wo_matmul_ref(x, w, bias)


# Rows up to which NF4 weights run the native GEMV (cpu_native.linear_lut4); more rows decode the weight to bf16 a
# slice at a time into the dense GEMM.
NF4_NATIVE_MAX_ROWS = 4


def nf4_matmul_cpu(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.nf4_matmul`` on the CPU: with bf16 ``x`` of up to :data:`NF4_NATIVE_MAX_ROWS` rows the native GEMV over
    the codes as stored (``cpu_native.linear_lut4``: each codebook value scaled by its block's absmax, times the
    activations, summed in fp32); with more bf16 rows the weight decoded to bf16 (codebook value times absmax,
    rounded) a slice of rows at a time into the dense GEMM (``cpu_native.dequant_lut4_rows``); else the reference.
    Arguments are checked by the op."""
    from ..ops.moe import cpu_native

    if x.dtype == torch.bfloat16 and w.qweight.device.type == "cpu" and cpu_native.q4_supported():
        codes, absmax, lut = w.qweight.contiguous(), w.absmax.contiguous(), w.codebook.contiguous()
        if x.shape[0] <= NF4_NATIVE_MAX_ROWS:
            ops = cpu_native.lut4_operands(w)
            return _with_bias(cpu_native.linear_lut4(x, codes, absmax, lut, ops), bias, x.dtype)
        y = _sliced_matmul(x, codes.shape[0], 2 * codes.shape[1], lambda r0, r1, slab: cpu_native.dequant_lut4_rows(
            codes, absmax, lut, r0, r1, slab))
        return _with_bias(y, bias, x.dtype)
    return naive.nf4_matmul_ref(x, w, bias)


def w8a8_matmul_cpu(qx: torch.Tensor, sx: torch.Tensor, w: Int8Weight, *, x_out: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``quant.w8a8_matmul`` (INT8 activations and weights) on the CPU: the integer products through ATen's int8
    GEMM (``torch._int_mm``, int32 sums: exact, where the reference sums in float64, also exact), then the
    reference's scaling, outlier and bias steps in its order: bit-equal to ``naive.w8a8_matmul_ref``. Arguments
    are checked by the op."""
    if w.act != "int8" or qx.device.type != "cpu" or w.qweight.device.type != "cpu":
        return naive.w8a8_matmul_ref(qx, sx, w, x_out=x_out, bias=bias, out_dtype=out_dtype)
    y = torch._int_mm(qx.contiguous(), w.qweight.t()).float() * sx.float()[:, None] * w.scales.float()[None, :]
    if w.num_outliers and x_out is not None:
        y = y + x_out.float() @ w.w_outlier.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


register("quant.wq_matmul", "cpu", wq_matmul_cpu, priority=5, available=_on_cpu)
register("quant.w8a8_matmul", "cpu", w8a8_matmul_cpu, priority=5, available=_on_cpu)
register("quant.nf4_matmul", "cpu", nf4_matmul_cpu, priority=5, available=_on_cpu)
register("quant.fp8_wo_matmul", "cpu", fp8_wo_matmul_cpu, priority=5, available=_on_cpu)
register("quant.fp4_matmul", "cpu", fp4_matmul_cpu, priority=5, available=_on_cpu)
register("quant.gguf_matmul", "cpu", gguf_matmul_cpu, priority=5, available=_on_cpu)
