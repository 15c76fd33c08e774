"""Quantization: formats (tensor containers with a reference ``dequantize()``), kernels, and the
model-level ``quantize(model, scheme)``. See docs/quantization.md."""

from .api import (
    SCHEMES,
    CalibrationStats,
    QuantScheme,
    collect_calibration,
    load_quantized,
    outlier_hit_rate,
    quantize,
    quantize_experts_,
    quantize_weight,
    save_quantized,
    scheme_table,
)
from .formats import FP4Weight, FP8Weight, GGUFWeight, Int8Weight, IntWeight, NF4Weight, QuantizedWeight
from .fp8 import fp8_e4m3_decode_emulated, fp8_e4m3_encode
from .gptq import gptq_quantize
from .kv import dequantize_kv, quantize_kv, write_quantized_kv_cache_
from .linear import QuantLinear
from .ops import (
    fp4_matmul,
    fp8_decode,
    fp8_wo_matmul,
    gguf_matmul,
    nf4_matmul,
    per_token_quant,
    w8a8_matmul,
    wq_matmul,
)
from .packing import from_awq, from_gptq, from_gptq_act_order, to_awq, to_gptq

__all__ = [
    "SCHEMES",
    "CalibrationStats",
    "FP4Weight",
    "FP8Weight",
    "GGUFWeight",
    "Int8Weight",
    "IntWeight",
    "NF4Weight",
    "QuantLinear",
    "QuantScheme",
    "QuantizedWeight",
    "collect_calibration",
    "dequantize_kv",
    "fp4_matmul",
    "fp8_decode",
    "fp8_e4m3_decode_emulated",
    "fp8_e4m3_encode",
    "fp8_wo_matmul",
    "from_awq",
    "from_gptq",
    "from_gptq_act_order",
    "gguf_matmul",
    "gptq_quantize",
    "load_quantized",
    "nf4_matmul",
    "outlier_hit_rate",
    "per_token_quant",
    "quantize",
    "quantize_experts_",
    "quantize_kv",
    "quantize_weight",
    "save_quantized",
    "scheme_table",
    "to_awq",
    "to_gptq",
    "write_quantized_kv_cache_",
    "w8a8_matmul",
    "wq_matmul",
]
