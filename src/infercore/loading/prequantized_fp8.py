"""Pre-quantized FP8 checkpoints: ``quant_method`` ``"fp8"`` (DeepSeek / Qwen3-FP8 block-128 exports, transformers'
``finegrained_fp8``, per-tensor FP8 exports), ``"fbgemm_fp8"`` (Meta's Llama-3.1 FP8 exports), NVIDIA ModelOpt FP8
and compressed-tensors ``float-quantized`` / ``naive-quantized`` with FP8 weights.

Each stores an FP8 linear ``<name>`` ``[N, K]`` as ``<name>.weight`` ``float8_e4m3fn`` ``[N, K]`` plus fp32 (or
bf16 / fp16) scales that **multiply** the decoded e4m3 values: ``w = e4m3(weight) * scale``, the scale per tensor,
per output channel or per 128 x 128 block. They load **weight-only** into :class:`~infercore.quant.FP8Weight`
:class:`~infercore.quant.QuantLinear` s (whose kernels decode e4m3 on any GPU, and on the CPU), with q / k / v and
gate / up merged as the dense loader merges them (:func:`infercore.loading.prequantized.build_prequantized`);
everything else loads through the model's ``load_weights``. The activations stay in the model dtype:
``activation_scheme`` / ``input_activations`` are read but ignored, and the static activation scales
(``<name>.input_scale``) are dropped. FP8 KV-cache scales (``k_scale``, ``v_scale``, ``q_scale``, ``prob_scale``,
``output_scale``) are dropped too: the cache keeps the model dtype.

Scales map onto :class:`FP8Weight` exactly: a per-tensor scale is expanded to one per output channel (``[N]``, the
same fp32 value in every row), a per-channel scale is ``[N]``, a block scale ``[ceil(N / 128), ceil(K / 128)]`` with
``block_size=128`` (the only block :class:`FP8Weight`'s kernels take). bf16 / fp16 / e8m0 scales widen to fp32
exactly, and the product ``e4m3 * scale`` is taken in fp32 (as vLLM, which loads the scales into fp32 parameters).

**quant_method "fp8"** (vLLM ``vllm/model_executor/layers/quantization/fp8.py`` ``Fp8Config`` /
``Fp8LinearMethod``; transformers ``src/transformers/integrations/finegrained_fp8.py`` and
``utils/quantization_config.py`` ``FineGrainedFP8Config``):

* config: ``{"quant_method": "fp8", "activation_scheme": "dynamic" | "static", "weight_block_size": [128, 128]
  (or absent / null), "fmt": "e4m3", "ignored_layers" | "modules_to_not_convert": [...]}``. vLLM reads
  ``ignored_layers`` and falls back to ``modules_to_not_convert``; transformers writes the latter. Both are read
  here; an entry matches a module by its full name, a trailing part of it (``"lm_head"``) or a parent module.
* block (``weight_block_size`` given): ``<name>.weight_scale_inv`` fp32 ``[ceil(N / bn), ceil(K / bk)]``; despite
  its name it is *multiplied* (vLLM registers it as the block layer's weight scale, "The weight_scale_inv name is
  intentional for deepseekv3", and its block GEMM does ``tl.dot(a, b) * a_s * b_s``; transformers'
  ``Fp8Quantize`` stores ``inv_scales = 1 / (448 / amax)`` and ``_dequantize_fp8_weight`` multiplies by it).
  Only ``[128, 128]`` is accepted (``ValueError`` otherwise).
* per tensor (no ``weight_block_size``): ``<name>.weight_scale`` fp32, one value (vLLM's ``PerTensorScaleParameter``;
  AutoFP8-style exports), or transformers' ``<name>.weight_scale_inv`` ``[1, 1]`` (its ``FP8Linear`` without a
  block size); ``<name>.input_scale`` with ``activation_scheme`` ``"static"``.

**quant_method "fbgemm_fp8"** (transformers ``integrations/fbgemm_fp8.py`` ``FbgemmFp8Linear`` and
``FbgemmFp8Config``; vLLM ``quantization/fbgemm_fp8.py``): config ``{"quant_method": "fbgemm_fp8",
"activation_scale_ub": 1200.0, "modules_to_not_convert": [...]}``; ``<name>.weight`` e4m3 ``[N, K]`` and
``<name>.weight_scale`` fp32 ``[N, 1]`` (per output row, multiplied); ``input_scale_ub`` (the bound of the dynamic
per-token activation scales, a buffer transformers does not save) is dropped where present: the activations stay in
the model dtype.

**ModelOpt** (vLLM ``vllm/model_executor/layers/quantization/modelopt.py`` ``ModelOptFp8Config``,
``ModelOptFp8LinearMethod``, ``ModelOptFp8PcPtLinearMethod``, ``ModelOptFp8PbWoLinearMethod``): the same config
plumbing as NVFP4 (:mod:`infercore.loading.prequantized_fp4`: ``quantization_config`` ``{"quant_method":
"modelopt", "quant_algo": ..., "ignore": [...]}`` or ``hf_quant_config.json`` ``{"quantization": {"quant_algo":
..., "exclude_modules": [...]}}``, fnmatch wildcards). ``quant_algo`` ``"FP8"``: ``weight`` e4m3, ``weight_scale``
fp32 scalar, ``input_scale`` fp32 scalar (dropped); ``"FP8_PER_CHANNEL_PER_TOKEN"``: ``weight_scale`` fp32 ``[N]``;
``"FP8_PB_WO"``: ``weight_scale`` fp32 ``[N / 128, 1, K / 128, 1]`` (or ``[N / 128, K / 128]``). For q / k / v
with different per-tensor scales vLLM requantizes the shards to their max scale (``requantize_with_max_scale``,
lossy); here each shard keeps its own scale as per-channel scales (exact).

**compressed-tensors** (``vllm-project/compressed-tensors``: ``quantization/quant_scheme.py`` presets ``FP8``
(tensor), ``FP8_DYNAMIC`` (channel), ``FP8_BLOCK`` (block 128 x 128); ``compressors/naive_quantized/base.py``
``FloatQuantizationCompressor`` (``float-quantized``, schemes with input activations) and
``NaiveQuantizationCompressor`` (``naive-quantized``, weight-only); scale shapes from
``quantization/lifecycle/initialize.py``; vLLM ``compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py`` and
``compressed_tensors_w8a16_fp8.py``):

* config: ``{"quant_method": "compressed-tensors", "format": "float-quantized" | "naive-quantized",
  "config_groups": {...: {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor" | "channel" | "block",
  "block_structure": [128, 128], "symmetric": true, "dynamic": false}, "input_activations": ..., "format": ...}},
  "ignore": [...], "quantization_status": "compressed"}``; ``ignore`` entries are module names or ``"re:"``
  regexes.
* tensors: ``weight`` e4m3 ``[N, K]``; ``weight_scale`` ``[1]`` (tensor), ``[N, 1]`` (channel) or
  ``[ceil(N / 128), ceil(K / 128)]`` (block), in the dtype the model had when quantized (``_dequantize``:
  ``x_q.to(scale.dtype) * scale``); ``input_scale`` ``[1]`` (static ``FP8`` preset) dropped.

Merged projections: per-channel scales (and per-tensor ones, expanded) concatenate exactly; 128 x 128 block scales
only when every shard but the last has a multiple of 128 rows (otherwise one scale block would straddle two
shards): ``ValueError`` naming the shards. A linear stored with a floating-point (non-FP8) ``weight`` loads dense;
one the config excludes but stored as FP8 is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .prequantized import build_prequantized
from .prequantized_fp4 import (
    _KV_SCALES,
    _check_float_bits,
    _ct_groups,
    _modelopt_exclude,
    _modelopt_settings,
    _named,
    _patterns,
)
from .prequantized_fp4 import _excluded as _modelopt_or_ct_excluded

_BLOCK = 128
_E4M3 = torch.float8_e4m3fn
_FP8_DTYPES = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
_SCALE_DTYPES = tuple(
    getattr(torch, n) for n in ("float32", "bfloat16", "float16", "float8_e8m0fnu") if hasattr(torch, n)
)
# ModelOpt quant_algo -> the weight-scale strategy it stores
_MODELOPT_ALGOS = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel", "FP8_PB_WO": "block"}
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_STRATEGIES = ("tensor", "channel", "block")
_SCALES = ("weight_scale", "weight_scale_inv")
_DROP = ("input_scale", "input_scale_ub")  # activation scales / bounds: the activations stay in the model dtype


def is_fp8_config(q: Any) -> bool:
    """Whether the ``quantization_config`` (or ModelOpt ``hf_quant_config.json``) ``q`` describes FP8 weights:
    ``quant_method`` ``"fp8"``, a ModelOpt ``quant_algo`` starting with ``"FP8"``, or a compressed-tensors config
    whose groups hold 8-bit float weights (in a format other than ``nvfp4-pack-quantized``). Anything else (NVFP4
    included) is left to the other loaders."""
    if not isinstance(q, dict):
        return False
    method = str(q.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8"):
        return True
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if not isinstance(groups, dict):
            return False
        return any(
            isinstance(g, dict)
            and isinstance(g.get("weights"), dict)
            and g["weights"].get("num_bits") == 8
            and str(g["weights"].get("type", "")).lower() == "float"
            and (g.get("format") or q.get("format")) != "nvfp4-pack-quantized"
            for g in groups.values()
        )
    inner = q.get("quantization") if "quantization" in q else q if method.startswith("modelopt") else None
    return isinstance(inner, dict) and str(inner.get("quant_algo") or "").upper().startswith("FP8")


def fp8_config(q: dict[str, Any], where: str = "config.json: quantization_config") -> dict[str, Any]:
    """The FP8 settings of a ``quant_method`` ``"fp8"``, ModelOpt or compressed-tensors ``quantization_config``
    (or an ``hf_quant_config.json``), checked: ``{"method": "fp8", "format": "fp8" | "fbgemm" | "modelopt" |
    "compressed-tensors", "strategies": [the scale layouts it may store], "exclude": [patterns]}``. ``where``
    names the source in errors. ``ValueError`` for a setting this loader does not run; ``activation_scheme`` and
    input-activation settings are not checked (weight-only)."""
    if not isinstance(q, dict):
        raise ValueError(f"{where}: expected an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return _native_config(q, where)
    if method == "fbgemm_fp8":
        exclude = _patterns(f"{where}.modules_to_not_convert", q.get("modules_to_not_convert"))
        return {"method": "fp8", "format": "fbgemm", "strategies": ["channel"], "exclude": exclude}
    if method == "compressed-tensors":
        return _ct_config(q, where)
    inner, where, algo = _modelopt_settings(
        q, where, "an FP8", _MODELOPT_ALGOS,
        f"{', '.join(_MODELOPT_ALGOS)} (FP8 weights, run weight-only) and NVFP4 / W4A16_NVFP4",
    )
    exclude = _modelopt_exclude(inner, where)
    return {"method": "fp8", "format": "modelopt", "strategies": [_MODELOPT_ALGOS[algo]], "exclude": exclude}


def _native_config(q: dict[str, Any], where: str) -> dict[str, Any]:
    fmt = q.get("fmt")
    if fmt is not None and str(fmt).lower() != "e4m3":
        raise ValueError(f"{where}.fmt: only 'e4m3' FP8 weights are supported, got {fmt!r}")
    block = q.get("weight_block_size")
    if block is not None:
        if not isinstance(block, (list, tuple)) or [b for b in block if not isinstance(b, bool)] != [_BLOCK, _BLOCK]:
            raise ValueError(
                f"{where}.weight_block_size: expected [{_BLOCK}, {_BLOCK}] (or null for per-tensor scales), got "
                f"{block!r}; infercore's FP8 kernels take {_BLOCK}x{_BLOCK} blocks only"
            )
    exclude = []
    for key in ("ignored_layers", "modules_to_not_convert"):
        exclude += _patterns(f"{where}.{key}", q.get(key))
    strategy = "tensor" if block is None else "block"
    return {"method": "fp8", "format": "fp8", "strategies": [strategy], "exclude": exclude}


def _ct_config(q: dict[str, Any], where: str) -> dict[str, Any]:
    strategies: list[str] = []
    for at, fmt, w, _ in _ct_groups(q, where, "FP8 tensors"):
        if fmt not in _CT_FORMATS:
            raise ValueError(
                f"{at}: compressed-tensors format {fmt!r} is not supported for FP8 weights; infercore loads "
                f"{' / '.join(map(repr, _CT_FORMATS))} (and 'nvfp4-pack-quantized')"
            )
        _check_float_bits(at, w, 8, "FP8")
        strategy = str(w.get("strategy", "tensor")).lower()
        if strategy not in _CT_STRATEGIES:
            raise ValueError(f"{at}.weights.strategy: expected one of {_CT_STRATEGIES} for FP8, got {strategy!r}")
        if strategy == "block" and list(w.get("block_structure") or []) != [_BLOCK, _BLOCK]:
            raise ValueError(
                f"{at}.weights.block_structure: expected [{_BLOCK}, {_BLOCK}], got {w.get('block_structure')!r}; "
                f"infercore's FP8 kernels take {_BLOCK}x{_BLOCK} blocks only"
            )
        if not w.get("symmetric", True):
            raise ValueError(f"{at}.weights.symmetric: FP8 with zero points is not supported")
        if w.get("dynamic", False):
            raise ValueError(f"{at}.weights.dynamic: dynamic weight scales are not stored in a checkpoint")
        strategies.append(strategy)
    exclude = _patterns(f"{where}.ignore", q.get("ignore"))
    return {"method": "fp8", "format": "compressed-tensors", "strategies": sorted(set(strategies)), "exclude": exclude}


def _excluded(name: str, q: dict[str, Any]) -> bool:
    if q["format"] not in ("fp8", "fbgemm"):
        return _modelopt_or_ct_excluded(name, q)
    return _named(name, q["exclude"])


def _fp8_weight(name: str, parts: dict[str, torch.Tensor], q: dict[str, Any]):
    """:class:`FP8Weight` of one quantized linear's tensors, every dtype and shape checked."""
    from ..quant.formats import FP8Weight

    w = parts["weight"]
    if w.dtype != _E4M3 or w.dim() != 2:
        raise ValueError(
            f"checkpoint: {name}.weight must be float8_e4m3fn [N, K] (FP8 weights), got {w.dtype} {list(w.shape)}"
        )
    if "weight_zero_point" in parts:
        raise ValueError(f"checkpoint: {name}.weight_zero_point: FP8 weights with zero points are not supported")
    leaves = ("weight_scale_inv", "weight_scale") if q["format"] == "fp8" else ("weight_scale",)
    present = [p for p in leaves if p in parts]
    if not present:
        raise ValueError(f"checkpoint: {name} has {sorted(parts)} but misses {' or '.join(map(repr, leaves))}")
    if len(present) > 1:
        raise ValueError(f"checkpoint: {name} has both {present}; expected one weight scale")
    sn = f"{name}.{present[0]}"
    s = parts[present[0]]
    if s.dtype not in _SCALE_DTYPES:
        raise ValueError(f"checkpoint: {sn} must be float32 / bfloat16 / float16 (scales), got {s.dtype}")
    s = s.float()
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise ValueError(f"checkpoint: {sn} holds negative or non-finite scales")
    n, k = w.shape
    nb, kb = math.ceil(n / _BLOCK), math.ceil(k / _BLOCK)
    shape, strategies = tuple(s.shape), q["strategies"]
    scales, block = None, None
    if "tensor" in strategies and s.numel() == 1:
        scales = s.reshape(1).expand(n)
    elif "channel" in strategies and shape in ((n,), (n, 1)):
        scales = s.reshape(n)
    elif "block" in strategies and shape in ((nb, kb), (nb, 1, kb, 1)):
        scales, block = s.reshape(nb, kb), _BLOCK
    if scales is None:
        want = {
            "tensor": "one value (per tensor)",
            "channel": f"[{n}] or [{n}, 1] (per output channel)",
            "block": f"[{nb}, {kb}] ({_BLOCK}x{_BLOCK} blocks)",
        }
        raise ValueError(
            f"checkpoint: {sn} holds {list(shape)}, expected {' or '.join(want[x] for x in strategies)} for "
            f"{name}.weight {[n, k]}"
        )
    return FP8Weight(w.contiguous().view(torch.uint8), scales.contiguous(), block)


