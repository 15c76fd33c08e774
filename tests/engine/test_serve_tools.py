"""The HTTP server's tool calling (named / required / auto / none, auto calls streamed as generated), beam search,
``stream_options.include_usage`` and ``echo``, on a tiny random Llama with a byte-level tokenizer (one token per
byte) whose chat template renders tools Hermes-style; and the tool-call parsers on strings, whole and streamed in
any chunking (hypothesis)."""

import json
import re
import threading

import pytest
from engine_helpers import ours_from_hf, post, sse_events, tiny_hf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infercore import Engine, SamplingParams
from infercore.serve import make_server
from infercore.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    HermesToolStream,
    Llama3JsonToolStream,
    MistralToolStream,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
)

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}. Call one as "
    "<tool_call>{...}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response id={{ m.tool_call_id }}>{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}<tool_call>"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "[A-Z][a-z]{2,8}"}},
         "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": CLOCK}}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def byte_tokenizer():
    """Byte-level BPE without merges (one token per byte, ids 0-255) plus <|im_start|> (256) and <|im_end|> (257,
    the end of a turn)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from infercore.loading.tokenizer import Tokenizer, _bytes_to_unicode

    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(_bytes_to_unicode().values())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return Tokenizer(backend, eos_token="<|im_end|>", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def served():
    tok = byte_tokenizer()
    model = ours_from_hf(tiny_hf("llama", vocab_size=258, max_position_embeddings=1024))
    engine = Engine(model, tok, page_size=16, num_pages=256, async_scheduling=False)
    server = make_server(engine, port=0, model_name="tiny")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
    server.loop.close()


_post, _events = post, sse_events


def valid(value, schema) -> bool:
    """``value`` against the JSON-schema subset these tests use (object / string / integer, properties, required,
    enum, pattern, minimum / maximum)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and all(k in props and valid(v, props[k]) for k, v in value.items()))
    if kind == "string":
        return isinstance(value, str) and re.fullmatch(schema.get("pattern", ".*"), value) is not None
    if kind == "integer":
        return (type(value) is int and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    return kind is None


# ---------------------------------------------------------------------------------------------- the parser


def test_hermes_parser_reads_calls_and_leaves_the_rest():
    p = get_tool_parser("hermes")
    assert isinstance(p, HermesToolParser) and "hermes" in TOOL_PARSERS
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"Utc\\"}"}</tool_call> Done.')
    content, calls = p.extract(text)
    assert content == "Let me look. Done."  # less the whitespace before each call and at the end
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    # the arguments as written; written as a JSON string: its decoded text
    assert [c.arguments for c in calls] == ['{"city": "Paris", "days": 3}', '{"zone": "Utc"}']
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls) and calls[0].id != calls[1].id
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": calls[0].arguments}}
    # a malformed block stays in the content as written; a good one beside it is still read
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    content, calls = p.extract(f'{bad}<tool_call>{{"name": "f", "arguments": {{}}}}</tool_call>')
    assert content == bad and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    for junk in ('<tool_call>["f"]</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": 3}</tool_call>'):
        assert p.extract(junk) == (junk, [])
    # no call: the text untouched; an unclosed last block (cut off) is read to the end; only calls: no content
    assert p.extract("  plain text\n") == ("  plain text\n", [])
    content, calls = p.extract('ok <tool_call>{"name": "f", "arguments": {"a": [1, 2]}}')
    assert content == "ok" and calls[0].arguments == '{"a": [1, 2]}'
    assert p.extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')[0] is None
    # the object is read as JSON: a closing tag inside a string is no end; junk after the object is no call
    content, calls = p.extract('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>')
    assert content is None and calls[0].arguments == '{"s": "</tool_call>"}'
    junk = '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>'
    assert p.extract(junk) == (junk, [])
    # without arguments: {}; "parameters" for "arguments"; other keys ignored
    content, calls = p.extract('<tool_call>{"name": "f"}</tool_call><tool_call>{"id": 1, "parameters": {"b": 2}, '
                               '"name": "g"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}"), ("g", '{"b": 2}')]


def test_llama3_json_parser():
    p = get_tool_parser("llama3_json")
    content, calls = p.extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                               '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"zone": "UTC"}]
    content, calls = p.extract(' {"name": "f", "parameters": {}}\n')  # without the tag
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    for text in ("The weather is fine.", '{"city": "Paris"}', '{"name": "f", "parameters": {}} and more',
                 '{"name": "f", "parameters": {"a": }', '{"name": "f", "parameters": [1]}'):
        assert p.extract(text) == (text, []), text


def test_mistral_parser():
    p = get_tool_parser("mistral")
    assert p.start == "[TOOL_CALLS]"
    content, calls = p.extract('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                               '{"name": "get_time", "arguments": {}}]')
    assert content == "Checking." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    # the v11 form: name[ARGS]{json}, one marker per call
    content, calls = p.extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for text in ("no calls here", "[TOOL_CALLS][{\"name\": 3}]", "[TOOL_CALLS]not json", "[TOOL_CALLS][]",
                 "[TOOL_CALLS]f[ARGS]{bad}"):
        assert p.extract(text) == (text, []), text


# ---------------------------------------------------------------------------------------------- streamed parsing


def replay(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """Feed ``pieces`` (the last one final) to a new stream of ``parser``: the content and ``(name, arguments)`` its
    deltas add up to, and the deltas. Checks the chunk shape on the way: a call's first piece has its index (the
    next one), id, type and name; later pieces only add (non-empty) arguments."""
    s = get_tool_parser(parser).stream()
    content, calls, deltas = "", [], []
    for i, piece in enumerate(pieces):
        d = s.feed(piece, final=i == len(pieces) - 1)
        deltas.append(d)
        content += d.content
        for p in d.tool_calls:
            if p["index"] == len(calls):
                assert p["id"].startswith("call_") and p["type"] == "function" and p["function"]["name"]
                assert set(p["function"]) == {"name", "arguments"}
                calls.append([p["function"]["name"], p["function"]["arguments"]])
            else:
                assert p["index"] < len(calls) and set(p) == {"index", "function"}
                assert set(p["function"]) == {"arguments"} and p["function"]["arguments"]
                calls[p["index"]][1] += p["function"]["arguments"]
    assert s.called == bool(calls)
    assert [(c.name, c.arguments) for c in s.tool_calls()] == [tuple(c) for c in calls]
    return content, [tuple(c) for c in calls], deltas


def chunked(text: str, cuts) -> list[str]:
    """``text`` split at ``cuts`` (any positions, repeats and ends allowed: empty pieces too)."""
    cuts = sorted({min(max(c, 0), len(text)) for c in cuts})
    edges = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:])] or [""]


