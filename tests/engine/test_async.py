"""Async scheduling (step n+1 launched before step n's tokens are read) against the synchronous engine.

On the CPU nothing overlaps, but the bookkeeping is the same as on CUDA: placeholders, the
device-side gather of the previous step's tokens, speculative steps discarded when a request turns
out finished, frozen requests that end by length, preemption while a token is pending, aborts.
"""


import pytest
from engine_helpers import ours_from_hf, random_prompts, tiny_hf, with_fake_graphs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infercore import Engine, SamplingParams
from infercore.engine.graph_runner import CUDAGraphRunner

_MODEL = None
ALPHABET = "abcdef"


def model():
    global _MODEL
    if _MODEL is None:
        _MODEL = ours_from_hf(tiny_hf("llama", num_hidden_layers=1))
    return _MODEL


class LetterTokenizer:
    """Token t decodes to one letter; few letters, so stop strings hit often. Token 5 is EOS."""

    eos_token_ids = {5}
    bos_token_id = None

    def decode(self, ids, *, skip_special_tokens=True):
        return "".join(ALPHABET[t % len(ALPHABET)] for t in ids if not (skip_special_tokens and t == 5))

    def encode(self, text, *, add_special_tokens=True):
        return [ALPHABET.index(c) for c in text]


def run(reqs, *, async_scheduling, aborts=True, tokenizer=None, graphs=0, **cfg):
    """Feed ``reqs`` = [(prompt, params, arrival_step, abort_step)] through an engine (with CPU
    stand-ins for decode graphs of up to ``graphs`` rows); returns the per-request streams of
    outputs and the engine."""
    eng = Engine(model(), tokenizer, page_size=4, async_scheduling=async_scheduling, **cfg)
    if graphs:
        _with_fake_graphs(eng, graphs)
    streams: dict[str, list] = {}
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    added: list[str] = []
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (prompt, params, _, _) = pending.pop(0)
            added.append(eng.add_request(list(prompt), params, request_id=f"r{i}"))
            streams[f"r{i}"] = []
        if aborts:
            for i, (_, _, _, abort_at) in enumerate(reqs):
                if abort_at == step and f"r{i}" in streams:
                    eng.abort(f"r{i}")
        for out in eng.step():
            s = streams[out.request_id]
            assert not (s and s[-1].finished), "output after the request finished"
            s.append(out)
        held = {p for r in eng.scheduler.running for p in eng.block_manager.block_table(r.request_id)}
        assert len(held) + eng.block_manager.num_free_pages <= eng.block_manager.num_pages
        step += 1
        assert step < 3000, "no progress"
    assert eng._inflight is None
    assert eng.block_manager.num_free_pages == eng.block_manager.num_pages, "pages leaked"
    rows = eng.runner.rows
    assert len(rows.free) == rows.tables.shape[0], "runner rows leaked"
    assert not eng.requests
    return streams, eng


def check_stream(outs):
    """Deltas add up to the totals and every output extends the previous one."""
    toks, text = [], ""
    for o in outs:
        assert o.token_ids[: len(toks)] == toks
        toks += o.new_token_ids
        text += o.new_text
        assert o.token_ids == toks
    if outs:
        assert text == outs[-1].text


def params_strategy():
    return st.builds(
        lambda max_tokens, temp, seed, stop, ignore_eos, min_tokens: SamplingParams(
            max_tokens=max_tokens, temperature=temp, seed=seed, stop=stop, ignore_eos=ignore_eos,
            min_tokens=min(min_tokens, max_tokens)),
        max_tokens=st.integers(1, 12),
        temp=st.sampled_from([0.0, 0.0, 0.9]),
        seed=st.integers(0, 3),
        stop=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=2),
        ignore_eos=st.booleans(),
        min_tokens=st.integers(0, 3),
    )  # fmt: skip


request = st.tuples(
    st.lists(st.integers(0, 7), min_size=1, max_size=24),  # small alphabet: prefixes repeat
    params_strategy(),
    st.integers(0, 4),  # arrival step
    st.one_of(st.none(), st.none(), st.integers(0, 8)),  # abort at step (None: never)
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reqs=st.lists(request, min_size=1, max_size=6),
    num_pages=st.integers(9, 40),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 5),
    caching=st.booleans(),
    graphs=st.sampled_from([0, 0, 3]),
)
def test_async_outputs_equal_sync(reqs, num_pages, budget, max_seqs, caching, graphs):
    cfg = dict(num_pages=num_pages, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
               enable_prefix_caching=caching, tokenizer=LetterTokenizer(), graphs=graphs)
    # The reference: no aborts, a roomy pool, synchronous.
    ref, _ = run(reqs, async_scheduling=False, aborts=False, tokenizer=LetterTokenizer(), num_pages=512)
    for a in (False, True):
        streams, _ = run(reqs, async_scheduling=a, **cfg)
        for rid, outs in streams.items():
            check_stream(outs)
            want = ref[rid][-1]
            if outs and outs[-1].finished:
                got = outs[-1]
                assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
                assert len(got.token_ids) <= reqs[int(rid[1:])][1].max_tokens
            else:  # aborted: what it streamed is a prefix of the full answer
                assert reqs[int(rid[1:])][3] is not None
                toks = outs[-1].token_ids if outs else []
                assert toks == want.token_ids[: len(toks)]


