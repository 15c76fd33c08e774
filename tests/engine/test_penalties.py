"""Presence / frequency penalties (OpenAI's): the engine's greedy tokens against a loop over transformers'
logits that applies them by hand, in vLLM's order after the repetition penalty; and the tensor-level op."""

import pytest
import torch
from engine_helpers import random_prompts, with_fake_graphs

from infercore import Engine, SamplingParams
from infercore.engine.graph_runner import CUDAGraphRunner
from infercore.ops import apply_presence_frequency_penalty


@torch.inference_mode()
def _hf_penalized_greedy(hf, prompt, n, presence=0.0, frequency=0.0, repetition=1.0):
    out: list[int] = []
    for _ in range(n):
        ids = torch.tensor([prompt + out])
        logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
        if repetition != 1.0:
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(prompt + out)] = True
            logits = torch.where(seen, torch.where(logits < 0, logits * repetition, logits / repetition), logits)
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


CASES = [dict(frequency_penalty=2.0),
         # the order matters here (for this case's prompt): a negative presence penalty lifts seen logits,
         # which the repetition penalty then divides (vLLM's order) instead of multiplying
         dict(presence_penalty=-1.0, repetition_penalty=1.5),
         dict(presence_penalty=1.5), dict(presence_penalty=-0.5, frequency_penalty=1.0),
         dict(frequency_penalty=0.7, repetition_penalty=1.4), dict()]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalized_greedy_matches_a_loop_over_transformers(llama_pair, async_scheduling):
    hf, model = llama_pair
    ps = random_prompts(len(CASES), seed=8)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **c) for c in CASES]
    eng = Engine(model, page_size=4, num_pages=256, max_num_batched_tokens=13, async_scheduling=async_scheduling)
    outs = eng.generate(ps, params)
    plain = eng.generate(ps[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    for p, o, c in zip(ps, outs, CASES):
        want = _hf_penalized_greedy(hf, p, 16, presence=c.get("presence_penalty", 0.0),
                                    frequency=c.get("frequency_penalty", 0.0),
                                    repetition=c.get("repetition_penalty", 1.0))  # fmt: skip
        assert o.token_ids == want, c
    # the penalty changes what the tiny model says (else the comparison above could not fail)
    assert outs[0].token_ids != plain.token_ids


def test_graph_runner_path_applies_the_penalties(llama_pair):
    _, model = llama_pair
    ps = random_prompts(4, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True, presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=0.5,
                             repetition_penalty=1.2)]
    want = [o.token_ids for o in Engine(model, page_size=4, num_pages=128).generate(ps, params)]
    eng = Engine(model, page_size=4, num_pages=128, max_num_seqs=4, async_scheduling=True)
    gr = with_fake_graphs(eng, CUDAGraphRunner, max_batch=4, buckets=(1, 2))
    replays = []
    orig = gr.launch
    gr.launch = lambda batch, gather=None: (replays.append(len(batch)), orig(batch, gather))[1]
    assert [o.token_ids for o in eng.generate(ps, params)] == want
    assert replays


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value, err", [(2.5, ValueError), (-2.01, ValueError), (float("nan"), ValueError),
                                        ("1", TypeError), (None, TypeError)])
def test_bad_penalties_name_the_field(field, value, err):
    with pytest.raises(err, match=field):
        SamplingParams(**{field: value})


def test_presence_frequency_op():
    logits = torch.randn(3, 10, dtype=torch.bfloat16)
    out = torch.tensor([[1, 1, 4, -1], [-1, -1, -1, -1], [9, 0, 9, 9]], dtype=torch.int32)
    got = apply_presence_frequency_penalty(logits, out, torch.tensor([0.5, 1.0, -1.0]), 0.25)
    want = logits.float().clone()
    want[0, 1] -= 0.5 + 2 * 0.25
    want[0, 4] -= 0.5 + 0.25
    want[2, 9] -= -1.0 + 3 * 0.25
    want[2, 0] -= -1.0 + 0.25
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("args, err, match", [
    ((torch.zeros(2, 5), torch.zeros(3, 1, dtype=torch.long), 0.0, 0.0), ValueError, "output_tokens"),
    ((torch.zeros(2, 5), torch.zeros(2, 1), 0.0, 0.0), TypeError, "output_tokens"),
    ((torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), 0.0, 0.0), ValueError, "output_tokens"),
    ((torch.zeros(2, 5), torch.zeros(2, 1, dtype=torch.long), float("inf"), 0.0), ValueError, "presence"),
    ((torch.zeros(2, 5), torch.zeros(2, 1, dtype=torch.long), 0.0, torch.zeros(3)), ValueError, "frequency"),
    ((torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), 0.0, 0.0), TypeError, "logits"),
])
def test_presence_frequency_op_bad_inputs(args, err, match):
    with pytest.raises(err, match=match):
        apply_presence_frequency_penalty(*args)
