"""The engine over the hybrid KV manager: layout choice, checkpoint-aligned chunking, state copies,
preemption, prefix hits equal to misses, and multi-granularity capacity against uniform."""


import pytest
import torch
from engine_helpers import adopt_and_finish, ours_from_hf, random_prompts, tiny_hf, with_fake_graphs

from infercore import Engine, SamplingParams
from infercore.engine.graph_runner import HybridCUDAGraphRunner
from infercore.engine.scheduler import Scheduler
from infercore.models import Gemma3Config, Mamba2Config, Qwen3NextConfig, build_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_next():
    cfg = Qwen3NextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
        layer_types=["linear_attention", "full_attention"] * 2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, max_position_embeddings=512,
        partial_rotary_factor=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def gemma3():
    cfg = Gemma3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=2, num_kv_heads=1, head_dim=16,
        sliding_window=8, layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=512,
        query_pre_attn_scalar=16.0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg, dtype=torch.float32, device="cpu")


def test_layout_choice(qwen3_next, gemma3):
    mistral = ours_from_hf(tiny_hf("mistral"))  # sliding windows but dense metadata: stays dense
    assert Engine(mistral, page_size=4, num_pages=64).kv_layout == "dense"
    assert Engine(gemma3, page_size=4, num_pages=64).kv_layout == "multi"
    assert Engine(gemma3, page_size=4, num_pages=64, kv_layout="dense").kv_layout == "dense"
    assert Engine(qwen3_next, page_size=4, kv_cache_bytes=1 << 20, kv_layout="uniform").kv_layout == "uniform"
    with pytest.raises(ValueError, match="supports_hybrid_kv"):
        Engine(mistral, page_size=4, num_pages=64, kv_layout="multi")
    with pytest.raises(ValueError, match="recurrent"):
        Engine(qwen3_next, page_size=4, kv_cache_bytes=1 << 20, kv_layout="dense")
    with pytest.raises(ValueError, match="kv_layout"):
        Engine(gemma3, page_size=4, num_pages=64, kv_layout="paged")
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine(qwen3_next, page_size=4, num_pages=64)


def test_scheduler_cuts_prefill_at_checkpoint_boundaries():
    class Pool:  # a pool that never runs short
        def allocate(self, *a, **k):
            return 0

        def grow(self, *a):
            return True

    s = Scheduler(Pool(), max_num_seqs=4, max_num_batched_tokens=100, chunk_boundary=8)
    assert [s._cut(0, 30), s._cut(5, 30), s._cut(8, 30), s._cut(16, 3), s._cut(23, 1)] == [8, 3, 8, 3, 1]
    assert Scheduler(Pool(), max_num_seqs=4, max_num_batched_tokens=100)._cut(5, 30) == 30
    # in-flight prefix sharing reads published pages, which only the dense manager reports
    with pytest.raises(ValueError, match="share_prefills"):
        Scheduler(Pool(), max_num_seqs=4, max_num_batched_tokens=100, share_prefills=True)


