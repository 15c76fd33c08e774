"""Speculative decoding with a draft model: the target's tokens are exactly those of the engine without drafts
(greedy and seeded sampling, batched, with preemption), whatever the draft; a draft equal to the target has every
greedy draft token accepted; on the real SmolLM2 weights too."""

import pytest
import torch
from engine_helpers import hf_greedy, ours_from_hf, random_prompts, tiny_hf

from infercore import Engine, SamplingParams


def _draft(layers=1, seed=5):
    hf = tiny_hf("llama", num_hidden_layers=layers)
    torch.manual_seed(seed)
    with torch.no_grad():  # other weights than the target's
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ours_from_hf(hf)


def _run(eng, prompts, params):
    return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("k", [1, 3])
def test_outputs_equal_the_engine_without_drafts(k):
    hf = tiny_hf("llama")
    prompts = random_prompts(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, max_tokens=17, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=25, ignore_eos=True)] * 2
    want = _run(Engine(ours_from_hf(hf), page_size=4, num_pages=256), prompts, params)
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=256, num_speculative_tokens=k, draft_model=_draft())
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert want[0] == hf_greedy(hf, prompts[0], 20)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > 0 and eng.draft.proposed >= drafted


def test_draft_equal_to_the_target_is_always_accepted():
    hf = tiny_hf("llama")
    prompts = random_prompts(4, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=256, num_speculative_tokens=4,
                 draft_model=ours_from_hf(hf))
    outs = eng.generate(prompts, sp)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 24)
        m = o.metrics
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens
    # the shadows of finished requests are freed at the next proposal
    eng.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(eng.draft.shadows) <= 1 and eng.draft.bm.num_free_pages >= eng.draft.bm.num_pages - 16


def test_tight_pools_preempt_and_still_match():
    """Target and draft pools of 24 pages of 4 tokens for 6 requests of up to 60 tokens: requests are preempted,
    shadows freed and rebuilt; the tokens stay the plain engine's."""
    hf = tiny_hf("llama")
    prompts = random_prompts(6, seed=21, lo=20, hi=30)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _run(Engine(ours_from_hf(hf), page_size=4, num_pages=256), prompts, sp)
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=24, num_speculative_tokens=3, draft_model=_draft(2))
    outs = eng.generate(prompts, sp)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_errors():
    hf = tiny_hf("llama")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(ours_from_hf(hf), page_size=4, num_pages=32, draft_model=_draft())
    with pytest.raises(TypeError, match="draft_model"):
        Engine(ours_from_hf(hf), page_size=4, num_pages=32, num_speculative_tokens=2, draft_model="x")
    other = ours_from_hf(tiny_hf("llama", vocab_size=128))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(ours_from_hf(hf), page_size=4, num_pages=32, num_speculative_tokens=2, draft_model=other)


def test_real_smollm2_drafting_for_itself():
    """SmolLM2-135M drafting for itself (fp32, the only real checkpoint here): the answer equals plain greedy
    decoding and nearly every draft token is kept (a batched verification rounds like a one-token step, or
    nearly)."""
    from infercore.loading import default_model_path

    plain = Engine.from_pretrained(device="cpu", dtype=torch.float32)
    spec = Engine.from_pretrained(device="cpu", dtype=torch.float32, num_speculative_tokens=4,
                                  draft_model=str(default_model_path()))
    sp = SamplingParams(temperature=0, max_tokens=40)
    q = ["What is the capital of France?", "Write a haiku about the sea."]
    want = plain.generate(q, sp, chat=True)
    got = spec.generate(q, sp, chat=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in got) >= 0.9 * drafted


def test_cli_generate_with_a_draft_model(capsys):
    from infercore import cli
    from infercore.loading import default_model_path

    args = ["generate", "What is 2 + 2?", "--device", "cpu", "--dtype", "float32", "--max-tokens", "8"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out
    assert cli.main(args + ["--num-speculative-tokens", "3", "--draft-model", str(default_model_path())]) == 0
    assert capsys.readouterr().out == plain
    assert cli.main(args + ["--draft-model", str(default_model_path())]) == 2  # no --num-speculative-tokens
    assert cli.main(args + ["--num-speculative-tokens", "3", "--draft-model", str(default_model_path()),
                            "--tensor-parallel", "3"]) == 2
