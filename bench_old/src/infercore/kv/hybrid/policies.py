"""Per-layer-type policies: which pages a request must hold, and which prefix hits a type serves.

One small class per layer type, each stateless over plain lists, so the coordinator
(:class:`infercore.kv.hybrid.HybridBlockManager`) has no per-type special cases beyond asking:

* ``first_needed_page(num_computed)`` -- pages below this index will never be read again by a
  request whose next uncomputed position is ``num_computed`` (they may be released);
* ``hit_lengths(present)`` -- given which cached entries exist at page boundaries
  ``1..n`` (``present[i]``: the entry for page ``i``, or for linear layers the checkpoint after
  ``i + 1`` pages), a predicate saying whether a hit of ``j`` pages can be served.

Token positions are page-aligned: page ``i`` holds positions ``[i * P, (i + 1) * P)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from .spec import FULL, LINEAR, SLIDING


class FullAttentionPolicy:
    """Every token's KV is read by every later token: hold all pages; a hit needs all of them."""

    kind = FULL

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens

    def first_needed_page(self, num_computed: int) -> int:
        return 0

    def hit_lengths(self, present: Sequence[bool]) -> Callable[[int], bool]:
        run = 0
        while run < len(present) and present[run]:
            run += 1
        return lambda j: j <= run


class SlidingWindowPolicy(FullAttentionPolicy):
    """A query at position ``q`` reads keys ``(q - w, q]``: a request whose next position is
    ``n`` needs pages from the one holding ``n - w + 1`` on; a hit of ``j`` pages needs only the
    pages that the first recomputed token (position ``j * P``) reads."""

    kind = SLIDING

    def __init__(self, page_tokens: int, window: int) -> None:
        super().__init__(page_tokens)
        self.window = window

    def first_needed_page(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) // self.page_tokens

    def hit_lengths(self, present: Sequence[bool]) -> Callable[[int], bool]:
        missing = [0, *accumulate(0 if p else 1 for p in present)]  # missing[i]: absent among [0, i)
        P = self.page_tokens

        def ok(j: int) -> bool:
            first = self.first_needed_page(j * P)
            return missing[j] - missing[min(first, j)] == 0

        return ok


class LinearStatePolicy:
    """One live state per request; a hit of ``j`` pages needs the checkpoint taken after exactly
    ``j * P`` tokens (the state summarizes the whole prefix, so nothing else is needed)."""

    kind = LINEAR

    def __init__(self, page_tokens: int, checkpoint_interval: int) -> None:
        self.page_tokens = page_tokens
        self.checkpoint_interval = checkpoint_interval

    def first_needed_page(self, num_computed: int) -> int:
        return 0

    def is_checkpoint(self, num_computed: int) -> bool:
        return num_computed > 0 and num_computed % self.checkpoint_interval == 0

    def hit_lengths(self, present: Sequence[bool]) -> Callable[[int], bool]:
        return lambda j: j == 0 or present[j - 1]
