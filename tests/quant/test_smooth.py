"""SmoothQuant (alone and under MixQ outliers) on CPU: exact fold, accuracy, outlier seeding."""

import pytest
import torch
from torch import nn

from infercore.quant import (
    FP8Weight,
    Int8Weight,
    QuantLinear,
    collect_calibration,
    quantize,
    quantize_weight,
)


def _exact_case(seed: int = 0):
    """A layer and inputs on which smoothing + INT8 W8A8 introduce no rounding at all.

    ``smooth`` is a power of two per channel, ``W * smooth`` is ``W_int * 2^-7`` (row max 127), and
    ``x / smooth`` is ``X_int * 2^-3`` (row max 127): every scale is a power of two, every code is
    an integer, so the quantized product must equal fp32 ``x @ W^T`` bit for bit -- provided the
    smoothing is applied to activations and weights in opposite directions, as it must be.
    """
    g = torch.Generator().manual_seed(seed)
    n, k, m = 24, 64, 7
    smooth = 2.0 ** torch.randint(-3, 4, (k,), generator=g).float()
    w_int = torch.randint(-100, 101, (n, k), generator=g).float()
    w_int[:, 0] = 127.0  # row absmax 127 -> weight scale exactly 2^-7
    x_int = torch.randint(-100, 101, (m, k), generator=g).float()
    x_int[:, 1] = 127.0  # token absmax 127 -> activation scale exactly 2^-3
    w = w_int * 2.0**-7 / smooth
    x = x_int * 2.0**-3 * smooth
    return w, x, smooth


def test_smooth_fold_is_exact_without_quantization_error():
    w, x, smooth = _exact_case()
    q = Int8Weight.quantize(w, smooth=smooth)
    layer = QuantLinear(q)
    with torch.no_grad():
        assert torch.equal(layer(x), x @ w.T)
    # The effective weight (stored W * smooth, read back / smooth) is exactly W.
    assert torch.equal(q.dequantize(), w)


def test_smooth_fold_is_exact_with_outlier_channels():
    w, x, smooth = _exact_case(seed=1)
    idx = torch.tensor([5, 40], dtype=torch.int32)  # raw columns in fp32, raw activations
    q = Int8Weight.quantize(w, smooth=smooth, outlier_idx=idx, outlier_dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(QuantLinear(q)(x), x @ w.T)


def _outlier_inputs(t: int = 64, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, [3, 17, 90]] *= 25.0  # persistent outlier channels, as in LLM activations
    x[:, 40] *= 5.0  # a moderately large one, under the MixQ threshold after smoothing
    return x


def _layer(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 96)).eval()


@pytest.mark.parametrize("scheme", ["w8a8-smooth", "w8a8-mixed-smooth"])
def test_smoothed_quantized_layer_matches_unquantized(scheme):
    x = _outlier_inputs()
    ref = _layer()
    with torch.no_grad():
        y_ref = ref(x)
        plain = quantize(_layer(), "w8a8")(x)
        smoothed = quantize(_layer(), scheme, calibration=lambda m: m(x))(x)
    e_plain = ((plain - y_ref).norm() / y_ref.norm()).item()
    e_smooth = ((smoothed - y_ref).norm() / y_ref.norm()).item()
    assert e_smooth < 0.01, e_smooth
    assert e_smooth < 0.5 * e_plain, (e_smooth, e_plain)


def test_mixed_smooth_seeds_outliers_on_smoothed_activations():
    x = _outlier_inputs()
    stats = collect_calibration(_layer(), lambda m: m(x))
    w = _layer()[0].weight.detach()
    q = quantize_weight(w, "w8a8-mixed-smooth", act_absmax=stats["0"])
    assert q.smooth is not None
    seen = stats["0"] / q.smooth
    expect = (seen > 6.0).nonzero().flatten().tolist()
    assert sorted(q.outlier_idx.tolist()) == expect
    # Smoothing shrinks the outlier set: raw |x| > 6 would flag more channels.
    assert len(expect) < int((stats["0"] > 6.0).sum())
    with pytest.raises(ValueError, match="calibration"):
        quantize(_layer(), "w8a8-mixed-smooth")


def test_fp8_scale_search_never_worse_than_absmax():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * torch.rand(32, 1)
    w[:, 0] *= 6.0  # a large column sets absmax
    imp = torch.rand(64) + 0.1
    plain = FP8Weight.quantize(w)
    searched = FP8Weight.quantize(w, scale_search=True, importance=imp)
    e_plain = (((plain.dequantize() - w) ** 2) * imp).sum(1)
    e_search = (((searched.dequantize() - w) ** 2) * imp).sum(1)
    assert bool((e_search <= e_plain).all()) and e_search.sum() < 0.97 * e_plain.sum()
    with pytest.raises(ValueError, match="importance"):
        FP8Weight.quantize(w, scale_search=True, importance=torch.ones(3))


def test_schemes_that_need_calibration_refuse_to_run_without_it():
    from infercore.quant import SCHEMES

    need = {n for n, s in SCHEMES.items() if s.needs_calibration}
    assert need == {"w4a16-g128-gptq", "w8a8-smooth", "w8a8-mixed-smooth"}
    for name in need:
        layer = _layer()
        with pytest.raises(ValueError, match=f"calibration: scheme '{name}' needs calibration"):
            quantize(layer, name)
        assert type(layer[0]) is torch.nn.Linear  # refused before any layer was replaced
