import math

import numpy as np
import pytest
import torch
from engine_helpers import adopt_and_finish, hf_greedy, ours_from_hf, random_prompts, tiny_hf

from infercore import Engine, SamplingParams
from infercore.models import ModelConfig, build_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_batched_chunked_greedy_matches_transformers(kind):
    hf = tiny_hf(kind)
    ps = random_prompts(4, seed=1, hi=40)
    # page 4 and an 11-token budget: prompts are chunked across steps and mixed with decodes.
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=256, max_num_batched_tokens=11)
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 32)
        assert o.finish_reason == "length"
    assert eng.block_manager.num_free_pages == 256


def test_prefix_cache_hit_gives_same_tokens(llama_pair):
    hf, model = llama_pair
    shared = random_prompts(1, seed=2, lo=30, hi=30)[0]
    a, b = shared + [5, 6, 7], shared + [8, 9]
    eng = Engine(model, page_size=4, num_pages=128)
    first = eng.generate([a], GREEDY)[0]
    second = eng.generate([b], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 28  # 7 full pages of the shared 30 tokens
    assert first.token_ids == hf_greedy(hf, a, 32)
    assert second.token_ids == hf_greedy(hf, b, 32)
    # the whole prompt cached: the last token is still recomputed to get logits
    third = eng.generate([a], GREEDY)[0]
    assert third.metrics.num_cached_tokens == 32 and third.token_ids == first.token_ids


def test_identical_prompts_are_prefilled_once(llama_pair):
    hf, model = llama_pair
    prompt = random_prompts(1, seed=21, lo=37, hi=37)[0]
    eng = Engine(model, page_size=4, num_pages=128)
    outs = eng.generate([prompt] * 4, GREEDY)
    # the first computes the prompt; the others wait for its 9 full pages and take them as a hit
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 36, 36, 36]
    want = hf_greedy(hf, prompt, 32)
    assert all(o.token_ids == want for o in outs)
    assert eng.block_manager.num_free_pages == 128  # free or evictable: nothing leaked
    # without prefix caching every copy computes its prompt (nothing to wait for)
    plain = Engine(model, page_size=4, num_pages=128, enable_prefix_caching=False).generate([prompt] * 4, GREEDY)
    assert [o.metrics.num_cached_tokens for o in plain] == [0] * 4
    assert all(o.token_ids == want for o in plain)


def test_shared_prefix_wait_lets_later_requests_pass(llama_pair):
    _, model = llama_pair
    sys_prompt = random_prompts(1, seed=22, lo=32, hi=32)[0]
    a, b, c = sys_prompt + [1, 2, 3], sys_prompt + [4, 5], random_prompts(1, seed=23, lo=20, hi=20)[0]
    eng = Engine(model, page_size=4, num_pages=128, max_num_batched_tokens=512)
    for rid, p in (("a", a), ("b", b), ("c", c)):
        eng.add_request(p, GREEDY, request_id=rid)
    first = eng.scheduler.schedule()
    # b shares a's 8 full pages, more than half of what it would compute: it waits, and c goes past it
    assert [r.request_id for r in first.requests] == ["a", "c"]
    eng._process(eng._launch(first, None))
    second = eng.scheduler.schedule()
    assert second.requests[-1].request_id == "b" and second.num_new_tokens[-1] == 2
    assert second.requests[-1].metrics.num_cached_tokens == 32


def test_short_shared_prefix_does_not_wait(llama_pair):
    _, model = llama_pair
    head = random_prompts(1, seed=24, lo=4, hi=4)[0]
    a = head + random_prompts(1, seed=25, lo=30, hi=30)[0]
    b = head + random_prompts(1, seed=26, lo=30, hi=30)[0]
    eng = Engine(model, page_size=4, num_pages=128)
    eng.add_request(a, GREEDY, request_id="a")
    eng.add_request(b, GREEDY, request_id="b")
    # one shared page of the 34 tokens b has to compute: not worth a wait, both prefill at once
    assert [r.request_id for r in eng.scheduler.schedule().requests] == ["a", "b"]


def test_sampled_copies_of_one_prompt_differ_and_share_the_prefill(llama_pair):
    _, model = llama_pair
    prompt = random_prompts(1, seed=27, lo=40, hi=40)[0]
    eng = Engine(model, page_size=4, num_pages=128)
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in range(4)]
    outs = eng.generate([prompt] * 4, sps)
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 36, 36, 36]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    alone = Engine(model, page_size=4, num_pages=128).generate([prompt], sps[2])[0]
    assert outs[2].token_ids == alone.token_ids  # seeded: the same tokens as the copy run by itself