def _fp8_linears(parts: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """The linears of ``parts`` stored as FP8 (those with a ``weight`` part), sorted; ``ValueError`` for a dense
    linear with a weight scale or zero point (its other parts may only be activation scales, dropped)."""
    for base, p in parts.items():
        if "weight" not in p and set(p) & {*_SCALES, "weight_zero_point"}:
            raise ValueError(
                f"checkpoint: {base} has {sorted(p)} but its weight is not stored as float8_e4m3fn (a dense "
                "weight takes no weight scale)"
            )
    return sorted(b for b, p in parts.items() if "weight" in p)


def _concat(target: str, ws: list, names: list[str]):
    """One :class:`FP8Weight` of the shards ``ws`` stacked along N, only where exact."""
    from ..quant.formats import FP8Weight

    if any(w.shape[1] != ws[0].shape[1] for w in ws):
        raise ValueError(f"checkpoint: the shards of {target} ({', '.join(names)}) differ in input size")
    if any(w.block_size != ws[0].block_size for w in ws):
        raise ValueError(
            f"checkpoint: the shards of {target} ({', '.join(names)}) mix {_BLOCK}x{_BLOCK} block and per-channel "
            "scales; a merged projection needs one layout"
        )
    if ws[0].block_size is not None and any(w.shape[0] % _BLOCK for w in ws[:-1]):
        rows = ", ".join(f"{n}: {w.shape[0]}" for n, w in zip(names, ws))
        raise ValueError(
            f"checkpoint: the shards of {target} have {rows} rows; {_BLOCK}x{_BLOCK} block scales can be merged only "
            f"when every shard but the last has a multiple of {_BLOCK} rows (a scale block would straddle two "
            "shards), and infercore does not rescale them lossily"
        )
    return FP8Weight(torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]), ws[0].block_size)