def test_chunks_end_on_checkpoints_and_copies_run(qwen3_next):
    eng = Engine(qwen3_next, page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)
    prompt = random_prompts(1, seed=1, lo=21, hi=21)[0]
    eng.add_request(prompt, GREEDY)
    ends = []
    while eng.has_unfinished():
        batch = eng.scheduler.schedule()
        ends += [r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_new_tokens)]
        sampled = eng.runner.execute(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            eng.block_manager.mark_computed(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if req in sampled:
                eng._append(req, sampled[req])
    assert ends[:3] == [8, 16, 21]  # the prompt is cut at the 8-token checkpoints
    eng.runner.apply_state_copies()  # the checkpoint queued by the last step
    bm = eng.block_manager
    # A new request sharing 16 tokens is served from the checkpoint; its copy is queued, then run.
    assert bm.allocate("x", prompt[:18], 18, max_cached_tokens=17) == 16
    copies = bm.take_state_copies()
    assert len(copies) == 1 and copies[0].dst == bm.state_slot("x", copies[0].group)
    rows = eng.runner.group_rows[copies[0].group]
    assert not torch.equal(rows[copies[0].dst], rows[copies[0].src])
    bm._copies = copies
    eng.runner.apply_state_copies()
    assert torch.equal(rows[copies[0].dst], rows[copies[0].src])
    bm.free("x")
    bm.check_invariants()


@pytest.mark.parametrize("layout", ["multi", "uniform"])
def test_preemption_and_prefix_hits_keep_outputs(qwen3_next, layout):
    shared = random_prompts(1, seed=2, lo=17, hi=17)[0]
    ps = [shared + p for p in random_prompts(5, seed=3, lo=1, hi=9)] + random_prompts(2, seed=4, lo=5, hi=20)
    ref = Engine(qwen3_next, page_size=4, kv_cache_bytes=4 << 20, enable_prefix_caching=False)
    want = [o.token_ids for o in ref.generate(ps, GREEDY)]
    eng = Engine(qwen3_next, page_size=4, kv_cache_bytes=60_000, checkpoint_interval=8, kv_layout=layout,
                 max_num_batched_tokens=16)  # fmt: skip
    outs = eng.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.memory()["used"] == 0


def _peak_running(eng, prompts, params):
    for p in prompts:
        eng.add_request(p, params)
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, len(eng.scheduler.running))
    return peak


def test_multi_granularity_holds_more_requests_than_uniform(gemma3):
    ps = random_prompts(10, seed=5, lo=60, hi=60)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    budget = dict(page_size=4, num_pages=48, max_num_batched_tokens=64, enable_prefix_caching=False)
    peak = {kv: _peak_running(Engine(gemma3, kv_layout=kv, **budget), ps, params)
            for kv in ("multi", "uniform", "dense")}
    # 5 of 6 layers slide (window 8): once a prompt is in, a request holds its full layer's pages and
    # about three pages of each sliding layer, so the same bytes hold over twice the requests.
    assert peak["uniform"] == peak["dense"] <= 3
    assert peak["multi"] >= 2 * peak["uniform"]


def test_mamba2_pure_runs_with_prefix_cache():
    cfg = Mamba2Config(vocab_size=96, hidden_size=16, num_layers=2, mamba_heads=4, mamba_head_dim=8,
                       state_size=8, n_groups=2)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    eng = Engine(model, page_size=4, kv_cache_bytes=1 << 18, checkpoint_interval=4)
    p = random_prompts(1, seed=6, lo=14, hi=14)[0]
    a = eng.generate([p], GREEDY)[0]
    b = eng.generate([p], GREEDY)[0]
    assert b.metrics.num_cached_tokens == 12 and a.token_ids == b.token_ids


def _mamba2_hybrid():
    cfg = Mamba2Config(vocab_size=96, hidden_size=16, num_layers=3, mamba_heads=4, mamba_head_dim=8, state_size=8,
                       n_groups=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
                       num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32, model_type="bamba",
                       architecture="BambaForCausalLM")  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("name,layout", [("qwen3_next", "multi"), ("qwen3_next", "uniform"), ("gemma3", "multi"),
                                         ("gemma3", "uniform"), ("mamba2", "multi")])  # fmt: skip
def test_graph_runner_path_matches_eager(qwen3_next, gemma3, name, layout):
    """Decode through the hybrid graph runner's staging (CPU stand-in graphs: buckets 1, 2, 4 with
    padding rows, bigger batches eager) gives the eager engine's tokens, with prefix hits,
    checkpoint copies and preemption in the mix; nothing leaks."""
    model = {"qwen3_next": qwen3_next, "gemma3": gemma3}.get(name) or _mamba2_hybrid()
    shared = random_prompts(1, seed=7, lo=17, hi=17)[0]
    ps = [shared + p for p in random_prompts(4, seed=8, lo=1, hi=9)] + random_prompts(3, seed=9, lo=5, hi=20)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    cfg = dict(page_size=4, kv_cache_bytes=60_000, checkpoint_interval=8, kv_layout=layout, max_num_batched_tokens=16)
    want = [o.token_ids for o in Engine(model, **cfg).generate(ps, params)]
    eng = Engine(model, **cfg)
    gr = with_fake_graphs(eng, HybridCUDAGraphRunner, max_batch=4, buckets=(1, 2))
    replays = []
    orig = gr.launch
    gr.launch = lambda batch, gather=None: (replays.append(len(batch)), orig(batch, gather))[1]
    outs = eng.generate(ps, params)
    assert [o.token_ids for o in outs] == want
    assert replays and max(replays) <= 4 and 3 in replays  # bucket 4 with a padding row
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    if name != "mamba2":  # the pool is small enough to preempt (re-admitted requests get new pages)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.memory()["used"] == 0


@pytest.mark.parametrize("name,layout", [("qwen3_next", "multi"), ("gemma3", "multi"), ("gemma3", "uniform")])
def test_mixed_steps_with_decodes_split_off_keep_the_tokens(qwen3_next, gemma3, name, layout,
                                                           split_attention_through_triton):
    """The hybrid runner marks a mixed step's one-query sequences (every attention group alike); with
    the Triton kernels (interpreter) the decode kernel takes them, the prefill kernel the rest, and the
    tokens are the CPU engine's. Sliding windows, prefix hits and preemption are in the mix."""
    from infercore.ops import attention

    model = {"qwen3_next": qwen3_next, "gemma3": gemma3}[name]
    shared = random_prompts(1, seed=3, lo=13, hi=13)[0]
    ps = [shared + p for p in random_prompts(3, seed=4, lo=1, hi=7)] + random_prompts(4, seed=5, lo=3, hi=19)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cfg = dict(page_size=4, kv_cache_bytes=60_000, checkpoint_interval=8, kv_layout=layout, max_num_batched_tokens=12)
    want = [o.token_ids for o in Engine(model, **cfg).generate(ps, params)]
    split = split_attention_through_triton(attention)
    got = [o.token_ids for o in Engine(model, **cfg).generate(ps, params)]
    assert got == want
    assert split and max(split) >= 2  # mixed steps did put their decodes through the decode kernel


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3"])
def test_hybrid_logprobs_equal_a_fresh_prefill(qwen3_next, gemma3, name):
    """SamplingParams.logprobs on the hybrid runner (decodes through the graph runner's staging): the values
    at each generated position equal those of a fresh engine that prefills the prompt plus the tokens so far."""
    model = {"qwen3_next": qwen3_next, "gemma3": gemma3}[name]
    cfg = dict(page_size=4, kv_cache_bytes=200_000, checkpoint_interval=8, kv_layout="multi", max_num_batched_tokens=16)
    prompt = random_prompts(1, seed=12, lo=11, hi=11)[0]
    eng = Engine(model, **cfg)
    with_fake_graphs(eng, HybridCUDAGraphRunner, max_batch=2, buckets=(1,))
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))[0]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=3)
    for i, d in enumerate(out.logprobs):
        fresh = Engine(model, **cfg).generate([prompt + out.token_ids[:i]], one)[0]
        assert fresh.token_ids[0] == out.token_ids[i]
        assert list(fresh.logprobs[0]) == list(d)
        assert list(fresh.logprobs[0].values()) == pytest.approx(list(d.values()), abs=1e-4)


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3"])
def test_requests_moved_between_hybrid_engines_keep_their_tokens(qwen3_next, gemma3, name):
    # Engine.take_requests / adopt_request over the hybrid managers (linear state, sliding windows): requests taken
    # mid-decode from one engine and continued by another engine of the same model give the unmoved tokens, and
    # the first engine's pool is whole again.
    model = {"qwen3_next": qwen3_next, "gemma3": gemma3}[name]
    ps = random_prompts(4, seed=9, lo=5, hi=20)
    sampled = SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True)
    params = [GREEDY, sampled, GREEDY, sampled]
    want = [o.token_ids for o in Engine(model, page_size=4, kv_cache_bytes=4 << 20).generate(ps, params)]
    a = Engine(model, page_size=4, kv_cache_bytes=4 << 20, max_num_batched_tokens=16)
    b = Engine(model, page_size=4, kv_cache_bytes=4 << 20, max_num_batched_tokens=16)
    assert a.kv_layout != "dense"
    ids = [a.add_request(p, sp) for p, sp in zip(ps, params)]
    for _ in range(5):
        a.step()
    a.settle()
    taken = a.take_requests()
    assert {r.request_id for r in taken} == set(ids) and any(r.output_token_ids for r in taken)
    assert a.block_manager.memory()["used"] == 0 and not a.has_unfinished()
    assert adopt_and_finish(b, taken, ids) == want
