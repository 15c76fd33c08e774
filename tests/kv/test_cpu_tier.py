"""The CPU tier under the block manager: demotion on reuse, loads on a match, LRU, pinning, quantized pages.

Caches are CPU tensors here (the tier then copies host to host), filled with a pattern that names the
(page, token position) so every test can check that a loaded page holds exactly the bytes demoted.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infercore.kv import (
    BlockManager,
    CPUKVTier,
    FullAttentionSpec,
    allocate_kv_caches,
    hash_pages,
)

PS = 4


def caches(num_pages, kv_cache_dtype=None, layers=2):
    specs = [FullAttentionSpec(num_kv_heads=2, head_dim=8)] * layers
    return allocate_kv_caches(specs, num_pages, PS, dtype=torch.float32, device="cpu", kv_cache_dtype=kv_cache_dtype)


def tensors(kv):
    out = []
    for layer in kv:
        out += [layer[0], layer[1]]
        if hasattr(layer, "k_scale"):
            out += [layer.k_scale, layer.v_scale]
    return out


def fill(kv, page, tokens):
    """Write content that depends on the page's token ids (as real KV does) into every tensor of ``page``."""
    seed = hash(tuple(tokens)) % (2**31)
    g = torch.Generator().manual_seed(seed)
    for t in tensors(kv):
        if t.dtype.is_floating_point:
            t[page] = torch.randn(t[page].shape, generator=g).to(t.dtype)
        else:
            t[page] = torch.randint(-128, 127, t[page].shape, generator=g).to(t.dtype)


def snapshot(kv, page):
    return [t[page].clone() for t in tensors(kv)]


