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


def test_optional_inputs_go_only_to_implementations_that_take_them():
    # devices.accepts decides, for every optional input the callers pass (k_scale, k / v, only_seqs,
    # fp32): an implementation without the parameter is called without it, or replaced by the reference.
    from infercore.devices import accepts, implementation
    from infercore.ops.attention import takes_new_kv
    from infercore.ops.kv_cache import scale_aware

    def old_write(k, v, k_cache, v_cache, slot_mapping):  # written before quantized KV
        raise AssertionError("must not be called with scales")

    def new_write(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
        pass

    assert not accepts(old_write, "k_scale") and accepts(new_write, "k_scale")
    assert not accepts(len, "k_scale")  # a builtin without a readable signature: False, no error
    assert takes_new_kv(implementation("paged_attention_prefill", "triton"))
    assert accepts(implementation("paged_attention_prefill", "triton"), "only_seqs")
    assert not accepts(implementation("paged_attention_prefill", "reference"), "only_seqs")
    import infercore.devices.registry as reg

    op = "write_kv_cache_"
    entry = reg._OPS[op]
    saved = dict(entry.impls)
    try:
        reg.register(op, "legacy", old_write, priority=100, available=lambda cap: True)
        assert scale_aware(op, "cpu") is implementation(op, "reference")
        reg.register(op, "legacy", new_write, priority=100, available=lambda cap: True)
        assert scale_aware(op, "cpu") is new_write
    finally:
        entry.impls.clear()
        entry.impls.update(saved)
        reg._CACHE.clear()
