"""Pre-quantized bitsandbytes checkpoints as transformers saves them: 4-bit (``load_in_4bit``: NF4 or FP4, with or
without double-quantized scales; the ``*-bnb-4bit`` exports) and 8-bit (``load_in_8bit``, LLM.int8).

Format facts from ``bitsandbytes-foundation/bitsandbytes`` (``bitsandbytes/functional.py`` ``quantize_4bit`` /
``dequantize_4bit`` / ``QuantState.as_dict(packed=True)`` / ``QuantState.from_dict``) and transformers'
``integrations/bitsandbytes.py`` / ``quantizers/quantizer_bnb_4bit.py``; checked in the tests against
bitsandbytes' own quantizer and dequantizer:

* config: ``quantization_config`` ``{"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type":
  "nf4" | "fp4", "bnb_4bit_use_double_quant": ..., "bnb_4bit_compute_dtype": ..., "bnb_4bit_quant_storage":
  "uint8", "llm_int8_skip_modules": [...]}``, or ``{"load_in_8bit": true, "llm_int8_threshold": 6.0, ...}``.
* tensors of a quantized linear ``<name>`` ``[N, K]``: ``<name>.weight`` uint8 ``[N K / 2, 1]``, the weight
  flattened row-major, two 4-bit codes a byte, **the first in the high nibble**; ``<name>.weight.quant_map`` fp32
  ``[16]``, the codebook (NF4's NormalFloat values, or bitsandbytes' FP4 table); ``<name>.weight.absmax``: one scale
  a block of ``blocksize`` (64 by default) consecutive weights, fp32, or with double quantization uint8 codes into
  ``<name>.weight.nested_quant_map`` (fp32 ``[256]``) times ``<name>.weight.nested_absmax`` (fp32, one a block of
  ``nested_blocksize`` = 256 scales) plus ``nested_offset``; ``<name>.weight.quant_state.bitsandbytes__<type>``
  uint8, the UTF-8 JSON of ``quant_type``, ``blocksize``, ``dtype``, ``shape`` and the nested settings.
* ``w = quant_map[code] * absmax`` (fp32), with ``absmax = nested_quant_map[absmax_code] * nested_absmax +
  nested_offset`` when double-quantized.

8-bit (``bitsandbytes/nn/modules.py`` ``Linear8bitLt._save_to_state_dict``, ``functional.int8_vectorwise_quant`` /
``int8_vectorwise_dequant``): ``<name>.weight`` int8 ``[N, K]``, ``<name>.SCB`` fp32 ``[N]`` (each row's absmax),
``<name>.weight_format`` uint8 0 ("row", the only layout saved); ``w = weight * SCB / 127``. Loaded weight-only
as INT8 per-channel :class:`~infercore.quant.IntWeight` (scale ``SCB * (1 / 127)``, the weights bitsandbytes
dequantizes to within one fp32 rounding) and run W8A16: bitsandbytes' own LLM.int8 matmul instead quantizes the
activations per row to INT8 and keeps the columns over ``llm_int8_threshold`` in 16 bits; computing with the whole
16-bit activations is the exact product it approximates.

4-bit loads weight-only as :class:`~infercore.quant.NF4Weight` ``QuantLinear`` s (codes re-packed to our nibble order,
double-quantized scales decoded to the fp32 values bitsandbytes computes: the same weights bit for bit), q / k / v
and gate / up merged. Blocks must lie within a row (K a multiple of ``blocksize``), else ``ValueError``. Modules in
``llm_int8_skip_modules`` (and any linear stored with a floating-point ``weight``) load dense.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from .prequantized import build_prequantized
from .prequantized_fp4 import _named, _patterns

_SUBS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_STATE = "quant_state.bitsandbytes__"
_PART = "bnb_"  # leaf prefix the loader gives the parts stored as ``<name>.weight.<sub>``


def is_bnb_config(q: Any) -> bool:
    """Whether the ``quantization_config`` ``q`` is a bitsandbytes one (``quant_method`` ``"bitsandbytes"``)."""
    return isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "bitsandbytes"


def bnb_config(q: dict[str, Any], where: str = "config.json: quantization_config") -> dict[str, Any]:
    """The settings of a bitsandbytes ``quantization_config``, checked: ``{"method": "bnb4", "quant_type": "nf4" |
    "fp4", "exclude": [module names]}`` or ``{"method": "bnb8", "exclude": [...]}``. ``ValueError`` for a config
    with neither (or both) of ``load_in_4bit`` / ``load_in_8bit``, or a quant type or storage this loader does not
    read."""
    if q.get("load_in_8bit") and q.get("load_in_4bit"):
        raise ValueError(f"{where}: load_in_4bit and load_in_8bit are both set")
    if q.get("load_in_8bit"):
        skip = _patterns(f"{where}.llm_int8_skip_modules", q.get("llm_int8_skip_modules"))
        return {"method": "bnb8", "exclude": skip}
    if not q.get("load_in_4bit"):
        raise ValueError(f"{where}: a bitsandbytes config sets neither load_in_4bit nor load_in_8bit")
    qt = str(q.get("bnb_4bit_quant_type", "fp4")).lower()
    if qt not in ("nf4", "fp4"):
        raise ValueError(f"{where}.bnb_4bit_quant_type: expected 'nf4' or 'fp4', got {q.get('bnb_4bit_quant_type')!r}")
    storage = str(q.get("bnb_4bit_quant_storage", "uint8")).lower().removeprefix("torch.")
    if storage != "uint8":
        raise ValueError(f"{where}.bnb_4bit_quant_storage: only 'uint8' storage is supported, got {storage!r}")
    exclude = _patterns(f"{where}.llm_int8_skip_modules", q.get("llm_int8_skip_modules"))
    return {"method": "bnb4", "quant_type": qt, "exclude": exclude}


class _Renamed:
    """A checkpoint whose parts ``<name>.weight.<sub>`` read as ``<name>.bnb_<sub>`` (one level, like the other
    formats' parts), so the loader groups them with the codes ``<name>.weight``."""

    def __init__(self, ckpt) -> None:
        self.ckpt = ckpt

    def weights(self, dtype=None):
        for name, t in self.ckpt.weights(dtype):
            base, sep, sub = name.partition(".weight.")
            if sep and (sub in _SUBS or sub.startswith(_STATE)):
                yield f"{base}.{_PART}{'quant_state' if sub.startswith(_STATE) else sub}", t
            else:
                yield name, t


def _state(name: str, t: torch.Tensor) -> dict[str, Any]:
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"checkpoint: {name}.weight.{_STATE}* must be uint8 [bytes] (packed JSON)")
    try:
        state = json.loads(bytes(t.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint: {name}.weight.{_STATE}* is not JSON: {e}") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint: {name}.weight.{_STATE}* must hold a JSON object")
    return state


def _nf4_weight(name: str, parts: dict[str, torch.Tensor], q: dict[str, Any]):
    """:class:`NF4Weight` of one quantized linear's tensors, every dtype and shape checked."""
    from ..quant.formats import NF4Weight

    need = ("weight", f"{_PART}absmax", f"{_PART}quant_map", f"{_PART}quant_state")
    missing = [p.replace(_PART, "weight.") for p in need if p not in parts]
    if missing:
        have = sorted(p.replace(_PART, "weight.") for p in parts)
        raise ValueError(f"checkpoint: {name} has {have} but misses {missing}")
    state = _state(name, parts[f"{_PART}quant_state"])
    shape, bs, qt = state.get("shape"), state.get("blocksize"), str(state.get("quant_type", ""))
    if qt != q["quant_type"]:
        raise ValueError(f"checkpoint: {name} is stored {qt!r}, the config says {q['quant_type']!r}")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) and v > 0 for v in shape)):
        raise ValueError(f"checkpoint: {name}'s quant_state shape must be [N, K], got {shape!r}")
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
        raise ValueError(f"checkpoint: {name}'s quant_state blocksize must be a power of two >= 16, got {bs!r}")
    n, k = shape
    if k % bs:
        raise ValueError(f"checkpoint: {name}: K = {k} is not a multiple of the blocksize {bs} (blocks would straddle "
                         "rows); not supported")
    codes = parts["weight"]
    if codes.dtype != torch.uint8 or codes.numel() != n * k // 2:
        raise ValueError(f"checkpoint: {name}.weight must be uint8 with {n * k // 2} bytes (two codes a byte), got "
                         f"{codes.dtype} {list(codes.shape)}")
    lut = parts[f"{_PART}quant_map"]
    if lut.dtype != torch.float32 or lut.numel() != 16:
        raise ValueError(f"checkpoint: {name}.weight.quant_map must be fp32 [16], got {lut.dtype} {list(lut.shape)}")
    absmax, blocks = parts[f"{_PART}absmax"].reshape(-1), n * k // bs
    if absmax.numel() != blocks:
        raise ValueError(f"checkpoint: {name}.weight.absmax holds {absmax.numel()} values, expected {blocks}")
    if absmax.dtype == torch.uint8:  # double-quantized: codes into nested_quant_map, nested_absmax per block
        nq, na = parts.get(f"{_PART}nested_quant_map"), parts.get(f"{_PART}nested_absmax")
        nbs, offset = state.get("nested_blocksize"), state.get("nested_offset")
        if nq is None or na is None or not isinstance(nbs, int) or isinstance(offset, bool) \
                or not isinstance(offset, (int, float)):
            raise ValueError(f"checkpoint: {name}.weight.absmax is double-quantized (uint8) but nested_quant_map, "
                             "nested_absmax, nested_blocksize or nested_offset is missing")
        if nq.dtype != torch.float32 or nq.numel() != 256 or na.dtype != torch.float32 \
                or na.numel() != -(-blocks // nbs):
            raise ValueError(f"checkpoint: {name}.weight.nested_quant_map / nested_absmax must be fp32 [256] / "
                             f"[{-(-blocks // nbs)}]")
        absmax = nq[absmax.long()] * na.reshape(-1).repeat_interleave(nbs)[:blocks] + float(offset)
    elif absmax.dtype != torch.float32:
        raise ValueError(f"checkpoint: {name}.weight.absmax must be fp32 (or uint8, double-quantized), got "
                         f"{absmax.dtype}")
    b = codes.reshape(n, k // 2)
    ours = ((b >> 4) | (b << 4)).to(torch.uint8)  # bitsandbytes: the first code in the high nibble
    try:
        return NF4Weight(ours.contiguous(), absmax.float().reshape(n, k // bs).contiguous(),
                         lut.float().reshape(16).contiguous(), bs, qt), None
    except (ValueError, TypeError) as e:
        raise ValueError(f"checkpoint: {name}: {e}") from None


def load_bnb4(ckpt, config, q: dict[str, Any], *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model of ``config`` on ``device`` with the bitsandbytes 4-bit linears of ``ckpt`` as
    ``QuantLinear`` s over :class:`~infercore.quant.NF4Weight`, and load the rest. ``q`` is :func:`bnb_config`.
    Raises ``ValueError`` naming the tensor or module for a wrong dtype or shape, a missing part, a quantized linear
    the model lacks or the config skips, or a tensor missing (by ``load_weights``)."""
    from ..quant.formats import NF4Weight

    def select(parts: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        for base, p in parts.items():
            if "weight" not in p:
                raise ValueError(f"checkpoint: {base} has bitsandbytes quantization state but its weight is not "
                                 "stored as uint8 codes")
        return sorted(parts)

    return build_prequantized(
        _Renamed(ckpt), config, dtype=dtype, device=device, label="bitsandbytes 4-bit",
        # the codes share the name "weight" with dense weights: floating-point ones are dense
        is_part=lambda leaf, t: leaf.startswith(_PART) or (leaf == "weight" and t.dtype == torch.uint8),
        select=select,
        weight=lambda base, parts: _nf4_weight(base, parts, q),
        concat=lambda target, ws, names: NF4Weight.concat(ws),
        codes="weight",
        none_converted="checkpoint: a bitsandbytes quantization_config is set but no linear has a uint8 weight",
        excluded=lambda base: _named(base, q["exclude"]),
    )


def _int8_weight(name: str, parts: dict[str, torch.Tensor]):
    """INT8 per-channel :class:`IntWeight` of one LLM.int8 linear's ``weight`` / ``SCB`` (/ ``weight_format``)."""
    from ..quant.formats import IntWeight
    from ..quant.packing import _pack_codes

    w, scb = parts.get("weight"), parts.get("SCB")
    if w is None or scb is None:
        raise ValueError(f"checkpoint: {name} has {sorted(parts)} but misses {['weight', 'SCB'][int(w is not None)]!r}")
    if w.dtype != torch.int8 or w.dim() != 2:
        raise ValueError(f"checkpoint: {name}.weight must be int8 [N, K], got {w.dtype} {list(w.shape)}")
    n, k = w.shape
    if scb.dtype not in (torch.float32, torch.float16, torch.bfloat16) or scb.numel() != n:
        raise ValueError(f"checkpoint: {name}.SCB must be a float [{n}] tensor (each row's absmax), got {scb.dtype} "
                         f"{list(scb.shape)}")
    fmt = parts.get("weight_format")
    if fmt is not None and (fmt.numel() != 1 or int(fmt.reshape(-1)[0]) != 0):
        raise ValueError(f"checkpoint: {name}.weight_format must be 0 (row-major), got {fmt.reshape(-1).tolist()}")
    scb = scb.float().reshape(n, 1)
    if not bool(torch.isfinite(scb).all()) or bool((scb < 0).any()):
        raise ValueError(f"checkpoint: {name}.SCB holds negative or non-finite values")
    scales = scb * torch.tensor(7.874015718698502e-3)  # 1 / 127 as bitsandbytes writes it, in fp32
    return IntWeight(_pack_codes(w.to(torch.int32) + 128, 8), scales.contiguous(), None, 8, k, k), None


def load_bnb8(ckpt, config, q: dict[str, Any], *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model of ``config`` on ``device`` with the bitsandbytes 8-bit (LLM.int8) linears of ``ckpt`` as
    INT8 weight-only ``QuantLinear`` s (module docstring), and load the rest. ``q`` is :func:`bnb_config`. Raises
    ``ValueError`` naming the tensor or module for a wrong dtype or shape, a missing part, a quantized linear the model
    lacks or the config skips, or a tensor missing (by ``load_weights``)."""
    from .prequantized_int import _concat

    def select(parts: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        for base, p in parts.items():
            if "weight" not in p:
                raise ValueError(f"checkpoint: {base} has {sorted(p)} but its weight is not stored as int8")
        return sorted(parts)

    return build_prequantized(
        ckpt, config, dtype=dtype, device=device, label="bitsandbytes 8-bit",
        # the int8 codes share the name "weight" with dense weights: floating-point ones are dense
        is_part=lambda leaf, t: leaf in ("SCB", "weight_format") or (leaf == "weight" and t.dtype == torch.int8),
        select=select, weight=_int8_weight, concat=_concat, codes="weight",
        none_converted="checkpoint: a bitsandbytes 8-bit quantization_config is set but no linear has an int8 weight",
        excluded=lambda base: _named(base, q["exclude"]),
    )
