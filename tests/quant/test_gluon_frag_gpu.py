"""MODE 7 (``quant.gluon_frag``: MODE 6's INT4 / FP8 fragments streamed by TMA; sm90+) on a CUDA GPU
against dequantize() + fp32 matmul: FP8 with per-channel scales, INT4 symmetric / zero points, g128 / g256 /
per channel, bf16 and fp16 activations, M = 1..16 (one and two B fragments), warps per program, stages,
split-K (even and uneven; the tagged, ready-flag and counter finishes), the fused gated epilogue, CUDA-graph
replays, bad configs, and the dispatcher's MODE 7 entries. Run with ``pytest -m gpu``."""

import pytest
import torch

from infercore.quant import FP8Weight, IntWeight
from infercore.quant import triton_frag as TF
from infercore.quant import triton_wo as TW

pytestmark = pytest.mark.gpu
dev = "cuda"


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


def _need_sm90():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("MODE 7 needs sm90+: run these tests on a Hopper GPU")


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("sym,group", [(True, 128), (False, 128), (False, 256), (True, None)])
@pytest.mark.parametrize("tile", [(1, 2, 1), (1, 2, 3), (2, 3, 2), (4, 1, 4), (8, 2, 1), (1, 4, 5)])
def test_mode7_int4(m, sym, group, tile):
    _need_sm90()
    w_, stages, split = tile
    torch.manual_seed(m)
    w = IntWeight.quantize(torch.randn(192, 1024, device=dev) * 0.05, bits=4, group_size=group, symmetric=sym)
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    y = TW.wq_matmul_triton(x, w, config={"MODE": 7, "W": w_, "STAGES": stages, "SPLIT": split})
    assert y.dtype == torch.bfloat16 and y.shape == (m, 192)
    assert _rel(y, x.float() @ w.dequantize(torch.float32).T) < 8e-3


