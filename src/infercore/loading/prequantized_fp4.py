"""Pre-quantized NVFP4 checkpoints: NVIDIA ModelOpt exports and compressed-tensors ``nvfp4-pack-quantized``.

Both store an NVFP4 linear ``<name>`` ``[N, K]`` as FP4 e2m1 codes, two a byte, plus one e4m3 scale per block of
16 along K and one fp32 scale per tensor; they are loaded weight-only into
:class:`~infercore.quant.FP4Weight` (``fmt="nvfp4"``) :class:`~infercore.quant.QuantLinear` s, whose kernels
decode the codes (no FP4 instruction needed), with q / k / v and gate / up merged as the dense loader merges
them (:func:`infercore.loading.prequantized.build_prequantized`). Everything else loads through the model's
``load_weights``. The ModelOpt and compressed-tensors config plumbing here (``_modelopt_settings``, ``_ct_groups``,
exclude lists) serves :mod:`infercore.loading.prequantized_fp8` too.

**ModelOpt** (``NVIDIA/Model-Optimizer``, ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``
``NVFP4QTensor``; read by vLLM's ``vllm/model_executor/layers/quantization/modelopt.py``
``ModelOptNvFp4Config`` / ``ModelOptNvFp4LinearMethod``):

* config: ``config.json``'s ``quantization_config`` ``{"quant_method": "modelopt", "quant_algo": "NVFP4",
  "ignore": [...], "config_groups": {"group_0": {"weights": {"group_size": 16, ...}, ...}}, ...}``
  (``modelopt/torch/export/convert_hf_config.py`` ``convert_hf_quant_config_format``), or, in older exports
  without it, ``hf_quant_config.json`` ``{"producer": ..., "quantization": {"quant_algo": "NVFP4", "group_size":
  16, "exclude_modules": [...], "kv_cache_quant_algo": ...}}``. ``quant_algo`` ``"NVFP4"`` (W4A4) and
  ``"W4A16_NVFP4"`` (weight-only) are read; the exclude list holds fnmatch wildcards (``"lm_head"``,
  ``"model.layers.0.mlp*"``), as vLLM's ``is_layer_excluded`` matches them.
* tensors: ``<name>.weight`` uint8 ``[N, K / 2]``, element ``2j`` in the low nibble and ``2j + 1`` in the high
  one (``packed = (q[..., 1::2] << 4) | q[..., 0::2]`` in ``NVFP4QTensor.quantize``); ``<name>.weight_scale``
  float8_e4m3fn ``[N, K / 16]``; ``<name>.weight_scale_2`` fp32 scalar ``amax / (6 * 448)``; and, for W4A4,
  ``<name>.input_scale`` fp32 scalar, the *activation* global scale of an FP4 x FP4 GEMM: unused here (the
  activations stay in the model dtype), so it is read and dropped. ``w = e2m1(code) * float(weight_scale) *
  weight_scale_2`` (``NVFP4QTensor.dequantize``): ``weight_scale_2`` is :class:`FP4Weight`'s ``global_scale``
  as stored.
* merged projections: ModelOpt's export gives the q / k / v and gate / up shards one ``weight_scale_2`` (the
  max of their amaxes: ``preprocess_linear_fusion`` in ``modelopt/torch/export/quant_utils.py``). vLLM, given
  shards whose scales differ, warns and uses the max for all of them without touching the e4m3 block scales
  (``process_weights_after_loading``), which changes the other shards' weights.

**compressed-tensors** (``vllm-project/compressed-tensors``, ``compressors/nvfp4/base.py``
``NVFP4PackedCompressor`` and ``compressors/nvfp4/helpers.py``; vLLM's
``compressed_tensors/schemes/compressed_tensors_w4a16_nvfp4.py``):

* config: ``quantization_config`` ``{"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
  "config_groups": {...: {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
  "group_size": 16, "symmetric": true, ...}, "format": ...}}, "ignore": [...], "quantization_status":
  "compressed"}``; ``ignore`` entries are module names or ``"re:"`` regexes (``utils/match.py``
  ``match_name``).
* tensors: ``<name>.weight_packed`` uint8 ``[N, K / 2]``, same nibble order (``pack_fp4_to_uint8``:
  ``indices[:, 0] | (indices[:, 1] << 4)``); ``<name>.weight_scale`` float8_e4m3fn ``[N, K / 16]``;
  ``<name>.weight_global_scale`` fp32 ``[1]``, the **reciprocal** of ModelOpt's: ``6 * 448 / amax``
  (``quantization/utils/helpers.py`` ``generate_gparam``), dequantized as ``e2m1 * (weight_scale /
  weight_global_scale)`` (``quantization/lifecycle/forward_helpers.py`` ``_dequantize``); vLLM reciprocates it
  too ("ct stores the inverse"). ``global_scale`` here is the fp32 ``1 / weight_global_scale``, so a block
  scale may differ from the exact quotient by one fp32 rounding. ``<name>.input_global_scale`` (W4A4) is dropped.

Merged projections whose shards carry different global scales are merged only where that stays exact: one
shard's global scale is taken for all and each other shard's e4m3 block scales are multiplied by the ratio,
accepted only if every rescaled block scale is an e4m3 value whose product with the common scale equals the
shard's original block scale bit for bit (in practice: ratios that are powers of two, within e4m3's range).
Otherwise ``ValueError`` naming the tensors: nothing is rescaled lossily.

FP8 KV-cache and attention scales (``k_scale``, ``v_scale``, ``q_scale``, ``prob_scale``, ``output_scale``,
``prob_output_scale``) are dropped: the cache keeps the model dtype.
A linear left dense (an excluded module, or any linear stored as a floating-point ``weight``) loads dense.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Container
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .prequantized import build_prequantized

HF_QUANT_CONFIG = "hf_quant_config.json"
_MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")
_CT_FORMAT = "nvfp4-pack-quantized"
_GROUP = 16
# Tensor leaves of one quantized linear, per format: packed codes, e4m3 block scales, fp32 global scale, and the
# activation scales a W4A4 export adds (read and dropped).
_LEAVES = {
    "modelopt": {"codes": "weight", "scales": "weight_scale", "global": "weight_scale_2", "drop": ("input_scale",)},
    "compressed-tensors": {
        "codes": "weight_packed",
        "scales": "weight_scale",
        "global": "weight_global_scale",
        "drop": ("input_global_scale",),
    },
}
# attention / KV-cache scales of an FP8 KV cache or attention (ModelOpt, compressed-tensors): unused here, dropped
_KV_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale", "output_scale", "prob_output_scale")


def read_hf_quant_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """ModelOpt's ``hf_quant_config.json`` of the directory ``path`` as a dict, or None without one."""
    from .safetensors_dir import _read_json_object

    file = Path(path) / HF_QUANT_CONFIG
    return _read_json_object(file) if file.is_file() else None


