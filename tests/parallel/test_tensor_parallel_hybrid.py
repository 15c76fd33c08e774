"""Tensor parallelism of Gemma 3 (sliding + global attention), Qwen3-Next (gated DeltaNet + gated attention +
routed experts), Mamba2 (B / C groups split) and Bamba (one group kept whole, its norm summed over the ranks) over
torch.distributed (gloo, two CPU processes): each rank keeps half of every layer's heads, its KV pages and recurrent
states hold only those, and the Engine's tokens on every rank equal transformers' greedy ones and the unsharded
engine's sampled ones, in each KV layout; rank 0 also drives the other through MirroredEngine."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, HERE)

WORLD = 2


def _prompts():
    import random

    rng = random.Random(4)
    return [[rng.randrange(96) for _ in range(rng.randint(9, 26))] for _ in range(3)]


def _worker(rank: int, init: str, family: str) -> None:
    from dist_helpers import _leave
    from hybrid_harness import hf_greedy

    from infercore import Engine, SamplingParams
    from infercore.parallel import MirroredEngine, RowParallel, follow, tensor_parallel_

    torch.set_num_threads(1)
    if family == "gemma3":
        from test_gemma3 import tiny_pair

        hf, ref = tiny_pair()
        _, model = tiny_pair()
        layouts, kv = ["dense", "multi"], dict(page_size=4, num_pages=96)
    elif family == "qwen3_next":
        from test_qwen3_next import _tiny_pair

        hf, ref = _tiny_pair(0)
        _, model = _tiny_pair(0)
        layouts, kv = ["multi", "uniform"], dict(page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)
    else:  # mamba2: two groups of B / C, split; bamba: one group, kept whole, its norm summed over the ranks
        from test_mamba2 import _hf

        from infercore.models import Mamba2Config, build_model

        hf = _hf(family)
        ref, model = (build_model(Mamba2Config.from_hf(hf.config.to_dict()), dtype=torch.float32, device="cpu",
                                  init="empty") for _ in range(2))
        ref.load_weights(hf.state_dict().items())
        model.load_weights(hf.state_dict().items())
        layouts, kv = ["multi", "uniform"], dict(page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        tensor_parallel_(model)
        layers = model.backbone.layers if family == "mamba2" else model.model.layers
        if family == "gemma3":
            assert layers[0].self_attn.num_heads == 2 and layers[0].self_attn.num_kv_heads == 1
        elif family in ("mamba2", "bamba"):  # 8 heads of 8: 4 a rank
            mix = layers[0].mixer if family == "mamba2" else layers[0].mamba
            assert (mix.H, mix.inner, mix.G) == (4, 32, 1)
            assert (mix.norm_reduce is None) == (family == "mamba2")
            assert mix.conv_dim == 32 + 2 * 16 and mix.in_proj.out_features == 2 * 32 + 2 * 16 + 4
        else:
            net = layers[0].linear_attn  # 2 key heads / 4 value heads of 8: one / two per rank
            assert (net.hk, net.hv, net.conv_dim) == (1, 2, 2 * 8 + 2 * 8)
            assert isinstance(net.out_proj, RowParallel) and net.out_proj.linear.in_features == 16
            assert isinstance(layers[0].mlp, RowParallel)  # the routed experts' partial sums, one all_reduce
            assert layers[2].self_attn.num_heads == 2 and layers[2].self_attn.qkv_proj.out_features == 2 * 16 + 2 * 8
        prompts = _prompts()
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
        outs = {}
        for layout in layouts:
            eng = Engine(model, kv_layout=layout, max_num_batched_tokens=13, **kv)  # chunked, mixed steps
            specs = model.kv_specs()
            if family == "qwen3_next":  # this rank's states: its value heads only
                assert specs[0].recurrent_state_shape == (2, 8, 8) and specs[2].num_kv_heads == 1
            elif family != "gemma3":
                assert specs[0].recurrent_state_shape == (4, 8, 16)
            outs[layout] = {name: [(o.token_ids, o.logprobs) for o in eng.generate(prompts, sp)]
                            for name, sp in (("greedy", greedy), ("seeded", seeded))}
            if layout != "dense":
                eng.block_manager.check_invariants()
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, outs)
        assert all(o == outs for o in everyone)  # every rank sampled the same tokens
        # rank 0 drives, the other follows (the serving path)
        eng = Engine(model, kv_layout=layouts[-1], **kv)
        if rank:
            assert follow(eng) > 0
        else:
            mirrored = MirroredEngine(eng)
            served = [o.token_ids for o in mirrored.generate(prompts, greedy)]
            mirrored.close()
            assert served == [t for t, _ in outs[layouts[-1]]["greedy"]]
        if rank == 0:
            want = [hf_greedy(hf, p, 12) for p in prompts]
            plain = Engine(ref, kv_layout=layouts[-1], **kv).generate(prompts, seeded)
            for layout in layouts:
                assert [t for t, _ in outs[layout]["greedy"]] == want, layout
                for (toks, lps), exp in zip(outs[layout]["seeded"], plain):
                    assert toks == exp.token_ids, layout
                    for got, lp in zip(lps, exp.logprobs):
                        assert [got[t] for t in lp] == pytest.approx(list(lp.values()), abs=1e-4)
    finally:
        _leave()


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next", "mamba2", "bamba"])
def test_two_ranks_match_one(family, tmp_path):
    mp.spawn(_worker, args=(f"file://{tmp_path}/rdzv", family), nprocs=WORLD, join=True)


def _errors_worker(rank: int, init: str) -> None:
    from dist_helpers import _leave
    from test_qwen3_next import _tiny_pair

    from infercore.parallel import tensor_parallel_

    _, model = _tiny_pair(0)
    model.config.linear_num_key_heads = 3  # as a config whose DeltaNet key heads do not split over two ranks
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        with pytest.raises(ValueError, match="linear_num_key_heads=3"):
            tensor_parallel_(model)
    finally:
        _leave()


def test_errors(tmp_path):
    mp.spawn(_errors_worker, args=(f"file://{tmp_path}/rdzv",), nprocs=WORLD, join=True)