def whole(parser: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    """``extract``'s reading of ``text`` in :func:`replay`'s terms (no content: "")."""
    content, calls = get_tool_parser(parser).extract(text)
    return content or "", [(c.name, c.arguments) for c in calls]


def test_hermes_stream_sends_content_then_each_call_as_it_grows():
    args = '{"city": "Paris", "days": 3}'
    text = f'Let me check. <tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call> Then more.'
    s = get_tool_parser("hermes").stream()
    assert isinstance(s, HermesToolStream)
    content, pieces = "", []
    for k in range(len(text)):
        d = s.feed(text[k], final=k == len(text) - 1)
        content += d.content
        seen = text[:k + 1]
        if d.tool_calls:
            pieces.append((k, d.tool_calls))
        if seen.endswith('"get_weather"'):  # the call goes out as soon as its name is known
            [head] = d.tool_calls
            assert head["index"] == 0 and head["function"] == {"name": "get_weather", "arguments": ""}
        if len(seen) < text.index("<tool_call>"):
            assert content == seen.rstrip()  # the text before the call streams as it comes, less trailing spaces
        elif len(seen) < text.index("</tool_call>"):
            assert content == "Let me check."  # nothing of the call is content
        a = text.index(args)
        if a <= k < a + len(args):  # the arguments so far: every character of the object already written
            assert "".join(p[0]["function"]["arguments"] for _, p in pieces) == text[a:k + 1]
    assert content == "Let me check. Then more." == whole("hermes", text)[0]
    assert len(pieces) == len(args) + 1  # the name, then one piece per character of the arguments


def test_hermes_stream_false_starts_are_content():
    s = get_tool_parser("hermes").stream()
    assert s.feed("Use <tool").content == "Use"  # " <tool" may begin a call: held back
    assert s.feed("s> not <tool_c").content == " <tools> not"
    assert s.feed("alls").content == " <tool_calls"
    assert s.feed(" <", final=True).content == " <" and not s.called
    # a block whose body is no call object is content as written, streamed once it proves none
    s = get_tool_parser("hermes").stream()
    assert s.feed("a <tool_call>").content == "a"
    assert s.feed(" [1, 2] </tool").content == " <tool_call> [1, 2]"
    assert s.feed("_call> b", final=True).content == " </tool_call> b" and not s.called
    # an object that is no call (no name) is held until it closes, then is content
    text = '<tool_call>{"arguments": {"a": 1}}</tool_call>'
    content, calls, deltas = replay("hermes", list(text))
    assert (content, calls) == (text, []) == whole("hermes", text) and "".join(d.content for d in deltas[:30]) == ""


def test_hermes_stream_string_arguments_decode_as_they_settle():
    inner = '{"q": "a\\"b", "e": "\\u00e9\\ud83d\\ude00"}'  # the arguments' own JSON text
    text = '<tool_call>{"name": "f", "arguments": ' + json.dumps(inner) + "}</tool_call>"
    content, calls, deltas = replay("hermes", list(text))
    assert calls == [("f", inner)] == whole("hermes", text)[1] and content == ""
    args = [p["function"]["arguments"] for d in deltas for p in d.tool_calls]
    assert len(args) > 20 and "\\" not in "".join(args[:2])  # decoded piece by piece, no escape cut in half


def test_llama3_json_stream():
    s = get_tool_parser("llama3_json").stream()
    assert isinstance(s, Llama3JsonToolStream)
    assert s.feed("  The weather").content == "  The weather"  # not a call: content as it comes
    assert s.feed(" is {fine}.", final=True).content == " is {fine}." and not s.called
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    content, calls, deltas = replay("llama3_json", list(text))
    assert (content, calls) == whole("llama3_json", text) == (
        "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC"}')])
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert text[:first + 1].endswith('"get_weather"')
    # a reply that starts with "{" is held until its first object shows a name, or closes without one
    s = get_tool_parser("llama3_json").stream()
    assert s.feed('{"city": "Pa').content == ""
    assert s.feed('ris"}').content == '{"city": "Paris"}' and s.feed(" ok", final=True).content == " ok"
    # a "<|python" that is no tag is content too
    assert replay("llama3_json", ["<|pyth", "on is great"])[0] == "<|python is great"


def test_mistral_stream():
    s = get_tool_parser("mistral").stream()
    assert isinstance(s, MistralToolStream)
    assert s.feed("Checking. [TOOL").content == "Checking."
    assert s.feed("S] are fine", final=True).content == " [TOOLS] are fine" and not s.called
    for text, want in (
            ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "get_time", "arguments": {}}]', [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
            ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS] get_time [ARGS] {}',
             [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])):
        content, calls, deltas = replay("mistral", list(text))
        assert (content, calls) == whole("mistral", text) and calls == want
        args = [p["function"]["arguments"] for d in deltas for p in d.tool_calls if "id" not in p]
        assert "".join(args).startswith('{"city": "') and len(args) > 5  # the arguments in pieces
    # v11: the name is known at [ARGS]
    s = get_tool_parser("mistral").stream()
    assert s.feed("[TOOL_CALLS]get_weather").tool_calls == []
    [head] = s.feed("[ARGS]{").tool_calls
    assert head["function"] == {"name": "get_weather", "arguments": "{"}


