"""Two-level page pool: large pages, each carved into small pages of one layer group.

Small page ``k`` of large page ``L`` in group ``g`` has id ``L * smalls_per_large[g] + k``, so a
group's small pages index dim 0 of a ``[num_large * smalls_per_large[g], small_bytes]`` view of one
byte buffer of ``num_large * large_bytes`` bytes.

Placement is request-aware (Jenga), but never at the price of stranding memory. An owner (a
request) takes small pages of a group from, in order:

1. its own carved large pages that still have a free slot;
2. whole fresh large pages, carved for it, for the part of its need that fills them by itself --
   these go back to the pool whole when it finishes;
3. for the remainder (less than one large page): free slots of pages carved earlier, if they
   cover it (pages whose owner left first, then the fullest); otherwise a fresh large page
   carved for it, so that its later pages (decode growth) land next to its earlier ones.

So a group never holds a large page's worth of free slots while it carves a new large page:
during admission each group strands less than one large page, whatever the page sizes. (An
earlier design carved a fresh large page for every request until only 1/8 of the pool was free.
With a large page much bigger than a request's footprint -- a 768-token request fills 12% of
the 24.6 MiB large page of the 8-layer Qwen3-Next shape -- that stranded half the pool in
attention pages the linear-state group could not use, and multi-granularity held fewer requests
than the uniform baseline: 34 vs 46 in a 1 GiB pool.) The price: short requests admitted
together share large pages, so freeing one leaves free slots rather than a free large page;
those slots are refilled by the same group first.

The pool knows nothing of prefix caching: a small page is either free or taken; the manager above
decides when a taken page is released.
"""

from __future__ import annotations

from collections.abc import Hashable


