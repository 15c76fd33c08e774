"""The Engine with a CPU tier under the prefix cache (EngineConfig.cpu_kv_cache_bytes).

On the CPU the tier copies host to host, which runs every piece of its bookkeeping: demotion of reused
cached pages, loads of matched ones, LRU, metrics, preemption, async scheduling, quantized KV.
"""

import pytest
import torch
from engine_helpers import hf_greedy, ours_from_hf, random_prompts, tiny_hf, with_fake_graphs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_async import LetterTokenizer, check_stream
from test_async import request as async_request
from test_async import run as async_run

from infercore import Engine, EngineConfig, SamplingParams
from infercore.engine.graph_runner import CUDAGraphRunner

N = 6
# log-probabilities too: a page loaded with wrong bytes can leave greedy tokens of a tiny model unchanged, but
# not the log-probabilities of the tokens that read it
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=0)
TIER = 1 << 20


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf("llama", max_position_embeddings=512)
    return hf, ours_from_hf(hf)


def sessions(eng, first, params=GREEDY, turns=2, extra=5):
    """Run every session's turns: each turn's prompt is the last prompt + its output + ``extra`` new tokens
    (all sessions of a turn in one generate call). Returns the outputs of every turn."""
    prompts, out = [list(p) for p in first], []
    for t in range(turns):
        res = eng.generate(prompts, params)
        out.append(res)
        prompts = [p + o.token_ids + [(7 * t + j) % 96 for j in range(extra)] for p, o in zip(prompts, res)]
    assert eng.block_manager.num_free_pages == eng.block_manager.num_pages
    return out


def engine(model, tier=TIER, **kw):
    cfg = dict(page_size=4, num_pages=30, max_num_seqs=4, max_num_batched_tokens=64)
    cfg.update(kw)
    return Engine(model, cpu_kv_cache_bytes=tier, **cfg)


def same_outputs(a, b):
    """Token ids equal; log-probabilities (where asked for) equal up to float rounding: loaded KV was
    computed by other steps (a decode, another chunking) than a recompute's."""
    assert [[o.token_ids for o in t] for t in a] == [[o.token_ids for o in t] for t in b]
    for ta, tb in zip(a, b):
        for x, y in zip(ta, tb):
            if x.cumulative_logprob is not None:
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
                for da, db in zip(x.logprobs, y.logprobs):
                    assert da == pytest.approx(db, abs=1e-4)


def computed_prompt_tokens(turn):
    return sum(len(o.prompt_token_ids) - o.metrics.num_cached_tokens for o in turn)


def test_sessions_that_evict_each_other_match_transformers_and_compute_less(pair):
    hf, model = pair
    first = random_prompts(6, 3, 20, 40)
    base = sessions(engine(model, tier=0), first, turns=3)
    eng = engine(model)
    tiered = sessions(eng, first, turns=3)
    same_outputs(tiered, base)
    for o in tiered[2]:
        assert o.token_ids == hf_greedy(hf, o.prompt_token_ids, N)
    tier = eng.cpu_tier
    assert tier.stats.demoted > 0 and tier.stats.loaded > 0
    # the pool of 30 pages cannot keep 6 sessions of 30-60 tokens: without the tier most history is recomputed
    for t in (1, 2):
        assert computed_prompt_tokens(tiered[t]) < computed_prompt_tokens(base[t])
        cpu = sum(o.metrics.num_cpu_cached_tokens for o in tiered[t])
        assert cpu > 0 and cpu % 4 == 0
        for o in tiered[t]:
            m = o.metrics
            assert m.num_gpu_cached_tokens + m.num_cpu_cached_tokens == m.num_cached_tokens
        assert all(o.metrics.num_cpu_cached_tokens == 0 for o in base[t])
    assert eng.block_manager.stats.cpu_hit_tokens == sum(o.metrics.num_cpu_cached_tokens for t in tiered
                                                         for o in t)


