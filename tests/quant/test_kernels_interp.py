"""Triton kernels vs the references under the CPU interpreter (tiny fp32/fp16 shapes).

FP8 *conversions* are not checked here (the interpreter's fp32 -> fp8 cast is unreliable); the
emulated FP8 decode uses integer ops and a bitcast only, which the interpreter runs exactly.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated; tests/conftest.py decides first

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore.quant import FP8Weight, GGUFWeight, Int8Weight, IntWeight, triton_w8a8, triton_wo  # noqa: E402
from infercore.quant import naive as R  # noqa: E402


def _close(y, r, tol):
    err = ((y.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item()
    assert err < tol, err


@pytest.mark.parametrize("bits,sym,group", [(4, False, 32), (4, True, None), (8, True, 32), (8, False, None)])
@pytest.mark.parametrize("m", [1, 3, 20])
def test_wq_matmul(bits, sym, group, m):
    torch.manual_seed(m)
    w = IntWeight.quantize(torch.randn(40, 96), bits=bits, group_size=group, symmetric=sym)
    x = torch.randn(m, 96)
    _close(triton_wo.wq_matmul_triton(x, w), R.wq_matmul_ref(x, w), 1e-5)


def test_wq_gemv_split_k_and_fp16():
    torch.manual_seed(0)
    w = IntWeight.quantize(torch.randn(32, 1024), bits=4, group_size=64)
    x = torch.randn(1, 1024)
    _close(triton_wo.wq_matmul_triton(x, w), R.wq_matmul_ref(x, w), 1e-5)  # K=1024 -> split 2
    xh = torch.randn(24, 1024).half()
    bias = torch.randn(32)
    _close(triton_wo.wq_matmul_triton(xh, w, bias), R.wq_matmul_ref(xh, w, bias), 2e-3)


def test_fp8_decode_kernel_bit_exact():
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = q.view(torch.float8_e4m3fn).float()
    got = triton_wo.fp8_decode_triton(q)
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok].view(torch.int32), ref[ok].view(torch.int32))


@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("m,dtype", [(2, torch.float32), (5, torch.float32), (17, torch.float16)])
def test_fp8_weight_only(block, m, dtype):
    torch.manual_seed(0)
    w = FP8Weight.quantize(torch.randn(40, 160), block_size=block)
    x = torch.randn(m, 160).to(dtype)
    # m=2: FMA GEMV; m=5: dot on the fp32 pattern; fp16: dot on the fp16 pattern (fold 2**8).
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    _close(triton_wo.fp8_wo_matmul_triton(x, w), R.fp8_wo_matmul_ref(x, w), tol)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_gguf_blocks(qtype):
    torch.manual_seed(0)
    w = GGUFWeight.quantize(torch.randn(24, 128), qtype=qtype)
    x = torch.randn(3, 128)
    _close(triton_wo.gguf_matmul_triton(x, w), R.gguf_matmul_ref(x, w), 1e-5)


@pytest.mark.parametrize("smooth,outliers", [(False, False), (True, False), (False, True)])
def test_per_token_quant_int8(smooth, outliers):
    torch.manual_seed(0)
    x = torch.randn(6, 80) * 3
    s = torch.rand(80) + 0.5 if smooth else None
    idx = torch.tensor([2, 33, 79], dtype=torch.int32) if outliers else None
    q, sc, xo = triton_w8a8.per_token_quant_triton(x, act="int8", smooth=s, outlier_idx=idx)
    rq, rs, rxo = R.per_token_quant_ref(x, act="int8", smooth=s, outlier_idx=idx)
    assert torch.allclose(sc, rs, rtol=1e-6)
    assert (q.int() - rq.int()).abs().max() <= 1 and (q != rq).float().mean() < 0.01
    if outliers:
        assert torch.equal(xo, rxo) and torch.all(q[:, idx.long()] == 0)
    else:
        assert xo is None


def test_int8_scaled_mm_exact_and_mixed():
    torch.manual_seed(0)
    wt = torch.randn(40, 96)
    x = torch.randn(20, 96)
    x[:, 5] *= 30  # an outlier channel
    plain = Int8Weight.quantize(wt)
    q, s, _ = R.per_token_quant_ref(x)
    bias = torch.randn(40)
    y = triton_w8a8.w8a8_matmul_triton(q, s, plain, bias=bias, out_dtype=torch.float32)
    r = R.w8a8_matmul_ref(q, s, plain, bias=bias, out_dtype=torch.float32)
    _close(y, r, 1e-6)  # int32 accumulation is exact; only the fp32 epilogue rounds
    mixed = Int8Weight.quantize(wt, outlier_idx=torch.tensor([5, 17], dtype=torch.int32),
                                outlier_dtype=torch.float32)
    q, s, xo = R.per_token_quant_ref(x, outlier_idx=mixed.outlier_idx)
    y = triton_w8a8.w8a8_matmul_triton(q, s, mixed, x_out=xo, out_dtype=torch.float32)
    r = R.w8a8_matmul_ref(q, s, mixed, x_out=xo, out_dtype=torch.float32)
    _close(y, r, 1e-6)
    # And the outliers are the point: mixed is closer to the fp32 product than plain W8A8.
    exact = x @ wt.T
    qp, sp, _ = R.per_token_quant_ref(x)
    plain_y = R.w8a8_matmul_ref(qp, sp, plain, out_dtype=torch.float32)
    assert (y - exact).norm() < 0.5 * (plain_y - exact).norm()


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("k", [80, 96])  # 80: ragged last K step (masked / TMA zero-fill)
def test_int8_scaled_mm_paths(tma, k):
    torch.manual_seed(2)
    wt, x = torch.randn(40, k), torch.randn(20, k)
    x[:, 5] *= 30
    cfg = triton_w8a8.MMConfig(16, 16, 32, 2, 4, 1, tma=tma, block_o=16)
    plain = Int8Weight.quantize(wt)
    q, s, _ = R.per_token_quant_ref(x)
    y = triton_w8a8.w8a8_matmul_triton(q, s, plain, out_dtype=torch.float32, config=cfg)
    _close(y, R.w8a8_matmul_ref(q, s, plain, out_dtype=torch.float32), 1e-6)
    # 20 outliers: a second, ragged step of the outlier loop; fp32 rows of 80 bytes meet TMA rules.
    idx = torch.arange(1, k, k // 20, dtype=torch.int32)[:20]
    mixed = Int8Weight.quantize(wt, outlier_idx=idx, outlier_dtype=torch.float32)
    q, s, xo = R.per_token_quant_ref(x, outlier_idx=mixed.outlier_idx)
    bias = torch.randn(40)
    y = triton_w8a8.w8a8_matmul_triton(q, s, mixed, x_out=xo, bias=bias, out_dtype=torch.float32, config=cfg)
    _close(y, R.w8a8_matmul_ref(q, s, mixed, x_out=xo, bias=bias, out_dtype=torch.float32), 1e-6)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("k", [80, 96])  # 80: ragged last K step (masked fp8 loads / TMA zero-fill)
def test_fp8_scaled_mm_codes(tma, k):
    # FP8 codes come from the reference encoder (the interpreter's fp32 -> fp8 cast is unreliable);
    # the kernel only loads e4m3 and multiplies, and products of e4m3 values are exact in fp32.
    # k=80 on the pointer path is the masked fp8 load whose int fill once failed to compile.
    torch.manual_seed(3)
    wt, x = torch.randn(40, k), torch.randn(20, k)
    w = Int8Weight.quantize(wt, act="fp8")
    q, s, _ = R.per_token_quant_ref(x, act="fp8")
    cfg = triton_w8a8.MMConfig(16, 16, 32, 2, 4, 1, tma=tma)
    y = triton_w8a8.w8a8_matmul_triton(q, s, w, out_dtype=torch.float32, config=cfg)
    _close(y, R.w8a8_matmul_ref(q, s, w, out_dtype=torch.float32), 1e-5)


@pytest.mark.parametrize("variant", ["int8", "fp8", "mixed"])
@pytest.mark.parametrize("persistent,tma,tma_c", [(True, False, False), (True, True, True), (False, True, True)])
def test_scaled_mm_persistent_and_tma_store(variant, persistent, tma, tma_c):
    # 2 x 3 tiles over 4 programs under the interpreter: some programs walk two tiles, and the
    # last row/column tiles are ragged (clipped by the TMA store, masked by the pointer store).
    torch.manual_seed(4)
    wt, x = torch.randn(40, 80), torch.randn(20, 80)
    x[:, 7] *= 30
    idx = torch.tensor([7, 30, 41], dtype=torch.int32) if variant == "mixed" else None
    act = "fp8" if variant == "fp8" else "int8"
    w = Int8Weight.quantize(wt, act=act, outlier_idx=idx, outlier_dtype=torch.float32)
    q, s, xo = R.per_token_quant_ref(x, act=act, outlier_idx=w.outlier_idx)
    cfg = triton_w8a8.MMConfig(16, 16, 32, 2, 4, 1, tma=tma, block_o=16, persistent=persistent, tma_c=tma_c)
    bias = torch.randn(40)
    y = triton_w8a8.w8a8_matmul_triton(q, s, w, x_out=xo, bias=bias, out_dtype=torch.float32, config=cfg)
    _close(y, R.w8a8_matmul_ref(q, s, w, x_out=xo, bias=bias, out_dtype=torch.float32), 1e-5)


def test_mm_config_table_covers_all_m():
    for variant, table in triton_w8a8.MM_CONFIGS.items():
        bounds = [b for b, _ in table]
        assert bounds == sorted(bounds) and bounds[-1] >= 1 << 40, variant
        for bound, cfg in table:
            assert cfg.block_m <= max(16, triton_w8a8.triton.next_power_of_2(bound)), (variant, cfg)
