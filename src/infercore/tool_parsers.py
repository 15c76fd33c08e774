"""Tool-call parsers: the function calls a chat model wrote in its own format, read out of its text.

The server (``tool_choice: "auto"``, :mod:`infercore.serve`) reads each reply with the parser named by
``make_server(tool_call_parser=...)`` / ``infercore serve --tool-call-parser``. A parser is a class registered under a
name (:func:`register_tool_parser`); :func:`get_tool_parser` builds one. ``parser.extract(text)`` reads a finished
reply: the text outside the calls (the message's ``content``) and the calls as :class:`ToolCall`.
``parser.stream()`` reads one reply as it is generated (a :class:`ToolStream`, vLLM's streaming tool parsers'
behaviour): each :meth:`ToolStream.feed` of new text gives the :class:`ToolDelta` that may go out now, the content
while the text is outside a call (a tail that may begin a call's opening is held back), each call once its name is
out (``index``, ``id``, ``type``, ``function.name``), then its arguments' text as it grows. ``extract`` is one feed
of the whole text, so the pieces of a stream add up to the finished reply's message.

A call's ``arguments`` are the JSON object as the model wrote it (the decoded text where it wrote the object as a
JSON string). ``content`` is the text outside the calls less the whitespace right before each call and at the end;
a reply without calls is its content unchanged.

A stream commits to a call once its name is out. Should the text then break the format (a reply cut off inside
the call, junk after it), the call stays with its arguments as far as they went and the rest is content, where
the finished reply, seen whole, reads such a call as content.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ._registry import Registry

__all__ = ["TOOL_PARSERS", "HermesToolParser", "HermesToolStream", "Llama3JsonToolParser", "Llama3JsonToolStream",
           "MistralToolParser", "MistralToolStream", "ToolCall", "ToolDelta", "ToolParser", "ToolStream",
           "get_tool_parser", "new_call_id", "register_tool_parser"]


def new_call_id() -> str:
    """A fresh tool-call id, ``call_`` and 24 hex digits (OpenAI's form)."""
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    """One function call: the function's ``name`` and its ``arguments`` as JSON text (OpenAI's
    ``tool_calls[i].function``)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    """What a :class:`ToolStream` may send after a feed: ``content`` text ("" for none) and ``tool_calls`` pieces in
    OpenAI's chunk shape: a call's first piece ``{"index", "id", "type": "function", "function": {"name",
    "arguments"}}`` (the arguments so far, maybe ""), later ones ``{"index", "function": {"arguments"}}``."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- scanning


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def _tail(text: str, tag: str, lo: int = 0) -> int:
    """How many trailing characters of ``text[lo:]`` could begin ``tag`` (held back while streaming)."""
    for m in range(min(len(tag) - 1, len(text) - lo), 0, -1):
        if text.endswith(tag[:m]):
            return m
    return 0


def _settled(raw: str) -> str:
    """The part of a JSON string's body ``raw`` (written so far) whose decoding is final: without an unfinished
    escape at its end, nor a ``\\uD8xx`` high surrogate that its pair may still follow."""
    i = raw.find("\\")
    while i >= 0:
        if i + 1 >= len(raw):
            return raw[:i]
        if raw[i + 1] != "u":
            i = raw.find("\\", i + 2)
            continue
        if i + 6 > len(raw):
            return raw[:i]
        if raw[i + 2:i + 4].lower() in ("d8", "d9", "da", "db") and i + 12 > len(raw):
            return raw[:i]
        i = raw.find("\\", i + 6)
    return raw


_STR_STOP = re.compile(r'["\\]')
_ARG_KEYS = ("arguments", "parameters")


class _CallScan:
    """Reads one call object ``{"name": ..., "arguments" | "parameters": {...} | "{...}"}`` from ``text[start]``
    (a ``{``) as the text grows, following its strings and nesting: its ``name`` once that string has closed, where
    its arguments value starts and ends (the first of the two keys), and ``end``, the index after its closing
    brace. Each character is read once; its JSON syntax is checked once it has closed (:meth:`result`)."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.end: int | None = None
        self.depth, self.in_str, self.esc, self.str_from, self.str_value = 0, False, False, 0, False
        self.key: str | None = None
        self.want_value = False  # after a top-level ':'
        self.name: str | None = None
        self.name_seen, self.name_from = False, -1
        self.args_seen, self.args_str = False, False
        self.args_from: int | None = None
        self.args_to: int | None = None
        self._decoded, self._raw = "", 0  # a string-valued arguments' settled text, and its raw length

    def advance(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end is None:
            if self.in_str:
                if self.esc:
                    self.esc, i = False, i + 1
                    continue
                m = _STR_STOP.search(text, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if text[i] == "\\":
                    self.esc = True
                else:
                    self.in_str = False
                    if self.depth == 1:
                        self._string_closed(text, i)
                i += 1
                continue
            ch = text[i]
            if ch == '"':
                self.in_str, self.str_from, self.str_value = True, i, False
                if self.depth == 1 and self.want_value:
                    self.str_value = True
                    self._value(ch, i)
            elif ch in "{[":
                if self.depth == 1 and self.want_value:
                    self._value(ch, i)
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self.args_from is not None and not self.args_str and self.args_to is None:
                    self.args_to = i + 1
                if self.depth <= 0:
                    self.end = i + 1
            elif self.depth == 1:
                if ch == ":":
                    self.want_value = True
                elif ch == ",":
                    self.key, self.want_value = None, False
                elif self.want_value and not ch.isspace():  # a number or literal
                    self._value(ch, i)
            i += 1
        self.pos = i

    def _value(self, ch: str, i: int) -> None:
        self.want_value = False
        if self.key == "name" and not self.name_seen:
            self.name_seen, self.name_from = True, i if ch == '"' else -1
        elif self.key in _ARG_KEYS and not self.args_seen:
            self.args_seen = True
            if ch in '{"':
                self.args_from, self.args_str = i, ch == '"'

    def _string_closed(self, text: str, i: int) -> None:
        try:
            word = json.loads(text[self.str_from:i + 1])
        except ValueError:
            word = None
        if not self.str_value:
            self.key = word
        elif self.str_from == self.name_from:
            self.name = word or None
        elif self.args_str and self.str_from == self.args_from:
            self.args_to = i + 1

    def args_so_far(self, text: str) -> str:
        """The arguments' text that is settled: the object as written so far, or a JSON string's decoded text so
        far ("" before the value starts). A later text's is longer, starting with this one."""
        if self.args_from is None:
            return ""
        if not self.args_str:
            return text[self.args_from:self.args_to or self.pos]
        at = self.args_from + 1 + self._raw  # decoded up to here (never inside an escape)
        raw = text[at:self.args_to - 1 if self.args_to else self.pos]
        raw = raw if self.args_to else _settled(raw)
        try:
            self._decoded += json.loads(f'"{raw}"', strict=False)
            self._raw += len(raw)
        except ValueError:  # a bad escape: the object will not parse; keep what was settled
            pass
        return self._decoded

    def result(self, text: str) -> tuple[str, str] | None:
        """Once closed: ``(name, arguments)`` if the object is a call (valid JSON, a non-empty string name,
        arguments an object or JSON text of one, ``{}`` when absent), else None."""
        try:
            obj = json.loads(text[self.start:self.end])
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(self.name, str):
            return None
        if not self.args_seen:
            return self.name, "{}"
        if self.args_from is None:
            return None
        if not self.args_str:
            return self.name, text[self.args_from:self.args_to]
        args = json.loads(text[self.args_from:self.args_to])
        try:
            ok = isinstance(json.loads(args), dict)
        except ValueError:
            ok = False
        return (self.name, args) if ok else None


# ---------------------------------------------------------------------------------------------- streams


@dataclass(eq=False)
class _Call:
    """A call being read: ``ws``, the content's whitespace held before it (content again should it prove no call);
    ``sent``, its argument characters out (None: not announced yet)."""

    ws: str = ""
    name: str | None = None
    args: str = ""
    done: bool = False
    sent: int | None = None
    id: str = field(default_factory=new_call_id)


class ToolStream(ABC):
    """Reads one reply's tool calls as its text grows. :meth:`feed` each new piece (``final=True`` with the last);
    each feed returns the :class:`ToolDelta` to send. Subclasses implement :meth:`_advance`, which reads
    ``self.text`` from ``self.pos`` as far as it can decide, handing content to :meth:`_say` and keeping the calls
    in ``self.calls`` (the last one open while its object is read); a call is announced at the end of the feed
    in which its name became known."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.final = False
        self.calls: list[_Call] = []
        self._out: list[str] = []  # content said during this feed
        self._ws = ""  # the content's trailing whitespace, held: it is dropped before a call and at the end

    def feed(self, text: str, *, final: bool = False) -> ToolDelta:
        """Read ``text``, the reply's next piece; ``final``: it is the last (everything held back is decided)."""
        self.text += text
        self.final = final
        self._advance()
        if final:
            if not self.calls:
                self._out.append(self._ws)
            self._ws = ""
        return self._emit()

    @property
    def called(self) -> bool:
        """Whether any call was announced."""
        return any(c.sent is not None for c in self.calls)

    def tool_calls(self) -> list[ToolCall]:
        """The calls announced so far (after the final feed: all of the reply's)."""
        return [ToolCall(c.name, c.args, c.id) for c in self.calls if c.sent is not None]

    @abstractmethod
    def _advance(self) -> None:
        """Read on from ``pos`` as far as the text decides, saying content and opening / growing calls."""

    def _text_until(self, mark: str) -> int | None:
        """Content from ``pos`` up to ``mark``: said, and the marker's index returned; without the marker all of the
        text is said but a tail that may yet become it (none once final), and None."""
        text = self.text
        k = text.find(mark, self.pos)
        if k < 0:
            stop = len(text) if self.final else len(text) - _tail(text, mark, self.pos)
            self._say(text[self.pos:stop])
            self.pos = stop
            return None
        self._say(text[self.pos:k])
        return k

    def _say(self, s: str) -> None:
        if not s:
            return
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body):]
        if body:
            self._out.append(body)

    def _open_call(self) -> _Call:
        call = _Call(ws=self._ws)
        self._ws = ""
        self.calls.append(call)
        return call

    def _drop_call(self) -> None:
        """The open call is no call after all: its held whitespace is content again."""
        self._ws = self.calls.pop().ws

    def _read_call(self, scan: _CallScan) -> str:
        """Advance the open call's object: "open" while it has not closed, "ok" once closed as a call, "bad" once
        closed as something else."""
        call = self.calls[-1]
        scan.advance(self.text)
        if scan.end is None:
            call.name, call.args = scan.name, scan.args_so_far(self.text)
            return "open"
        got = scan.result(self.text)
        if got is None:
            return "bad"
        (call.name, call.args), call.done = got, True
        return "ok"

    def _break(self, at: int, whole_from: int) -> None:
        """The reply left the format at ``at`` (a one-format-throughout reply: Llama 3 JSON, Mistral). Before any
        call went out, the whole reply from ``whole_from`` is content (as :meth:`ToolParser.extract` reads it);
        after, the calls read stay, the open one only if announced, and the rest from ``at`` is content."""
        if not self.called:
            if self.calls:
                self._ws = self.calls[0].ws
            self.calls.clear()
            at = whole_from
        elif not self.calls[-1].done and self.calls[-1].sent is None:
            self._drop_call()
        self._say(self.text[at:])
        self.pos, self.state = len(self.text), "rest"

    def _emit(self) -> ToolDelta:
        delta = ToolDelta("".join(self._out))
        self._out.clear()
        for k, c in enumerate(self.calls):
            if c.name is None:
                continue
            if c.sent is None:
                delta.tool_calls.append({"index": k, "id": c.id, "type": "function",
                                         "function": {"name": c.name, "arguments": c.args}})
                c.sent = len(c.args)
            elif len(c.args) > c.sent:
                delta.tool_calls.append({"index": k, "function": {"arguments": c.args[c.sent:]}})
                c.sent = len(c.args)
        return delta