def _group_sizes(q: dict[str, Any]) -> list[Any]:
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict):
        return []
    return [
        g["weights"].get("group_size")
        for g in groups.values()
        if isinstance(g, dict) and isinstance(g.get("weights"), dict)
    ]


def _check_group(where: str, group: Any) -> None:
    if isinstance(group, bool) or group != _GROUP:
        raise ValueError(f"{where}: NVFP4 group_size must be {_GROUP}, got {group!r}")


def _named(name: str, patterns: list[str]) -> bool:
    """Whether a vLLM / transformers module-name list names module ``name``: the name itself, a trailing part of it
    (``"lm_head"``) or a parent module."""
    return any(name == p or name.endswith("." + p) or name.startswith(p + ".") for p in patterns if p)


def _patterns(where: str, value: Any) -> list[str]:
    value = [] if value is None else value
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"{where}: expected a list of module names, got {value!r}")
    return value


def nvfp4_config(q: dict[str, Any], where: str = "config.json: quantization_config") -> dict[str, Any]:
    """The NVFP4 settings of a ModelOpt (``quant_method`` ``"modelopt"``, or an ``hf_quant_config.json`` with a
    ``quantization`` object) or compressed-tensors ``quantization_config``, checked: ``{"method": "nvfp4",
    "format": "modelopt" | "compressed-tensors", "group_size": 16, "exclude": [patterns]}``. ``where`` names the
    source in errors. ``ValueError`` for an algorithm, format or setting this loader does not run."""
    if not isinstance(q, dict):
        raise ValueError(f"{where}: expected an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _ct_config(q, where)
    inner, where, _ = _modelopt_settings(
        q, where, "a ModelOpt or compressed-tensors NVFP4", _MODELOPT_ALGOS,
        f"{' and '.join(_MODELOPT_ALGOS)} (FP4 weights, run weight-only)",
    )
    group = inner.get("group_size")
    sizes = _group_sizes(inner)
    if group is None and sizes:
        group = sizes[0]
    _check_group(f"{where}.group_size", _GROUP if group is None else group)  # vLLM's default: 16
    for s in sizes:
        _check_group(f"{where}.config_groups", s)
    return {"method": "nvfp4", "format": "modelopt", "group_size": _GROUP, "exclude": _modelopt_exclude(inner, where)}


def _modelopt_settings(
    q: dict[str, Any], where: str, what: str, algos: Container[str], loads: str
) -> tuple[dict[str, Any], str, str]:
    """``(settings, where, quant_algo)`` of a ModelOpt config ``q`` (NVFP4 or FP8): its ``quantization`` object (an
    ``hf_quant_config.json``, or a ``config.json`` holding it nested) or ``q`` itself (``quant_method``
    ``"modelopt..."``), ``where`` naming it, and its ``quant_algo`` (upper case), one of ``algos``. ``ValueError``
    for anything else: calling it not ``what`` config, or saying the loader ``loads`` other algorithms."""
    if "quantization" in q:  # hf_quant_config.json, or a config.json holding it nested
        inner = q["quantization"]
        if not isinstance(inner, dict):
            raise ValueError(f"{where}: 'quantization' must be an object, got {type(inner).__name__}")
        where = f"{where}.quantization"
    else:
        method = str(q.get("quant_method", "")).lower()
        if not method.startswith("modelopt"):
            raise ValueError(f"{where}: not {what} config (quant_method {method!r})")
        inner = q
    algo = str(inner.get("quant_algo") or "").upper()
    if algo not in algos:
        raise ValueError(
            f"{where}: ModelOpt quant_algo {inner.get('quant_algo')!r} is not supported; infercore loads {loads}"
        )
    return inner, where, algo


def _modelopt_exclude(inner: dict[str, Any], where: str) -> list[str]:
    """The exclude patterns of ModelOpt settings (``exclude_modules``, or ``ignore`` in the config.json form)."""
    key = "exclude_modules" if "exclude_modules" in inner else "ignore"
    return _patterns(f"{where}.{key}", inner.get(key))


def _ct_groups(q: dict[str, Any], where: str, stored: str):
    """``(where, format, weights, group)`` of each of a compressed-tensors config's ``config_groups``, checked to be
    ``"compressed"`` (``stored`` says what that means, in the message) and to hold objects with ``weights``."""
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}.quantization_status: expected 'compressed' ({stored}), got {status!r}")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups: expected a non-empty object, got {groups!r}")
    for gname, g in groups.items():
        at = f"{where}.config_groups.{gname}"
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise ValueError(f"{at}: expected an object with 'weights'")
        yield at, g.get("format") or q.get("format"), g["weights"], g


