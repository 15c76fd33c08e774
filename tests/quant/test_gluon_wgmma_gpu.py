"""MODE 8 (``quant.gluon_wgmma``: INT4 fragment words decoded into the A operand of Hopper's warpgroup MMA; sm90+)
on a CUDA GPU against dequantize() + fp32 matmul: symmetric / zero points, g128 / g256 / per channel, bf16 and
fp16 activations, M = 1..16, stages, even / uneven / clamped splits, CUDA-graph replays and bad configs. Run with
``pytest -m gpu``."""

import pytest
import torch

from infercore.quant import IntWeight
from infercore.quant import gluon_wgmma as GW
from infercore.quant import triton_frag as TF

pytestmark = pytest.mark.gpu
dev = "cuda"


def _rel(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


def _need_sm90():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("MODE 8 needs sm90+: run these tests on a Hopper GPU")


def _run(x, w, cfg):
    group = w.group_size if w.scales.shape[1] != 1 else w.padded_in_features
    words, sz = TF.pack_int4(w.codes(), w.scales, w.zeros, group)
    return GW.launch(x, words, sz, w.shape[0], cfg)


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("sym,group", [(True, 128), (False, 128), (False, 256), (True, None)])
@pytest.mark.parametrize("tile", [(1, 1), (2, 3), (3, 4), (2, 20), (4, 2)])
def test_mode8_int4(m, sym, group, tile):
    _need_sm90()
    stages, split = tile
    torch.manual_seed(m * 13 + split)
    n, k = 512, 1280  # two programs of four blocks; 10 groups: splits 3 and 4 are uneven, 20 is clamped
    w = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.05, bits=4, group_size=group, symmetric=sym)
    dtype = torch.float16 if m in (5, 9) else torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dtype)
    ref = x.float() @ w.dequantize(torch.float32).T
    for _ in range(2):  # the second call finds the split-K counters reset
        y = _run(x, w, {"MODE": 8, "STAGES": stages, "SPLIT": split})
        assert y.dtype == dtype and y.shape == (m, n)
        assert _rel(y, ref) < 8e-3


def test_mode8_graph_and_bad_configs(graph_matches_eager):
    _need_sm90()
    torch.manual_seed(2)
    n, k = 768, 4096
    w = IntWeight.quantize(torch.randn(n, k, device=dev) * 0.05, bits=4, group_size=128)
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    words, sz = TF.pack_int4(w.codes(), w.scales, w.zeros, 128)
    cfg = {"MODE": 8, "STAGES": 2, "SPLIT": 8}
    GW.launch(x, words, sz, n, cfg)

    def close(y):
        assert _rel(y, x.float() @ w.dequantize(torch.float32).T) < 8e-3

    graph_matches_eager(lambda: GW.launch(x, words, sz, n, cfg), x, rounds=3, each=close)
    for key, bad in (("STAGES", 0), ("STAGES", 9), ("SPLIT", 0), ("SPLIT", True)):
        with pytest.raises(ValueError, match=key):
            GW.launch(x, words, sz, n, {**cfg, key: bad})
    with pytest.raises(ValueError, match="shared memory"):  # 32 groups in one program
        GW.launch(x, words, sz, n, {**cfg, "STAGES": 8, "SPLIT": 1})
    w2 = IntWeight.quantize(torch.randn(192, k, device=dev) * 0.05, bits=4, group_size=128)
    words2, sz2 = TF.pack_int4(w2.codes(), w2.scales, w2.zeros, 128)
    with pytest.raises(ValueError, match="four 64-channel blocks"):
        GW.launch(x, words2, sz2, 192, cfg)
