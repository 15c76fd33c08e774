"""Speculative decoding by prompt lookup (n-gram drafts).

A decoding request whose last tokens occurred earlier in its own prompt or output (code being edited,
a document being quoted, a list being continued) is likely to continue as it did there. The engine
proposes those following tokens as a draft, feeds the request's last token and the draft in one forward
(the verification step: ``1 + k`` query tokens over the cached prefix, like a prefill chunk) and samples
the target token at each of the ``k + 1`` positions with the request's own sampler.

Acceptance is "sample, then compare": the draft token at position ``j`` is kept when the token sampled
there equals it; the first sampled token that differs (or the one after the whole draft) ends the step's
output. For a deterministic draft this is exactly speculative sampling (Leviathan et al., 2023, with a
point-mass proposal): the draft token ``d`` is kept with probability ``p(d)``, and otherwise the token
is drawn from ``p`` without ``d``, renormalized. Because the sampler draws position ``t`` of a request
from the stream ``(seed, t)`` whatever the step, a speculative run samples the same tokens as a plain
run with the same seed, up to the rounding of a batched forward against a one-token one.

The rejected draft tokens' K/V rows lie past the request's computed prefix: the next steps overwrite
them, and the prefix cache only publishes pages of computed tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens, k: int, *, min_n: int = 2, max_n: int = 4) -> list[int]:
    """A draft of up to ``k`` tokens for the sequence ``tokens`` (a list or int array, prompt then output).

    The longest suffix of ``max_n`` down to ``min_n`` tokens that also occurs earlier is looked up; the
    draft is what followed its most recent earlier occurrence. Where that continuation runs into the
    suffix itself (a repeating pattern), it continues with the draft's own tokens, so a loop of period
    ``p`` is drafted ``k`` tokens ahead, not ``p``. Returns ``[]`` when no suffix recurs (or ``k`` is 0).
    Costs ``O(len(tokens) * max_n)`` host time per call.
    """
    if k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.size
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - 1 - n: each has a next token, and none is the suffix itself
        hits = np.flatnonzero((sliding_window_view(arr[: length - 1], n) == arr[length - n :]).all(axis=1))
        if hits.size:
            src = int(hits[-1]) + n
            draft = arr[src : src + k].tolist()
            while len(draft) < k:  # the continuation reached the end: the sequence repeats with period length - src
                draft.append(draft[len(draft) - (length - src)])
            return draft
    return []