def _check_float_bits(at: str, w: dict[str, Any], bits: int, name: str) -> None:
    if w.get("num_bits") != bits or str(w.get("type", "")).lower() != "float":
        raise ValueError(
            f"{at}.weights: expected num_bits {bits}, type 'float' ({name}), got {w.get('num_bits')!r}, "
            f"{w.get('type')!r}"
        )


def _ct_config(q: dict[str, Any], where: str) -> dict[str, Any]:
    for at, fmt, w, _ in _ct_groups(q, where, "packed tensors"):
        if fmt != _CT_FORMAT:
            raise ValueError(
                f"{at}: compressed-tensors format {fmt!r} is not supported; infercore loads "
                f"{_CT_FORMAT!r} (and 'gptq' / 'awq' checkpoints)"
            )
        _check_float_bits(at, w, 4, "NVFP4")
        strategy = str(w.get("strategy", "tensor_group")).lower()
        if strategy != "tensor_group":
            raise ValueError(f"{at}.weights.strategy: expected 'tensor_group' (NVFP4), got {strategy!r}")
        if not w.get("symmetric", True):
            raise ValueError(f"{at}.weights.symmetric: NVFP4 with zero points is not supported")
        _check_group(f"{at}.weights.group_size", w.get("group_size"))
    exclude = _patterns(f"{where}.ignore", q.get("ignore"))
    return {"method": "nvfp4", "format": "compressed-tensors", "group_size": _GROUP, "exclude": exclude}


