"""Incremental detokenization (engine/detok.py) against whole-output decodes, and in the Engine."""

import random

import pytest
from engine_helpers import ours_from_hf, tiny_hf

from infercore import Engine, SamplingParams
from infercore.engine import detok
from infercore.engine.detok import MAX_PENDING, IncrementalDetokenizer
from infercore.loading import default_model_path
from infercore.loading.tokenizer import Tokenizer

_MODEL = []


def model():
    if not _MODEL:
        _MODEL.append(ours_from_hf(tiny_hf("llama", num_hidden_layers=1)))
    return _MODEL[0]


class LetterTokenizer:
    """Token t decodes to one of six letters; token 5 is EOS (skipped as a special token)."""

    eos_token_ids = {5}
    bos_token_id = None

    def decode(self, ids, *, skip_special_tokens=True):
        return "".join("abcdef"[t % 6] for t in ids if not (skip_special_tokens and t == 5))

TEXTS = [
    "The capital of France is Paris. Ça coûte 12,50 € — naïve café, straße.",
    "日本語のテキストと中文文本，한국어 텍스트. Emoji: 🤖🚀👩‍💻 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "def f(x):\n    return x ** 2  # tabs\tand  double  spaces\n\n\n",
]


@pytest.fixture(scope="module")
def smollm_tok():
    return Tokenizer.from_gguf(default_model_path())


class DecodeOnly:
    """A tokenizer seen only through ``decode`` (no stream backend): the window fallback."""

    def __init__(self, tok):
        self.tok = tok
        self.calls: list[int] = []

    def decode(self, ids, *, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(det, ids):
    pieces = [det.step(ids[: i + 1]) for i in range(len(ids))]
    return pieces, "".join(pieces)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("fallback", [False, True])
def test_streamed_text_equals_full_decode(smollm_tok, text, fallback):
    ids = smollm_tok.encode(text, add_special_tokens=False)
    tok = DecodeOnly(smollm_tok) if fallback else smollm_tok
    det = IncrementalDetokenizer(tok)
    assert det.streaming is not fallback
    pieces, streamed = _stream(det, ids)
    full = smollm_tok.decode(ids)
    assert streamed == full == det.finish(ids)
    assert not any("\ufffd" in p for p in pieces)  # split characters are held back, not emitted broken
    if fallback:  # each step decoded a short window, not the output so far
        assert max(tok.calls[:-1]) <= 8 < len(ids)


def test_special_tokens_skipped_and_random_ids(smollm_tok):
    im_end = smollm_tok.token_to_id("<|im_end|>")
    rng = random.Random(0)
    ids = smollm_tok.encode("Hello there, 世界!", add_special_tokens=False) + [im_end]
    ids += [rng.randrange(smollm_tok.vocab_size) for _ in range(200)]  # byte tokens mid-character included
    for tok in (smollm_tok, DecodeOnly(smollm_tok)):
        det = IncrementalDetokenizer(tok)
        _, streamed = _stream(det, ids)
        full = det.finish(ids)
        assert "<|im_end|>" not in full
        # The stream holds back an incomplete trailing character; finish() completes the text.
        assert full.startswith(streamed) and len(full) - len(streamed) <= 1


def test_steps_may_take_several_tokens_and_reject_shrinking(smollm_tok):
    ids = smollm_tok.encode(TEXTS[1], add_special_tokens=False)
    det = IncrementalDetokenizer(smollm_tok)
    text = det.step(ids[:5]) + det.step(ids[:5]) + det.step(ids)
    assert text == smollm_tok.decode(ids)
    with pytest.raises(ValueError, match="ids"):
        det.step(ids[:3])
    with pytest.raises(TypeError, match="tokenizer"):
        IncrementalDetokenizer(object())


@pytest.mark.parametrize("kind", ["lone_bytes", "special"])
@pytest.mark.parametrize("fallback", [False, True])
def test_held_back_tokens_are_flushed(smollm_tok, kind, fallback, monkeypatch):
    """A run that never completes a character (lone continuation bytes) or decodes to nothing (special tokens)
    is not held back, and so decoded again, for more than MAX_PENDING tokens: each step stays O(1)."""
    made = []  # the stream restarts after each flush (its held-back tokens are not observable otherwise)

    class CountedStream:
        def __init__(self, **kw):
            made.append(1)
            self.stream = stream_cls(**kw)

        def step(self, backend, token):
            return self.stream.step(backend, token)

    stream_cls = detok._DecodeStream
    monkeypatch.setattr(detok, "_DecodeStream", CountedStream)
    if kind == "lone_bytes":
        tid = next(i for i in range(17, 1000) if smollm_tok.decode([i]) == "\ufffd")
    else:
        tid = smollm_tok.token_to_id("<|im_end|>")
    head = smollm_tok.encode("Hello", add_special_tokens=False)
    ids = head + [tid] * 200 + smollm_tok.encode(" world", add_special_tokens=False)
    tok = DecodeOnly(smollm_tok) if fallback else smollm_tok
    det = IncrementalDetokenizer(tok)
    pieces, streamed = _stream(det, ids)
    full = smollm_tok.decode(ids)
    assert streamed == full  # byte-level: the broken bytes show as U+FFFD either way
    if kind == "lone_bytes":  # emitted at least every MAX_PENDING + 1 tokens
        gaps = [j - i for i, j in zip(*[[k for k, p in enumerate(pieces) if p][x:] for x in (0, 1)])]
        assert max(gaps) <= MAX_PENDING + 1
    if fallback:
        assert max(tok.calls) <= 2 * MAX_PENDING + 2
    else:
        assert len(made) >= 200 // (MAX_PENDING + 1)


class CleanupTokenizer(LetterTokenizer):
    """Its decode rewrites across token boundaries ("ab" -> "X"): streamed pieces differ from a full decode."""

    def decode(self, ids, *, skip_special_tokens=True):
        return super().decode(ids, skip_special_tokens=skip_special_tokens).replace("ab", "X")


def _generate(tok, params, prompt=(1, 2, 3)):
    eng = Engine(model(), tok, page_size=4)
    return eng.generate([list(prompt)], params)[0]


def test_engine_text_is_the_full_decode_and_stops_cut_it():
    letters = LetterTokenizer()
    out = _generate(letters, SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True))
    assert out.text == letters.decode(out.token_ids)
    target = out.text[10:12]  # a stop string that occurs in that output
    cut = _generate(letters, SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, stop=[target]))
    assert cut.finish_reason == "stop"
    assert cut.text == out.text[: out.text.index(target)]


