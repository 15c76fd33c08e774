"""Paged KV block manager for full-attention layers, with prefix caching.

Every page is in exactly one of three states:

* **free** -- holds nothing useful; kept in a FIFO (``_free``).
* **in use** -- referenced by ``ref_count > 0`` live requests (a cached page may be shared).
* **evictable** -- ``ref_count == 0`` but its KV is a cached prefix page; kept in LRU order
  (``_evictable``, oldest first) and reclaimed only when the free list is empty.

A page becomes cache-visible only through :meth:`BlockManager.mark_computed`, i.e. after its KV
has been written, and only when it is full: a partially filled page still receives writes.
Shared pages are always full and lie before the request's first uncomputed token, so a request
never writes into a page someone else reads.

All bookkeeping is plain Python (lists, dicts, deques); every call costs O(pages touched), not
O(pool), because it runs on the host in every engine step.

With a :class:`~infercore.kv.cpu_tier.CPUKVTier` attached (``cpu_tier``), an evictable cached page that is
about to be reused is first copied to the tier under its chain key (*demotion*), and a prefix match
continues past the pages cached on the device into the tier: each matched tier page gets a fresh device
page, queued for a copy back, and is published in the device cache at once (the forward that reads it
waits for the copy, see :meth:`CPUKVTier.before_forward`). Decisions depend only on this manager's state,
so tensor-parallel ranks with the same calls make the same ones.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from .prefix_cache import PrefixCacheStats, hash_page, root_hash

if TYPE_CHECKING:
    from .cpu_tier import CPUKVTier


class _Request:
    """Per-request state: its pages, and the chain keys of its leading full computed pages."""

    __slots__ = ("block_table", "hashes", "num_computed", "cpu_hit", "root")

    def __init__(self, block_table: list[int], hashes: list[bytes], num_computed: int, cpu_hit: int = 0,
                 root: bytes | None = None) -> None:
        self.cpu_hit = cpu_hit  # tokens of the admission's cache hit that came from the CPU tier
        self.block_table = block_table
        # hashes[i] is the chain key of page i; len(hashes) full pages have been hashed so far,
        # so mark_computed only hashes pages it has not seen.
        self.hashes = hashes
        self.num_computed = num_computed  # the cache hit at admission, then the last mark_computed
        self.root = root if root is not None else root_hash()  # the chain's root (salted by the extra key)


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class BlockManager:
    """Allocates fixed-size KV pages to requests; reuses computed full pages by content.

    Args:
        num_pages: pages in the pool; page ids are ``0 .. num_pages - 1`` and index dim 0 of the
            ``[num_pages, page_size, Hk, D]`` caches from :func:`infercore.kv.allocate_kv_caches`.
        page_size: tokens per page. Token position ``p`` of a request lives in slot
            ``block_table[p // page_size] * page_size + p % page_size``.
        enable_prefix_caching: share computed full pages between requests with equal prefixes.
        cpu_tier: a :class:`~infercore.kv.cpu_tier.CPUKVTier` over this pool's caches, or None; needs
            prefix caching (its pages are found by chain key).

    Prefix lookups and admissions take an optional ``extra_key`` (bytes, e.g. a LoRA adapter's identity): it
    salts the request's whole hash chain, so requests with different keys never share pages.

    Request ids are any hashable values. Running out of pages is not an error: ``allocate``
    returns None and ``grow`` returns False, without changing anything, so the scheduler can
    queue or preempt.
    """

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 cpu_tier: CPUKVTier | None = None) -> None:
        self.num_pages = _check_count("num_pages", num_pages, minimum=1)
        self.page_size = _check_count("page_size", page_size, minimum=1)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        if cpu_tier is not None and not self.enable_prefix_caching:
            raise ValueError("cpu_tier: the CPU tier keeps prefix-cache pages; it needs enable_prefix_caching=True")
        self.cpu_tier = cpu_tier
        # The tier's launch number when each page last lost its last reference (-1: never used): copies
        # out of / into the page wait for that launch (see CPUKVTier).
        self._stamp: list[int] = [-1] * num_pages

        self._ref: list[int] = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        # Insertion order is LRU order: freed pages are appended, eviction pops the front.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Chain key -> page holding that KV; a page's own key and token ids (None if uncached).
        self._cache: dict[bytes, int] = {}
        self._page_hash: list[bytes | None] = [None] * num_pages
        self._page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self._requests: dict[Hashable, _Request] = {}
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------ queries

    @property
    def num_free_pages(self) -> int:
        """Pages a new allocation can take: free plus evictable cached pages."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one live request."""
        return self.num_pages - self.num_free_pages

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages whose KV is registered in the prefix cache (in use or evictable)."""
        return len(self._cache)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by live requests."""
        return self.num_used_pages / self.num_pages

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        _check_count("num_tokens", num_tokens, minimum=0)
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` fit in fresh pages (ignores prefix hits, so it is conservative)."""
        return self.num_pages_for(num_tokens) <= self.num_free_pages

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def block_table(self, req_id: Hashable) -> list[int]:
        """Page ids of ``req_id`` in position order (a copy; page ``i`` holds tokens
        ``[i * page_size, (i + 1) * page_size)``)."""
        return list(self._get(req_id).block_table)

    def num_allocated_tokens(self, req_id: Hashable) -> int:
        """Token capacity of the pages ``req_id`` holds."""
        return len(self._get(req_id).block_table) * self.page_size

    def slot_mapping(self, req_id: Hashable, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``[start, end)`` of ``req_id``.

        Slot ``s`` addresses row ``s // page_size``, offset ``s % page_size`` of a
        ``[num_pages, page_size, Hk, D]`` cache (i.e. row ``s`` of its ``[-1, Hk, D]`` view).
        """
        req = self._get(req_id)
        capacity = len(req.block_table) * self.page_size
        if not 0 <= start <= end <= capacity:
            raise ValueError(
                f"positions [start={start}, end={end}) of request {req_id!r} must lie within its "
                f"{capacity} allocated token slots"
            )
        ps, table = self.page_size, req.block_table
        out: list[int] = []
        pos = start
        # Walk page by page so the inner step is a range, not a divmod per token.
        while pos < end:
            idx = pos // ps
            stop = min(end, (idx + 1) * ps)
            base = table[idx] * ps - idx * ps
            out.extend(range(base + pos, base + stop))
            pos = stop
        return out

    def match_prefix(self, token_ids: Sequence[int], *, max_cached_tokens: int, extra_key: bytes | None = None) -> int:
        """Tokens that :meth:`allocate` would take from the cache now (read-only)."""
        _check_count("max_cached_tokens", max_cached_tokens, minimum=0)
        return len(self._lookup(token_ids, max_cached_tokens, root_hash(extra_key))[0]) * self.page_size

    def cached_pages(self, token_ids: Sequence[int], *, extra_key: bytes | None = None) -> list[int]:
        """The device pages holding the longest cached full-page prefix of ``token_ids``, in order (read-only;
        it stops before a page found only in the CPU tier). Their KV stays there until the pages are evicted:
        read it before anything else allocates."""
        hits = self._lookup(token_ids, len(token_ids), root_hash(extra_key))[0]
        n = next((i for i, p in enumerate(hits) if p < 0), len(hits))
        return hits[:n]

    def published_tokens(self, req_id: Hashable) -> int:
        """Tokens of ``req_id``'s leading full pages that are in the prefix cache's view: hashed by
        :meth:`mark_computed` or taken from the cache at admission (a multiple of ``page_size``; 0 without
        prefix caching)."""
        return len(self._get(req_id).hashes) * self.page_size if self.enable_prefix_caching else 0

    def cpu_hit_tokens(self, req_id: Hashable) -> int:
        """Tokens of ``req_id``'s admission cache hit that were loaded from the CPU tier (a multiple of
        ``page_size``; included in what :meth:`allocate` returned)."""
        return self._get(req_id).cpu_hit

    # ------------------------------------------------------------------ mutations

    def allocate(
        self, req_id: Hashable, token_ids: Sequence[int], num_tokens: int, *, max_cached_tokens: int,
        extra_key: bytes | None = None,
    ) -> int | None:
        """Admit ``req_id``: reuse cached pages of its longest cached prefix, allocate the rest.

        Args:
            req_id: a new request id.
            token_ids: the request's known tokens (the prompt, or prompt + output on resumption).
            num_tokens: tokens to make room for (may exceed ``len(token_ids)`` or stop short of
                it for chunked prefill). If the cache hit is longer, room for the hit is held.
            max_cached_tokens: cap on tokens taken from the cache; pass ``len(token_ids) - 1`` so
                at least one token is computed and yields logits.
            extra_key: salts the request's hash chain (bytes, or None): it shares pages only with
                requests of the same key.

        Returns:
            The number of cached tokens (a multiple of ``page_size``): KV for positions
            ``[0, cached)`` is already in the pages. None if the pool is short, in which case
            nothing changed (not even LRU order or statistics).
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already allocated")
        _check_count("num_tokens", num_tokens, minimum=0)
        _check_count("max_cached_tokens", max_cached_tokens, minimum=0)

        root = root_hash(extra_key)
        hits, hit_hashes = self._lookup(token_ids, max_cached_tokens, root)
        num_hit = len(hits)
        # Tier hits (negative entries: -1 - slot) need fresh device pages like uncached tokens do.
        num_device = sum(1 for p in hits if p >= 0)
        num_new = max(self.num_pages_for(num_tokens), num_hit) - num_device
        # Hit pages sitting in the evictable set are claimed by this request, so they must not be
        # counted as room for its new pages too.
        hit_evictable = sum(1 for p in hits if p >= 0 and self._ref[p] == 0)
        if num_new > self.num_free_pages - hit_evictable:
            return None

        for p in hits:
            if p >= 0:
                if self._ref[p] == 0:
                    del self._evictable[p]
                self._ref[p] += 1
        tier = self.cpu_tier
        slots = [-1 - p for p in hits if p < 0]
        if slots:
            tier.pin(slots)  # the demotions that taking pages causes must not reuse them
        table: list[int] = []
        for i, p in enumerate(hits):
            if p < 0:
                page = self._take_page()
                tier.load(-1 - p, page, self._stamp[page])
                self._publish(page, hit_hashes[i], tuple(token_ids[i * self.page_size : (i + 1) * self.page_size]))
                p = page
            table.append(p)
        for _ in range(num_new - len(slots)):
            table.append(self._take_page())
        if slots:
            tier.unpin(slots)
        if tier is not None:
            tier.flush()
        cached = num_hit * self.page_size
        cpu_hit = len(slots) * self.page_size
        self._requests[req_id] = _Request(table, hit_hashes, cached, cpu_hit, root)
        if self.enable_prefix_caching:
            self.stats.requests += 1
            self.stats.query_tokens += len(token_ids)
            self.stats.hit_tokens += cached
            self.stats.cpu_hit_tokens += cpu_hit
        return cached

    def grow(self, req_id: Hashable, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in total; False (nothing changed) if short."""
        req = self._get(req_id)
        _check_count("num_tokens", num_tokens, minimum=0)
        need = self.num_pages_for(num_tokens) - len(req.block_table)
        if need <= 0:
            return True
        if need > self.num_free_pages:
            return False
        table = req.block_table
        for _ in range(need):
            table.append(self._take_page())
        if self.cpu_tier is not None:
            self.cpu_tier.flush()
        return True

    def mark_computed(self, req_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that KV of positions ``[0, num_computed)`` is written; publish full pages.

        ``token_ids`` is the request's token sequence (at least ``num_computed`` long). Pages
        already published for this request are not rehashed, so repeated calls cost O(new pages).
        A page whose content is already cached under another page stays private (it returns to the
        free list when released); the cached copy keeps serving hits.
        """
        req = self._get(req_id)
        _check_count("num_computed", num_computed, minimum=0)
        if num_computed > len(token_ids):
            raise ValueError(
                f"num_computed={num_computed} exceeds len(token_ids)={len(token_ids)} for request {req_id!r}"
            )
        if num_computed > len(req.block_table) * self.page_size:
            raise ValueError(
                f"num_computed={num_computed} exceeds the {len(req.block_table) * self.page_size} "
                f"token slots allocated to request {req_id!r}"
            )
        # Computed KV is never un-computed (HybridBlockManager refuses this too).
        if num_computed < req.num_computed:
            raise ValueError(
                f"num_computed={num_computed} is below the {req.num_computed} already computed for request {req_id!r}"
            )
        req.num_computed = num_computed
        if not self.enable_prefix_caching:
            return
        ps, hashes, table = self.page_size, req.hashes, req.block_table
        parent = hashes[-1] if hashes else req.root
        for i in range(len(hashes), num_computed // ps):
            tokens = tuple(token_ids[i * ps : (i + 1) * ps])
            parent = hash_page(parent, tokens)
            hashes.append(parent)
            page = table[i]
            if parent not in self._cache and self._page_hash[page] is None:
                self._publish(page, parent, tokens)

    def free(self, req_id: Hashable) -> None:
        """Release ``req_id``'s pages: cached ones become evictable, the rest free."""
        req = self._requests.pop(req_id, None)
        if req is None:
            raise ValueError(f"request {req_id!r} is not allocated (unknown or already freed)")
        ref, evictable, free = self._ref, self._evictable, self._free
        stamp = -1 if self.cpu_tier is None else self.cpu_tier.launch_seq
        # Tail first: the tail of a sequence is the least likely to be shared, so it should be
        # the first evicted (it is inserted earliest into the LRU order).
        for p in reversed(req.block_table):
            ref[p] -= 1
            if ref[p] == 0:
                self._stamp[p] = stamp
                if self._page_hash[p] is not None:
                    evictable[p] = None
                else:
                    free.append(p)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content (the CPU tier's too). Evictable pages become free; pages in use
        stay with their requests but are no longer shareable. Statistics are reset too."""
        if self.cpu_tier is not None:
            self.cpu_tier.reset()
        for p in self._cache.values():
            self._page_hash[p] = None
            self._page_tokens[p] = None
        self._cache.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        # Live requests rehash from their first page on the next mark_computed, which republishes
        # their (still valid) computed pages instead of chaining new pages onto dropped parents.
        for req in self._requests.values():
            req.hashes = []
        self.stats.reset()

    # ------------------------------------------------------------------ internals

    def _get(self, req_id: Hashable) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise ValueError(f"request {req_id!r} is not allocated")
        return req

    def _lookup(self, token_ids: Sequence[int], max_cached_tokens: int, root: bytes) -> tuple[list[int], list[bytes]]:
        """Hits (and chain keys) of the longest cached full-page prefix, at most ``max_cached_tokens``
        tokens: a device page id, or ``-1 - slot`` for a page found in the CPU tier. No side effects."""
        tier = self.cpu_tier
        if not self.enable_prefix_caching or not (self._cache or (tier is not None and len(tier))):
            return [], []
        ps = self.page_size
        limit = min(max_cached_tokens, len(token_ids)) // ps
        hits: list[int] = []
        hashes: list[bytes] = []
        parent = root
        for i in range(limit):
            tokens = tuple(token_ids[i * ps : (i + 1) * ps])
            parent = hash_page(parent, tokens)
            page = self._cache.get(parent)
            if page is None:
                slot = None if tier is None else tier.lookup(parent, tokens)
                if slot is None:
                    break
                page = -1 - slot
            # The stored token ids guard against a chain collision handing out foreign KV.
            elif self._page_tokens[page] != tokens:
                break
            hits.append(page)
            hashes.append(parent)
        return hits, hashes

    def _publish(self, page: int, key: bytes, tokens: tuple[int, ...]) -> None:
        self._cache[key] = page
        self._page_hash[page] = key
        self._page_tokens[page] = tokens

    def _take_page(self) -> int:
        """Pop a free page, evicting the least recently used cached page if none is free.
        Callers have checked ``num_free_pages``."""
        if self._free:
            p = self._free.popleft()
        else:
            p, _ = self._evictable.popitem(last=False)
            key = self._page_hash[p]
            if self.cpu_tier is not None:  # copied out before anything overwrites it
                self.cpu_tier.demote(p, key, self._page_tokens[p], self._stamp[p])
            del self._cache[key]
            self._page_hash[p] = None
            self._page_tokens[p] = None
        self._ref[p] = 1
        return p
