"""GGUF block formats, kept as stored: Q4_0, Q4_1, Q8_0 (quantized here too, and read by the GPU kernels), and
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (loaded from files; read by the CPU kernels).

A weight ``[N, K]`` is ``N`` rows of blocks along K; a block holds :data:`BLOCK_ELEMS` (32, or 256 for the
K-quants) consecutive values of a row. Byte layouts (ggml's ``block_q4_0`` etc., little-endian fp16)::

    Q4_0 (18 B): d:fp16, qs[16]            w[i] = (nib[i] - 8) * d
    Q4_1 (20 B): d:fp16, m:fp16, qs[16]    w[i] = nib[i] * d + m
    Q8_0 (34 B): d:fp16, qs[32]:int8       w[i] = qs[i] * d

with ``nib[i] = qs[i] & 15`` for ``i < 16`` and ``qs[i - 16] >> 4`` for ``i >= 16``. The raw tensor
is ``uint8 [N, (K // block_elems) * block_bytes]``; kernels read it directly.

Every one of these formats is an integer code ``u`` per element with one fp32 ``(scale, zero)`` pair per sub-block
of :func:`sub_block` elements, ``w = u * scale + zero`` (:func:`affine_parts`): Q5_0 ``u = q5``, ``zero = -16 d``;
Q5_1 ``scale = d``, ``zero = m``; Q4_K / Q5_K (8 sub-blocks of 32 with 6-bit scales and mins) ``scale = d sc_j``,
``zero = -dmin m_j``; Q6_K (16 sub-blocks of 16, int8 scales) ``u = q6``, ``scale = d sc_j``, ``zero = -32 scale``.
Each product ``d sc_j`` and ``dmin m_j`` is exact in fp32, so the dequantized values equal ggml's (and
``loading.gguf_quants``') bit for bit.
"""

from __future__ import annotations

import torch

QK = 32
QK_K = 256  # elements of a K-quant super-block
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176, "q6_k": 210}
BLOCK_ELEMS = {q: QK_K if q.endswith("_k") else QK for q in BLOCK_BYTES}
QUANTIZABLE = ("q4_0", "q4_1", "q8_0")  # the formats gguf_quantize writes (and the GPU kernels read)
AFFINE = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")  # the formats only loaded from files (dequantized via affine_parts)


def _check_qtype(qtype: str, allowed=BLOCK_BYTES) -> str:
    if qtype not in allowed:
        raise ValueError(f"qtype: expected one of {sorted(allowed)}, got {qtype!r}")
    return qtype


def sub_block(qtype: str) -> int:
    """Elements per ``(scale, zero)`` pair of :func:`affine_parts` (and per block of the 32-element formats)."""
    return 16 if _check_qtype(qtype) == "q6_k" else QK