def test_a_stream_commits_to_a_named_call():
    """A call goes out once named; a reply then cut off inside it keeps it (arguments as far as they went), where
    the whole reply, read at once, is content (the documented limit of streaming)."""
    text = 'ok <tool_call>{"name": "f", "arguments": {"a": 1'
    assert replay("hermes", chunked(text, [20, 30]))[:2] == ("ok", [("f", '{"a": 1')])
    assert whole("hermes", text) == (text, [])
    assert replay("hermes", [text])[:2] == (text, [])  # one piece: read as a whole


# the JSON-ish characters and markers that strings, keys and content are drawn from
_BITS = ["a", "Z", " ", "\n", '"', "\\", "{", "}", "[", "]", ":", ",", ";", "<", ">", "/", "é", "😀", "\\u", "<tool",
         "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "[TOOL"]
_WORD = st.lists(st.sampled_from(_BITS), max_size=5).map("".join)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6)
                     | st.floats(allow_nan=False, allow_infinity=False) | _WORD,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_WORD, inner, max_size=3),
                     max_leaves=6)
_NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
_WS = st.sampled_from(["", " ", "\n", " \n  "])


@st.composite
def _call(draw, *, strings: bool) -> tuple[str, str, str]:
    """``(name, arguments text, call object text)``: the arguments rendered in some JSON style, the object with its
    keys in either order, maybe an extra key, "arguments" or "parameters", the arguments maybe as a JSON string."""
    name, value = draw(_NAME), draw(st.dictionaries(_WORD, _JSON, max_size=3))
    args = json.dumps(value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))
    written = json.dumps(args) if strings and draw(st.booleans()) else args
    w = draw(_WS)
    key = draw(st.sampled_from(["arguments", "parameters"]))
    fields = [f'"name"{w}:{w}{json.dumps(name)}', f'"{key}":{w}{written}']
    if draw(st.booleans()):
        fields.reverse()
    if draw(st.booleans()):
        fields.insert(draw(st.integers(0, 2)), f'"id": {json.dumps(draw(_JSON))}')
    return name, args, "{" + w + f",{w}".join(fields) + w + "}"


