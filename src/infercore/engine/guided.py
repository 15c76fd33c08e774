"""Guided (structured-output) decoding: a request's tokens constrained to a regular or context-free language.

A request's :class:`~infercore.engine.params.SamplingParams` names the language (``guided_regex``,
``guided_choice``, ``guided_json`` or a GBNF grammar ``guided_grammar``), which
:meth:`SamplingParams.guided_spec` gives as a regex or a grammar (a JSON schema is a regex unless it recurses or
leaves a value free: :mod:`~infercore.engine.json_grammar`). The engine keeps one guide per language: a
:class:`TokenGuide` walks the pattern's character DFA (:class:`~infercore.engine.fsm.CharDFA`) over the tokenizer's
vocabulary, a :class:`GrammarGuide` the grammar's pushdown recognizer (:class:`~infercore.engine.grammar.Grammar`).
For each state it finds the tokens whose text keeps the output a prefix of some match (a walk of the vocabulary's
character trie, pruned where the language dies; cached per state), and the sampler masks every other logit to
``-inf`` (``mask_``). End-of-sequence is allowed only where the output so far is a whole match, and is the only
choice once nothing can follow.

Limits: a token whose text is not valid UTF-8 on its own (a byte-level BPE piece of a multi-byte character)
is never chosen, so characters spelled only by such pieces cannot appear; special tokens other than
end-of-sequence are never chosen. Guided requests sample outside a captured CUDA graph and settle each step
before the next (as penalties do), and take no speculative drafts.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

import torch

from .fsm import DEAD, CharDFA
from .grammar import Grammar

__all__ = ["GrammarGuide", "GuideSet", "TokenGuide", "vocab_strings", "vocab_trie"]


def vocab_strings(tokenizer, size: int) -> list[str | None]:
    """Each id's text (``size`` ids), or None for special tokens, ids past the tokenizer's vocabulary and
    pieces that are not valid UTF-8 alone."""
    n = min(size, tokenizer.vocab_size)
    backend = getattr(tokenizer, "backend", None)
    if hasattr(backend, "decode_batch"):  # infercore's Tokenizer: one call
        texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=True)
    else:  # any tokenizer with decode(ids, skip_special_tokens=...)
        texts = [tokenizer.decode([i], skip_special_tokens=True) for i in range(n)]
    special = {int(i) for i in getattr(tokenizer, "eos_token_ids", ())}
    for i in (getattr(tokenizer, "bos_token_id", None),):
        if i is not None:
            special.add(int(i))
    out: list[str | None] = []
    for i, s in enumerate(texts):
        out.append(None if (not s or "\ufffd" in s or i in special) else s)
    return out + [None] * (size - n)


def vocab_trie(strings: list[str | None]) -> tuple[dict, list[int]]:
    """The vocabulary's texts as a character trie: a node is ``(children by character, ids of the tokens ending
    there)``; None texts are left out."""
    trie: tuple[dict, list[int]] = ({}, [])
    for i, s in enumerate(strings):
        if s is None:
            continue
        node = trie
        for ch in s:
            node = node[0].setdefault(ch, ({}, []))
        node[1].append(i)
    return trie


class TokenGuide:
    """The tokens allowed after each state of ``pattern``'s DFA, over a vocabulary of ``len(strings)`` ids
    (``strings[i]``: token i's text, None = never allowed); ``eos_ids``: the end-of-sequence ids; ``trie``: the
    vocabulary's :func:`vocab_trie`, when the caller has it already."""

    def __init__(self, pattern: str, strings: list[str | None], eos_ids, *, trie=None) -> None:
        self.dfa = CharDFA(pattern)
        self.strings = strings
        self.eos = sorted(int(i) for i in eos_ids)
        if not self.eos:
            raise ValueError("guided decoding needs a tokenizer with an end-of-sequence token")
        self._trie = vocab_trie(strings) if trie is None else trie
        self._allowed: dict[int, list[int]] = {}
        # Names this guide in a request's progress (Request._guide): its DFA's state numbers mean nothing to
        # another guide, so a request adopted from another engine walks its output again.
        self.key = secrets.randbits(63)
        self._masks: dict[tuple[int, torch.device, int], torch.Tensor] = {}

    @property
    def start(self) -> int:
        """The state of an empty output."""
        return self.dfa.start

    def advance(self, state: int, token_ids) -> int:
        """The state after the texts of ``token_ids`` (end-of-sequence ids add nothing); DEAD when one leaves
        the language."""
        for t in token_ids:
            if state == DEAD:
                return DEAD
            s = self.strings[t] if 0 <= t < len(self.strings) else None
            if s is None:
                if t in self.eos:
                    continue
                return DEAD
            state = self.dfa.walk(state, s)
        return state

    def allowed(self, state: int) -> list[int]:
        """Sorted ids allowed after ``state``: the tokens whose text leads to a live state, and the
        end-of-sequence ids where ``state`` is a whole match. Never empty: a state with no way on (dead, or a
        language no token can spell) allows end-of-sequence alone."""
        got = self._allowed.get(state)
        if got is not None:
            return got
        ids: list[int] = []
        if state != DEAD and self.dfa.can_continue(state):
            dfa = self.dfa
            stack = [(self._trie, state)]
            while stack:
                (children, _), st = stack.pop()
                for ch, child in children.items():
                    nxt = dfa.step(st, ch)
                    if nxt == DEAD:
                        continue
                    ids.extend(child[1])
                    if child[0]:
                        stack.append((child, nxt))
        if state == DEAD or self.dfa.accepting(state) or not ids:
            ids.extend(self.eos)
        got = sorted(set(ids))
        self._allowed[state] = got
        return got

    def mask_(self, logits: torch.Tensor, row: int, state: int) -> None:
        """Set every logit of ``logits[row]`` that ``state`` does not allow to ``-inf``, in place."""
        key = (state, logits.device, logits.shape[1])
        keep = self._masks.get(key)
        if keep is None:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool)
            ids = [i for i in self.allowed(state) if i < logits.shape[1]]
            keep[ids] = True
            keep = keep.to(logits.device)
            self._masks[key] = keep
        logits[row].masked_fill_(~keep, float("-inf"))


