"""Bad counts, indices and token ids are refused by the KV managers, with an error naming the argument."""

import pytest

from infercore.kv import BlockManager, FullAttentionSpec
from infercore.kv.hybrid import HybridBlockManager, HybridKVLayout, LinearStateSpec, SlidingWindowSpec

SPECS = [FullAttentionSpec(2, 8), SlidingWindowSpec(2, 8, 4), LinearStateSpec((4, 3), (2, 4, 4))]


def _layout(**kw) -> HybridKVLayout:
    return HybridKVLayout.build(SPECS, page_tokens=2, **kw)


def _hybrid() -> HybridBlockManager:
    mgr = HybridBlockManager(_layout(), 8)
    assert mgr.allocate("r", [1, 2, 3, 4], 4, max_cached_tokens=0) == 0
    return mgr


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda bm: bm.num_pages_for(-5), ValueError, "num_tokens"),
        (lambda bm: bm.num_pages_for(2.5), TypeError, "num_tokens"),
        (lambda bm: bm.can_allocate(-5), ValueError, "num_tokens"),
        (lambda bm: bm.can_allocate("4"), TypeError, "num_tokens"),
    ],
)
def test_block_manager_bad_counts(call, exc, match):
    with pytest.raises(exc, match=match):
        call(BlockManager(4, 2))


@pytest.mark.parametrize("caching", [True, False])
def test_block_manager_num_computed_never_decreases(caching):
    bm = BlockManager(4, 2, enable_prefix_caching=caching)
    bm.allocate("a", [1, 2, 3, 4], 4, max_cached_tokens=0)
    bm.mark_computed("a", [1, 2, 3, 4], 4)
    bm.mark_computed("a", [1, 2, 3, 4], 4)  # repeating is fine
    with pytest.raises(ValueError, match="num_computed"):
        bm.mark_computed("a", [1, 2, 3, 4], 2)


def test_block_manager_num_computed_starts_at_the_cache_hit():
    bm = BlockManager(8, 2)
    bm.allocate("a", [1, 2, 3, 4, 5], 5, max_cached_tokens=0)
    bm.mark_computed("a", [1, 2, 3, 4, 5], 5)
    assert bm.allocate("b", [1, 2, 3, 4, 5], 5, max_cached_tokens=4) == 4
    with pytest.raises(ValueError, match="num_computed"):
        bm.mark_computed("b", [1, 2, 3, 4, 5], 2)


@pytest.mark.parametrize(
    ("tokens", "exc"),
    [([1, 2**70, 3, 4], ValueError), ([1, -(2**63) - 1, 3, 4], ValueError), ([1, 2.5, 3, 4], TypeError)],
)
def test_token_ids_must_be_int64(tokens, exc):
    bm = BlockManager(4, 2)
    bm.allocate("a", tokens, 4, max_cached_tokens=0)
    with pytest.raises(exc, match="token_ids"):
        bm.mark_computed("a", tokens, 4)
    mgr = HybridBlockManager(_layout(), 8)
    mgr.allocate("a", tokens, 4, max_cached_tokens=0)
    with pytest.raises(exc, match="token_ids"):
        mgr.mark_computed("a", tokens, 4)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda lay: lay.smalls_per_large(9), ValueError, "group"),
        (lambda lay: lay.smalls_per_large(-1), ValueError, "group"),
        (lambda lay: lay.smalls_per_large(1.0), ValueError, "group"),
        (lambda lay: lay.effective_kind(3), ValueError, "group"),
        (lambda lay: lay.num_large_pages(-1), ValueError, "budget_bytes"),
        (lambda lay: lay.num_large_pages(1.5), TypeError, "budget_bytes"),
        (lambda lay: lay.needed_bytes(-4), ValueError, "num_tokens"),
        (lambda lay: lay.needed_bytes(None), TypeError, "num_tokens"),
        (lambda lay: lay.group_of_layer(1.0), TypeError, "layer"),
        (lambda lay: lay.group_of_layer(True), TypeError, "layer"),
    ],
)
def test_layout_bad_queries(call, exc, match):
    with pytest.raises(exc, match=match):
        call(_layout())


@pytest.mark.parametrize("cap", ["a", 1e12])
def test_layout_bad_max_large_page_bytes(cap):
    with pytest.raises(ValueError, match="max_large_page_bytes"):
        _layout(max_large_page_bytes=cap)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda m: m.block_table_tensor(["r"], 0, max_pages=-1), ValueError, "max_pages"),
        (lambda m: m.block_table_tensor(["r"], 0, max_pages=2.0), TypeError, "max_pages"),
        (lambda m: m.block_table("r", 0, start=-1), ValueError, "start"),
        (lambda m: m.block_table("r", 0, start=None), TypeError, "start"),
    ],
)
def test_hybrid_manager_bad_table_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(_hybrid())
