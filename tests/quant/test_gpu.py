"""Quant kernels on a CUDA GPU (bf16/fp8 numerics, real shapes). Run with ``pytest -m gpu``."""

import os

os.environ.setdefault("INFERCORE_QUANT_AUTOTUNE", "0")  # one config per kernel: fast compile

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore.quant import (  # noqa: E402
    FP8Weight,
    GGUFWeight,
    Int8Weight,
    IntWeight,
    QuantLinear,
    fp8_decode,
    fp8_wo_matmul,
    gguf_matmul,
    per_token_quant,
    w8a8_matmul,
    wq_matmul,
)
from infercore.quant import naive as R  # noqa: E402

pytestmark = pytest.mark.gpu
dev = "cuda"


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


def test_fp8_decode_bit_exact_on_gpu():
    q = torch.arange(256, dtype=torch.int32, device=dev).to(torch.uint8)
    ref = q.view(torch.float8_e4m3fn).float()
    got = fp8_decode(q)
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok].view(torch.int32), ref[ok].view(torch.int32))


@pytest.mark.parametrize("m", [1, 7, 40, 64, 300])
@pytest.mark.parametrize("bits,group,sym", [(4, 128, False), (4, 128, True), (8, None, True)])
def test_wq_bf16(m, bits, group, sym):
    torch.manual_seed(0)
    w = IntWeight.quantize(torch.randn(1000, 1536, device=dev), bits=bits, group_size=group, symmetric=sym)
    x = torch.randn(m, 1536, device=dev, dtype=torch.bfloat16)
    assert _rel(wq_matmul(x, w), R.wq_matmul_ref(x, w)) < 1e-2


@pytest.mark.parametrize("m", [1, 16, 40, 64, 200, 300])
@pytest.mark.parametrize("block", [None, 128])
def test_fp8_emulated_bf16(m, block):
    torch.manual_seed(0)
    w = FP8Weight.quantize(torch.randn(1000, 1024, device=dev) * 0.02, block_size=block)
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    assert _rel(fp8_wo_matmul(x, w), R.fp8_wo_matmul_ref(x, w)) < 1e-2