def _excluded(name: str, q: dict[str, Any]) -> bool:
    for p in q["exclude"]:
        if q["format"] == "compressed-tensors":
            if p == name or (p.startswith("re:") and re.match(p[3:], name)):
                return True
        elif fnmatchcase(name, p):  # ModelOpt: wildcards ("lm_head", "model.layers.0.mlp*")
            return True
    return False


def _fp4_weight(name: str, parts: dict[str, torch.Tensor], q: dict[str, Any]):
    """:class:`FP4Weight` of one quantized linear's tensors, every dtype and shape checked."""
    from ..quant.formats import FP4Weight

    leaves = _LEAVES[q["format"]]
    need = (leaves["codes"], leaves["scales"], leaves["global"])
    missing = [p for p in need if p not in parts]
    if missing:
        raise ValueError(f"checkpoint: {name} has {sorted(parts)} but misses {missing}")
    codes, scales, g = (parts[p] for p in need)
    cn, sn, gn = (f"{name}.{p}" for p in need)
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(
            f"checkpoint: {cn} must be uint8 [N, K / 2] (two FP4 codes a byte), got {codes.dtype} {list(codes.shape)}"
        )
    if scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"checkpoint: {sn} must be float8_e4m3fn (NVFP4 block scales), got {scales.dtype}")
    n, k = codes.shape[0], 2 * codes.shape[1]
    if k % _GROUP or scales.shape != (n, k // _GROUP):
        raise ValueError(
            f"checkpoint: {sn} holds {list(scales.shape)}, expected [{n}, {k // _GROUP}] for {cn} "
            f"{list(codes.shape)} (one scale per {_GROUP} weights)"
        )
    if torch.isnan(scales.float()).any():
        raise ValueError(f"checkpoint: {sn} holds NaN block scales")
    if g.dtype != torch.float32 or g.numel() != 1:
        raise ValueError(f"checkpoint: {gn} must be one float32 value, got {g.dtype} {list(g.shape)}")
    value = g.reshape(()).float()
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"checkpoint: {gn} must be positive and finite, got {float(value)}")
    if q["format"] == "compressed-tensors":  # stored as the reciprocal
        value = torch.reciprocal(value)
        if not (math.isfinite(float(value)) and float(value) > 0):
            raise ValueError(f"checkpoint: 1 / {gn} is not a positive finite fp32 value")
    try:
        return FP4Weight(codes.contiguous(), scales.contiguous().view(torch.uint8), "nvfp4", float(value))
    except (ValueError, TypeError) as e:
        raise ValueError(f"checkpoint: {name}: {e}") from None


