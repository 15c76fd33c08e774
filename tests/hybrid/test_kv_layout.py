"""Hybrid KV layout: small/large page sizes in multi and uniform mode, specs as data."""

from __future__ import annotations

import math

import pytest
import torch

from infercore.kv import FullAttentionSpec
from infercore.kv.hybrid import HybridKVLayout, LinearStateSpec, SlidingWindowSpec, normalize_spec, spec_kind

GDN = LinearStateSpec((8192, 3), (32, 128, 128), conv_dtype=torch.bfloat16, recurrent_dtype=torch.float32)


def test_multi_large_page_is_lcm_of_small_pages():
    specs = ([SlidingWindowSpec(8, 128, 1024)] * 5 + [FullAttentionSpec(8, 128)]) * 8
    lay = HybridKVLayout.build(specs, page_tokens=16)
    sliding, full = lay.groups
    assert (sliding.kind, full.kind) == ("sliding", "full")
    assert sliding.layers == tuple(i for i in range(48) if i % 6 != 5)
    per_token = 2 * 8 * 128 * 2
    assert sliding.small_bytes == 40 * 16 * per_token and full.small_bytes == 8 * 16 * per_token
    assert lay.large_bytes == math.lcm(sliding.small_bytes, full.small_bytes)
    assert (lay.smalls_per_large(0), lay.smalls_per_large(1)) == (1, 5)


def test_multi_pads_only_when_the_lcm_is_too_large():
    specs = [GDN] * 3 + [FullAttentionSpec(2, 256)]
    lay = HybridKVLayout.build(specs, page_tokens=16)
    assert all(g.small_bytes == g.useful_bytes for g in lay.groups)  # LCM fits the default cap
    cap = 3 * max(g.small_bytes for g in lay.groups) // 2  # the natural LCM is 2x the state page
    capped = HybridKVLayout.build(specs, page_tokens=16, max_large_page_bytes=cap)
    assert capped.large_bytes <= cap < lay.large_bytes
    for g in capped.groups:
        assert capped.large_bytes % g.small_bytes == 0
        assert g.small_bytes >= g.useful_bytes
    padded = sum(g.small_bytes - g.useful_bytes for g in capped.groups)
    assert padded / sum(g.small_bytes for g in capped.groups) < 0.01
    with pytest.raises(ValueError, match="max_large_page_bytes"):
        HybridKVLayout.build(specs, max_large_page_bytes=1024)


def test_uniform_inflates_token_pages_to_hold_a_state():
    specs = [GDN] * 3 + [FullAttentionSpec(2, 256)]
    lay = HybridKVLayout.build(specs, page_tokens=16, mode="uniform")
    state = GDN.conv_bytes + GDN.recurrent_bytes
    per_token = 2 * 2 * 256 * 2
    assert lay.page_tokens % 16 == 0 and lay.page_tokens * per_token >= state
    assert (lay.page_tokens - 16) * per_token < state  # the smallest such multiple
    stride = lay.groups[0].layer_stride
    assert all(g.layer_stride == stride for g in lay.groups)  # one page size for every layer
    assert lay.effective_kind(0) == "linear"
    sw = HybridKVLayout.build([SlidingWindowSpec(1, 8, 4), FullAttentionSpec(1, 8)], mode="uniform")
    assert sw.effective_kind(0) == "full" and sw.page_tokens == 16


def test_needed_bytes_and_checkpoint_interval():
    specs = [SlidingWindowSpec(1, 8, 100), LinearStateSpec(None, (4,)), FullAttentionSpec(1, 8)]
    lay = HybridKVLayout.build(specs, page_tokens=4, dtype=torch.float32)
    assert lay.needed_bytes(1000) == 1000 * 64 + 100 * 64 + 16
    assert lay.checkpoint_interval == 4  # a 16-byte state is lighter than a page of KV
    heavy = HybridKVLayout.build([GDN, FullAttentionSpec(2, 256)], page_tokens=16)
    kv_page = 16 * 2 * 2 * 256 * 2
    assert heavy.checkpoint_interval == 16 * math.ceil((GDN.conv_bytes + GDN.recurrent_bytes) / kv_page)


def test_specs_validate_and_normalize():
    assert normalize_spec(FullAttentionSpec(2, 64, sliding_window=512)) == SlidingWindowSpec(2, 64, 512)
    assert spec_kind(FullAttentionSpec(2, 64)) == "full" and spec_kind(GDN) == "linear"
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(2, 64, 0)
    with pytest.raises(TypeError, match="recurrent_state_shape"):
        LinearStateSpec((4, 3), [4, 4])
    with pytest.raises(TypeError, match="specs\\[1\\]"):
        HybridKVLayout.build([FullAttentionSpec(1, 8), "mamba"])
    with pytest.raises(ValueError, match="mode"):
        HybridKVLayout.build([FullAttentionSpec(1, 8)], mode="jenga")
    with pytest.raises(ValueError, match="checkpoint_interval"):
        HybridKVLayout.build([GDN, FullAttentionSpec(1, 8)], page_tokens=16, checkpoint_interval=20)
