"""Pre-quantized compressed-tensors checkpoints with integer weights: ``pack-quantized`` (W4A16 / W8A16, the
RedHatAI / llm-compressor ``*-quantized.w4a16`` exports) and ``int-quantized`` / ``naive-quantized`` INT8 weights
(W8A8 ``*-quantized.w8a8`` exports, or INT8 weight-only).

Format facts from ``vllm-project/compressed-tensors`` (``compressors/pack_quantized/base.py``
``PackedQuantizationCompressor``, ``compressors/pack_quantized/helpers.py`` ``pack_to_int32``,
``compressors/naive_quantized/base.py``, ``quantization/lifecycle/forward.py`` ``quantize`` / ``dequantize``,
``quantization/quant_scheme.py`` presets ``W4A16``, ``W4A16_ASYM``, ``W8A16``, ``W8A8``) and vLLM's readers
(``compressed_tensors/schemes/compressed_tensors_wNa16.py``, ``compressed_tensors_w8a8_int8.py``):

* config: ``quantization_config`` ``{"quant_method": "compressed-tensors", "format": "pack-quantized" |
  "int-quantized" | "naive-quantized" | "mixed-precision", "config_groups": {...: {"weights": {"num_bits": 4 | 8,
  "type": "int", "strategy": "group" | "channel" | "tensor", "group_size": 128, "symmetric": ..., "actorder":
  ...}, "input_activations": ..., "format": ...}}, "ignore": [...], "quantization_status": "compressed"}``;
  ``ignore`` entries are module names or ``"re:"`` regexes.
* ``quantize``: ``q = clamp(round(w / scale) + zero_point, -2^(b-1), 2^(b-1) - 1)``; ``dequantize``:
  ``w = (q - zero_point) * scale``, the scale (and zero point) of the weight's group along K.
* ``pack-quantized`` tensors: ``<name>.weight_packed`` int32 ``[N, ceil(K b / 32)]``, the codes offset to
  unsigned (``q + 2^(b-1)``) and packed along K, element ``i`` of a row at bit ``b i`` of the row's bit stream
  (for 4 and 8 bits: code ``j`` of a word at bits ``b j``, low first, as GPTQ packs along K);
  ``<name>.weight_scale`` ``[N, K / group]`` (``[N, 1]`` per channel) in the model's dtype;
  ``<name>.weight_shape`` int ``[2]`` = ``[N, K]``; asymmetric: ``<name>.weight_zero_point`` int32
  ``[ceil(N b / 32), K / group]``, the zero points offset the same way and packed along N (``packed_dim=0``);
  act-order ``"group"``: ``<name>.weight_g_idx`` int ``[K]``, the group of each input channel (``"weight"``
  act-order stores none: its permutation was undone at export).
* ``int-quantized`` / ``naive-quantized`` INT8 tensors: ``<name>.weight`` int8 ``[N, K]`` (``q`` as is),
  ``<name>.weight_scale`` ``[N, 1]`` (channel), ``[1]`` (tensor) or ``[N, K / group]``; asymmetric
  ``<name>.weight_zero_point`` int8, same shape, unpacked; ``input_scale`` / ``input_zero_point`` (static
  activation quantization) are dropped.

Loaded as: ``pack-quantized`` and weight-only INT8 -> :class:`~infercore.quant.IntWeight` (``q + 2^(b-1)`` as the
unsigned codes, ``zero_point + 2^(b-1)`` as the zeros, symmetric ones with no zeros: the same weights bit for bit;
an act-order ``weight_g_idx`` sorts the input channels by group and gathers the activations in that order,
``QuantLinear.in_perm``, as the GPTQ loader does); INT8 weights whose config quantizes the activations to INT8
(the ``W8A8`` preset: per-token, dynamic) with per-channel or per-tensor symmetric scales ->
:class:`~infercore.quant.Int8Weight`, run W8A8 (per-token dynamic INT8 activations, ``quant.w8a8_matmul``) as the
checkpoint intends; static per-tensor activation scales are replaced by per-token dynamic ones. Merged q / k / v
and gate / up concatenate exactly (their groups lie along K). A linear stored with a floating-point ``weight`` loads
dense; one the config excludes but stored quantized is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .prequantized import _concat as _concat_int
from .prequantized import build_prequantized
from .prequantized_fp4 import _KV_SCALES, _ct_groups, _patterns
from .prequantized_fp4 import _excluded as _ct_excluded

_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_STRATEGIES = ("group", "channel", "tensor")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
_DROP = ("input_scale", "input_zero_point")


def is_int_config(q: Any) -> bool:
    """Whether the compressed-tensors ``quantization_config`` ``q`` holds integer weights (any group's
    ``weights.type`` ``"int"``)."""
    if not isinstance(q, dict) or str(q.get("quant_method", "")).lower() != "compressed-tensors":
        return False
    groups = q.get("config_groups")
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and isinstance(g.get("weights"), dict)
        and str(g["weights"].get("type", "")).lower() == "int"
        for g in groups.values()
    )


def int_config(q: dict[str, Any], where: str = "config.json: quantization_config") -> dict[str, Any]:
    """The settings of a compressed-tensors integer-weight ``quantization_config``, checked: ``{"method": "ct-int",
    "format": "compressed-tensors", "bits": [weight bits], "w8a8": bool, "exclude": [patterns]}`` (``w8a8``: its INT8
    weights run with INT8 per-token activations). ``ValueError`` naming the setting for anything this loader does
    not run."""
    bits: set[int] = set()
    w8a8: set[bool] = set()
    for at, fmt, w, group in _ct_groups(q, where, "packed / integer tensors"):
        if fmt not in _FORMATS:
            raise ValueError(
                f"{at}: compressed-tensors format {fmt!r} is not supported for integer weights; infercore loads "
                f"{' / '.join(map(repr, _FORMATS))}"
            )
        b, typ = w.get("num_bits"), str(w.get("type", "")).lower()
        if typ != "int" or b not in (4, 8) or isinstance(b, bool):
            raise ValueError(
                f"{at}.weights: expected type 'int' with num_bits 4 or 8, got {w.get('type')!r}, {b!r} (a config "
                "mixing integer and float weights is not supported)"
            )
        if fmt != "pack-quantized" and b != 8:
            raise ValueError(f"{at}: {fmt!r} stores 8-bit integer weights, got num_bits {b}")
        strategy = str(w.get("strategy", "tensor")).lower()
        if strategy not in _STRATEGIES:
            raise ValueError(f"{at}.weights.strategy: expected one of {_STRATEGIES}, got {strategy!r}")
        if strategy == "group":
            g = w.get("group_size")
            if isinstance(g, bool) or not isinstance(g, int) or g <= 0:
                raise ValueError(f"{at}.weights.group_size: expected a positive int, got {g!r}")
        if w.get("dynamic", False):
            raise ValueError(f"{at}.weights.dynamic: dynamic weight scales are not stored in a checkpoint")
        acts, g_acts = group.get("input_activations"), False
        if acts is not None:
            if not isinstance(acts, dict):
                raise ValueError(f"{at}.input_activations: expected an object or null, got {acts!r}")
            a_bits, a_type = acts.get("num_bits"), str(acts.get("type", "")).lower()
            if a_type != "int" or a_bits != 8:
                raise ValueError(
                    f"{at}.input_activations: {a_type} {a_bits}-bit activations are not supported with integer "
                    "weights (INT8 activations, or none: weight-only)"
                )
            if b != 8 or fmt == "pack-quantized" or strategy == "group" or not w.get("symmetric", True):
                raise ValueError(
                    f"{at}: INT8 activations run with symmetric per-channel or per-tensor INT8 weights "
                    f"(int-quantized), got {b}-bit {strategy} {fmt!r} weights"
                    + ("" if w.get("symmetric", True) else " with zero points")
                )
            g_acts = True
        bits.add(b)
        w8a8.add(g_acts)
    if len(w8a8) > 1:
        raise ValueError(f"{where}.config_groups: groups with and without INT8 activations in one checkpoint are "
                         "not supported")
    return {"method": "ct-int", "format": "compressed-tensors", "bits": sorted(bits), "w8a8": w8a8 == {True},
            "exclude": _patterns(f"{where}.ignore", q.get("ignore"))}


def _unpack_rows(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int32 ``[R, W]`` packed along the last dim (code ``j`` of a word at bits ``bits j``) -> codes int32
    ``[R, cols]``."""
    pack = 32 // bits
    shifts = torch.arange(pack, dtype=torch.int32) * bits
    codes = (words[..., None] >> shifts) & (2**bits - 1)
    return codes.reshape(words.shape[0], -1)[:, :cols]


