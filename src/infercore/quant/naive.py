"""Pure-PyTorch references of the quantized ops (the specification the kernels are tested against).

All math is fp32 (integer dots in fp64, which is exact up to 2**53); outputs are cast at the end.
Activations are 2-D ``[M, K]`` here; the public wrappers in :mod:`infercore.quant.ops` flatten.
"""

from __future__ import annotations

import torch

from ..ops.kv_cache.quant import round_half_away
from .formats import FP4Weight, FP8Weight, GGUFWeight, Int8Weight, IntWeight, NF4Weight
from .fp8 import E4M3_MAX

# Per-token scales never drop below this (an all-zero row quantizes to zeros, not NaN).
ACT_SCALE_EPS = 1e-8


def _dequant_matmul(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.dequantize(torch.float32).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def wq_matmul_ref(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T (+ bias [N]) -> [M, N]`` in ``x.dtype`` (fp32 math)."""
    return _dequant_matmul(x, w, bias)


def fp8_wo_matmul_ref(x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T (+ bias [N]) -> [M, N]`` in ``x.dtype`` (fp32 math; the e4m3 decode
    is torch's own float8_e4m3fn conversion)."""
    return _dequant_matmul(x, w, bias)


def gguf_matmul_ref(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T (+ bias [N]) -> [M, N]`` in ``x.dtype`` (fp32 math; blocks decoded by
    ``quant.gguf``)."""
    return _dequant_matmul(x, w, bias)


def fp4_matmul_ref(x: torch.Tensor, w: FP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T (+ bias [N]) -> [M, N]`` in ``x.dtype`` (fp32 math; e2m1 codes decoded by table)."""
    return _dequant_matmul(x, w, bias)


def nf4_matmul_ref(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T (+ bias [N]) -> [M, N]`` in ``x.dtype`` (fp32 math; codes looked up in the
    codebook, times the block's absmax)."""
    return _dequant_matmul(x, w, bias)


def fp8_decode_ref(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes ``uint8`` -> fp32 through torch's own ``float8_e4m3fn`` conversion."""
    return q.view(torch.float8_e4m3fn).float()


def per_token_quant_ref(
    x: torch.Tensor, *, act: str = "int8", smooth: torch.Tensor | None = None,
    outlier_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dynamic per-token symmetric quantization of ``x [M, K]``.

    Returns ``(q, scale, x_out)``: ``q`` int8 (``act="int8"``) or float8_e4m3fn (``"fp8"``)
    ``[M, K]``; ``scale`` fp32 ``[M]`` with ``x / smooth ~= q * scale`` on ordinary channels;
    ``x_out`` ``[M, n_out]`` in ``x.dtype``: the raw values of the outlier channels, which are
    zero in ``q`` and excluded from the scale (None without outliers).
    """
    xf = x.float()
    if smooth is not None:
        xf = xf / smooth.float()
    x_out = None
    if outlier_idx is not None and outlier_idx.numel():
        x_out = x[:, outlier_idx.long()].contiguous()
        xf = xf.clone()
        xf[:, outlier_idx.long()] = 0.0
    qmax = 127.0 if act == "int8" else E4M3_MAX
    scale = xf.abs().amax(1).clamp_min(ACT_SCALE_EPS) / qmax
    v = xf / scale[:, None]
    if act == "int8":
        q = round_half_away(v).clamp(-127, 127).to(torch.int8)
    else:
        q = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale, x_out


def w8a8_matmul_ref(
    qx: torch.Tensor, sx: torch.Tensor, w: Int8Weight, *, x_out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(qx @ qw.T) * sx[:, None] * sw[None, :] + x_out @ w_outlier.T (+ bias)`` -> ``[M, N]``."""
    if w.act == "fp8":
        a, b = qx.float().double(), w.qweight.view(torch.float8_e4m3fn).double()
    else:
        a, b = qx.double(), w.qweight.double()
    y = (a @ b.T).float() * sx.float()[:, None] * w.scales.float()[None, :]
    if w.num_outliers and x_out is not None:
        y = y + x_out.float() @ w.w_outlier.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