def test_tier_hits_are_counted_exactly(pair):
    _, model = pair
    eng = engine(model, num_pages=8, max_num_seqs=1)
    a = list(range(1, 18))  # 17 tokens: 4 full pages, and the partial 5th
    out_a = eng.generate([a], GREEDY)[0]
    # a computed 17 + 5 tokens (its last output is never fed): pages 0-4 are full and cached
    b = list(range(40, 66))  # 26 tokens + 6 new: all 8 pages, so every cached page of a is reused
    eng.generate([b], GREEDY)
    assert eng.cpu_tier.stats.demoted == 5
    a2 = a + out_a.token_ids + [9, 9, 9]  # 26 tokens; 22 = 5 pages + 2 tokens are a's history
    out = eng.generate([a2], GREEDY)[0]
    assert out.metrics.num_cpu_cached_tokens == 20
    assert out.metrics.num_gpu_cached_tokens == 0
    assert out.metrics.num_cached_tokens == 20
    # the same prompt again: its pages are on the device now
    again = eng.generate([a2], GREEDY)[0]
    assert again.metrics.num_gpu_cached_tokens == 24 and again.metrics.num_cpu_cached_tokens == 0
    same_outputs([[again]], [[out]])
    # without the tier, nothing of a2 is cached
    ref = engine(model, tier=0, num_pages=8, max_num_seqs=1)
    ref.generate([a], GREEDY)
    ref.generate([b], GREEDY)
    r = ref.generate([a2], GREEDY)[0]
    assert r.metrics.num_cached_tokens == 0
    same_outputs([[out]], [[r]])


def test_seeded_sampling_is_the_same_with_and_without_the_tier(pair):
    _, model = pair
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=N, seed=11, ignore_eos=True, logprobs=2)
    first = random_prompts(5, 8, 20, 40)
    base = sessions(engine(model, tier=0), first, sp)
    tiered = sessions(engine(model), first, sp)
    same_outputs(tiered, base)


def test_tier_lru_eviction_in_the_engine(pair):
    _, model = pair
    # a tier of 4 pages behind a pool of 8: a's 5 cached pages are demoted, then b's push out a's oldest
    per_page = engine(model).cpu_tier.page_bytes
    eng = engine(model, tier=4 * per_page, num_pages=8, max_num_seqs=1)
    assert eng.cpu_tier.num_pages == 4
    a, b, c = list(range(1, 18)), list(range(40, 66)), list(range(20, 46))
    out_a = eng.generate([a], GREEDY)[0]
    eng.generate([b], GREEDY)
    eng.generate([c], GREEDY)
    assert eng.cpu_tier.stats.evicted > 0 and len(eng.cpu_tier) == 4
    out = eng.generate([a + out_a.token_ids + [9]], GREEDY)[0]
    assert out.metrics.num_cpu_cached_tokens < 20  # a's first pages were evicted from the tier
    ref = engine(model, tier=0, num_pages=8, max_num_seqs=1).generate([a + out_a.token_ids + [9]], GREEDY)[0]
    same_outputs([[out]], [[ref]])


def test_preemption_under_a_tiny_pool(pair):
    hf, model = pair
    prompts = random_prompts(8, 5, 10, 30)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    kw = dict(num_pages=14, max_num_seqs=8, max_num_batched_tokens=32)
    base = engine(model, tier=0, **kw).generate(prompts, sp)
    eng = engine(model, **kw)
    out = eng.generate(prompts, sp)
    assert sum(o.metrics.num_preemptions for o in out) > 0
    assert eng.cpu_tier.stats.loaded > 0  # a preempted request's full pages came back from the tier
    same_outputs([out], [base])
    for p, o in zip(prompts, out):
        assert o.token_ids == hf_greedy(hf, p, 16)
    assert eng.block_manager.num_free_pages == eng.block_manager.num_pages


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_with_the_tier(pair, kv_cache_dtype):
    _, model = pair
    first = random_prompts(6, 4, 20, 40)
    base = sessions(engine(model, tier=0, kv_cache_dtype=kv_cache_dtype), first)
    eng = engine(model, kv_cache_dtype=kv_cache_dtype)
    assert eng.cpu_tier.page_bytes == 2 * 2 * 4 * 2 * (8 + 4)  # layers, k/v, page, heads, codes + fp32 scale
    tiered = sessions(eng, first)
    assert sum(o.metrics.num_cpu_cached_tokens for o in tiered[1]) > 0
    # the tier moves codes and scales bit for bit, and recompute quantizes the same values alike
    same_outputs(tiered, base)


