"""FP8 e4m3 helpers: encoding, and the *emulated* decode used on GPUs without FP8 units.

The emulated decode (Chitu's trick) turns an e4m3 byte into an fp32 bit pattern with two shifts::

    bits = (x & 0x80) << 24 | (x & 0x7F) << 20

e4m3 is 1 sign, 4 exponent (bias 7) and 3 mantissa bits; moving exponent+mantissa up by 20 bits
drops them into the low 4 bits of fp32's 8-bit exponent (bias 127) and the top 3 mantissa bits. The
resulting fp32 equals the e4m3 value times exactly ``2**-120`` -- for normal values (the exponent is
re-biased by 127 - 7) and for subnormal ones too (exponent field 0 stays 0, and fp32's subnormal
step 2**-149 times 2**20 is e4m3's 2**-9 times 2**-120). The constant factor is folded into the
weight scale, so a kernel needs no FP8 instruction (sm80 and older run it). The NaN encodings
(0x7F/0xFF) become fp32 values, not NaN; quantizers never produce them (they clamp to +-448).
"""

from __future__ import annotations

import torch

from ..ops.kv_cache.quant import E4M3_MAX

# The emulated decode is off by exactly this power of two; kernels multiply it into the scale.
FP8_EMU_FOLD = 2.0**120


def fp8_e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32/fp16/bf16 values -> e4m3 bytes (``uint8``, same shape), round-to-nearest-even, saturating."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_e4m3_decode_emulated(q: torch.Tensor, *, fold_scale: bool = True) -> torch.Tensor:
    """e4m3 bytes (``uint8`` any shape) -> fp32 values with integer ops only (the emulated decode).

    With ``fold_scale=False`` returns the raw bit-pattern value (true value times ``2**-120``).
    """
    if q.dtype != torch.uint8:
        raise TypeError(f"q: expected uint8 e4m3 bytes, got {q.dtype}")
    x = q.to(torch.int32)
    bits = ((x & 0x80) << 24) | ((x & 0x7F) << 20)
    v = bits.view(torch.float32)
    return v * FP8_EMU_FOLD if fold_scale else v
