"""Tool-call parsers: the function calls a chat model wrote in its own format, read out of its text.

The server (``tool_choice: "auto"``, :mod:`infercore.serve`) runs the model freely and hands the finished text to
the parser named by ``make_server(tool_call_parser=...)`` / ``infercore serve --tool-call-parser``. A parser is a
class registered under a name (:func:`register_tool_parser`); :func:`get_tool_parser` builds one. Each returns
the text outside the calls (the message's ``content``) and the calls as :class:`ToolCall`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

__all__ = ["TOOL_PARSERS", "HermesToolParser", "ToolCall", "ToolParser", "get_tool_parser", "new_call_id",
           "register_tool_parser"]


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


class ToolParser:
    """Reads tool calls out of a model's finished output. ``start``: the text that opens a call, so a stream can
    send the text before it as it comes (None: the parser cannot say; streams hold the whole text back)."""

    start: str | None = None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)``: the calls in the order written and the text outside them, stripped (None when
        nothing is left); without calls, ``text`` itself."""
        raise NotImplementedError


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str):
    """Class decorator: register a :class:`ToolParser` subclass under ``name``."""

    def wrap(cls: type[ToolParser]) -> type[ToolParser]:
        TOOL_PARSERS[name] = cls
        return cls

    return wrap


def get_tool_parser(name: str) -> ToolParser:
    """A new parser of the format ``name`` (ValueError naming the registered ones for anything else)."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (registered: {sorted(TOOL_PARSERS)})")
    return cls()


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
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as JSON text already
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
