"""Triton RoPE, KV-cache write and the fused RoPE + cache write, against the references (CPU interpreter)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops.rope import fused as rope_fused  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


def _cache(max_pos, rot, dtype=torch.float32):
    return infercore.ops.rope_cos_sin_cache(rotary_dim=rot, max_positions=max_pos, base=10000.0, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [32, 16])  # 16: partial rotary on head_dim 32
def test_apply_rope(dtype, is_neox, rot):
    T, Hq, Hk, D = 5, 4, 2, 32
    q = torch.randn(T, Hq, D, dtype=dtype)
    k = torch.randn(T, Hk, D, dtype=dtype)
    pos = torch.randint(0, 64, (T,), dtype=torch.int64)
    cache = _cache(64, rot)
    got_q, got_k = implementation("apply_rope", "triton")(q, k, pos, cache, is_neox=is_neox)
    want_q, want_k = implementation("apply_rope", "reference")(q, k, pos, cache, is_neox=is_neox)
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_k, want_k, atol=TOL[dtype], rtol=TOL[dtype])


def test_write_kv_cache_casts_and_skips():
    T, Hk, D, page = 6, 2, 24, 8
    k, v = torch.randn(T, Hk, D), torch.randn(T, Hk, D)
    slots = torch.tensor([3, 17, -1, 8, 30, 0], dtype=torch.int32)
    kc = torch.full((4, page, Hk, D), 7.0, dtype=torch.float16)  # sentinel: untouched slots stay 7
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    implementation("write_kv_cache_", "triton")(k, v, kc, vc, slots)
    implementation("write_kv_cache_", "reference")(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox,rot", [(True, 32), (False, 16)])
def test_rope_and_write_kv(dtype, is_neox, rot):
    T, Hq, Hk, D, page = 7, 6, 2, 32, 8
    q = torch.randn(T, Hq, D, dtype=dtype)
    k = torch.randn(T, Hk, D, dtype=dtype)
    v = torch.randn(T, Hk, D, dtype=dtype)
    pos = torch.randint(0, 40, (T,), dtype=torch.int32)
    cache = _cache(40, rot)
    slots = torch.tensor([5, 6, -1, 20, 31, 2, 9], dtype=torch.int32)
    kc = torch.full((4, page, Hk, D), -3.0, dtype=dtype)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got_q = implementation("rope_and_write_kv", "triton")(q, k, v, pos, cache, kc, vc, slots, is_neox=is_neox)
    want_q = implementation("rope_and_write_kv", "reference")(
        q, k, v, pos, cache, kc_ref, vc_ref, slots, is_neox=is_neox
    )
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(kc, kc_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(vc, vc_ref)
    assert (kc.view(-1, Hk, D)[[0, 1, 3]] == -3.0).all(), "unmapped slots must stay untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox,rot", [(True, 32), (False, 16)])
def test_rope_and_write_kv_returns_the_rotated_k(dtype, is_neox, rot):
    """return_k: one kernel rotates q and k, keeps the rotated k and writes the caches (a prefill that reads this
    step's K/V from contiguous tensors), as apply_rope then write_kv_cache_ would."""
    T, Hq, Hk, D, page = 7, 6, 2, 32, 8
    q, k, v = (torch.randn(T, h, D, dtype=dtype) for h in (Hq, Hk, Hk))
    pos = torch.randint(0, 40, (T,), dtype=torch.int32)
    cache = _cache(40, rot)
    slots = torch.tensor([5, 6, -1, 20, 31, 2, 9], dtype=torch.int32)
    kc = torch.full((4, page, Hk, D), -3.0, dtype=dtype)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    got_q, got_k = implementation("rope_and_write_kv", "triton")(q, k, v, pos, cache, kc, vc, slots, is_neox=is_neox,
                                                                return_k=True)
    want_q, want_k = implementation("apply_rope", "reference")(q, k, pos, cache, is_neox=is_neox)
    implementation("write_kv_cache_", "reference")(want_k, v, kc_ref, vc_ref, slots)
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_k, want_k, atol=TOL[dtype], rtol=TOL[dtype])  # the row not cached (-1) too
    torch.testing.assert_close(kc, kc_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(vc, vc_ref)
    ref_q, ref_k = implementation("rope_and_write_kv", "reference")(q, k, v, pos, cache, kc_ref.clone(), vc_ref.clone(),
                                                                   slots, is_neox=is_neox, return_k=True)
    assert torch.equal(ref_q, want_q) and torch.equal(ref_k, want_k)


def test_rope_and_write_kv_validates():
    q = torch.randn(3, 2, 16)
    k = v = torch.randn(3, 1, 16)
    kc = torch.zeros(2, 8, 1, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_fused.rope_and_write_kv_cache_(
            q, k, v, torch.arange(3), _cache(8, 16), kc, kc.clone(), torch.zeros(2, dtype=torch.int32)
        )