def _final(streams):
    return {rid: (s[-1].token_ids, s[-1].finish_reason) for rid, s in streams.items()}


@pytest.mark.parametrize("caching", [False, True])
def test_async_matches_sync_with_preemption(caching):
    ps = random_prompts(8, seed=3, lo=10, hi=20)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reqs = [(p, sp, 0, None) for p in ps]
    sync, _ = run(reqs, async_scheduling=False, num_pages=24, enable_prefix_caching=caching)
    asyn, eng = run(reqs, async_scheduling=True, num_pages=24, enable_prefix_caching=caching)
    assert _final(asyn) == _final(sync)
    assert sum(s[-1].metrics.num_preemptions for s in asyn.values()) > 0


def test_async_prefix_cache_hits_and_same_outputs():
    shared = random_prompts(1, seed=2, lo=30, hi=30)[0]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = [(shared + [i], sp, 3 * i, None) for i in range(4)]
    sync, _ = run(reqs, async_scheduling=False, num_pages=128)
    asyn, _ = run(reqs, async_scheduling=True, num_pages=128)
    assert _final(asyn) == _final(sync)
    assert sum(s[-1].metrics.num_cached_tokens for s in asyn.values()) >= 3 * 28


def test_length_stop_costs_no_extra_step():
    """A request whose last token ends it by length is not scheduled again (no speculative step),
    while one that stops on a token has one step discarded."""
    calls = []
    m = model()
    eng = Engine(m, page_size=4, num_pages=64, async_scheduling=True)
    orig = eng.runner.launch

    def launch(batch, gather=None):
        calls.append(len(batch))
        return orig(batch, gather)

    eng.runner.launch = launch
    p = random_prompts(1, seed=9)[0]
    out = eng.generate([p], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert len(calls) == 5  # one prefill + four decodes, as in the synchronous engine
    stop = out.token_ids[2]
    calls.clear()
    out2 = eng.generate([p], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop]))[0]
    first = out.token_ids.index(stop)
    assert out2.token_ids == out.token_ids[: first + 1] and out2.finish_reason == "stop"
    while eng.has_unfinished():
        eng.step()
    assert len(calls) == first + 2  # the speculative step after the stop token was launched and dropped
    assert eng.block_manager.num_free_pages == 64


def test_outputs_lag_one_call_and_stream_in_order():
    eng = Engine(model(), page_size=4, num_pages=64, async_scheduling=True)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rid = eng.add_request(random_prompts(1, seed=4)[0], sp)
    assert eng.step() == []  # the prefill is launched, its token not read yet
    seen = []
    while eng.has_unfinished():
        for o in eng.step():
            seen.append(o)
    assert [len(o.token_ids) for o in seen] == [1, 2, 3, 4] and seen[-1].finished
    sync = Engine(model(), page_size=4, num_pages=64, async_scheduling=False)
    assert sync.generate([eng_prompt := random_prompts(1, seed=4)[0]], sp)[0].token_ids == seen[-1].token_ids
    assert rid == seen[-1].request_id and eng_prompt


def test_async_repetition_penalty_and_seeded_sampling_match_sync():
    ps = random_prompts(4, seed=8)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=3.0),
              SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=10, seed=6, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    reqs = [(p, sp, i, None) for i, (p, sp) in enumerate(zip(ps, params))]
    sync, _ = run(reqs, async_scheduling=False, num_pages=64)
    asyn, _ = run(reqs, async_scheduling=True, num_pages=64)
    assert _final(asyn) == _final(sync)


def test_async_is_off_by_default_on_cpu():
    assert Engine(model(), page_size=4, num_pages=16).async_scheduling is False
    assert Engine(model(), page_size=4, num_pages=16, async_scheduling=True).async_scheduling is True


def _with_fake_graphs(eng, max_batch):
    return with_fake_graphs(eng, CUDAGraphRunner, max_batch=max_batch, buckets=(1, 2))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_runner_path_matches_eager(async_scheduling):
    ps = random_prompts(7, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.8, seed=1, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0.5, min_p=0.1, top_k=7, seed=2, max_tokens=6, ignore_eos=True)] * 3
    reqs = [(p, sp, i // 2, None) for i, (p, sp) in enumerate(zip(ps, params))]
    want = _final(run(reqs, async_scheduling=False, num_pages=128)[0])
    eng = Engine(model(), page_size=4, num_pages=128, max_num_seqs=6, async_scheduling=async_scheduling)
    gr = _with_fake_graphs(eng, max_batch=5)
    replays = []
    orig = gr.launch
    gr.launch = lambda batch, gather=None: (replays.append(len(batch)), orig(batch, gather))[1]
    for i, (p, sp, _, _) in enumerate(reqs):
        eng.add_request(p, sp, request_id=f"r{i}")
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = (o.token_ids, o.finish_reason)
    assert got == want
    assert replays and max(replays) <= 5 and 3 in replays  # buckets 1,2,5 (3 padded); 6 rows go eager
    assert eng.block_manager.num_free_pages == 128
