"""Formats and their references (pure PyTorch, CPU)."""

import numpy as np
import pytest
import torch

from infercore.quant import (
    FP8Weight,
    GGUFWeight,
    Int8Weight,
    IntWeight,
    fp8_e4m3_decode_emulated,
    from_awq,
    from_gptq,
    from_gptq_act_order,
    to_awq,
    to_gptq,
)
from infercore.quant.gguf import gguf_dequantize


def test_fp8_emulated_decode_bit_exact_all_bytes():
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = q.view(torch.float8_e4m3fn).float()
    got = fp8_e4m3_decode_emulated(q)
    finite = ~torch.isnan(ref)
    assert finite.sum() == 254  # 0x7F and 0xFF are e4m3's NaNs
    assert torch.equal(got[finite].view(torch.int32), ref[finite].view(torch.int32))
    # Subnormals (exponent field 0) are covered, and the raw pattern is exactly 2**-120 off.
    sub = (q & 0x78) == 0
    assert int((sub & (q & 7 != 0)).sum()) == 14
    raw = fp8_e4m3_decode_emulated(q, fold_scale=False)
    assert torch.equal((raw[finite].double() * 2.0**120), ref[finite].double())


def test_fp8_weight_emulated_dequant_matches_reference():
    w = torch.randn(200, 300) * torch.logspace(-4, 1, 300)
    for block in (None, 128):
        f = FP8Weight.quantize(w, block_size=block)
        assert torch.equal(f.dequantize(), f.dequantize_emulated())
        rel = (f.dequantize() - w).norm() / w.norm()
        assert rel < 0.05


@pytest.mark.parametrize("bits,sym,group", [(4, False, 128), (4, True, 64), (8, True, None), (8, False, 32)])
def test_int_weight_roundtrip(bits, sym, group):
    torch.manual_seed(0)
    w = torch.randn(64, 320)
    q = IntWeight.quantize(w, bits=bits, group_size=group, symmetric=sym)
    d = q.dequantize()
    assert d.shape == w.shape
    rel = ((d - w).norm() / w.norm()).item()
    assert rel < (0.12 if bits == 4 else 0.008)
    # Codes stay in range and padded positions (K=320 -> Kp=384 at g128) dequantize to zero.
    codes = q.codes()
    assert codes.min() >= 0 and codes.max() < 2**bits
    full = (codes.float().view(64, -1, q.group_size) - q.zero_points()[..., None]) * q.scales[..., None]
    assert torch.all(full.reshape(64, -1)[:, 320:] == 0)


def test_int_weight_clip_search_helps():
    torch.manual_seed(1)
    w = torch.randn(32, 256)
    w[:, 7] *= 8  # one heavy column per group widens the range
    a = IntWeight.quantize(w, bits=4, group_size=128, clip_search=False)
    b = IntWeight.quantize(w, bits=4, group_size=128, clip_search=True)
    assert (b.dequantize() - w).norm() < (a.dequantize() - w).norm()


