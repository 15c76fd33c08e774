"""The CPU fast path of ``quant.fp8_wo_matmul`` (``quant/cpu.py`` -> ``ops.moe.cpu_native.linear_fp8``: e4m3 codes
decoded to their exact bf16 in AVX-512 registers, fp32 sums scaled per row or per 128 x 128 block) against torch's
float8_e4m3fn conversion and the reference op, prefill rows through the weight decoded to bf16
(``cpu_native.dequant_fp8_rows``) into the dense GEMM, its limits, and an FP8 model through the Engine."""

import pytest
import torch

from infercore import Engine, SamplingParams
from infercore.devices import resolve
from infercore.ops.moe import cpu_native
from infercore.quant import FP8Weight, QuantLinear, fp8_wo_matmul, naive
from infercore.quant import cpu as QC


def test_the_cpu_implementation_serves_cpu_calls_and_runs_vectorized():
    assert resolve("quant.fp8_wo_matmul", "cpu").name == "cpu"
    assert cpu_native.q4_supported(), cpu_native.status()  # the CI machine has AVX512-BF16


@pytest.mark.parametrize("k, pos", [(64, 35), (40, 35), (64, 3), (1, 0)])
def test_every_e4m3_byte_decodes_as_torch_does(k, pos):
    # row n holds byte n at column pos (zeros elsewhere; a NaN byte elsewhere would make the whole sum NaN):
    # the vector loop (k 64), its masked tail (k 40, pos 35; k 1) and the subnormal / NaN lanes
    codes = torch.zeros(256, k, dtype=torch.uint8)
    codes[:, pos] = torch.arange(256, dtype=torch.uint8)
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    x[0, pos] = 1
    got = cpu_native.linear_fp8(x, codes, torch.ones(256), None)[0].float()
    want = codes[:, pos].view(torch.float8_e4m3fn).float()
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("m", [1, 3, 5, 17])
@pytest.mark.parametrize("n, k", [(300, 200), (256, 576), (64, 32)])
def test_matches_the_reference(block, m, n, k):
    torch.manual_seed(m * 7 + n)
    w = FP8Weight.quantize(torch.randn(n, k) * 0.05, block_size=block)
    x = torch.randn(m, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    for b in (None, bias):
        y = fp8_wo_matmul(x, w, bias=b)
        r = naive.fp8_wo_matmul_ref(x, w, b)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # the same fp32 sums in another order and with the scale applied to the block's sum, rounded to bf16; a bias
        # is added to the bf16 product (as the other CPU fast paths add it): one more rounding, up to half an ulp of
        # the product's magnitude, which the bias may cancel
        mag = r.float().abs().max().item() + (0.0 if b is None else b.float().abs().max().item())
        torch.testing.assert_close(y.float(), r.float(), rtol=2 ** -7, atol=2 ** -8 * mag)


@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("n, k", [(300, 200), (4096 + 40, 576)])
def test_decoded_rows_are_the_weight_rounded_to_bf16(block, n, k):
    # every row (a slice in the middle too) is code * scale rounded to bf16 as torch rounds it: the vector loop, the
    # tail of a 128-block (200), a scale per row or per block
    torch.manual_seed(n + k)
    w = FP8Weight.quantize(torch.randn(n, k) * 0.05, block_size=block)
    want = w.dequantize().to(torch.bfloat16)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    got = cpu_native.dequant_fp8_rows(w.qweight, w.scales.float(), block, 0, n, out)
    assert torch.equal(got, want)
    got = cpu_native.dequant_fp8_rows(w.qweight, w.scales.float(), block, 130, 261, out)
    assert got.shape == (131, k) and torch.equal(got, want[130:261])


@pytest.mark.parametrize("block", [None, 128])
def test_prefill_rows_take_the_decoded_gemm(block, monkeypatch):
    # past FP8_NATIVE_MAX_ROWS the weight is decoded to bf16 slice by slice (several slices: a small slice size)
    # into the dense GEMM: the bf16 GEMM over the weight rounded to bf16, within rounding of the fp32 reference
    monkeypatch.setattr(QC, "DECODE_SLICE_BYTES", 64 * 576 * 2)
    torch.manual_seed(3)
    w = FP8Weight.quantize(torch.randn(300, 576) * 0.05, block_size=block)
    x = torch.randn(QC.FP8_NATIVE_MAX_ROWS + 37, 576).to(torch.bfloat16)
    bias = torch.randn(300).to(torch.bfloat16)
    y = fp8_wo_matmul(x, w, bias=bias)
    exact = (x @ w.dequantize().to(torch.bfloat16).t()).float() + bias.float()
    assert y.dtype == torch.bfloat16 and torch.equal(y, exact.to(torch.bfloat16))
    r = naive.fp8_wo_matmul_ref(x, w, bias).float()
    torch.testing.assert_close(y.float(), r, rtol=2 ** -6, atol=2 ** -7 * r.abs().max().item())


def test_rows_past_the_limit_decode_and_other_dtypes_take_the_reference(monkeypatch):
    calls, decoded = [], []
    real, real_rows = cpu_native.linear_fp8, cpu_native.dequant_fp8_rows
    monkeypatch.setattr(cpu_native, "linear_fp8", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(cpu_native, "dequant_fp8_rows", lambda *a: decoded.append(a[3:5]) or real_rows(*a))
    w = FP8Weight.quantize(torch.randn(64, 128) * 0.05)
    for m in (1, QC.FP8_NATIVE_MAX_ROWS, QC.FP8_NATIVE_MAX_ROWS + 1):
        fp8_wo_matmul(torch.randn(m, 128).to(torch.bfloat16), w)
    x32 = torch.randn(2, 128)
    assert torch.equal(fp8_wo_matmul(x32, w), naive.fp8_wo_matmul_ref(x32, w))
    x16 = torch.randn(QC.FP8_NATIVE_MAX_ROWS + 1, 128).half()
    assert torch.equal(fp8_wo_matmul(x16, w), naive.fp8_wo_matmul_ref(x16, w))
    assert calls == [1, QC.FP8_NATIVE_MAX_ROWS] and decoded == [(0, 64)]


def test_bad_operands():
    codes = torch.zeros(8, 32, dtype=torch.uint8)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="linear_fp8"):
        cpu_native.linear_fp8(x.float(), codes, torch.ones(8), None)
    with pytest.raises(ValueError, match="scales must be"):
        cpu_native.linear_fp8(x, codes, torch.ones(4), None)
    with pytest.raises(ValueError, match="block"):
        cpu_native.linear_fp8(x, codes, torch.ones(1, 1), 64)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        cpu_native.linear_fp8(x[0], codes, torch.ones(8), None)
    with pytest.raises(ValueError, match="host tensors"):
        cpu_native.linear_fp8(x, codes.to("meta"), torch.ones(8), None)
    out = torch.empty(8, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dequant_fp8_rows"):
        cpu_native.dequant_fp8_rows(codes.to(torch.int8), torch.ones(8), None, 0, 8, out)
    with pytest.raises(ValueError, match="scales must be"):
        cpu_native.dequant_fp8_rows(codes, torch.ones(2, 1), 128, 0, 8, out)
    with pytest.raises(ValueError, match="outside"):
        cpu_native.dequant_fp8_rows(codes, torch.ones(8), None, 4, 9, out)
    with pytest.raises(ValueError, match="out must be"):
        cpu_native.dequant_fp8_rows(codes, torch.ones(8), None, 0, 8, out[:4])


def test_fp8_model_through_the_engine(monkeypatch):
    # the real SmolLM2 weights as fp8-wo-block through the Engine in bf16: the decode steps run the fused native
    # decoder layers (cpu_kernels.c over the FP8 codes: no Python-level FP8 call at one row), with the tokens of the
    # op-by-op path, where every FP8 linear call of a decode step takes the native kernel; the model answers
    calls = []
    real = cpu_native.linear_fp8
    monkeypatch.setattr(cpu_native, "linear_fp8", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    eng = Engine.from_pretrained(device="cpu", dtype="bfloat16", quantization="fp8-wo-block", max_num_batched_tokens=64)
    q = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(q) == 30 * 4 and all(m.qweight_format.block_size == 128 for m in q)
    assert all(cpu_native.layer_linear(m, torch.bfloat16) is not None for m in q)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fused = eng.generate(["The capital of France is"], sp)[0]
    assert "Paris" in fused.text and calls.count(1) == 0
    with cpu_native.fused_layers_disabled():
        op_by_op = eng.generate(["The capital of France is"], sp)[0]
    assert op_by_op.token_ids == fused.token_ids
    assert calls.count(1) == 7 * len(q)  # 7 decode steps (the 8th token comes from the prefill), each linear once
