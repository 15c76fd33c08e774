"""Conversion between :class:`IntWeight` and the AWQ / GPTQ checkpoint packings.

GPTQ (AutoGPTQ / GPTQModel ``gptq`` v1 format), ``pack = 32 // bits`` codes per int32:

* ``qweight`` int32 ``[K / pack, N]``: word ``[i, n]`` holds ``k = pack*i + j`` at bits ``bits*j``.
* ``qzeros`` int32 ``[K / g, N / pack]``: word ``[G, c]`` holds the zero of ``n = pack*c + j``,
  stored minus one (v1's historical off-by-one), so ``z = stored + 1``.
* ``scales`` fp16 ``[K / g, N]``; ``g_idx`` int32 ``[K]``: ``k // g``, or with act-order (``desc_act``) any
  assignment of ``g`` channels per group (:func:`from_gptq_act_order`).

AWQ (``GEMM`` version, 4 bits): ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32
``[K / g, N / 8]`` pack along N in the interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``j``
holds column ``8c + order[j]``); ``scales`` fp16 ``[K / g, N]``; zeros are stored as is.
In both, ``w[n, k] = (q - z) * s``.
"""

from __future__ import annotations

import torch

from .formats import IntWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_last(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[..., W]`` -> codes int32 ``[..., W * 32/bits]`` (code ``j`` of a word at bits ``bits*j``)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=words.device, dtype=torch.int32) * bits
    codes = (words[..., None] >> shifts) & (2**bits - 1)
    return codes.reshape(*words.shape[:-1], -1)


def _pack_last(codes: torch.Tensor, bits: int) -> torch.Tensor:
    pack = 32 // bits
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, pack)
    shifts = torch.arange(pack, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)
    # Wrap to int32 two's complement (the top code sets the sign bit).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, K]`` -> :class:`IntWeight` byte layout."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if bits == 4 else q.contiguous()


