"""4-bit codebook weights (``NF4Weight``: bitsandbytes NF4 / FP4, absmax blocks): the format against bitsandbytes' own
quantizer and dequantizer, the CPU path (``cpu_native.dequant_lut4_rows`` + dense GEMM), the Triton kernels under the
interpreter (tiny fp32 / fp16 shapes), the ``w4a16-nf4`` scheme, and bf16 at real shapes on the GPU (``gpu``)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated; tests/conftest.py decides first

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore.devices import resolve  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402
from infercore.quant import NF4Weight, QuantLinear, naive, nf4_matmul, quantize  # noqa: E402
from infercore.quant.formats import NF4_CODEBOOK  # noqa: E402


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item()


def test_codebook_and_quantizer_match_bitsandbytes():
    # bitsandbytes' stored quant_map is our codebook, and its codes for the same weights are ours (the
    # weights drawn away from the midpoints between codebook values, where the two could round apart)
    import bitsandbytes.functional as F  # a dev dependency: its absence fails the test
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(st.code.float(), torch.tensor(NF4_CODEBOOK))
    ours = NF4Weight.quantize(w, blocksize=64)
    b = q.reshape(16, 64)  # bitsandbytes: the first of two codes in the high nibble
    assert torch.equal(ours.qweight, ((b >> 4) | (b << 4)).to(torch.uint8))
    assert torch.equal(ours.absmax, st.absmax.reshape(16, 2))
    assert torch.equal(ours.dequantize(), F.dequantize_4bit(q, st))


def test_format_checks():
    w = NF4Weight.quantize(torch.randn(8, 64))
    assert w.shape == (8, 64) and w.kind == "nf4"
    with pytest.raises(ValueError, match="not a multiple of the blocksize"):
        NF4Weight.quantize(torch.randn(8, 96), blocksize=64)
    with pytest.raises(ValueError, match="blocksize"):
        NF4Weight.quantize(torch.randn(8, 64), blocksize=48)
    with pytest.raises(ValueError, match="absmax: expected shape"):
        NF4Weight(w.qweight, w.absmax[:, :0], w.codebook)
    with pytest.raises(TypeError, match="codebook"):
        NF4Weight(w.qweight, w.absmax, w.codebook[:8])
    with pytest.raises(ValueError, match="quant_type"):
        NF4Weight(w.qweight, w.absmax, w.codebook, 64, "int4")
    with pytest.raises(TypeError, match="non-empty list"):
        NF4Weight.concat([])
    merged = NF4Weight.concat([w, NF4Weight.quantize(torch.randn(4, 64))])
    assert merged.shape == (12, 64) and torch.equal(merged.dequantize()[:8], w.dequantize())


@pytest.mark.parametrize("n, k, bs", [(300, 256, 64), (64, 96, 32), (40, 576, 64), (24, 512, 256)])
def test_cpu_decode_is_the_weight_rounded_to_bf16(n, k, bs):
    torch.manual_seed(n)
    w = NF4Weight.quantize(torch.randn(n, k), blocksize=bs)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    got = cpu_native.dequant_lut4_rows(w.qweight, w.absmax, w.codebook, 0, n, out)
    assert torch.equal(got, w.dequantize().to(torch.bfloat16))
    got = cpu_native.dequant_lut4_rows(w.qweight, w.absmax, w.codebook, 5, 17, out)
    assert torch.equal(got, w.dequantize().to(torch.bfloat16)[5:17])
    with pytest.raises(ValueError, match="outside"):
        cpu_native.dequant_lut4_rows(w.qweight, w.absmax, w.codebook, 0, n + 1, out)
    with pytest.raises(TypeError, match="dequant_lut4_rows"):
        cpu_native.dequant_lut4_rows(w.qweight, w.absmax.double(), w.codebook, 0, n, out)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.linear_lut4(torch.zeros(1, k, dtype=torch.bfloat16), w.qweight, w.absmax[:1], w.codebook)
    with pytest.raises(ValueError, match="x has K"):
        cpu_native.linear_lut4(torch.zeros(1, k + 2, dtype=torch.bfloat16), w.qweight, w.absmax, w.codebook)


@pytest.mark.parametrize("m", [5, 70])
def test_cpu_prefill_rows_are_the_bf16_gemm_over_the_decoded_weight(m):
    from infercore.quant import cpu as QC

    assert resolve("quant.nf4_matmul", "cpu").name == "cpu" and m > QC.NF4_NATIVE_MAX_ROWS
    torch.manual_seed(m)
    w = NF4Weight.quantize(torch.randn(200, 320))
    x = torch.randn(m, 320).to(torch.bfloat16)
    bias = torch.randn(200).to(torch.bfloat16)
    y = nf4_matmul(x, w, bias=bias)
    want = ((x @ w.dequantize().to(torch.bfloat16).t()).float() + bias.float()).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert _rel(y, naive.nf4_matmul_ref(x, w, bias)) < 1e-2
    x32 = x.float()  # other dtypes: the reference
    assert torch.equal(nf4_matmul(x32, w), naive.nf4_matmul_ref(x32, w))


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k, bs", [(200, 320, 64), (37, 512, 256), (64, 96, 32), (20, 64, 16)])
def test_cpu_decode_rows_take_the_native_gemv(m, n, k, bs, monkeypatch):
    # up to NF4_NATIVE_MAX_ROWS rows: cpu_native.linear_lut4 over the codes as stored (the vector loop for blocks of
    # 32 and more, the scalar one for 16), the same fp32 sums as the reference in another order, rounded to bf16
    calls = []
    real = cpu_native.linear_lut4
    monkeypatch.setattr(cpu_native, "linear_lut4", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    torch.manual_seed(m + n)
    w = NF4Weight.quantize(torch.randn(n, k), blocksize=bs)
    x = torch.randn(m, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    y = nf4_matmul(x, w, bias=bias)
    r = naive.nf4_matmul_ref(x, w, bias)
    mag = r.float().abs().max().item()
    torch.testing.assert_close(y.float(), r.float(), rtol=2 ** -7, atol=2 ** -8 * mag)
    assert calls == [m]


@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("bs", [16, 32, 64, 256])
def test_triton_kernels_match_the_reference(m, bs):
    from infercore.quant import triton_nf4

    torch.manual_seed(m + bs)
    w = NF4Weight.quantize(torch.randn(72, 512), blocksize=bs)
    x = torch.randn(m, 512)
    bias = torch.randn(72)
    assert _rel(triton_nf4.nf4_matmul_triton(x, w, bias), naive.nf4_matmul_ref(x, w, bias)) < 1e-5
    xh = x.half()
    assert _rel(triton_nf4.nf4_matmul_triton(xh, w), naive.nf4_matmul_ref(xh, w)) < 2e-3
    assert torch.equal(triton_nf4.dequant_nf4_triton(w, torch.float16), w.dequantize(torch.float16))
    assert torch.equal(triton_nf4.dequant_nf4_triton(w, torch.float32), w.dequantize())


def test_triton_odd_k_takes_the_reference():
    from infercore.quant import triton_nf4

    torch.manual_seed(3)
    w = NF4Weight.quantize(torch.randn(24, 48), blocksize=16)  # K = 48: not whole 32-code words
    x = torch.randn(2, 48)
    assert torch.equal(triton_nf4.nf4_matmul_triton(x, w), naive.nf4_matmul_ref(x, w))
    assert torch.equal(triton_nf4.dequant_nf4_triton(w, torch.float16), w.dequantize(torch.float16))


def test_triton_large_m_decodes_then_multiplies(monkeypatch):
    from infercore.quant import triton_nf4

    monkeypatch.setattr(triton_nf4, "DEQUANT_M_MIN", 4)
    torch.manual_seed(1)
    w = NF4Weight.quantize(torch.randn(40, 128))
    xh = torch.randn(9, 128).half()
    y = triton_nf4.nf4_matmul_triton(xh, w)
    assert torch.equal(y, xh @ w.dequantize(torch.float16).t())


def test_scheme_quantizes_a_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 32), torch.nn.Linear(96, 8))
    dense = [lin.weight.detach().clone() for lin in m]
    quantize(m, "w4a16-nf4")
    assert [type(lin).__name__ for lin in m] == ["QuantLinear", "QuantLinear", "Linear"]  # K = 96: not a 64 multiple
    assert isinstance(m[0], QuantLinear) and m[0].qweight_format.kind == "nf4"
    assert _rel(m[0].qweight_format.dequantize(), dense[0]) < 0.12


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16, 17, 64, 300])
def test_nf4_on_cuda_bf16(m):
    torch.manual_seed(m)
    w = NF4Weight.quantize(torch.randn(4096, 1024, device="cuda") * 0.02)
    x = torch.randn(m, 1024, device="cuda").to(torch.bfloat16)
    bias = torch.randn(4096, device="cuda").to(torch.bfloat16)
    assert resolve("quant.nf4_matmul", x.device).name == "triton"
    y = nf4_matmul(x, w, bias=bias)
    assert y.dtype == torch.bfloat16 and _rel(y, naive.nf4_matmul_ref(x, w, bias)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nf4_mode9(bs, dtype, graph_matches_eager, mode9_calls):
    # 1-16 rows: MODE 9 (cuda_mma, NF4 codes looked up by byte permutes into the MMA's A registers), eager and
    # replayed in a CUDA graph, deterministic; absmax blocks of 32 keep the Triton kernels
    from infercore.quant import triton_nf4

    torch.manual_seed(bs)
    w = NF4Weight.quantize(torch.randn(3000, 2048, device="cuda") * 0.02, blocksize=bs)
    for m in (1, 3, 8, 9, 16):
        x = torch.randn(m, 2048, device="cuda").to(dtype)
        y = triton_nf4.nf4_matmul_triton(x, w)
        assert _rel(y, naive.nf4_matmul_ref(x, w)) < 1e-2
        assert torch.equal(y, triton_nf4.nf4_matmul_triton(x, w))
        graph_matches_eager(lambda x=x: triton_nf4.nf4_matmul_triton(x, w), x, rounds=2)
    assert mode9_calls == [m for m in (1, 3, 8, 9, 16) for _ in range(5)]  # eager twice, the capture, two rounds
    w32 = NF4Weight.quantize(torch.randn(256, 512, device="cuda"), blocksize=32)
    x = torch.randn(8, 512, device="cuda").to(dtype)
    assert _rel(triton_nf4.nf4_matmul_triton(x, w32), naive.nf4_matmul_ref(x, w32)) < 1e-2
    assert len(mode9_calls) == 25


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [32, 64, 256])
def test_nf4_cuda_decode_is_exact(bs):
    # the dequantization kernel looks the fp32 codebook up by byte permutes: the values of w.dequantize(dtype)
    from infercore.quant import triton_nf4

    torch.manual_seed(bs)
    w = NF4Weight.quantize(torch.randn(1000, 1536, device="cuda"), blocksize=bs)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(triton_nf4.dequant_nf4_triton(w, dtype), w.dequantize(dtype))
    fp4 = NF4Weight(w.qweight, w.absmax, torch.linspace(-1, 1, 16, device="cuda") ** 3, bs, "fp4")  # another table
    assert torch.equal(triton_nf4.dequant_nf4_triton(fp4, torch.float32), fp4.dequantize())
