"""CPU fast path of the INT4 / INT8 weight-only matmul (``quant.wq_matmul``): ATen's packed CPU kernels for bf16
activations, the weight repacked once and kept beside it while it lives.

* INT4, group-wise (groups of 32-256, or per channel where K is a multiple of 32), any zero points, ``N % 16 == 0``:
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``. Its weight is ``(q - 8) * scale + zero`` per group, so ours,
  ``(q - z) * s``, is ``scale = s`` and ``zero = (8 - z) * s``, both rounded to bf16 as the kernel takes them.
* INT8, symmetric per output channel (the ``w8a16`` scheme): ``torch.ops.aten._weight_int8pack_mm`` over the
  signed codes ``q - 128`` (K padded with zeros to a multiple of 16: the kernel returns wrong sums for other K) and
  the bf16 scales.

Other formats, fp32 / fp16 activations (ATen's kernels are vectorized for bf16 only: 20-30x slower in fp32 on the
2-core AVX-512 CI machine) and a torch without these ops take the reference (dequantize, then matmul). On that
machine the packed kernels beat the reference at every row count measured (1-256: a 4096 x 4096 INT4 g128 weight,
1 row 0.46 ms vs 116 ms, 256 rows 52 ms vs 154 ms) and the bf16 ``F.linear`` of the dense weight at decode sizes
(1 row 0.46 vs 2.1 ms); ``benchmarks/bench_cpu_quant.py`` measures them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..devices import register
from . import naive
from .formats import IntWeight
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


def cpu_kind(w: IntWeight) -> str | None:
    """``"int4"`` / ``"int8"`` when a packed CPU kernel can take ``w`` (this torch has it), else None."""
    if not isinstance(w, IntWeight):
        return None
    if int4_group(w) is not None and _has("_weight_int4pack_mm_for_cpu"):
        return "int4"
    if w.bits == 8 and w.symmetric and w.scales.shape[1] == 1 and _has("_weight_int8pack_mm"):
        return "int8"
    return None


def pack_int4(w: IntWeight) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(packed codes, group size, scales_and_zeros bf16 [Kp / group, N, 2])`` for the INT4 kernel."""
    g = int4_group(w)
    if g is None:
        raise ValueError("w: the CPU INT4 kernel needs 4-bit codes, N % 16 == 0 and groups of 32-256 (or per-channel "
                         "scales with K a multiple of 32)")
    kp = w.padded_in_features
    reps = kp // g // w.scales.shape[1]  # > 1 only for per-channel scales
    s = w.scales.float().repeat_interleave(reps, 1)  # [N, Kp / g]
    z = w.zero_points().repeat_interleave(reps, 1)
    sz = torch.stack([s, (8.0 - z) * s], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes().contiguous(), 1)
    return codes, g, sz


def _int8_k(w: IntWeight) -> int:
    """K of the INT8 kernel's operands: Kp rounded up to 16 (it reads K in 16-wide steps: other K give wrong sums)."""
    return -(-w.padded_in_features // 16) * 16


def pack_int8(w: IntWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(signed codes int8 [N, K16], scales bf16 [N])`` for the INT8 kernel (K16: Kp rounded up to 16, the
    columns past Kp zero)."""
    if not (w.bits == 8 and w.symmetric and w.scales.shape[1] == 1):
        raise ValueError("w: the CPU INT8 kernel needs symmetric per-channel 8-bit weights")
    q = (w.codes() - 128).to(torch.int8)
    q = F.pad(q, (0, _int8_k(w) - q.shape[1])).contiguous()
    return q, w.scales[:, 0].to(torch.bfloat16).contiguous()


def wq_matmul_cpu(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T (+ bias [N]) -> [M, N]``: the packed kernels for bf16 ``x`` where
    :func:`cpu_kind` allows (the bias added in fp32 to their bf16 product), else the reference."""
    kind = cpu_kind(w) if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
    if kind is None:
        return naive.wq_matmul_ref(x, w, bias)
    kp = w.padded_in_features if kind == "int4" else _int8_k(w)
    xp = F.pad(x, (0, kp - x.shape[1])) if kp > x.shape[1] else x.contiguous()
    if kind == "int4":
        codes, g, sz = packed(w.qweight, ("cpu", "int4"), lambda: pack_int4(w))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xp, codes, g, sz)
    else:
        q, s = packed(w.qweight, ("cpu", "int8"), lambda: pack_int8(w))
        y = torch.ops.aten._weight_int8pack_mm(xp, q, s)
    return y if bias is None else (y.float() + bias.float()).to(x.dtype)


register("quant.wq_matmul", "cpu", wq_matmul_cpu, priority=5, available=lambda cap: cap.device_type == "cpu")