def from_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, bits: int = 4,
    group_size: int, g_idx: torch.Tensor | None = None, zero_offset: int = 1,
) -> IntWeight:
    """GPTQ tensors -> :class:`IntWeight` (shapes in the module docstring). ``zero_offset`` is added to the
    stored zeros: 1 for the v1 ``gptq`` format (zeros stored minus one), 0 for ``gptq_v2``. An act-order
    ``g_idx`` (not ``k // group_size``) is refused here: :func:`from_gptq_act_order` takes it."""
    k = _check_gptq(qweight, qzeros, bits, group_size)
    if g_idx is not None and not torch.equal(g_idx.cpu().long(), torch.arange(k) // group_size):
        raise ValueError("g_idx: an act-order (desc_act) g_idx; use from_gptq_act_order, which also returns "
                         "the input permutation")
    q = _unpack_last(qweight.t().contiguous(), bits)  # [N, K]
    return IntWeight(_pack_codes(q, bits), scales.t().float().contiguous(), _gptq_zeros(qzeros, bits, zero_offset),
                     bits, group_size, k)


def from_gptq_act_order(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, *, bits: int = 4,
    group_size: int, zero_offset: int = 1,
) -> tuple[IntWeight, torch.Tensor]:
    """An act-order (``desc_act``) GPTQ layer -> ``(w, perm)``: input channel ``k`` belongs to group ``g_idx[k]``,
    so the channels are sorted by group (``perm``: int64 ``[K]``, stable) and ``w`` holds the columns in that
    order, ``w.dequantize()[:, j]`` = the layer's weight column ``perm[j]``; the layer computes
    ``x[..., perm] @ w^T`` (:class:`~infercore.quant.QuantLinear`'s ``in_perm``), as exllama and vLLM do. Every
    group must hold exactly ``group_size`` channels."""
    k = _check_gptq(qweight, qzeros, bits, group_size)
    if not isinstance(g_idx, torch.Tensor) or g_idx.dtype not in (torch.int32, torch.int64) or g_idx.shape != (k,):
        raise ValueError(f"g_idx: expected an int32 / int64 [{k}] tensor")
    gi = g_idx.cpu().long()
    if int(gi.min()) < 0 or not torch.equal(torch.bincount(gi, minlength=k // group_size),
                                            torch.full((k // group_size,), group_size)):
        raise ValueError(f"g_idx: every one of the {k // group_size} groups must hold {group_size} input channels")
    perm = torch.argsort(gi, stable=True)
    q = _unpack_last(qweight.t().contiguous(), bits)[:, perm.to(qweight.device)]  # [N, K] in group order
    w = IntWeight(_pack_codes(q, bits), scales.t().float().contiguous(), _gptq_zeros(qzeros, bits, zero_offset),
                  bits, group_size, k)
    return w, perm.to(qweight.device)


def _check_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, group_size: int) -> int:
    """K of a GPTQ layer, after checking the packing's dtypes, ``bits`` and ``group_size``."""
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 4 or 8, got {bits}")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise TypeError("qweight/qzeros: expected int32 tensors")
    k = qweight.shape[0] * (32 // bits)
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size: {group_size} does not divide K={k}")
    return k


def _gptq_zeros(qzeros: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """The zero points uint8 ``[N, K / g]`` of GPTQ ``qzeros`` (stored minus ``zero_offset``)."""
    if zero_offset not in (0, 1):
        raise ValueError(f"zero_offset: expected 0 (gptq_v2) or 1 (gptq), got {zero_offset!r}")
    z = _unpack_last(qzeros, bits).t() + zero_offset  # [N, K/g]
    if int(z.max()) >= 2**bits:
        raise ValueError(f"qzeros: a zero point reaches {int(z.max())}, outside the {bits}-bit codes "
                         "(a v1 checkpoint's zero of 0 cannot be stored; or the checkpoint is gptq_v2)")
    return z.to(torch.uint8).contiguous()


def to_gptq(w: IntWeight) -> dict[str, torch.Tensor]:
    """:class:`IntWeight` -> ``{"qweight", "qzeros", "scales", "g_idx"}`` in GPTQ v1 layout."""
    if w.in_features != w.padded_in_features:
        raise ValueError("w: K must be a multiple of the group size for GPTQ export")
    q = w.codes()  # [N, K]
    z = w.zero_points().to(torch.int32) - 1
    k = w.in_features
    return {
        "qweight": _pack_last(q, w.bits).t().contiguous(),
        "qzeros": _pack_last(z.t().contiguous(), w.bits),
        "scales": w.scales.t().to(torch.float16).contiguous(),
        "g_idx": (torch.arange(k, dtype=torch.int32) // w.group_size),
    }


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int
) -> IntWeight:
    """AWQ GEMM tensors (4-bit) -> :class:`IntWeight`."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise TypeError("qweight/qzeros: expected int32 tensors")
    k = qweight.shape[0]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size: {group_size} does not divide K={k}")
    inv = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=qweight.device)

    def unpack(words: torch.Tensor) -> torch.Tensor:
        c = _unpack_last(words, 4).view(*words.shape, 8)
        return c[..., inv].reshape(*words.shape[:-1], -1)

    q = unpack(qweight).t()  # [N, K]
    z = unpack(qzeros).t()  # [N, K/g]
    return IntWeight(_pack_codes(q, 4), scales.t().float().contiguous(),
                     z.to(torch.uint8).contiguous(), 4, group_size, k)


def to_awq(w: IntWeight) -> dict[str, torch.Tensor]:
    """:class:`IntWeight` (4-bit) -> ``{"qweight", "qzeros", "scales"}`` in AWQ GEMM layout."""
    if w.bits != 4 or w.in_features != w.padded_in_features:
        raise ValueError("w: AWQ export needs 4-bit weights with K a multiple of the group size")
    order = torch.tensor(AWQ_ORDER, device=w.qweight.device)

    def pack(codes: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        c = codes.reshape(codes.shape[0], -1, 8)[..., order]
        return _pack_last(c.reshape(codes.shape[0], -1), 4)

    return {
        "qweight": pack(w.codes().t().contiguous()),
        "qzeros": pack(w.zero_points().to(torch.int32).t().contiguous()),
        "scales": w.scales.t().to(torch.float16).contiguous(),
    }
