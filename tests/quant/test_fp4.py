"""FP4 e2m1 weights with MXFP4 / NVFP4 block scales: the format against references no one here wrote (torchao's
MX / NVFP4 quantizers and e2m1 conversions, transformers' gpt-oss MXFP4 decode), the Triton kernels against the
reference under the CPU interpreter, and the model-level API."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from infercore.quant import (  # noqa: E402
    FP4Weight,
    QuantLinear,
    fp4_matmul,
    load_quantized,
    quantize,
    save_quantized,
    triton_fp4,  # noqa: E402
)
from infercore.quant import fp4 as F4  # noqa: E402
from infercore.quant import naive as R  # noqa: E402


def _weights(n=48, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2
    w[1, :32] = 0  # an all-zero block
    w[2, 40] = 3.0  # a block with an outlier
    return w


def _torchao():
    # a test dependency (pyproject's dev extras): its absence fails here rather than skipping the comparisons
    import torchao.prototype.mx_formats.mx_tensor as mx

    return mx


def test_e2m1_encode_decode_match_torchao():
    _torchao()
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    g = torch.Generator().manual_seed(0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.randn(20000, generator=g) * 3, ties, -ties, torch.tensor([0.0, -0.0, 6.5, -7.0, 1e-9, 1e3])])
    assert torch.equal(F4.e2m1_encode(x), f32_to_f4_unpacked(x))
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(F4.e2m1_decode(codes), f4_unpacked_to_f32(codes))
    assert torch.equal(F4.e2m1_decode_emulated(codes), F4.e2m1_decode(codes))


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mxfp4_quantize_matches_torchao(mode):
    mx = _torchao()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    w = _weights()
    q = FP4Weight.quantize(w, fmt="mxfp4", scale_mode=mode)
    scale, data = mx.to_mx(w.contiguous(), torch.float4_e2m1fn_x2, 32,
                           scaling_mode=getattr(ScaleCalculationMode, mode.upper()))  # fmt: skip
    assert torch.equal(q.qweight, data.view(torch.uint8).reshape(q.qweight.shape))
    assert torch.equal(q.scales, scale.view(torch.uint8).reshape(q.scales.shape))


def test_nvfp4_quantize_matches_torchao():
    _torchao()
    from torchao.prototype.mx_formats import nvfp4_tensor as nv

    for sc in (1e-3, 1.0, 30.0):
        w = _weights(seed=3) * sc
        q = FP4Weight.quantize(w, fmt="nvfp4")
        per_tensor = nv.per_tensor_amax_to_scale(w.abs().max())
        scale, data = nv.nvfp4_quantize(w.contiguous(), 16, per_tensor_scale=per_tensor)
        assert torch.equal(q.qweight, data.view(torch.uint8))
        assert torch.equal(q.scales, scale.view(torch.uint8))
        assert q.global_scale == float(per_tensor)


def test_mxfp4_dequantize_matches_transformers_gpt_oss_decode():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = _weights(n=32, k=128)
    q = FP4Weight.quantize(w, fmt="mxfp4")
    blocks = q.qweight.view(32, 4, 16)
    # gpt-oss stores experts [E, N, K / 32, 16] and its decode returns each expert's [K, N]
    theirs = convert_moe_packed_tensors(blocks[None], q.scales[None], dtype=torch.float32)[0].T
    assert torch.equal(q.dequantize(), theirs)
    assert torch.equal(FP4Weight.from_mxfp4_blocks(blocks, q.scales).dequantize(), theirs)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantization_error_is_small(fmt):
    w = _weights()
    q = FP4Weight.quantize(w, fmt=fmt)
    err = (q.dequantize() - w).norm() / w.norm()
    assert err < 0.12, err  # e2m1 has a 2-bit significand: ~8-10% relative error on Gaussian weights
    assert not q.dequantize()[1, :32].any()


@pytest.mark.parametrize("fmt, k", [("mxfp4", 160), ("nvfp4", 160), ("nvfp4", 176)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_the_reference(fmt, k, m, dtype):
    # m <= 4: the GEMV (K = 160: 20 words a row, a partial tile of the interpreter's 8); more, or NVFP4 with K not
    # a multiple of 32 (176): the tiled tl.dot kernel (the interpreter never takes the cuBLAS path, which needs
    # 96 rows and 16-bit activations; test_dequantize_kernel covers its decode).
    torch.manual_seed(m)
    q = FP4Weight.quantize(_weights(n=40, k=k), fmt=fmt)
    x = torch.randn(m, q.shape[1]).to(dtype)
    bias = torch.randn(40)
    y = triton_fp4.fp4_matmul_triton(x, q, bias)
    r = R.fp4_matmul_ref(x, q, bias)
    assert y.dtype == dtype and y.shape == (m, 40)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((y.float() - r.float()).norm() / r.float().norm()).item() < tol


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gemv_words_layout(fmt):
    # word i of each group of 32 codes holds codes i + 4 j at bits 4 j (one MXFP4 block, two NVFP4 blocks)
    q = FP4Weight.quantize(_weights(n=3, k=64), fmt=fmt)
    words = triton_fp4.fp4_words(q)
    codes = F4.unpack_nibbles(q.qweight).long()
    assert words.shape == (3, 8) and words.dtype == torch.int32
    for g in range(2):
        for i in range(4):
            w = words[:, 4 * g + i].long() & 0xFFFFFFFF
            for j in range(8):
                assert torch.equal((w >> (4 * j)) & 15, codes[:, 32 * g + i + 4 * j])
    with pytest.raises(ValueError, match="multiple of 32"):
        triton_fp4.fp4_words(FP4Weight.quantize(_weights(n=3, k=48), fmt="nvfp4"))


def test_nvfp4_gemv_with_unaligned_scales():
    # scales at an odd byte offset cannot be read two bytes at a time: the tiled kernel takes the rows instead
    q = FP4Weight.quantize(_weights(n=8, k=64), fmt="nvfp4")
    store = torch.zeros(8 * 4 + 1, dtype=torch.uint8)
    store[1:] = q.scales.flatten()
    odd = FP4Weight(q.qweight, store[1:].view(8, 4), "nvfp4", q.global_scale)
    assert odd.scales.data_ptr() % 2 == 1 and not triton_fp4._gemv_ok(odd) and triton_fp4._gemv_ok(q)
    x = torch.randn(2, 64)
    r = R.fp4_matmul_ref(x, q)
    for w in (q, odd):
        y = triton_fp4.fp4_matmul_triton(x, w)
        assert ((y - r).norm() / r.norm()).item() < 1e-5


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_dequantize_kernel(fmt):
    q = FP4Weight.quantize(_weights(n=40, k=192), fmt=fmt)
    got = triton_fp4.fp4_dequantize_triton(q, torch.float32)
    assert torch.equal(got, q.dequantize())


def test_extreme_scales_decode_exactly():
    # e8m0 bytes 0 (2**-127) and 140 (2**13) and an nvfp4 global scale far from 1: the kernels fold the decode's
    # 2**14 into the scale without overflow or flush.
    codes = torch.randint(0, 256, (8, 32), dtype=torch.uint8)
    scales = torch.tensor([[0, 140]] * 8, dtype=torch.uint8)
    q = FP4Weight(codes, scales, "mxfp4")
    assert torch.equal(triton_fp4.fp4_dequantize_triton(q, torch.float32), q.dequantize())
    s8 = torch.full((8, 4), 0x7E, dtype=torch.uint8)  # e4m3 448
    q = FP4Weight(codes, s8, "nvfp4", 3e-5)
    assert torch.equal(triton_fp4.fp4_dequantize_triton(q, torch.float32), q.dequantize())


def test_helper_checks():
    with pytest.raises(TypeError, match="codes"):
        F4.e2m1_decode(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="codes"):
        F4.unpack_nibbles(torch.zeros(4))
    with pytest.raises(ValueError, match="even"):
        F4.pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="x"):
        F4.e2m1_encode(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple"):
        F4.mxfp4_quantize(torch.randn(4, 48))
    with pytest.raises(TypeError, match="w"):
        F4.nvfp4_quantize(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="global_scale"):
        F4.nvfp4_quantize(torch.randn(4, 32), global_scale=-1.0)
    codes = torch.randint(0, 16, (3, 10), dtype=torch.uint8)
    assert torch.equal(F4.unpack_nibbles(F4.pack_nibbles(codes)), codes)


def test_format_checks():
    codes = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fmt"):
        FP4Weight(codes, torch.zeros(4, 1, dtype=torch.uint8), "fp4")
    with pytest.raises(ValueError, match="scales"):
        FP4Weight(codes, torch.zeros(4, 2, dtype=torch.uint8), "mxfp4")
    with pytest.raises(TypeError, match="qweight"):
        FP4Weight(codes.float(), torch.zeros(4, 1, dtype=torch.uint8), "mxfp4")
    with pytest.raises(ValueError, match="global_scale"):
        FP4Weight(codes, torch.zeros(4, 2, dtype=torch.uint8), "nvfp4", 0.0)
    with pytest.raises(ValueError, match="multiple"):
        FP4Weight.quantize(torch.randn(4, 48), fmt="mxfp4")
    with pytest.raises(ValueError, match="scale_mode"):
        FP4Weight.quantize(torch.randn(4, 32), fmt="nvfp4", scale_mode="floor")
    with pytest.raises(ValueError, match="blocks"):
        FP4Weight.from_mxfp4_blocks(torch.zeros(4, 2, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    q = FP4Weight.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="x must be"):
        fp4_matmul(torch.randn(2, 63), q)
    with pytest.raises(TypeError, match="FP4Weight"):
        fp4_matmul(torch.randn(2, 64), q.dequantize())


@pytest.mark.parametrize("scheme", ["w4a16-mxfp4", "w4a16-nvfp4"])
def test_quantize_model_and_save_load(tmp_path, scheme):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 48), nn.Linear(48, 8))
    x = torch.randn(5, 64)
    dense = m(x)
    quantize(m, scheme)
    # K = 48 is a multiple of nvfp4's 16-blocks only
    assert isinstance(m[0], QuantLinear) and isinstance(m[2], QuantLinear)
    assert isinstance(m[3], QuantLinear) == (scheme == "w4a16-nvfp4")
    with torch.no_grad():
        y = m(x)
    assert ((y - dense).norm() / dense.norm()).item() < 0.25
    path = tmp_path / "q.safetensors"
    save_quantized(m, path)
    torch.manual_seed(1)
    fresh = load_quantized(nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 48), nn.Linear(48, 8)), path)
    with torch.no_grad():
        assert torch.equal(fresh(x), y)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_cpu_fast_path(fmt):
    # bf16 on the CPU: the native INT8 kernels over 2 * e2m1 as Q8_0-style bytes (decode rows), the same bytes
    # decoded into a dense GEMM (from 16 rows); fp32 keeps the reference.
    from infercore.devices import resolve
    from infercore.ops.moe import cpu_native
    from infercore.quant import cpu as qcpu

    assert resolve("quant.fp4_matmul", "cpu").name == "cpu"
    torch.manual_seed(0)
    q = FP4Weight.quantize(torch.randn(96, 256) * 0.05, fmt=fmt)
    codes, sz = qcpu.pack_fp4_q8(q)
    n, k = q.shape
    dec = (codes.float() - 128).view(n, -1, q.block) * sz[:, 0, :, None]  # the bytes decode to the weight exactly
    assert torch.equal(dec.reshape(n, k), q.dequantize())
    if cpu_native.q4_supported():
        assert qcpu.native_operands(q) is not None and qcpu.native_operands(q)[2] == 8
    for m in (1, 3, 20):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        r = R.fp4_matmul_ref(x, q)
        y = fp4_matmul(x, q)
        assert y.dtype == torch.bfloat16 and ((y.float() - r.float()).norm() / r.float().norm()).item() < 1e-2
    xf = torch.randn(2, k)
    assert torch.equal(fp4_matmul(xf, q), R.fp4_matmul_ref(xf, q))