def same(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def setup(num_pages=8, tier_pages=16, kv_cache_dtype=None):
    kv = caches(num_pages, kv_cache_dtype)
    tier = CPUKVTier(kv, tier_pages)
    bm = BlockManager(num_pages, PS, cpu_tier=tier)
    return kv, tier, bm


def run_request(bm, kv, rid, tokens, *, contents=None):
    """Admit ``tokens``, 'compute' the uncached pages (write their pattern), publish, free. Returns the
    cached token count and the request's block table."""
    cached = bm.allocate(rid, tokens, len(tokens), max_cached_tokens=len(tokens) - 1)
    assert cached is not None
    table = bm.block_table(rid)
    for i in range(cached // PS, -(-len(tokens) // PS)):
        fill(kv, table[i], tokens[: (i + 1) * PS])
        if contents is not None and (i + 1) * PS <= len(tokens):
            contents[tuple(tokens[: (i + 1) * PS])] = snapshot(kv, table[i])
    bm.mark_computed(rid, tokens, len(tokens))
    bm.free(rid)
    return cached, table


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_evicted_pages_come_back_with_their_bytes(kv_cache_dtype):
    kv, tier, bm = setup(kv_cache_dtype=kv_cache_dtype)
    contents = {}
    a = list(range(100, 121))  # 5 full pages + 1 token
    run_request(bm, kv, "a1", a, contents=contents)
    assert tier.stats.demoted == 0
    b = list(range(200, 232))  # 8 pages: every page of a is reused, its 5 cached pages demoted first
    run_request(bm, kv, "b", b, contents=contents)
    assert tier.stats.demoted == 5 and len(tier) == 5
    # a again (and more): its 5 full pages come from the tier into fresh device pages
    cached = bm.allocate("a2", a + [7, 7, 7], 24, max_cached_tokens=23)
    assert cached == 20 and bm.cpu_hit_tokens("a2") == 20
    assert bm.stats.cpu_hit_tokens == 20 and bm.stats.hit_tokens == 20
    table = bm.block_table("a2")
    for i in range(5):
        assert same(snapshot(kv, table[i]), contents[tuple(a[: (i + 1) * PS])]), f"page {i} differs"
    # the loaded pages are published on the device: a third request hits them there, not in the tier
    loaded = tier.stats.loaded
    c = bm.allocate("a3", a, 21, max_cached_tokens=20)
    assert c == 20 and bm.cpu_hit_tokens("a3") == 0 and tier.stats.loaded == loaded
    assert bm.block_table("a3")[:5] == table[:5]


def test_quantized_tier_moves_scales_too():
    kv, tier, bm = setup(kv_cache_dtype="int8")
    assert tier.page_bytes == 2 * 2 * PS * 2 * (8 + 4)  # layers * (k, v) * page * heads * (codes + fp32 scale)
    a = list(range(1, 9))
    run_request(bm, kv, "a", a)
    page = bm._cache[hash_pages(a, PS)[0]]
    before = snapshot(kv, page)
    run_request(bm, kv, "b", list(range(50, 82)))  # evicts everything
    for t in tensors(kv):  # scribble over the whole pool: only the tier can give a's bytes back
        t.zero_()
    assert bm.allocate("a2", a, 8, max_cached_tokens=7) == 4
    assert same(snapshot(kv, bm.block_table("a2")[0]), before)


def test_match_continues_from_device_hits_into_the_tier():
    kv, tier, bm = setup(num_pages=8)
    contents = {}
    a = list(range(1, 17))  # 4 pages
    run_request(bm, kv, "a", a, contents=contents)
    # b shares a's first page only and takes 7 more: the pool's 4 free ones, then a's 3 tail pages
    # (freed tail first, so they are the least recently used); a's first page stays on the device
    run_request(bm, kv, "b", a[:4] + list(range(60, 88)))
    assert tier.stats.demoted == 3
    cached = bm.allocate("a2", a + [5], 17, max_cached_tokens=16)
    assert cached == 16
    assert bm.cpu_hit_tokens("a2") == 12  # page 0 on the device, pages 1-3 from the tier
    table = bm.block_table("a2")
    for i in range(4):
        assert same(snapshot(kv, table[i]), contents[tuple(a[: (i + 1) * PS])])


def test_tier_lru_eviction():
    kv, tier, bm = setup(num_pages=3, tier_pages=4)
    a, b, c = list(range(1, 13)), list(range(20, 32)), list(range(40, 52))  # 3 pages each
    run_request(bm, kv, "a", a)
    run_request(bm, kv, "b", b)  # demotes a's 3 pages
    assert len(tier) == 3
    run_request(bm, kv, "c", c)  # demotes b's 3: the tier's 4 slots keep b's 3 and a's most recent one
    assert tier.stats.evicted == 2 and len(tier) == 4
    # a's pages were freed tail first, so its first page was demoted last of a's: it survived
    keys_a = hash_pages(a, PS)
    assert keys_a[0] in tier and keys_a[1] not in tier and keys_a[2] not in tier
    assert bm.match_prefix(a, max_cached_tokens=12) == 4
    assert bm.match_prefix(b, max_cached_tokens=12) == 12
    # a hit makes a slot the most recently used: loading a's first page protects it from the next demotions
    assert bm.allocate("a2", a[:4] + [0], 5, max_cached_tokens=4) == 4
    bm.free("a2")
    run_request(bm, kv, "d", list(range(60, 72)))
    assert keys_a[0] in tier


def test_pinned_slots_are_not_reused_by_the_demotions_of_the_same_admission():
    # a tier of 2 slots: loading a's 2 pages needs 2 device pages, whose demotions must not take a's slots
    kv, tier, bm = setup(num_pages=3, tier_pages=2)
    contents = {}
    a = list(range(1, 9))
    run_request(bm, kv, "a", a, contents=contents)
    run_request(bm, kv, "b", list(range(20, 32)))
    assert len(tier) == 2 and all(k in tier for k in hash_pages(a, PS))
    assert bm.allocate("a2", a + [3], 9, max_cached_tokens=8) == 8
    assert tier.stats.dropped >= 1  # b's pages found every slot pinned
    table = bm.block_table("a2")
    for i in range(2):
        assert same(snapshot(kv, table[i]), contents[tuple(a[: (i + 1) * PS])])


def test_a_pool_short_admission_changes_nothing():
    kv, tier, bm = setup(num_pages=4, tier_pages=8)
    a = list(range(1, 17))
    run_request(bm, kv, "a", a)
    run_request(bm, kv, "b", list(range(30, 46)))
    bm.allocate("hold", list(range(90, 94)), 4, max_cached_tokens=3)  # one page held
    state = (dict(tier._index), tier.stats.loaded, bm.stats.requests)
    assert bm.allocate("a2", a + [1], 17, max_cached_tokens=16) is None  # needs 5 pages, 3 available
    assert (dict(tier._index), tier.stats.loaded, bm.stats.requests) == state
    assert "a2" not in bm


def test_dedup_and_reset():
    kv, tier, bm = setup(num_pages=4, tier_pages=8)
    a = list(range(1, 17))
    run_request(bm, kv, "a", a)
    run_request(bm, kv, "b", list(range(30, 46)))
    assert bm.allocate("a2", a + [1], 16, max_cached_tokens=16) == 16
    bm.free("a2")
    demoted = tier.stats.demoted
    run_request(bm, kv, "c", list(range(60, 76)))  # evicts a's pages again: the tier has them, no copy
    assert tier.stats.deduplicated >= 4 and tier.stats.demoted == demoted
    bm.reset_prefix_cache()
    assert len(tier) == 0 and bm.match_prefix(a, max_cached_tokens=16) == 0


def test_refused_without_prefix_caching_and_bad_arguments():
    kv = caches(4)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        BlockManager(4, PS, enable_prefix_caching=False, cpu_tier=CPUKVTier(kv, 2))
    with pytest.raises(ValueError, match="num_pages"):
        CPUKVTier(kv, 0)
    with pytest.raises(ValueError, match="staging_pages"):
        CPUKVTier(kv, 2, staging_pages=0)
    strided = [(k[:, :, :1], v[:, :, :1]) for k, v in kv]
    with pytest.raises(ValueError, match="contiguous"):
        CPUKVTier(strided, 2)


def test_small_staging_batches_and_host_chunks_copy_the_same_bytes(monkeypatch):
    kv = caches(8)
    tier = CPUKVTier(kv, 16, staging_pages=2)  # 5 pages per direction go in 3 batches
    # slots in chunks of 3 (1 GiB on a real model): runs of consecutive slots are cut at chunk ends
    tier._per_chunk = 3
    tier.host_chunks = [torch.empty((min(3, 16 - a), tier.page_bytes), dtype=torch.uint8) for a in range(0, 16, 3)]
    bm = BlockManager(8, PS, cpu_tier=tier)
    contents = {}
    a = list(range(100, 121))
    run_request(bm, kv, "a", a, contents=contents)
    run_request(bm, kv, "b", list(range(200, 232)))
    assert bm.allocate("a2", a, 21, max_cached_tokens=20) == 20
    table = bm.block_table("a2")
    for i in range(5):
        assert same(snapshot(kv, table[i]), contents[tuple(a[: (i + 1) * PS])])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 5), st.integers(0, 9)), min_size=1, max_size=25),
       st.integers(1, 6))
