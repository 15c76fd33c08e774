"""BlockManager: focused unit tests plus a hypothesis state machine with a shadow model.

The shadow model records, for every cache slot, the token prefix whose KV was written there
(KV at position p is a function of tokens[0..p]). Any prefix hit, eviction of a page in use, or
write into a shared page that the manager gets wrong shows up as a mismatch.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infercore.kv import BlockManager, hash_pages
from infercore.kv.prefix_cache import ROOT_HASH, hash_page


def snapshot(bm: BlockManager) -> tuple:
    """Everything an operation could change, for no-side-effect checks."""
    return (
        list(bm._ref),
        list(bm._free),
        list(bm._evictable),
        dict(bm._cache),
        list(bm._page_hash),
        {r: (list(q.block_table), list(q.hashes)) for r, q in bm._requests.items()},
        (bm.stats.requests, bm.stats.query_tokens, bm.stats.hit_tokens),
    )


def check_invariants(bm: BlockManager) -> None:
    n = bm.num_pages
    free, evictable = list(bm._free), list(bm._evictable)
    assert len(set(free)) == len(free), "page twice in the free list"
    assert not set(free) & set(evictable), "page both free and evictable"
    in_use = {p for p in range(n) if bm._ref[p] > 0}
    assert not in_use & (set(free) | set(evictable)), "page in use and free/evictable"
    assert in_use | set(free) | set(evictable) == set(range(n)), "page in no state (leak)"
    assert all(r >= 0 for r in bm._ref)
    # Refcount == number of live block tables holding the page; no duplicates within a table.
    counts = [0] * n
    for req in bm._requests.values():
        assert len(set(req.block_table)) == len(req.block_table), "page twice in one block table"
        for p in req.block_table:
            counts[p] += 1
    assert counts == bm._ref
    # Evictable pages are exactly the cached pages nobody references; free pages are uncached.
    assert all(bm._page_hash[p] is not None for p in evictable)
    assert all(bm._page_hash[p] is None for p in free)
    assert {p: h for h, p in bm._cache.items()} == {
        p: h for p, h in enumerate(bm._page_hash) if h is not None
    }
    assert bm.num_free_pages == len(free) + len(evictable)
    assert 0 <= bm.stats.hit_tokens <= bm.stats.query_tokens


# ---------------------------------------------------------------------------- unit tests


def test_constructor_validates() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_pages"):
            BlockManager(bad, 4)
        with pytest.raises(ValueError, match="page_size"):
            BlockManager(4, bad)
    with pytest.raises(TypeError, match="page_size"):
        BlockManager(4, 2.0)  # type: ignore[arg-type]


def test_request_errors_name_the_request() -> None:
    bm = BlockManager(8, 4)
    assert bm.allocate("a", [1, 2, 3], 3, max_cached_tokens=2) == 0
    with pytest.raises(ValueError, match="'a'.*already"):
        bm.allocate("a", [1, 2, 3], 3, max_cached_tokens=2)
    for call in (
        lambda: bm.free("zz"),
        lambda: bm.grow("zz", 4),
        lambda: bm.block_table("zz"),
        lambda: bm.slot_mapping("zz", 0, 1),
        lambda: bm.mark_computed("zz", [1], 1),
    ):
        with pytest.raises(ValueError, match="'zz'"):
            call()
    bm.free("a")
    with pytest.raises(ValueError, match="'a'"):
        bm.free("a")  # double free
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate("b", [1], -1, max_cached_tokens=0)
    with pytest.raises(ValueError, match="max_cached_tokens"):
        bm.allocate("b", [1], 1, max_cached_tokens=-1)


def test_mark_computed_validates() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(6)), 6, max_cached_tokens=5)
    with pytest.raises(ValueError, match="len\\(token_ids\\)"):
        bm.mark_computed("a", [0, 1], 3)
    with pytest.raises(ValueError, match="allocated"):
        bm.mark_computed("a", list(range(12)), 9)


def test_slot_mapping_values() -> None:
    bm = BlockManager(5, 4)
    bm.allocate("x", [0], 4, max_cached_tokens=0)  # takes page 0
    bm.allocate("a", list(range(10)), 10, max_cached_tokens=9)  # pages 1, 2, 3
    assert bm.block_table("a") == [1, 2, 3]
    assert bm.slot_mapping("a", 0, 10) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert bm.slot_mapping("a", 3, 6) == [7, 8, 9]
    assert bm.slot_mapping("a", 5, 5) == []
    assert bm.slot_mapping("a", 11, 12) == [15]  # capacity is 12 tokens
    with pytest.raises(ValueError, match="allocated"):
        bm.slot_mapping("a", 10, 13)
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 3, 2)
    # Non-contiguous, non-monotonic pages: x's page 0 is recycled after page 4.
    bm.free("x")
    assert bm.grow("a", 17)
    assert bm.block_table("a") == [1, 2, 3, 4, 0]
    assert bm.slot_mapping("a", 10, 17) == [14, 15, 16, 17, 18, 19, 0]


def test_hit_after_miss_reuses_pages() -> None:
    bm = BlockManager(16, 4)
    prompt = list(range(100, 110))  # 2 full pages + 2 tokens
    assert bm.allocate("a", prompt, len(prompt), max_cached_tokens=len(prompt) - 1) == 0
    a_table = bm.block_table("a")
    bm.mark_computed("a", prompt, 10)
    assert bm.num_cached_pages == 2  # the partial third page is not cached
    bm.free("a")
    assert bm.num_evictable_pages == 2

    assert bm.allocate("b", prompt + [5, 6], 12, max_cached_tokens=11) == 8
    assert bm.block_table("b")[:2] == a_table[:2]
    assert bm.block_table("b")[2] != a_table[0] and bm.num_evictable_pages == 0
    assert bm.stats.query_tokens == 10 + 12 and bm.stats.hit_tokens == 8
    # A different second page only hits the first one.
    other = prompt[:4] + [0, 0, 0, 0, 1]
    assert bm.allocate("c", other, 9, max_cached_tokens=8) == 4
    assert bm.block_table("c")[0] == a_table[0]
    assert bm._ref[a_table[0]] == 2  # shared by b and c
    # A different first page hits nothing even if later pages agree.
    assert bm.allocate("d", [0] + prompt[1:], 10, max_cached_tokens=9) == 0
    check_invariants(bm)


def test_concurrent_share_and_hit_rate() -> None:
    bm = BlockManager(8, 2)
    p = [1, 2, 3, 4, 5]
    bm.allocate("a", p, 5, max_cached_tokens=4)
    bm.mark_computed("a", p, 5)
    assert bm.allocate("b", p, 5, max_cached_tokens=4) == 4
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2]
    assert bm.block_table("a")[2] != bm.block_table("b")[2]
    assert bm.num_used_pages == 4
    bm.free("a")
    assert bm.num_evictable_pages == 0  # b still holds the shared pages
    bm.free("b")
    assert bm.num_evictable_pages == 2 and bm.num_free_pages == 8
    assert bm.stats.hit_rate == pytest.approx(4 / 10)


def test_max_cached_tokens_cap() -> None:
    bm = BlockManager(8, 4)
    p = list(range(8))
    bm.allocate("a", p, 8, max_cached_tokens=7)
    bm.mark_computed("a", p, 8)
    bm.free("a")
    # The whole prompt is cached, but the cap keeps the last token to be recomputed.
    assert bm.match_prefix(p, max_cached_tokens=7) == 4
    assert bm.allocate("b", p, 8, max_cached_tokens=7) == 4
    assert bm.allocate("c", p, 8, max_cached_tokens=8) == 8
    assert bm.allocate("d", p, 8, max_cached_tokens=0) == 0
    # A hit longer than num_tokens still holds room for the hit.
    assert bm.allocate("e", p, 1, max_cached_tokens=8) == 8
    assert len(bm.block_table("e")) == 2


def test_lru_eviction_order() -> None:
    bm = BlockManager(4, 2)
    pa, pb = [1, 1], [2, 2]
    for rid, p in (("a", pa), ("b", pb)):
        bm.allocate(rid, p, 2, max_cached_tokens=2)
        bm.mark_computed(rid, p, 2)
    page_a, page_b = bm.block_table("a")[0], bm.block_table("b")[0]
    bm.free("a")
    bm.free("b")  # LRU order: a (oldest), b
    # Two free pages remain; they are used before any cached page is evicted.
    bm.allocate("x", [9] * 4, 4, max_cached_tokens=0)
    assert set(bm.block_table("x")).isdisjoint({page_a, page_b})
    assert bm.num_cached_pages == 2
    # Now one more page must come from the evictable set: the oldest (a) goes.
    bm.allocate("y", [8], 1, max_cached_tokens=0)
    assert bm.block_table("y") == [page_a]
    assert bm.match_prefix(pa, max_cached_tokens=2) == 0
    assert bm.match_prefix(pb, max_cached_tokens=2) == 2
    # A hit refreshes recency: reuse b, release it after y, then b is the newest.
    bm.free("y")
    assert bm.allocate("b2", pb, 2, max_cached_tokens=2) == 2
    bm.free("b2")
    assert list(bm._evictable) == [page_b]
    check_invariants(bm)


def test_free_order_evicts_tail_pages_first() -> None:
    bm = BlockManager(3, 1)
    p = [1, 2, 3]
    bm.allocate("a", p, 3, max_cached_tokens=3)
    bm.mark_computed("a", p, 3)
    table = bm.block_table("a")
    bm.free("a")
    bm.allocate("x", [7], 1, max_cached_tokens=0)
    assert bm.block_table("x") == [table[2]]  # the tail page is evicted, the head stays
    assert bm.match_prefix(p, max_cached_tokens=3) == 2


def test_allocate_failure_has_no_side_effects() -> None:
    bm = BlockManager(4, 2)
    p = [1, 2, 3, 4, 5, 6]
    bm.allocate("a", p, 6, max_cached_tokens=6)
    bm.mark_computed("a", p, 6)
    bm.free("a")  # 3 evictable cached pages + 1 free
    before = snapshot(bm)
    # Hit 3 pages (all evictable) + 2 new pages; only 1 page is left once the hit is claimed.
    # Counting the hit pages as free room too would evict the request's own prefix.
    assert bm.allocate("b", p, 10, max_cached_tokens=6) is None
    assert snapshot(bm) == before
    assert bm.allocate("b", p, 8, max_cached_tokens=6) == 6
    check_invariants(bm)
    before = snapshot(bm)
    assert not bm.grow("b", 9)
    assert snapshot(bm) == before
    assert bm.grow("b", 8)  # within capacity: no-op
    assert snapshot(bm) == before


def test_duplicate_content_is_cached_once() -> None:
    bm = BlockManager(8, 2)
    p = [3, 4, 5, 6]
    bm.allocate("a", p, 4, max_cached_tokens=3)
    bm.allocate("b", p, 4, max_cached_tokens=3)  # both miss: nothing computed yet
    bm.mark_computed("a", p, 4)
    bm.mark_computed("b", p, 4)
    assert bm.num_cached_pages == 2
    assert set(bm._cache.values()) == set(bm.block_table("a"))
    bm.free("b")  # b's private duplicates go straight back to the free list
    assert bm.num_evictable_pages == 0 and bm.num_free_pages == 6
    bm.free("a")
    assert bm.num_evictable_pages == 2 and bm.num_free_pages == 8
    check_invariants(bm)


def test_incremental_mark_computed_and_decode_pages() -> None:
    bm = BlockManager(8, 2)
    seq = [1, 2, 3]
    bm.allocate("a", seq, 3, max_cached_tokens=2)
    bm.mark_computed("a", seq, 3)
    assert bm.num_cached_pages == 1
    seq = seq + [9]  # a decode step fills page 1
    assert bm.grow("a", 4)
    bm.mark_computed("a", seq, 4)
    assert bm.num_cached_pages == 2
    assert bm._requests["a"].hashes == hash_pages(seq, 2)
    bm.free("a")
    # Output tokens are cached too: a follow-up turn hits the whole conversation.
    assert bm.allocate("b", seq + [5], 5, max_cached_tokens=4) == 4


def test_collision_guard_rejects_foreign_tokens() -> None:
    bm = BlockManager(4, 2)
    bm.allocate("a", [1, 2], 2, max_cached_tokens=2)
    bm.mark_computed("a", [1, 2], 2)
    bm.free("a")
    # Forge a collision: make [7, 8]'s key point at the page holding [1, 2].
    forged = hash_page(ROOT_HASH, (7, 8))
    page = next(iter(bm._cache.values()))
    bm._cache[forged] = page
    assert bm.match_prefix([7, 8], max_cached_tokens=2) == 0
    assert bm.match_prefix([1, 2], max_cached_tokens=2) == 2


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    p = [1, 2, 3, 4]
    bm.allocate("a", p, 4, max_cached_tokens=4)
    bm.mark_computed("a", p, 4)
    bm.free("a")
    assert bm.num_cached_pages == 0 and bm.num_evictable_pages == 0
    assert bm.allocate("b", p, 4, max_cached_tokens=4) == 0
    assert bm.stats.query_tokens == 0


def test_reset_prefix_cache() -> None:
    bm = BlockManager(6, 2)
    p = [1, 2, 3, 4]
    bm.allocate("a", p, 4, max_cached_tokens=4)
    bm.mark_computed("a", p, 4)
    bm.allocate("b", [5, 6], 2, max_cached_tokens=2)
    bm.mark_computed("b", [5, 6], 2)
    bm.free("b")
    assert bm.num_evictable_pages == 1
    bm.reset_prefix_cache()
    check_invariants(bm)
    assert bm.num_cached_pages == 0 and bm.num_evictable_pages == 0 and bm.num_free_pages == 4
    assert bm.match_prefix(p, max_cached_tokens=4) == 0
    # a's computed pages are republished on its next mark_computed.
    bm.mark_computed("a", p, 4)
    assert bm.match_prefix(p, max_cached_tokens=4) == 4
    bm.free("a")
    check_invariants(bm)
    assert bm.num_free_pages == 6


def test_can_allocate_and_grow_accounting() -> None:
    bm = BlockManager(5, 3)
    assert bm.can_allocate(15) and not bm.can_allocate(16)
    assert bm.allocate("a", [0], 16, max_cached_tokens=0) is None
    assert bm.allocate("a", [0], 7, max_cached_tokens=0) == 0  # 3 pages
    assert bm.num_allocated_tokens("a") == 9
    assert bm.grow("a", 15) and not bm.grow("a", 16)
    assert bm.num_free_pages == 0 and bm.usage == 1.0


# ---------------------------------------------------------------------------- state machine

# Token alphabet {0, 1, 2}; the second base agrees with the first on its first 5 tokens.
BASES = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
    [0, 1, 2, 0, 1, 1, 1, 1, 0, 0, 2, 2],
    [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of the engine's calls, checked against a shadow model."""

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        # req -> {"tokens": list, "computed": int, "key": its prefix-cache salt}
        self.reqs: dict[int, dict] = {}
        # slot -> token prefix whose KV was written there
        self.shadow: dict[int, tuple[int, ...]] = {}

    @initialize(
        num_pages=st.integers(1, 20),
        page_size=st.integers(1, 4),
        caching=st.sampled_from([True, True, False]),
    )
    def setup(self, num_pages: int, page_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=caching)

    # -- helpers

    def _write(self, rid: int, start: int, end: int) -> None:
        """Simulate the forward pass writing KV for positions [start, end)."""
        tokens = self.reqs[rid]["tokens"]
        table = self.bm.block_table(rid)
        ps = self.bm.page_size
        for pos, slot in zip(range(start, end), self.bm.slot_mapping(rid, start, end)):
            page = slot // ps
            assert page == table[pos // ps]
            # Writing into a page someone else reads, or a published page, corrupts the cache.
            assert self.bm._ref[page] == 1, "write into a shared page"
            assert self.bm._page_hash[page] is None, "write into a cached page"
            self.shadow[slot] = (self.reqs[rid]["key"], tuple(tokens[: pos + 1]))

    def _compute(self, rid: int, chunk: int) -> None:
        r = self.reqs[rid]
        end = min(r["computed"] + chunk, len(r["tokens"]), self.bm.num_allocated_tokens(rid))
        if end > r["computed"]:
            self._write(rid, r["computed"], end)
            r["computed"] = end
        self.bm.mark_computed(rid, r["tokens"], r["computed"])

    # -- rules

    @rule(
        base=st.sampled_from(BASES),
        head=st.integers(0, 12),
        tail=st.lists(st.integers(0, 2), max_size=4),
        extra=st.integers(-4, 4),
        cap_slack=st.integers(0, 2),
        prefill=st.booleans(),
        key=st.sampled_from([None, None, b"lora-a", b"lora-b"]),
    )
    def allocate(
        self, base: list[int], head: int, tail: list[int], extra: int, cap_slack: int, prefill: bool,
        key: bytes | None,
    ) -> None:
        # ``key``: the prefix-cache salt (a LoRA adapter's): KV computed under one key is never another's hit
        # Prompts share prefixes of a few base sequences, so hits (and near misses) are common.
        prompt = base[:head] + tail
        assume(prompt)
        rid = self.next_id
        num_tokens = max(0, len(prompt) + extra)
        max_cached = max(0, len(prompt) - cap_slack)
        could_fit = self.bm.can_allocate(num_tokens)
        expected_hit = self.bm.match_prefix(prompt, max_cached_tokens=max_cached, extra_key=key)
        before = snapshot(self.bm)
        cached = self.bm.allocate(rid, prompt, num_tokens, max_cached_tokens=max_cached, extra_key=key)
        if cached is None:
            assert snapshot(self.bm) == before
            # Prefix hits can only reduce the need, so a refusal implies plain shortage.
            assert not could_fit
            return
        if could_fit is False:
            assert cached > 0  # only a hit can make an allocation fit that can_allocate refused
        self.next_id += 1
        assert cached == expected_hit
        ps = self.bm.page_size
        assert cached % ps == 0 and cached <= max_cached and cached <= len(prompt)
        if not self.bm.enable_prefix_caching:
            assert cached == 0
        table = self.bm.block_table(rid)
        assert len(table) == max(self.bm.num_pages_for(num_tokens), cached // ps)
        # The hit's KV must be exactly that of this prompt's prefix.
        for pos, slot in zip(range(cached), self.bm.slot_mapping(rid, 0, cached)):
            assert self.shadow.get(slot) == (key, tuple(prompt[: pos + 1])), "prefix hit returned foreign KV"
        self.reqs[rid] = {"tokens": list(prompt), "computed": cached, "key": key}
        if prefill:  # the engine usually runs the first chunk in the same step
            self._compute(rid, len(prompt))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.sampled_from([1, 3, 16, 16]))
    def compute(self, data: st.DataObject, chunk: int) -> None:
        self._compute(data.draw(st.sampled_from(sorted(self.reqs))), chunk)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.integers(0, 6))
    def grow(self, data: st.DataObject, extra: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        target = len(self.reqs[rid]["tokens"]) + extra
        need = self.bm.num_pages_for(target) - len(self.bm.block_table(rid))
        available = self.bm.num_free_pages
        before = snapshot(self.bm)
        ok = self.bm.grow(rid, target)
        assert ok == (need <= available)
        if not ok:
            assert snapshot(self.bm) == before
        else:
            assert self.bm.num_allocated_tokens(rid) >= target

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append_token(self, data: st.DataObject, token: int) -> None:
        """A sampled token joins the sequence once everything before it is computed."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        assume(r["computed"] == len(r["tokens"]))
        r["tokens"].append(token)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), reset=st.sampled_from([False] * 15 + [True]))
    def free(self, data: st.DataObject, reset: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.bm.free(rid)
        del self.reqs[rid]
        if reset:  # rare: a no-argument rule would be drawn far too often
            self.bm.reset_prefix_cache()

    # -- invariants

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        check_invariants(self.bm)
        assert set(self.bm._requests) == set(self.reqs)
        # Nobody overwrote or evicted KV that a live request has computed.
        for rid, r in self.reqs.items():
            for pos, slot in zip(range(r["computed"]), self.bm.slot_mapping(rid, 0, r["computed"])):
                assert self.shadow[slot] == (r["key"], tuple(r["tokens"][: pos + 1]))
        # Every cached page holds the KV its recorded tokens say.
        ps = self.bm.page_size
        for page, tokens in enumerate(self.bm._page_tokens):
            if tokens is not None:
                written = [self.shadow.get(page * ps + i) for i in range(ps)]
                assert all(w is not None for w in written)
                assert tuple(w[1][-1] for w in written) == tokens

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for rid in list(self.reqs):
            self.bm.free(rid)
        check_invariants(self.bm)
        assert all(r == 0 for r in self.bm._ref)
        assert self.bm.num_free_pages == self.bm.num_pages
        assert self.bm.num_used_pages == 0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
