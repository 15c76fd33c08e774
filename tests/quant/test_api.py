"""Model-level API: quantize(), QuantLinear, calibration, checkpoints, KV quantization (CPU)."""

import pytest
import torch
from torch import nn

from infercore.quant import (
    SCHEMES,
    FP8Weight,
    Int8Weight,
    IntWeight,
    QuantLinear,
    collect_calibration,
    dequantize_kv,
    load_quantized,
    outlier_hit_rate,
    quantize,
    quantize_kv,
    save_quantized,
    write_quantized_kv_cache_,
)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64, bias=False)).eval()


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_swaps_and_stays_close(scheme):
    ref = _mlp()
    x = torch.randn(9, 64)
    x[:, 3] *= 20  # an activation outlier channel
    m = _mlp()
    calib = collect_calibration(m, lambda mod: mod(x), hessian=True)  # GPTQ needs Hessians
    quantize(m, scheme, calibration=calib)
    assert isinstance(m[0], QuantLinear) and isinstance(m[2], QuantLinear)
    with torch.no_grad():
        y, r = m(x), ref(x)
    # FP4 (e2m1: a 2-bit significand; MXFP4's power-of-two scales rounded up) errs ~12% a weight, INT4 g128 less
    tol = 0.2 if "fp4" in scheme else 0.15 if ("w4" in scheme or "q4" in scheme) else 0.05
    assert ((y - r).norm() / r.norm()).item() < tol


def test_mixed_beats_plain_w8a8_and_grows_online():
    x = torch.randn(32, 64)
    x[:, [3, 50]] *= 40
    ref = _mlp()(x)
    plain = quantize(_mlp(), "w8a8")
    mixed = quantize(_mlp(), "w8a8-mixed")  # no calibration: the set starts empty
    with torch.no_grad():
        e_plain = (plain(x) - ref).norm()
        e_mixed = (mixed(x) - ref).norm()
    assert e_mixed < 0.5 * e_plain
    first = mixed[0]
    assert set(first.qweight_format.outlier_idx.tolist()) >= {3, 50}
    stats = outlier_hit_rate(mixed)
    assert stats["grown"] >= 1 and stats["hit_rate"] < 1.0
    with torch.no_grad():
        mixed(x)
    assert outlier_hit_rate(mixed)["hit_rate"] > stats["hit_rate"]  # second call fully predicted


def test_smoothquant_needs_calibration():
    with pytest.raises(ValueError, match="calibration"):
        quantize(_mlp(), "w8a8-smooth")
    with pytest.raises(ValueError, match="scheme"):
        quantize(_mlp(), "int3")


@pytest.mark.parametrize("scheme", ["w4a16-g128", "fp8-wo-block", "w8a8-mixed", "gguf-q4_1"])
def test_save_load_roundtrip(tmp_path, scheme):
    x = torch.randn(5, 64)
    x[:, 7] *= 30
    m = quantize(_mlp(), scheme)
    with torch.no_grad():
        y = m(x)  # for mixed this also grows the outlier set, which must be saved
    path = tmp_path / "q.safetensors"
    save_quantized(m, path)
    fresh = load_quantized(_mlp(seed=1), path)
    assert isinstance(fresh[0], QuantLinear)
    with torch.no_grad():
        assert torch.equal(fresh(x), y)


def test_skip_and_gguf_k_multiple():
    m = nn.Sequential(nn.Linear(40, 64), nn.Linear(64, 8))
    quantize(m, "gguf-q8_0")  # K=40 is not a multiple of 32: stays dense
    assert isinstance(m[0], nn.Linear) and isinstance(m[1], QuantLinear)
    m = nn.Sequential(nn.Linear(64, 64))
    quantize(m, "w8a16", skip=("0",))
    assert isinstance(m[0], nn.Linear)


def test_quant_linear_rejects_bad_input():
    lin = QuantLinear(Int8Weight.quantize(torch.randn(8, 16)))
    with pytest.raises(ValueError, match="x must be"):
        lin(torch.randn(3, 15))
    with pytest.raises(ValueError, match="outlier_threshold"):
        QuantLinear(Int8Weight.quantize(torch.randn(8, 16), act="fp8"), outlier_threshold=6.0)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_kv_quantization(kv_dtype):
    torch.manual_seed(0)
    k = torch.randn(7, 2, 16) * torch.tensor([1.0, 50.0])[None, :, None]
    v = torch.randn(7, 2, 16)
    q, s = quantize_kv(k, kv_dtype=kv_dtype)
    assert s.shape == (7, 2)
    err = ((dequantize_kv(q, s, dtype=torch.float32) - k).abs() / k.abs().amax(-1, keepdim=True)).max()
    assert err < (0.005 if kv_dtype == "int8" else 0.07)  # per-(token, head) scales: heads independent
    dt = torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn
    kc = torch.zeros(4, 4, 2, 16, dtype=dt)
    vc = torch.zeros(4, 4, 2, 16, dtype=dt)
    ks = torch.zeros(4, 4, 2)
    vs = torch.zeros(4, 4, 2)
    slots = torch.tensor([5, 6, -1, 0, 15, 9, 10], dtype=torch.int32)
    write_quantized_kv_cache_(k, v, kc, vc, ks, vs, slots)
    back = dequantize_kv(kc.view(16, 2, 16), ks.view(16, 2), dtype=torch.float32)
    keep = slots >= 0
    assert torch.equal(back[slots[keep].long()], dequantize_kv(q[keep], s[keep], dtype=torch.float32))
    assert torch.all(ks.view(16, 2)[[1, 2, 3]] == 0)  # untouched slots


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
def test_quant_linear_forward_act_matches_unfused(act):
    """forward_act = the *_and_mul op on forward's output (the CPU path; on CUDA at <= 4 rows it is
    one kernel, checked in tests/quant/test_gpu.py); a bad act is refused."""
    from infercore.ops import gelu_and_mul, silu_and_mul

    torch.manual_seed(0)
    for w in (IntWeight.quantize(torch.randn(32, 64), bits=4, group_size=32), FP8Weight.quantize(torch.randn(32, 64))):
        lin = QuantLinear(w)
        x = torch.randn(3, 64)
        y = lin(x)
        approx = "tanh" if act == "gelu_tanh" else "none"
        want = silu_and_mul(y) if act == "silu" else gelu_and_mul(y, approximate=approx)
        assert torch.allclose(lin.forward_act(x, act), want)
    with pytest.raises(ValueError, match="act"):
        lin.forward_act(x, "relu")