def test_engine_keeps_the_full_decode_where_the_stream_differs():
    clean = CleanupTokenizer()
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=60, ignore_eos=True)
    out = _generate(clean, params)
    assert out.text == clean.decode(out.token_ids)
    full = out.text
    # A stop string without the rewritten letters occurs in the streamed text where it does in the full one.
    stop = next((full[i : i + 2] for i in range(len(full) - 1) if not set(full[i : i + 2]) & set("abX")), None)
    assert stop is not None
    cut = _generate(clean, SamplingParams(temperature=1.0, seed=5, max_tokens=60, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


class CountingLetters(LetterTokenizer):
    def __init__(self):
        self.decodes = 0

    def decode(self, ids, *, skip_special_tokens=True):
        self.decodes += 1
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


def test_generate_reports_final_outputs_only_and_decodes_once(monkeypatch):
    """generate() reads only final outputs: no per-step RequestOutput, and without stop strings one decode of
    each output at its end; step()'s callers still get one output per token."""
    letters = CountingLetters()
    eng = Engine(model(), letters, page_size=4)
    built = []
    output = Engine._output
    monkeypatch.setattr(Engine, "_output", lambda self, req: built.append(req.request_id) or output(self, req))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    outs = eng.generate([[1, 2, 3], [4, 5]], params)
    assert len(built) == 2 and letters.decodes == 2
    assert all(o.text == LetterTokenizer().decode(o.token_ids) and len(o.token_ids) == 20 for o in outs)
    stop = outs[0].text[8:10]
    cut = eng.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True,
                                                  stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == outs[0].text[: outs[0].text.index(stop)]
    built.clear()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    streamed = []
    while eng.has_unfinished():
        streamed += eng.step()
    assert len(streamed) == len(built) == 5 and streamed[-1].finished
    assert "".join(o.new_text for o in streamed) == streamed[-1].text
