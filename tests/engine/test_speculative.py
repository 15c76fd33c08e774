"""Speculative decoding by prompt lookup: n-gram drafts verified in one forward.

The reference is the same engine without speculation (itself tested against transformers), and transformers'
greedy decoding directly: drafts must change how many forwards run, never which tokens come out."""

import numpy as np
import pytest
import torch
from engine_helpers import hf_greedy, ours_from_hf, random_prompts, tiny_hf, with_fake_graphs

from infercore import Engine, SamplingParams
from infercore.engine import EngineConfig
from infercore.engine.graph_runner import CUDAGraphRunner
from infercore.engine.speculative import propose_ngram

# prompts that repeat themselves (drafts from the first step), and random ones (drafts only once the tiny
# model falls into a loop, which random tiny models do)
LOOPY = [[5, 6, 7, 8, 9] * 3, [1, 2, 3, 4] * 2 + [1, 2], [40, 41, 40, 41, 40, 42, 40, 41]]


@pytest.fixture(scope="module")
def gemma3():
    """A tiny Gemma-3 (5 sliding : 1 global layers): the hybrid layout by default, the dense one on request."""
    from infercore.models import Gemma3Config, build_model

    cfg = Gemma3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=2, num_kv_heads=1,
                       head_dim=16, sliding_window=8, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                       max_position_embeddings=512, query_pre_attn_scalar=16.0)
    torch.manual_seed(0)
    return build_model(cfg, dtype=torch.float32, device="cpu")


def _prompts(n_random: int = 3, seed: int = 4) -> list[list[int]]:
    return LOOPY + random_prompts(n_random, seed=seed)


def _drafted(outs) -> tuple[int, int]:
    return (sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs))


def test_propose_ngram():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # longest recurring suffix, what followed it
    assert propose_ngram([1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3], 2, max_n=2) == [8, 1]  # the most recent occurrence
    assert propose_ngram([1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3], 2) == [9, 4]  # a longer match wins
    assert propose_ngram([7, 1, 2, 8, 1, 2], 2, min_n=2) == [8, 1]
    assert propose_ngram([5, 5, 5, 5], 4) == [5, 5, 5, 5]  # a loop runs on past the end of the sequence
    assert propose_ngram([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert propose_ngram([1, 2, 3, 4], 3) == []  # nothing recurs
    assert propose_ngram([3, 1, 2, 4, 2], 3, min_n=1) == [4, 2, 4]  # a 1-gram only when min_n allows it
    assert propose_ngram([3, 1, 2, 4, 2], 3) == []
    assert propose_ngram([1, 2, 1, 2], 0) == [] and propose_ngram([1], 3) == []


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_tokens_equal_transformers_and_the_plain_engine(llama_pair, k):
    hf, model = llama_pair
    ps = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = Engine(model, page_size=4, num_pages=256).generate(ps, sp)
    outs = Engine(model, page_size=4, num_pages=256, num_speculative_tokens=k).generate(ps, sp)
    for p, a, b in zip(ps, plain, outs):
        assert b.token_ids == a.token_ids == hf_greedy(hf, p, 40)
        assert b.finish_reason == "length"
    drafted, kept = _drafted(outs)
    assert 0 < kept < drafted  # drafts were kept and rejected, so both paths of the verification ran
    assert _drafted(plain) == (0, 0)


def test_seeded_sampling_draws_the_same_tokens(llama_pair):
    """Position t of a request samples from the stream (seed, t) whatever the step, and sample-then-compare
    keeps a draft token exactly when that sample equals it: a speculative run draws the plain run's tokens."""
    _, model = llama_pair
    ps = _prompts(4, seed=5)
    # low temperatures, where the tiny model loops and drafts get kept, and higher ones
    params = [SamplingParams(temperature=t, top_p=0.95, top_k=k, seed=11 + i, max_tokens=32, ignore_eos=True)
              for i, (t, k) in enumerate([(0.05, 0), (0.1, 0), (0.08, 20), (1.0, 0), (0.05, 8), (0.6, 0), (0.1, 0)])]
    plain = Engine(model, page_size=4, num_pages=256).generate(ps, params)
    outs = Engine(model, page_size=4, num_pages=256, num_speculative_tokens=3).generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drafted, kept = _drafted(outs)
    assert 0 < kept < drafted


def test_stops_inside_a_draft(llama_pair):
    """max_tokens, a stop token and EOS that fall inside a kept draft end the request there, as without drafts."""
    _, model = llama_pair
    ps = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = Engine(model, page_size=4, num_pages=256).generate(ps, sp)
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 13)]
    # stop on a token each reference output produces late (inside a run of kept drafts, in the loops)
    cases += [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[o.token_ids[20]]) for o in ref[:3]]
    cases += [SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[o.token_ids[5]])
              for o in ref[:2]]
    plain, spec = Engine(model, page_size=4, num_pages=256), Engine(model, page_size=4, num_pages=256,
                                                                   num_speculative_tokens=5)
    for sp in cases:
        a, b = plain.generate(ps, sp), spec.generate(ps, sp)
        assert [(o.token_ids, o.finish_reason) for o in b] == [(o.token_ids, o.finish_reason) for o in a], sp
    assert not spec.has_unfinished() and spec.block_manager.num_free_pages == spec.block_manager.num_pages


