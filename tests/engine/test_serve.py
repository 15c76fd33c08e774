"""``infercore serve``: the OpenAI-compatible HTTP server, on the real SmolLM2-135M-Instruct weights (CPU)."""

import http.client
import json
import socket
import threading
import time

import pytest
import torch
from engine_helpers import post, sse_events

from infercore import Engine, SamplingParams
from infercore.serve import make_server


@pytest.fixture(scope="module")
def served():
    engine = Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=256,
                                    enable_prefix_caching=False, async_scheduling=False)
    # answers computed directly, before the server owns the engine
    want = {
        "chat": engine.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=12),
                                chat=True)[0],
        "text": engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0],
    }
    server = make_server(engine, port=0, model_name="smollm2")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, want
    server.shutdown()
    server.server_close()
    server.loop.close()


_post, _events = post, sse_events


def test_models(served):
    server, _ = served
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("GET", "/v1/models")
    body = json.loads(conn.getresponse().read())
    assert [m["id"] for m in body["data"]] == ["smollm2"]


def test_completion_equals_the_engine(served):
    server, want = served
    status, body = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                     "temperature": 0})
    assert status == 200 and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == want["text"].text and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(want["text"].prompt_token_ids), "completion_tokens": 8,
                             "total_tokens": len(want["text"].prompt_token_ids) + 8}


def test_chat_completion_and_its_stream(served):
    server, want = served
    req = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_completion_tokens": 12,
           "temperature": 0}
    status, body = _post(server, "/v1/chat/completions", req)
    assert status == 200
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": want["chat"].text} and "Paris" in msg["content"]
    status, data = _post(server, "/v1/chat/completions", {**req, "stream": True}, raw=True)
    events = _events(data)
    assert status == 200 and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want["chat"].text
    assert events[-1]["choices"][0]["finish_reason"] == want["chat"].finish_reason


def test_several_prompts_in_one_request(served):
    server, want = served
    prompts = ["The capital of France is", "Count to 3:", "The capital of France is"]
    status, body = _post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 8, "temperature": 0})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["choices"][0]["text"] == body["choices"][2]["text"] == want["text"].text
    assert body["usage"]["completion_tokens"] == 24
    status, data = _post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 8, "temperature": 0,
                                                     "stream": True}, raw=True)
    texts = ["", "", ""]
    for e in _events(data):
        c = e["choices"][0]
        texts[c["index"]] += c["text"]
    assert status == 200 and texts == [c["text"] for c in body["choices"]]
    # one refused prompt fails the request and leaves nothing running
    status, reply = _post(server, "/v1/completions", {"prompt": ["Hi", [1, 10**9]], "max_tokens": 50})
    assert status == 400 and reply["error"]["message"].startswith("prompt 1: ")
    deadline = time.time() + 10
    while server.loop.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.1)
    assert not server.loop.engine.has_unfinished()


def test_n_samples_per_prompt(served):
    server, want = served
    status, body = _post(server, "/v1/completions", {"prompt": ["The capital of France is", "Count to 3:"], "n": 3,
                                                     "max_tokens": 8, "temperature": 1.0, "seed": 5})
    assert status == 200 and [c["index"] for c in body["choices"]] == list(range(6))
    texts = [c["text"] for c in body["choices"]]
    assert len(set(texts[:3])) > 1  # seeds 5, 6, 7 draw different samples
    again = _post(server, "/v1/completions", {"prompt": "Count to 3:", "n": 3, "max_tokens": 8, "temperature": 1.0,
                                              "seed": 5})[1]
    assert [c["text"] for c in again["choices"]] == texts[3:]  # each sample is a function of its seed
    status, body = _post(server, "/v1/completions", {"prompt": "The capital of France is", "n": 2, "max_tokens": 8,
                                                     "temperature": 0})
    assert [c["text"] for c in body["choices"]] == [want["text"].text] * 2
    chat = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 4, "stream": True}
    status, data = _post(server, "/v1/chat/completions", chat, raw=True)
    roles = [e["choices"][0]["index"] for e in _events(data) if e["choices"][0]["delta"].get("role")]
    assert status == 200 and roles == [0, 1]


def test_logprobs(served):
    server, _ = served
    status, body = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 5,
                                                     "temperature": 0, "logprobs": 2})
    lp = body["choices"][0]["logprobs"]
    assert status == 200 and len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == 5
    for v, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert v <= 0 and len(top) <= 2 and v >= max(top.values())  # greedy: the sampled token is the top one
    status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 3, "logprobs": True, "top_logprobs": 1})
    content = body["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == body["usage"]["completion_tokens"]


def test_concurrent_requests_batch_and_all_finish(served):
    server, _ = served
    results = [None] * 4

    def ask(i):
        results[i] = _post(server, "/v1/completions", {"prompt": f"Count to {i + 3}:", "max_tokens": 6,
                                                       "temperature": 0.5, "seed": i})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None and r[0] == 200 and r[1]["usage"]["completion_tokens"] == 6 for r in results)


@pytest.mark.parametrize("path, body, param, text", [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "temperature must be a float"),
    ("/v1/completions", {"prompt": "x", "top_p": 2.0}, None, "top_p"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n must be in [1, 16]"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "stop", "stop"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, None, "token ids outside"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "messages"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5.0}, None, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format", "response_format must be"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(?=a)b"}, None, "unsupported regex construct"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= undefined"}, None, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"xml": "a"}}, "structured_outputs", "unsupported"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}},
     "structured_outputs", "one constraint"),
])
def test_bad_requests_get_400_naming_the_field(served, path, body, param, text):
    server, _ = served
    status, reply = _post(server, path, body)
    assert status == 400
    assert text in reply["error"]["message"] and reply["error"]["param"] == param
    status, _ = _post(server, "/v1/nothing", {})
    assert status == 404


