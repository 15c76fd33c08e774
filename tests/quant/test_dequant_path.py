"""The large-M weight-only path (``quant.triton_dequant``): one-pass decode equals ``dequantize()`` bit for
bit, and the matmuls take it from ``DEQUANT_M_MIN`` rows (CPU, Triton interpreter; bf16 output on the GPU in
test_gpu.py)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore.quant import FP8Weight, IntWeight, triton_dequant, triton_wo  # noqa: E402
from infercore.quant import naive as R  # noqa: E402


@pytest.mark.parametrize("bits,sym,group", [(4, False, 32), (4, True, 64), (4, False, None), (4, False, 48),
                                            (8, True, 32), (8, False, None)])
@pytest.mark.parametrize("k", [96, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (the interpreter's bf16 cast truncates)
def test_int_decode_equals_dequantize(bits, sym, group, k, dtype):
    torch.manual_seed(k + bits)
    w = IntWeight.quantize(torch.randn(40, k), bits=bits, group_size=group, symmetric=sym)
    got = triton_dequant.dequant_int_triton(w, dtype)
    assert got.dtype == dtype and got.shape == (40, k)
    assert torch.equal(got, w.dequantize(dtype))


@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_decode_equals_dequantize(block, dtype):
    torch.manual_seed(1)
    w = FP8Weight.quantize(torch.randn(200, 300) * torch.logspace(-3, 1, 300), block_size=block)
    got = triton_dequant.dequant_fp8_triton(w, dtype)
    assert torch.equal(got, w.dequantize(dtype))


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


def test_matmuls_take_the_decode_path_from_the_threshold(monkeypatch):
    torch.manual_seed(2)
    w4 = IntWeight.quantize(torch.randn(64, 96), bits=4, group_size=32)
    f8 = FP8Weight.quantize(torch.randn(64, 96))
    bias = torch.randn(64)
    calls = []
    for name in ("dequant_int_triton", "dequant_fp8_triton"):
        real = getattr(triton_wo, name)
        monkeypatch.setattr(triton_wo, name, lambda w, dt, real=real, name=name: calls.append(name) or real(w, dt))
    rows = triton_wo.WORDS_M_MAX + 8  # past the small-M kernels
    monkeypatch.setattr(triton_dequant, "DEQUANT_M_MIN", {"int4": rows, "fp8": rows})
    x = torch.randn(rows, 96, dtype=torch.float16)
    assert triton_dequant.use_dequant(x, "int4") and not triton_dequant.use_dequant(x[:-1], "fp8")
    assert not triton_dequant.use_dequant(x.float(), "int4")  # fp32 activations keep the fused kernels
    assert not triton_dequant.use_dequant(x, "int8")  # INT8 weights keep the tiled GEMM
    y = triton_wo.wq_matmul_triton(x, w4, bias)
    assert _rel(y, R.wq_matmul_ref(x.float(), w4) + bias) < 2e-3
    y = triton_wo.fp8_wo_matmul_triton(x, f8, act="silu")
    h = x.float() @ f8.dequantize().T
    assert y.shape == (rows, 32) and _rel(y, torch.nn.functional.silu(h[:, :32]) * h[:, 32:]) < 5e-3
    assert calls == ["dequant_int_triton", "dequant_fp8_triton"]
    monkeypatch.setattr(triton_dequant, "DEQUANT_M_MIN", {"int4": 0, "fp8": 0})  # 0: off
    assert not triton_dequant.use_dequant(x, "int4")
    triton_wo.wq_matmul_triton(x, w4)
    assert calls == ["dequant_int_triton", "dequant_fp8_triton"]


def test_decode_rejects_a_non_float_dtype():
    w = IntWeight.quantize(torch.randn(32, 128), bits=4, group_size=128)
    with pytest.raises(TypeError, match="dequant_int_triton: dtype"):
        triton_dequant.dequant_int_triton(w, torch.int8)
    with pytest.raises(TypeError, match="dequant_fp8_triton: dtype"):
        triton_dequant.dequant_fp8_triton(FP8Weight.quantize(torch.randn(32, 128)), torch.float64)
