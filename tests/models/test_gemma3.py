"""Gemma 3 (text) against transformers' Gemma3ForCausalLM: logits, greedy decoding through the
engine in every KV layout, chunked prefill, prefix-cache hits and sliding pages being freed."""

import random

import pytest
import torch
from hybrid_harness import engine_prefill_logits, hf_greedy, hf_logits

from infercore import Engine, SamplingParams
from infercore.kv.hybrid import PAD_PAGE
from infercore.models import Gemma3Config, build_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
WINDOW = 7


def _prompts(n, seed, lo=9, hi=30, vocab=96):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tiny_pair():
    """A tiny random transformers Gemma 3 (two sliding layers, a global one, softcapped logits) and ours with its
    weights."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=12, final_logit_softcapping=5.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial 1+w norms and spread logits (greedy far from ties)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        hf.model.embed_tokens.weight.mul_(4.0)
    ours = build_model(Gemma3Config.from_hf(cfg.to_dict()), dtype=torch.float32, device="cpu", init="empty")
    ours.load_weights(hf.state_dict().items())
    return hf, ours


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def test_config_from_hf_reads_per_type_rope(pair):
    hf, ours = pair
    cfg = ours.config
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling["factor"] == 2.0
    assert cfg.rope_local_theta == 100.0 and cfg.rope_local_scaling is None
    assert [s.sliding_window for s in ours.kv_specs()] == [WINDOW, WINDOW, None, WINDOW]
    with pytest.raises(ValueError, match="model_type"):
        Gemma3Config.from_hf({"model_type": "llama"})


@pytest.mark.parametrize("layout", ["dense", "multi"])
def test_prefill_logits_match(pair, layout):
    hf, ours = pair
    ps = _prompts(3, seed=1)
    eng = Engine(ours, page_size=4, num_pages=64, kv_layout=layout)
    for p, got in zip(ps, engine_prefill_logits(eng, ps)):
        torch.testing.assert_close(got, hf_logits(hf, p), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["dense", "multi", "uniform"])
def test_batched_chunked_greedy_matches_transformers(pair, layout):
    hf, ours = pair
    ps = _prompts(3, seed=2)
    # page 4 and an 11-token budget: prompts are chunked and mixed with decodes.
    eng = Engine(ours, page_size=4, num_pages=96, max_num_batched_tokens=11, kv_layout=layout)
    assert eng.kv_layout == layout
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 32)
    if layout != "dense":
        eng.block_manager.check_invariants()
        assert eng.block_manager.memory()["used"] == 0


def test_prefix_hit_gives_same_tokens(pair):
    hf, ours = pair
    shared = _prompts(1, seed=3, lo=22, hi=22)[0]
    a, b = shared + [5, 6, 7], shared + [8, 9]
    eng = Engine(ours, page_size=4, num_pages=96)
    assert eng.kv_layout == "multi"  # auto: sliding layers -> multi-granularity pages
    first = eng.generate([a], GREEDY)[0]
    second = eng.generate([b], GREEDY)[0]
    third = eng.generate([a], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 20  # the shared 22 tokens' 5 full pages
    assert third.metrics.num_cached_tokens == 24
    assert second.token_ids == hf_greedy(hf, b, 32)
    assert third.token_ids == first.token_ids == hf_greedy(hf, a, 32)


def test_sliding_pages_are_released(pair):
    _, ours = pair
    prompt = _prompts(1, seed=4, lo=40, hi=40)[0]
    eng = Engine(ours, page_size=4, num_pages=96, enable_prefix_caching=False)
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()
    bm = eng.block_manager
    sliding = [g.index for g in bm.layout.groups if g.kind == "sliding"]
    full = [g.index for g in bm.layout.groups if g.kind == "full"]
    assert len(sliding) == 1 and len(full) == 1
    table = bm.block_table(rid, sliding[0])
    assert table.count(PAD_PAGE) >= (41 - WINDOW) // 4  # only the window's pages are held
    assert PAD_PAGE not in bm.block_table(rid, full[0])
    while eng.has_unfinished():
        eng.step()
    bm.check_invariants()
