"""MODE 9 (``quant.cuda_mma``, the CUDA stream-K weight-only kernel; sm80+) on a CUDA GPU against dequantize() +
fp32 matmul: INT4 (zero points / symmetric, g128 / g256 / per channel) and FP8 (per-channel / 128 blocks), bf16 and
fp16 activations, 1-16 rows, padded channels, ring depths, CTAs per SM and K parts per unit, repeated launches (the
partial-sum sentinels must be back after each), CUDA-graph replay, and the dispatcher's choice. Run with
``pytest -m gpu``."""

import pytest
import torch

from infercore.quant import FP8Weight, IntWeight
from infercore.quant import cuda_mma as CM
from infercore.quant import triton_wo as TW

pytestmark = pytest.mark.gpu
dev = "cuda"


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


def _has_mode9_pack(q) -> bool:
    """Whether the dispatcher made a MODE 9 repack of ``q`` (cache keys ``("mode9", warps, mt)``)."""
    return any(key[0] == "mode9" for key in TW.TF._PACKS.get(id(q.qweight), (None, {}))[1])


def _sentinels_back():
    ws = CM._BUFFERS[torch.cuda.current_device()].view(torch.int32)
    assert bool((ws == -1).all()), "partial-sum slots left written"


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 13, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,sym", [(600, 384, 128, False), (512, 640, None, True), (4096, 1024, 256, False),
                                           (14336, 4096, 128, False)])
@pytest.mark.parametrize("launch", [(4, 1, 1), (6, 1, 1), (3, 2, 1), (6, 1, 2), (4, 2, 2)])
def test_mode9_int4(m, dtype, n, k, group, sym, launch):
    torch.manual_seed(m + n)
    q = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.02, bits=4, group_size=group, symmetric=sym,
                           clip_search=False)
    words, sw = CM.repack_int4(q)
    x = torch.randn(m, k, device=dev).to(dtype)
    ref = x.float() @ q.dequantize(torch.float32).T
    y = CM.matmul(x, "int4", words, sw, n, k, stages=launch[0], ctas=launch[1], ksplit=launch[2])
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel(y, ref) < 5e-3
    assert torch.equal(CM.matmul(x, "int4", words, sw, n, k, stages=launch[0], ctas=launch[1], ksplit=launch[2]), y)
    torch.cuda.synchronize()
    _sentinels_back()


