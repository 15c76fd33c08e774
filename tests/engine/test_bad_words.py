"""``SamplingParams.bad_words``: a tiny random Llama with a byte-level tokenizer (one token per byte, so a word is
its bytes; the outputs kept to lowercase letters with ``allowed_token_ids``, one character a token) and the real
SmolLM2 weights (whose tokenizer writes a word inside a text with its leading space)."""

import pytest
import torch
from engine_helpers import ours_from_hf, serving, tiny_hf
from test_serve_tools import byte_tokenizer

from infercore import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine():
    model = ours_from_hf(tiny_hf("llama", vocab_size=258, max_position_embeddings=1024))
    return Engine(model, byte_tokenizer(), page_size=16, num_pages=128, async_scheduling=False)


LETTERS = list(range(ord("a"), ord("z") + 1))


def _gen(eng, prompt, **kw):
    return eng.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                 allowed_token_ids=LETTERS, **kw))[0]


def test_a_banned_word_never_appears_and_the_rest_is_unchanged(engine):
    prompt = "The weather in Paris is"
    free = _gen(engine, prompt)
    text = free.text
    assert len(text) == 40 and text.isalpha()
    word = text[3:5]  # a two-letter word the free output writes, and a letter it writes
    banned = _gen(engine, prompt, bad_words=[word])
    assert word not in banned.text
    first = text.index(word)
    assert banned.text[:first + 1] == text[:first + 1]  # identical until the word's last byte would come
    assert banned.text != text
    char = next(c for c in text if c.strip() and c != word[0])
    single = _gen(engine, prompt, bad_words=[char])
    assert char not in single.text and single.text[:text.index(char)] == text[:text.index(char)]
    # several words, mixed with a penalty and seeded sampling: none appears in any of the outputs
    outs = engine.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True,
                                                         bad_words=[word, char], frequency_penalty=0.3,
                                                         allowed_token_ids=LETTERS) for s in range(3)])
    for o in outs:
        assert word not in o.text and char not in o.text


def test_bad_words_over_http(engine):
    prompt = "The weather in Paris is"
    text = _gen(engine, prompt).text
    word = text[3:5]
    with serving(engine) as call:
        status, body = call("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                        "ignore_eos": True, "bad_words": [word],
                                                        "allowed_token_ids": LETTERS})
        assert status == 200 and word not in body["choices"][0]["text"]
        status, body = call("POST", "/v1/completions", {"prompt": prompt, "bad_words": "x"})
        assert status == 400 and "bad_words" in body["error"]["message"]


def test_bad_words_refusals(engine):
    with pytest.raises(TypeError, match="bad_words"):
        SamplingParams(bad_words="Paris")
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", "  "])
    bare = Engine(ours_from_hf(tiny_hf("llama")), page_size=16, num_pages=32)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.add_request([1, 2, 3], SamplingParams(bad_words=["a"]))
    spec = Engine(ours_from_hf(tiny_hf("llama", vocab_size=258)), byte_tokenizer(), page_size=16, num_pages=32,
                  num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative"):
        spec.add_request("hi", SamplingParams(bad_words=["a"]))


def test_real_smollm2_answer_without_the_word():
    """SmolLM2 names Paris; banned, "Paris" (the word alone, and " Paris" inside the sentence) never comes."""
    eng = Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=64)
    sp = dict(temperature=0, max_tokens=24)
    q = "What is the capital of France?"
    free = eng.generate([q], SamplingParams(**sp), chat=True)[0].text
    assert "Paris" in free
    ids = eng._bad_word_ids(["Paris"])
    assert len(ids) == 2 and ids[0] != ids[1]  # "Paris" and " Paris", different first tokens
    banned = eng.generate([q], SamplingParams(**sp, bad_words=["Paris"]), chat=True)[0].text
    assert "Paris" not in banned and banned != free
