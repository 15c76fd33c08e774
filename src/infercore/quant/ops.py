"""Public quantized ops: validation, flattening, and dispatch through :mod:`infercore.devices`.

Op names (reference = ``"reference"``, kernels = ``"triton"``; native-FP8 kernels need a device
with ``native_fp8``; everything else runs wherever Triton does, sm80 included):

=========================  ============================================================
``quant.wq_matmul``        INT4/INT8 weight-only (:class:`IntWeight`), GEMV for M <= 4
``quant.fp8_wo_matmul``    FP8 weight-only, emulated decode (:class:`FP8Weight`)
``quant.gguf_matmul``      GGUF Q4_0/Q4_1/Q8_0 blocks (:class:`GGUFWeight`)
``quant.fp4_matmul``       FP4 e2m1 weight-only, MXFP4 / NVFP4 block scales, emulated decode (:class:`FP4Weight`)
``quant.nf4_matmul``       4-bit codebook weight-only, bitsandbytes NF4 / FP4 with absmax blocks (:class:`NF4Weight`)
``quant.per_token_quant``  fused per-token INT8/FP8 activation quantizer
``quant.w8a8_matmul``      INT8 W8A8 (+ MixQ outliers) and FP8 W8A8 scaled GEMM
``quant.fp8_decode``       e4m3 bytes -> fp32 (kernel: the emulated integer decode)
=========================  ============================================================
"""

from __future__ import annotations

import torch

from ..devices import capability, dispatch, register, triton_available
from . import naive
from .formats import FP4Weight, FP8Weight, GGUFWeight, Int8Weight, IntWeight, NF4Weight

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_x(op: str, x: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"{op}: x must be a fp32/fp16/bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: x must be [..., {k}], got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{op}: x is on {x.device} but the weight is on {device}")
    return x.reshape(-1, k)


def _check_bias(op: str, bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op}: bias must be [{n}], got {tuple(bias.shape)}")


