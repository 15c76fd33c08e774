"""Guided decoding: the output constrained to a regex, a list of choices or a JSON schema, on the real SmolLM2
weights, in a batch with unguided requests, streamed, moved between engines; and the token guide on a toy
vocabulary."""

import json
import pickle
import re

import pytest
import torch

from infercore import Engine, SamplingParams
from infercore.engine.fsm import CharDFA
from infercore.engine.guided import TokenGuide

PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "[A-Z][a-z]{1,10}"},
                                           "age": {"type": "integer"}, "student": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=128)


def test_toy_vocabulary_masks():
    strings = ["a", "b", "ab", "abc", "c", None, "1", "12", "x1"]
    eos = 9
    g = TokenGuide(r"ab?c|1+", strings, [eos])
    s0 = g.dfa.start
    assert g.allowed(s0) == [0, 2, 3, 6]  # "a", "ab", "abc", "1": each a prefix of a match ("12" is not)
    s1 = g.advance(s0, [6])  # "1": a whole match, more 1s may follow
    assert g.allowed(s1) == [6, eos]
    s2 = g.advance(s0, [3])  # "abc": nothing may follow
    assert g.allowed(s2) == [eos]
    assert g.advance(s0, [1]) == -1 and g.allowed(-1) == [eos]  # "b" leaves the language: end it
    logits = torch.zeros(2, 12)
    g.mask_(logits, 1, s1)
    assert torch.isinf(logits[1]).sum() == 10 and not torch.isinf(logits[0]).any()
    assert logits[1, 6] == 0 and logits[1, eos] == 0


def test_choice_regex_and_json_outputs(engine):
    prompts = ["Is the sky blue? Answer yes or no.", "Give me a phone number.",
               "Describe a person as JSON with name, age and student.", "Write a JSON object about a cat.",
               "What is the capital of France?"]
    params = [SamplingParams(temperature=0, max_tokens=8, guided_choice=["yes", "no", "maybe so"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, guided_regex=r"\d{3}-\d{4}"),
              SamplingParams(temperature=0, max_tokens=60, guided_json=PERSON),
              SamplingParams(temperature=0.7, seed=5, max_tokens=80, guided_json=True),
              SamplingParams(temperature=0, max_tokens=12)]
    outs = engine.generate(prompts, params, chat=True)
    assert outs[0].text in ("yes", "no", "maybe so") and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"\d{3}-\d{4}", outs[1].text) and outs[1].finish_reason == "stop"
    person = json.loads(outs[2].text)
    assert list(person) == ["name", "age", "student"]
    assert re.fullmatch("[A-Z][a-z]{1,10}", person["name"]) and type(person["age"]) is int
    assert type(person["student"]) is bool
    if outs[3].finish_reason == "stop":  # any JSON object, unless it ran out of tokens
        assert isinstance(json.loads(outs[3].text), dict)
    else:
        assert outs[3].text.startswith("{")
    # the unguided request in the batch is untouched by its neighbours' masks
    alone = engine.generate([prompts[4]], params[4], chat=True)[0]
    assert outs[4].token_ids == alone.token_ids


def test_stream_logprobs_and_moving_engines(engine):
    sp = SamplingParams(temperature=0, max_tokens=60, guided_json=PERSON, logprobs=1)
    prompt = "Describe a person as JSON with name, age and student."
    want = engine.generate([prompt], sp, chat=True)[0]
    deltas = [o.new_text for o in engine.stream(prompt, sp, chat=True)]
    assert "".join(deltas) == want.text
    # the log-probabilities are the model's own (before the mask): the chosen tokens' are finite and <= 0
    assert all(lp[t] <= 0 for lp, t in zip(want.logprobs, want.token_ids))
    # half-way through, the request moves (pickled) to a second engine, whose guide walks its output again
    other = Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=128)
    rid = engine.add_request(prompt, sp, chat=True)
    for _ in range(8):
        engine.step()
    engine.settle()
    moved = engine.take_requests()
    assert len(moved) == 1 and moved[0]._guide is not None
    other.adopt_request(pickle.loads(pickle.dumps(moved[0])))
    final = None
    while other.has_unfinished():
        for out in other.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final.token_ids == want.token_ids


def test_bad_guided_params(engine):
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(guided_regex="a", guided_choice=["a"])
    with pytest.raises(ValueError, match="GROUPREF"):
        SamplingParams(guided_regex=r"(a)\1")
    with pytest.raises(TypeError, match="guided_regex"):
        SamplingParams(guided_regex=5)
    with pytest.raises(TypeError, match="guided_json"):
        SamplingParams(guided_json=3.0)
    with pytest.raises(ValueError, match="guided_choice"):
        SamplingParams(guided_choice=[])
    bare = Engine(engine.model, None, num_pages=16)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.add_request([1, 2, 3], SamplingParams(guided_regex="a+", max_tokens=4))
    spec = Engine(engine.model, engine.tokenizer, num_pages=64, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative"):
        spec.add_request("hi", SamplingParams(guided_regex="a+"))
    assert CharDFA(SamplingParams(guided_choice=["a.b"]).guided_pattern()).fullmatch("a.b")


def test_vocab_texts_from_any_tokenizer(engine):
    """The vocabulary's texts through the infercore tokenizer's batch decode, or any tokenizer's ``decode``."""
    from infercore.engine.guided import vocab_strings

    tok = engine.tokenizer

    class Plain:
        vocab_size, eos_token_ids, bos_token_id = tok.vocab_size, tok.eos_token_ids, tok.bos_token_id

        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    texts = vocab_strings(tok, 3000)
    assert texts == vocab_strings(Plain(), 3000)
    assert all(texts[i] is None for i in tok.eos_token_ids if i < 3000) and texts[1003] == " return"
    assert vocab_strings(tok, tok.vocab_size + 5)[-5:] == [None] * 5  # ids past the tokenizer: never allowed


def test_logit_bias_and_allowed_token_ids(engine):
    """OpenAI's logit_bias and an allowed set, next to a plain request in the same batch; both sample outside the
    captured graph and leave the raw log-probabilities."""
    prompt = "Name a color."
    plain = SamplingParams(temperature=0, max_tokens=6)
    base = engine.generate([prompt], plain, chat=True)[0]
    banned = base.token_ids[0]
    allowed = engine.tokenizer.encode(" red blue", add_special_tokens=False)
    outs = engine.generate([prompt] * 3, [SamplingParams(temperature=0, max_tokens=6, logit_bias={banned: -100.0}),
                                          SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=allowed,
                                                         logprobs=0),
                                          plain], chat=True)
    assert outs[0].token_ids[0] != banned
    assert set(outs[1].token_ids) <= set(allowed)
    assert outs[2].token_ids == base.token_ids
    boosted = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, logit_bias={allowed[0]: 100.0}),
                              chat=True)[0]
    assert boosted.token_ids[0] == allowed[0]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 200.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="exclude each other"):
        SamplingParams(allowed_token_ids=[1], guided_regex="a")
    with pytest.raises(ValueError, match="outside"):
        engine.add_request("hi", SamplingParams(logit_bias={10**7: 1.0}))