def test_preemption_keeps_outputs(llama_pair):
    _, model = llama_pair
    ps = random_prompts(6, seed=3, lo=10, hi=20)
    ref = Engine(model, page_size=4, num_pages=512).generate(ps, GREEDY)
    eng = Engine(model, page_size=4, num_pages=24, enable_prefix_caching=False)
    outs = eng.generate(ps, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.block_manager.num_free_pages == 24


def test_seeded_sampling_is_independent_of_batch(llama_pair):
    _, model = llama_pair
    ps = random_prompts(4, seed=4, hi=40)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=123, max_tokens=16, ignore_eos=True)
    alone = Engine(model, num_pages=64).generate([ps[0]], sp)[0].token_ids
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=10) for i in range(3)]
    mixed = Engine(model, num_pages=64).generate(ps, [sp] + others)[0].token_ids
    assert alone == mixed
    unseeded = [Engine(model, num_pages=64).generate([ps[0]], SamplingParams(temperature=1.0, max_tokens=16,
                                                                             ignore_eos=True))[0].token_ids
                for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_stop_token_ids_and_max_tokens(llama_pair):
    hf, model = llama_pair
    p = random_prompts(1, seed=5, hi=40)[0]
    ref = hf_greedy(hf, p, 32)
    stop = ref[5]
    first = ref.index(stop)
    eng = Engine(model, num_pages=64)
    out = eng.generate([p], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: first + 1]
    out = eng.generate([p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == ref[:3]


def test_abort_frees_pages(llama_pair):
    _, model = llama_pair
    eng = Engine(model, page_size=4, num_pages=64)
    a = eng.add_request(random_prompts(1, seed=6, hi=40)[0], GREEDY)
    b = eng.add_request(random_prompts(1, seed=7, hi=40)[0], GREEDY)
    eng.step()
    eng.step()
    eng.abort(a)
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == [b]
    assert eng.block_manager.num_free_pages == 64


@pytest.mark.parametrize(
    "prompt, params, err",
    [
        ([], None, ValueError),
        ([1] * 300, None, ValueError),  # longer than max_position_embeddings=256
        ([1, 2, 500], None, ValueError),  # outside the vocabulary
        ("text", None, ValueError),  # no tokenizer
        (3.5, None, TypeError),
    ],
)
def test_bad_requests_are_rejected_and_others_keep_going(llama_pair, prompt, params, err):
    hf, model = llama_pair
    eng = Engine(model, num_pages=64)
    good = eng.add_request([1, 2, 3], GREEDY)
    with pytest.raises(err):
        eng.add_request(prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == [good]
    assert outs[0].token_ids == hf_greedy(hf, [1, 2, 3], 32)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
     ("min_p", 2.0), ("repetition_penalty", 0.0), ("max_tokens", 0), ("temperature", math.inf)],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_request_too_big_for_pool(llama_pair):
    _, model = llama_pair
    eng = Engine(model, page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="KV pages"):
        eng.add_request([1] * 10, SamplingParams(max_tokens=32))


def test_repetition_penalty_changes_greedy_output(llama_pair):
    _, model = llama_pair
    p = random_prompts(1, seed=8, hi=40)[0]
    eng = Engine(model, num_pages=64)
    plain = eng.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
    pen = eng.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                           repetition_penalty=5.0))[0].token_ids
    assert plain != pen
    assert len(set(pen)) >= len(set(plain))


def test_kv_pool_dtype_and_device_follow_model(llama_pair):
    _, model = llama_pair
    eng = Engine(model, num_pages=8)
    k, v = eng.runner.kv_caches[0]
    assert k.dtype == torch.float32 and k.shape[1] == 16 and k.device.type == "cpu"


def test_sampling_logits_keep_the_model_dtype_and_the_tokens():
    from infercore.engine.runner import sampling_logits
    from infercore.ops import SamplingTensors, sample

    model = build_model(ModelConfig.from_hf(tiny_hf().config.to_dict()), dtype=torch.bfloat16, device="cpu")
    hidden = torch.randn(5, 32, dtype=torch.bfloat16)
    narrow = sampling_logits(model, hidden)
    assert narrow.dtype == torch.bfloat16 and model.compute_logits(hidden).dtype == torch.float32
    torch.testing.assert_close(narrow.float(), model.compute_logits(hidden), rtol=0, atol=0)

    class Fp32Only(torch.nn.Module):  # a model without the keyword keeps being called without it
        def compute_logits(self, h):
            return model.compute_logits(h)

    assert sampling_logits(Fp32Only(), hidden).dtype == torch.float32
    params = SamplingTensors(
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9]), top_k=torch.tensor([0, 5, 0, 20, 3], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0]), min_p=torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0]),
        repetition_penalty=torch.ones(5), seeds=torch.arange(5) + 11,
        offsets=torch.full((5,), 3),
    )
    assert torch.equal(sample(narrow, params), sample(narrow.float(), params))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 95, 223])
