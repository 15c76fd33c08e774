"""Bad shapes, dtypes and configs are refused up front, with an error naming the argument."""

import pytest
import torch
from torch import nn

from infercore.quant.api import CalibrationStats, QuantScheme, quantize, quantize_weight
from infercore.quant.formats import FP8Weight, Int8Weight, IntWeight
from infercore.quant.gptq import gptq_quantize
from infercore.quant.linear import QuantLinear

W = torch.randn(8, 64)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 8))


@pytest.mark.parametrize(
    ("fields", "exc", "match"),
    [
        ({"weight": "int3"}, ValueError, "weight"),
        ({"weight": "int4", "group_size": 2.5}, TypeError, "group_size"),
        ({"weight": "int4", "group_size": 31}, ValueError, "group_size"),
        ({"weight": "fp8", "group_size": 128}, ValueError, "group_size"),
        ({"weight": "fp8", "fp8_block": 0}, ValueError, "fp8_block"),
        ({"weight": "int8", "fp8_block": 128}, ValueError, "fp8_block"),
        ({"weight": "fp8", "fp8_block": 128, "scale_search": True}, ValueError, "scale_search"),
        ({"weight": "w8a8"}, ValueError, "act"),
        ({"weight": "w8a8", "act": "int4"}, ValueError, "act"),
        ({"weight": "int4", "act": "int8"}, ValueError, "act"),
        ({"weight": "w8a8", "act": "int8", "smooth_alpha": 1.5}, ValueError, "smooth_alpha"),
        ({"weight": "fp8", "smooth_alpha": 0.5}, ValueError, "smooth_alpha"),
        ({"weight": "w8a8", "act": "int8", "outlier_threshold": -1.0}, ValueError, "outlier_threshold"),
        ({"weight": "w8a8", "act": "fp8", "outlier_threshold": 6.0}, ValueError, "outlier_threshold"),
        ({"weight": "w8a8", "act": "int8", "max_outliers": -1}, ValueError, "max_outliers"),
        ({"weight": "int4", "method": "awq"}, ValueError, "method"),
        ({"weight": "fp8", "method": "gptq"}, ValueError, "method"),
        ({"weight": "int4", "damp": 1.0}, ValueError, "damp"),
        ({"weight": "int4", "symmetric": "yes"}, TypeError, "symmetric"),
        ({"weight": "int4", "name": 3}, TypeError, "name"),
    ],
)
def test_scheme_fields_validated_at_construction(fields, exc, match):
    kw = {"name": "x", "weight": "int4", "description": "d", **fields}
    with pytest.raises(exc, match=match):
        QuantScheme(**kw)


def test_bad_scheme_never_reaches_quantize():
    with pytest.raises(ValueError, match="weight"):
        quantize(_model(), QuantScheme("x", "int3", "d"))
    with pytest.raises(TypeError, match="scheme"):
        quantize(_model(), ["w8a16"])


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": -4}, ValueError, "block_size"),
        ({"block_size": 2.7}, TypeError, "block_size"),
        ({"block_size": 32, "scale_search": True}, ValueError, "scale_search"),
        ({"scale_search": True, "importance": [1.0] * 64}, TypeError, "importance"),
        ({"scale_search": True, "importance": -torch.ones(64)}, ValueError, "importance"),
    ],
)
def test_fp8_weight_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        FP8Weight.quantize(W, **kw)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"smooth": [1.0] * 64}, TypeError, "smooth"),
        ({"smooth": torch.zeros(64)}, ValueError, "smooth"),
        ({"outlier_idx": [1, 2]}, TypeError, "outlier_idx"),
        ({"outlier_idx": torch.tensor([1.0])}, TypeError, "outlier_idx"),
        ({"outlier_idx": torch.tensor([[1]])}, ValueError, "outlier_idx"),
        ({"outlier_idx": torch.tensor([99])}, ValueError, "outlier_idx"),
        ({"outlier_idx": torch.tensor([-1])}, ValueError, "outlier_idx"),
        ({"outlier_idx": torch.tensor([3, 3])}, ValueError, "outlier_idx"),
        ({"outlier_idx": torch.tensor([3]), "outlier_dtype": "bf16"}, TypeError, "outlier_dtype"),
    ],
)
def test_int8_weight_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        Int8Weight.quantize(W, **kw)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"group_size": 2.5}, TypeError, "group_size"),
        ({"group_size": "32"}, TypeError, "group_size"),
        ({"bits": 4.0}, TypeError, "bits"),
        ({"bits": True}, TypeError, "bits"),
    ],
)
def test_int_weight_refuses_instead_of_coercing(kw, exc, match):
    with pytest.raises(exc, match=match):
        IntWeight.quantize(W, **kw)