def _content(draw, marker: str) -> str:
    return draw(st.lists(st.sampled_from(_BITS + ["Let me", ".", "  "]), max_size=6).map("".join)
                .filter(lambda t: marker not in t))


@st.composite
def _reply(draw, parser: str) -> tuple[str, str | None, list[tuple[str, str]]]:
    """A well-formed reply in ``parser``'s format (zero or more calls) and what it must read as: ``(text, content,
    calls)``, the content by the documented rule (the text outside the calls less the whitespace before each call
    and at the end; without calls the text itself)."""
    n = draw(st.integers(0, 3))
    calls = [draw(_call(strings=parser == "hermes")) for _ in range(n)]
    if parser == "hermes":
        outside = [_content(draw, "<tool_call>") for _ in range(n + 1)]
        text = outside[0]
        for k, (_, _, obj) in enumerate(calls):
            last = k == n - 1 and not outside[-1].strip()
            close = "" if last and draw(st.booleans()) else "</tool_call>"  # a last block may stay open
            text += "<tool_call>" + draw(_WS) + obj + draw(_WS) + close + outside[k + 1]
        content = "".join(p.rstrip() for p in outside) or None
    elif parser == "llama3_json":
        if not n:
            text = _content(draw, "<tool_call>").lstrip().lstrip("{")  # prose: no call
            text = draw(_WS) + ("Sure" if text.startswith("<|python_tag|>") else "") + text
        else:
            seps = st.sampled_from([";", "; ", "\n", "", " ;\n"])
            text = draw(_WS) + draw(st.sampled_from(["", "<|python_tag|>"])) + draw(_WS) + calls[0][2]
            text += "".join(draw(seps) + obj for _, _, obj in calls[1:]) + draw(_WS)
        content = None
    else:
        head = _content(draw, "[TOOL_CALLS]")
        text, rest = head, list(calls)
        while rest:
            if draw(st.booleans()):  # an array of one or more calls
                k = draw(st.integers(1, len(rest)))
                take, rest = rest[:k], rest[k:]
                text += "[TOOL_CALLS]" + draw(_WS) + "[" + ",".join(draw(_WS) + obj for _, _, obj in take) + "]"
            else:  # name[ARGS]{...}
                (name, args, _), rest = rest[0], rest[1:]
                text += "[TOOL_CALLS]" + draw(_WS) + name + draw(_WS) + "[ARGS]" + draw(_WS) + args
            text += draw(_WS)
        content = head.rstrip() or None
    if not n:
        content = text
    return text, content, [(name, args) for name, args, _ in calls]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_chunking_streams_the_whole_reply(parser, data):
    """Generated replies: ``extract`` reads the calls as written and the content by the rule, and a stream of the
    same text in any chunking (down to empty pieces) adds up to exactly that."""
    text, content, calls = data.draw(_reply(parser))
    got_content, got_calls = get_tool_parser(parser).extract(text)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls
    assert all(isinstance(json.loads(args), dict) for _, args in calls)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=max(1, len(text))))
    assert replay(parser, chunked(text, cuts))[:2] == ((content or ""), calls)
    assert replay(parser, list(text) + [""])[:2] == ((content or ""), calls)  # one character at a time


def test_tool_parser_registry(served):
    with pytest.raises(ValueError, match="unknown parser 'nope'.*hermes"):
        get_tool_parser("nope")

    @register_tool_parser("test-upper")
    class Upper(ToolParser):
        def extract(self, text):
            return text.upper(), []

    try:
        assert get_tool_parser("test-upper").extract("ab") == ("AB", [])
        # a parser with no stream of its own: its streams hold the reply back and read it whole at the end
        s = get_tool_parser("test-upper").stream()
        assert s.feed("a<tool_call>").content == "" and s.feed("b", final=True).content == "A<TOOL_CALL>B"
        assert not s.called
        with pytest.raises(ValueError, match="unknown parser"):
            make_server(served.loop.engine, port=0, tool_call_parser="nope")
    finally:
        del TOOL_PARSERS["test-upper"]


# ---------------------------------------------------------------------------------------------- tool calling


