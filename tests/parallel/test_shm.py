"""Shared-memory collectives of CPU ranks on one host (parallel.shm), three processes over gloo."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import _leave  # noqa: E402

WORLD = 3


def _worker(rank: int, init: str) -> None:
    from infercore.parallel.shm import shm_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        shm = shm_group(slot_bytes=4096)
        assert shm is not None and shm.world == WORLD and shm.rank == rank
        big = torch.ones(1025)
        assert not shm.fits(big) and shm.fits(big[:1024]) and not shm.fits(torch.ones(4, dtype=torch.int32))
        with pytest.raises(ValueError, match="ShmGroup.fits"):
            shm.all_reduce_(big)  # a clear error on every rank (no rank reached the exchange)
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(200):  # back to back, of changing sizes and dtypes: the two parities' slots alternate
            n = 1 + (i * 37) % 1024
            dtype = (torch.float32, torch.bfloat16)[i % 2]
            x = torch.randn(n, generator=g).to(dtype)
            parts = [torch.empty_like(x) for _ in range(WORLD)]
            dist.all_gather(parts, x)  # the reference, through gloo
            got = shm.all_gather(x)
            assert all(torch.equal(a, b) for a, b in zip(got, parts))
            want = sum(p.float() for p in parts).to(dtype)  # fp32 sums in rank order
            y = x.clone().view(1, n)
            assert shm.all_reduce_(y) is y
            assert torch.equal(y.view(-1), want), i
            if i % 50 == 0:  # every rank holds the same bits
                everyone = [None] * WORLD
                dist.all_gather_object(everyone, y.view(-1).tolist())
                assert everyone.count(everyone[0]) == WORLD
        # objects: pickles in the slots; one rank's too large for its slot sends every rank's through gloo
        assert shm.all_gather_object({"rank": rank, "x": [rank] * 10}) == [{"rank": r, "x": [r] * 10}
                                                                          for r in range(WORLD)]
        objs = shm.all_gather_object(bytes(8192) if rank == 2 else rank)
        assert objs == [0, 1, bytes(8192)]
        assert shm.all_gather_object(None if rank else "from rank 0")[0] == "from rank 0"
        shm.close()
        os.environ["INFERCORE_SHM_COLLECTIVES"] = "0" if rank == 1 else "1"  # one rank's veto holds for all
        assert shm_group() is None
    finally:
        _leave()


def test_all_reduce_and_all_gather_match_gloo(tmp_path):
    before = set(os.listdir("/dev/shm"))
    mp.spawn(_worker, args=(f"file://{tmp_path}/rdzv",), nprocs=WORLD, join=True)
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("infercore_shm_")]  # unlinked

