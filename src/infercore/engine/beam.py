"""Beam search over an engine: each step every live beam is a one-token request whose top ``2 * beam_width``
log-probabilities are read; the best ``beam_width`` extensions of each prompt's beams go on (Hugging Face's
``generate(num_beams=...)`` semantics: a candidate ending in an end-of-sequence token, ranked among the best
``beam_width``, is set aside as a finished hypothesis scored ``sum of log-probabilities / length ** length_penalty``;
without ``early_stopping`` the search stops once no live beam can beat the worst kept hypothesis).

The beams of all prompts run together in the engine's batches; their shared prefixes come from the prefix cache
(each step recomputes at most a beam's last partial page and its new token).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .params import SamplingParams


@dataclass
class BeamSequence:
    """One hypothesis: the generated ``token_ids`` (and ``text`` where the engine has a tokenizer), the sum of their
    log-probabilities, the length-penalized ``score`` the search ranks by, and why it ended ("stop": an
    end-of-sequence token, kept in ``token_ids``; "length": ``max_tokens``)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str
    text: str = ""


class _Hyps:
    """The best ``width`` finished hypotheses of one prompt."""

    def __init__(self, width: int, length_penalty: float, early_stopping: bool) -> None:
        self.width, self.lp, self.early = width, length_penalty, early_stopping
        self.heap: list[tuple[float, int, list[int], float, str]] = []  # (score, serial, tokens, logprob, reason)
        self.serial = 0

    def score(self, logprob: float, length: int) -> float:
        return logprob / (max(length, 1) ** self.lp)

    def add(self, tokens: list[int], logprob: float, reason: str) -> None:
        s = self.score(logprob, len(tokens))
        self.serial += 1
        item = (s, -self.serial, tokens, logprob, reason)
        if len(self.heap) < self.width:
            heapq.heappush(self.heap, item)
        elif s > self.heap[0][0]:
            heapq.heapreplace(self.heap, item)

    def done(self, best_live_logprob: float, length: int) -> bool:
        """Whether no live beam (the best has ``best_live_logprob`` at ``length`` tokens) can still enter."""
        if len(self.heap) < self.width:
            return False
        if self.early:
            return True
        return self.heap[0][0] >= self.score(best_live_logprob, length)


def beam_search(engine, prompts: list[list[int]], *, beam_width: int, max_tokens: int, length_penalty: float,
                early_stopping: bool, ignore_eos: bool, lora=None) -> list[list[BeamSequence]]:
    """``Engine.beam_search`` on prompts of token ids (checked by the caller)."""
    eos = set() if ignore_eos else set(engine._eos)
    P = len(prompts)
    hyps = [_Hyps(beam_width, length_penalty, early_stopping) for _ in range(P)]
    beams: list[list[tuple[list[int], float]]] = [[([], 0.0)] for _ in range(P)]  # per prompt: (generated, logprob)
    loras = lora if isinstance(lora, list) else [lora] * P  # (Engine.beam_search checked a list's length)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2 * beam_width)
    for step in range(max_tokens):
        live = [(i, b) for i in range(P) for b in beams[i]]
        if not live:
            break
        outs = engine.generate([prompts[i] + gen for i, (gen, _) in live], sp, lora=[loras[i] for i, _ in live])
        cands: list[list[tuple[float, list[int], int]]] = [[] for _ in range(P)]
        for (i, (gen, logprob)), out in zip(live, outs):
            for tok, lp in out.logprobs[0].items():
                cands[i].append((logprob + lp, gen, tok))
        last = step + 1 == max_tokens
        for i in range(P):
            nxt: list[tuple[list[int], float]] = []
            for rank, (lp, gen, tok) in enumerate(sorted(cands[i], key=lambda c: -c[0])):
                if tok in eos:
                    if rank < beam_width:  # as transformers: only an EOS among the best width is kept
                        hyps[i].add(gen + [tok], lp, "stop")
                    continue
                nxt.append((gen + [tok], lp))
                if len(nxt) == beam_width:
                    break
            if last:
                for gen, lp in nxt:
                    hyps[i].add(gen, lp, "length")
                nxt = []
            elif nxt and hyps[i].done(nxt[0][1], step + 1):
                nxt = []
            beams[i] = nxt
    tok = engine.tokenizer
    results = []
    for h in hyps:
        ranked = sorted(h.heap, key=lambda x: (-x[0], -x[1]))
        results.append([BeamSequence(list(t), lp, s, reason, "" if tok is None else tok.decode(t))
                        for s, _, t, lp, reason in ranked])
    return results
