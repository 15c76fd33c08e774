"""GPTQ (CPU): error feedback beats round-to-nearest, codes are on the format's grid, packing."""

import pytest
import torch
from torch import nn

from infercore.quant import (
    IntWeight,
    QuantLinear,
    collect_calibration,
    from_gptq,
    gptq_quantize,
    load_quantized,
    quantize,
    save_quantized,
    to_gptq,
)


def _correlated_inputs(t: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with strongly correlated channels of unequal scale (what makes GPTQ pay off)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, k // 4, generator=g)
    mix = torch.randn(k // 4, k, generator=g)
    x = z @ mix + 0.1 * torch.randn(t, k, generator=g)
    return x * (torch.rand(k, generator=g) * 3 + 0.2)


def _out_err(x: torch.Tensor, w: torch.Tensor, q: IntWeight) -> float:
    return ((x @ (q.dequantize() - w).T).norm() / (x @ w.T).norm()).item()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_gptq_output_error_below_rtn(act_order, symmetric):
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    x = _correlated_inputs(512, 256)
    rtn = IntWeight.quantize(w, bits=4, group_size=64, symmetric=symmetric)
    gq = gptq_quantize(w, x.T @ x, bits=4, group_size=64, symmetric=symmetric, act_order=act_order,
                       block_size=32)
    e_rtn, e_gptq = _out_err(x, w, rtn), _out_err(x, w, gq)
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)


def test_gptq_with_identity_hessian_is_rtn():
    # A diagonal Hessian has no cross terms: no error is fed forward, so GPTQ must choose the
    # round-to-nearest codes and the same clipped group ranges as IntWeight.quantize.
    torch.manual_seed(1)
    w = torch.randn(24, 200)
    rtn = IntWeight.quantize(w, bits=4, group_size=64)
    gq = gptq_quantize(w, torch.eye(200), bits=4, group_size=64, block_size=48)
    assert torch.equal(gq.codes(), rtn.codes())
    assert torch.equal(gq.scales, rtn.scales) and torch.equal(gq.zeros, rtn.zeros)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True)])
def test_gptq_weights_on_the_grid_and_padding(bits, symmetric):
    torch.manual_seed(2)
    w = torch.randn(16, 96)  # K = 96 is padded to 128 at g64
    x = _correlated_inputs(256, 96)
    q = gptq_quantize(w, x.T @ x, bits=bits, group_size=64, symmetric=symmetric, act_order=True)
    assert q.qweight.shape == (16, 128 * bits // 8) and q.scales.shape == (16, 2)
    codes = q.codes()
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    # Padding codes equal the zero point, so the padded columns dequantize to exactly 0.
    z = q.zero_points()
    assert torch.equal(codes[:, 96:].float(), z[:, 1:2].expand(-1, 32))
    deq = q.dequantize()
    assert deq.shape == (16, 96)
    # Every dequantized value is (integer code - zero) * group scale.
    s = q.scales.repeat_interleave(64, 1)[:, :96]
    grid = deq / s + z.repeat_interleave(64, 1)[:, :96]
    assert torch.allclose(grid, grid.round(), atol=1e-3)
    assert grid.round().min() >= 0 and grid.round().max() <= 2**bits - 1


def test_gptq_packing_roundtrip():
    torch.manual_seed(3)
    w = torch.randn(64, 256)
    x = _correlated_inputs(256, 256)
    q = gptq_quantize(w, x.T @ x, bits=4, group_size=128, act_order=True)
    back = from_gptq(**to_gptq(q), bits=4, group_size=128)
    assert torch.equal(back.codes(), q.codes()) and torch.equal(back.zeros, q.zeros)
    assert torch.allclose(back.scales, q.scales, rtol=1e-3)  # checkpoint scales are fp16


def test_gptq_bad_arguments():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, torch.eye(32))
    with pytest.raises(ValueError, match="bits"):
        gptq_quantize(w, torch.eye(64), bits=3)
    with pytest.raises(ValueError, match="damp"):
        gptq_quantize(w, torch.eye(64), damp=-1.0)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 128, bias=False)).eval()


def test_quantize_model_with_gptq(tmp_path):
    x = _correlated_inputs(256, 128, seed=4)
    ref = _mlp()
    with torch.no_grad():
        y_ref = ref(x)
        y_rtn = quantize(_mlp(), "w4a16-g128")(x)
        gm = quantize(_mlp(), "w4a16-g128-gptq", calibration=lambda m: m(x))
        y_gptq = gm(x)
        # The same through method= on the RTN scheme name, from precollected statistics.
        stats = collect_calibration(_mlp(), lambda m: m(x), hessian=True)
        y_meth = quantize(_mlp(), "w4a16-g128", calibration=stats, method="gptq")(x)
    assert isinstance(gm[0], QuantLinear) and isinstance(gm[2], QuantLinear)
    e_rtn = (y_rtn - y_ref).norm() / y_ref.norm()
    e_gptq = (y_gptq - y_ref).norm() / y_ref.norm()
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)
    assert ((y_meth - y_ref).norm() / y_ref.norm()) < 0.8 * e_rtn
    path = tmp_path / "gptq.safetensors"
    save_quantized(gm, path)
    with torch.no_grad():
        assert torch.equal(load_quantized(_mlp(seed=1), path)(x), y_gptq)


def test_gptq_needs_hessians():
    x = torch.randn(16, 128)
    stats = collect_calibration(_mlp(), lambda m: m(x))  # no hessian=True
    with pytest.raises(ValueError, match="calibration"):
        quantize(_mlp(), "w4a16-g128-gptq", calibration=stats)
    with pytest.raises(ValueError, match="calibration"):
        quantize(_mlp(), "w4a16-g128-gptq")
    with pytest.raises(ValueError, match="method"):
        quantize(_mlp(), "fp8-wo", calibration=lambda m: m(x), method="gptq")


def test_calibration_hessian_is_the_running_mean_of_xtx():
    lin = nn.Linear(32, 8).eval()
    xs = [torch.randn(5, 32), torch.randn(3, 2, 32)]  # two calls, one with a batch dimension
    stats = collect_calibration(lin, lambda m: [m(x) for x in xs], hessian=True)
    flat = torch.cat([x.reshape(-1, 32) for x in xs])
    assert stats.tokens[""] == 11
    assert torch.allclose(stats.hessians[""], flat.T @ flat / 11, atol=1e-5)
    assert torch.allclose(stats.mean_sq[""], (flat**2).mean(0), atol=1e-5)
    assert torch.equal(stats[""], flat.abs().amax(0))


def test_gptq_lazy_block_updates_match_unblocked():
    # Blocking only defers the trailing update; the chosen codes must not depend on it.
    torch.manual_seed(5)
    w = torch.randn(32, 192)
    x = _correlated_inputs(384, 192, seed=5)
    a = gptq_quantize(w, x.T @ x, group_size=64, block_size=192)
    b = gptq_quantize(w, x.T @ x, group_size=64, block_size=16)
    assert (a.codes() == b.codes()).float().mean() > 0.99
    assert abs(_out_err(x, w, a) - _out_err(x, w, b)) < 1e-3
