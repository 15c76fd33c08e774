"""Quantized weight formats: tensor containers whose ``dequantize()`` is the specification.

Every format stores a linear weight of logical shape ``[N, K]`` (out_features, in_features; the
``nn.Linear`` layout) and knows how to turn itself back into a dense tensor. Kernels consume the
stored tensors directly; tests compare them with ``x @ fmt.dequantize().T``.

Layouts (all row-major, rows = output channels):

* :class:`IntWeight` -- INT4/INT8 weight-only, group-wise. ``qweight`` ``uint8 [N, Kp * bits / 8]``
  holds unsigned codes ``q`` in ``[0, 2**bits)``; for 4 bits byte ``j`` holds ``k = 2j`` in its low
  nibble and ``k = 2j + 1`` in its high nibble. ``scales`` fp32 ``[N, Kp / group]``; ``zeros`` uint8
  ``[N, Kp / group]`` (asymmetric) or ``None`` (symmetric, zero point ``2**(bits-1)``).
  ``w = (q - z) * s``. ``Kp`` is ``K`` rounded up to the group size; padded codes equal the zero
  point so they dequantize to 0.
* :class:`FP8Weight` -- e4m3 bytes ``uint8 [N, K]`` with fp32 scales, per output channel ``[N]`` or
  per 128x128 block ``[ceil(N/128), ceil(K/128)]``. ``w = e4m3(q) * s``.
* :class:`Int8Weight` -- INT8 weights for W8A8: ``int8 [N, K]`` symmetric per output channel,
  scales fp32 ``[N]``; optional SmoothQuant factors ``smooth`` fp32 ``[K]`` (the stored weight is
  ``W * smooth``; activations are divided by ``smooth``); optional outlier channels
  (``outlier_idx`` int32 ``[n_out]`` and ``w_outlier`` ``[N, n_out]`` in high precision).
  ``dequantize()`` returns the effective weight ``W_q * s / smooth`` with outlier columns replaced.
* :class:`GGUFWeight` -- GGUF Q4_0/Q4_1/Q8_0 raw blocks ``uint8 [N, K/32 * block_bytes]``.
* :class:`NF4Weight` -- 4-bit codes ``uint8 [N, K/2]`` into a 16-value fp32 codebook (bitsandbytes NF4 / FP4) with
  fp32 absmax scales per block of ``blocksize`` along K. ``w = codebook[q] * absmax``.
* :class:`FP4Weight` -- FP4 e2m1 codes ``uint8 [N, K/2]`` (two a byte, element ``2j`` low) with block
  scales ``uint8 [N, K/block]``: MXFP4 (blocks of 32, e8m0 powers of two) or NVFP4 (blocks of 16, e4m3
  scales times one fp32 ``global_scale``). ``w = e2m1(q) * s_block (* global_scale)``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .fp4 import BLOCK as FP4_BLOCK
from .fp4 import e2m1_decode, e8m0_to_f32, mxfp4_quantize, nvfp4_quantize, unpack_nibbles
from .fp8 import E4M3_MAX, fp8_e4m3_decode_emulated, fp8_e4m3_encode
from .gguf import BLOCK_BYTES, BLOCK_ELEMS, affine_parts, gguf_dequantize, gguf_quantize, sub_block

FP8_BLOCK = 128
# Per-channel FP8 scale search: fractions of absmax / 448 tried (see FP8Weight.quantize).
_FP8_SCALE_RATIOS = tuple(1.0 - 0.0125 * i for i in range(1, 25))


@dataclass
class QuantizedWeight(abc.ABC):
    """Base class. Subclasses are dataclasses of tensors plus a few plain-data fields."""

    kind: ClassVar[str] = ""

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int]:
        """Logical ``(N, K)``."""

    @abc.abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[N, K]`` (the reference every kernel is tested against)."""

    # -- serialization: tensors go to safetensors, the rest to JSON metadata --------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def meta(self) -> dict:
        out = {"kind": self.kind}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, torch.Tensor) and v is not None:
                out[f.name] = v
        return out

    @classmethod
    def from_parts(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        sub = _KINDS.get(meta.get("kind"))
        if sub is None:
            raise ValueError(f"meta: unknown quantized format {meta.get('kind')!r}")
        names = {f.name for f in dataclasses.fields(sub)}
        kwargs = {k: v for k, v in meta.items() if k in names}
        kwargs.update({k: v for k, v in tensors.items() if k in names})
        for f in dataclasses.fields(sub):
            kwargs.setdefault(f.name, None)
        return sub(**kwargs)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})