@pytest.mark.parametrize("graphs", [False, True])
def test_async_scheduling_with_the_tier(pair, graphs):
    hf, model = pair
    first = random_prompts(6, 6, 20, 40)
    base = sessions(engine(model, tier=0), first)
    eng = engine(model, async_scheduling=True)
    assert eng.async_scheduling
    if graphs:  # CPU stand-ins for decode graphs: the graph runner's path with the tier's fences
        with_fake_graphs(eng, CUDAGraphRunner, max_batch=4, buckets=(1, 2, 4))
    tiered = sessions(eng, first)
    assert sum(o.metrics.num_cpu_cached_tokens for o in tiered[1]) > 0
    same_outputs(tiered, base)
    assert eng.cpu_tier.launch_seq >= 0
    for o in tiered[1]:
        assert o.token_ids == hf_greedy(hf, o.prompt_token_ids, N)


def test_speculative_decoding_with_the_tier(pair):
    _, model = pair
    first = [[1, 2, 3, 4, 5, 6] * 5, [7, 8, 9] * 9, random_prompts(1, 9, 25, 30)[0]]
    base = sessions(engine(model, tier=0, num_pages=20), first)
    tiered = sessions(engine(model, num_pages=20, num_speculative_tokens=3), first)
    assert sum(o.metrics.num_cpu_cached_tokens for o in tiered[1]) > 0
    same_outputs(tiered, base)


def test_bad_configs(pair):
    _, model = pair
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(ValueError, match="cpu_kv_cache_bytes"):
            EngineConfig(cpu_kv_cache_bytes=bad)
    with pytest.raises(ValueError, match="cpu_kv_cache_bytes.*enable_prefix_caching"):
        EngineConfig(cpu_kv_cache_bytes=TIER, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="cpu_kv_cache_bytes.*dense"):
        EngineConfig(cpu_kv_cache_bytes=TIER, kv_layout="multi")
    with pytest.raises(ValueError, match="cpu_kv_cache_bytes.*holds no KV page"):
        Engine(model, page_size=4, num_pages=8, cpu_kv_cache_bytes=100)
    assert Engine(model, page_size=4, num_pages=8).cpu_tier is None


def test_hybrid_layout_is_refused():
    from infercore.models import Gemma3Config, build_model

    cfg = Gemma3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        query_pre_attn_scalar=16.0, tie_word_embeddings=True,
    )  # fmt: skip
    gemma3 = build_model(cfg, dtype=torch.float32, device="cpu")
    assert Engine(gemma3, page_size=4, num_pages=16).kv_layout == "multi"  # the auto choice for this model
    with pytest.raises(ValueError, match="cpu_kv_cache_bytes.*dense.*'multi'"):
        Engine(gemma3, page_size=4, num_pages=16, cpu_kv_cache_bytes=TIER)
    # the dense layout of the same model takes the tier
    assert Engine(gemma3, page_size=4, num_pages=16, kv_layout="dense", cpu_kv_cache_bytes=TIER).cpu_tier is not None


def test_tier_copies_never_happen_without_pressure(pair):
    _, model = pair
    eng = engine(model, num_pages=200)
    sessions(eng, random_prompts(4, 2, 20, 40))
    assert eng.cpu_tier.stats.demoted == 0 and eng.cpu_tier.stats.loaded == 0


