"""Hybrid KV manager: a model-based property test plus targeted scenarios.

The property test drives the manager with random admissions, growth and frees, and keeps a fake
memory: every KV slot holds the id of the token prefix it was computed from, every state slot the
prefix its state summarizes. Whatever a request reads -- its own pages, pages shared through the
prefix cache, a checkpoint copied into its live slot -- must hold *its* prefix. That catches wrong
sharing, reuse of a page still referenced, stale cache entries and broken copies; the manager's
``check_invariants`` recounts every page after every step (no leak, no double free, exact refs).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infercore.kv import FullAttentionSpec
from infercore.kv.hybrid import (
    PAD_PAGE,
    HybridBlockManager,
    HybridKVLayout,
    LinearStateSpec,
    SlidingWindowSpec,
)

P, W, INTERVAL = 4, 6, 8
LIN = LinearStateSpec((6, 3), (2, 4, 4), conv_dtype=torch.float16, recurrent_dtype=torch.float32)
MODELS = {
    "sliding_5to1": [SlidingWindowSpec(1, 8, W)] * 5 + [FullAttentionSpec(1, 8)],
    "linear_3to1": [LIN] * 3 + [FullAttentionSpec(1, 8)],
    "all_three": [SlidingWindowSpec(1, 8, W), LIN, FullAttentionSpec(2, 8)],
    "sliding_only": [SlidingWindowSpec(1, 8, W)] * 2,
}


class FakeMemory:
    """Slot contents of every group, as ids of token prefixes."""

    def __init__(self, mgr: HybridBlockManager) -> None:
        self.mgr = mgr
        self.kv: dict[tuple[int, int], tuple] = {}  # (group, slot) -> prefix tuple
        self.state: dict[tuple[int, int], tuple] = {}

    def apply_copies(self) -> None:
        for c in self.mgr.take_state_copies():
            self.state[(c.group, c.dst)] = self.state.get((c.group, c.src))

    def check_reads_and_write(self, rid, tokens: list[int], start: int, end: int) -> None:
        """Verify what computing positions [start, end) reads, then write their results."""
        mgr = self.mgr
        for g, pol in enumerate(mgr.policies):
            if pol.kind == "linear":
                slot = mgr.state_slot(rid, g)
                have = self.state.get((g, slot)) if start else ()
                assert have == tuple(tokens[:start]), f"group {g}: live state holds a foreign prefix"
                self.state[(g, slot)] = tuple(tokens[:end])
                continue
            # Independent of the policy under test: HF window semantics, query q reads (q - w, q].
            window = mgr.layout.groups[g].window if pol.kind == "sliding" else None
            first = max(0, start - window + 1) // P * P if window else 0
            slots = mgr.slot_mapping(rid, g, first, end)
            for pos, s in zip(range(first, start), slots):
                assert self.kv.get((g, s)) == tuple(tokens[: pos + 1]), f"group {g} pos {pos}: foreign KV"
            for pos, s in zip(range(start, end), slots[start - first :]):
                self.kv[(g, s)] = tuple(tokens[: pos + 1])


def _run(model: str, mode: str, caching: bool, num_large: int, seed: int, steps: int) -> int:
    """Run a random workload; returns the prefix-cache hit tokens it saw."""
    rng = random.Random(seed)
    layout = HybridKVLayout.build(MODELS[model], page_tokens=P, mode=mode, dtype=torch.float16,
                                  checkpoint_interval=INTERVAL if mode == "multi" else None)  # fmt: skip
    mgr = HybridBlockManager(layout, num_large, enable_prefix_caching=caching)
    mem = FakeMemory(mgr)
    bases = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]
    live: dict[int, list] = {}  # rid -> [tokens, computed, target_len]
    next_id = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.35 or not live:
            base = rng.choice(bases)
            n = rng.randrange(1, 40)
            tokens = (
                base[:n]
                if rng.random() < 0.7
                else base[: n // 2] + [rng.randrange(3) for _ in range(n - n // 2)]
            )
            want = rng.randrange(1, len(tokens) + 1)
            cached = mgr.allocate(next_id, tokens, want, max_cached_tokens=len(tokens) - 1)
            if cached is not None:
                assert cached % P == 0 and cached <= len(tokens) - 1
                assert cached == 0 or caching
                mem.apply_copies()
                end = max(want, cached)
                mem.check_reads_and_write(next_id, tokens, cached, end)
                mgr.mark_computed(next_id, tokens, end)
                mem.apply_copies()
                live[next_id] = [tokens, end, len(tokens) + rng.randrange(0, 12)]
            next_id += 1
        elif op < 0.85:
            rid = rng.choice(list(live))
            tokens, done, target = live[rid]
            if done >= target:
                mgr.free(rid)
                del live[rid]
            else:
                step = rng.choice([1, 1, INTERVAL - done % INTERVAL, rng.randrange(1, 9)])
                end = min(target, done + step)
                while len(tokens) < end:
                    tokens.append(rng.randrange(3))
                if mgr.grow(rid, end):
                    mem.check_reads_and_write(rid, tokens, done, end)
                    mgr.mark_computed(rid, tokens, end)
                    mem.apply_copies()
                    live[rid][1] = end
                    _check_window(mgr, rid, end)
        else:
            rid = rng.choice(list(live))
            mgr.free(rid)
            del live[rid]
        mgr.check_invariants()
    for rid in list(live):
        mgr.free(rid)
    mgr.check_invariants()
    mem_stats = mgr.memory()
    assert mem_stats["used"] == 0
    assert sum(mem_stats[k] for k in ("used", "cached", "fragment", "free")) == mem_stats["total"]
    hits = mgr.stats.hit_tokens
    mgr.reset_prefix_cache()
    mgr.check_invariants()
    # No leaked small page can hide a large page: everything is free again.
    assert mgr.pool.num_free_large == num_large
    return hits


def _check_window(mgr: HybridBlockManager, rid, computed: int) -> None:
    """Sliding pages are released as soon as no later token reads them, and not before."""
    for g, pol in enumerate(mgr.policies):
        if pol.kind != "sliding":
            continue
        table = mgr.block_table(rid, g)
        first = max(0, computed - W + 1) // P
        assert all(p == PAD_PAGE for p in table[:first])
        assert all(p != PAD_PAGE for p in table[first:])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(sorted(MODELS)),
    mode=st.sampled_from(["multi", "uniform"]),
    caching=st.booleans(),
    num_large=st.integers(3, 24),
    seed=st.integers(0, 2**16),
)
def test_random_workload_keeps_books_and_contents(model, mode, caching, num_large, seed):
    _run(model, mode, caching, num_large, seed, steps=80)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_fixed_workloads_multi_with_cache(model):
    # Deterministic companions of the property test: a roomy pool (many hits) and a tight one
    # (constant eviction).
    assert _run(model, "multi", True, 40, seed=1, steps=150) > 0  # hits happened and were checked
    _run(model, "multi", True, 4, seed=2, steps=150)


def _layout(model: str, mode: str = "multi") -> HybridKVLayout:
    return HybridKVLayout.build(MODELS[model], page_tokens=P, mode=mode, dtype=torch.float16,
                                checkpoint_interval=INTERVAL if mode == "multi" else None)  # fmt: skip


def test_hit_is_longest_prefix_every_type_serves():
    mgr = HybridBlockManager(_layout("linear_3to1"), 16)
    tokens = list(range(30))
    assert mgr.allocate("a", tokens, 30, max_cached_tokens=29) == 0
    for n in (8, 13, 16, 23, 30):  # checkpoints only where a step ends on the interval: 8 and 16
        mgr.mark_computed("a", tokens, n)
    copies = mgr.take_state_copies()
    assert len(copies) == 2 and all(c.src == mgr.state_slot("a", 0) for c in copies)
    mgr.free("a")
    # Full pages are cached up to 28 tokens, but the recurrent layers can resume only at 16.
    assert mgr.allocate("b", tokens, 30, max_cached_tokens=29) == 16
    (copy,) = mgr.take_state_copies()
    assert copy.dst == mgr.state_slot("b", 0) and copy.src == copies[1].dst
    # Capped below 16: the 8-token checkpoint serves.
    assert mgr.allocate("c", tokens, 30, max_cached_tokens=15) == 8
    mgr.check_invariants()


def _cached_page(mgr: HybridBlockManager, group: int, depth: int) -> int:
    return next(n.entries[group] for n in mgr._nodes.values() if n.depth == depth and group in n.entries)


def test_sliding_hit_needs_only_the_window():
    mgr = HybridBlockManager(_layout("sliding_only"), 64)
    tokens = list(range(40))
    mgr.allocate("a", tokens, 40, max_cached_tokens=39)
    mgr.mark_computed("a", tokens, 40)
    mgr.free("a")
    # Pages 0..2 leave the cache: position 36 (the first recomputed token) reads 31..35 only.
    for depth in range(3):
        mgr._evict(0, _cached_page(mgr, 0, depth))
    assert mgr.match_prefix(tokens, max_cached_tokens=39) == 36
    # Page 8 (positions 32..35) is in that window: the hit falls back to 32 (reads 27..31).
    mgr._evict(0, _cached_page(mgr, 0, 8))
    mgr.check_invariants()
    hit = mgr.allocate("b", tokens, 40, max_cached_tokens=39)
    assert hit == 32
    table = mgr.block_table("b", 0)
    first = mgr.policies[0].first_needed_page(hit)
    assert first == 6 and table[:first] == [PAD_PAGE] * first and PAD_PAGE not in table[first:]
    mgr.check_invariants()


def test_checkpoints_are_released_with_their_prefix():
    mgr = HybridBlockManager(_layout("linear_3to1"), 16)
    tokens = list(range(24))
    mgr.allocate("a", tokens, 24, max_cached_tokens=23)
    for n in (8, 16, 24):
        mgr.mark_computed("a", tokens, n)
    mgr.take_state_copies()
    mgr.free("a")
    lin, full = 0, 1
    assert len(mgr._entry_node[lin]) == 3
    first_page = mgr._nodes[next(k for k, n in mgr._nodes.items() if n.depth == 0)].entries[full]
    mgr._evict(full, first_page)
    # Every later prefix chains through page 0: all its checkpoints went with it.
    assert not mgr._nodes and not mgr._entry_node[lin]
    assert mgr.pool.num_free_large == 16
    mgr.check_invariants()


def test_free_returns_whole_large_pages():
    layout = _layout("sliding_5to1")
    full = 1
    per = layout.smalls_per_large(full)
    span = per * P  # tokens that fill one large page of the full group
    mgr = HybridBlockManager(layout, 64, enable_prefix_caching=False)
    # Interleave two requests' growth one large page at a time: request-aware placement carves
    # whole large pages for each, so their pages stay apart.
    mgr.allocate("a", [0] * span, span, max_cached_tokens=0)
    mgr.allocate("b", [1] * span, span, max_cached_tokens=0)
    for n in range(2 * span, 4 * span + 1, span):
        assert mgr.grow("a", n) and mgr.grow("b", n)
    larges = {
        r: {mgr.pool.large_of(g, p) for g in range(mgr.num_groups) for p in mgr.block_table(r, g) if p >= 0}
        for r in "ab"
    }
    assert not larges["a"] & larges["b"]
    before = mgr.pool.num_free_large
    mgr.free("a")
    assert mgr.pool.num_free_large == before + len(larges["a"])
    mgr.check_invariants()


def test_a_group_strands_less_than_one_large_page():
    # Requests far smaller than a large page (the Qwen3-Next case: 48 of 393 attention pages):
    # their remainders share carved pages instead of each carving its own, so no group ever
    # holds a large page's worth of free slots that another group could have used.
    layout = _layout("linear_3to1")
    lin, full = 0, 1
    per = layout.smalls_per_large(full)
    assert per >= 4
    mgr = HybridBlockManager(layout, 64, enable_prefix_caching=False)
    n = 0
    while mgr.allocate(n, [0] * P, P, max_cached_tokens=0) is not None:  # one page per group
        assert mgr.pool._free_slots[full] < per and mgr.pool._free_slots[lin] < layout.smalls_per_large(lin)
        n += 1
        for rid in range(0, n, 3):  # some grow by a page, interleaved, as decode would
            mgr.grow(rid, P * (len(mgr.block_table(rid, full)) + 1))
    mgr.check_invariants()
    mem = mgr.memory()
    assert mem["free"] == 0 and mem["fragment"] < layout.large_bytes * mgr.num_groups


def test_accounting_is_exact_without_cache():
    layout = _layout("all_three")
    mgr = HybridBlockManager(layout, 20, enable_prefix_caching=False)
    mgr.allocate("a", list(range(30)), 30, max_cached_tokens=29)
    mgr.mark_computed("a", list(range(30)), 30)
    held = {g: [p for p in mgr._requests["a"].tables[g] if p >= 0] for g in range(mgr.num_groups)}
    mem = mgr.memory()
    assert mem["used"] == sum(len(h) * layout.groups[g].small_bytes for g, h in held.items())
    assert mem["cached"] == 0
    assert sum(mem[k] for k in ("used", "cached", "fragment", "free")) == mem["total"]
    # Sliding keeps the window: position 30 reads 25..29 -> pages 6 and 7 only.
    assert len(held[0]) == 2 and len(held[2]) == 8 and len(held[1]) == 1


def test_short_pool_changes_nothing_and_uniform_keeps_history():
    mgr = HybridBlockManager(_layout("sliding_5to1", "uniform"), 4, enable_prefix_caching=False)
    assert mgr.allocate("a", list(range(100)), 100, max_cached_tokens=0) is None
    assert len(mgr) == 0 and mgr.pool.num_free_large == 4
    mgr.allocate("a", list(range(12)), 12, max_cached_tokens=0)
    mgr.mark_computed("a", list(range(12)), 12)
    assert PAD_PAGE not in mgr.block_table("a", 0)  # uniform: the sliding group keeps full history
    assert not mgr.grow("a", 10_000)
    assert len(mgr.block_table("a", 0)) == 3
    mgr.check_invariants()


def test_bad_arguments_raise():
    mgr = HybridBlockManager(_layout("all_three"), 8)
    with pytest.raises(TypeError, match="layout"):
        HybridBlockManager("x", 8)
    with pytest.raises(ValueError, match="num_large_pages"):
        HybridBlockManager(_layout("all_three"), 0)
    mgr.allocate("a", [1, 2, 3], 3, max_cached_tokens=2)
    with pytest.raises(ValueError, match="already allocated"):
        mgr.allocate("a", [1], 1, max_cached_tokens=0)
    with pytest.raises(ValueError, match="not a linear-state group"):
        mgr.state_slot("a", 0)
    with pytest.raises(ValueError, match="not an attention group"):
        mgr.block_table("a", 1)
    with pytest.raises(ValueError, match="num_computed"):
        mgr.mark_computed("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match="not allocated"):
        mgr.free("zzz")