class TwoLevelPool:
    """Large pages carved on demand into per-group small pages.

    Args:
        num_large: large pages in the pool.
        smalls_per_large: per group, how many small pages one large page holds.
        dense: per group, fill any carved page's free slots before carving a new one (for
            groups a request holds one page of); default False (request-aware placement).
    """

    def __init__(self, num_large: int, smalls_per_large: list[int], *, dense: list[bool] | None = None) -> None:
        if isinstance(num_large, bool) or not isinstance(num_large, int) or num_large < 0:
            raise ValueError(f"num_large must be a non-negative int, got {num_large!r}")
        if not smalls_per_large or any(n <= 0 for n in smalls_per_large):
            raise ValueError(f"smalls_per_large must be positive counts, got {smalls_per_large!r}")
        self.num_large = num_large
        self.smalls_per_large = list(smalls_per_large)
        # Dense groups skip owner affinity: a request holds one small page of them (a linear
        # state slot), so a large page carved for it alone would mostly sit empty.
        self.dense = list(dense) if dense is not None else [False] * len(smalls_per_large)
        if len(self.dense) != len(smalls_per_large):
            raise ValueError("dense must have one flag per group")
        # Free large pages, FIFO (reusing the least recently freed spreads wear evenly; it also
        # makes allocation order deterministic, which the tests rely on).
        self._free_large: dict[int, None] = dict.fromkeys(range(num_large))
        self._group: list[int | None] = [None] * num_large
        self._owner: list[Hashable | None] = [None] * num_large
        self._taken: list[int] = [0] * num_large
        # Per large page: free small offsets (a stack), only while carved.
        self._free_in: list[list[int]] = [[] for _ in range(num_large)]
        # Per group: carved large pages with a free small slot (ordered set).
        self._partial: list[dict[int, None]] = [{} for _ in smalls_per_large]
        # Per (owner, group): the owner's carved large pages with a free slot.
        self._owned: dict[tuple[Hashable, int], dict[int, None]] = {}
        # Per group: free small slots inside carved large pages (kept so queries are O(1)).
        self._free_slots: list[int] = [0] * len(smalls_per_large)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_large(self) -> int:
        return len(self._free_large)

    def num_free_small(self, group: int) -> int:
        """Small pages of ``group`` obtainable without eviction (free slots + free large pages)."""
        return self._free_slots[group] + self.smalls_per_large[group] * len(self._free_large)

    def num_taken_small(self, group: int) -> int:
        return sum(self._taken[L] for L in range(self.num_large) if self._group[L] == group)

    def large_of(self, group: int, small: int) -> int:
        return small // self.smalls_per_large[group]

    def group_of_large(self, large: int) -> int | None:
        return self._group[large]

    def taken_in(self, large: int) -> int:
        return self._taken[large]

    def carved(self, group: int | None = None) -> list[int]:
        """Carved large pages (of ``group``, or of any group)."""
        return [L for L in range(self.num_large) if self._group[L] is not None and group in (None, self._group[L])]

    # ------------------------------------------------------------------ mutations

    def take(self, group: int, owner: Hashable, n: int) -> list[int] | None:
        """``n`` small pages of ``group`` for ``owner``, or None (nothing taken) if short.

        Placement order: the owner's own pages, whole fresh large pages for it, then -- for a
        remainder under one large page -- free slots of carved pages if they cover it, else a
        fresh large page for it (see the module doc).
        """
        if n <= 0:
            return []
        if self.num_free_small(group) < n:
            return None
        out: list[int] = []
        owned = self._owned.get((owner, group), {})
        while len(out) < n and owned:
            self._take_from(next(iter(owned)), group, n - len(out), out)
        dense = self.dense[group]
        if not dense:
            self._take_fresh(group, owner, n, out, whole=True)
        # Carving a fresh page for a remainder strands its unused tail until the owner grows
        # into it: do it only if the free slots already carved cannot take the remainder (then
        # the group's free slots stay below one large page), or when no large page is free.
        rest = n - len(out)
        if rest and (dense or self._free_slots[group] >= rest or not self._free_large):
            # Orphaned pages first (no live owner will grow into them), then the fullest ones,
            # so that the remainder lands in few pages and emptier pages can drain to free.
            partial = sorted(self._partial[group], key=lambda L: (self._owner[L] is not None, len(self._free_in[L])))
            for L in partial:
                self._take_from(L, group, n - len(out), out)
                if len(out) == n:
                    break
        self._take_fresh(group, owner, n, out, whole=False)
        return out

    def _take_fresh(self, group: int, owner: Hashable, n: int, out: list[int], *, whole: bool) -> None:
        """Carve free large pages for ``owner`` until ``out`` holds ``n`` pages (``whole``: only
        while the rest of the need fills a whole large page)."""
        per = self.smalls_per_large[group]
        while len(out) < n and self._free_large and (not whole or n - len(out) >= per):
            L = next(iter(self._free_large))
            del self._free_large[L]
            self._carve(L, group, owner)
            self._take_from(L, group, n - len(out), out)

    def release(self, group: int, small: int) -> bool:
        """Return one small page; True if its large page became free as a whole."""
        per = self.smalls_per_large[group]
        L, k = divmod(small, per)
        if self._group[L] != group:
            raise ValueError(f"small page {small} of group {group} lies in a large page not carved for it")
        free_in = self._free_in[L]
        if len(free_in) + self._taken[L] != per or k in free_in:
            raise ValueError(f"small page {small} of group {group} is not taken (double free?)")
        self._taken[L] -= 1
        if self._taken[L] == 0:
            self._free_slots[group] -= per - 1
            self._uncarve(L)
            return True
        self._free_slots[group] += 1
        free_in.append(k)
        self._partial[group][L] = None
        owner = self._owner[L]
        if owner is not None:
            self._owned.setdefault((owner, group), {})[L] = None
        return False

    def disown(self, owner: Hashable) -> None:
        """Forget ``owner``'s affinity (the request finished): pages it left partly taken --
        e.g. by prefix-cached pages -- become anyone's to fill."""
        for key in [k for k in self._owned if k[0] == owner]:
            del self._owned[key]
        for L in range(self.num_large):
            if self._owner[L] == owner:
                self._owner[L] = None

    # ------------------------------------------------------------------ internals

    def _carve(self, L: int, group: int, owner: Hashable) -> None:
        per = self.smalls_per_large[group]
        self._group[L] = group
        self._owner[L] = owner
        self._taken[L] = 0
        # Reversed so that pop() hands out offsets in ascending order.
        self._free_in[L] = list(range(per - 1, -1, -1))
        self._free_slots[group] += per
        self._partial[group][L] = None
        self._owned.setdefault((owner, group), {})[L] = None

    def _uncarve(self, L: int) -> None:
        group, owner = self._group[L], self._owner[L]
        self._partial[group].pop(L, None)
        if owner is not None:
            owned = self._owned.get((owner, group))
            if owned is not None:
                owned.pop(L, None)
                if not owned:
                    del self._owned[(owner, group)]
        self._group[L] = None
        self._owner[L] = None
        self._free_in[L] = []
        self._free_large[L] = None

    def _take_from(self, L: int, group: int, n: int, out: list[int]) -> None:
        per, free_in = self.smalls_per_large[group], self._free_in[L]
        base = L * per
        k = min(n, len(free_in))
        self._free_slots[group] -= k
        for _ in range(k):
            out.append(base + free_in.pop())
        self._taken[L] = per - len(free_in)
        if not free_in:
            self._partial[group].pop(L, None)
            owner = self._owner[L]
            if owner is not None:
                owned = self._owned.get((owner, group))
                if owned is not None:
                    owned.pop(L, None)
                    if not owned:
                        del self._owned[(owner, group)]

    def check(self) -> None:
        """Assert internal consistency (tests)."""
        for L in range(self.num_large):
            g = self._group[L]
            if g is None:
                assert L in self._free_large and self._taken[L] == 0 and not self._free_in[L], L
                continue
            per = self.smalls_per_large[g]
            assert L not in self._free_large, L
            assert len(set(self._free_in[L])) == len(self._free_in[L])
            assert self._taken[L] + len(self._free_in[L]) == per and self._taken[L] > 0, L
            assert (L in self._partial[g]) == bool(self._free_in[L]), L
        for g in range(len(self.smalls_per_large)):
            assert self._free_slots[g] == sum(len(self._free_in[L]) for L in self._partial[g]), g
        for (owner, g), owned in self._owned.items():
            for L in owned:
                assert self._owner[L] == owner and self._group[L] == g and self._free_in[L], (owner, L)
