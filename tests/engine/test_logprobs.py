"""``SamplingParams.logprobs``: per-token log-probabilities of the model's own distribution, checked against
transformers (teacher-forced over the tokens the engine generated), and ``ops.token_logprobs``."""

import pytest
import torch
from engine_helpers import random_prompts, with_fake_graphs

from infercore import Engine, SamplingParams
from infercore.engine.graph_runner import CUDAGraphRunner
from infercore.engine.params import MAX_LOGPROBS
from infercore.ops import token_logprobs


@torch.inference_mode()
def _hf_logprobs(hf, prompt, generated):
    """transformers' log_softmax over the vocabulary at each generated position ``[len(generated), V]``."""
    ids = torch.tensor([prompt + generated])
    logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1)


def _check(out, want, k):
    """``out``'s logprobs against transformers' ``want`` ``[n, V]``: the sampled tokens' values, the top-k
    ids and values, and the cumulative sum."""
    assert len(out.logprobs) == len(out.token_ids) == want.shape[0]
    total = 0.0
    for pos, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        assert next(iter(d)) == tok  # the sampled token comes first
        assert d[tok] == pytest.approx(want[pos, tok].item(), abs=2e-4)
        total += d[tok]
        top_v, top_i = want[pos].topk(k)
        others = {t: v for t, v in d.items() if t != tok}
        # the dict holds the top k (the sampled one among them or not) and nothing else
        assert set(d) == set(top_i.tolist()) | {tok}
        for t, v in zip(top_i.tolist(), top_v.tolist()):
            assert d[t] == pytest.approx(v, abs=2e-4)
        assert len(others) in (k - 1, k)
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_logprobs_match_transformers(llama_pair, async_scheduling):
    hf, model = llama_pair
    ps = random_prompts(5, seed=3)
    ks = [0, 3, None, MAX_LOGPROBS, 1]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=k) for k in ks]
    # page 4 and a 13-token budget: prompts are chunked and mixed with decodes
    eng = Engine(model, page_size=4, num_pages=256, max_num_batched_tokens=13, async_scheduling=async_scheduling)
    outs = eng.generate(ps, params)
    for p, o, k in zip(ps, outs, ks):
        if k is None:
            assert o.logprobs is None and o.cumulative_logprob is None
            continue
        want = _hf_logprobs(hf, p, o.token_ids)
        assert o.token_ids == want.argmax(-1).tolist()  # greedy: the sampled token is the top one
        _check(o, want, k)


def test_sampled_logprobs_are_the_raw_distribution(llama_pair):
    """With temperature and filters the reported values are still log_softmax of the raw logits."""
    hf, model = llama_pair
    p = random_prompts(1, seed=4)[0]
    sp = SamplingParams(temperature=1.7, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=5, max_tokens=10,
                        ignore_eos=True, logprobs=2)  # fmt: skip
    out = Engine(model, page_size=4, num_pages=64).generate([p], sp)[0]
    _check(out, _hf_logprobs(hf, p, out.token_ids), 2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_runner_path_reports_the_same_logprobs(llama_pair, async_scheduling):
    _, model = llama_pair
    ps = random_prompts(4, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=4),
              SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.5, seed=2, max_tokens=8, ignore_eos=True, logprobs=2)]
    want = Engine(model, page_size=4, num_pages=128).generate(ps, params)
    eng = Engine(model, page_size=4, num_pages=128, max_num_seqs=4, async_scheduling=async_scheduling)
    gr = with_fake_graphs(eng, CUDAGraphRunner, max_batch=4, buckets=(1, 2))
    replays = []
    orig = gr.launch
    gr.launch = lambda batch, gather=None: (replays.append(len(batch)), orig(batch, gather))[1]
    got = eng.generate(ps, params)
    assert replays  # the decode steps went through the graph runner
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        if w.logprobs is None:
            assert g.logprobs is None
            continue
        assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]
        for dg, dw in zip(g.logprobs, w.logprobs):
            assert list(dg.values()) == pytest.approx(list(dw.values()), abs=1e-5)