def _scales(name: str, s: torch.Tensor, n: int) -> torch.Tensor:
    if s.dtype not in _SCALE_DTYPES:
        raise ValueError(f"checkpoint: {name}.weight_scale must be float32 / bfloat16 / float16, got {s.dtype}")
    s = s.float()
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise ValueError(f"checkpoint: {name}.weight_scale holds negative or non-finite scales")
    if s.numel() == 1:  # per tensor
        return s.reshape(1, 1).expand(n, 1).contiguous()
    if s.dim() == 1 and s.shape[0] == n:
        return s.reshape(n, 1)
    if s.dim() != 2 or s.shape[0] != n:
        raise ValueError(f"checkpoint: {name}.weight_scale holds {list(s.shape)}, expected [{n}, groups]")
    return s.contiguous()


def _int_weight(name: str, parts: dict[str, torch.Tensor], q: dict[str, Any]):
    """``(IntWeight or Int8Weight, input permutation or None)`` of one quantized linear's tensors, checked."""
    from ..quant.formats import Int8Weight, IntWeight
    from ..quant.packing import _pack_codes

    if "weight_scale" not in parts:
        raise ValueError(f"checkpoint: {name} has {sorted(parts)} but misses 'weight_scale'")
    packed = "weight_packed" in parts
    if packed:
        words = parts["weight_packed"]
        if words.dtype != torch.int32 or words.dim() != 2:
            raise ValueError(f"checkpoint: {name}.weight_packed must be int32 [N, words], got {words.dtype} "
                             f"{list(words.shape)}")
        if "weight_shape" not in parts:
            raise ValueError(f"checkpoint: {name} has {sorted(parts)} but misses 'weight_shape'")
        shape = [int(v) for v in parts["weight_shape"].reshape(-1).tolist()]
        n = words.shape[0]
        if len(shape) != 2 or shape[0] != n:
            raise ValueError(f"checkpoint: {name}.weight_shape {shape} does not fit weight_packed {list(words.shape)}")
        k = shape[1]
        bits = next((b for b in q["bits"] if -(-k * b // 32) == words.shape[1]), None)
        if bits is None:
            raise ValueError(f"checkpoint: {name}.weight_packed holds {words.shape[1]} words a row, which fits none of "
                             f"the config's {q['bits']}-bit codes for K = {k}")
        codes = _unpack_rows(words, bits, k)
    else:
        w = parts.get("weight")
        if w is None or w.dtype != torch.int8 or w.dim() != 2:
            raise ValueError(f"checkpoint: {name}.weight must be int8 [N, K] (integer weights)")
        n, k = w.shape
        bits, codes = 8, w.to(torch.int32) + 128
    if bits == 4 and k % 2:
        raise ValueError(f"checkpoint: {name}: 4-bit weights with an odd K ({k}) are not supported")
    s = _scales(name, parts["weight_scale"], n)
    groups = s.shape[1]
    if k % groups:
        raise ValueError(f"checkpoint: {name}.weight_scale holds {groups} groups a row, which do not divide K = {k}")
    g = k // groups
    zp = parts.get("weight_zero_point")
    zeros = None
    if zp is not None:
        if packed:
            if zp.dtype != torch.int32 or zp.dim() != 2 or zp.shape[1] != groups:
                raise ValueError(f"checkpoint: {name}.weight_zero_point must be int32 [words, {groups}] (packed "
                                 f"along N), got {zp.dtype} {list(zp.shape)}")
            if -(-n * bits // 32) != zp.shape[0]:
                raise ValueError(f"checkpoint: {name}.weight_zero_point holds {zp.shape[0]} packed rows, expected "
                                 f"{-(-n * bits // 32)} for N = {n}")
            zeros = _unpack_rows(zp.t().contiguous(), bits, n).t()  # [N, groups], offset like the codes
        else:
            if zp.dtype != torch.int8 or zp.numel() not in (1, n * groups):
                raise ValueError(f"checkpoint: {name}.weight_zero_point must be int8 like weight_scale, got {zp.dtype} "
                                 f"{list(zp.shape)}")
            zeros = (zp.to(torch.int32).reshape(-1, 1).expand(n, groups) if zp.numel() == 1
                     else zp.to(torch.int32).reshape(n, groups)) + 128
    perm = None
    gi = parts.get("weight_g_idx")
    if gi is not None:
        if gi.dtype not in (torch.int32, torch.int64) or gi.shape != (k,):
            raise ValueError(f"checkpoint: {name}.weight_g_idx must be an int32 / int64 [{k}] tensor")
        gi = gi.long()
        if not torch.equal(gi, torch.arange(k) // g):
            if int(gi.min()) < 0 or not torch.equal(torch.bincount(gi, minlength=groups), torch.full((groups,), g)):
                raise ValueError(f"checkpoint: {name}.weight_g_idx: every one of the {groups} groups must hold {g} "
                                 "input channels")
            perm = torch.argsort(gi, stable=True)
            codes = codes[:, perm]
    if q["w8a8"]:
        if zeros is not None or groups != 1 or bits != 8:
            raise ValueError(f"checkpoint: {name}: INT8 activations need symmetric per-channel INT8 weights")
        return Int8Weight((codes - 128).to(torch.int8).contiguous(), s.reshape(n).contiguous()), perm
    if int(codes.min()) < 0 or int(codes.max()) >= 2**bits:
        raise ValueError(f"checkpoint: {name}: codes outside {bits} bits")
    if zeros is not None and (int(zeros.min()) < 0 or int(zeros.max()) >= 2**bits):
        raise ValueError(f"checkpoint: {name}.weight_zero_point: zero points outside {bits} bits")
    z = None if zeros is None else zeros.to(torch.uint8).contiguous()
    return IntWeight(_pack_codes(codes, bits), s, z, bits, g, k), perm


def _concat(target: str, ws: list, names: list[str]):
    """One weight of the shards ``ws`` stacked along N (exact: the groups lie along K)."""
    from ..quant.formats import Int8Weight

    if isinstance(ws[0], Int8Weight):
        if any(w.shape[1] != ws[0].shape[1] for w in ws):
            raise ValueError(f"checkpoint: the shards of {target} ({', '.join(names)}) differ in input size")
        return Int8Weight(torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]))
    if any(w.symmetric != ws[0].symmetric for w in ws):  # symmetric shards get explicit zeros beside asymmetric ones
        from dataclasses import replace

        ws = [w if not w.symmetric else replace(w, zeros=w.zero_points().to(torch.uint8)) for w in ws]
    return _concat_int(ws)


def load_ct_int(ckpt, config, q: dict[str, Any], *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model of ``config`` on ``device`` with the integer linears of ``ckpt`` (an HF directory
    :class:`~infercore.loading.Checkpoint`) as ``QuantLinear`` s, and load the rest.

    ``q`` is :func:`int_config` of the checkpoint. Raises ``ValueError`` naming the tensor or module for a wrong
    dtype or shape, a missing part, a quantized linear the model lacks or the config excludes, a merged projection
    quantized only in part, or a tensor missing (by ``load_weights``)."""

    def is_part(leaf: str, t: torch.Tensor) -> bool:
        # INT8 codes share the name "weight" with dense weights: floating-point ones are dense
        return leaf in _PARTS or leaf in _DROP or (leaf == "weight" and not t.is_floating_point())

    def select(parts: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        for base, p in parts.items():
            if "weight" not in p and "weight_packed" not in p and set(p) & set(_PARTS):
                raise ValueError(f"checkpoint: {base} has {sorted(p)} but no integer weight (weight_packed, or an "
                                 "int8 weight)")
        return sorted(b for b, p in parts.items() if "weight" in p or "weight_packed" in p)

    return build_prequantized(
        ckpt, config, dtype=dtype, device=device, label="compressed-tensors integer",
        is_part=is_part, select=select, weight=lambda base, parts: _int_weight(base, parts, q), concat=_concat,
        codes="weight_packed",
        none_converted="checkpoint: an integer compressed-tensors quantization_config is set but no linear has "
                       "weight_packed codes or an int8 weight",
        excluded=lambda base: _ct_excluded(base, q), drop=_KV_SCALES,
    )
