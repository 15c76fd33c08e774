"""FP4 (MXFP4 / NVFP4) weight-only kernels on a CUDA GPU: bf16 activations at real shapes, every path (GEMV,
tiled, decode + cuBLAS), the decode bit for bit, and a CUDA-graph replay. Run with ``pytest -m gpu``."""

import os

os.environ.setdefault("INFERCORE_QUANT_AUTOTUNE", "0")  # one config per kernel: fast compile

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore.quant import (  # noqa: E402
    FP4Weight,
    QuantLinear,
    fp4_matmul,
    triton_fp4,  # noqa: E402
)
from infercore.quant import naive as R  # noqa: E402

pytestmark = pytest.mark.gpu
dev = "cuda"


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("m", [1, 2, 8, 9, 16, 64, 96, 300])
def test_fp4_matmul_bf16(fmt, m):
    torch.manual_seed(m)
    w = FP4Weight.quantize(torch.randn(3072, 1536, device=dev) * 0.05, fmt=fmt)
    x = torch.randn(m, 1536, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(3072, device=dev, dtype=torch.bfloat16)
    y = fp4_matmul(x, w, bias=bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 3072)
    assert _rel(y, R.fp4_matmul_ref(x, w, bias)) < 1e-2


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_decode_bit_exact_on_gpu(fmt):
    codes = torch.randint(0, 256, (64, 256), dtype=torch.uint8, device=dev)
    if fmt == "mxfp4":
        scales = torch.randint(90, 140, (64, 16), dtype=torch.uint8, device=dev)
        scales[0, :2] = torch.tensor([0, 1], dtype=torch.uint8)
        w = FP4Weight(codes, scales, "mxfp4")
    else:
        scales = torch.randint(1, 0x7F, (64, 32), dtype=torch.uint8, device=dev)
        w = FP4Weight(codes, scales, "nvfp4", 1.7e-3)
    got = triton_fp4.fp4_dequantize_triton(w, torch.float32)
    assert torch.equal(got, w.dequantize())


def test_fp4_linear_in_a_cuda_graph(graph_matches_eager):
    torch.manual_seed(0)
    lin = QuantLinear(FP4Weight.quantize(torch.randn(4096, 2048, device=dev) * 0.05, fmt="mxfp4"))
    for rows in (1, 8):
        x = torch.randn(rows, 2048, device=dev, dtype=torch.bfloat16)
        lin(x)  # autotune / compile outside the capture
        graph_matches_eager(lambda x=x: lin(x), x=x, rounds=2)


@pytest.mark.parametrize("fmt, dtype", [("nvfp4", torch.float16), ("nvfp4", torch.bfloat16), ("mxfp4", torch.bfloat16)])
def test_fp4_mode9_wide_scales(fmt, dtype, graph_matches_eager, mode9_calls):
    # 1-16 rows: MODE 9 (cuda_mma with FP4): e2m1 codes looked up into the MMA's A registers, times the block scales in
    # the 16-bit type (exact), over scales far apart (e8m0 2**-27 .. 2**22; e4m3 subnormals to 448); eager and
    # replayed in a CUDA graph, deterministic
    codes = torch.randint(0, 256, (2048, 512), dtype=torch.uint8, device=dev)
    if fmt == "mxfp4":
        w = FP4Weight(codes, torch.randint(100, 150, (2048, 32), dtype=torch.uint8, device=dev), "mxfp4")
    else:
        w = FP4Weight(codes, torch.randint(1, 0x7F, (2048, 64), dtype=torch.uint8, device=dev), "nvfp4", 1.7e-3)
    for m in (1, 2, 5, 9, 16):
        x = torch.randn(m, 1024, device=dev, dtype=dtype)
        y = triton_fp4.fp4_matmul_triton(x, w)
        assert _rel(y, R.fp4_matmul_ref(x, w)) < 1e-2
        assert torch.equal(y, triton_fp4.fp4_matmul_triton(x, w))
        graph_matches_eager(lambda x=x: triton_fp4.fp4_matmul_triton(x, w), x, rounds=2)
    assert mode9_calls == [m for m in (1, 2, 5, 9, 16) for _ in range(5)]  # eager twice, the capture, two rounds


def test_mode9_takes_the_default_rows(monkeypatch):
    # by default MODE 9 takes NF4 and FP4 at 3-16 rows (the GEMVs at 1-2: faster for FP4, mode9_lut_h200.json, and for
    # NF4 end to end, e2e_quant_fp4_nf4_mode9_h100.json)
    from infercore.quant import cuda_mma, nf4_matmul
    from infercore.quant.formats import NF4Weight

    calls = []
    real = cuda_mma.matmul
    monkeypatch.setattr(cuda_mma, "matmul", lambda *a, **kw: calls.append((a[1], a[0].shape[0])) or real(*a, **kw))
    torch.manual_seed(0)
    w = torch.randn(1024, 2048, device=dev) * 0.02
    weights = {"nf4": NF4Weight.quantize(w), "mxfp4": FP4Weight.quantize(w, fmt="mxfp4"),
               "nvfp4": FP4Weight.quantize(w, fmt="nvfp4")}
    for kind, q in weights.items():
        for m in (1, 2, 3, 16, 17):
            x = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
            y = nf4_matmul(x, q) if kind == "nf4" else fp4_matmul(x, q)
            ref = R.nf4_matmul_ref(x, q) if kind == "nf4" else R.fp4_matmul_ref(x, q)
            assert _rel(y, ref) < 1e-2
    want = [(k, m) for k in ("nf4", "mxfp4", "nvfp4") for m in (3, 16)]
    assert calls == want