@pytest.mark.parametrize("m", [1, 4, 9, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,block", [(328, 256, None), (640, 512, 128), (4096, 14336, None)])
@pytest.mark.parametrize("ksplit", [1, 2])
def test_mode9_fp8(m, dtype, n, k, block, ksplit):
    torch.manual_seed(m + n)
    q = FP8Weight.quantize(torch.randn(n, k, device=dev) * 0.02, **({"block_size": block} if block else {}))
    words, s = CM.repack_fp8(q)
    x = torch.randn(m, k, device=dev).to(dtype)
    ref = x.float() @ q.dequantize(torch.float32).T
    y = CM.matmul(x, "fp8", words, s, n, k, ksplit=ksplit)
    assert _rel(y, ref) < 5e-3
    torch.cuda.synchronize()
    _sentinels_back()


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("kind,warps,mt", [("int4", 7, 1), ("int4", 4, 2), ("int4", 8, 1), ("fp8", 7, 1)])
@pytest.mark.parametrize("n,k", [(600, 384), (14336, 4096)])
@pytest.mark.parametrize("whole_blocks", [False, True])
@pytest.mark.parametrize("ksplit", [1, 2])
def test_mode9_layouts(m, kind, warps, mt, n, k, whole_blocks, ksplit):
    """Other unit layouts (warps x m16 tiles per warp), streamed by the default one-wave grid or with one CTA per
    channel block (``grid`` = blocks: no partial exchange at all)."""
    torch.manual_seed(m + n + warps)
    w = torch.randn(n, k, device=dev) * 0.02
    if kind == "int4":
        q = IntWeight.quantize(w, bits=4, group_size=128, clip_search=False)
        words, sc = CM.repack_int4(q, warps, mt)
    else:
        q = FP8Weight.quantize(w, block_size=128)
        words, sc = CM.repack_fp8(q, warps)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ q.dequantize(torch.float32).T
    nb = -(-n // CM.block_n(kind, warps, mt))
    grid = min(nb, torch.cuda.get_device_properties(0).multi_processor_count) if whole_blocks else None
    kw = {"warps": warps, "mt": mt, "grid": grid, "ksplit": ksplit}
    y = CM.matmul(x, kind, words, sc, n, k, **kw)
    assert _rel(y, ref) < 5e-3
    assert torch.equal(CM.matmul(x, kind, words, sc, n, k, **kw), y)
    torch.cuda.synchronize()
    _sentinels_back()


def test_dispatcher_runs_a_mode9_layout_from_its_table(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("MODE 9's default dispatch is for sm90+: run on a Hopper GPU")
    n, k = 14336, 4096
    monkeypatch.setitem(TW.MODE9_LAYOUTS, "int4", ((n, k, 7, 1, True),))
    monkeypatch.setitem(TW.MODE9_LAYOUTS, "fp8", ((n, k, 7, 1, True),))
    for q in (IntWeight.quantize(torch.randn(n, k, device=dev) * 0.02, bits=4, group_size=128),
              FP8Weight.quantize(torch.randn(n, k, device=dev) * 0.02)):
        ref_w = q.dequantize(torch.float32)
        fn = TW.wq_matmul_triton if isinstance(q, IntWeight) else TW.fp8_wo_matmul_triton
        for m in (4, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            assert _rel(fn(x, q), x.float() @ ref_w.T) < 5e-3
        assert set(TW.TF._PACKS[id(q.qweight)][1]) >= {("mode9", 7, 1)}
        assert ("mode9", None, None) not in TW.TF._PACKS[id(q.qweight)][1]
    torch.cuda.synchronize()
    _sentinels_back()


def test_mode9_grid_argument():
    q = IntWeight.quantize(torch.randn(512, 256, device=dev), bits=4, group_size=128, clip_search=False)
    x = torch.randn(2, 256, device=dev, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grid:"):
        CM.matmul(x, "int4", *CM.repack_int4(q), 512, 256, grid=5)  # 2 blocks x 2 units: at most 4 CTAs
    with pytest.raises(ValueError, match="grid:"):
        CM.matmul(x, "int4", *CM.repack_int4(q), 512, 256, grid=0)


def test_mode9_graph_replay():
    n, k = 6144, 4096
    qs = [IntWeight.quantize(torch.randn(n, k, device=dev) * 0.02, bits=4, group_size=128, clip_search=False)
          for _ in range(2)]
    packs = [CM.repack_int4(q) for q in qs]
    x = torch.randn(12, k, device=dev, dtype=torch.bfloat16)
    refs = [x.float() @ q.dequantize(torch.float32).T for q in qs]
    CM.matmul(x, "int4", *packs[0], n, k)
    ys = []
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(6):
            ys.append(CM.matmul(x, "int4", *packs[i % 2], n, k))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    for i, y in enumerate(ys):
        assert _rel(y, refs[i % 2]) < 5e-3
    _sentinels_back()


def test_dispatcher_takes_mode9_for_int4_by_its_rules():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("MODE 9's default dispatch is for sm90+: run on a Hopper GPU")
    n, k = 14336, 4096
    q = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.02, bits=4, group_size=128)
    ref_w = q.dequantize(torch.float32)
    assert TW.mode9_rows("int4", n * k // 2) == (3, 16)
    for m in (3, 9, 16):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        y = TW.wq_matmul_triton(x, q)
        assert _rel(y, x.float() @ ref_w.T) < 5e-3
        assert _has_mode9_pack(q)
    # fused gate (the merged gate_up) and bias go through the unfused epilogue
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = TW.wq_matmul_triton(x, q, b, act="silu")
    full = x.float() @ ref_w.T + b.float()
    want = torch.nn.functional.silu(full[:, : n // 2]) * full[:, n // 2:]
    assert _rel(y, want) < 1e-2
    # outside the rules (1-2 rows; the merged gate_up 28672x4096 below 8 rows) the Triton kernels keep the call: no
    # MODE 9 repack
    q2 = IntWeight.quantize(torch.randn(4096, 4096, device=dev) * 0.02, bits=4, group_size=128)
    assert TW.mode9_rows("int4", 4096 * 2048) == (3, 16)
    assert TW.mode9_rows("int4", 28672 * 2048) == (8, 16)
    for m in (1, 2):
        TW.wq_matmul_triton(torch.randn(m, 4096, device=dev, dtype=torch.bfloat16), q2)
    assert not _has_mode9_pack(q2)


def test_dispatcher_takes_mode9_for_large_fp8_from_its_row_threshold():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("MODE 9's default dispatch is for sm90+: run on a Hopper GPU")
    n, k = 14336, 4096
    q = FP8Weight.quantize(torch.randn(n, k, device=dev) * 0.02)
    ref_w = q.dequantize(torch.float32)
    lo, hi = TW.mode9_rows("fp8", n * k)
    assert 1 < lo <= hi == 16
    for m in sorted({1, lo - 1, lo, 16} - {0}):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        y = TW.fp8_wo_matmul_triton(x, q)
        assert _rel(y, x.float() @ ref_w.T) < 5e-3
        assert TW.mode9_default(x, q) == (lo <= m <= hi)
    assert _has_mode9_pack(q)
    x = torch.randn(lo, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = TW.fp8_wo_matmul_triton(x, q, b, act="silu")
    full = x.float() @ ref_w.T + b.float()
    want = torch.nn.functional.silu(full[:, : n // 2]) * full[:, n // 2:]
    assert _rel(y, want) < 1e-2


def test_mode9_forced_config_and_errors():
    q = IntWeight.quantize(torch.randn(512, 256, device=dev) * 0.02, bits=4, group_size=128)
    x = torch.randn(3, 256, device=dev, dtype=torch.float16)
    y = TW.wq_matmul_triton(x, q, config={"MODE": 9})
    assert _rel(y, x.float() @ q.dequantize(torch.float32).T) < 5e-3
    with pytest.raises(ValueError, match="config: MODE 9"):
        TW.wq_matmul_triton(x.float(), q, config={"MODE": 9})
    q64 = IntWeight.quantize(torch.randn(512, 256, device=dev) * 0.02, bits=4, group_size=64)
    with pytest.raises(ValueError, match="config: MODE 9"):
        TW.wq_matmul_triton(x, q64, config={"MODE": 9})
    with pytest.raises(ValueError, match="x:"):
        CM.matmul(torch.randn(2, 128, device=dev, dtype=torch.bfloat16), "int4", *CM.repack_int4(q), 512, 256)


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_mode9_programmatic_launch_chain(kind):
    """Each call reads the previous call's output: with programmatic dependent launch the next kernel starts
    early and must still wait for it (eager and in a CUDA graph), and leave every partial-sum slot clean."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("programmatic dependent launch needs sm90+: run on a Hopper GPU")
    torch.manual_seed(5)
    k = 4096
    w = torch.randn(k, k, device=dev) * 0.02
    q = (IntWeight.quantize(w, bits=4, group_size=128, clip_search=False) if kind == "int4"
         else FP8Weight.quantize(w))
    pack = CM.repack_int4(q) if kind == "int4" else CM.repack_fp8(q)
    x0 = torch.randn(16, k, device=dev).to(torch.bfloat16)
    for m in (4, 16):
        def chain(pdl, x=x0[:m]):
            for _ in range(12):
                x = CM.matmul(x, kind, *pack, k, k, pdl=pdl)
            return x
        want = chain(False)
        assert torch.equal(chain(True), want)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(True)
        for _ in range(3):
            out.zero_()
            g.replay()
            assert torch.equal(out, want)
    torch.cuda.synchronize()
    _sentinels_back()
