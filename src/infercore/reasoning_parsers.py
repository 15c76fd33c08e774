"""Reasoning parsers: a thinking model's reasoning, split from its answer.

Models such as DeepSeek-R1 and Qwen3 write their reasoning between ``<think>`` and ``</think>`` before the answer.
The server (``make_server(reasoning_parser=...)`` / ``infercore serve --reasoning-parser``) returns the reasoning
as the chat message's ``reasoning_content`` and the rest as its ``content``, in whole replies and in streams (the
deltas carry ``reasoning_content`` until the end tag, then ``content``). A parser is a class registered under a
name (:func:`register_reasoning_parser`); :func:`get_reasoning_parser` builds one.
"""

from __future__ import annotations

from ._registry import Registry

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser",
           "get_reasoning_parser", "register_reasoning_parser"]


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag`` (held back while streaming)."""
    for m in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:m]):
            return m
    return 0


class ReasoningParser:
    """``<think>`` ... ``</think>`` then the answer. ``implicit``: whether a reply without the opening tag is reasoning
    all the same up to the end tag (DeepSeek-R1's chat template writes ``<think>`` into the prompt, so its replies
    start inside the block); otherwise such a reply is all answer (Qwen3 with thinking switched off)."""

    start = "<think>"
    end = "</think>"
    implicit = True

    def split(self, text: str, *, finished: bool = True, explicit: bool = False) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of ``text``. With ``finished=False`` (a stream's text so far) each is the part that
        is settled: a later, longer text's parts start with these (a tail that may begin a tag is held back, as is a
        start that may still turn out to be the opening tag). None: no such part (no reasoning block; nothing after
        the block). ``explicit``: only a reply that opens the block has reasoning, whatever :attr:`implicit` says
        (a guided reply, whose pattern decides whether it may open one)."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not finished and self.start.startswith(body):
            return None, None  # "", "<", "<th", ...: not yet known whether a block opens
        elif explicit or not self.implicit:
            return None, (text or None)
        k = body.find(self.end)
        if k >= 0:
            return body[:k], (body[k + len(self.end):] or None)
        if finished:  # the block never closed (cut off by max_tokens): all reasoning
            return body, None
        return body[: len(body) - _held(body, self.end)], None


REASONING_PARSERS = Registry("reasoning_parser")  # name -> ReasoningParser subclass
register_reasoning_parser = REASONING_PARSERS.register  # class decorator: register a subclass under a name


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A new parser of the format ``name`` (ValueError naming the registered ones for anything else)."""
    return REASONING_PARSERS.build(name)


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the reply starts inside the block, with or without ``<think>``."""

    implicit = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only where the reply opens a ``<think>`` block (``enable_thinking=False`` replies have none,
    or an empty one)."""

    implicit = False
