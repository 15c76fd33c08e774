"""The CPU fast path of ``quant.wq_matmul`` (``quant/cpu.py``: ATen's packed INT4 / INT8 CPU kernels for bf16
activations) against the reference (dequantize, then matmul), the formats it leaves to the reference, and a
quantized model through it."""

import copy

import pytest
import torch

from infercore.devices import resolve
from infercore.quant import GGUFWeight, IntWeight, gguf_matmul, naive, quantize, repacks, wq_matmul
from infercore.quant import cpu as QC


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


def _w(n, k, bits=4, group=128, sym=False, seed=0):
    torch.manual_seed(seed)
    return IntWeight.quantize(torch.randn(n, k) * 0.05, bits=bits, group_size=group, symmetric=sym,
                              clip_search=False)


def test_the_cpu_implementations_serve_cpu_calls():
    assert resolve("quant.wq_matmul", "cpu").name == "cpu"
    assert resolve("quant.gguf_matmul", "cpu").name == "cpu"


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("n,k,group,sym", [(96, 256, 128, False), (64, 576, 64, False), (48, 320, 32, True),
                                           (32, 512, 256, False), (80, 200, 128, False), (64, 384, None, False),
                                           (32, 256, None, True)])
def test_int4_matches_the_reference(m, n, k, group, sym):
    w = _w(n, k, 4, group, sym, seed=m)
    assert QC.cpu_kind(w) == "int4"
    x = torch.randn(m, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    for bias in (None, b):
        y = wq_matmul(x, w, bias=bias)
        ref = naive.wq_matmul_ref(x, w, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # bf16 scale and zero (the kernel's operands) against the fp32 ones of the reference
        assert _rel(y, ref) < 1e-2


@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize("n,k", [(64, 256), (40, 200)])
def test_int8_per_channel_matches_the_reference(m, n, k):
    w = _w(n, k, 8, None, True, seed=m)
    assert QC.cpu_kind(w) == "int8"
    x = torch.randn(m, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    for bias in (None, b):
        assert _rel(wq_matmul(x, w, bias=bias), naive.wq_matmul_ref(x, w, bias)) < 1e-2


@pytest.mark.parametrize("case", ["fp32 x", "fp16 x", "int8 grouped", "int8 asymmetric", "int4 N % 16",
                                  "int4 group 512"])
def test_what_the_kernels_cannot_take_runs_the_reference(case):
    dtype = {"fp32 x": torch.float32, "fp16 x": torch.float16}.get(case, torch.bfloat16)
    w = {"int8 grouped": _w(64, 256, 8, 128, True), "int8 asymmetric": _w(64, 256, 8, None, False),
         "int4 N % 16": _w(40, 256), "int4 group 512": _w(64, 1024, 4, 512)}.get(case, _w(64, 256))
    if case in ("fp32 x", "fp16 x"):
        assert QC.cpu_kind(w) == "int4"  # the weight could run; the activations' dtype sends it to the reference
    else:
        assert QC.cpu_kind(w) is None
    x = torch.randn(3, 256 if case != "int4 group 512" else 1024).to(dtype)
    assert torch.equal(wq_matmul(x, w), naive.wq_matmul_ref(x, w))


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 6, 40])
def test_gguf_q4_blocks_match_the_reference(qtype, m):
    # Q8_0: no ATen kernel (cpu_kind None); the native INT8 kernel at every row count where it runs
    torch.manual_seed(m)
    w = GGUFWeight.quantize(torch.randn(48, 320) * 0.05, qtype=qtype)
    assert QC.cpu_kind(w) == ("gguf4" if qtype != "q8_0" else None)
    x = torch.randn(m, 320).to(torch.bfloat16)
    b = torch.randn(48).to(torch.bfloat16)
    for bias in (None, b):
        assert _rel(gguf_matmul(x, w, bias=bias), naive.gguf_matmul_ref(x, w, bias)) < 1e-2


@pytest.mark.parametrize("case", ["q8_0 fp32 x", "q4_1 N % 16", "q4_1 fp32 x"])
def test_gguf_blocks_the_kernel_cannot_take_run_the_reference(case):
    torch.manual_seed(0)
    w = GGUFWeight.quantize(torch.randn(40 if "N %" in case else 64, 256), qtype=case.split()[0])
    x = torch.randn(3, 256).to(torch.float32 if "fp32" in case else torch.bfloat16)
    assert (QC.cpu_kind(w) is None) == (case != "q4_1 fp32 x")
    assert torch.equal(gguf_matmul(x, w), naive.gguf_matmul_ref(x, w))
    if case.startswith("q8_0"):
        with pytest.raises(ValueError, match="w:"):
            QC.pack_gguf4(w)


def test_the_repack_is_made_once_and_leaves_with_the_weight():
    from infercore.ops.moe import cpu_native

    w = _w(64, 256)
    # up to NATIVE_Q4_MAX_ROWS rows the native INT4 kernel's operands (where it builds), more rows ATen's
    for rows, kind in ((2, "native4" if cpu_native.q4_supported() else "int4"), (8, "int4")):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        wq_matmul(x, w)
        entry = repacks._PACKS[id(w.qweight)][1]
        first = entry[("cpu", kind)]
        wq_matmul(x, w)
        assert entry[("cpu", kind)] is first
    assert QC.NATIVE_Q4_MAX_ROWS == 4
    key = id(w.qweight)
    del w, entry, first
    assert key not in repacks._PACKS
    # INT8: the native operands are the weight's own bytes, through another tensor (held by the cache, the weight's
    # own tensor would never leave)
    w8 = IntWeight.quantize(torch.randn(64, 256), bits=8, group_size=None, symmetric=True)
    wq_matmul(torch.randn(2, 256).to(torch.bfloat16), w8)
    if cpu_native.q4_supported():
        codes = repacks._PACKS[id(w8.qweight)][1][("cpu", "native8")][0]
        assert codes is not w8.qweight and codes.data_ptr() == w8.qweight.data_ptr()
        del codes
    key = id(w8.qweight)
    del w8
    assert key not in repacks._PACKS


def test_pack_functions_name_what_they_cannot_take():
    with pytest.raises(ValueError, match="w:"):
        QC.pack_int4(_w(40, 256))
    with pytest.raises(ValueError, match="w:"):
        QC.pack_int8(_w(64, 256, 8, 128, True))


def test_a_quantized_model_runs_through_the_fast_path_as_through_the_reference(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256)).to(
        torch.bfloat16)
    x = torch.randn(4, 256).to(torch.bfloat16)
    for scheme in ("w4a16-g128", "w8a16"):
        q = quantize(copy.deepcopy(model), scheme)
        fast = q(x)
        monkeypatch.setenv("INFERCORE_BACKEND", "quant.wq_matmul:reference")
        ref = q(x)
        monkeypatch.delenv("INFERCORE_BACKEND")
        assert _rel(fast, ref) < 2e-2