def test_tight_budget_and_pool_shorten_drafts_instead_of_preempting(llama_pair):
    """A token budget of 3 leaves room for part of a draft; a pool that fits the requests without drafts
    drops them (the request decodes one token) instead of preempting another request."""
    hf, model = llama_pair
    ps = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [hf_greedy(hf, p, 30) for p in ps]
    small = Engine(model, page_size=4, num_pages=256, max_num_batched_tokens=3, num_speculative_tokens=4)
    assert [o.token_ids for o in small.generate(ps, sp)] == want
    tight = Engine(model, page_size=4, num_pages=72, num_speculative_tokens=4)
    outs = tight.generate(ps, sp)
    assert [o.token_ids for o in outs] == want
    assert _drafted(outs)[1] > 0
    assert tight.block_manager.num_free_pages == 72


def test_prefix_cache_after_speculative_steps(llama_pair):
    """Pages are published only with kept tokens: a later prompt that extends a finished one (prompt +
    output) hits the cache and continues as a fresh engine without a cache does."""
    _, model = llama_pair
    ps = LOOPY
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng = Engine(model, page_size=4, num_pages=256, num_speculative_tokens=4)
    first = eng.generate(ps, sp)
    longer = [p + o.token_ids for p, o in zip(ps, first)]
    outs = eng.generate(longer, sp)
    fresh = Engine(model, page_size=4, num_pages=256, enable_prefix_caching=False).generate(longer, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh]
    # every full page of the first run's computed tokens (all but its last token) is served from the cache
    assert [o.metrics.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in longer]


def test_mixed_batch_with_penalties_logprobs_and_streams(llama_pair):
    """Requests with penalties and with logprobs speculate next to plain ones;
    a stream's deltas carry several tokens after a kept draft and add up to the output."""
    _, model = llama_pair
    ps = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2
    plain = Engine(model, page_size=4, num_pages=256).generate(ps, params)
    eng = Engine(model, page_size=4, num_pages=256, num_speculative_tokens=4)
    outs = eng.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # log-probabilities of drafted positions come from the verification's rows
    for o, want in zip(outs[1::3], plain[1::3]):
        assert len(o.logprobs) == len(want.logprobs) == 24
        for a, b in zip(o.logprobs, want.logprobs):
            assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
        assert o.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
    assert outs[4].metrics.num_accepted_tokens > 0  # a loopy prompt's logprobs request kept drafts
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    deltas = [o.new_token_ids for o in eng.stream(LOOPY[0], greedy)]
    assert sum(deltas, []) == Engine(model, page_size=4, num_pages=256).generate(LOOPY[:1], greedy)[0].token_ids
    assert max(len(d) for d in deltas) > 1  # a kept draft streams several tokens at once


