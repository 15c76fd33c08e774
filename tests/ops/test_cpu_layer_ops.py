"""The native layer kernels (ops/cpu_kernels.c through ops.moe.cpu_native) against the references, at the shapes
their code paths branch on: head dims off the 16-lane width, GQA groups, threaded rows and keys, windows."""

import contextlib

import pytest
import torch
from test_attention_ref import build_paged

from infercore.devices import implementation
from infercore.ops import rope_cos_sin_cache
from infercore.ops.moe import cpu_native

torch.manual_seed(0)
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)


def test_the_kernels_build_here():
    # The test machines have gcc with OpenMP: the native paths must be what the other tests exercise.
    assert cpu_native.available(), cpu_native.status()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("T,D", [(1, 576), (3, 37), (40, 64)])
def test_rms_norm(dtype, wdtype, T, D):
    x, r = torch.randn(T, D, dtype=dtype) * 3, torch.randn(T, D, dtype=dtype)
    w = torch.randn(D, dtype=wdtype)
    ref = implementation("rms_norm", "reference")
    for offset in (0.0, 1.0):
        y, none = cpu_native.rms_norm(x, w, 1e-6, offset)
        assert none is None
        torch.testing.assert_close(y, ref(x, w, eps=1e-6, offset=offset), **tol(dtype))
        y, res = cpu_native.rms_norm(x, w, 1e-6, offset, residual=r)
        assert torch.equal(res, x + r)  # the residual sum rounds exactly as torch's add
        torch.testing.assert_close(y, ref(x + r, w, eps=1e-6, offset=offset), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_residual(dtype):
    # callers may hand the residual back as the output buffer's source; aliasing x must still give x + r
    x, r, w = torch.randn(4, 48, dtype=dtype), torch.randn(4, 48, dtype=dtype), torch.randn(48, dtype=dtype)
    want = x + r
    _, res = cpu_native.rms_norm(x, w, 1e-5, 0.0, residual=r)
    assert torch.equal(res, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d", [(1, 1536), (5, 40), (64, 1024)])
def test_silu_and_mul(dtype, T, d):
    x = torch.randn(T, 2 * d, dtype=dtype) * 4
    torch.testing.assert_close(cpu_native.silu_and_mul(x), implementation("silu_and_mul", "reference")(x),
                               **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hk,d", [(1, 9, 3, 64), (7, 4, 4, 24), (33, 8, 2, 128)])
@pytest.mark.parametrize("fused", [False, True])
def test_rope_write_kv_is_exact(dtype, T, hq, hk, d, fused):
    # fused: q / k / v are views of one qkv output row (read in place at its row stride)
    pages, ps = 40, 4
    cache = rope_cos_sin_cache(rotary_dim=d, max_positions=256, base=10000.0)
    if fused:
        q, k, v = torch.randn(T, (hq + 2 * hk) * d, dtype=dtype).split([hq * d, hk * d, hk * d], dim=1)
        q, k, v = q.view(T, hq, d), k.view(T, hk, d), v.view(T, hk, d)
        assert T == 1 or not q.is_contiguous()
    else:
        q, k, v = (torch.randn(T, h, d, dtype=dtype) for h in (hq, hk, hk))
    pos = torch.randint(0, 256, (T,))
    slots = torch.randperm(pages * ps)[:T].to(torch.int32)
    if T > 1:
        slots[T // 2] = -1  # a row whose K/V are not stored
    ref = implementation("rope_and_write_kv", "reference")
    got, want = [], []
    for fn, out in ((None, got), (ref, want)):
        kc, vc = torch.zeros(pages, ps, hk, d, dtype=dtype), torch.zeros(pages, ps, hk, d, dtype=dtype)
        if fn is None:
            qr = cpu_native.rope_write_kv(q, k, v, pos, cache, kc, vc, slots)
        else:
            qr = fn(q, k, v, pos, cache, kc, vc, slots, is_neox=True)
        out += [qr, kc, vc]
    for a, b in zip(got, want):  # the same fp32 products and sums, one rounding: bit for bit
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,hq,hk,d,ps", [
    ([1], 9, 3, 64, 16),             # SmolLM2's heads, one key
    ([700], 9, 3, 64, 16),           # long enough for the threaded path
    ([5, 0, 300, 17], 8, 2, 40, 4),  # an empty sequence; a head dim off the lane width
    ([129, 64], 4, 4, 128, 8),       # no GQA
    ([33, 250], 24, 2, 32, 16),      # a group of 12 (the vector path's generic group loop)
    ([90], 12, 2, 48, 16),           # bf16 head dims of 16 lanes but not 32 (fp32 products, no vdpbf16ps)
    ([70], 32, 1, 16, 8),            # a group of 32: the scalar loops
])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("vector", [True, False])
def test_decode_attention(dtype, lens, hq, hk, d, ps, window, vector):
    # vector: the AVX-512 tiles where the host has them (head dims of a multiple of 16), else the scalar loops
    kc, vc, table, _, _ = build_paged(lens, hk, d, ps, dtype=dtype)  # NaN outside the sequences' keys
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with contextlib.nullcontext() if vector else cpu_native.scalar_attention():
        got = cpu_native.decode_attention(q, kc, vc, seq_lens, table[:, :-1], 0.2, window)  # a strided table view
    want = implementation("paged_attention_decode", "reference")(
        q, kc, vc, seq_lens=seq_lens, block_table=table, scale=0.2, sliding_window=window)
    torch.testing.assert_close(got, want, **tol(dtype))
    assert not got[torch.tensor(lens) == 0].any()


@pytest.mark.parametrize("threads", [3, 4])
@pytest.mark.parametrize("window", [None, 300])
def test_decode_attention_key_splits(threads, window, monkeypatch):
    # Few KV heads for the threads: each (sequence, KV head)'s keys in parts, merged after; a part may be empty (the
    # window), and a sequence of length 0 in the batch still gets zeros
    lens, hq, hk, d = [1000, 0], 6, 1, 64
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert cpu_native.attention_splits(len(lens), hk, d, hq // hk, max(lens)) > 1
    assert cpu_native.attention_splits(len(lens), hk, d, hq // hk, 300) == 1  # parts of >= 256 keys
    assert cpu_native.attention_splits(len(lens), threads, d, hq // hk, max(lens)) == 1  # a unit a thread
    with cpu_native.unsplit_attention():
        assert cpu_native.attention_splits(len(lens), hk, d, hq // hk, max(lens)) == 1
    kc, vc, table, _, _ = build_paged(lens, hk, d, 16, dtype=torch.bfloat16)
    q = torch.randn(len(lens), hq, d, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = cpu_native.decode_attention(q, kc, vc, seq_lens, table, 0.2, window)
    want = implementation("paged_attention_decode", "reference")(
        q, kc, vc, seq_lens=seq_lens, block_table=table, scale=0.2, sliding_window=window)
    torch.testing.assert_close(got, want, **tol(torch.bfloat16))
    assert not got[1].any()


def test_ops_take_the_native_path_only_where_it_applies():
    # fp16 (no native kernel): the ATen paths, same results as the reference
    x, w = torch.randn(3, 32, dtype=torch.float16), torch.randn(32, dtype=torch.float16)
    fast = implementation("rms_norm", "cpu")
    torch.testing.assert_close(fast(x, w, eps=1e-6), implementation("rms_norm", "reference")(x, w, eps=1e-6),
                               atol=2e-3, rtol=2e-3)
    assert not cpu_native.layer_ops_apply(x)
    assert not cpu_native.layer_ops_apply(torch.randn(2), torch.randn(2, dtype=torch.bfloat16))
    with cpu_native.disabled():
        assert not cpu_native.layer_ops_apply(torch.randn(2))
    with cpu_native.layer_ops_disabled():
        assert not cpu_native.layer_ops_apply(torch.randn(2)) and cpu_native.available()
    assert cpu_native.layer_ops_apply(torch.randn(2))


def test_out_of_range_indices_raise_before_touching_memory():
    # An index the caches cannot hold is an IndexError naming it, as ATen's index_copy_ / index_select raise, not a
    # write or read past the buffers; nothing is written first.
    T, hq, hk, d = 3, 4, 2, 16
    cache = rope_cos_sin_cache(rotary_dim=d, max_positions=8, base=10000.0)
    q, k, v = (torch.randn(T, h, d) for h in (hq, hk, hk))
    kc, vc = torch.zeros(2, 4, hk, d), torch.zeros(2, 4, hk, d)
    with pytest.raises(IndexError, match=r"slot_mapping\[2\] = 8 is outside the cache's 8 slots"):
        cpu_native.rope_write_kv(q, k, v, torch.tensor([0, 1, 2]), cache, kc, vc, torch.tensor([0, 1, 8]).int())
    with pytest.raises(IndexError, match=r"positions\[1\] = 8 is outside the rotary table's 8 positions"):
        cpu_native.rope_write_kv(q, k, v, torch.tensor([0, 8, 2]), cache, kc, vc, torch.tensor([0, 1, 2]).int())
    assert not kc.any() and not vc.any()
    fast = implementation("rope_and_write_kv", "cpu")  # through the op's CPU path too
    with pytest.raises(IndexError, match="slot_mapping"):
        fast(q, k, v, torch.tensor([0, 1, 2]), cache, kc, vc, torch.tensor([0, 1, 9]).int(), is_neox=True)

    qd = torch.randn(2, hq, d)
    table = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    with pytest.raises(IndexError, match=r"seq_lens\[1\] = 9 needs more than the 2 pages of block_table row 1"):
        cpu_native.decode_attention(qd, kc, vc, torch.tensor([3, 9]).int(), table, 0.25, None)
    with pytest.raises(IndexError, match="block_table row 0 names a page outside the cache's 2 pages"):
        cpu_native.decode_attention(qd, kc, vc, torch.tensor([6, 2]).int(), torch.tensor([[0, 2], [1, 0]]).int(),
                                    0.25, None)
    # a window that skips the bad page reads only valid ones
    out = cpu_native.decode_attention(qd, kc, vc, torch.tensor([6, 2]).int(), torch.tensor([[-1, 0], [1, 0]]).int(),
                                      0.25, 2)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,hq,hk,d,window,threads", [
    ([5, 0, 300, 17], 8, 2, 64, None, 2),  # an empty sequence, GQA
    ([700], 9, 3, 64, 50, 2),               # a window
    ([1000], 6, 1, 32, None, 4),            # key splits
    ([129, 64], 4, 4, 128, None, 2),        # no GQA
])
def test_decode_attention_reads_1_byte_caches(kv, dtype, lens, hq, hk, d, window, threads, monkeypatch):
    # int8 / fp8 code caches with fp32 scales per (slot, KV head), read as they are by the vector path, against the
    # reference over the same codes; also through the op's CPU implementation
    from infercore.ops.kv_cache.quant import quantize_kv_ref

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    kf, vf, table, _, _ = build_paged(lens, hk, d, 16, dtype=torch.float32)  # NaN outside the sequences' keys
    (kc, ks), (vc, vs) = (quantize_kv_ref(c.nan_to_num(), kv) for c in (kf, vf))
    ks, vs = ks.reshape(kc.shape[:3]), vs.reshape(kc.shape[:3])
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = cpu_native.decode_attention(q, kc, vc, seq_lens, table, 0.2, window, ks, vs)
    kw = dict(seq_lens=seq_lens, block_table=table, scale=0.2, sliding_window=window, k_scale=ks, v_scale=vs)
    want = implementation("paged_attention_decode", "reference")(q, kc, vc, **kw)
    torch.testing.assert_close(got, want, **tol(dtype))
    assert not got[torch.tensor(lens) == 0].any()
    torch.testing.assert_close(implementation("paged_attention_decode", "cpu")(q, kc, vc, **kw), got, rtol=0, atol=0)
    # a head dim off the 16 lanes (d - 8): nothing read, the op's CPU path falls back to its SDPA loop
    q40 = torch.randn(len(lens), hq, d - 8, dtype=dtype)
    kc40, vc40 = kc[..., : d - 8].contiguous(), vc[..., : d - 8].contiguous()
    assert cpu_native.decode_attention(q40, kc40, vc40, seq_lens, table, 0.2, window, ks, vs) is None
    kw40 = dict(kw)
    torch.testing.assert_close(implementation("paged_attention_decode", "cpu")(q40, kc40, vc40, **kw40),
                               implementation("paged_attention_decode", "reference")(q40, kc40, vc40, **kw40),
                               **tol(dtype))


def test_decode_attention_scales_checked():
    kc, vc = torch.zeros(4, 16, 2, 64, dtype=torch.int8), torch.zeros(4, 16, 2, 64, dtype=torch.int8)
    ks, q = torch.ones(4, 16, 2), torch.randn(1, 4, 64)
    args = (q, kc, vc, torch.tensor([5], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), 0.1, None)
    with pytest.raises(ValueError, match="go together"):
        cpu_native.decode_attention(*args, ks, None)
    with pytest.raises(ValueError, match=r"must be \(4, 16, 2\)"):
        cpu_native.decode_attention(*args, ks, ks[:, :8])
    with pytest.raises(TypeError, match="int8 or float8_e4m3fn"):
        cpu_native.decode_attention(q, kc.float(), vc.float(), *args[3:], ks, ks)
    assert torch.isfinite(cpu_native.decode_attention(*args, ks, ks)).all()
