"""Adaptive parallelism (gloo, two CPU processes): a group that switches between its tensor- and data-parallel
engines with the load, mid-request, gives every request the tokens of one unsharded engine."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import _leave  # noqa: E402

WORLD = 2


def test_load_policy():
    from infercore.parallel import LoadPolicy

    p = LoadPolicy(high_at=4, low_at=1, min_steps=3)
    assert (p.low, p.high) == ("tp", "dp")
    assert p.choose("tp", 9, 2) == "tp"  # too soon after the last switch
    assert p.choose("tp", 4, 3) == "dp" and p.choose("tp", 3, 30) == "tp"
    assert p.choose("dp", 2, 30) == "dp" and p.choose("dp", 1, 3) == "tp"
    rev = LoadPolicy(high_at=4, low_at=1, min_steps=0, low="dp", high="tp")
    assert rev.choose("dp", 4, 0) == "tp" and rev.choose("tp", 1, 0) == "dp"
    fixed = LoadPolicy(low="dp", high="dp")
    assert fixed.choose("tp", 1, 0) == fixed.choose("dp", 100, 100) == "dp"
    with pytest.raises(ValueError, match="low_at"):
        LoadPolicy(high_at=2, low_at=2).validate()
    with pytest.raises(ValueError, match="min_steps"):
        LoadPolicy(min_steps=-1).validate()
    with pytest.raises(ValueError, match="LoadPolicy.high"):
        LoadPolicy(high="pp").validate()
    # from measured rates: the faster layout at the fewest requests is `low`, at the most `high`; the switch where
    # `high` stays ahead
    rates = {1: {"tp": 40, "dp": 30}, 2: {"tp": 50, "dp": 55}, 4: {"tp": 90, "dp": 80}, 8: {"tp": 100, "dp": 150},
             16: {"tp": 150, "dp": 290}}
    p = LoadPolicy.from_rates(rates, min_steps=5)
    assert (p.low, p.high, p.high_at, p.low_at, p.min_steps) == ("tp", "dp", 8, 4, 5)
    p = LoadPolicy.from_rates({1: {"tp": 30, "dp": 40}, 16: {"tp": 200, "dp": 180}})
    assert (p.low, p.high, p.high_at, p.low_at) == ("dp", "tp", 16, 1)
    p = LoadPolicy.from_rates({1: {"tp": 30, "dp": 40}, 16: {"tp": 200, "dp": 280}})
    assert p.low == p.high == "dp"
    with pytest.raises(ValueError, match="two or more"):
        LoadPolicy.from_rates({1: {"tp": 1, "dp": 2}})


def _worker(rank: int, init: str) -> None:
    from engine_helpers import ours_from_hf, random_prompts, tiny_hf

    from infercore import Engine, SamplingParams
    from infercore.parallel import AdaptiveEngine, LoadPolicy, build_adaptive

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        hf = tiny_hf("llama", num_key_value_heads=2)
        kw = dict(page_size=4, num_pages=96, max_num_batched_tokens=32)
        eng = build_adaptive(ours_from_hf(hf), tp_engine_kwargs=kw, dp_engine_kwargs=kw,
                             policy=LoadPolicy(high_at=3, low_at=1, min_steps=2))
        with pytest.raises(ValueError, match="not sharded"):
            AdaptiveEngine(eng.dp, eng.dp)
        with pytest.raises(ValueError, match="whole replica"):
            AdaptiveEngine(eng.tp, eng.tp)
        other = Engine(ours_from_hf(tiny_hf("llama", num_key_value_heads=2, intermediate_size=32)), num_pages=8)
        with pytest.raises(ValueError, match="one model"):
            AdaptiveEngine(other, eng.tp)
        if rank != 0:
            with pytest.raises(RuntimeError, match="follows"):
                eng.add_request([1, 2, 3])
            assert eng.follow() > 0  # every step rank 0 runs, until it closes
            return
        with pytest.raises(RuntimeError, match="rank 0 drives"):
            eng.follow()
        prompts = random_prompts(7, seed=5)
        greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        params = [greedy, SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=12, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True, logprobs=2),
                  greedy, greedy, SamplingParams(temperature=0.7, seed=1, max_tokens=10, ignore_eos=True)]
        final, modes = {}, []

        def step():
            for out in eng.step():
                if out.finished:
                    assert out.request_id not in final
                    final[out.request_id] = out
            modes.append(eng.mode)

        ids = [eng.add_request(prompts[0], params[0])]
        for _ in range(3):
            step()
        assert modes == ["tp"] * 3  # one request: tensor parallel
        ids += [eng.add_request(p, sp) for p, sp in zip(prompts[1:5], params[1:5])]
        step()
        assert eng.mode == "dp" and eng.switches[-1]["requests"] == 1  # the running one moved
        # rank 0's DP engine holds requests; one is aborted in DP, one more arrives in DP
        assert eng.dp.has_unfinished()
        eng.abort(ids[4])
        ids.append(eng.add_request(prompts[5], params[5]))
        with pytest.raises(ValueError, match="already in use"):
            eng.add_request([1, 2], request_id=ids[0])
        while eng.has_unfinished():
            step()
        assert "dp" in modes and modes[-1] == "tp"  # back to tensor parallel for the tail
        assert [s["to"] for s in eng.switches] == ["dp", "tp"] and eng.switches[1]["requests"] >= 1
        # the moved requests' KV went along (rank 0 took the first one's whole heads, then its TP slice of all)
        assert eng.move_kv and all(s["kv_tokens"] > 0 for s in eng.switches)
        assert sorted(final) == sorted(i for i in ids if i != ids[4])
        plain = Engine(ours_from_hf(hf), page_size=4, num_pages=96)
        for rid, p, sp in zip(ids, prompts, params):
            if rid == ids[4]:
                continue
            want = plain.generate([p], sp)[0]
            assert final[rid].token_ids == want.token_ids, rid
            if sp.logprobs:
                for got_lp, want_lp in zip(final[rid].logprobs, want.logprobs):
                    assert [got_lp[t] for t in want_lp] == pytest.approx(list(want_lp.values()), abs=1e-4)
        assert max(final[r].metrics.num_migrations for r in final) >= 1
        # generate: a burst through data parallel, the stragglers back on tensor parallel
        outs = eng.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
        assert [s["to"] for s in eng.switches] == ["dp", "tp", "dp", "tp"]
        eng.close()
        with pytest.raises(RuntimeError, match="closed"):
            eng.step()
    finally:
        _leave()


def test_switches_between_layouts_mid_request(tmp_path):
    mp.spawn(_worker, args=(f"file://{tmp_path}/rdzv",), nprocs=WORLD, join=True)