def test_streamed_outputs_carry_this_steps_logprobs(llama_pair):
    _, model = llama_pair
    eng = Engine(model, page_size=4, num_pages=64)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    rid = eng.add_request(random_prompts(1, seed=7)[0], sp)
    seen = []
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == rid and len(o.logprobs) == len(o.token_ids)
            seen += o.logprobs[len(o.logprobs) - len(o.new_token_ids):]
    assert len(seen) == 6 and seen == o.logprobs


@pytest.mark.parametrize("value, err", [(-1, ValueError), (MAX_LOGPROBS + 1, ValueError), (2.0, TypeError),
                                        (True, TypeError), ("3", TypeError)])
def test_bad_logprobs_name_the_field(value, err):
    with pytest.raises(err, match="logprobs"):
        SamplingParams(logprobs=value)


def test_token_logprobs_op():
    torch.manual_seed(0)
    logits = torch.randn(3, 50, dtype=torch.bfloat16) * 4
    tokens = torch.tensor([0, 49, 7])
    picked, top, ids = token_logprobs(logits, tokens, 5)
    ref = logits.float().log_softmax(-1)
    assert picked.dtype == top.dtype == torch.float32 and ids.dtype == torch.int64
    torch.testing.assert_close(picked, ref[torch.arange(3), tokens])
    torch.testing.assert_close(top, ref.topk(5).values)
    torch.testing.assert_close(ref.gather(1, ids), top)
    p0, t0, i0 = token_logprobs(logits, tokens.int(), 0)
    torch.testing.assert_close(p0, picked)
    assert t0.shape == i0.shape == (3, 0)


@pytest.mark.parametrize("args, err, match", [
    ((torch.zeros(2, 5), torch.zeros(3, dtype=torch.long), 1), ValueError, "tokens"),
    ((torch.zeros(2, 5), torch.zeros(2), 1), TypeError, "tokens"),
    ((torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), 6), ValueError, "num_top"),
    ((torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), -1), ValueError, "num_top"),
    ((torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), 1.0), TypeError, "num_top"),
    ((torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long), 1), TypeError, "logits"),
    ((torch.zeros(5), torch.zeros(1, dtype=torch.long), 1), ValueError, "logits"),
])
def test_token_logprobs_bad_inputs(args, err, match):
    with pytest.raises(err, match=match):
        token_logprobs(*args)


@pytest.mark.parametrize("chunk", [5, 64])
def test_prompt_logprobs_match_transformers(llama_pair, chunk):
    """``SamplingParams.prompt_logprobs``: every prompt position's log-probability and top ones equal transformers'
    log_softmax, through chunked prefills (5-token steps) and mixed with other requests, and a request sharing a
    cached prefix still computes (and reports) every position."""
    hf, ours = llama_pair
    prompts = random_prompts(3, seed=11)
    shared = prompts[0] + [7, 8, 9]  # the first prompt's pages are in the prefix cache by then
    eng = Engine(ours, page_size=4, num_pages=96, max_num_batched_tokens=chunk, enable_prefix_caching=True)
    eng.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    outs = eng.generate([prompts[1], shared, prompts[2]],
                        [sp, sp, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert outs[2].prompt_logprobs is None
    assert outs[1].metrics.num_cached_tokens == 0  # no prefix hit for a request that reports its prompt
    for prompt, out in zip([prompts[1], shared], outs[:2]):
        with torch.inference_mode():
            want = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for pos in range(1, len(prompt)):
            d, tok = plp[pos], prompt[pos]
            assert next(iter(d)) == tok and d[tok] == pytest.approx(want[pos - 1, tok].item(), abs=2e-4)
            top_v, top_i = want[pos - 1].topk(3)
            assert set(d) == set(top_i.tolist()) | {tok}
            for t, v in zip(top_i.tolist(), top_v.tolist()):
                assert d[t] == pytest.approx(v, abs=2e-4)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)