def test_tools_reach_the_chat_template(served):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, body = _post(served, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200
    text = _post(served, "/detokenize", {"tokens": body["tokens"]})[1]["prompt"]
    assert "Tools: get_weather get_time." in text
    # the assistant's arguments (JSON text) reach the template as an object, null content as ""
    call = '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    assert call in text.replace('"days": 3, "city": "Paris"', '"city": "Paris", "days": 3')
    assert "<tool_response id=call_1>sunny</tool_response>" in text and "None" not in text
    status, plain = _post(served, "/tokenize", {"messages": ASK})
    assert status == 200 and plain["count"] < body["count"]


def test_named_tool_choice_is_guided_by_its_schema(served):
    for fn, schema in (("get_weather", WEATHER), ("get_time", CLOCK)):
        req = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": fn}},
               "max_tokens": 80, "temperature": 0.8, "seed": 1}
        status, body = _post(served, "/v1/chat/completions", req)
        assert status == 200
        choice = body["choices"][0]
        msg = choice["message"]
        assert choice["finish_reason"] == "stop" and msg["content"] is None and len(msg["tool_calls"]) == 1
        call = msg["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == fn
        args = json.loads(call["function"]["arguments"])
        assert valid(args, schema), args
        # streamed: the call named in its first chunk, its arguments in pieces as they are generated
        status, data = _post(served, "/v1/chat/completions", {**req, "stream": True}, raw=True)
        events = [e for e in _events(data) if e["choices"]]
        assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "stop"
        pieces = [e["choices"][0]["delta"]["tool_calls"] for e in events if "tool_calls" in e["choices"][0]["delta"]]
        assert len(pieces) > 2 and all(len(p) == 1 and p[0]["index"] == 0 for p in pieces)
        head = pieces[0][0]
        assert head["type"] == "function" and head["id"].startswith("call_") and head["function"]["name"] == fn
        assert all("id" not in p[0] and "name" not in p[0]["function"] for p in pieces[1:])
        # same seed, same arguments
        assert "".join(p[0]["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
        assert not any(e["choices"][0]["delta"].get("content") for e in events)


def test_required_tool_choice_gives_calls_valid_for_their_tools(served):
    close = str(ord("]"))  # only the array's end can be "]" in these schemas: favour ending after one call
    seen = set()
    for seed in range(3):
        status, body = _post(served, "/v1/chat/completions", {
            "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 1.0,
            "seed": seed, "logit_bias": {close: 30}})
        assert status == 200
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert len(calls) >= 1
        for call in calls:
            name = call["function"]["name"]
            assert name in ("get_weather", "get_time") and call["id"].startswith("call_")
            assert valid(json.loads(call["function"]["arguments"]), WEATHER if name == "get_weather" else CLOCK)
            seen.add(name)
        # streamed (same seed): each call named in its first piece, its arguments in pieces after it
        status, data = _post(served, "/v1/chat/completions", {
            "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 1.0,
            "seed": seed, "logit_bias": {close: 30}, "stream": True}, raw=True)
        events = [e["choices"][0] for e in _events(data) if e["choices"]]
        assert status == 200 and events[-1]["finish_reason"] == "tool_calls"
        pieces = [p for e in events for p in e["delta"].get("tool_calls", [])]
        streamed: dict[int, dict] = {}
        for p in pieces:
            if p["index"] not in streamed:  # a call's first piece: id, type and name
                assert p["id"].startswith("call_") and p["type"] == "function" and p["index"] == len(streamed)
                streamed[p["index"]] = {"name": p["function"]["name"], "arguments": ""}
            else:
                assert "id" not in p and "name" not in p["function"]
            streamed[p["index"]]["arguments"] += p["function"]["arguments"]
        assert len(pieces) > len(calls)  # the arguments came in pieces
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]  # the same text, as written
    assert seen  # (which tool the random model picks is its own business)


def test_required_calls_so_far_extend_at_every_prefix():
    from infercore.serve import required_calls_so_far

    text = ('[ {"name": "get_weather", "parameters": {"city": "Pa\\"ris{", "nested": {"a": [1, {"b": "}"}]}}}, '
            '{"parameters": {"zone": "Utc"}, "name": "get_time"} ]')
    final = required_calls_so_far(text)
    assert final == [("get_weather", '{"city": "Pa\\"ris{", "nested": {"a": [1, {"b": "}"}]}}'),
                     ("get_time", '{"zone": "Utc"}')]
    assert [json.loads(a) for _, a in final] == [{"city": 'Pa"ris{', "nested": {"a": [1, {"b": "}"}]}},
                                                 {"zone": "Utc"}]
    prev = []
    for k in range(len(text) + 1):
        now = required_calls_so_far(text[:k])
        assert len(now) >= len(prev)
        for (n0, a0), (n1, a1) in zip(prev, now):
            assert (n0 is None or n0 == n1) and a1.startswith(a0)
        for (n, a), (fn, fa) in zip(now, final):
            assert n in (None, fn) and fa.startswith(a)
        prev = now


FORCED = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


def test_auto_tool_choice_parses_hermes_calls(served):
    """A reply written in the Hermes format (forced with guided_regex: a random model would not) is read into
    tool_calls; with tool_choice "none" it stays text."""
    req = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0, "guided_regex": re.escape(FORCED)}
    status, body = _post(served, "/v1/chat/completions", req)  # tool_choice defaults to "auto" with tools
    assert status == 200
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    status, body = _post(served, "/v1/chat/completions", {**req, "tool_choice": "none"})
    msg = body["choices"][0]["message"]
    assert status == 200 and msg == {"role": "assistant", "content": FORCED}
    assert body["choices"][0]["finish_reason"] == "stop"
    _, data = _post(served, "/v1/chat/completions", {**req, "tool_choice": "none", "stream": True}, raw=True)
    chunks = [e["choices"][0] for e in _events(data)]
    assert "".join(c["delta"].get("content", "") for c in chunks) == FORCED
    assert not any("tool_calls" in c["delta"] for c in chunks) and chunks[-1]["finish_reason"] == "stop"


def add_up(chunks: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """A streamed chat choice's chunks added up: its content and ``(name, arguments)`` per call, checking the chunk
    shape: a call's first piece carries its index (the next), id, type and name; later ones only arguments."""
    content, calls = "", []
    for c in chunks:
        content += c["delta"].get("content") or ""
        for p in c["delta"].get("tool_calls", []):
            if p["index"] == len(calls):
                assert p["id"].startswith("call_") and p["type"] == "function" and p["function"]["name"]
                calls.append([p["function"]["name"], p["function"]["arguments"]])
            else:
                assert p["index"] < len(calls) and "id" not in p and set(p["function"]) == {"arguments"}
                calls[p["index"]][1] += p["function"]["arguments"]
    return content, [tuple(c) for c in calls]


WANT_CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "Utc"}')]
AUTO_REPLIES = {  # parser -> a reply in its format with the two calls of WANT_CALLS, and that reply's content
    "hermes": ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "Utc"}}</tool_call>',
               "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"zone": "Utc"}}', None),
    "mistral": ('Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {"zone": "Utc"}}]', "Let me check."),
}