def test_random_sessions_always_read_back_their_own_bytes(ops, tier_pages):
    """Sessions (one of 6 prefixes, a length in pages, a suffix token) come and go in a pool of 6 pages:
    whatever was cached or loaded, every hit page holds the bytes computed for its prefix, no page leaks."""
    kv = caches(6, layers=1)
    tier = CPUKVTier(kv, tier_pages)
    bm = BlockManager(6, PS, cpu_tier=tier)
    contents = {}
    for n, (base, pages, extra) in enumerate(ops):
        tokens = [base * 50 + i for i in range(pages * PS - 1)] + [extra]
        cached, table = run_request(bm, kv, n, tokens + [1], contents=contents)
        for i in range(cached // PS):
            assert same(snapshot(kv, table[i]), contents[tuple(tokens[: (i + 1) * PS])])
    assert bm.num_free_pages == 6 and len(bm) == 0
    assert len(tier) <= tier_pages and bm.stats.cpu_hit_tokens <= bm.stats.hit_tokens


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["out", "in"]), st.integers(0, 5), st.integers(0, 5)), max_size=30))
def test_flush_regrouping_keeps_the_order_of_copies_that_share_a_page_or_slot(raw):
    """Copies out move ahead of loads only where no page or slot orders them; runs alternate direction."""
    from infercore.kv.cpu_tier import _grouped

    # ("out", page, slot, stamp) / ("in", slot, page, stamp), tagged by position through the stamp
    q = [(k, a, b, i) if k == "out" else (k, b, a, i) for i, (k, a, b) in enumerate(raw)]
    groups = _grouped(q)
    order = [op for _, ops in groups for op in ops]
    assert sorted(order, key=lambda op: op[3]) == q
    assert all(all(op[0] == k for op in ops) and ops for k, ops in groups)
    assert all(a[0] != b[0] for a, b in zip(groups, groups[1:]))

    def page_slot(op):
        return (op[1], op[2]) if op[0] == "out" else (op[2], op[1])

    pos = {op[3]: i for i, op in enumerate(order)}
    for i, a in enumerate(q):
        for b in q[i + 1 :]:
            pa, sa = page_slot(a)
            pb, sb = page_slot(b)
            if pa == pb or sa == sb:
                assert pos[a[3]] < pos[b[3]], (a, b)
    # the pattern a pool-full admission queues (out p -> s, in s' -> p, ...) goes in two runs
    alt = [op for p in range(8) for op in (("out", p, 10 + p, 0), ("in", 20 + p, p, 0))]
    assert [k for k, _ in _grouped(alt)] == ["out", "in"]