def _weight_only(op: str, cls: type, x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(w, cls):
        raise TypeError(f"{op}: w must be a {cls.__name__}, got {type(w).__name__}")
    n, k = w.shape
    x2 = _check_x(op, x, k, next(iter(w.tensors().values())).device)
    _check_bias(op, bias, n)
    y = dispatch(op, x2.device)(x2, w, bias)
    return y.reshape(*x.shape[:-1], n)


def wq_matmul(x: torch.Tensor, w: IntWeight, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T (+ bias)`` for INT4/INT8 group-wise weights.

    Args:
        x: ``[..., K]`` fp32/fp16/bf16.
        w: :class:`IntWeight` of logical shape ``[N, K]``.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype`` (fp32 accumulation).
    """
    return _weight_only("quant.wq_matmul", IntWeight, x, w, bias)


def fp8_wo_matmul(x: torch.Tensor, w: FP8Weight, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T`` for e4m3 weights (per-channel or 128x128 block scales).

    Emulated decode on every GPU (no FP8 instruction); returns ``[..., N]`` in ``x.dtype``.
    """
    return _weight_only("quant.fp8_wo_matmul", FP8Weight, x, w, bias)


def gguf_matmul(x: torch.Tensor, w: GGUFWeight, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T`` reading GGUF Q4_0/Q4_1/Q8_0 blocks as stored; ``[..., N]`` in x.dtype."""
    return _weight_only("quant.gguf_matmul", GGUFWeight, x, w, bias)


def fp4_matmul(x: torch.Tensor, w: FP4Weight, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T (+ bias)`` for FP4 e2m1 weights with MXFP4 / NVFP4 block scales, decoded with integer
    operations on any GPU (no FP4 instruction).

    Args:
        x: ``[..., K]`` fp32/fp16/bf16, on the weight's device.
        w: :class:`FP4Weight` of logical shape ``[N, K]``.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype`` (fp32 accumulation).
    """
    return _weight_only("quant.fp4_matmul", FP4Weight, x, w, bias)


def nf4_matmul(x: torch.Tensor, w: NF4Weight, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T (+ bias)`` for 4-bit codebook weights (bitsandbytes NF4 / FP4) with absmax block scales.

    Args:
        x: ``[..., K]`` fp32/fp16/bf16, on the weight's device.
        w: :class:`NF4Weight` of logical shape ``[N, K]``.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    return _weight_only("quant.nf4_matmul", NF4Weight, x, w, bias)


def per_token_quant(
    x: torch.Tensor, *, act: str = "int8", smooth: torch.Tensor | None = None,
    outlier_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dynamic per-token symmetric quantization.

    Args:
        x: ``[M, K]`` fp32/fp16/bf16.
        act: ``"int8"`` (codes in [-127, 127], round half away from zero) or ``"fp8"`` (e4m3).
        smooth: optional fp32 ``[K]`` SmoothQuant factors; ``x / smooth`` is quantized.
        outlier_idx: optional int32 ``[n_out]`` channels excluded from quantization.

    Returns:
        ``(q [M, K] int8 | float8_e4m3fn, scale fp32 [M], x_out [M, n_out] x.dtype | None)``.
    """
    op = "quant.per_token_quant"
    if act not in ("int8", "fp8"):
        raise ValueError(f"{op}: act must be 'int8' or 'fp8', got {act!r}")
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or x.dim() != 2:
        raise TypeError(f"{op}: x must be a 2-D fp32/fp16/bf16 tensor")
    k = x.shape[1]
    if smooth is not None and (smooth.shape != (k,) or smooth.dtype != torch.float32):
        raise ValueError(f"{op}: smooth must be fp32 [{k}]")
    if outlier_idx is not None and (outlier_idx.dim() != 1 or outlier_idx.dtype != torch.int32):
        raise ValueError(f"{op}: outlier_idx must be int32 [n_out]")
    fn = dispatch(op, x.device)
    if act == "fp8" and x.device.type == "cuda" and not capability(x.device).native_fp8:
        fn = naive.per_token_quant_ref  # no fp32 -> e4m3 conversion instruction before sm89
    return fn(x, act=act, smooth=smooth, outlier_idx=outlier_idx)


def w8a8_matmul(
    qx: torch.Tensor, sx: torch.Tensor, w: Int8Weight, *, x_out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(qx @ qw.T) * sx[:, None] * sw[None, :] (+ x_out @ w_outlier.T) (+ bias)``.

    Args:
        qx: ``[M, K]`` int8 (``w.act == "int8"``) or float8_e4m3fn (``"fp8"``).
        sx: fp32 ``[M]`` per-token scales.
        w: :class:`Int8Weight` ``[N, K]``.
        x_out: ``[M, n_out]`` raw outlier activations (required when ``w`` has outliers).
        bias: optional ``[N]``.

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    op = "quant.w8a8_matmul"
    if not isinstance(w, Int8Weight):
        raise TypeError(f"{op}: w must be an Int8Weight, got {type(w).__name__}")
    n, k = w.shape
    want = torch.int8 if w.act == "int8" else torch.float8_e4m3fn
    if qx.dtype != want or qx.dim() != 2 or qx.shape[1] != k:
        raise ValueError(f"{op}: qx must be {want} [M, {k}], got {qx.dtype} {tuple(qx.shape)}")
    if sx.shape != (qx.shape[0],) or sx.dtype != torch.float32:
        raise ValueError(f"{op}: sx must be fp32 [{qx.shape[0]}]")
    if w.num_outliers and (x_out is None or x_out.shape != (qx.shape[0], w.num_outliers)):
        raise ValueError(f"{op}: x_out must be [{qx.shape[0]}, {w.num_outliers}] for a weight with outliers")
    _check_bias(op, bias, n)
    name = op if w.act == "int8" else "quant.fp8_w8a8_matmul"
    return dispatch(name, qx.device)(qx, sx, w, x_out=x_out, bias=bias, out_dtype=out_dtype)


def fp8_decode(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (``uint8``, any shape) -> fp32 values (same shape)."""
    if q.dtype != torch.uint8:
        raise TypeError(f"quant.fp8_decode: q must be uint8 e4m3 bytes, got {q.dtype}")
    return dispatch("quant.fp8_decode", q.device)(q)


register("quant.wq_matmul", "reference", naive.wq_matmul_ref)
register("quant.fp8_wo_matmul", "reference", naive.fp8_wo_matmul_ref)
register("quant.gguf_matmul", "reference", naive.gguf_matmul_ref)
register("quant.fp4_matmul", "reference", naive.fp4_matmul_ref)
register("quant.nf4_matmul", "reference", naive.nf4_matmul_ref)
register("quant.per_token_quant", "reference", naive.per_token_quant_ref)
register("quant.w8a8_matmul", "reference", naive.w8a8_matmul_ref)
register("quant.fp8_w8a8_matmul", "reference", naive.w8a8_matmul_ref)
register("quant.fp8_decode", "reference", naive.fp8_decode_ref)

from . import cpu as _cpu  # noqa: E402, F401  (registers the CPU fast path of quant.wq_matmul)

if triton_available():
    from . import triton_fp4, triton_nf4, triton_w8a8, triton_wo

    def _gpu(cap) -> bool:
        return cap.is_cuda and cap.triton

    register("quant.wq_matmul", "triton", triton_wo.wq_matmul_triton, priority=10, available=_gpu)
    register("quant.fp8_wo_matmul", "triton", triton_wo.fp8_wo_matmul_triton, priority=10, available=_gpu)
    register("quant.gguf_matmul", "triton", triton_wo.gguf_matmul_triton, priority=10, available=_gpu)
    register("quant.fp4_matmul", "triton", triton_fp4.fp4_matmul_triton, priority=10, available=_gpu)
    register("quant.nf4_matmul", "triton", triton_nf4.nf4_matmul_triton, priority=10, available=_gpu)
    register("quant.fp8_decode", "triton", triton_wo.fp8_decode_triton, priority=10, available=_gpu)
    register("quant.per_token_quant", "triton", triton_w8a8.per_token_quant_triton, priority=10,
             available=_gpu)
    register("quant.w8a8_matmul", "triton", triton_w8a8.w8a8_matmul_triton, priority=10, available=_gpu)
    register("quant.fp8_w8a8_matmul", "triton", triton_w8a8.w8a8_matmul_triton, priority=10,
             available=lambda cap: _gpu(cap) and cap.native_fp8)
