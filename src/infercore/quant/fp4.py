"""FP4 e2m1 weights with block scales (OCP MXFP4, NVIDIA NVFP4): encoding, the reference decode, and the
*emulated* decode the kernels use (no FP4 instruction, so any GPU runs them, sm80 included).

An e2m1 code is 1 sign, 2 exponent (bias 1) and 1 mantissa bit: ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their
negatives. Two codes share a byte, element ``2j`` in the low nibble and ``2j + 1`` in the high one (the layout
of gpt-oss' MXFP4 checkpoints and of torch's ``float4_e2m1fn_x2``).

* **MXFP4** (OCP Microscaling v1.0): blocks of 32 along K share an e8m0 scale, a biased power of two ``2**(e -
  127)`` stored as one byte.
* **NVFP4**: blocks of 16 share an e4m3 scale, times one fp32 scale per tensor.

The emulated decode moves the code's bits into an fp16's (the FP8 path's trick, one size down)::

    bits = (q & 8) << 12 | (q & 7) << 9

The fp16 with those bits is the code's value times exactly ``2**-14``: for ``e >= 1`` the exponent field holds ``e``
(fp16 bias 15 against e2m1's 1) and the mantissa's top bit ``m``; for ``e = 0`` it is fp16's subnormal
``2**-14 * m / 2``, e2m1's subnormal ``m / 2`` times ``2**-14``. Kernels convert it to fp32 (exact) and fold the
``2**14`` into the block scale.
"""

from __future__ import annotations

import math

import torch

E2M1_MAX = 6.0
# Magnitudes of the codes 0..7 (code | 8 is the negative).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_EMU_FOLD = 2.0**14
BLOCK = {"mxfp4": 32, "nvfp4": 16}
E4M3_MAX = 448.0
# The smallest normal e4m3 (torch.finfo(torch.float8_e4m3fn).tiny): NVFP4 block scales never go below it.
E4M3_TINY = 2.0**-6


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (any shape) -> e2m1 codes ``uint8`` 0..15 (one per byte), round to nearest with ties to the even
    code, saturating at +-6; ``-0.0`` and negative values that round to zero keep the sign bit."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    x = x.float()
    a = x.abs()
    mids = torch.tensor((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), device=x.device)
    code = torch.bucketize(a, mids, right=True)  # codes whose lower midpoint is <= a
    # A value exactly on a midpoint went up; ties go to the even code (mantissa bit 0).
    tie = (code > 0) & (a == mids[(code - 1).clamp_min(0)])
    code = torch.where(tie & (code % 2 == 1), code - 1, code)
    sign = (x.view(torch.int32) < 0).to(torch.int64) << 3
    return (code | sign).to(torch.uint8)


def _check_codes(codes: object) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = getattr(codes, "dtype", type(codes))
        raise TypeError(f"codes: expected a uint8 tensor of e2m1 codes, got {got}")


def _check_weight(w: object, block: int) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise TypeError(f"w: expected a floating-point [N, K] tensor, got {getattr(w, 'shape', type(w))}")
    if w.shape[1] % block:
        raise ValueError(f"w: K = {w.shape[1]} is not a multiple of the block ({block})")


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``uint8`` 0..15 (any shape) -> fp32 values, by table (the reference)."""
    _check_codes(codes)
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return lut[codes.long()]


def e2m1_decode_emulated(codes: torch.Tensor, *, fold_scale: bool = True) -> torch.Tensor:
    """e2m1 codes -> fp32 with integer ops and an fp16 -> fp32 conversion only (the kernels' decode);
    ``fold_scale=False`` keeps the ``2**-14``."""
    _check_codes(codes)
    c = codes.to(torch.int16)
    v = (((c & 8) << 12) | ((c & 7) << 9)).view(torch.float16).float()
    return v * FP4_EMU_FOLD if fold_scale else v


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., 2K]`` codes 0..15 -> ``uint8 [..., K]``, element ``2j`` in the low nibble."""
    _check_codes(codes)
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: the last axis must hold an even number of codes, got {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``uint8 [..., K]`` -> codes ``uint8 [..., 2K]``."""
    _check_codes(packed)
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def e8m0_to_f32(e: torch.Tensor) -> torch.Tensor:
    """e8m0 biased exponents ``uint8`` -> fp32 ``2**(e - 127)`` (255, NaN in the spec, reads as inf here)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 127)


def mxfp4_quantize(w: torch.Tensor, *, scale_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` (K a multiple of 32) -> ``(codes uint8 [N, K / 2], e8m0 scales uint8 [N, K / 32])``.

    ``scale_mode``: ``"rceil"`` (default; the scale ``2**ceil(log2(amax / 6))``, no value clips) or ``"floor"``
    (the OCP spec's ``2**(floor(log2(amax)) - 2)``, which may clip up to 25% of a block's largest value to 6).
    Both as torchao's ``to_mx`` computes them."""
    _check_weight(w, 32)
    if scale_mode not in ("rceil", "floor"):
        raise ValueError(f"scale_mode: expected 'rceil' or 'floor', got {scale_mode!r}")
    n, k = w.shape
    x = w.float().reshape(n, k // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    if scale_mode == "rceil":
        e = (torch.clamp(torch.ceil(torch.log2(amax / E2M1_MAX)), min=-127, max=127) + 127).to(torch.uint8)
        rcp = torch.where(e == 0, 1.0, torch.exp2(127.0 - e.float()))
        data = torch.clamp(x * rcp, -E2M1_MAX, E2M1_MAX)
    else:
        pow2 = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
        e = (torch.clamp(pow2 - 2, min=-127, max=128) + 127).to(torch.uint8)
        scale = torch.clamp((e.to(torch.int32) << 23).view(torch.float32), min=torch.finfo(torch.float32).tiny)
        data = torch.clamp(x / scale, -E2M1_MAX, E2M1_MAX)
    return pack_nibbles(e2m1_encode(data).reshape(n, k)), e.reshape(n, k // 32)


def nvfp4_quantize(w: torch.Tensor, *, global_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``[N, K]`` (K a multiple of 16) -> ``(codes uint8 [N, K / 2], e4m3 scale bytes uint8 [N, K / 16],
    global_scale)``: two-level NVFP4, the per-tensor scale ``amax / (448 * 6)`` unless given, block scales
    ``amax_block / 6 / global_scale`` rounded to e4m3; as torchao's ``nvfp4_quantize`` computes them."""
    _check_weight(w, 16)
    if global_scale is not None and (isinstance(global_scale, bool) or not isinstance(global_scale, (int, float))
                                     or not math.isfinite(global_scale) or global_scale <= 0):
        raise ValueError(f"global_scale: expected a positive finite number or None, got {global_scale!r}")
    n, k = w.shape
    x = w.float().reshape(n, k // 16, 16)
    if global_scale is None:
        amax = float(x.abs().max())
        global_scale = amax / (E4M3_MAX * E2M1_MAX) if amax > 0 else 1.0
    g = torch.tensor(global_scale, dtype=torch.float32, device=x.device)
    block = x.abs().amax(-1) / E2M1_MAX
    s8 = torch.clamp(block / g, min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn)
    rcp = (1.0 / g) / s8.float()
    data = torch.clamp(x * rcp[..., None], -E2M1_MAX, E2M1_MAX)
    return pack_nibbles(e2m1_encode(data).reshape(n, k)), s8.view(torch.uint8), float(g)