def test_same_tokens_under_different_prefixes_are_different_pages():
    # Page 1 of a and b holds the same token ids after different first pages: its KV differs, so the tier
    # must key it by the whole chain, not by its own tokens.
    kv, tier, bm = setup(num_pages=4, tier_pages=8)
    contents = {}
    y = [70, 71, 72, 73]
    a, b = [1, 2, 3, 4] + y, [5, 6, 7, 8] + y
    run_request(bm, kv, "a", a, contents=contents)
    run_request(bm, kv, "b", b, contents=contents)
    run_request(bm, kv, "c", list(range(30, 46)))  # evicts both
    assert tier.stats.demoted == 4
    for rid, tokens in (("a2", a), ("b2", b)):
        assert bm.allocate(rid, tokens + [0], 9, max_cached_tokens=8) == 8
        table = bm.block_table(rid)
        assert same(snapshot(kv, table[1]), contents[tuple(tokens)])
        bm.free(rid)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_cuda_round_trip_through_the_side_stream(kv_cache_dtype):
    """On CUDA: pinned host slots, copies on the tier's stream fenced by launch events. 'Compute' writes
    happen on the compute stream after a long kernel (so a copy that did not wait would read stale
    bytes); every loaded page must hold what was written."""
    specs = [FullAttentionSpec(num_kv_heads=2, head_dim=64)] * 3
    kv = allocate_kv_caches(specs, 16, PS, dtype=torch.bfloat16, device="cuda", kv_cache_dtype=kv_cache_dtype)
    tier = CPUKVTier(kv, 160, staging_pages=4)  # every session fits: cyclic returns thrash a smaller LRU tier
    assert all(c.is_pinned() for c in tier.host_chunks) and tier.stream is not None
    bm = BlockManager(16, PS, cpu_tier=tier)
    busy = torch.randn(4096, 4096, device="cuda")
    expected = {}
    sessions = [[s * 100 + i for i in range(4 * PS * (1 + s % 3) + 1)] for s in range(12)]
    for rnd in range(3):
        for s, tokens in enumerate(sessions):
            rid = (rnd, s)
            cached = bm.allocate(rid, tokens, len(tokens), max_cached_tokens=len(tokens) - 1)
            assert cached is not None
            table = bm.block_table(rid)
            tier.before_forward()
            for _ in range(3):  # the loads' copies are issued; the compute stream is still busy
                busy = busy @ busy / 4096
            for i in range(cached // PS):  # what the 'forward' reads must be what was computed
                got = [t[table[i]].clone() for t in tensors(kv)]
                want = expected[tuple(tokens[: (i + 1) * PS])]
                for g, w in zip(got, want):
                    assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (rnd, s, i)
            for _ in range(3):  # the writes below queue behind this: a copy out that did not wait reads stale bytes
                busy = busy @ busy / 4096
            for i in range(cached // PS, -(-len(tokens) // PS)):
                g = torch.Generator(device="cuda").manual_seed(hash(tuple(tokens[: (i + 1) * PS])) % 2**31)
                for t in tensors(kv):
                    vals = torch.randn(t[table[i]].shape, generator=g, device="cuda") * 4
                    t[table[i]] = vals.to(t.dtype)
                if (i + 1) * PS <= len(tokens):
                    expected[tuple(tokens[: (i + 1) * PS])] = [t[table[i]].clone() for t in tensors(kv)]
            tier.record_launch()
            bm.mark_computed(rid, tokens, len(tokens))
            bm.free(rid)
    torch.cuda.synchronize()
    assert tier.stats.loaded > 20 and tier.stats.demoted > 20
    assert bm.stats.cpu_hit_tokens > 0