@pytest.mark.parametrize("parser", list(AUTO_REPLIES))
def test_auto_tool_calls_stream_as_generated(served, monkeypatch, parser):
    """Each parser's reply (forced; one token per byte): the whole reply's message, and its stream, which sends the
    content before the calls as it comes, then each call once named and its arguments a piece per token, adding
    up to the whole reply's, for every choice."""
    monkeypatch.setattr(served, "tool_parser", get_tool_parser(parser))
    text, content = AUTO_REPLIES[parser]
    req = {"messages": ASK, "tools": TOOLS, "max_tokens": 300, "temperature": 0, "guided_regex": re.escape(text)}
    status, body = _post(served, "/v1/chat/completions", req)
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == content
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert calls == WANT_CALLS
    status, data = _post(served, "/v1/chat/completions", {**req, "stream": True, "n": 2}, raw=True)
    events = _events(data)
    assert status == 200
    for i in range(2):
        chunks = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert add_up(chunks) == ((content or ""), calls)
        assert chunks[-1]["finish_reason"] == "tool_calls" and all(c["finish_reason"] is None for c in chunks[:-1])
        pieces = [(k, p) for k, c in enumerate(chunks) for p in c["delta"].get("tool_calls", [])]
        # each call named as soon as its name is out, with no arguments yet; then one piece per token
        assert [p["function"] for _, p in pieces if "id" in p] == [{"name": n, "arguments": ""} for n, _ in calls]
        assert len(pieces) == len(calls) + sum(len(a) for _, a in calls)
        first = pieces[0][0]
        said = [k for k, c in enumerate(chunks) if c["delta"].get("content")]
        assert all(k < first for k in said)  # no content once the call began
        if content:
            assert len(said) > 5  # the content streamed as it came


@pytest.mark.parametrize("parser, text", [
    ("hermes", "Use <tool> or <tool_call tags, not </tool_call>."),
    ("mistral", "A [TOOL] or [TOOL_CALLS is no call."),
    ("llama3_json", "<|python is no tag {x}"),
])
def test_auto_false_starts_stream_as_content(served, monkeypatch, parser, text):
    """Text that looks like the start of a call but is none streams as content (held back only while it may still
    be one): all of it, as it comes, with finish_reason "stop"."""
    monkeypatch.setattr(served, "tool_parser", get_tool_parser(parser))
    req = {"messages": ASK, "tools": TOOLS, "max_tokens": 100, "temperature": 0, "guided_regex": re.escape(text),
           "stream": True}
    status, data = _post(served, "/v1/chat/completions", req, raw=True)
    chunks = [e["choices"][0] for e in _events(data)]
    assert status == 200 and add_up(chunks) == (text, []) and chunks[-1]["finish_reason"] == "stop"
    said = [c["delta"]["content"] for c in chunks if c["delta"].get("content")]
    # as it came (a space waits for the next word): a held-back start went out once it proved none
    assert len(said) > len(text) // 3
    marker = {"hermes": "<tool", "mistral": "[TOOL", "llama3_json": "<|python"}[parser]
    k = text.index(marker) + len(marker)
    assert len("".join(said[:-3])) >= k  # the false start went out well before the end of the reply