@pytest.mark.parametrize(
    ("calibration", "exc", "match"),
    [
        ({"0": torch.ones(64)}, TypeError, "calibration"),  # a plain dict has no mean_sq / hessians
        (42, TypeError, "calibration"),
        (CalibrationStats({"0": torch.ones(3)}), ValueError, r"calibration\['0'\]"),
        (CalibrationStats({"0": [1.0] * 64}), TypeError, r"calibration\['0'\]"),
        (CalibrationStats({"0": torch.full((64,), float("nan"))}), ValueError, r"calibration\['0'\]"),
    ],
)
def test_quantize_bad_calibration_leaves_model_intact(calibration, exc, match):
    m = _model()
    with pytest.raises(exc, match=match):
        quantize(m, "w8a8-smooth", calibration=calibration)
    assert isinstance(m[0], nn.Linear)


def test_quantize_bad_model_and_skip():
    with pytest.raises(TypeError, match="model"):
        quantize("notamodel", "w8a16")
    with pytest.raises(TypeError, match="skip"):
        quantize(_model(), "w8a16", skip="lm_head")  # would skip modules named 'l', 'm', ...
    with pytest.raises(TypeError, match="skip"):
        quantize(_model(), "w8a16", skip=[0])
    with pytest.raises(ValueError, match="method"):
        quantize(_model(), "w8a16", method="awq")


def test_quantize_weight_bad_statistics():
    with pytest.raises(ValueError, match="act_absmax"):
        quantize_weight(W, "w8a8-mixed", act_absmax=torch.ones(3) * 10)
    with pytest.raises(ValueError, match="act_absmax"):
        quantize_weight(W, "w8a8-mixed", act_absmax=-torch.ones(64))
    with pytest.raises(ValueError, match="act_mean_sq"):
        quantize_weight(W, "fp8-wo-search", act_mean_sq=torch.ones(3))
    with pytest.raises(TypeError, match="w"):
        quantize_weight("w", "w8a16")


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"bias": "b"}, TypeError, "bias"),
        ({"bias": torch.ones(8, dtype=torch.int64)}, TypeError, "bias"),
        ({"bias": torch.ones(3)}, ValueError, "bias"),
        ({"outlier_threshold": -1.0}, ValueError, "outlier_threshold"),
        ({"outlier_threshold": "6"}, TypeError, "outlier_threshold"),
        ({"max_outliers": -1}, ValueError, "max_outliers"),
        ({"max_outliers": 2.5}, TypeError, "max_outliers"),
    ],
)
def test_quant_linear_bad_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        QuantLinear(Int8Weight.quantize(W), **kw)


@pytest.mark.parametrize("weight", [Int8Weight.quantize(W), IntWeight.quantize(W, group_size=32)])
def test_quant_linear_bad_input(weight):
    lin = QuantLinear(weight)
    with pytest.raises(TypeError, match="x must be"):
        lin("x")
    with pytest.raises(TypeError, match="x must be"):
        lin(torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be"):
        lin.forward_act("x", "silu")


@pytest.mark.parametrize(("kw", "exc"), [({"group_size": 2.5}, TypeError), ({"group_size": 31}, ValueError),
                                         ({"bits": 4.0}, TypeError)])
def test_gptq_refuses_instead_of_coercing(kw, exc):
    with pytest.raises(exc, match=next(iter(kw))):
        gptq_quantize(W, torch.eye(64), **kw)
