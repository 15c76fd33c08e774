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