@pytest.mark.parametrize("body, param, text", [
    ({"tools": {"name": "f"}}, "tools", "tools must be a non-empty list"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", "parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}],
      "tool_choice": "required"}, "tools", "unsupported keyword 'not'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "response_format": {"type": "json_object"}}, "tool_choice", "guides the output itself"),
    ({"messages": ASK + [{"role": "tool", "content": "sunny"}]}, "messages", "tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages", "arguments"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "messages[0].content"),
    ({"use_beam_search": True, "stream": True}, "stream", "not with stream"),
    ({"use_beam_search": True, "n": 3, "beam_width": 2}, "beam_width", "must be >= n"),
    ({"use_beam_search": True, "logprobs": True}, "logprobs", "not returned by beam search"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only for stream"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options", "include_usage"),
])
def test_bad_tool_beam_and_stream_fields_get_400(served, body, param, text):
    status, reply = _post(served, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400, reply
    assert text in reply["error"]["message"] and reply["error"]["param"] == param


# ---------------------------------------------------------------------------------------------- beam search


def test_beam_search_equals_the_engine(served):
    eng = served.loop.engine
    prompt = eng.tokenizer.encode("The weather is")
    want = served.loop.call(lambda e: e.beam_search(prompt, beam_width=3, max_tokens=6, length_penalty=0.5))[0]
    plain = served.loop.call(lambda e: e.generate(["Count:"], SamplingParams(temperature=0, max_tokens=40,
                                                                            ignore_eos=True)))[0]
    other = []  # a stream running beside the beam search is served as if alone
    t = threading.Thread(target=lambda: other.append(_post(served, "/v1/completions", {
        "prompt": "Count:", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}, raw=True)))
    t.start()
    status, body = _post(served, "/v1/completions", {"prompt": "The weather is", "use_beam_search": True, "n": 2,
                                                     "beam_width": 3, "max_tokens": 6, "length_penalty": 0.5})
    t.join(timeout=120)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [(h.text, h.finish_reason) for h in want[:2]]
    assert body["usage"]["completion_tokens"] == sum(len(h.token_ids) for h in want[:2])
    assert body["usage"]["prompt_tokens"] == 2 * len(prompt)
    assert "".join(e["choices"][0]["text"] for e in _events(other[0][1])) == plain.text
    # chat: the conversation's template, then the same search; echo on a completion puts the prompt first
    ids = _post(served, "/tokenize", {"messages": ASK})[1]["tokens"]
    want = served.loop.call(lambda e: e.beam_search(ids, beam_width=2, max_tokens=4))[0]
    status, body = _post(served, "/v1/chat/completions", {"messages": ASK, "use_beam_search": True, "n": 2,
                                                          "max_tokens": 4})
    assert status == 200
    assert [c["message"]["content"] for c in body["choices"]] == [h.text for h in want]
    status, body = _post(served, "/v1/completions", {"prompt": "The weather is", "use_beam_search": True,
                                                     "max_tokens": 4, "echo": True})
    best = served.loop.call(lambda e: e.beam_search(prompt, beam_width=1, max_tokens=4))[0][0]
    assert status == 200 and body["choices"][0]["text"] == "The weather is" + best.text
    assert not served.loop.engine.has_unfinished()


def test_beam_search_length_penalty_over_http(served):
    """With an end-of-sequence token among the candidates (as test_beam.py makes one), hypotheses of several
    lengths compete and ``length_penalty`` reorders them: the server's replies follow the engine's."""
    eng = served.loop.engine
    prompt = eng.tokenizer.encode("The weather is")
    free = served.loop.call(lambda e: e.beam_search(prompt, beam_width=3, max_tokens=6, ignore_eos=True))[0]
    saved = eng._eos
    served.loop.call(lambda e: setattr(e, "_eos", frozenset({free[1].token_ids[0]})))
    try:
        got = {}
        for penalty in (0.0, 3.0):
            want = served.loop.call(lambda e, lp: e.beam_search(prompt, beam_width=3, max_tokens=6,
                                                                length_penalty=lp), penalty)[0]
            status, body = _post(served, "/v1/completions", {"prompt": prompt, "use_beam_search": True, "n": 3,
                                                             "max_tokens": 6, "length_penalty": penalty})
            assert status == 200
            got[penalty] = [(c["text"], c["finish_reason"]) for c in body["choices"]]
            assert got[penalty] == [(h.text, h.finish_reason) for h in want]
        assert got[0.0] != got[3.0] and "stop" in {r for _, r in got[0.0]}
    finally:
        served.loop.call(lambda e: setattr(e, "_eos", saved))


# ---------------------------------------------------------------------------------------------- usage and echo


def test_stream_usage_chunk_equals_the_whole_reply(served):
    for path, req in (("/v1/completions", {"prompt": ["Hello", "Count to 3:"], "n": 2, "max_tokens": 7}),
                      ("/v1/chat/completions", {"messages": ASK, "max_tokens": 9})):
        req = {**req, "temperature": 0}
        status, whole = _post(served, path, req)
        status2, data = _post(served, path, {**req, "stream": True, "stream_options": {"include_usage": True}},
                              raw=True)
        events = _events(data)
        assert status == status2 == 200
        assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
        assert all(e["usage"] is None for e in events[:-1]) and events[-1]["id"] == events[0]["id"]
        _, data = _post(served, path, {**req, "stream": True}, raw=True)
        assert all("usage" not in e for e in _events(data))


def test_echo_puts_the_prompt_first(served):
    tok = served.loop.engine.tokenizer
    prompts = ["The weather is", tok.encode("Count to 3:")]
    req = {"prompt": prompts, "max_tokens": 6, "temperature": 0}
    plain = _post(served, "/v1/completions", req)[1]["choices"]
    status, body = _post(served, "/v1/completions", {**req, "echo": True})
    assert status == 200
    want = ["The weather is" + plain[0]["text"], "Count to 3:" + plain[1]["text"]]
    assert [c["text"] for c in body["choices"]] == want
    status, data = _post(served, "/v1/completions", {**req, "echo": True, "stream": True}, raw=True)
    texts = ["", ""]
    for e in _events(data):
        texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert status == 200 and texts == [c["text"] for c in body["choices"]]
    # with logprobs: the prompt's tokens and log-probabilities before the generated ones (the first None)
    ref = _post(served, "/v1/completions", {**req, "prompt": "The weather is", "logprobs": 1,
                                            "prompt_logprobs": 1})[1]["choices"][0]
    status, body = _post(served, "/v1/completions", {**req, "prompt": "The weather is", "logprobs": 1, "echo": True})
    choice = body["choices"][0]
    lp, n = choice["logprobs"], len(tok.encode("The weather is"))
    assert status == 200 and "prompt_logprobs" not in choice
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == n + 6
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [next(iter(d.values()))["logprob"] for d in ref["prompt_logprobs"][1:]]
    assert lp["token_logprobs"][1:n] == pytest.approx(want, abs=1e-5)
    assert lp["token_logprobs"][n:] == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-5)