@pytest.mark.parametrize("kind", ["int4", "int4-sym", "int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_m_decode_bit_exact_on_gpu(kind, dtype):
    """The large-M path's one-pass decode (``triton_dequant``) rounds like ``dequantize(dtype)``."""
    from infercore.quant.triton_dequant import dequant_fp8_triton, dequant_int_triton

    torch.manual_seed(0)
    wf = torch.randn(1000, 1100, device=dev) * torch.logspace(-2, 1, 1100, device=dev)
    if kind.startswith("fp8"):
        w = FP8Weight.quantize(wf, block_size=128 if kind == "fp8-block" else None)
        got = dequant_fp8_triton(w, dtype)
    else:
        w = IntWeight.quantize(wf, bits=8 if kind == "int8" else 4, group_size=None if kind == "int8" else 128,
                               symmetric=kind != "int4")
        got = dequant_int_triton(w, dtype)
    assert torch.equal(got, w.dequantize(dtype))


@pytest.mark.parametrize("mode", [1, 2, 4, 5])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_small_m_every_mode_bf16(mode, m):
    """Each small-M kernel variant the sweep may pick, with split-K, on bf16 activations (MODE 4 at
    M > 4 runs as the swapped dot)."""
    from infercore.quant import triton_wo

    torch.manual_seed(0)
    wt = torch.randn(1000, 2048, device=dev)
    x = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
    w4 = IntWeight.quantize(wt, bits=4, group_size=128)
    f8 = FP8Weight.quantize(wt)
    for split in (1, 4):
        cfg = {"MODE": mode, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": split, "num_warps": 4, "num_stages": 3}
        assert _rel(triton_wo.wq_matmul_triton(x, w4, config=cfg), R.wq_matmul_ref(x, w4)) < 1e-2
        assert _rel(triton_wo.fp8_wo_matmul_triton(x, f8, config=cfg), R.fp8_wo_matmul_ref(x, f8)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,bn,warps", [(1024, 128, 4), (1024, 256, 8), (1000, 128, 4)])
def test_mode5_word_decode(dtype, n, bn, warps):
    """MODE 5 (stored words, two codes per instruction) in both 16-bit dtypes, whole tiles (the
    unmasked EVEN path) and a ragged last channel tile; asymmetric INT4 and block-scaled FP8 too."""
    from infercore.quant import triton_wo

    torch.manual_seed(1)
    wt = torch.randn(n, 2048, device=dev)
    x = torch.randn(7, 2048, device=dev, dtype=dtype)
    qs = [IntWeight.quantize(wt, bits=4, group_size=128),
          IntWeight.quantize(wt, bits=4, group_size=128, symmetric=False),
          FP8Weight.quantize(wt), FP8Weight.quantize(wt, block_size=128)]
    for q in qs:
        fn, ref = ((triton_wo.wq_matmul_triton, R.wq_matmul_ref) if isinstance(q, IntWeight)
                   else (triton_wo.fp8_wo_matmul_triton, R.fp8_wo_matmul_ref))
        for split in (1, 3, 4):
            cfg = {"MODE": 5, "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT": split, "num_warps": warps, "num_stages": 3}
            for _ in range(2):  # the second call reuses the split-K arrival counters the first reset
                y = fn(x, q, config=cfg)
                assert y.dtype == dtype and _rel(y, ref(x, q)) < 1e-2, (type(q).__name__, split)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_gguf_bf16(qtype):
    torch.manual_seed(0)
    w = GGUFWeight.quantize(torch.randn(576, 1536, device=dev), qtype=qtype)
    x = torch.randn(5, 1536, device=dev, dtype=torch.bfloat16)
    assert _rel(gguf_matmul(x, w), R.gguf_matmul_ref(x, w)) < 1e-2


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_per_token_quant_gpu(act):
    torch.manual_seed(0)
    x = torch.randn(300, 2000, device=dev, dtype=torch.bfloat16) * 4
    idx = torch.tensor([1, 999], dtype=torch.int32, device=dev)
    q, s, xo = per_token_quant(x, act=act, outlier_idx=idx)
    rq, rs, rxo = R.per_token_quant_ref(x, act=act, outlier_idx=idx)
    assert torch.allclose(s, rs, rtol=1e-6) and torch.equal(xo, rxo)
    if act == "int8":
        assert (q.int() - rq.int()).abs().max() <= 1 and (q != rq).float().mean() < 1e-3
    else:
        assert (q.float() - rq.float()).abs().max() / 448 < 0.07
        assert (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean() < 1e-3


@pytest.mark.parametrize("act", ["int8", "fp8"])
@pytest.mark.parametrize("m", [5, 512])
def test_w8a8_gpu(act, m):
    torch.manual_seed(0)
    wt = torch.randn(1024, 2048, device=dev) * 0.05
    x = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
    idx = torch.arange(0, 2048, 37, device=dev, dtype=torch.int32) if act == "int8" else None
    w = Int8Weight.quantize(wt, act=act, outlier_idx=idx)
    q, s, xo = per_token_quant(x, act=act, outlier_idx=w.outlier_idx)
    y = w8a8_matmul(q, s, w, x_out=xo, out_dtype=torch.bfloat16)
    assert _rel(y, R.w8a8_matmul_ref(q, s, w, x_out=xo)) < 1e-2
    assert _rel(y, x.float() @ wt.T) < 0.06


@pytest.mark.parametrize("variant", ["int8", "fp8", "mixed"])
def test_w8a8_every_table_config_on_gpu(variant):
    # Each M bucket's table entry and its variants, on a ragged N and a K that is not a multiple
    # of BLOCK_K (the TMA unit zero-fills the last K box; pointer loads mask it).
    from infercore.quant import triton_w8a8 as TW

    torch.manual_seed(0)
    wt = torch.randn(1000, 1040, device=dev) * 0.05
    idx = torch.arange(3, 1040, 9, device=dev, dtype=torch.int32)[:112] if variant == "mixed" else None
    w = Int8Weight.quantize(wt, act="fp8" if variant == "fp8" else "int8", outlier_idx=idx)
    for bound, cfg in TW.MM_CONFIGS[variant]:
        m = min(bound, 300)
        x = torch.randn(m, 1040, device=dev, dtype=torch.bfloat16)
        q, s, xo = per_token_quant(x, act=w.act, outlier_idx=w.outlier_idx)
        r = R.w8a8_matmul_ref(q, s, w, x_out=xo)
        # The table entry, its pointer path (masked 8-bit loads on the ragged K), and the
        # persistent + TMA-store form of it the sweep explores (the TMA store's staging tile does not
        # fit beside a 4-stage 128x256 main loop, so that form keeps plain stores there).
        wide = cfg.block_m * cfg.block_n >= 128 * 256 and cfg.stages > 3
        for c in (cfg, cfg._replace(tma=False), cfg._replace(tma=True, persistent=True, tma_c=not wide)):
            y = TW.w8a8_matmul_triton(q, s, w, x_out=xo, config=c)
            assert _rel(y, r) < 1e-2, (m, c)


def test_mixed_linear_grows_outliers_on_gpu():
    torch.manual_seed(0)
    wt = torch.randn(256, 512, device=dev) * 0.05
    lin = QuantLinear(Int8Weight.quantize(wt), outlier_threshold=6.0)
    x = torch.randn(64, 512, device=dev, dtype=torch.bfloat16)
    x[:, 100] = 40.0
    y = lin(x)
    assert lin.qweight_format.num_outliers == 1 and lin.outlier_stats["grown"] == 1
    assert _rel(y, x.float() @ wt.T) < 0.02
    lin(x)
    assert lin.outlier_stats["covered"] == 64  # second call fully predicted


@pytest.mark.parametrize("stages", [1, 2])
def test_gemv4_ragged_k_bf16(stages):
    """MODE 4 with a last tile that overhangs K (K = 2176: 272 int4 words, tiles of 128 words) and
    int4/int8/fp8 weights, bf16 activations, M = 1..4."""
    from infercore.quant import triton_wo

    torch.manual_seed(1)
    wt = torch.randn(777, 2176, device=dev)
    cfg = {"MODE": 4, "BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT": 1, "num_warps": 4, "num_stages": stages}
    for m in (1, 2, 4):
        x = torch.randn(m, 2176, device=dev, dtype=torch.bfloat16)
        for w in (IntWeight.quantize(wt, bits=4, group_size=128), IntWeight.quantize(wt, bits=8, group_size=128,
                                                                                      symmetric=False)):
            y = triton_wo.wq_matmul_triton(x, w, config=dict(cfg))
            assert torch.isfinite(y).all() and _rel(y, R.wq_matmul_ref(x, w)) < 1e-2
        f8 = FP8Weight.quantize(wt, block_size=128)
        y = triton_wo.fp8_wo_matmul_triton(x, f8, config=dict(cfg))
        assert torch.isfinite(y).all() and _rel(y, R.fp8_wo_matmul_ref(x, f8)) < 1e-2


@pytest.mark.parametrize("scheme", ["w4a16-g128", "fp8-wo"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_quantized_gated_mlp_fused_act_on_gpu(scheme, m):
    """A Llama MLP whose gate_up is quantized, swapped by use_triton_gemv_: at <= 4 rows gate_up and
    SiLU run as one GEMV (QuantLinear.forward_act), above that the unfused path; both equal the
    quantized module before the swap."""
    from infercore.models import ModelConfig
    from infercore.models.gpu_layout import use_triton_gemv_
    from infercore.models.llama import LlamaMLP
    from infercore.quant import quantize

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
                               "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
                               "vocab_size": 128})
    mlp = LlamaMLP(cfg, dtype=torch.bfloat16).to(dev)
    quantize(mlp, scheme)
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    want = mlp(x)
    use_triton_gemv_(mlp)
    assert type(mlp).__name__.startswith("GemvFused")
    assert _rel(mlp(x), want) < 1e-2


def _activations(m, k, dtype):
    """Rows from 1e-4 to 1e5 (fp16 to 1e4), and one mixing 1e-3 with a few 1e4 outliers; with several rows,
    each row down to 1e-2 of that."""
    mixed = torch.where(torch.rand(k, device=dev) < 0.01, 1e4, 1e-3)
    for scale in (1.0, 1e-4, 1e5 if dtype == torch.bfloat16 else 1e4, mixed):  # (fp16 outputs stay finite)
        x = torch.randn(m, k, device=dev) * scale
        if m > 1:  # rows of different magnitudes: each row has its own power-of-two scale
            x = x * torch.logspace(-2, 0, m, device=dev)[:, None]
        yield x.to(dtype)


def _check_packed(matmul, ref_fn, make_w, m, dtype, tiles, silu_warps):
    """MODE 4 with the packed dot (``"PACKED": True``) and the fp32 path (False) against ``ref_fn`` (the
    reference matmul): whole and ragged K, split-K, every tile of ``tiles`` (BLOCK_N, BLOCK_K, warps, stages),
    the activations of ``_activations`` -- within 3e-3; then the fused SiLU epilogue of a merged [gate; up]
    weight against the exact gated product, within 4e-3. ``make_w(n, k, scale)`` quantizes a random weight."""
    for n, k, split in ((1024, 4096, 1), (777, 2176, 1), (1024, 4096, 4)):
        w = make_w(n, k, 0.02)
        for x in _activations(m, k, dtype):
            ref = ref_fn(x, w).float()
            for bn, bk, warps, stages in tiles:
                cfg = {"MODE": 4, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "num_warps": warps,
                       "num_stages": stages}
                fp32 = matmul(x, w, config={**cfg, "PACKED": False})
                got = matmul(x, w, config={**cfg, "PACKED": True})
                assert torch.isfinite(got).all(), (n, k, bn, x.abs().max())
                assert _rel(fp32, ref) < 3e-3 and _rel(got, ref) < 3e-3, (n, k, split, bn, _rel(got, ref))
    w = make_w(2 * 1024, 4096, 1.0)
    x = torch.randn(m, 4096, device=dev, dtype=dtype)
    y = ref_fn(x, w).float()
    ref = torch.nn.functional.silu(y[:, :1024]) * y[:, 1024:]
    cfg = {"MODE": 4, "BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT": 1, "num_warps": silu_warps, "num_stages": 2}
    for packed in (True, False):
        got = matmul(x, w, config={**cfg, "PACKED": packed}, act="silu")
        assert got.shape == (m, 1024) and _rel(got, ref) < 4e-3, (packed, _rel(got, ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv4_packed_int4(dtype, symmetric, m):
    """MODE 4's packed fp16 INT4 dot against the reference and the fp32 path, 1-4 rows, symmetric and
    asymmetric g128 (``_check_packed``; the step runs where BLOCK_K >= 1024 x num_warps)."""
    from infercore.quant import triton_wo

    torch.manual_seed(2)

    def make_w(n, k, scale):
        return IntWeight.quantize(torch.randn(n, k, device=dev) * scale, bits=4, group_size=128, symmetric=symmetric)

    _check_packed(triton_wo.wq_matmul_triton, R.wq_matmul_ref, make_w, m, dtype,
                  ((4, 2048, 2, 2), (8, 4096, 4, 1), (4, 1024, 1, 2)), 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv4_packed_fp8(dtype, block, m):
    """MODE 4's packed fp16 FP8 dot (e4m3 decoded exactly to fp16 times 2**-8) against the reference and the fp32
    path, 1-4 rows, per-channel and 128x128 block scales (``_check_packed``), with codes at both ends of e4m3's
    range in the product checks (every code but NaN in the first 256 columns: subnormals, +-448)."""
    from infercore.quant import triton_wo

    torch.manual_seed(3)

    def make_w(n, k, scale):
        w = FP8Weight.quantize(torch.randn(n, k, device=dev) * scale, block_size=block)
        if scale != 1.0:  # (the gated-epilogue weight keeps its quantized codes)
            q = w.qweight.view(torch.uint8)
            q[:, :256] = torch.arange(256, device=dev, dtype=torch.int32).to(torch.uint8)
            q[q == 0x7F] = 0x7E
            q[q == 0xFF] = 0xFE
        return w

    _check_packed(triton_wo.fp8_wo_matmul_triton, R.fp8_wo_matmul_ref, make_w, m, dtype,
                  ((4, 2048, 4, 2), (8, 2048, 4, 2), (4, 1024, 2, 2)), 4)

