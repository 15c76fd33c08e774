import pytest
import torch

from infercore.ops import write_kv_cache_


def _caches(num_pages=6, page_size=4, hk=2, d=8, dtype=torch.float32):
    k_cache = torch.full((num_pages, page_size, hk, d), -7.0, dtype=dtype)
    return k_cache, k_cache.clone() - 1


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_scatters_and_skips(cache_dtype):
    torch.manual_seed(0)
    k_cache, v_cache = _caches(dtype=cache_dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    t = 7
    k, v = torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    slots = torch.tensor([5, 0, -1, 23, 9, -1, 12], dtype=torch.int32)
    write_kv_cache_(k, v, k_cache, v_cache, slots)
    written = set()
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        page, off = divmod(s, 4)
        assert torch.equal(k_cache[page, off], k[i].to(cache_dtype))
        assert torch.equal(v_cache[page, off], v[i].to(cache_dtype))
        written.add(s)
    flat_k, flat_k0 = k_cache.view(-1, 2, 8), k0.view(-1, 2, 8)
    flat_v, flat_v0 = v_cache.view(-1, 2, 8), v0.view(-1, 2, 8)
    for s in range(24):
        if s not in written:
            assert torch.equal(flat_k[s], flat_k0[s]) and torch.equal(flat_v[s], flat_v0[s])


def test_write_kv_cache_errors_name_the_argument():
    k_cache, v_cache = _caches()
    k = torch.randn(3, 2, 8)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="write_kv_cache_: slot_mapping"):
        write_kv_cache_(k, k, k_cache, v_cache, slots.long())
    with pytest.raises(ValueError, match="write_kv_cache_: slot_mapping"):
        write_kv_cache_(k, k, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="write_kv_cache_: v"):
        write_kv_cache_(k, k[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="write_kv_cache_: k_cache"):
        write_kv_cache_(torch.randn(3, 2, 4), torch.randn(3, 2, 4), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="write_kv_cache_: k_cache"):
        write_kv_cache_(k, k, k_cache[0], v_cache[0], slots)
    with pytest.raises(ValueError, match="write_kv_cache_: v_cache"):
        write_kv_cache_(k, k, k_cache, v_cache[:3], slots)
    strided_d = torch.zeros(6, 4, 8, 2).transpose(2, 3)  # [6, 4, 2, 8] with head_dim stride 2
    with pytest.raises(ValueError, match="contiguous head_dim"):
        write_kv_cache_(k, k, strided_d, strided_d.clone().transpose(2, 3).transpose(2, 3), slots)
    with pytest.raises(TypeError, match="write_kv_cache_: k"):
        write_kv_cache_(k.int(), k, k_cache, v_cache, slots)