def _rescaled(w, g: float):
    """``w`` with ``global_scale`` ``g`` and its e4m3 block scales multiplied by ``w.global_scale / g``, or None
    unless every block scale (e4m3 times the global scale, in fp32, as ``FP4Weight.block_scales``) is unchanged."""
    from ..quant.formats import FP4Weight

    if g == w.global_scale:
        return w
    s = w.scales.view(torch.float8_e4m3fn)
    new = (s.double() * (w.global_scale / g)).float()
    e4m3 = new.to(torch.float8_e4m3fn)
    if not torch.equal(e4m3.float(), new):  # out of range or not an e4m3 value
        return None
    g32 = torch.tensor(g, dtype=torch.float32)
    if not torch.equal(e4m3.float() * g32, s.float() * torch.tensor(w.global_scale, dtype=torch.float32)):
        return None
    return FP4Weight(w.qweight, e4m3.view(torch.uint8), "nvfp4", g)


def _concat(target: str, ws: list, names: list[str], leaf: str):
    """One :class:`FP4Weight` of the shards ``ws`` stacked along N; different global scales only where exact."""
    from ..quant.formats import FP4Weight

    if any(w.shape[1] != ws[0].shape[1] for w in ws):
        raise ValueError(f"checkpoint: the shards of {target} ({', '.join(names)}) differ in input size")
    scales = [w.global_scale for w in ws]
    for g in sorted(set(scales), reverse=True):
        shards = [_rescaled(w, g) for w in ws]
        if all(s is not None for s in shards):
            return FP4Weight(torch.cat([s.qweight for s in shards]), torch.cat([s.scales for s in shards]), "nvfp4", g)
    listed = ", ".join(f"{n}.{leaf} = {s!r}" for n, s in zip(names, scales))
    raise ValueError(
        f"checkpoint: the shards of {target} have different global scales ({listed}) and their e4m3 "
        "block scales cannot be brought to one global scale exactly; infercore does not rescale them "
        "lossily. Re-export with a shared global scale for q/k/v and gate/up (ModelOpt does by default)"
    )


def load_nvfp4(ckpt, config, q: dict[str, Any], *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model of ``config`` on ``device`` with the NVFP4 linears of ``ckpt`` (an HF directory
    :class:`~infercore.loading.Checkpoint`) as ``QuantLinear`` s over :class:`FP4Weight`, and load the rest.

    ``q`` is :func:`nvfp4_config` of the checkpoint. Raises ``ValueError`` naming the tensor or module for a wrong
    dtype or shape, a missing part, a quantized linear the model lacks or the config excludes, a merged
    projection quantized only in part or with global scales that cannot be merged exactly (module docstring),
    or a tensor missing (by ``load_weights``)."""
    leaves = _LEAVES[q["format"]]
    parts_of = {leaves["codes"], leaves["scales"], leaves["global"], *leaves["drop"]}
    return build_prequantized(
        ckpt,
        config,
        dtype=dtype,
        device=device,
        label="NVFP4",
        # ModelOpt's codes share the name "weight" with dense weights: floating-point ones are dense
        is_part=lambda leaf, t: leaf in parts_of and (leaf != "weight" or not t.is_floating_point()),
        # a dense linear's activation scale is a part too: read and dropped
        select=lambda parts: sorted(b for b, p in parts.items() if set(p) - set(leaves["drop"])),
        weight=lambda base, parts: (_fp4_weight(base, parts, q), None),
        concat=lambda target, ws, names: _concat(target, ws, names, leaves["global"]),
        codes=leaves["codes"],
        none_converted=(
            f"checkpoint: an NVFP4 quantization_config is set but no linear has "
            f"{leaves['codes']!r} codes with {leaves['scales']!r} / {leaves['global']!r} scales"
        ),
        excluded=lambda base: _excluded(base, q),
        drop=_KV_SCALES,
    )