def test_tier_is_the_same_size_whatever_the_device_pool(pair):
    _, model = pair
    eng = engine(model, tier=TIER)
    assert eng.cpu_tier.num_pages == TIER // eng.cpu_tier.page_bytes
    host = eng.cpu_tier.host_chunks
    assert len(host) == 1 and host[0].dtype == torch.uint8 and not host[0].is_pinned()


# prompts that continue one of three 13-token prefixes (sessions returning), or the async tests' short ones
_PREFIXES = [[(5 * i + j) % 8 for j in range(13)] for i in range(3)]
# (arriving up to 40 steps late, after others pushed their prefix out of a small pool)
tier_request = st.one_of(async_request, st.builds(
    lambda k, suffix, arrival, rest: (_PREFIXES[k] + suffix, rest[1], arrival, rest[3]),
    st.integers(0, 2), st.lists(st.integers(0, 7), max_size=10), st.integers(0, 40), async_request))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reqs=st.lists(tier_request, min_size=1, max_size=8),
    num_pages=st.integers(9, 24),
    tier_pages=st.integers(1, 40),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 5),
    graphs=st.sampled_from([0, 3]),
)
def test_random_traffic_with_the_tier_equals_a_roomy_pool(reqs, num_pages, tier_pages, budget, max_seqs, graphs):
    """Arrivals, aborts, stop strings, seeded sampling and preemption in a small pool over a tier of 1-40 pages,
    synchronous and async, with and without (stand-in) decode graphs: every finished request's output equals a
    roomy synchronous engine's; an aborted one streamed a prefix of it; no page or row leaks (``run`` checks)."""
    page_bytes = 2 * 2 * 4 * 8 * 4  # one layer of the async tests' model: (k, v) * page * (Hk=2 * D=8) * fp32
    cfg = dict(num_pages=num_pages, max_num_batched_tokens=budget, max_num_seqs=max_seqs, graphs=graphs,
               tokenizer=LetterTokenizer(), cpu_kv_cache_bytes=tier_pages * page_bytes)
    ref, _ = async_run(reqs, async_scheduling=False, aborts=False, tokenizer=LetterTokenizer(), num_pages=512)
    for a in (False, True):
        streams, eng = async_run(reqs, async_scheduling=a, **cfg)
        assert eng.cpu_tier.num_pages == tier_pages
        for rid, outs in streams.items():
            check_stream(outs)
            want = ref[rid][-1]
            if outs and outs[-1].finished:
                got = outs[-1]
                assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            else:
                assert reqs[int(rid[1:])][3] is not None
                toks = outs[-1].token_ids if outs else []
                assert toks == want.token_ids[: len(toks)]


def test_cli_passes_the_cpu_tier_size(capsys, monkeypatch):
    from infercore import cli

    seen = {}

    def load(path, **kw):
        seen.update(kw)
        raise ValueError("not loading here")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(load))
    for cmd in (["generate", "hi"], ["serve"]):
        seen.clear()
        assert cli.main([*cmd, "--cpu-kv-cache-gb", "1.5"]) == 2
        assert seen["cpu_kv_cache_bytes"] == 3 << 29
        assert "not loading here" in capsys.readouterr().err
    seen.clear()
    assert cli.main(["generate", "hi", "--cpu-kv-cache-gb", "-1"]) == 2
    assert not seen and "--cpu-kv-cache-gb must be >= 0" in capsys.readouterr().err