@pytest.mark.parametrize("flag,key,cases", [
    ("--tool-call-parser", "tool_call_parser", (([], "hermes"), (["none"], None), (["mistral"], "mistral"))),
    ("--reasoning-parser", "reasoning_parser", (([], None), (["qwen3"], "qwen3"), (["deepseek_r1"], "deepseek_r1"))),
])
def test_cli_parser_flags(served, monkeypatch, capsys, flag, key, cases):
    """``infercore serve``'s parser options reach ``make_server``; an unknown name is refused by argparse."""
    from infercore import cli, serve

    seen = {}

    def fake_server(engine, **kw):
        seen.update(kw)
        raise ValueError("not serving here")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(lambda *a, **k: served.loop.engine))
    monkeypatch.setattr(serve, "make_server", fake_server)
    for value, want in cases:
        assert cli.main(["serve", *([flag, *value] if value else [])]) == 2
        assert "not serving here" in capsys.readouterr().err
        assert seen[key] == want
    with pytest.raises(SystemExit):
        cli.main(["serve", flag, "xml"])
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_a_tool_parser_defines_a_reader():
    """A format must give a stream reader or extract: checked when the class is defined, not at a reply."""
    from infercore.tool_parsers import ToolParser

    with pytest.raises(TypeError, match="stream_class or extract"):
        type("Empty", (ToolParser,), {})
    with pytest.raises(TypeError, match="get_tool_parser"):
        ToolParser().extract("x")

    class Whole(ToolParser):  # extract alone: its streams hold the reply back and read it whole at the end
        def extract(self, text):
            return None, []

    assert Whole().extract("x") == (None, [])