def load_fp8(ckpt, config, q: dict[str, Any], *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model of ``config`` on ``device`` with the FP8 linears of ``ckpt`` (an HF directory
    :class:`~infercore.loading.Checkpoint`) as ``QuantLinear`` s over :class:`FP8Weight`, and load the rest.

    ``q`` is :func:`fp8_config` of the checkpoint. Raises ``ValueError`` naming the tensor or module for a wrong
    dtype or shape, a missing scale, a quantized linear the model lacks or the config excludes, a merged
    projection quantized only in part or whose block scales cannot be merged exactly (module docstring), or a
    tensor missing (by ``load_weights``)."""
    part_leaves = {"weight", *_SCALES, *_DROP, "weight_zero_point"}
    return build_prequantized(
        ckpt,
        config,
        dtype=dtype,
        device=device,
        label="FP8",
        # FP8 codes share the name "weight" with dense weights: float16 / bfloat16 / float32 ones are dense
        is_part=lambda leaf, t: (
            leaf in part_leaves and (leaf != "weight" or t.dtype in _FP8_DTYPES or not t.is_floating_point())
        ),
        select=_fp8_linears,
        weight=lambda base, parts: (_fp8_weight(base, parts, q), None),
        concat=_concat,
        codes="weight",
        none_converted="checkpoint: an FP8 quantization_config is set but no linear has a float8_e4m3fn weight",
        excluded=lambda base: _excluded(base, q),
        drop=_KV_SCALES,
    )