def _tp_worker(rank: int, init: str) -> None:
    import torch.distributed as dist

    from infercore.parallel import tensor_parallel_

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ok = False
    try:
        hf = tiny_hf("llama", max_position_embeddings=512)
        model = tensor_parallel_(ours_from_hf(hf))
        # tiers sized from budgets that differ by rank: every rank gets the smallest, as with the pool
        eng = engine(model, tier=(40 + 10 * rank) * 2 * 2 * 4 * 1 * 8 * 4, num_pages=24)
        assert eng.cpu_tier.num_pages == 40 and eng.runner.kv_caches[0][0].shape[2] == 1
        first = random_prompts(6, 3, 20, 40)
        out = sessions(eng, first, turns=3)
        mine = ([[o.token_ids for o in t] for t in out], [[o.metrics.num_cpu_cached_tokens for o in t] for t in out],
                eng.cpu_tier.stats)
        everyone = [None, None]
        dist.all_gather_object(everyone, mine)
        assert everyone[0] == everyone[1]  # the same tokens, tier hits and copies on both ranks
        assert sum(sum(t) for t in mine[1]) > 0 and mine[2].evicted > 0, mine[1:]
        if rank == 0:
            for t in out:
                for o in t:
                    assert o.token_ids == hf_greedy(hf, o.prompt_token_ids, N)
        ok = True
    finally:
        if ok:
            dist.barrier()  # leave together
        dist.destroy_process_group()
        if ok:  # skip the teardown, where a rank aborted now and then after passing (see test_tensor_parallel._leave)
            import os
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def test_tensor_parallel_ranks_keep_their_tiers_in_lockstep(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(f"file://{tmp_path}/rdzv",), nprocs=2, join=True)


# ---------------------------------------------------------------------------------------------- CUDA


def _on_cuda(hf, dtype):
    from infercore.models import ModelConfig, build_model

    model = build_model(ModelConfig.from_hf(hf.config.to_dict()), dtype=dtype, device=torch.device("cuda"))
    model.load_weights(hf.state_dict().items())
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cuda_sessions_with_graphs_match_transformers(pair, async_scheduling):
    """fp32 on CUDA, decode in CUDA graphs: the tier's side-stream copies and launch fences keep every
    turn's greedy tokens those of transformers, with most history loaded from the tier."""
    hf, _ = pair
    model = _on_cuda(hf, torch.float32)
    first = random_prompts(10, 13, 20, 60)
    eng = engine(model, num_pages=40, max_num_seqs=6, max_num_batched_tokens=48, async_scheduling=async_scheduling)
    assert eng.graph_runner is not None and eng.graph_runner.graphs and eng.cpu_tier.host_chunks[0].is_pinned()
    tiered = sessions(eng, first, turns=3)
    assert sum(o.metrics.num_cpu_cached_tokens for t in tiered[1:] for o in t) > 0
    for t in tiered:
        for o in t:
            assert o.token_ids == hf_greedy(hf, o.prompt_token_ids, N)
    base = sessions(engine(model, tier=0, num_pages=40, max_num_seqs=6, max_num_batched_tokens=48,
                           async_scheduling=async_scheduling), first, turns=3)
    same_outputs(tiered, base)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cuda_bf16_sessions_with_the_tier(pair, kv_cache_dtype):
    """bf16 model, bf16 or int8 KV, graphs and async scheduling (the CUDA defaults): the tier's outputs
    agree with recompute's (bf16 recompute is not bit-identical to the decode that wrote the pages, so
    rare near-ties may flip), and the loaded pages are counted."""
    hf, _ = pair
    model = _on_cuda(hf, torch.bfloat16)
    first = random_prompts(10, 14, 20, 60)
    kw = dict(num_pages=40, max_num_seqs=6, max_num_batched_tokens=48, kv_cache_dtype=kv_cache_dtype)
    eng = engine(model, **kw)
    assert eng.async_scheduling and eng.graph_runner is not None
    tiered = sessions(eng, first, turns=3)
    base = sessions(engine(model, tier=0, **kw), first, turns=3)
    assert sum(o.metrics.num_cpu_cached_tokens for t in tiered[1:] for o in t) > 0
    assert sum(len(o.prompt_token_ids) - o.metrics.num_cached_tokens for o in tiered[2]) < \
        sum(len(o.prompt_token_ids) - o.metrics.num_cached_tokens for o in base[2])
    pairs = [(a, b) for ta, tb in zip(tiered, base) for x, y in zip(ta, tb) for a, b in zip(x.token_ids, y.token_ids)]
    assert sum(a == b for a, b in pairs) >= 0.9 * len(pairs)
