"""GGML tensor types and vectorized numpy dequantizers for GGUF block formats.

Every block format stores a run of ``block_elems`` consecutive values of a row (ggml's fastest
dimension, torch's last) in ``block_bytes`` bytes. A dequantizer takes the blocks as a ``uint8``
array ``[n_blocks, block_bytes]`` and returns fp32 values ``[n_blocks, block_elems]``; rows are
whole numbers of blocks, so the caller only reshapes. The arithmetic follows ggml's reference C
(``dequantize_row_*`` in ggml-quants.c) operation by operation, so results are bit-identical to
llama.cpp's and to the ``gguf`` Python package's.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum

import numpy as np

QK_K = 256  # elements in a K-quant super-block


class GGMLType(IntEnum):
    """ggml tensor type ids, as stored in a GGUF tensor info (``ggml_type`` in ggml.h)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# (elements per block, bytes per block); plain types are "blocks" of one element. Every type whose
# size is known can be read raw (``GGUFFile.raw``) even when there is no dequantizer for it here.
BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.F64: (1, 8),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 4 + 32),
    GGMLType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    GGMLType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType.Q8_K: (QK_K, 4 + QK_K + QK_K // 8),
    GGMLType.IQ2_XXS: (QK_K, 2 + QK_K // 4),
    GGMLType.IQ2_XS: (QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: (QK_K, 2 + QK_K // 4 + QK_K // 8),
    GGMLType.IQ1_S: (QK_K, 2 + QK_K // 8 + QK_K // 16),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType.IQ2_S: (QK_K, 2 + QK_K // 4 + QK_K // 16),
    GGMLType.IQ4_XS: (QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    GGMLType.IQ1_M: (QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType.TQ1_0: (QK_K, 2 + 4 * 13),
    GGMLType.TQ2_0: (QK_K, 2 + 64),
    GGMLType.MXFP4: (32, 1 + 16),
}


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 scale at byte ``start`` of every block, as fp32 ``[n_blocks, 1]``."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n, 16]`` packed bytes -> ``[n, 32]`` values: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """``[n, 4]`` bytes of a little-endian uint32 -> ``[n, 32]`` bit j of it, as uint8."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)
    return d * q + m


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:22]) | (_high_bits_32(blocks[:, 2:6]) << 4)
    return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:24]) | (_high_bits_32(blocks[:, 4:8]) << 4)
    return d * q.astype(np.float32) + m


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0)
    return blocks[:, 2:34].view(np.int8).astype(np.float32) * d


def _q8_k(blocks: np.ndarray) -> np.ndarray:
    # The trailing int16 block sums only serve dot products; dequantization ignores them.
    d = np.ascontiguousarray(blocks[:, 0:4]).view(np.float32)
    return d * blocks[:, 4 : 4 + QK_K].view(np.int8).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte, 6-bit (scale, min) pairs of Q4_K/Q5_K -> two ``[n, 8]`` uint8 arrays.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low nibbles of
    scales 4-7 (low half) and mins 4-7 (high half), whose top two bits sit in the spare top bits of
    bytes 0-3 (scales) and 4-7 (mins) -- ``get_scale_min_k4`` in ggml-quants.c.
    """
    s_lo, m_lo, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([s_lo & 0x3F, (hi & 0x0F) | ((s_lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([m_lo & 0x3F, (hi >> 4) | ((m_lo >> 6) << 4)], axis=-1)
    return sc, mn


def _k_affine(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``d*sc_j * q - dmin*m_j`` over 8 sub-blocks of 32, for Q4_K/Q5_K; q is ``[n, 8, 32]``."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    return (dl * q.astype(np.float32) - ml).reshape(n, QK_K)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    # 4 chunks of 32 bytes: each chunk's low nibbles are sub-block 2c, its high nibbles 2c+1.
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    return _k_affine(blocks, q)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    qs = blocks[:, 48:176].reshape(n, 4, 1, 32)
    ql = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    # Bit j of qh[l] is the fifth bit of element l of sub-block j.
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _k_affine(blocks, ql | (high << 4))


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)  # two halves of 128 elements
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    # Within a half: elements [0,32) and [64,96) take the low/high nibbles of ql[0:32],
    # [32,64) and [96,128) those of ql[32:64]; qh bit pairs 0,2,4,6 supply the top two bits.
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    dl = (d * scales).reshape(n, 16, 1)  # one scale per 16 elements
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
    # Each half of 128: 32 bytes, four 2-bit planes (shifts 0,2,4,6) of 32 elements each.
    q = (qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    return (dl * q.reshape(n, 16, 16).astype(np.float32) - ml).reshape(n, QK_K)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    hmask = blocks[:, 0:32].reshape(n, 1, 32)
    qs = blocks[:, 32:96].reshape(n, 2, 1, 32)
    raw = blocks[:, 96:108]
    d = _f16(blocks, 108)
    # 16 6-bit scales: low nibbles from bytes 0-7 (scale j in byte j%8, nibble j//8), top two bits
    # from bytes 8-11 (scale j in byte 8 + j%4, bit pair j//4).
    lo = np.concatenate([raw[:, 0:8] & 0x0F, raw[:, 0:8] >> 4], axis=-1)
    hi = (raw[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
    scales = (lo | (hi.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)
    dl = (d * scales.astype(np.float32)).reshape(n, 16, 1)
    ql = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    # hmask bit j of byte l is the (inverted) third bit of element l of the j-th group of 32.
    hbit = (hmask >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = ql.astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


_DEQUANTIZERS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
    GGMLType.Q8_K: _q8_k,
}

PLAIN_TYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype(np.float32),
    GGMLType.F16: np.dtype(np.float16),
    GGMLType.F64: np.dtype(np.float64),
    GGMLType.I8: np.dtype(np.int8),
    GGMLType.I16: np.dtype(np.int16),
    GGMLType.I32: np.dtype(np.int32),
    GGMLType.I64: np.dtype(np.int64),
}

# Everything ``dequantize`` accepts: block formats above, plain floats, and BF16.
DEQUANTIZABLE = frozenset(_DEQUANTIZERS) | {GGMLType.F32, GGMLType.F16, GGMLType.BF16}


def dequantize(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """Dequantize GGUF blocks to fp32.

    Args:
        blocks: ``uint8`` array ``[n_blocks, block_bytes]`` (any leading shape whose last dim is
            ``block_bytes`` is accepted and flattened), in file order.
        ggml_type: a ``GGMLType`` in ``DEQUANTIZABLE``.

    Returns:
        fp32 array ``[n_blocks * block_elems]`` (a fresh, writable array).
    """
    try:
        kind = GGMLType(ggml_type)
    except ValueError:
        raise ValueError(f"ggml_type: unknown ggml type id {ggml_type}") from None
    if kind not in DEQUANTIZABLE:
        raise ValueError(
            f"ggml_type: no dequantizer for {kind.name}; supported: {sorted(t.name for t in DEQUANTIZABLE)}"
        )
    if blocks.dtype != np.uint8:
        raise TypeError(f"blocks: expected a uint8 array, got {blocks.dtype}")
    block_bytes = BLOCK_LAYOUT[kind][1]
    if blocks.shape[-1] != block_bytes:
        raise ValueError(f"blocks: last dim must be {block_bytes} bytes for {kind.name}, got {blocks.shape}")
    flat = blocks.reshape(-1, block_bytes)
    if kind is GGMLType.F32:
        return np.ascontiguousarray(flat).view(np.float32).reshape(-1).copy()
    if kind is GGMLType.F16:
        return np.ascontiguousarray(flat).view(np.float16).reshape(-1).astype(np.float32)
    if kind is GGMLType.BF16:
        # bf16 is the top half of an fp32: widen the bits, no arithmetic.
        bits = np.ascontiguousarray(flat).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(-1)
    return _DEQUANTIZERS[kind](flat).reshape(-1)