class _HeldStream(ToolStream):
    """A parser with no stream of its own: the whole reply is held back and read by its ``extract`` at the end."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()
        self.parser = parser

    def _advance(self) -> None:
        if not self.final:
            return
        content, calls = self.parser.extract(self.text)
        self._out.append(content or "")
        self.calls = [_Call(name=c.name, args=c.arguments, done=True, id=c.id) for c in calls]


class HermesToolStream(ToolStream):
    """:class:`HermesToolParser`'s reader. A block opened by ``<tool_call>`` is a call when its body is one call
    object, then (after whitespace) ``</tool_call>`` or the end of the reply; otherwise the block is content as
    written up to the first ``</tool_call>``, and so is the text between calls."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "text"
        self.block = self.search = 0  # the open block's tag; where a content block's closing tag is looked for
        self.scan: _CallScan | None = None

    def _advance(self) -> None:
        text, final, start, end = self.text, self.final, self.start, self.end
        while True:
            if self.state == "text":
                k = self._text_until(start)
                if k is None:
                    return
                self.block, self.pos, self.state = k, k + len(start), "open"
            elif self.state == "open":  # after the tag: a call object, or the block is content
                j = _skip_ws(text, self.pos)
                if j == len(text) and not final:
                    return
                if j == len(text) or text[j] != "{":
                    self._as_text()
                    continue
                self.scan = _CallScan(j)
                self._open_call()
                self.state = "call"
            elif self.state == "call":
                got = self._read_call(self.scan)
                announced = self.calls[-1].sent is not None
                if got == "open":
                    if not final:
                        return
                    if not announced:  # cut off before its end: content, as a whole reply reads it
                        self._as_text()
                        continue
                    self.pos, self.state = len(text), "text"
                elif got == "bad" and not announced:
                    self._as_text()
                else:
                    self.pos, self.state = self.scan.end, "close"
            elif self.state == "close":  # after the object: its closing tag, or the reply's end
                j = _skip_ws(text, self.pos)
                if text.startswith(end, j):
                    self.pos, self.state = j + len(end), "text"
                elif (j == len(text) or end.startswith(text[j:])) and not final:
                    return
                elif j == len(text):
                    self.pos, self.state = j, "text"
                elif self.calls[-1].sent is None:  # junk after the object: the block is content
                    self._as_text()
                else:
                    self.pos, self.state = j, "text"
            else:  # "content": a block that is no call, up to its closing tag
                k = text.find(end, self.search)
                if k >= 0:
                    self._say(text[self.pos:k + len(end)])
                    self.pos, self.state = k + len(end), "text"
                    continue
                stop = len(text) if final else max(self.pos, len(text) - _tail(text, end, self.search))
                self._say(text[self.pos:stop])
                self.pos = self.search = stop
                return

    def _as_text(self) -> None:
        if self.state in ("call", "close"):
            self._drop_call()
        self.scan, self.state = None, "content"
        self.pos, self.search = self.block, self.block + len(self.start)