@pytest.mark.parametrize("m", [1, 12])
def test_mode7_int4_fp16(m):
    _need_sm90()
    w = IntWeight.quantize(torch.randn(128, 512, device=dev) * 0.05, bits=4, group_size=128)
    x = torch.randn(m, 512, device=dev, dtype=torch.float16)
    y = TW.wq_matmul_triton(x, w, config={"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 2})
    assert y.dtype == torch.float16
    assert _rel(y, x.float() @ w.dequantize(torch.float32).T) < 8e-3


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("m,split,w_", [(1, 1, 1), (1, 3, 1), (4, 2, 2), (16, 1, 4)])
def test_mode7_fused_gated_act(act, m, split, w_):
    _need_sm90()
    torch.manual_seed(0)
    d, k = 128, 512
    w = IntWeight.quantize(torch.randn(2 * d, k, device=dev) * 0.05, bits=4, group_size=128)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    y = TW.wq_matmul_triton(x, w, config={"MODE": 7, "W": w_, "STAGES": 2, "SPLIT": split}, act=act)
    h = (x.float() @ w.dequantize(torch.float32).T).to(torch.bfloat16).float()
    fn = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
          "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[act]
    assert y.shape == (m, d)
    assert _rel(y, fn(h[:, :d]) * h[:, d:]) < 1e-2


def test_mode7_graph_replay_and_bad_config(graph_matches_eager):
    _need_sm90()
    n, k = 256, 512
    w = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.05, bits=4, group_size=128)
    x = torch.randn(2, k, device=dev, dtype=torch.bfloat16)
    cfg = {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 2}
    TW.wq_matmul_triton(x, w, config=cfg)  # eager first call makes the repack

    def close(y):
        assert _rel(y, x.float() @ w.dequantize(torch.float32).T) < 8e-3

    graph_matches_eager(lambda: TW.wq_matmul_triton(x, w, config=cfg), x, rounds=3, each=close)
    for key, bad in (("W", 3), ("STAGES", 0), ("STAGES", 9), ("SPLIT", 0), ("FLAGS", 1)):
        with pytest.raises(ValueError, match=key):
            TW.wq_matmul_triton(x, w, config={**cfg, key: bad})
    wf = FP8Weight.quantize(torch.randn(n, k, device=dev) * 0.05, block_size=128)
    with pytest.raises(ValueError, match="MODE 7"):  # 128x128 block scales: per-channel only
        TW.fp8_wo_matmul_triton(x, wf, config=cfg)


@pytest.mark.parametrize("act", [None, "silu"])
def test_mode7_tagged_finish(act):
    """The tagged split-K finish (INT4, one warp, M <= 2) against the counter finish (TAGGED False) and the
    reference, over alternating weights, row counts and splits (each launch's epoch one past the last), and
    in CUDA-graph replays."""
    from infercore.quant._splitk import tagged_buffers

    _need_sm90()
    torch.manual_seed(1)
    n, k = 256, 1024
    ws = [IntWeight.quantize(torch.randn(n, k, device=dev) * 0.05, bits=4, group_size=128) for _ in range(2)]
    d = n // 2 if act else n

    def ref(x, w):
        h = x.float() @ w.dequantize(torch.float32).T
        if act is None:
            return h
        h = h.to(torch.bfloat16).float()
        return torch.nn.functional.silu(h[:, :d]) * h[:, d:]

    calls = {}
    for rep in range(3):
        for i, w in enumerate(ws):
            for m in (1, 2):
                for split in (2, 4, 8):
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    cfg = {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": split}
                    y = TW.wq_matmul_triton(x, w, config=cfg, act=act)
                    y0 = TW.wq_matmul_triton(x, w, config={**cfg, "TAGGED": False}, act=act)
                    assert y.shape == (m, d)
                    assert _rel(y, ref(x, w)) < 1e-2, (rep, i, m, split)
                    assert _rel(y, y0) < 1e-3, (rep, i, m, split)
                    calls[(split, m)] = calls.get((split, m), 0) + 1
    for (split, m), count in calls.items():  # every launch advanced each block's epoch (shared with other shapes)
        ep, _ = tagged_buffers(torch.device(dev, torch.cuda.current_device()), n // 64, split, m)
        assert all(int(e) >= count for e in ep[: n // 64])
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    cfg = {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = TW.wq_matmul_triton(x, ws[0], config=cfg, act=act)
        y2 = TW.wq_matmul_triton(x, ws[1], config=cfg, act=act)
    for _ in range(4):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert _rel(y, ref(x, ws[0])) < 1e-2 and _rel(y2, ref(x, ws[1])) < 1e-2
    with pytest.raises(ValueError, match="TAGGED"):
        TW.wq_matmul_triton(x, ws[0], config={**cfg, "TAGGED": 1})


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_mode7_ready_flags(kind):
    """The ready-flag split-K finish (3-16 rows, FP8, several warps; <= 8 splits) against the counter finish (FLAGS
    False) and the reference, over alternating weights, row counts, warps and splits (the flags cleared for the next
    launch), and in CUDA-graph replays."""
    _need_sm90()
    torch.manual_seed(4)
    n, k = 256, 1024
    if kind == "fp8":
        ws = [FP8Weight.quantize(torch.randn(n, k, device=dev) * 0.05) for _ in range(2)]
        fn = TW.fp8_wo_matmul_triton
    else:
        ws = [IntWeight.quantize(torch.randn(n, k, device=dev) * 0.05, bits=4, group_size=128) for _ in range(2)]
        fn = TW.wq_matmul_triton
    for rep in range(2):
        for i, w in enumerate(ws):
            for m, w_ in ((3, 1), (8, 1), (16, 1), (2, 2), (12, 4)):
                for split in (2, 3, 8):
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    cfg = {"MODE": 7, "W": w_, "STAGES": 2, "SPLIT": split}
                    y = fn(x, w, config=cfg)
                    y0 = fn(x, w, config={**cfg, "FLAGS": False})
                    assert _rel(y, x.float() @ w.dequantize(torch.float32).T) < 8e-3, (rep, i, m, split)
                    assert _rel(y, y0) < 1e-3, (rep, i, m, split)
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    cfg = {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4}
    fn(x, ws[0], config=cfg)
    fn(x, ws[1], config=cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn(x, ws[0], config=cfg)
        y2 = fn(x, ws[1], config=cfg)
    for _ in range(4):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert _rel(y, x.float() @ ws[0].dequantize(torch.float32).T) < 8e-3
        assert _rel(y2, x.float() @ ws[1].dequantize(torch.float32).T) < 8e-3


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [(1, 2, 1), (1, 2, 3), (2, 3, 2), (4, 1, 4), (8, 2, 1)])
def test_mode7_fp8(m, dtype, tile):
    """FP8 (per-channel scales, the emulated decode) through MODE 7."""
    _need_sm90()
    w_, stages, split = tile
    torch.manual_seed(m)
    w = FP8Weight.quantize(torch.randn(96, 1024, device=dev) * 0.05)
    x = torch.randn(m, 1024, device=dev, dtype=dtype)
    y = TW.fp8_wo_matmul_triton(x, w, config={"MODE": 7, "W": w_, "STAGES": stages, "SPLIT": split})
    assert y.dtype == dtype and y.shape == (m, 96)
    assert _rel(y, x.float() @ w.dequantize(torch.float32).T) < 8e-3


@pytest.mark.parametrize("m,split", [(1, 1), (4, 3), (16, 2)])
def test_mode7_fp8_fused_gated_act(m, split):
    _need_sm90()
    torch.manual_seed(0)
    d, k = 64, 512
    w = FP8Weight.quantize(torch.randn(2 * d, k, device=dev) * 0.05)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    y = TW.fp8_wo_matmul_triton(x, w, config={"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": split}, act="silu")
    h = (x.float() @ w.dequantize(torch.float32).T).to(torch.bfloat16).float()
    assert y.shape == (m, d)
    assert _rel(y, torch.nn.functional.silu(h[:, :d]) * h[:, d:]) < 1e-2


@pytest.mark.parametrize("n, k", [(14336, 4096), (4096, 14336), (6144, 4096)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8, 16])
def test_mode7_dispatch(monkeypatch, n, k, m, graph_matches_eager):
    """The call without a config takes MODE7_TUNED's entry where it has one (14336x4096 and down at every
    M <= 8; qkv at M <= 8) where MODE 9 (``cuda_mma``, ``TW.mode9_rows``) does not take it, eagerly and inside a
    CUDA graph,
    and matches dequantize() + fp32 matmul."""
    _need_sm90()
    from infercore.quant import gluon_frag as GF

    seen = []
    real = GF.launch
    monkeypatch.setattr(GF, "launch", lambda *a, **kw: seen.append(a[4]) or real(*a, **kw))
    torch.manual_seed(0)
    w = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.02, bits=4, group_size=128)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    y = TW.wq_matmul_triton(x, w)
    assert _rel(y, x.float() @ w.dequantize(torch.float32).T) < 8e-3
    entry = TW._mode6_entry("int4", n, k, m, 132, True)
    lo, hi = TW.mode9_rows("int4", n * k // 2)
    mode9 = lo <= m <= hi
    assert mode9 == TW.mode9_default(x, w)
    assert bool(seen) == (entry is not None and not mode9) == ((n != 6144 or m <= 8) and not mode9)
    if seen:
        assert seen[0] == entry
    assert torch.equal(graph_matches_eager(lambda: TW.wq_matmul_triton(x, w)), y)
    assert TF.gluon_available()
