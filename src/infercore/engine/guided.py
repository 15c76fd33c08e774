"""Guided (structured-output) decoding: a request's tokens constrained to a regular language.

A request's :class:`~infercore.engine.params.SamplingParams` names the language (``guided_regex``,
``guided_choice`` or ``guided_json``); :meth:`SamplingParams.guided_pattern` gives its regex. The engine keeps
one :class:`TokenGuide` per pattern: the pattern's character DFA (:class:`~infercore.engine.fsm.CharDFA`) walked
over the tokenizer's vocabulary. For each DFA state it finds the tokens whose text keeps the output a prefix of
some match (a walk of the vocabulary's character trie, pruned where the DFA dies; cached per state), and the
sampler masks every other logit to ``-inf`` (:meth:`TokenGuide.mask_`). End-of-sequence is allowed only where
the output so far is a whole match, and is the only choice once nothing can follow.

Limits: a token whose text is not valid UTF-8 on its own (a byte-level BPE piece of a multi-byte character)
is never chosen, so characters spelled only by such pieces cannot appear; special tokens other than
end-of-sequence are never chosen. Guided requests sample outside a captured CUDA graph and settle each step
before the next (as penalties do), and take no speculative drafts.
"""

from __future__ import annotations

import secrets

import torch

from .fsm import DEAD, CharDFA

__all__ = ["GuideSet", "TokenGuide", "vocab_strings"]


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


class TokenGuide:
    """The tokens allowed after each state of ``pattern``'s DFA, over a vocabulary of ``len(strings)`` ids
    (``strings[i]``: token i's text, None = never allowed); ``eos_ids``: the end-of-sequence ids."""

    def __init__(self, pattern: str, strings: list[str | None], eos_ids) -> None:
        self.dfa = CharDFA(pattern)
        self.strings = strings
        self.eos = sorted(int(i) for i in eos_ids)
        if not self.eos:
            raise ValueError("guided decoding needs a tokenizer with an end-of-sequence token")
        # a character trie of the vocabulary: node = (children by character, ids ending here)
        self._trie: tuple[dict, list[int]] = ({}, [])
        for i, s in enumerate(strings):
            if s is None:
                continue
            node = self._trie
            for ch in s:
                node = node[0].setdefault(ch, ({}, []))
            node[1].append(i)
        self._allowed: dict[int, list[int]] = {}
        # Names this guide in a request's progress (Request._guide): its DFA's state numbers mean nothing to
        # another guide, so a request adopted from another engine walks its output again.
        self.key = secrets.randbits(63)
        self._masks: dict[tuple[int, torch.device, int], torch.Tensor] = {}

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


class GuideSet:
    """An engine's guides, one :class:`TokenGuide` per pattern over ``tokenizer``'s vocabulary (its texts read at the
    first use), and the sampler's logits processing: ``guides(reqs, logits)`` returns a copy of ``logits``
    ``[len(reqs), V]`` with each request's ``logit_bias`` added, its ``allowed_token_ids`` kept alone, and each guided
    request's row masked to what its pattern allows after its output so far."""

    def __init__(self, tokenizer, vocab_size: int | None, eos_ids, *, speculative: bool) -> None:
        self.tokenizer, self.vocab_size, self.eos, self.speculative = tokenizer, vocab_size, eos_ids, speculative
        self._guides: dict[str, TokenGuide] = {}
        self._texts: list[str | None] | None = None

    def guide_for(self, params) -> TokenGuide:
        """The guide of ``params``' pattern (:meth:`SamplingParams.guided_pattern`). Raises ValueError without a
        tokenizer or with speculative decoding."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams guided_*: guided decoding needs an engine with a tokenizer")
        if self.speculative:
            raise ValueError("SamplingParams guided_*: not with speculative decoding (num_speculative_tokens)")
        pattern = params.guided_pattern()
        guide = self._guides.get(pattern)
        if guide is None:
            if self._texts is None:
                self._texts = vocab_strings(self.tokenizer, self.vocab_size or self.tokenizer.vocab_size)
            guide = self._guides[pattern] = TokenGuide(pattern, self._texts, self.eos)
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
                pos, state = 0, guide.dfa.start
            out = req.output_token_ids
            if len(out) > pos:
                state = guide.advance(state, out[pos:])
                pos = len(out)
            req._guide = (guide.key, pos, state)
            guide.mask_(logits, i, state)
        return logits