class Llama3JsonToolStream(ToolStream):
    """:class:`Llama3JsonToolParser`'s reader: a reply that starts (after whitespace and ``<|python_tag|>``) with
    ``{`` is read as calls separated by ``;``; any other reply is content, streamed as it comes."""

    tag = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"
        self.scan: _CallScan | None = None

    def _advance(self) -> None:
        text, final = self.text, self.final
        while True:
            if self.state == "start":
                j = _skip_ws(text, 0)
                if text.startswith(self.tag, j):
                    j = _skip_ws(text, j + len(self.tag))
                elif j < len(text) and self.tag.startswith(text[j:]) and not final:
                    return
                if j == len(text) and not final:
                    return
                if j < len(text) and text[j] == "{":
                    self.pos, self.state = j, "calls"
                else:
                    self.state = "rest"
            elif self.state == "calls":  # between calls
                j = self.pos
                while j < len(text) and (text[j].isspace() or text[j] == ";"):
                    j += 1
                self.pos = j
                if j == len(text):
                    return
                if text[j] != "{":
                    self._break(j, 0)
                    continue
                self.scan = _CallScan(j)
                self._open_call()
                self.state = "call"
            elif self.state == "call":
                got = self._read_call(self.scan)
                if got == "ok":
                    self.pos, self.state = self.scan.end, "calls"
                elif got == "bad" or final:
                    self._break(self._after(self.scan), 0)
                else:
                    return
            else:  # "rest": content
                self._say(text[self.pos:])
                self.pos = len(text)
                return

    def _after(self, scan: _CallScan) -> int:
        """Where content resumes after the open call broke: past it if it went out, else at its start."""
        return (scan.end or len(self.text)) if self.calls[-1].sent is not None else scan.start


