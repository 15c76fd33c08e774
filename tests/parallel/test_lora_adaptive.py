"""Multi-LoRA on the adaptive TP / DP group (gloo, two CPU processes): adapters loaded from rank 0 reach both engines
of every rank; requests keep their adapter when they move between the layouts mid-request, and their greedy tokens
equal PEFT's."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import _leave  # noqa: E402
from engine_helpers import hf_greedy  # noqa: E402
from test_lora_tp import SPECS, _hf, _prompts, _save_adapter  # noqa: E402

WORLD = 2
LORAS = ["all", None, "attn", "mlp1", "all", "attn"]
MAX_TOKENS = 10


def _worker(rank: int, init: str, paths: dict, want: list) -> None:
    from engine_helpers import ours_from_hf

    from infercore import SamplingParams
    from infercore.lora import load_lora_adapter
    from infercore.parallel import LoadPolicy, build_adaptive

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        kw = dict(page_size=4, num_pages=256, max_num_batched_tokens=64, max_loras=2, max_lora_rank=16)
        eng = build_adaptive(ours_from_hf(_hf("llama")), tp_engine_kwargs=kw, dp_engine_kwargs=kw,
                             policy=LoadPolicy(high_at=4, low_at=2, min_steps=2))
        if rank != 0:
            assert eng.follow() > 0
        else:
            for name in SPECS:  # a path each rank reads, or an adapter sent to every rank
                eng.add_lora(name, paths[name] if name != "attn" else load_lora_adapter(paths[name], name="attn"))
            with pytest.raises(ValueError, match="already loaded"):
                eng.add_lora("all", paths["all"])
            with pytest.raises(ValueError, match="no adapter named .nope."):
                eng.add_request([1, 2, 3], lora="nope")
            greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            rid = eng.add_request(_prompts()[0], greedy, lora="all")
            with pytest.raises(ValueError, match="in use"):
                eng.remove_lora("all")
            eng.abort(rid)
            outs = eng.generate(_prompts(), greedy, lora=LORAS)
            assert [o.token_ids for o in outs] == want
            # six requests at once: data parallel for the burst, tensor parallel again for the tail
            assert [s["to"] for s in eng.switches][:2] == ["dp", "tp"]
            assert max(o.metrics.num_migrations for o in outs) >= 1
            eng.remove_lora("mlp1")
            assert eng.list_loras() == ["all", "attn"]
            eng.close()
        # every rank's two engines hold the same adapters
        state = (eng.dp.list_loras(), eng.tp.list_loras())
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, state)
        assert all(s == (["all", "attn"], ["all", "attn"]) for s in everyone), everyone
    finally:
        _leave()


def test_adapters_follow_requests_across_layouts(tmp_path):
    base = _hf("llama")
    refs, paths = {}, {}
    for seed, (name, spec) in enumerate(SPECS.items(), 1):
        paths[name] = str(tmp_path / name)
        refs[name] = _save_adapter("llama", paths[name], seed=seed, **spec)
    want = [hf_greedy(base if la is None else refs[la], p, MAX_TOKENS) for p, la in zip(_prompts(), LORAS)]
    mp.spawn(_worker, args=(f"file://{tmp_path}/rdzv", paths, want), nprocs=WORLD, join=True)
