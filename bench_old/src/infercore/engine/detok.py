"""Incremental detokenization: a request's text grows by each new token's characters.

Decoding the whole output again at every step costs O(n) per token and O(n^2) per request, per
sequence of the batch: with SmolLM2's tokenizer, 256 sequences of 1024-token outputs spent 51.4 ms of host
time per step on it, against 0.76 ms here (on the 2-vCPU Xeon, ``benchmarks/probe_detok.py``,
``benchmarks/results/cpu/sweeps/detok.json``); a random SmolLM2-shaped model on an H100 generating 256 requests of
512 tokens put out 13323 tokens/s, host-bound, against 46056 now (``benchmarks/probe_detok_serving.py``,
``benchmarks/results/h200/sweeps/probe_detok_serving_h100.json``). Here each step decodes only the new token
against a short window of the ones before it:

- With the Rust ``tokenizers`` library's ``DecodeStream`` (0.21.1+) and a tokenizer that exposes its
  ``tokenizers.Tokenizer`` as ``backend`` (:class:`infercore.loading.Tokenizer`), the stream does it:
  it holds back tokens that end inside a UTF-8 sequence and yields the text once it is complete.
- Otherwise any object with ``decode(ids, skip_special_tokens=...)`` works through a two-offset window
  (the scheme vLLM and transformers' streamers use): the text of ``ids[prefix:]`` minus that of
  ``ids[prefix:read]``, emitted once it does not end in U+FFFD (an incomplete UTF-8 sequence).

Either holds back tokens while their text is incomplete, and decodes the held-back ones again at each
step. A sequence that never completes a character (a run of lone UTF-8 continuation bytes, or of special
tokens that decode to nothing) would make that O(n) a step again: with SmolLM2's tokenizer, 1600 such tokens
took the stream 183.4 us a step on average, 4.15 us with the flush (``benchmarks/probe_detok.py --held-back``,
``benchmarks/results/cpu/sweeps/detok_held_back.json``). So after :data:`MAX_PENDING` held-back tokens
their decode is emitted as it stands (U+FFFD for the broken bytes, as a full decode shows them) and the
window starts after them.

Both agree with a full decode for byte-level BPE and SentencePiece vocabularies; a tokenizer whose
decode rewrites text across token boundaries (``clean_up_tokenization_spaces``) may differ in the
streamed pieces, which is why :meth:`IncrementalDetokenizer.finish` decodes the whole output once, at
the end, and its text is the one a finished request keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:  # tokenizers >= 0.21.1
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # older tokenizers, or none installed
    _DecodeStream = None

# Tokens held back (an incomplete character, or special tokens that decode to nothing) before their text is
# emitted as it decodes; a UTF-8 character spans at most 4 byte-level tokens.
MAX_PENDING = 8


def _stream_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` if ``DecodeStream`` can drive it, else None."""
    if _DecodeStream is None:
        return None
    backend = getattr(tokenizer, "backend", None)
    try:
        import tokenizers
    except ImportError:
        return None
    return backend if isinstance(backend, tokenizers.Tokenizer) else None


class IncrementalDetokenizer:
    """The text of one sequence of token ids, extended token by token.

    ``step(ids)`` takes the whole output so far (the newest tokens last; the ones already seen are not
    decoded again) and returns the characters they add, possibly ``""`` while a multi-byte character
    is incomplete. ``finish(ids)`` returns the full decode of ``ids``.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True):
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer: expected an object with decode(), got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = _stream_backend(tokenizer)
        self._stream = _DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._seen = 0  # tokens consumed
        self._mark = 0  # stream: tokens whose text has been emitted
        self._prefix = 0  # window fallback: ids[prefix:read] is text already emitted
        self._read = 0

    @property
    def streaming(self) -> bool:
        """Whether the ``tokenizers`` stream decoder is in use (else the decode-window fallback)."""
        return self._stream is not None

    def step(self, ids: Sequence[int]) -> str:
        n = len(ids)
        if n < self._seen:
            raise ValueError(f"ids: {n} tokens, fewer than the {self._seen} already decoded")
        if n == self._seen:
            return ""
        if self._stream is not None:
            if n == self._seen + 1:  # the usual step: one new token
                self._seen = n
                piece = self._stream.step(self._backend, int(ids[-1]))
                if piece:
                    self._mark = n
                    return piece
                return self._flush(ids) if n - self._mark > MAX_PENDING else ""
            pieces = []
            for t in ids[self._seen :]:
                self._seen += 1
                piece = self._stream.step(self._backend, int(t))
                if piece:
                    self._mark = self._seen
                    pieces.append(piece)
                elif self._seen - self._mark > MAX_PENDING:
                    pieces.append(self._flush(ids))
            return "".join(pieces)
        self._seen = n
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        done = ""
        if self._read > self._prefix:
            done = decode(list(ids[self._prefix : self._read]), skip_special_tokens=skip)
        text = decode(list(ids[self._prefix :]), skip_special_tokens=skip)
        stuck = n - self._read > MAX_PENDING
        if len(text) > len(done) and (stuck or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, n
            return text[len(done) :]
        if stuck:  # nothing to show (special tokens): the window moves on
            self._prefix, self._read = self._read, n
        return ""

    def _flush(self, ids: Sequence[int]) -> str:
        """Stream: the held-back tokens' text as it decodes; a fresh stream takes the tokens after them."""
        text = self.tokenizer.decode(list(ids[self._mark : self._seen]), skip_special_tokens=self.skip_special_tokens)
        self._stream = _DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self._mark = self._seen
        return text

    def finish(self, ids: Sequence[int]) -> str:
        """The whole text of ``ids``, decoded at once (the reference for the streamed pieces)."""
        return full_text(self.tokenizer, ids, skip_special_tokens=self.skip_special_tokens)


def full_text(tokenizer: Any, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """The text of ``ids`` in one decode: a finished request's text."""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
