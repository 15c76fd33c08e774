"""MODE 6 fragment layouts on the CPU: the packers (``pack_int4`` / ``pack_fp8``) replayed through the
PTX fragment tables of mma.m16n8k16 by ``triton_frag.emulate`` must give ``x @ dequantize()^T``; the
inline-PTX kernel itself runs on the GPU only (tests/quant/test_frag_gpu.py)."""

import pytest
import torch

from infercore.quant import FP8Weight, IntWeight
from infercore.quant import triton_frag as TF


def _close(y, ref, rtol=1e-6):
    # INT4: the scales carry the zero point in their 4 low mantissa bits (relative change < 2**-19)
    assert torch.allclose(y, ref, rtol=rtol, atol=max(rtol, 1e-5) * ref.abs().max().item())


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_fragments_replay_the_product(sym, dtype):
    torch.manual_seed(0)
    w = IntWeight.quantize(torch.randn(64, 256), bits=4, group_size=128, symmetric=sym)
    words, sz = TF.pack_int4(w.codes(), w.scales, w.zeros, 128)
    assert words.shape == (1, 2, 8, 32, 4) and words.dtype == torch.int32 and sz.shape == (1, 2, 8, 4)
    x = torch.randn(11, 256).to(dtype)
    y = TF.emulate(x, words, "int4", 64, s=sz, f16=dtype == torch.float16)
    _close(y, x.double() @ w.dequantize(torch.float64).T, rtol=2e-6)


def test_int4_fragments_large_group_and_gated_row_order():
    torch.manual_seed(1)
    w = IntWeight.quantize(torch.randn(128, 256), bits=4, group_size=256)
    words, sz = TF.pack_int4(w.codes(), w.scales, w.zeros, 256, act=True)
    x = torch.randn(2, 256).to(torch.bfloat16)
    y = TF.emulate(x, words, "int4", 128, s=sz)
    order = TF._act_rows(128, 64, "cpu")  # block b: gate rows 32b.., then up rows 64 + 32b..
    assert order[:64].tolist() == list(range(32)) + list(range(64, 96))
    _close(y, (x.double() @ w.dequantize(torch.float64).T)[:, order])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_fragments_replay_the_product(dtype):
    torch.manual_seed(2)
    w = FP8Weight.quantize(torch.randn(64, 256))
    frags = TF.pack_fp8(w.qweight)
    assert frags.shape == (2, 2, 8, 32, 2) and frags.dtype == torch.int64
    x = torch.randn(16, 256).to(dtype)
    y = TF.emulate(x, frags, "fp8", 64, fp8_scales=w.scales, f16=dtype == torch.float16)
    _close(y, x.double() @ w.dequantize(torch.float64).T)


def test_fp8_block_scale_fragments():
    torch.manual_seed(3)
    w = FP8Weight.quantize(torch.randn(256, 256), block_size=128)
    frags = TF.pack_fp8(w.qweight)
    bs = TF.pack_fp8_block_scales(w.scales, 256, 256)
    x = torch.randn(3, 256).to(torch.bfloat16)
    _close(TF.emulate(x, frags, "fp8", 256, block_scales=bs), x.double() @ w.dequantize(torch.float64).T)


def test_layout_errors_name_the_shape():
    codes = torch.zeros(48, 256, dtype=torch.int32)
    with pytest.raises(ValueError, match="pack_int4"):
        TF.pack_int4(codes, torch.ones(48, 2), None, 128)
    with pytest.raises(ValueError, match="pack_fp8"):
        TF.pack_fp8(torch.zeros(64, 100, dtype=torch.uint8))
    assert not TF.supported(torch.zeros(1, 256))  # CPU tensors never take MODE 6


def test_ptx_variants_name_every_operand():
    for nb in (1, 2):
        for f16 in (False, True):
            for words in (1, 2, 4):
                asm, cons = TF.int4_asm(nb, f16, words)
                n_ops = len(cons.split(","))
                assert f"${n_ops - 1}" in asm and f"${n_ops}" not in asm
                assert asm.count("mma.sync") == words * nb and asm.count("fma.rn.f32") == 4 * nb
            for bs in (False, True):
                asm, cons = TF.fp8_asm(nb, f16, bs)
                n_ops = len(cons.split(","))
                assert f"${n_ops - 1}" in asm and f"${n_ops}" not in asm


def test_mode6_request_where_it_cannot_run_raises():
    from infercore.quant import triton_wo as TW

    w = IntWeight.quantize(torch.randn(64, 256), bits=4, group_size=128)
    x = torch.randn(1, 256)  # CPU, fp32: no fragment kernel here
    with pytest.raises(ValueError, match="MODE 6"):
        TW.wq_matmul_triton(x, w, config={"MODE": 6})
    fw = FP8Weight.quantize(torch.randn(64, 256))
    with pytest.raises(ValueError, match="MODE 6"):
        TW.fp8_wo_matmul_triton(x, fw, config={"MODE": 6})
    # the dispatcher never picks MODE 6 off the GPU
    assert TW._mode6_cfg("int4", x, 14336, 4096, None, lambda: True) is None


def test_launch_checks_its_inputs_naming_the_argument():
    w = IntWeight.quantize(torch.randn(128, 256), bits=4, group_size=128)
    words, sz = TF.pack_int4(w.codes(), w.scales, w.zeros, 128)
    cfg = {"WARPS": 4, "REPS": 2}
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    # a well-formed call gets past the shape checks and stops at the device (no fragment kernel on the CPU)
    with pytest.raises(ValueError, match="x: MODE 6 needs a CUDA"):
        TF.launch(x, "int4", words, 128, cfg, s=sz)
    fw = FP8Weight.quantize(torch.randn(64, 256))
    with pytest.raises(ValueError, match="x: MODE 6 needs a CUDA"):
        TF.launch(x, "fp8", TF.pack_fp8(fw.qweight), 64, cfg, s=fw.scales, fold=2.0**120)
    with pytest.raises(ValueError, match="frags"):
        TF.launch(x, "int4", words.to(torch.int64), 128, cfg, s=sz)
    with pytest.raises(ValueError, match="n:"):
        TF.launch(x, "int4", words, 96, cfg, s=sz)
    with pytest.raises(ValueError, match=r"x: expected \[M, 256\]"):
        TF.launch(torch.randn(2, 128, dtype=torch.bfloat16), "int4", words, 128, cfg, s=sz)
    with pytest.raises(ValueError, match="kind"):
        TF.launch(x, "int8", words, 128, cfg, s=sz)
    with pytest.raises(ValueError, match="s: expected torch.int64"):  # INT4 scale / zero-point words
        TF.launch(x, "int4", words, 128, cfg, s=sz[:, :1])
    with pytest.raises(ValueError, match="s: expected torch.float32"):  # FP8 per-channel scales [N]
        TF.launch(x, "fp8", TF.pack_fp8(fw.qweight), 64, cfg, s=fw.scales[:32], fold=2.0**120)