def code_bits(qtype: str) -> int:
    """Bits of the codes ``u`` (4: Q4_0 / Q4_1 / Q4_K; 5: Q5_*; 6: Q6_K; 8: Q8_0)."""
    return {"q8_0": 8, "q6_k": 6, "q5_0": 5, "q5_1": 5, "q5_k": 5}.get(_check_qtype(qtype), 4)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def q4_parts(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks ``uint8 [N, nb, block_bytes]`` -> ``(nib uint8 [N, nb, 32], d fp32 [N, nb], m fp32
    [N, nb])`` with ``w = nib * d + m`` (Q4_0: ``m = -8 d``)."""
    qs = blocks[..., 4:] if qtype == "q4_1" else blocks[..., 2:]
    nib = torch.cat([qs & 15, qs >> 4], dim=-1)
    d = _f16(blocks, 0)
    return nib, d, _f16(blocks, 2) if qtype == "q4_1" else -8.0 * d


def _blocks(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """``raw uint8 [N, nb * block_bytes]`` -> ``[N, nb, block_bytes]``; bad ``raw``: ``TypeError`` / ``ValueError``."""
    _check_qtype(qtype)
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise TypeError(f"raw: expected uint8 [N, row_bytes], got {raw.dtype} {tuple(raw.shape)}")
    bb = BLOCK_BYTES[qtype]
    n, row_bytes = raw.shape
    if row_bytes % bb:
        raise ValueError(f"raw: row of {row_bytes} bytes is not a whole number of {qtype} blocks")
    return raw.reshape(n, row_bytes // bb, bb)


def _bits(b: torch.Tensor, shifts) -> torch.Tensor:
    """``b [..., m]`` uint8 shifted right by each of ``shifts`` -> ``[..., m, len(shifts)]`` (callers mask)."""
    return b.unsqueeze(-1) >> torch.tensor(list(shifts), dtype=torch.uint8, device=b.device)


def _k_scale_min(sc12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte packed 6-bit (scale, min) pairs of Q4_K / Q5_K ``[..., 12]`` -> two ``[..., 8]`` uint8
    (ggml's ``get_scale_min_k4``): bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top two bits
    of scales / mins 4-7 in their top two; bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)."""
    s_lo, m_lo, hi = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    sc = torch.cat([s_lo & 0x3F, (hi & 0x0F) | ((s_lo >> 6) << 4)], -1)
    mn = torch.cat([m_lo & 0x3F, (hi >> 4) | ((m_lo >> 6) << 4)], -1)
    return sc, mn


def affine_parts(raw: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of any format here -> ``(codes uint8 [N, K], scale fp32 [N, K / sb], zero fp32 [N, K / sb])`` with
    ``w = codes * scale + zero`` per sub-block of ``sb = sub_block(qtype)`` elements (module docstring; Q4_0
    ``zero = -8 d``, Q8_0 ``codes = q + 128``, ``zero = -128 d``)."""
    blocks = _blocks(raw, qtype)
    n, nb, _ = blocks.shape
    if qtype in ("q4_0", "q4_1"):
        nib, d, m = q4_parts(blocks, qtype)
        return nib.reshape(n, -1), d, m
    if qtype == "q8_0":
        codes = (blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        d = _f16(blocks, 0)
        return codes.reshape(n, -1), d, -128.0 * d
    if qtype in ("q5_0", "q5_1"):
        h = 2 if qtype == "q5_0" else 4  # the fifth bits: one little-endian uint32 after the header
        qh = (_bits(blocks[..., h : h + 4], range(8)) & 1).reshape(n, nb, 32)
        qs = blocks[..., h + 4 :]
        codes = torch.cat([qs & 15, qs >> 4], -1) | (qh << 4)
        d = _f16(blocks, 0)
        scale, zero = (d, -16.0 * d) if qtype == "q5_0" else (d, _f16(blocks, 2))
        return codes.reshape(n, -1), scale, zero
    if qtype in ("q4_k", "q5_k"):
        off = 16 if qtype == "q4_k" else 48
        qs = blocks[..., off : off + 128].reshape(n, nb, 4, 1, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
        codes = torch.cat([qs & 15, qs >> 4], 3).reshape(n, nb, 8, 32)
        if qtype == "q5_k":  # bit j of qh[l]: the fifth bit of element l of sub-block j
            codes = codes | ((_bits(blocks[..., 16:48], range(8)) & 1).transpose(-1, -2) << 4)
        sc, mn = _k_scale_min(blocks[..., 4:16])
        scale = _f16(blocks, 0)[..., None] * sc.float()
        zero = -(_f16(blocks, 2)[..., None] * mn.float())
        return codes.reshape(n, -1), scale.reshape(n, -1), zero.reshape(n, -1)
    # q6_k: two halves of 128; in a half, elements [0, 32) / [64, 96) take the low / high nibbles of ql[0:32],
    # [32, 64) / [96, 128) those of ql[32:64]; bit pairs 0, 2, 4, 6 of qh[0:32] give the top two bits
    ql = blocks[..., 0:128].reshape(n, nb, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], 3).reshape(n, nb, 2, 4, 32)
    high = (_bits(blocks[..., 128:192].reshape(n, nb, 2, 32), (0, 2, 4, 6)) & 3).transpose(-1, -2)
    codes = (low | (high << 4)).reshape(n, -1)
    scale = _f16(blocks, 208)[..., None] * blocks[..., 192:208].contiguous().view(torch.int8).float()
    return codes, scale.reshape(n, -1), (-32.0 * scale).reshape(n, -1)


def gguf_dequantize(raw: torch.Tensor, qtype: str, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw blocks ``uint8 [N, nb * block_bytes]`` -> weight ``[N, nb * block_elems]`` in ``dtype`` (math in fp32)."""
    blocks = _blocks(raw, qtype)
    n = blocks.shape[0]
    if qtype in AFFINE:
        codes, scale, zero = affine_parts(raw, qtype)
        sb = sub_block(qtype)
        w = codes.reshape(n, -1, sb).float() * scale[..., None] + zero[..., None]
    elif qtype == "q8_0":
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)[..., None]
    else:
        nib, d, m = q4_parts(blocks, qtype)
        w = nib.float() * d[..., None] + m[..., None]
    return w.reshape(n, -1).to(dtype)


def gguf_quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Weight ``[N, K]`` (``K % 32 == 0``) -> raw blocks ``uint8 [N, K // 32 * block_bytes]``.

    Follows ggml's reference quantizers (``quantize_row_q4_0_ref`` etc.): Q4_0 takes the signed
    value of largest magnitude as ``-8 * d``; Q4_1 spans ``[min, max]``; Q8_0 uses ``amax / 127``.
    Only :data:`QUANTIZABLE` formats (the others load from GGUF files as they are).
    """
    _check_qtype(qtype, QUANTIZABLE)
    if w.dim() != 2 or w.shape[1] % QK:
        raise ValueError(f"w: expected [N, K] with K % 32 == 0, got {tuple(w.shape)}")
    n, k = w.shape
    x = w.float().reshape(n, k // QK, QK)
    if qtype == "q8_0":
        d = x.abs().amax(-1) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        head = [d.to(torch.float16)]
    elif qtype == "q4_0":
        idx = x.abs().argmax(-1, keepdim=True)
        mx = torch.gather(x, -1, idx)[..., 0]
        d = mx / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.floor(x * inv[..., None] + 8.5), 0, 15).to(torch.uint8)
        q = q[..., :16] | (q[..., 16:] << 4)
        head = [d.to(torch.float16)]
    else:
        mn, mx = x.amin(-1), x.amax(-1)
        d = (mx - mn) / 15.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.floor((x - mn[..., None]) * inv[..., None] + 0.5), 0, 15).to(torch.uint8)
        q = q[..., :16] | (q[..., 16:] << 4)
        head = [d.to(torch.float16), mn.to(torch.float16)]
    parts = [h.contiguous().view(torch.uint8).reshape(n, k // QK, 2) for h in head] + [q]
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()
