"""The split-K finish buffers (``quant._splitk``): shared per device, grown on demand, and never freed while a
CUDA graph captured with them could still replay."""

import torch

from infercore.quant import _splitk


def test_tagged_buffers_shared_and_grown_without_freeing(monkeypatch):
    monkeypatch.setattr(_splitk, "_TAGGED", {})
    monkeypatch.setattr(_splitk, "_RETIRED", [])
    dev = torch.device("cpu")
    ep, part = _splitk.tagged_buffers(dev, 64, 28, 1)
    assert ep.dtype == torch.int32 and part.dtype == torch.int64
    assert ep.numel() >= 64 and part.numel() >= 64 * 28 * 64 and not ep.any() and not part.any()
    ep2, part2 = _splitk.tagged_buffers(dev, 96, 28, 1)  # another shape, same split and rows: shared
    assert ep2 is ep and part2 is part
    assert _splitk.tagged_buffers(dev, 64, 16, 1)[0] is not ep  # another split: its own pair
    ep3, part3 = _splitk.tagged_buffers(dev, 2004, 28, 1)  # more blocks than the pair holds: a new pair
    assert ep3.numel() >= 2004 and part3.numel() >= 2004 * 28 * 64 and not ep3.any()
    assert any(t is ep for t in _splitk._RETIRED) and any(t is part for t in _splitk._RETIRED)


def test_arrival_counters_grown_without_freeing(monkeypatch):
    monkeypatch.setattr(_splitk, "_COUNTERS", {})
    monkeypatch.setattr(_splitk, "_RETIRED", [])
    dev = torch.device("cpu")
    c = _splitk.arrival_counters(dev, 10)
    assert c.numel() >= 1 << 16 and not c.any()
    assert _splitk.arrival_counters(dev, 1000) is c
    big = _splitk.arrival_counters(dev, (1 << 16) + 1)
    assert big is not c and big.numel() > 1 << 16
    assert any(t is c for t in _splitk._RETIRED)
