"""Beam search against transformers' ``generate(num_beams=...)`` on tiny random models: the same hypotheses in the
same order with the same scores (no end-of-sequence token in play), batched over prompts; end-of-sequence
hypotheses and the length penalty on a toy case."""

import pytest
import torch
from engine_helpers import ours_from_hf, tiny_hf

from infercore import Engine


@torch.inference_mode()
def _hf_beams(hf, prompt, width, n, length_penalty=1.0):
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=width, num_return_sequences=width,
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                      length_penalty=length_penalty, early_stopping=False, output_scores=True,
                      return_dict_in_generate=True)
    return [s[len(prompt):].tolist() for s in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("width", [2, 4])
def test_beams_match_transformers(kind, width):
    hf = tiny_hf(kind)
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=256)
    prompts = [[(5 * i + 3 * j) % 96 for j in range(3 + 6 * i)] for i in range(3)]
    n = 8
    results = eng.beam_search(prompts, beam_width=width, max_tokens=n, ignore_eos=True)
    for p, beams in zip(prompts, results):
        want, scores = _hf_beams(hf, p, width, n)
        assert [b.token_ids for b in beams] == want
        for b, s in zip(beams, scores):
            assert b.finish_reason == "length" and len(b.token_ids) == n
            assert b.score == pytest.approx(s, abs=1e-4)
            assert b.score == pytest.approx(b.cumulative_logprob / n, abs=1e-6)
    # the beams' shared prefixes were prefix-cache hits
    assert eng.block_manager.stats.hit_tokens > 0


def test_end_of_sequence_hypotheses_and_length_penalty():
    hf = tiny_hf("llama")
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=256)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free = eng.beam_search(prompt, beam_width=3, max_tokens=6, ignore_eos=True)[0]
    # make the runner-up's first token an end-of-sequence token: a finished hypothesis of one token
    eng._eos = frozenset({free[1].token_ids[0]})
    beams = eng.beam_search(prompt, beam_width=3, max_tokens=6, length_penalty=0.0)[0]
    stopped = [b for b in beams if b.finish_reason == "stop"]
    assert stopped and all(b.token_ids[-1] in eng._eos for b in stopped)
    assert [b.score for b in beams] == sorted((b.score for b in beams), reverse=True)
    for b in beams:
        assert b.score == pytest.approx(b.cumulative_logprob)  # length_penalty 0: the plain sum


def test_errors():
    eng = Engine(ours_from_hf(tiny_hf("llama")), page_size=4, num_pages=64)
    with pytest.raises(ValueError, match="beam_width"):
        eng.beam_search([1, 2, 3], beam_width=0)
    with pytest.raises(ValueError, match="beam_width"):
        eng.beam_search([1, 2, 3], beam_width=11)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.beam_search([1, 2, 3], max_tokens=0)
    with pytest.raises(TypeError, match="length_penalty"):
        eng.beam_search([1, 2, 3], length_penalty="1")
    with pytest.raises(ValueError, match="empty"):
        eng.beam_search([[]])
    with pytest.raises(ValueError, match="finite"):
        eng.beam_search([1, 2, 3], length_penalty=float("nan"))
    with pytest.raises(ValueError, match="lora has 1 entries for 2 prompts"):
        eng.beam_search([[1, 2], [3, 4]], lora=["x"])
    with pytest.raises(ValueError, match="no adapter named"):
        eng.beam_search([1, 2, 3], lora="x")
