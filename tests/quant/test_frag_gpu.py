"""MODE 6 (weights as MMA fragments, ``quant.triton_frag``) on a CUDA GPU against dequantize() + fp32
matmul: INT4 (symmetric / zero points, g128 / per channel), FP8 (per channel / 128x128 blocks), bf16 and
fp16 activations, M = 1..16 (one and two B fragments), split-K, the fused gated epilogue, and CUDA-graph
replays. Run with ``pytest -m gpu``."""

import pytest
import torch

from infercore.quant import FP8Weight, IntWeight
from infercore.quant import triton_wo as TW
from infercore.quant.triton_frag import int4_ok

pytestmark = pytest.mark.gpu
dev = "cuda"


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("sym,group", [(True, 128), (False, 128), (False, 256), (True, None)])
@pytest.mark.parametrize("tile", [(4, 2, 1, 1), (4, 4, 2, 1), (8, 1, 4, 2), (8, 2, 1, 2), (2, 4, 3, 2), (4, 4, 1, 3),
                                  (2, 4, 2, 3)])
def test_mode6_int4(m, sym, group, tile):
    warps, reps, split, depth = tile
    cfg = {"MODE": 6, "WARPS": warps, "REPS": reps, "SPLIT": split, "DEPTH": depth}
    assert _int4_rel_err(m, 192, sym, group, cfg) < 8e-3


def _int4_rel_err(m: int, n: int, sym: bool, group, cfg: dict) -> float:
    """MODE 6 with ``cfg`` on a random INT4 ``[n, 1024]`` weight and ``m`` bf16 rows: its relative error
    against dequantize() + an fp32 matmul (the output's dtype and shape checked on the way)."""
    torch.manual_seed(m)
    w = IntWeight.quantize(torch.randn(n, 1024, device=dev) * 0.05, bits=4, group_size=group, symmetric=sym)
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    y = TW.wq_matmul_triton(x, w, config=cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    return _rel(y, x.float() @ w.dequantize(torch.float32).T)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split,depth", [(1, 1), (4, 2), (3, 3)])
@pytest.mark.parametrize("wn", [0, 1])  # the warps split K / N
def test_mode6_fp8(m, block, dtype, split, depth, wn):
    torch.manual_seed(m)
    n, k = 256, 1024
    w = FP8Weight.quantize(torch.randn(n, k, device=dev) * 0.05, block_size=block)
    x = torch.randn(m, k, device=dev, dtype=dtype)
    cfg = {"MODE": 6, "WN": wn, "WARPS": 4, "REPS": 4, "SPLIT": split, "DEPTH": depth}
    y = TW.fp8_wo_matmul_triton(x, w, config=cfg)
    ref = x.float() @ w.dequantize(torch.float32).T
    assert _rel(y, ref) < 8e-3


@pytest.mark.parametrize("m", [1, 12])
def test_mode6_int4_fp16(m):
    n, k = 128, 512
    w = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.05, bits=4, group_size=128)
    x = torch.randn(m, k, device=dev, dtype=torch.float16)
    y = TW.wq_matmul_triton(x, w, config={"MODE": 6, "WARPS": 4, "REPS": 2, "SPLIT": 2})
    assert _rel(y, x.float() @ w.dequantize(torch.float32).T) < 8e-3


@pytest.mark.parametrize("kind", ["int4", "fp8"])
@pytest.mark.parametrize("m,split", [(1, 1), (2, 4), (16, 2)])
@pytest.mark.parametrize("wn", [0, 1])
def test_mode6_fused_gated_act(kind, m, split, wn):
    torch.manual_seed(0)
    d, k = 128, 512
    wf = torch.randn(2 * d, k, device=dev) * 0.05
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    cfg = {"MODE": 6, "WN": wn, "WARPS": 4, "REPS": 2, "SPLIT": split, "DEPTH": {1: 3, 2: 2, 16: 1}[m]}
    if m == 1:
        cfg["MAXNREG"] = 128  # as the tuned entry of the merged gate_up at M=1
    if kind == "int4":
        w = IntWeight.quantize(wf, bits=4, group_size=128)
        y = TW.wq_matmul_triton(x, w, config=cfg, act="silu")
    else:
        w = FP8Weight.quantize(wf)
        y = TW.fp8_wo_matmul_triton(x, w, config=cfg, act="silu")
    h = (x.float() @ w.dequantize(torch.float32).T).to(torch.bfloat16).float()
    ref = torch.nn.functional.silu(h[:, :d]) * h[:, d:]
    assert y.shape == (m, d)
    assert _rel(y, ref) < 1e-2