@pytest.mark.parametrize("graphs", [False, True])
def test_penalties_see_the_draft_tokens_before_each_position(llama_pair, graphs):
    """A penalized row at draft position j counts the draft's first j tokens as generated: greedy tokens under
    repetition / presence / frequency penalties equal the plain engine's, with drafts kept (eager steps, and
    graph steps, whose penalized rows sample outside the graph)."""
    _, model = llama_pair
    ps = LOOPY + random_prompts(3, seed=12)
    cases = [dict(repetition_penalty=1.1), dict(presence_penalty=0.3), dict(frequency_penalty=0.2),
             dict(frequency_penalty=0.15, repetition_penalty=1.05), dict(presence_penalty=-0.5), dict()]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **c) for c in cases]
    plain = Engine(model, page_size=4, num_pages=256).generate(ps, params)
    eng = Engine(model, page_size=4, num_pages=256, num_speculative_tokens=4)
    if graphs:
        with_fake_graphs(eng, CUDAGraphRunner, max_batch=32, buckets=[1, 2, 4, 8, 16, 32], draft_rows=True)
    outs = eng.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in outs[:5]) > 0


def test_sliding_window_model(llama_pair):
    """Mistral's sliding window over the dense layout: the verification's queries see the same keys."""
    hf = tiny_hf("mistral")
    model = ours_from_hf(hf)
    ps = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = Engine(model, page_size=4, num_pages=256, num_speculative_tokens=4).generate(ps, sp)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 30) for p in ps]


@pytest.mark.parametrize("draft_rows", [True, False])
def test_graph_runner_verifies_drafts_as_decode_rows(llama_pair, draft_rows):
    """With a CUDA-graph runner (CPU stand-in graphs): with ``draft_rows`` a step with drafts replays a decode
    graph with a row per position (``shared_seqs`` metadata); without, it runs eagerly. The tokens equal the
    plain engine's either way, greedy and seeded."""
    _, model = llama_pair
    ps = random_prompts(3, seed=6) + LOOPY
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.05, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.1, seed=4, max_tokens=20, ignore_eos=True, frequency_penalty=0.2)]
    plain = Engine(model, page_size=4, num_pages=256).generate(ps, params)
    eng = Engine(model, page_size=4, num_pages=256, num_speculative_tokens=3)
    gr = with_fake_graphs(eng, CUDAGraphRunner, max_batch=32, buckets=[1, 2, 4, 8, 16, 32], draft_rows=draft_rows)
    assert gr._meta(4).shared_seqs is draft_rows
    staged = []
    stage = gr.stage
    gr.stage = lambda batch, gather=None: staged.append(batch.num_tokens - len(batch)) or stage(batch, gather)
    eager = []
    launch = eng.runner.launch
    eng.runner.launch = lambda batch, gather=None: eager.append(batch.num_tokens) or launch(batch, gather)
    outs = eng.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert _drafted(outs)[1] > 0
    assert (max(staged) > 0) is draft_rows  # graph steps with draft rows
    assert staged.count(0) > 0  # and without
    # eager steps: the first (every prompt's prefill), and the verifications when the graphs may not take them
    assert (len(eager) == 1) is draft_rows


def test_config_errors(llama_pair):
    _, model = llama_pair
    for bad in (-1, 33, 1.5, True):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            EngineConfig(num_speculative_tokens=bad)
    for lo, hi in ((0, 4), (3, 2), (1, None)):
        with pytest.raises(ValueError, match="prompt_lookup"):
            EngineConfig(num_speculative_tokens=2, prompt_lookup_min=lo, prompt_lookup_max=hi)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(num_speculative_tokens=2, async_scheduling=True)
    assert not Engine(model, page_size=4, num_pages=64, num_speculative_tokens=2).async_scheduling