class GrammarGuide:
    """:class:`TokenGuide`'s interface over a GBNF grammar (``SamplingParams.guided_grammar``): states are the
    grammar recognizer's parse-stack sets (:class:`~infercore.engine.grammar.Grammar`), hashable values that a
    request carries as they are.

    A context-free language has unboundedly many states (a string inside an object inside a list is another
    state than a string inside an object), so a walk of the whole vocabulary per state would be paid again at
    every new depth. A token is allowed where some parse stack of the state allows it, and what a stack allows
    depends on its top ``top_frames`` frames alone unless a token ends all of them: so the walk is done (and kept)
    per top of stack, and only from where a token ends those frames is the rest of the stack walked, from those
    trie nodes on (few: a token rarely closes a string and the member and object around it). Where tokens end the
    top frames at more than ``max_exits`` trie nodes (frames that end after a character or two), twice as many
    frames are taken. The tokens allowed are kept for the ``max_cached`` states and stack tops used last (bool
    masks; per device and width for the sampler)."""

    def __init__(self, grammar: str, strings: list[str | None], eos_ids, *, trie=None, top_frames: int = 3,
                 max_exits: int = 256, max_cached: int = 256) -> None:
        self.grammar = Grammar(grammar)
        self.strings = strings
        self.eos = sorted(int(i) for i in eos_ids)
        if not self.eos:
            raise ValueError("guided decoding needs a tokenizer with an end-of-sequence token")
        self._trie = vocab_trie(strings) if trie is None else trie
        self.key = secrets.randbits(63)  # as TokenGuide.key: another guide's states are walked again
        self.top_frames, self.max_exits, self.max_cached = top_frames, max_exits, max_cached
        self._width = max(len(strings), self.eos[-1] + 1)
        self._keep: OrderedDict = OrderedDict()  # state -> bool [_width] on the CPU
        self._tops: OrderedDict = OrderedDict()  # a stack's top frames -> (bool [_width], trie nodes where they end)
        self._banned: OrderedDict = OrderedDict()  # (state, device, width) -> bool [width]: the masked ids

    @property
    def start(self):
        """The state of an empty output."""
        return self.grammar.start

    def advance(self, state, token_ids):
        """The state after the texts of ``token_ids`` (end-of-sequence ids add nothing); the empty (dead) state
        when one leaves the language."""
        g = self.grammar
        for t in token_ids:
            if not state:
                return state
            s = self.strings[t] if 0 <= t < len(self.strings) else None
            if s is None:
                if t in self.eos:
                    continue
                return frozenset()
            state = g.walk(state, s)
        return state

    def _allowed_mask(self, state) -> torch.Tensor:
        keep = self._keep.get(state)
        if keep is not None:
            self._keep.move_to_end(state)
            return keep
        g = self.grammar
        keep = torch.zeros(self._width, dtype=torch.bool)
        for stack in state:
            if not stack:
                continue
            k = self.top_frames
            while True:
                top = stack[-k:]
                got = self._tops.get(top)  # (mask, trie nodes where the top frames end); None: not known
                if got is None:
                    exits: list = []
                    ids = g.token_ids(frozenset((top,)), self._trie, exits, self.max_exits)
                    got = (None, None) if ids is None else (self._mask(ids), exits)
                    _put(self._tops, top, got, self.max_cached)
                else:
                    self._tops.move_to_end(top)
                if got[1] is not None or len(stack) <= k:
                    break
                k *= 2  # too many ends: more frames
            if got[0] is None:  # the whole stack, whose ends were too many to keep
                got = self._tops[top] = self._mask(g.token_ids(frozenset((top,)), self._trie)), None
            keep |= got[0]
            if got[1] and len(stack) > k:  # tokens that end the top frames go on in the frames below
                below = g.resume(stack[:-k])
                for node in got[1]:
                    keep[g.token_ids(below, node)] = True
        if g.accepting(state) or not keep.any():  # as TokenGuide: no way on (or none spelled) ends it
            keep[self.eos] = True
        _put(self._keep, state, keep, self.max_cached)
        return keep

    def _mask(self, ids: list[int]) -> torch.Tensor:
        keep = torch.zeros(self._width, dtype=torch.bool)
        keep[ids] = True
        return keep

    def allowed(self, state) -> list[int]:
        """Sorted ids allowed after ``state`` (as :meth:`TokenGuide.allowed`)."""
        return self._allowed_mask(state).nonzero().flatten().tolist()

    def mask_(self, logits: torch.Tensor, row: int, state) -> None:
        """Set every logit of ``logits[row]`` that ``state`` does not allow to ``-inf``, in place."""
        width = logits.shape[1]
        key = (state, logits.device, width)
        banned = self._banned.get(key)
        if banned is None:
            keep = self._allowed_mask(state)[:width]
            banned = torch.ones(width, dtype=torch.bool)
            banned[: len(keep)] = ~keep
            banned = banned.to(logits.device)
            _put(self._banned, key, banned, self.max_cached)
        else:
            self._banned.move_to_end(key)
        logits[row].masked_fill_(banned, float("-inf"))


