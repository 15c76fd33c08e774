"""Reasoning parsers (``<think>`` blocks as ``reasoning_content``): the split on strings, its streaming prefixes, and
the server's chat replies (whole and streamed, with tool calls, guided, ``chat_template_kwargs``) on a tiny random
Llama with a byte-level tokenizer; replies that must hold a block are forced with ``guided_regex``."""

import re
import threading

import pytest
from engine_helpers import ours_from_hf, tiny_hf
from test_serve_tools import TOOLS, _events, _post, add_up, byte_tokenizer

from infercore import Engine
from infercore.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from infercore.serve import make_server

TEXTS = ["<think>Paris is in France.</think>Paris.", "\n<think>\na < b </th </think>\n\nYes", "no block here",
         "plain</think>answer", "<think>cut off", "<thi", "", "<think></think>", "  <think>x</think>"]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_split_and_its_streaming_prefixes(name):
    p = get_reasoning_parser(name)
    assert p.split("<think>Paris is in France.</think>Paris.") == ("Paris is in France.", "Paris.")
    assert p.split("<think>\nhm\n</think>\n\nYes") == ("\nhm\n", "\n\nYes")
    assert p.split("<think>cut off") == ("cut off", None)
    if name == "deepseek_r1":  # the template opened the block: the reply starts inside it
        assert p.split("plain</think>answer") == ("plain", "answer")
        assert p.split("no block here") == ("no block here", None)
    else:
        assert p.split("plain</think>answer") == (None, "plain</think>answer")
        assert p.split("no block here") == (None, "no block here")
    # explicit (a guided reply): only an opened block is reasoning, for either parser
    assert p.split("plain</think>answer", explicit=True) == (None, "plain</think>answer")
    assert p.split("<think>a</think>b", explicit=True) == ("a", "b")
    # a stream's settled parts at every prefix begin the whole text's parts
    for text in TEXTS:
        for explicit in (False, True):
            r_all, c_all = p.split(text, explicit=explicit)
            for k in range(len(text) + 1):
                r, c = p.split(text[:k], finished=False, explicit=explicit)
                assert (r_all or "").startswith(r or ""), (text, k)
                assert (c_all or "").startswith(c or ""), (text, k)
            assert p.split(text, finished=False, explicit=explicit)[1] in (c_all, None)


def test_registry():
    assert {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="unknown parser 'nope'.*deepseek_r1"):
        get_reasoning_parser("nope")


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def served(request):
    tok = byte_tokenizer()
    tok.chat_template = tok.chat_template.replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think></think>"
        "{% endif %}{% endif %}")
    model = ours_from_hf(tiny_hf("llama", vocab_size=258, max_position_embeddings=1024))
    engine = Engine(model, tok, page_size=16, num_pages=256, async_scheduling=False)
    server = make_server(engine, port=0, model_name="tiny", reasoning_parser=request.param)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
    server.loop.close()


ASK = [{"role": "user", "content": "Capital of France?"}]
THOUGHT, ANSWER = "It is Paris, in France.", "Paris."
FORCED = f"<think>{THOUGHT}</think>{ANSWER}"


def test_reasoning_content_whole_and_streamed(served):
    req = {"messages": ASK, "max_tokens": 100, "temperature": 0, "guided_regex": re.escape(FORCED)}
    status, body = _post(served, "/v1/chat/completions", req)
    assert status == 200
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    status, data = _post(served, "/v1/chat/completions", {**req, "stream": True}, raw=True)
    deltas = [e["choices"][0]["delta"] for e in _events(data) if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert any(d.get("reasoning_content") for d in deltas[:first_content])  # reasoning streamed before the answer
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])
    # a guided reply without a block is all answer, whatever the parser
    status, body = _post(served, "/v1/chat/completions", {**req, "guided_regex": "Paris\\."})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": None}


def test_unguided_reply_follows_the_parser(served):
    """A random model's reply opens no block: DeepSeek-R1's parser reads it all as (cut-off) reasoning, Qwen3's as
    the answer; the text is the one the completions route gives for the same tokens."""
    req = {"messages": ASK, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ids = _post(served, "/tokenize", {"messages": ASK})[1]["tokens"]
    text = _post(served, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True})[1]["choices"][0]["text"]
    assert "<think>" not in text and "</think>" not in text
    msg = _post(served, "/v1/chat/completions", req)[1]["choices"][0]["message"]
    name = type(served.reasoning_parser).__name__
    if name.startswith("DeepSeek"):
        assert msg["reasoning_content"] == text.lstrip() and msg["content"] is None
    else:
        assert msg["reasoning_content"] is None and msg["content"] == text
    _, data = _post(served, "/v1/chat/completions", {**req, "stream": True}, raw=True)
    deltas = [e["choices"][0]["delta"] for e in _events(data) if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (msg["reasoning_content"] or "")
    assert "".join(d.get("content", "") for d in deltas) == (msg["content"] or "")


def test_reasoning_then_tool_call(served):
    """The tool parser reads the answer alone, whole and streamed: the reasoning streams first, then the answer's
    content, then its call, named before its arguments come in pieces."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
    forced = f"<think>{THOUGHT}</think>On it. {call}"
    req = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0, "guided_regex": re.escape(forced)}
    body = _post(served, "/v1/chat/completions", req)[1]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == THOUGHT
    assert choice["message"]["content"] == "On it."
    [whole] = choice["message"]["tool_calls"]
    assert whole["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    _, data = _post(served, "/v1/chat/completions", {**req, "stream": True}, raw=True)
    chunks = [e["choices"][0] for e in _events(data) if e["choices"]]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert "".join(c["delta"].get("reasoning_content", "") for c in chunks) == THOUGHT
    assert add_up(chunks) == ("On it.", [("get_weather", whole["function"]["arguments"])])
    thought = [k for k, c in enumerate(chunks) if c["delta"].get("reasoning_content")]
    said = [k for k, c in enumerate(chunks) if c["delta"].get("content")]
    called = [k for k, c in enumerate(chunks) if c["delta"].get("tool_calls")]
    assert len(thought) > 5 and len(said) > 1 and len(called) > 5  # each streamed, in pieces
    assert max(thought) < min(said) and max(said) < min(called)  # in that order, the block not as content


def test_chat_template_kwargs(served):
    ask = {"messages": ASK}
    plain = _post(served, "/tokenize", ask)[1]["tokens"]
    off = _post(served, "/tokenize", {**ask, "chat_template_kwargs": {"enable_thinking": False}})[1]["tokens"]
    text = _post(served, "/detokenize", {"tokens": off})[1]["prompt"]
    assert text.endswith("<think></think>") and len(off) == len(plain) + len("<think></think>")
    for bad in ([1], {"tools": []}, {"add_generation_prompt": False}):
        status, body = _post(served, "/v1/chat/completions", {**ask, "chat_template_kwargs": bad})
        assert status == 400 and body["error"]["param"] == "chat_template_kwargs", bad


def test_make_server_refuses_an_unknown_reasoning_parser(served):
    # (the CLI's --reasoning-parser: tests/engine/test_serve_tools.py, test_cli_parser_flags)
    with pytest.raises(ValueError, match="unknown parser"):
        make_server(served.loop.engine, port=0, reasoning_parser="nope")
