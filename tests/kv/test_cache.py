"""KV cache tensor allocation, page budgets and specs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from infercore.kv import (
    BlockManager,
    FullAttentionSpec,
    allocate_kv_caches,
    bytes_per_page,
    hash_pages,
    pages_for_budget,
    root_hash,
)

SPECS = [FullAttentionSpec(2, 8), FullAttentionSpec(4, 16, sliding_window=32)]


def test_shapes_dtypes_and_zero_fill() -> None:
    caches = allocate_kv_caches(SPECS, 5, 4, dtype=torch.float16, device="cpu")
    assert len(caches) == 2
    for (k, v), spec in zip(caches, SPECS):
        for t in (k, v):
            assert t.shape == (5, 4, spec.num_kv_heads, spec.head_dim)
            assert t.dtype == torch.float16 and t.device.type == "cpu"
            assert t.is_contiguous() and not t.any()
        assert k.data_ptr() != v.data_ptr()


def test_per_layer_dtype_override_and_bytes() -> None:
    specs = [FullAttentionSpec(2, 8), FullAttentionSpec(1, 4, dtype=torch.float32)]
    caches = allocate_kv_caches(specs, 3, 2, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert [k.dtype for k, _ in caches] == [torch.bfloat16, torch.float32]
    # 2 (k and v) * page_size * Hk * D * itemsize, summed over layers.
    expected = 2 * 2 * 2 * 8 * 2 + 2 * 2 * 1 * 4 * 4
    assert (
        bytes_per_page(specs, 2, torch.bfloat16) == expected == bytes_per_page(specs, 2, dtype=torch.bfloat16)
    )
    allocated = sum(k.nbytes + v.nbytes for k, v in caches)
    assert allocated == 3 * expected


def test_pages_for_budget() -> None:
    per_page = bytes_per_page(SPECS, 16, dtype=torch.float16)
    assert per_page == 2 * 16 * (2 * 8 + 4 * 16) * 2
    assert pages_for_budget(SPECS, 16, dtype=torch.float16, budget_bytes=10 * per_page) == 10
    assert pages_for_budget(SPECS, 16, dtype=torch.float16, budget_bytes=10 * per_page - 1) == 9
    assert pages_for_budget(SPECS, 16, dtype=torch.float16, budget_bytes=0) == 0
    # fp8 pages are half the size of fp16 ones.
    assert pages_for_budget(SPECS, 16, dtype=torch.float8_e4m3fn, budget_bytes=10 * per_page) == 20


def test_duck_typed_specs() -> None:
    @dataclass
    class Spec:
        num_kv_heads: int
        head_dim: int

    ((k, v),) = allocate_kv_caches([Spec(3, 2)], 2, 2, dtype=torch.float32, device="cpu")
    assert k.shape == (2, 2, 3, 2)


def test_validation() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        allocate_kv_caches(SPECS, 0, 4, dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="page_size"):
        allocate_kv_caches(SPECS, 4, 0, dtype=torch.float16, device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        allocate_kv_caches(SPECS, 4, 4, dtype="float16", device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="specs"):
        allocate_kv_caches([], 4, 4, dtype=torch.float16, device="cpu")
    with pytest.raises(TypeError, match=r"specs\[1\]"):
        allocate_kv_caches([SPECS[0], object()], 4, 4, dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="budget_bytes"):
        pages_for_budget(SPECS, 4, dtype=torch.float16, budget_bytes=-1)
    with pytest.raises(ValueError, match="page_size"):
        bytes_per_page(SPECS, -2, dtype=torch.float16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        FullAttentionSpec(0, 8)
    with pytest.raises(ValueError, match="head_dim"):
        FullAttentionSpec(2, -8)
    with pytest.raises(ValueError, match="sliding_window"):
        FullAttentionSpec(2, 8, sliding_window=0)
    with pytest.raises(TypeError, match="dtype"):
        FullAttentionSpec(2, 8, dtype="bf16")  # type: ignore[arg-type]


def test_slots_address_the_cache_layout() -> None:
    """Slots from the block manager index rows of the flattened ``[num_pages * page_size]`` view."""
    page_size, hk, d = 4, 2, 3
    ((k_cache, _),) = allocate_kv_caches(
        [FullAttentionSpec(hk, d)], 6, page_size, dtype=torch.float32, device="cpu"
    )
    bm = BlockManager(6, page_size)
    bm.allocate("pad", [0], 5, max_cached_tokens=0)  # so "a" does not start at page 0
    bm.allocate("a", list(range(7)), 7, max_cached_tokens=6)
    k = torch.randn(7, hk, d)
    slots = torch.tensor(bm.slot_mapping("a", 0, 7), dtype=torch.int64)
    k_cache.view(-1, hk, d)[slots] = k
    table = bm.block_table("a")
    for pos in range(7):
        torch.testing.assert_close(k_cache[table[pos // page_size], pos % page_size], k[pos])


def test_hash_chain_commits_to_whole_prefix() -> None:
    a = hash_pages([1, 2, 3, 4, 5], 2)
    assert len(a) == 2
    assert hash_pages([1, 2, 3, 4], 2, num_pages=1) == a[:1]
    # Same second page, different first page: different key for page 1.
    assert hash_pages([9, 2, 3, 4], 2)[1] != a[1]
    # A salt changes every key.
    assert hash_pages([1, 2, 3, 4], 2, parent=root_hash(b"lora-1"))[0] != a[0]
    # Page boundaries matter: [1, 2] + [3, 4] is not [1] + [2] + ...
    assert hash_pages([1, 2, 3, 4], 1)[1] != a[0]