@pytest.mark.parametrize("m", [1, 3, 9, 16])
@pytest.mark.parametrize("sym,group", [(True, 128), (False, 128), (True, None)])
@pytest.mark.parametrize("tile", [(4, 4, 1, 1), (4, 4, 3, 2), (2, 2, 8, 1), (8, 1, 2, 2), (1, 4, 5, 1), (4, 4, 3, 3),
                                  (2, 2, 8, 3), (8, 4, 1, 3)])
def test_mode6_warps_split_n_int4(m, sym, group, tile):
    """WN: each warp owns a channel block (no cross-warp sum), split-K through the workspace."""
    warps, reps, split, depth = tile
    cfg = {"MODE": 6, "WN": 1, "WARPS": warps, "REPS": reps, "SPLIT": split, "DEPTH": depth}
    if depth == 3 and warps == 4:  # as the tuned M=1 entries: ptxas spills past the cap
        cfg["MAXNREG"] = 128
    assert _int4_rel_err(m, 512, sym, group, cfg) < 8e-3


@pytest.mark.parametrize("wn", [0, 1])
def test_mode6_graph_replay_and_bad_config(wn, graph_matches_eager):
    n, k = 256, 512
    w = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.05, bits=4, group_size=128)
    x = torch.randn(2, k, device=dev, dtype=torch.bfloat16)
    cfg = {"MODE": 6, "WN": wn, "WARPS": 4, "REPS": 2, "SPLIT": 2}
    y0 = TW.wq_matmul_triton(x, w, config=cfg)  # eager first call makes the repack
    y = graph_matches_eager(lambda: TW.wq_matmul_triton(x, w, config=cfg), x, rounds=3)
    assert y0.shape == y.shape
    with pytest.raises(ValueError, match="WARPS"):
        TW.wq_matmul_triton(x, w, config={**cfg, "WARPS": 3})
    with pytest.raises(ValueError, match="DEPTH"):
        TW.wq_matmul_triton(x, w, config={**cfg, "DEPTH": 4})
    with pytest.raises(ValueError, match="MAXNREG"):
        TW.wq_matmul_triton(x, w, config={**cfg, "MAXNREG": 8})
    if wn:  # each warp owns a channel block: the blocks must split evenly among the warps
        w3 = IntWeight.quantize(torch.randn(192, k, device=dev) * 0.05, bits=4, group_size=128)  # 3 blocks of 64
        with pytest.raises(ValueError, match="multiple of WARPS"):
            TW.wq_matmul_triton(x, w3, config=cfg)
        with pytest.raises(ValueError, match="REPS"):
            TW.wq_matmul_triton(x, w, config={**cfg, "REPS": 8})
    w_odd = IntWeight.quantize(torch.randn(96, k, device=dev), bits=4, group_size=128)
    assert not int4_ok(x, w_odd, None)
    with pytest.raises(ValueError, match="MODE 6"):
        TW.wq_matmul_triton(x, w_odd, config=cfg)


@pytest.mark.parametrize("n,k,mode6", [(8192, 6144, True), (4096, 1024, False), (8192, 1024, False)])
def test_untuned_int4_m1_default(monkeypatch, n, k, mode6, graph_matches_eager):
    """A shape outside the tuned tables at M=1: from MODE6_MIN_N channels and MODE6_MIN_BYTES of codes the
    call without a config runs MODE 6 (``m1_config``), below either MODE 4's packed tile; both against
    dequantize() + fp32 matmul, eager and inside a CUDA graph (its repack made by the eager call)."""
    from infercore.quant import triton_frag as TF

    seen = []
    real = TF.launch
    monkeypatch.setattr(TF, "launch", lambda *a, **kw: seen.append(a[4]) or real(*a, **kw))
    torch.manual_seed(0)
    w = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.05, bits=4, group_size=128)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ w.dequantize(torch.float32).T
    y = TW.wq_matmul_triton(x, w)
    assert _rel(y, ref) < 8e-3
    assert bool(seen) == mode6
    if mode6:
        assert seen[0]["DEPTH"] == 3 and seen[0]["WN"] == 1 and seen[0]["MAXNREG"] == 128
    assert torch.equal(graph_matches_eager(lambda: TW.wq_matmul_triton(x, w)), y)