def _decodable(case):
    """A weight the native kernels take, its operands and their bits (``quant.cpu.native_q4`` / ``native_q8``)."""
    torch.manual_seed(len(case))
    fmt, k = case
    if fmt.startswith("gguf"):
        w = GGUFWeight.quantize(torch.randn(80, k) * 0.05, qtype=fmt[5:])
    elif fmt == "w8a16":
        w = _w(80, k, 8, None, True)
    else:
        w = _w(80, k, 4, int(fmt[5:]))
    ops = QC.native_q4(w)
    return (w, ops, 4) if ops is not None else (w, QC.native_q8(w), 8)


_DECODABLE = [("int4g32", 320), ("int4g64", 256), ("int4g128", 384), ("int4g256", 512), ("gguf-q4_0", 96),
              ("gguf-q4_1", 160), ("w8a16", 200), ("gguf-q8_0", 96)]


@pytest.mark.parametrize("case", _DECODABLE)
def test_dequant_rows_gives_the_weight_rounded_to_bf16(case):
    from infercore.ops.moe import cpu_native

    assert cpu_native.q4_supported(), cpu_native.status()  # the CI machine has AVX512-BF16
    w, (codes, sz), bits = _decodable(case)
    n, k = w.shape
    kp = codes.shape[1] * (2 if bits == 4 else 1)
    exact = w.dequantize(torch.float32)
    out = torch.full((n, kp), float("nan"), dtype=torch.bfloat16)
    got = cpu_native.dequant_rows(codes, sz, bits, 0, n, out)[:, :k]
    if isinstance(w, GGUFWeight):  # the blocks' fp16 scales: the same fp32 values, so the same bf16 roundings
        assert torch.equal(got, exact.to(torch.bfloat16))
    else:  # the kernels' offset form of scale and zero rounds in fp32 apart: at most a bf16 rounding step away
        assert ((got.float() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()
    part = torch.zeros(7, kp, dtype=torch.bfloat16)  # a range of rows into a buffer's first rows
    assert torch.equal(cpu_native.dequant_rows(codes, sz, bits, 30, 37, part)[:, :k], got[30:37])


def test_dequant_rows_names_bad_arguments():
    from infercore.ops.moe import cpu_native

    _, (codes, sz), bits = _decodable(("int4g128", 384))
    out = torch.empty(80, 384, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="codes must be"):
        cpu_native.dequant_rows(codes.float(), sz, bits, 0, 80, out)
    with pytest.raises(ValueError, match="bits must be 4, 5 or 8"):
        cpu_native.dequant_rows(codes, sz, 2, 0, 80, out)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.dequant_rows(codes, sz[:40].contiguous(), bits, 0, 80, out)
    with pytest.raises(ValueError, match="outside the weight's 80"):
        cpu_native.dequant_rows(codes, sz, bits, 70, 81, out)
    with pytest.raises(ValueError, match="out must be"):
        cpu_native.dequant_rows(codes, sz, bits, 0, 80, out[:40])
    with pytest.raises(ValueError, match="out must be"):
        cpu_native.dequant_rows(codes, sz, bits, 0, 80, out.float())


@pytest.mark.parametrize("case", _DECODABLE)
def test_prefill_rows_multiply_the_decoded_weight(case, monkeypatch):
    """From DECODE_MIN_ROWS rows (16 for GGUF Q8_0) the weight is decoded to bf16 slice by slice (here slices of 16
    rows, the last one partial) into a dense GEMM: the reference's values (the weight rounded to bf16, a bf16
    matmul)."""
    from infercore.ops.moe import cpu_native

    w, _, _ = _decodable(case)
    n, k = w.shape
    kp = -(-k // 64) * 64
    monkeypatch.setattr(QC, "DECODE_SLICE_BYTES", 16 * 2 * kp)
    calls = []
    real = cpu_native.dequant_rows
    monkeypatch.setattr(cpu_native, "dequant_rows", lambda *a: calls.append(a[3:5]) or real(*a))
    op = gguf_matmul if isinstance(w, GGUFWeight) else wq_matmul
    ref_op = naive.gguf_matmul_ref if isinstance(w, GGUFWeight) else naive.wq_matmul_ref
    rows = QC.DECODE_MIN_ROWS_Q8_0 if case[0] == "gguf-q8_0" else QC.DECODE_MIN_ROWS
    for m in (rows - 1, rows, 70):
        calls.clear()
        x = torch.randn(m, k).to(torch.bfloat16)
        b = torch.randn(n).to(torch.bfloat16)
        y = op(x, w, bias=b)
        if m < rows:
            assert not calls
            continue
        assert calls == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80)]
        dense = (x.float() @ w.dequantize(torch.float32).float().T + b.float()).to(torch.bfloat16)
        assert _rel(y, dense) < 4e-3  # bf16 products summed in another order, the output rounded
        assert _rel(y, ref_op(x, w, b)) < 1e-2


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("m, n, k", [(1, 64, 40), (5, 300, 200), (70, 96, 576)])
def test_w8a8_matmul_on_the_cpu_is_bit_equal_to_the_reference(m, n, k, outliers):
    # the integer products through torch._int_mm (int32 sums), then the reference's scaling / outlier / bias steps
    from infercore.quant import Int8Weight, per_token_quant, w8a8_matmul

    assert resolve("quant.w8a8_matmul", "cpu").name == "cpu"
    torch.manual_seed(m + n)
    idx = torch.tensor([3, 17, 30], dtype=torch.int32) if outliers else None
    w = Int8Weight.quantize(torch.randn(n, k) * 0.05, outlier_idx=idx)
    x = torch.randn(m, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    qx, sx, xo = per_token_quant(x, outlier_idx=idx)
    for dt in (torch.bfloat16, torch.float32):
        y = w8a8_matmul(qx, sx, w, x_out=xo, bias=bias, out_dtype=dt)
        assert torch.equal(y, naive.w8a8_matmul_ref(qx, sx, w, x_out=xo, bias=bias, out_dtype=dt))