def test_sampling_parameter_rows_start_16_byte_aligned(llama_pair, n):
    """Triton specializes pointers on 16-byte alignment: packed [k, n] parameter blocks whose rows start
    at n * 4 or n * 8 bytes compiled the sampling kernel again for odd batches in the middle of serving."""
    from infercore.engine.runner import sampling_tensors

    _, model = llama_pair
    eng = Engine(model, num_pages=64, max_num_seqs=256)
    params = [SamplingParams(temperature=0.5 + i / 1000, top_p=0.9, top_k=i % 7, seed=i, max_tokens=4)
              for i in range(n)]
    for i, sp in enumerate(params):
        eng.add_request([1 + i % 90, 2, 3], sp)
    reqs = list(eng.scheduler.waiting)
    rows = np.array([eng.runner.rows.assign(r) for r in reqs], dtype=np.int64)
    built = [sampling_tensors(reqs, torch.device("cpu")),
             eng.runner.row_sampling_tensors(rows, np.array([r.num_tokens for r in reqs], dtype=np.int64))]
    for st in built:
        fields = (st.temperature, st.top_p, st.min_p, st.repetition_penalty, st.seeds, st.offsets, st.top_k)
        assert all(t.shape == (n,) for t in fields)
        assert all(t.data_ptr() % 16 == 0 for t in fields), [t.data_ptr() % 16 for t in fields]
        torch.testing.assert_close(st.temperature, torch.tensor([p.temperature for p in params]))
        assert st.seeds.tolist() == list(range(n)) and st.top_k.tolist() == [i % 7 for i in range(n)]
        assert st.offsets.tolist() == [0] * n


def test_gc_freeze_follows_the_config(llama_pair):
    import gc

    _, model = llama_pair
    gc.unfreeze()
    try:
        Engine(model, num_pages=16)  # CPU default: the process's collector is left alone
        assert gc.get_freeze_count() == 0
        eng = Engine(model, num_pages=16, gc_freeze=True)
        assert gc.get_freeze_count() > 0
        assert eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].token_ids
        # frozen, an engine is only freed by reference counting: it must hold no reference cycle
        import weakref

        ref = weakref.ref(eng)
        del eng
        assert ref() is None
    finally:
        gc.unfreeze()


def test_chunked_prompt_longer_than_the_host_table_matches_transformers(llama_pair):
    # A prompt's pages are all allocated at admission, but a chunk needs only some: a 200-token prompt in
    # 16-token chunks holds 50 pages of 4 while the host block table starts 16 pages wide. (Copying every
    # allocated page into the narrower table raised a broadcast ValueError.)
    hf, model = llama_pair
    eng = Engine(model, page_size=4, num_pages=256, max_num_batched_tokens=16)
    ps = [[(3 * j + i) % 96 for j in range(200 - 37 * i)] for i in range(3)]
    outs = eng.generate(ps, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 6)
    assert eng.block_manager.num_free_pages == 256


def test_prefix_kv_moves_between_engines(llama_pair):
    # Engine.read_prefix_kv / write_prefix_kv: the KV one engine computed, written into another engine's prefix
    # cache, is taken there as a cache hit, and the tokens are those of computing it. Requests taken out mid-run
    # (take_requests) move with their KV the same way.
    hf, model = llama_pair
    prompts = [[(3 * i + 5 * j) % 96 for j in range(9 + 6 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in Engine(model, page_size=4, num_pages=64).generate(prompts, greedy)]
    a = Engine(model, page_size=4, num_pages=64)
    b = Engine(model, page_size=4, num_pages=64)
    a.generate(prompts[:1], greedy)
    n, kv = a.read_prefix_kv(prompts[0])
    assert n == 8 and len(kv) == 2 and kv[0][0].shape == (8, 2, 8)
    assert b.write_prefix_kv(prompts[0], kv) == 8
    assert b.write_prefix_kv(prompts[0], kv) == 8  # already cached: kept
    out = b.generate(prompts[:1], greedy)[0]
    assert out.metrics.num_cached_tokens == 8 and out.token_ids == want[0]
    # the hit reads what was written: zeroed KV gives other log-probabilities
    c = Engine(model, page_size=4, num_pages=64)
    assert c.write_prefix_kv(prompts[0], [(k * 0, v * 0) for k, v in kv]) == 8
    lp = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    zeroed = c.generate(prompts[:1], lp)[0]
    fresh = Engine(model, page_size=4, num_pages=64).generate(prompts[:1], lp)[0]
    assert zeroed.metrics.num_cached_tokens == 8 and zeroed.cumulative_logprob != fresh.cumulative_logprob
    with pytest.raises(ValueError, match="layers"):
        b.write_prefix_kv(prompts[0], kv[:1])
    with pytest.raises(TypeError, match="pairs"):
        b.write_prefix_kv(prompts[0], [kv[0][0]])
    assert b.read_prefix_kv([95, 94, 93, 92, 91]) == (0, [])
    # mid-run: KV first, then the requests
    ids = [a.add_request(p, greedy) for p in prompts]
    for _ in range(4):
        a.step()
    taken = a.take_requests()
    moved = 0
    for req in taken:
        n, kv = a.read_prefix_kv(req.all_token_ids)
        moved += b.write_prefix_kv(req.all_token_ids, kv)
    assert moved > sum(len(p) for p in prompts) // 2
    assert adopt_and_finish(b, taken, ids) == want
    # no prefix caching, no transfer
    plain = Engine(model, page_size=4, num_pages=64, enable_prefix_caching=False)
    assert plain.read_prefix_kv(prompts[0]) == (0, []) and plain.write_prefix_kv(prompts[0], kv) == 0