class MistralToolStream(ToolStream):
    """:class:`MistralToolParser`'s reader: content up to the first ``[TOOL_CALLS]``; after each marker a JSON array
    of call objects or one ``name[ARGS]{...}`` call; anything else after the first marker breaks the format."""

    mark, args_tag = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self.state = "text"
        self.first = 0  # the first marker
        self.item = True  # in an array: an item comes next (else "," or "]")
        self.scan: _CallScan | None = None

    def _advance(self) -> None:
        text, final, mark = self.text, self.final, self.mark
        while True:
            state = self.state
            if state == "text":
                k = self._text_until(mark)
                if k is None:
                    return
                self.first, self.pos, self.state = k, k + len(mark), "part"
            elif state in ("part", "between"):  # after a marker / after a call: a call, or the next marker
                j = _skip_ws(text, self.pos)
                if text.startswith(mark, j):
                    self.pos, self.state = j + len(mark), "part"
                elif (j == len(text) or mark.startswith(text[j:])) and not final:
                    return
                elif j == len(text):
                    if not self.calls:
                        self._break(j, self.first)
                    return
                elif state == "between":
                    self._break(j, self.first)
                elif text[j] == "[":
                    self.pos, self.state, self.item = j + 1, "array", True
                else:
                    self.pos, self.state = j, "name"
            elif state == "array":
                j = _skip_ws(text, self.pos)
                if j == len(text):
                    if final:
                        self._break(j, self.first)
                        continue
                    return
                ch = text[j]
                if self.item and ch == "{":
                    self.scan = _CallScan(j)
                    self._open_call()
                    self.state = "item"
                elif not self.item and ch in ",]":
                    self.pos, self.item = j + 1, True
                    if ch == "]":
                        self.state = "between"
                else:
                    self._break(j, self.first)
            elif state == "item":
                got = self._read_call(self.scan)
                if got == "ok":
                    self.pos, self.state, self.item = self.scan.end, "array", False
                elif got == "bad" or final:
                    self._break(self._after(), self.first)
                else:
                    return
            elif state == "name":  # name[ARGS]{...}
                k = text.find(self.args_tag, self.pos)
                m = text.find(mark, self.pos)
                if k < 0 or 0 <= m < k or not text[self.pos:k].strip():
                    if k < 0 and m < 0 and not final:
                        return
                    self._break(self.pos, self.first)
                    continue
                self._open_call().name = text[self.pos:k].strip()
                self.pos, self.state = k + len(self.args_tag), "args"
            elif state == "args":
                j = _skip_ws(text, self.pos)
                if j == len(text) and not final:
                    return
                if j == len(text) or text[j] != "{":
                    self._break(j, self.first)
                    continue
                self.scan, self.state = _CallScan(j), "object"
            elif state == "object":  # the arguments object itself
                scan, call = self.scan, self.calls[-1]
                scan.advance(text)
                if scan.end is None:
                    call.args = text[scan.start:scan.pos]
                    if final:
                        self._break(self._after(), self.first)
                        continue
                    return
                call.args = text[scan.start:scan.end]
                try:
                    call.done = isinstance(json.loads(call.args), dict)
                except ValueError:
                    call.done = False
                if call.done:
                    self.pos, self.state = scan.end, "between"
                else:
                    self._break(self._after(), self.first)
            else:  # "rest": content
                self._say(text[self.pos:])
                self.pos = len(text)
                return

    def _after(self) -> int:
        """Where content resumes after the open call broke: past its object if it went out, else at its start."""
        scan = self.scan
        return (scan.end or len(self.text)) if self.calls[-1].sent is not None else scan.start


