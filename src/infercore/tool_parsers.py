"""Tool-call parsers: the function calls a chat model wrote in its own format, read out of its text.

The server (``tool_choice: "auto"``, :mod:`infercore.serve`) runs the model freely and hands the finished text to
the parser named by ``make_server(tool_call_parser=...)`` / ``infercore serve --tool-call-parser``. A parser is a
class registered under a name (:func:`register_tool_parser`); :func:`get_tool_parser` builds one. Each returns
the text outside the calls (the message's ``content``) and the calls as :class:`ToolCall`.
"""

from __future__ import annotations

import abc
import json
import re
import secrets
from dataclasses import dataclass, field

from ._registry import Registry

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "ToolCall", "ToolParser",
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


class ToolParser(abc.ABC):
    """Reads tool calls out of a model's finished output. ``start``: the text that opens a call, so a stream can
    send the text before it as it comes (None: the parser cannot say; streams hold the whole text back)."""

    start: str | None = None

    @abc.abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)``: the calls in the order written and the text outside them, stripped (None when
        nothing is left); without calls, ``text`` itself."""


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

    start = "<tool_call>"
    end = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                continue  # left in the content, with its tags
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        if not calls:
            return text, []
        kept.append(text[pos:])
        content = "".join(kept).strip()
        return (content or None), calls

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            return _call_from(json.loads(body))
        except ValueError:
            return None

def _call_from(obj: object) -> ToolCall | None:
    """A call from a decoded ``{"name": ..., "arguments" | "parameters": {...} | JSON text}`` object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3's JSON tool calls: the whole reply is one or more ``{"name": ..., "parameters": {...}}``
    objects (``arguments`` accepted too), separated by ``;``, optionally after ``<|python_tag|>``. A reply that is
    anything else (prose, or JSON that is not such objects throughout) is content, unchanged. Streams hold the
    text back (a reply is a call only once it has parsed whole)."""

    tag = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].lstrip()
        if not body.startswith("{"):
            return text, []
        dec = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call_from(obj)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        return None, calls


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Mistral's tool calls after its ``[TOOL_CALLS]`` marker: a JSON array of ``{"name", "arguments"}`` objects
    (the v3 tokenizers' form), or ``name[ARGS]{...}`` per call (the v11+ form, repeated after further markers).
    The text before the marker is content; a reply whose calls do not parse is content, unchanged."""

    start = "[TOOL_CALLS]"
    _args = "[ARGS]"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        head, sep, rest = text.partition(self.start)
        if not sep:
            return text, []
        calls: list[ToolCall] = []
        for part in rest.split(self.start):
            part = part.strip()
            if not part:
                continue
            if part.startswith("["):
                try:
                    objs = json.loads(part)
                except ValueError:
                    return text, []
                if not isinstance(objs, list) or not objs:
                    return text, []
                got = [_call_from(o) for o in objs]
                if any(c is None for c in got):
                    return text, []
                calls.extend(got)
                continue
            name, sep2, args = part.partition(self._args)
            call = _call_from({"name": name.strip(), "arguments": args.strip()}) if sep2 else None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        return (head.strip() or None), calls