def test_disconnected_stream_is_aborted(served):
    server, _ = served
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 2000, "stream": True, "ignore_eos": True})
    sock = socket.create_connection(server.server_address[:2], timeout=60)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    head = b""
    while b"data: " not in head:  # the stream has started
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200")
    sock.close()  # the client goes away mid-stream
    deadline = time.time() + 10  # far less than the 2000 tokens would take
    while server.loop.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.2)
    assert not server.loop.engine.has_unfinished()


def test_guided_outputs(served):
    """OpenAI's response_format (a JSON schema) and logit_bias, and the guided_* fields."""
    server, want = served
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}}}
    status, body = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
        "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    assert status == 200
    answer = json.loads(body["choices"][0]["message"]["content"])
    assert answer["city"] in ("Paris", "Lyon", "Nice") and type(answer["population"]) is int
    assert 0 <= answer["population"] <= 10**8
    status, body = _post(server, "/v1/completions", {"prompt": "Is water wet? Answer:", "max_tokens": 5,
                                                     "temperature": 0, "guided_choice": [" yes", " no"]})
    assert status == 200 and body["choices"][0]["text"] in (" yes", " no")
    assert body["choices"][0]["finish_reason"] == "stop"
    # a context-free grammar (GBNF), as guided_grammar and as vLLM's structured_outputs
    arith = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9] | "(" expr ")"'
    for extra in ({"guided_grammar": arith}, {"structured_outputs": {"grammar": arith}}):
        status, body = _post(server, "/v1/completions", {"prompt": "An arithmetic sum:", "max_tokens": 24,
                                                         "temperature": 0, **extra})
        text = body["choices"][0]["text"]
        assert status == 200 and text and set(text) <= set("0123456789+-()"), text
        if body["choices"][0]["finish_reason"] == "stop":
            assert text.count("(") == text.count(")")
    status, body = _post(server, "/v1/completions", {"prompt": "Is water wet? Answer:", "max_tokens": 5,
                                                     "temperature": 0,
                                                     "structured_outputs": {"choice": [" yes", " no"]}})
    assert status == 200 and body["choices"][0]["text"] in (" yes", " no")
    # OpenAI's logit_bias (string keys): the greedy first token, banned, is not chosen
    banned = want["text"].token_ids[0]
    status, body = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 1,
                                                     "temperature": 0, "logprobs": 0,
                                                     "logit_bias": {str(banned): -100}})
    tok = server.loop.engine.tokenizer
    assert status == 200 and body["choices"][0]["logprobs"]["tokens"][0] != tok.decode([banned],
                                                                                    skip_special_tokens=False)


def test_prompt_logprobs(served):
    """``prompt_logprobs``: None for the first prompt token, then the prompt token's log-probability first."""
    server, want = served
    status, body = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2,
                                                     "temperature": 0, "prompt_logprobs": 2})
    assert status == 200
    plp = body["choices"][0]["prompt_logprobs"]
    prompt = want["text"].prompt_token_ids
    assert len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        first = next(iter(plp[pos]))
        assert int(first) == prompt[pos] and plp[pos][first]["logprob"] <= 0 and 2 <= len(plp[pos]) <= 3


def test_metrics_endpoint(served):
    """``GET /metrics``: Prometheus text whose counters and histograms grow with the requests served."""
    server, _ = served

    def scrape():
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain")
        vals = {}
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, v = line.rsplit(" ", 1)
                vals[name] = float(v)
        return vals

    before = scrape()
    lab = 'model_name="smollm2"'
    status, _ = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 5,
                                                  "temperature": 0})
    assert status == 200
    after = scrape()
    gen = f"infercore:generation_tokens_total{{{lab}}}"
    assert after[gen] == before[gen] + 5
    key = f'infercore:request_success_total{{{lab},finished_reason="length"}}'
    assert after[key] == before.get(key, 0) + 1
    n = f"infercore:e2e_request_latency_seconds_count{{{lab}}}"
    assert after[n] == before[n] + 1 and after[f"infercore:time_to_first_token_seconds_count{{{lab}}}"] >= 1
    assert after[f'infercore:e2e_request_latency_seconds_bucket{{{lab},le="+Inf"}}'] == after[n]
    assert after[f"infercore:num_requests_running{{{lab}}}"] == 0
    assert 0 <= after[f"infercore:kv_cache_usage{{{lab}}}"] <= 1


def test_tokenize_and_detokenize(served):
    server, _ = served
    status, body = _post(server, "/tokenize", {"prompt": "The capital of France is"})
    assert status == 200 and body["count"] == len(body["tokens"]) > 3 and body["max_model_len"] > 0
    status, back = _post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "The capital of France is"
    status, chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    status, text = _post(server, "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200 and "user" in text["prompt"] and "Hi" in text["prompt"]  # the chat template around "Hi"
    for path, bad, param in (("/tokenize", {"prompt": 3}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                             ("/detokenize", {"tokens": "x"}, "tokens")):
        status, err = _post(server, path, bad)
        assert status == 400 and err["error"]["param"] == param