# ---------------------------------------------------------------------------------------------- parsers


class ToolParser:
    """A tool-call format. ``start``: the text that opens a call, where there is one. ``stream_class``: the
    format's :class:`ToolStream`; a subclass without one defines :meth:`extract`, and its streams hold the whole
    reply back."""

    start: str | None = None
    stream_class: type[ToolStream] | None = None

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if cls.stream_class is None and cls.extract is ToolParser.extract:
            raise TypeError(f"{cls.__name__}: a tool parser defines stream_class or extract")

    def stream(self) -> ToolStream:
        """A reader of one reply as it is generated."""
        return self.stream_class() if self.stream_class is not None else _HeldStream(self)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)``: the calls in the order written and the text outside them (None when nothing is
        left); without calls, ``text`` itself."""
        if self.stream_class is None:  # only the base class itself (subclasses are checked when defined)
            raise TypeError("ToolParser is the base of the formats: use get_tool_parser(name)")
        s = self.stream_class()
        content = s.feed(text, final=True).content
        if not s.calls:
            return text, []
        return (content or None), s.tool_calls()


TOOL_PARSERS = Registry("tool_call_parser")  # name -> ToolParser subclass
register_tool_parser = TOOL_PARSERS.register  # class decorator: register a ToolParser subclass under a name


def get_tool_parser(name: str) -> ToolParser:
    """A new parser of the format ``name`` (ValueError naming the registered ones for anything else)."""
    return TOOL_PARSERS.build(name)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Hermes-style calls, as the Hermes 2 Pro / 3, Qwen2.5 and Qwen3 chat templates ask for: each call a JSON object
    ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, any number of them, with text
    around. A last block left open (the output ran out, or the model stopped at its end-of-turn token) is read to
    the end of the text. A block whose body is not such an object stays in the content as written."""

    start = HermesToolStream.start
    stream_class = HermesToolStream


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3's JSON tool calls: the whole reply is one or more ``{"name": ..., "parameters": {...}}``
    objects (``arguments`` accepted too), separated by ``;``, optionally after ``<|python_tag|>``. A reply that is
    anything else (prose, or JSON that is not such objects throughout) is content, unchanged. A stream holds back
    a reply that starts with ``{`` until its first call is named (or it proves to be no call)."""

    stream_class = Llama3JsonToolStream


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Mistral's tool calls after its ``[TOOL_CALLS]`` marker: a JSON array of ``{"name", "arguments"}`` objects
    (the v3 tokenizers' form), or ``name[ARGS]{...}`` per call (the v11+ form, repeated after further markers).
    The text before the marker is content; a reply whose calls do not parse is content, unchanged."""

    start = MistralToolStream.mark
    stream_class = MistralToolStream