def _put(cache: OrderedDict, key, value, limit: int) -> None:
    cache[key] = value
    if len(cache) > limit:
        cache.popitem(last=False)


class GuideSet:
    """An engine's guides, one :class:`TokenGuide` per pattern and one :class:`GrammarGuide` per grammar over
    ``tokenizer``'s vocabulary (its texts and trie built at the first use), and the sampler's logits processing:
    ``guides(reqs, logits)`` returns a copy of ``logits`` ``[len(reqs), V]`` with each request's ``logit_bias``
    added, its ``allowed_token_ids`` kept alone, and each guided request's row masked to what its pattern or
    grammar allows after its output so far."""

    def __init__(self, tokenizer, vocab_size: int | None, eos_ids, *, speculative: bool) -> None:
        self.tokenizer, self.vocab_size, self.eos, self.speculative = tokenizer, vocab_size, eos_ids, speculative
        self._guides: dict[tuple[str, str], TokenGuide | GrammarGuide] = {}
        self._texts: list[str | None] | None = None
        self._trie: tuple[dict, list[int]] | None = None

    def guide_for(self, params) -> TokenGuide | GrammarGuide:
        """The guide of ``params``' regex or grammar (:meth:`SamplingParams.guided_spec`). Raises ValueError
        without a tokenizer or with speculative decoding."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams guided_*: guided decoding needs an engine with a tokenizer")
        if self.speculative:
            raise ValueError("SamplingParams guided_*: not with speculative decoding (num_speculative_tokens)")
        key = params.guided_spec()
        guide = self._guides.get(key)
        if guide is None:
            if self._texts is None:
                self._texts = vocab_strings(self.tokenizer, self.vocab_size or self.tokenizer.vocab_size)
                self._trie = vocab_trie(self._texts)
            kind = GrammarGuide if key[0] == "grammar" else TokenGuide
            guide = self._guides[key] = kind(key[1], self._texts, self.eos, trie=self._trie)
        return guide

    def __call__(self, reqs, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()  # the raw logits stay for the log-probabilities
        for i, req in enumerate(reqs):
            p = req.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            if p.allowed_token_ids is not None:
                keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
                keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)] = True
                logits[i].masked_fill_(~keep, float("-inf"))
            if req._bad_words:  # a bad word's last token, where the output ends with the rest of it
                out = req.output_token_ids
                ban = [w[-1] for w in req._bad_words
                       if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])]
                if ban:
                    logits[i, torch.tensor(ban, dtype=torch.long, device=logits.device)] = float("-inf")
            if not p.guided:
                continue
            guide = self.guide_for(req.params)
            key, pos, state = req._guide if req._guide is not None else (None, 0, 0)
            if key != guide.key:  # first use, or a request moved here from another engine
                pos, state = 0, guide.start
            out = req.output_token_ids
            if len(out) > pos:
                state = guide.advance(state, out[pos:])
                pos = len(out)
            req._guide = (guide.key, pos, state)
            guide.mask_(logits, i, state)
        return logits