def test_hybrid_layout_is_refused(gemma3):
    model = gemma3
    with pytest.raises(ValueError, match="dense KV layout"):
        Engine(model, page_size=4, num_pages=64, num_speculative_tokens=2)
    # over the dense layout the model speculates, and keeps its tokens
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = Engine(model, page_size=4, num_pages=64, kv_layout="dense").generate(LOOPY, sp)
    spec = Engine(model, page_size=4, num_pages=64, kv_layout="dense", num_speculative_tokens=3).generate(LOOPY, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize("penalty", [dict(frequency_penalty=0.5), dict(presence_penalty=0.5),
                                     dict(repetition_penalty=2.0)])
def test_sample_tokens_penalizes_the_draft_before_each_row(penalty):
    """Row j of a drafted request counts the draft's first j tokens as generated: here they flip its greedy
    choice from token 1 to token 2, while row 0 (nothing drafted before it) keeps token 1."""
    from infercore.engine.request import Request
    from infercore.engine.runner import ModelRunner
    from infercore.kv import BlockManager

    runner = ModelRunner(torch.nn.Linear(1, 1), [], BlockManager(4, 4), device=torch.device("cpu"))
    req = Request("r", [3, 4], SamplingParams(temperature=0, **penalty), seed=1)
    req.spec_token_ids = [1, 5]
    logits = torch.tensor([[0.0, 1.0, 0.9, 0, 0, 0, 0, 0]]).repeat(3, 1)
    tokens = runner.sample_tokens([req] * 3, logits, ahead=np.arange(3))
    assert tokens.tolist() == [1, 2, 2]
    assert runner.sample_tokens([req], logits[:1]).tolist() == [1]


def test_shared_seqs_reaches_the_decode_implementation(monkeypatch):
    """``AttentionMetadata.shared_seqs`` goes to a decode implementation that takes it (the Triton kernel then
    reads nothing ahead of its PDL wait), through the public op too (the models that call it: Gemma-3)."""
    import infercore.ops.attention as attn
    from infercore.ops import AttentionMetadata

    seen = []

    def fake(q, k_cache, v_cache, *, seq_lens, block_table, scale, sliding_window=None, softcap=None,
             shared_seqs=False):
        seen.append(shared_seqs)
        return q

    monkeypatch.setattr(attn, "dispatch", lambda op, device: fake)
    q, kc = torch.zeros(2, 2, 8), torch.zeros(4, 4, 1, 8)
    for shared in (False, True):
        meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                                 seq_lens=torch.tensor([3, 4], dtype=torch.int32),
                                 block_table=torch.zeros(2, 1, dtype=torch.int32),
                                 slot_mapping=torch.tensor([2, 3], dtype=torch.int32), max_seqlen_q=1,
                                 max_seqlen_k=4, decode_only=True, shared_seqs=shared)
        attn.paged_attention(q, kc, kc, meta, scale=1.0)
    assert seen == [False, True]
    fn, extra = attn.decode_impl("cpu", quantized=False, shared_seqs=True)
    assert fn is fake and extra == {"shared_seqs": True}


def test_gemma3_dense_graph_rows(gemma3):
    """Gemma-3 (sliding and global layers, softcap-free) over the dense layout, drafts verified as graph rows."""
    model = gemma3
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(model, page_size=4, num_pages=128, kv_layout="dense").generate(LOOPY, sp)
    eng = Engine(model, page_size=4, num_pages=128, kv_layout="dense", num_speculative_tokens=3)
    with_fake_graphs(eng, CUDAGraphRunner, max_batch=16, buckets=[1, 2, 4, 8, 16], draft_rows=True)
    outs = eng.generate(LOOPY, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] and _drafted(outs)[1] > 0