def _check_weight(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise TypeError(f"w: expected a floating-point [N, K] tensor, got {getattr(w, 'shape', w)}")


def _check_int(name: str, value: object, allowed: str, ok: Callable[[int], bool]) -> None:
    """A plain ``int`` for which ``ok`` holds. bool, float and str are refused, not coerced: ``int(2.5)``
    would quietly quantize with another group size than the one asked for."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected {allowed}, got {value!r}")
    if not ok(value):
        raise ValueError(f"{name}: expected {allowed}, got {value}")


def _check_real(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    """A finite int or float (not bool) for which ``ok`` holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected {allowed}, got {value!r}")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name}: expected {allowed}, got {value}")


def _check_vector(name: str, t: object, k: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor of shape ({k},), got {type(t).__name__}")
    if t.shape != (k,):
        raise ValueError(f"{name}: expected shape ({k},), got {tuple(t.shape)}")


# ----------------------------------------------------------------------------------------------
# INT4 / INT8 weight-only
# ----------------------------------------------------------------------------------------------


@dataclass
class IntWeight(QuantizedWeight):
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int
    kind: ClassVar[str] = "int"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.in_features)

    @property
    def padded_in_features(self) -> int:
        return self.scales.shape[1] * self.group_size

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def codes(self) -> torch.Tensor:
        """Unpacked codes ``int32 [N, Kp]``."""
        q = self.qweight.to(torch.int32)
        if self.bits == 4:
            q = torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1)
        return q

    def zero_points(self) -> torch.Tensor:
        """Zero points ``fp32 [N, Kp / group]``."""
        if self.zeros is None:
            return torch.full_like(self.scales, float(2 ** (self.bits - 1)))
        return self.zeros.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.group_size
        q = self.codes().float()
        n, kp = q.shape
        w = (q.view(n, kp // g, g) - self.zero_points()[..., None]) * self.scales.float()[..., None]
        return w.reshape(n, kp)[:, : self.in_features].to(dtype)

    @classmethod
    def quantize(
        cls, w: torch.Tensor, *, bits: int = 4, group_size: int | None = 128, symmetric: bool = False,
        clip_search: bool = True,
    ) -> IntWeight:
        """Round-to-nearest group-wise quantization of ``w [N, K]``.

        ``group_size=None`` means one group per output channel. ``clip_search`` shrinks each
        group's range over a small grid and keeps the candidate of least squared error (the
        clipping search of AWQ/llama.cpp), which matters at 4 bits.
        """
        _check_weight(w)
        _check_int("bits", bits, "4 or 8", lambda b: b in (4, 8))
        n, k = w.shape
        if group_size is not None:
            # Even: two 4-bit codes share a byte, so a group must not split one.
            _check_int("group_size", group_size, "a positive even int or None", lambda g: g > 0 and g % 2 == 0)
        g = k if group_size is None else group_size
        kp = math.ceil(k / g) * g
        wf = torch.zeros(n, kp, dtype=torch.float32, device=w.device)
        wf[:, :k] = w.float()
        x = wf.view(n, kp // g, g)
        # Padding must not widen a group's range: mask it out of min/max.
        valid = (torch.arange(kp, device=w.device) < k).view(1, kp // g, g)
        qmax = 2**bits - 1
        best_err = best = None
        ratios = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75) if clip_search else (1.0,)
        for r in ratios:
            if symmetric:
                amax = torch.where(valid, x.abs(), 0).amax(-1) * r
                s = (amax / (2 ** (bits - 1) - 1)).clamp_min(1e-10)
                z = torch.full_like(s, float(2 ** (bits - 1)))
            else:
                mx = torch.where(valid, x, -float("inf")).amax(-1).clamp_min(0) * r
                mn = torch.where(valid, x, float("inf")).amin(-1).clamp_max(0) * r
                s = ((mx - mn) / qmax).clamp_min(1e-10)
                z = torch.round(-mn / s).clamp(0, qmax)
            q = torch.clamp(torch.round(x / s[..., None]) + z[..., None], 0, qmax)
            err = (((q - z[..., None]) * s[..., None] - x) ** 2 * valid).sum(-1)
            if best is None:
                best, best_err = (q, s, z), err
            else:
                better = err < best_err
                best = tuple(torch.where(better[..., None] if t.dim() == 3 else better, t, b)
                             for t, b in zip((q, s, z), best))
                best_err = torch.minimum(err, best_err)
        q, s, z = best
        q = torch.where(valid, q, z[..., None]).reshape(n, kp).to(torch.uint8)
        if bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        zeros = None if symmetric else z.to(torch.uint8)
        return cls(q.contiguous(), s.contiguous(), zeros, bits, g, k)


# ----------------------------------------------------------------------------------------------
# FP8 e4m3
# ----------------------------------------------------------------------------------------------


@dataclass
class FP8Weight(QuantizedWeight):
    qweight: torch.Tensor  # uint8 [N, K] e4m3 bytes
    scales: torch.Tensor  # fp32 [N] or [ceil(N/128), ceil(K/128)]
    block_size: int | None = None  # None: per output channel
    kind: ClassVar[str] = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def scale_per_element(self) -> torch.Tensor:
        n, k = self.shape
        if self.block_size is None:
            return self.scales.float()[:, None].expand(n, k)
        b = self.block_size
        return self.scales.float().repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # The reference decode is torch's own float8_e4m3fn conversion, not the emulated one.
        v = self.qweight.view(torch.float8_e4m3fn).float()
        return (v * self.scale_per_element()).to(dtype)

    def dequantize_emulated(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Same values through the integer-only decode, with ``2**120`` folded into the scale."""
        v = fp8_e4m3_decode_emulated(self.qweight, fold_scale=False)
        return (v * (self.scale_per_element() * 2.0**120)).to(dtype)

    @classmethod
    def quantize(
        cls, w: torch.Tensor, *, block_size: int | None = None, scale_search: bool = False,
        importance: torch.Tensor | None = None,
    ) -> FP8Weight:
        """Per-channel (``block_size=None``) or ``block_size x block_size`` block-scaled e4m3.

        ``scale_search`` (per-channel only): try scales below ``absmax / 448`` and keep, per
        output channel, the one of least squared error, weighted per input channel by
        ``importance [K]`` when given (e.g. the calibration's mean ``x^2``: errors on channels
        with large activations cost more). e4m3's error is relative, so clipping the largest
        weight a little can move every other weight of the row onto a finer step.
        """
        _check_weight(w)
        n, k = w.shape
        if block_size is not None:
            _check_int("block_size", block_size, "a positive int or None", lambda b: b > 0)
            if scale_search:
                raise ValueError("scale_search: applies to per-channel scales only (block_size=None)")
        if importance is not None:
            _check_vector("importance", importance, k)
            if not bool((torch.isfinite(importance) & (importance >= 0)).all()):
                raise ValueError("importance: expected finite non-negative per-channel weights")
        wf = w.float()
        if block_size is None:
            amax = wf.abs().amax(1)
            s = (amax / E4M3_MAX).clamp_min(1e-12)
            q = fp8_e4m3_encode(wf / s[:, None])
            if scale_search:
                imp = None if importance is None else importance.float().to(w.device)[None, :]

                def err_of(qb: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
                    d2 = (qb.view(torch.float8_e4m3fn).float() * sc[:, None] - wf) ** 2
                    return (d2 if imp is None else d2 * imp).sum(1)

                best_err = err_of(q, s)
                for r in _FP8_SCALE_RATIOS:
                    s_r = (amax * r / E4M3_MAX).clamp_min(1e-12)
                    q_r = fp8_e4m3_encode(wf / s_r[:, None])
                    e = err_of(q_r, s_r)
                    better = e < best_err
                    s = torch.where(better, s_r, s)
                    q = torch.where(better[:, None], q_r, q)
                    best_err = torch.minimum(e, best_err)
        else:
            b = block_size
            nb, kb = math.ceil(n / b), math.ceil(k / b)
            pad = torch.zeros(nb * b, kb * b, device=w.device)
            pad[:n, :k] = wf
            s = (pad.view(nb, b, kb, b).abs().amax((1, 3)) / E4M3_MAX).clamp_min(1e-12)
            per = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
            q = fp8_e4m3_encode(wf / per)
        return cls(q.contiguous(), s.contiguous(), block_size)


# ----------------------------------------------------------------------------------------------
# INT8 W8A8 (per-token activations, per-channel weights), SmoothQuant and outlier channels
# ----------------------------------------------------------------------------------------------


@dataclass
class Int8Weight(QuantizedWeight):
    qweight: torch.Tensor  # int8 [N, K]  (or uint8 e4m3 bytes when act == "fp8")
    scales: torch.Tensor  # fp32 [N]
    smooth: torch.Tensor | None = None  # fp32 [K]
    outlier_idx: torch.Tensor | None = None  # int32 [n_out]
    w_outlier: torch.Tensor | None = None  # [N, n_out] high precision (bf16/fp16/fp32)
    act: str = "int8"  # "int8" or "fp8": the activation (and weight) 8-bit type
    kind: ClassVar[str] = "w8a8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def num_outliers(self) -> int:
        return 0 if self.outlier_idx is None else int(self.outlier_idx.numel())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.act == "fp8":
            w = self.qweight.view(torch.float8_e4m3fn).float()
        else:
            w = self.qweight.float()
        w = w * self.scales.float()[:, None]
        if self.smooth is not None:
            w = w / self.smooth.float()[None, :]
        if self.num_outliers:
            w[:, self.outlier_idx.long()] = self.w_outlier.float()
        return w.to(dtype)

    @classmethod
    def quantize(
        cls, w: torch.Tensor, *, act: str = "int8", smooth: torch.Tensor | None = None,
        outlier_idx: torch.Tensor | None = None, outlier_dtype: torch.dtype = torch.bfloat16,
    ) -> Int8Weight:
        """Per-output-channel symmetric 8-bit weights.

        ``smooth`` ``[K]``: SmoothQuant factors; the stored weight is ``w * smooth``.
        ``outlier_idx`` ``[n_out]``: input channels kept in ``outlier_dtype``; their columns are
        excluded from the INT8 weight's range (and zeroed there) so they cost no precision.
        """
        _check_weight(w)
        if act not in ("int8", "fp8"):
            raise ValueError(f"act: expected 'int8' or 'fp8', got {act!r}")
        n, k = w.shape
        if smooth is not None:
            _check_vector("smooth", smooth, k)
            # Activations are divided by smooth: a zero, negative or non-finite factor is no scale.
            if not bool((torch.isfinite(smooth) & (smooth > 0)).all()):
                raise ValueError("smooth: expected finite positive factors")
        if outlier_idx is not None:
            if not isinstance(outlier_idx, torch.Tensor) or outlier_idx.dtype not in (torch.int32, torch.int64):
                got = getattr(outlier_idx, "dtype", type(outlier_idx).__name__)
                raise TypeError(f"outlier_idx: expected an int32/int64 tensor, got {got}")
            if outlier_idx.dim() != 1:
                raise ValueError(f"outlier_idx: expected shape (n_out,), got {tuple(outlier_idx.shape)}")
            # A repeated channel would be added twice by the high-precision path.
            if outlier_idx.numel() and (int(outlier_idx.min()) < 0 or int(outlier_idx.max()) >= k
                                        or outlier_idx.unique().numel() != outlier_idx.numel()):
                raise ValueError(f"outlier_idx: expected distinct input channels in [0, {k}), got "
                                 f"{outlier_idx.numel()} in [{int(outlier_idx.min())}, {int(outlier_idx.max())}]")
        if outlier_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"outlier_dtype: expected torch.float32, float16 or bfloat16, got {outlier_dtype!r}")
        wf = w.float().clone()
        w_out = None
        if outlier_idx is not None:
            outlier_idx = outlier_idx.to(device=w.device, dtype=torch.int32)
            w_out = wf[:, outlier_idx.long()].to(outlier_dtype).contiguous()
            wf[:, outlier_idx.long()] = 0.0
        if smooth is not None:
            smooth = smooth.float().to(w.device)
            wf = wf * smooth[None, :]
        if act == "int8":
            s = (wf.abs().amax(1) / 127.0).clamp_min(1e-12)
            q = torch.round(wf / s[:, None]).clamp(-127, 127).to(torch.int8)
        else:
            s = (wf.abs().amax(1) / E4M3_MAX).clamp_min(1e-12)
            q = fp8_e4m3_encode(wf / s[:, None])
        return cls(q.contiguous(), s.contiguous(), smooth, outlier_idx, w_out, act)

    def with_outliers(self, new_idx: torch.Tensor) -> Int8Weight:
        """A copy whose outlier set also holds ``new_idx`` (online growth).

        The high-precision columns of new outliers come from the dequantized 8-bit column (the
        original weight is gone by then); their activations stop being quantized, which is
        where the accuracy comes from. The 8-bit column is zeroed so it is not counted twice.
        """
        new_idx = new_idx.to(device=self.qweight.device, dtype=torch.int32)
        dtype = self.w_outlier.dtype if self.w_outlier is not None else torch.bfloat16
        cols = self.qweight[:, new_idx.long()]
        cols = cols.view(torch.float8_e4m3fn).float() if self.act == "fp8" else cols.float()
        cols = cols * self.scales[:, None]
        if self.smooth is not None:
            cols = cols / self.smooth[new_idx.long()][None, :]
        q = self.qweight.clone()
        q[:, new_idx.long()] = 0
        idx = new_idx if self.outlier_idx is None else torch.cat([self.outlier_idx, new_idx])
        w_out = cols.to(dtype) if self.w_outlier is None else torch.cat([self.w_outlier, cols.to(dtype)], 1)
        return dataclasses.replace(
            self, qweight=q, outlier_idx=idx.contiguous(), w_outlier=w_out.contiguous()
        )


# ----------------------------------------------------------------------------------------------
# GGUF blocks
# ----------------------------------------------------------------------------------------------


@dataclass
class GGUFWeight(QuantizedWeight):
    """GGUF blocks as stored: ``qtype`` one of ``quant.gguf.BLOCK_BYTES`` ("q4_0" | "q4_1" | "q8_0", which
    :meth:`quantize` also writes and the GPU kernels read; "q5_0" | "q5_1" | "q4_k" | "q5_k" | "q6_k", loaded from
    files and read by the CPU kernels, elsewhere dequantized at each call), or "mixed": row blocks of several formats
    (a merged projection whose parts a file stores differently; :meth:`concat`), ``parts`` listing ``[qtype, rows]``
    in row order and ``raw`` holding their bytes one after another."""

    raw: torch.Tensor  # uint8 [N, K / block_elems * block_bytes]; "mixed": uint8 [bytes of every part]
    qtype: str
    parts: list | None = None  # "mixed": [[qtype, rows], ...]
    kind: ClassVar[str] = "gguf"

    def segments(self) -> list[tuple[str, torch.Tensor]]:
        """``[(qtype, raw [rows, row_bytes])]``: one per part of a "mixed" weight, else the weight itself."""
        if self.qtype != "mixed":
            return [(self.qtype, self.raw)]
        out, start = [], 0
        k = self._mixed_k()
        for qtype, rows in self.parts:
            row_bytes = k // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype]
            out.append((qtype, self.raw[start : start + rows * row_bytes].view(rows, row_bytes)))
            start += rows * row_bytes
        return out

    def _mixed_k(self) -> int:
        """K of a "mixed" weight: the one its bytes and parts agree on."""
        per_k = sum(rows * BLOCK_BYTES[q] / BLOCK_ELEMS[q] for q, rows in self.parts)
        return round(self.raw.numel() / per_k)

    @property
    def shape(self) -> tuple[int, int]:
        if self.qtype == "mixed":
            return (sum(rows for _, rows in self.parts), self._mixed_k())
        return (self.raw.shape[0], self.raw.shape[1] // BLOCK_BYTES[self.qtype] * BLOCK_ELEMS[self.qtype])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([gguf_dequantize(raw, q, dtype=dtype) for q, raw in self.segments()], 0)

    def affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes uint8 [N, K], scale fp32 [N, K / sb], zero fp32 [N, K / sb])``, ``w = codes * scale + zero`` per
        sub-block of ``sb`` (``quant.gguf.affine_parts`` per part; a "mixed" weight's sub-blocks are its parts'
        smallest, the others' scales and zeros repeated), on the CPU."""
        parts = [(affine_parts(raw.cpu(), q), sub_block(q)) for q, raw in self.segments()]
        sb = min(b for _, b in parts)
        codes = torch.cat([c for (c, _, _), _ in parts], 0)
        scale = torch.cat([s.repeat_interleave(b // sb, 1) for (_, s, _), b in parts], 0)
        zero = torch.cat([z.repeat_interleave(b // sb, 1) for (_, _, z), b in parts], 0)
        return codes, scale, zero

    @classmethod
    def quantize(cls, w: torch.Tensor, *, qtype: str = "q4_1") -> GGUFWeight:
        _check_weight(w)
        return cls(gguf_quantize(w, qtype), qtype)

    @classmethod
    def from_blocks(cls, blocks, qtype: str) -> GGUFWeight:
        """From a GGUF reader's raw view ``[N, K / block_elems, block_bytes]`` (numpy or torch)."""
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"qtype: expected one of {sorted(BLOCK_BYTES)}, got {qtype!r}")
        t = torch.as_tensor(blocks)
        if t.dtype != torch.uint8 or t.dim() != 3 or t.shape[-1] != BLOCK_BYTES[qtype]:
            raise ValueError(f"blocks: expected uint8 [N, nb, {BLOCK_BYTES.get(qtype)}] for {qtype!r}")
        return cls(t.reshape(t.shape[0], -1).clone(), qtype)

    @classmethod
    def concat(cls, weights: list[GGUFWeight]) -> GGUFWeight:
        """The rows of ``weights`` (same K) one after another: one format's blocks, or a "mixed" weight."""
        if not weights or any(not isinstance(w, GGUFWeight) or w.qtype == "mixed" for w in weights):
            raise TypeError("weights: expected a non-empty list of single-format GGUFWeights")
        if len({w.shape[1] for w in weights}) != 1:
            raise ValueError(f"weights: K differs, {[w.shape for w in weights]}")
        if len({w.qtype for w in weights}) == 1:
            return cls(torch.cat([w.raw for w in weights], 0), weights[0].qtype)
        return cls(torch.cat([w.raw.reshape(-1) for w in weights]), "mixed", [[w.qtype, w.shape[0]] for w in weights])


# ----------------------------------------------------------------------------------------------
# FP4 e2m1 with block scales (MXFP4 / NVFP4), weight-only
# ----------------------------------------------------------------------------------------------


@dataclass
class FP4Weight(QuantizedWeight):
    """FP4 e2m1 codes with block scales (``quant.fp4``): ``fmt`` ``"mxfp4"`` (blocks of 32 along K, e8m0 scale
    bytes ``2**(e - 127)``) or ``"nvfp4"`` (blocks of 16, e4m3 scale bytes times ``global_scale``).
    ``w = e2m1(code) * block scale (* global_scale)``."""

    qweight: torch.Tensor  # uint8 [N, K / 2]: element 2j in the low nibble, 2j + 1 in the high one
    scales: torch.Tensor  # uint8 [N, K / block]: e8m0 exponents (mxfp4) or e4m3 bytes (nvfp4)
    fmt: str = "mxfp4"
    global_scale: float = 1.0  # nvfp4's per-tensor fp32 scale (mxfp4: 1.0)
    kind: ClassVar[str] = "fp4"

    def __post_init__(self) -> None:
        if self.fmt not in FP4_BLOCK:
            raise ValueError(f"fmt: expected one of {sorted(FP4_BLOCK)}, got {self.fmt!r}")
        for name in ("qweight", "scales"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
                raise TypeError(f"{name}: expected a uint8 [N, *] tensor, got {getattr(t, 'dtype', type(t))}")
        n, half = self.qweight.shape
        if self.scales.shape != (n, 2 * half // self.block):
            raise ValueError(f"scales: expected shape ({n}, {2 * half // self.block}) for {self.fmt} codes "
                             f"{tuple(self.qweight.shape)}, got {tuple(self.scales.shape)}")
        if (2 * half) % self.block:
            raise ValueError(f"qweight: K = {2 * half} is not a multiple of the {self.fmt} block ({self.block})")
        _check_real("global_scale", self.global_scale, "a positive finite number", lambda g: g > 0)

    @property
    def block(self) -> int:
        return FP4_BLOCK[self.fmt]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], 2 * self.qweight.shape[1])

    def block_scales(self) -> torch.Tensor:
        """fp32 ``[N, K / block]``: the scale of each block (nvfp4: ``global_scale`` included)."""
        if self.fmt == "mxfp4":
            return e8m0_to_f32(self.scales)
        return self.scales.view(torch.float8_e4m3fn).float() * torch.tensor(self.global_scale, dtype=torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        v = e2m1_decode(unpack_nibbles(self.qweight)).view(n, k // self.block, self.block)
        return (v * self.block_scales()[..., None]).reshape(n, k).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, fmt: str = "mxfp4", scale_mode: str = "rceil") -> FP4Weight:
        """``[N, K]`` -> FP4 (K a multiple of the block). ``scale_mode`` (mxfp4 only): see ``quant.fp4``."""
        _check_weight(w)
        if fmt not in FP4_BLOCK:
            raise ValueError(f"fmt: expected one of {sorted(FP4_BLOCK)}, got {fmt!r}")
        if w.shape[1] % FP4_BLOCK[fmt]:
            raise ValueError(f"w: K = {w.shape[1]} is not a multiple of the {fmt} block ({FP4_BLOCK[fmt]})")
        if fmt == "mxfp4":
            codes, e = mxfp4_quantize(w, scale_mode=scale_mode)
            return cls(codes, e, "mxfp4")
        if scale_mode != "rceil":
            raise ValueError("scale_mode: applies to mxfp4 only")
        codes, s8, g = nvfp4_quantize(w)
        return cls(codes, s8, "nvfp4", g)

    @classmethod
    def from_mxfp4_blocks(cls, blocks: torch.Tensor, scales: torch.Tensor) -> FP4Weight:
        """From a checkpoint's MXFP4 tensors as gpt-oss stores them: ``blocks`` uint8 ``[N, K / 32, 16]``,
        ``scales`` uint8 ``[N, K / 32]`` (e8m0)."""
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 3 \
                or blocks.shape[-1] != 16:
            raise ValueError(f"blocks: expected uint8 [N, K / 32, 16], got {getattr(blocks, 'shape', blocks)}")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.shape != blocks.shape[:2]:
            got = getattr(scales, "shape", scales)
            raise ValueError(f"scales: expected uint8 {tuple(blocks.shape[:2])}, got {got}")
        return cls(blocks.reshape(blocks.shape[0], -1).contiguous(), scales.contiguous(), "mxfp4")


# ----------------------------------------------------------------------------------------------
# 4-bit codes into a 16-value codebook with absmax block scales (bitsandbytes NF4 / FP4), weight-only
# ----------------------------------------------------------------------------------------------

# bitsandbytes' NF4 codebook (QLoRA's NormalFloat4: quantiles of N(0, 1) scaled to [-1, 1]), as bitsandbytes stores
# it in a checkpoint's quant_map (fp32)
NF4_CODEBOOK = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0)


@dataclass
class NF4Weight(QuantizedWeight):
    """4-bit codes indexing a 16-entry fp32 ``codebook``, one fp32 ``absmax`` scale per block of ``blocksize``
    along K: ``w = codebook[code] * absmax`` (bitsandbytes' 4-bit format: ``quant_type`` ``"nf4"``, its NormalFloat
    codebook, or ``"fp4"``, its own FP4 table; the codebook is stored, so either reads the same). Double-quantized
    scales are kept here as the fp32 values they decode to."""

    qweight: torch.Tensor  # uint8 [N, K / 2]: element 2j in the low nibble, 2j + 1 in the high one
    absmax: torch.Tensor  # fp32 [N, K / blocksize]
    codebook: torch.Tensor  # fp32 [16]
    blocksize: int = 64
    quant_type: str = "nf4"
    kind: ClassVar[str] = "nf4"

    def __post_init__(self) -> None:
        _check_int("blocksize", self.blocksize, "a power of two from 16 to 4096", lambda b: 16 <= b <= 4096
                   and b & (b - 1) == 0)
        if self.quant_type not in ("nf4", "fp4"):
            raise ValueError(f"quant_type: expected 'nf4' or 'fp4', got {self.quant_type!r}")
        q, a, c = self.qweight, self.absmax, self.codebook
        if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.dim() != 2:
            raise TypeError(f"qweight: expected a uint8 [N, K / 2] tensor, got {getattr(q, 'dtype', type(q))}")
        if not isinstance(a, torch.Tensor) or a.dtype != torch.float32:
            raise TypeError(f"absmax: expected an fp32 tensor, got {getattr(a, 'dtype', type(a))}")
        if not isinstance(c, torch.Tensor) or c.dtype != torch.float32 or c.shape != (16,):
            raise TypeError(f"codebook: expected an fp32 [16] tensor, got {getattr(c, 'dtype', type(c))} "
                            f"{tuple(getattr(c, 'shape', ()))}")
        n, half = q.shape
        if (2 * half) % self.blocksize:
            raise ValueError(f"qweight: K = {2 * half} is not a multiple of the blocksize ({self.blocksize})")
        if a.shape != (n, 2 * half // self.blocksize):
            raise ValueError(f"absmax: expected shape ({n}, {2 * half // self.blocksize}), got {tuple(a.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], 2 * self.qweight.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        v = self.codebook[unpack_nibbles(self.qweight).long()].view(n, k // self.blocksize, self.blocksize)
        return (v * self.absmax[..., None]).reshape(n, k).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, blocksize: int = 64) -> NF4Weight:
        """``[N, K]`` -> NF4 (K a multiple of ``blocksize``): ``absmax`` of each block, each weight the code of the
        codebook value nearest to ``w / absmax`` (the lower code on a tie)."""
        _check_weight(w)
        _check_int("blocksize", blocksize, "a power of two from 16 to 4096", lambda b: 16 <= b <= 4096
                   and b & (b - 1) == 0)
        n, k = w.shape
        if k % blocksize:
            raise ValueError(f"w: K = {k} is not a multiple of the blocksize ({blocksize})")
        wf = w.float().reshape(n, k // blocksize, blocksize)
        absmax = wf.abs().amax(-1)
        v = wf / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[..., None]
        book = torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=w.device)
        codes = (v[..., None] - book).abs().argmin(-1).reshape(n, k).to(torch.uint8)
        return cls((codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), absmax.contiguous(), book.clone(), blocksize)

    @classmethod
    def concat(cls, weights: list[NF4Weight]) -> NF4Weight:
        """The rows of ``weights`` one after another (same K, blocksize and codebook)."""
        if not weights or any(not isinstance(w, NF4Weight) for w in weights):
            raise TypeError("weights: expected a non-empty list of NF4Weights")
        first = weights[0]
        for w in weights[1:]:
            if (w.shape[1], w.blocksize) != (first.shape[1], first.blocksize) or not torch.equal(w.codebook,
                                                                                               first.codebook):
                raise ValueError("weights: the merged NF4 weights differ in K, blocksize or codebook")
        return cls(torch.cat([w.qweight for w in weights]), torch.cat([w.absmax for w in weights]), first.codebook,
                   first.blocksize, first.quant_type)


_KINDS: dict[str, type[QuantizedWeight]] = {
    c.kind: c for c in (IntWeight, FP8Weight, Int8Weight, GGUFWeight, FP4Weight, NF4Weight)
}