def _gptq_pack_loops(q, z, bits):
    """Independent GPTQ packer: explicit loops over words."""
    n, k = q.shape
    pack = 32 // bits
    qw = np.zeros((k // pack, n), dtype=np.uint32)
    for i in range(k // pack):
        for j in range(pack):
            qw[i] |= (q[:, pack * i + j].astype(np.uint32) << (bits * j))
    g = z.shape[1]
    qz = np.zeros((g, n // pack), dtype=np.uint32)
    for c in range(n // pack):
        for j in range(pack):
            qz[:, c] |= ((z[pack * c + j, :].astype(np.uint32) - 1) & (2**bits - 1)) << (bits * j)
    return torch.from_numpy(qw.view(np.int32)), torch.from_numpy(qz.view(np.int32))


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_import_export(bits):
    rng = np.random.default_rng(0)
    n, k, g = 16, 128, 32
    q = rng.integers(0, 2**bits, size=(n, k))
    z = rng.integers(1, 2**bits, size=(n, k // g))
    s = rng.random((n, k // g)).astype(np.float16) + 0.1
    qweight, qzeros = _gptq_pack_loops(q, z, bits)
    w = from_gptq(qweight, qzeros, torch.from_numpy(s.T.copy()), bits=bits, group_size=g)
    expect = (q - np.repeat(z, g, axis=1)) * np.repeat(s.astype(np.float32), g, axis=1)
    assert torch.allclose(w.dequantize(), torch.from_numpy(expect).float())
    out = to_gptq(w)
    assert torch.equal(out["qweight"], qweight) and torch.equal(out["qzeros"], qzeros)
    with pytest.raises(ValueError, match="g_idx"):
        from_gptq(qweight, qzeros, torch.from_numpy(s.T.copy()), bits=bits, group_size=g,
                  g_idx=torch.randperm(k) // g)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_act_order_import(bits, tmp_path):
    """An act-order layer: channel k in group g_idx[k]. The IntWeight holds the columns sorted by group and
    QuantLinear(in_perm=perm) computes x @ W^T of the original layer; saved and loaded with the model."""
    from torch import nn

    from infercore.quant import QuantLinear, load_quantized, save_quantized

    rng = np.random.default_rng(2)
    n, k, g = 16, 128, 32
    g_idx = torch.from_numpy(rng.permutation(k) // g).to(torch.int32)
    q = rng.integers(0, 2**bits, size=(n, k))
    z = rng.integers(1, 2**bits, size=(n, k // g))
    s = rng.random((n, k // g)).astype(np.float16) + 0.1
    qweight, qzeros = _gptq_pack_loops(q, z, bits)
    expect = torch.from_numpy((q - z[:, g_idx.numpy()]) * s.astype(np.float32)[:, g_idx.numpy()]).float()
    w, perm = from_gptq_act_order(qweight, qzeros, torch.from_numpy(s.T.copy()), g_idx, bits=bits, group_size=g)
    assert torch.equal(g_idx[perm].long(), torch.arange(k) // g)  # sorted by group
    torch.testing.assert_close(w.dequantize(), expect[:, perm], rtol=0, atol=0)
    lin = QuantLinear(w, in_perm=perm)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    y = x @ expect.t()  # magnitudes up to ~1e3 at 8 bits: compare relative to the largest
    assert float((lin(x) - y).abs().max()) <= 1e-5 * float(y.abs().max())
    # The gated form permutes once too (it used to permute, then call forward, which permuted again).
    gu = lin(x)
    want_act = torch.nn.functional.silu(gu[:, : n // 2]) * gu[:, n // 2:]
    torch.testing.assert_close(lin.forward_act(x, "silu"), want_act, rtol=0, atol=0)
    model = nn.Sequential(nn.Linear(k, n, bias=False))
    model[0] = lin
    save_quantized(model, tmp_path / "m.safetensors")
    back = load_quantized(nn.Sequential(nn.Linear(k, n, bias=False)), tmp_path / "m.safetensors")
    assert torch.equal(back[0].in_perm, perm)
    torch.testing.assert_close(back[0](x), lin(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="groups must hold"):
        from_gptq_act_order(qweight, qzeros, torch.from_numpy(s.T.copy()), torch.zeros(k, dtype=torch.int32),
                            bits=bits, group_size=g)
    with pytest.raises(ValueError, match="permutation"):
        QuantLinear(w, in_perm=torch.zeros(k, dtype=torch.long))
    with pytest.raises(TypeError, match="in_perm"):
        QuantLinear(w, in_perm=perm.float())
    with pytest.raises(ValueError, match="in_perm"):
        QuantLinear(Int8Weight.quantize(torch.randn(n, k)), in_perm=perm)


def test_awq_import_export():
    rng = np.random.default_rng(1)
    n, k, g = 16, 64, 32
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    q = rng.integers(0, 16, size=(n, k))
    z = rng.integers(0, 16, size=(n, k // g))
    s = (rng.random((k // g, n)) + 0.1).astype(np.float16)

    def pack(codes):  # codes [R, N] -> [R, N/8], AWQ's interleaved nibble order
        out = np.zeros((codes.shape[0], codes.shape[1] // 8), dtype=np.uint32)
        for c in range(codes.shape[1] // 8):
            for i in range(8):
                out[:, c] |= codes[:, 8 * c + order[i]].astype(np.uint32) << (4 * i)
        return torch.from_numpy(out.view(np.int32))

    qweight, qzeros = pack(q.T), pack(z.T)
    w = from_awq(qweight, qzeros, torch.from_numpy(s), group_size=g)
    expect = (q - np.repeat(z, g, axis=1)) * np.repeat(s.T.astype(np.float32), g, axis=1)
    assert torch.allclose(w.dequantize(), torch.from_numpy(expect).float())
    out = to_awq(w)
    assert torch.equal(out["qweight"], qweight) and torch.equal(out["qzeros"], qzeros)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_gguf_blocks_match_loader_dequantizer(qtype):
    from infercore.loading.gguf_quants import GGMLType, dequantize

    torch.manual_seed(0)
    w = torch.randn(8, 96)
    g = GGUFWeight.quantize(w, qtype=qtype)
    ggml = {"q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1, "q8_0": GGMLType.Q8_0}[qtype]
    bb = g.raw.shape[1] // 3
    ref = dequantize(g.raw.numpy().reshape(-1, bb), ggml).reshape(8, 96)
    assert torch.equal(g.dequantize(), torch.from_numpy(ref))
    rel = (g.dequantize() - w).norm() / w.norm()
    assert rel < (0.15 if qtype != "q8_0" else 0.01)


def test_gguf_quantizer_matches_gguf_package():
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 128)).astype(np.float32)
    for qtype, t in (("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1)):
        ours = GGUFWeight.quantize(torch.from_numpy(w), qtype=qtype)
        theirs = torch.from_numpy(gq.dequantize(gq.quantize(w, t), t).astype(np.float32))
        assert torch.allclose(ours.dequantize(), theirs, atol=1e-6), qtype


def test_int8_weight_outliers_and_smooth():
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    smooth = torch.rand(64) + 0.5
    idx = torch.tensor([3, 40], dtype=torch.int32)
    q = Int8Weight.quantize(w, smooth=smooth, outlier_idx=idx, outlier_dtype=torch.float32)
    d = q.dequantize()
    assert torch.equal(d[:, [3, 40]], w[:, [3, 40]])  # outlier columns exact in fp32
    assert ((d - w).abs().max() / w.abs().max()) < 0.02
    grown = q.with_outliers(torch.tensor([5], dtype=torch.int32))
    assert grown.num_outliers == 3 and torch.all(grown.qweight[:, 5] == 0)
    assert torch.allclose(grown.dequantize(), d, atol=1e-6)  # same effective weight


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        IntWeight.quantize(torch.randn(4, 8), bits=3)
    with pytest.raises(ValueError, match="qtype"):
        GGUFWeight.quantize(torch.randn(4, 32), qtype="q5_k")
    with pytest.raises(ValueError, match="w"):
        GGUFWeight.quantize(torch.randn(4, 30), qtype="q8_0")
    with pytest.raises(ValueError, match="act"):
        Int8Weight.quantize(torch.randn(4, 8), act="int4")
    with pytest.raises(TypeError, match="q"):
        fp8_e4m3_decode_emulated(torch.zeros(3))


def test_gguf_raw_dequant_of_real_file_rows():
    """The real SmolLM2 Q4_1 blocks decode the same through our torch path and the loader."""
    from infercore.loading import default_model_path
    from infercore.loading import gguf as G

    f = G.GGUFFile(default_model_path())
    blocks, _, shape = f.raw("blk.0.attn_q.weight")
    raw = torch.from_numpy(np.array(blocks[:16])).reshape(16, -1)
    ours = gguf_dequantize(raw, "q4_1")
    ref = f.tensor("blk.0.attn_q.weight")[:16]
    assert torch.equal(ours, ref)
