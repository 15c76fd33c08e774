"""GGUF block formats Q4_0, Q4_1 and Q8_0, kept as stored.

A weight ``[N, K]`` is ``N`` rows of ``K // 32`` blocks; each block holds 32 consecutive values of
a row. Byte layouts (ggml's ``block_q4_0`` etc., little-endian fp16)::

    Q4_0 (18 B): d:fp16, qs[16]            w[i] = (nib[i] - 8) * d
    Q4_1 (20 B): d:fp16, m:fp16, qs[16]    w[i] = nib[i] * d + m
    Q8_0 (34 B): d:fp16, qs[32]:int8       w[i] = qs[i] * d

with ``nib[i] = qs[i] & 15`` for ``i < 16`` and ``qs[i - 16] >> 4`` for ``i >= 16``. The raw tensor
is ``uint8 [N, (K // 32) * block_bytes]``; kernels read it directly.
"""

from __future__ import annotations

import torch

QK = 32
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


def _check_qtype(qtype: str) -> str:
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype: expected one of {sorted(BLOCK_BYTES)}, got {qtype!r}")
    return qtype


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def q4_parts(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks ``uint8 [N, nb, block_bytes]`` -> ``(nib uint8 [N, nb, 32], d fp32 [N, nb], m fp32
    [N, nb])`` with ``w = nib * d + m`` (Q4_0: ``m = -8 d``)."""
    qs = blocks[..., 4:] if qtype == "q4_1" else blocks[..., 2:]
    nib = torch.cat([qs & 15, qs >> 4], dim=-1)
    d = _f16(blocks, 0)
    return nib, d, _f16(blocks, 2) if qtype == "q4_1" else -8.0 * d


def gguf_dequantize(raw: torch.Tensor, qtype: str, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw blocks ``uint8 [N, nb * block_bytes]`` -> weight ``[N, nb * 32]`` in ``dtype`` (math in fp32)."""
    _check_qtype(qtype)
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise TypeError(f"raw: expected uint8 [N, row_bytes], got {raw.dtype} {tuple(raw.shape)}")
    bb = BLOCK_BYTES[qtype]
    n, row_bytes = raw.shape
    if row_bytes % bb:
        raise ValueError(f"raw: row of {row_bytes} bytes is not a whole number of {qtype} blocks")
    blocks = raw.reshape(n, row_bytes // bb, bb)
    if qtype == "q8_0":
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)[..., None]
    else:
        nib, d, m = q4_parts(blocks, qtype)
        w = nib.float() * d[..., None] + m[..., None]
    return w.reshape(n, -1).to(dtype)


def gguf_quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Weight ``[N, K]`` (``K % 32 == 0``) -> raw blocks ``uint8 [N, K // 32 * block_bytes]``.

    Follows ggml's reference quantizers (``quantize_row_q4_0_ref`` etc.): Q4_0 takes the signed
    value of largest magnitude as ``-8 * d``; Q4_1 spans ``[min, max]``; Q8_0 uses ``amax / 127``.
    """
    _check_qtype(qtype)
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
