"""Attention sinks (GPT-OSS: a learned per-head logit in each softmax's denominator, no value) in the paged
attention ops: every implementation (reference, CPU, Triton under the interpreter) against a plain computation
written here (scores with one more column holding the sink, softmax, the column dropped), fp32 and fp16; the
public wrappers' checks; bf16 kernels at real shapes under the ``gpu`` marker."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops import AttentionMetadata, paged_attention, paged_attention_decode, paged_attention_prefill  # noqa: E402
from infercore.ops.attention import rope_write_decode_attention, sinks_kw  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
IMPLS = ["reference", "cpu", "triton"]


def _paged_kv(seq_lens, hk, d, page, dtype, gen):
    """Random caches with shuffled pages; unused slots hold large values (a read of one shows)."""
    per_seq = max(-(-max(seq_lens) // page), 1) + 1
    num_pages = len(seq_lens) * per_seq + 3
    k_cache = torch.randn(num_pages, page, hk, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page, hk, d, generator=gen).to(dtype)
    table = torch.randperm(num_pages, generator=gen)[: len(seq_lens) * per_seq].view(len(seq_lens), per_seq)
    return k_cache, v_cache, table.to(torch.int32).contiguous()


def _sinks(hq, gen):
    # spread so that some heads' sinks dominate their rows and others barely count
    return (torch.randn(hq, generator=gen) * 2.0).float()


def _want(q, k_cache, v_cache, table, q_pos, seq_len, b, *, scale, window, softcap, sinks):
    """fp32 ``[M, Hq, D]`` for queries ``q [M, Hq, D]`` at positions ``q_pos`` of sequence ``b``: keys 0 .. seq_len - 1
    gathered one by one, ``softmax([scores | sink])`` without the sink's column, times V."""
    page, hk = k_cache.shape[1], k_cache.shape[2]
    hq = q.shape[1]
    pos = torch.arange(seq_len)
    rows = table[b, pos // page].long()
    keys = k_cache[rows, pos % page].float().repeat_interleave(hq // hk, dim=1)  # [L, Hq, D]
    vals = v_cache[rows, pos % page].float().repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("mhd,lhd->hml", q.float(), keys) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    visible = pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~visible, float("-inf"))
    col = sinks.view(hq, 1, 1).expand(hq, s.shape[1], 1)
    p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hml,lhd->mhd", p, vals)


DECODE_CASES = [
    # seq_lens, Hq, Hk, D, page, window, softcap, num_splits (Triton)
    ([5, 40, 1, 0], 4, 2, 32, 8, None, None, 1),  # ragged batch + an empty (padding) row
    ([33, 70], 8, 2, 16, 16, 16, None, 3),  # GQA 4, sliding window, split-K
    ([50, 17, 3], 4, 1, 16, 4, None, None, 4),  # split-K past the shortest sequences' keys
    ([64, 9], 4, 1, 32, 32, 7, 5.0, 2),  # window + softcap, split
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_with_sinks(impl, dtype, case):
    lens, hq, hk, d, page, window, softcap, splits = case
    gen = torch.Generator().manual_seed(len(lens) * 7 + hq)
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, dtype, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    sinks = _sinks(hq, gen)
    kw = dict(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=d**-0.5,
              sliding_window=window, softcap=softcap, sinks=sinks)  # fmt: skip
    extra = {"num_splits": splits} if impl == "triton" else {}
    got = implementation("paged_attention_decode", impl)(q, k_cache, v_cache, **kw, **extra)
    assert got.dtype == dtype
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))
            continue
        want = _want(q[b : b + 1], k_cache, v_cache, table, torch.tensor([n - 1]), n, b, scale=d**-0.5, window=window,
                     softcap=softcap, sinks=sinks)  # fmt: skip
        torch.testing.assert_close(got[b].float(), want[0], atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_decode_split_counts_agree_with_sinks():
    """The sink enters once whatever the split count (merge kernel with splits, decode kernel without)."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, table = _paged_kv([61, 23], 2, 16, 8, torch.float32, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    sinks = _sinks(4, gen)
    kw = dict(seq_lens=torch.tensor([61, 23], dtype=torch.int32), block_table=table, scale=0.25, sinks=sinks)
    fn = implementation("paged_attention_decode", "triton")
    one = fn(q, k_cache, v_cache, num_splits=1, **kw)
    no_sink = fn(q, k_cache, v_cache, num_splits=1, seq_lens=kw["seq_lens"], block_table=table, scale=0.25)
    assert (one - no_sink).abs().max() > 1e-2  # the sinks change the result
    for splits in (2, 5, 8):
        torch.testing.assert_close(fn(q, k_cache, v_cache, num_splits=splits, **kw), one, atol=1e-5, rtol=1e-5)


PREFILL_CASES = [
    # q_lens, seq_lens, Hq, Hk, D, page, window, softcap
    ([5, 20, 1], [5, 40, 9], 4, 2, 32, 8, None, None),  # fresh prompt, chunk after a cached prefix, one-query row
    ([33, 7], [70, 7], 4, 1, 16, 16, 10, None),  # GQA 4, chunked prefill with a window
    ([17, 0, 3], [50, 4, 3], 2, 2, 16, 4, 6, 20.0),  # empty query row, window + softcap
]


# (the CPU implementation takes no contiguous k / v: it reads every key from the cache)
@pytest.mark.parametrize("impl, new_kv", [(i, n) for i in IMPLS for n in (False, True) if not (n and i == "cpu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_with_sinks(impl, dtype, case, new_kv):
    fn = implementation("paged_attention_prefill", impl)
    q_lens, lens, hq, hk, d, page, window, softcap = case
    gen = torch.Generator().manual_seed(sum(lens))
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, dtype, gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    sinks = _sinks(hq, gen)
    cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    kw = dict(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
              block_table=table, scale=d**-0.5, sliding_window=window, softcap=softcap, max_seqlen_q=max(q_lens),
              sinks=sinks)  # fmt: skip
    if new_kv:  # this step's K/V also given contiguously (the same values the cache holds)
        rows = [(b, p) for b, (ql, n) in enumerate(zip(q_lens, lens)) for p in range(n - ql, n)]
        idx = (torch.tensor([table[b, p // page] for b, p in rows]).long(), torch.tensor([p % page for _, p in rows]))
        kw.update(k=k_cache[idx].contiguous(), v=v_cache[idx].contiguous())
    got = fn(q, k_cache, v_cache, **kw)
    assert got.dtype == dtype
    for b, (ql, n) in enumerate(zip(q_lens, lens)):
        if ql == 0:
            continue
        want = _want(q[cu[b] : cu[b + 1]], k_cache, v_cache, table, torch.arange(n - ql, n), n, b, scale=d**-0.5,
                     window=window, softcap=softcap, sinks=sinks)  # fmt: skip
        torch.testing.assert_close(got[cu[b] : cu[b + 1]].float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_prefill_only_seqs_with_sinks():
    """A mixed step's prefill sequences alone (the decodes left to the decode kernel) take the sinks too."""
    gen = torch.Generator().manual_seed(5)
    q_lens, lens = [1, 12, 1], [9, 30, 17]
    k_cache, v_cache, table = _paged_kv(lens, 2, 16, 8, torch.float32, gen)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen)
    sinks = _sinks(4, gen)
    kw = dict(cu_seqlens_q=torch.tensor([0, 1, 13, 14], dtype=torch.int32), block_table=table, scale=0.25,
              seq_lens=torch.tensor(lens, dtype=torch.int32), sinks=sinks)  # fmt: skip
    want = implementation("paged_attention_prefill", "reference")(q, k_cache, v_cache, **kw)
    got = implementation("paged_attention_prefill", "triton")(q, k_cache, v_cache, only_seqs=torch.tensor(
        [1], dtype=torch.int32), **kw)  # fmt: skip
    torch.testing.assert_close(got[1:13], want[1:13], atol=2e-5, rtol=2e-5)


def test_public_ops_with_sinks_on_the_cpu():
    """paged_attention (prefill then decode steps) through the CPU dispatch equals the reference; int8 caches
    with sinks take the CPU implementation's dequantizing path (not the native one, which has no sinks)."""
    gen = torch.Generator().manual_seed(11)
    lens, hq, hk, d, page = [13, 6], 4, 2, 16, 4
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, torch.float32, gen)
    sinks = _sinks(hq, gen)
    tables = [table[b].tolist() for b in range(2)]
    ref_pre = implementation("paged_attention_prefill", "reference")
    ref_dec = implementation("paged_attention_decode", "reference")
    # a chunk of 5 after a cached prefix, and a fresh prompt
    meta = AttentionMetadata.from_lists(query_lens=[5, 6], seq_lens=lens, block_tables=tables, slot_mapping=[0] * 11)
    q = torch.randn(11, hq, d, generator=gen)
    got = paged_attention(q, k_cache, v_cache, meta, scale=0.25, sliding_window=4, sinks=sinks)
    want = ref_pre(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens, block_table=table,
                   scale=0.25, sliding_window=4, sinks=sinks)  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    meta = AttentionMetadata.from_lists(query_lens=[1, 1], seq_lens=lens, block_tables=tables, slot_mapping=[0, 0])
    q = torch.randn(2, hq, d, generator=gen)
    got = paged_attention(q, k_cache, v_cache, meta, scale=0.25, sinks=sinks)
    want = ref_dec(q, k_cache, v_cache, seq_lens=meta.seq_lens, block_table=table, scale=0.25, sinks=sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # int8 codes with per-(token, head) scales
    kq, vq = (torch.randint(-127, 128, k_cache.shape, generator=gen, dtype=torch.int8) for _ in range(2))
    ks, vs = (torch.rand(k_cache.shape[:3], generator=gen) * 0.02 + 0.01 for _ in range(2))
    got = paged_attention_decode(q, kq, vq, seq_lens=meta.seq_lens, block_table=table, scale=0.25, k_scale=ks,
                                 v_scale=vs, sinks=sinks)  # fmt: skip
    want = ref_dec(q, kq.float() * ks[..., None], vq.float() * vs[..., None], seq_lens=meta.seq_lens, block_table=table,
                   scale=0.25, sinks=sinks)  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_int8_cache_with_sinks(splits):
    """1-byte codes with their scales (the kernel's KV_MODE 1) take the sink as float caches do."""
    gen = torch.Generator().manual_seed(12)
    lens, hq, hk, d, page = [37, 5], 4, 2, 16, 8
    k_cache, _, table = _paged_kv(lens, hk, d, page, torch.float32, gen)
    kq, vq = (torch.randint(-127, 128, k_cache.shape, generator=gen, dtype=torch.int8) for _ in range(2))
    ks, vs = (torch.rand(k_cache.shape[:3], generator=gen) * 0.02 + 0.01 for _ in range(2))
    q = torch.randn(2, hq, d, generator=gen)
    kw = dict(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=0.25, sliding_window=20,
              sinks=_sinks(hq, gen))  # fmt: skip
    got = implementation("paged_attention_decode", "triton")(q, kq, vq, k_scale=ks, v_scale=vs, num_splits=splits,
                                                             **kw)  # fmt: skip
    want = implementation("paged_attention_decode", "reference")(q, kq.float() * ks[..., None],
                                                                 vq.float() * vs[..., None], **kw)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sinks_none_leaves_every_implementation_unchanged():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, table = _paged_kv([20, 7], 2, 16, 4, torch.float32, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    kw = dict(seq_lens=torch.tensor([20, 7], dtype=torch.int32), block_table=table, scale=0.25)
    for impl in IMPLS:
        fn = implementation("paged_attention_decode", impl)
        assert torch.equal(fn(q, k_cache, v_cache, **kw), fn(q, k_cache, v_cache, sinks=None, **kw))
    # -inf sinks add nothing to any denominator
    minus_inf = torch.full((4,), float("-inf"))
    for impl in IMPLS:
        fn = implementation("paged_attention_decode", impl)
        torch.testing.assert_close(fn(q, k_cache, v_cache, sinks=minus_inf, **kw), fn(q, k_cache, v_cache, **kw),
                                   atol=1e-6, rtol=1e-6)  # fmt: skip


def test_triton_rope_write_decode_attention_with_sinks():
    from infercore.ops import rope_cos_sin_cache

    gen = torch.Generator().manual_seed(9)
    lens, hq, hk, d, page = [10, 25], 4, 2, 16, 8
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, torch.float32, gen)
    q, k, v = (torch.randn(2, h, d, generator=gen) for h in (hq, hk, hk))
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int32)
    slots = torch.tensor([int(table[b, (n - 1) // page]) * page + (n - 1) % page for b, n in enumerate(lens)],
                         dtype=torch.int32)  # fmt: skip
    cs = rope_cos_sin_cache(rotary_dim=d, max_positions=64, base=10000.0, dtype=torch.float32, device="cpu")
    sinks = _sinks(hq, gen)
    kw = dict(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=0.25, sliding_window=8,
              sinks=sinks)  # fmt: skip
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    want = implementation("rope_write_decode_attention", "reference")(q, k, v, pos, cs, *caches[0], slots, **kw)
    got = implementation("rope_write_decode_attention", "triton")(q, k, v, pos, cs, *caches[1], slots, num_splits=2,
                                                                  **kw)  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches[1][0], caches[0][0])
    got = rope_write_decode_attention(q, k, v, pos, cs, k_cache.clone(), v_cache.clone(), slots, **kw)  # CPU: the ref
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_bad_sinks_are_refused():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, table = _paged_kv([5], 2, 16, 4, torch.float32, gen)
    q = torch.randn(1, 4, 16)
    kw = dict(seq_lens=torch.tensor([5], dtype=torch.int32), block_table=table, scale=0.25)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    for bad, what in ((torch.zeros(4, dtype=torch.float16), "sinks"), (torch.zeros(2), r"sinks has shape"),
                      (torch.zeros(1, 4), r"sinks has shape"), ([0.0] * 4, "sinks")):
        with pytest.raises((ValueError, TypeError), match=what):
            paged_attention_decode(q, k_cache, v_cache, sinks=bad, **kw)
        with pytest.raises((ValueError, TypeError), match=what):
            paged_attention_prefill(q, k_cache, v_cache, cu_seqlens_q=cu, sinks=bad, **kw)

    def no_sinks(q, k_cache, v_cache, *, seq_lens, block_table, scale, sliding_window=None, softcap=None):
        return q

    assert sinks_kw("paged_attention_decode", no_sinks, None) == {}
    with pytest.raises(ValueError, match="no_sinks takes no attention sinks"):
        sinks_kw("paged_attention_decode", no_sinks, torch.zeros(4))


# ---------------------------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_triton_kernels_with_sinks_bf16(window):
    """GPT-OSS-20B's attention shape (64 query heads, 8 KV heads, head_dim 64, page 16) in bf16: decode at mixed
    context lengths (split-K chosen by the kernel and forced to 1) and a chunked prefill with a cached prefix, the
    new tokens' K/V given contiguously (the model's path), against the fp32 reference."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    lens, hq, hk, d, page = [1, 300, 2049, 4096], 64, 8, 64, 16
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, dt, gen)
    k_cache, v_cache, table = k_cache.to(dev), v_cache.to(dev), table.to(dev)
    sinks = _sinks(hq, gen).to(dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hq, d, device=dev, dtype=dt)
    ref = implementation("paged_attention_decode", "reference")
    want = ref(q.float(), k_cache.float(), v_cache.float(), seq_lens=sl, block_table=table, scale=d**-0.5,
               sliding_window=window, sinks=sinks)  # fmt: skip
    tri = implementation("paged_attention_decode", "triton")
    for splits in (None, 1):
        got = tri(q, k_cache, v_cache, seq_lens=sl, block_table=table, scale=d**-0.5, sliding_window=window,
                  sinks=sinks, num_splits=splits)  # fmt: skip
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    q_lens = [1, 300, 512, 1000]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q = torch.randn(sum(q_lens), hq, d, device=dev, dtype=dt)
    rows = [(b, p) for b, (ql, n) in enumerate(zip(q_lens, lens)) for p in range(n - ql, n)]
    tab = table.cpu()
    idx = (torch.tensor([int(tab[b, p // page]) for b, p in rows], device=dev),
           torch.tensor([p % page for _, p in rows], device=dev))  # fmt: skip
    kw = dict(cu_seqlens_q=cu, seq_lens=sl, block_table=table, scale=d**-0.5, sliding_window=window, sinks=sinks)
    want = implementation("paged_attention_prefill", "reference")(q.float(), k_cache.float(), v_cache.float(), **kw)
    tri = implementation("paged_attention_prefill", "triton")
    for new in ({}, {"k": k_cache[idx].contiguous(), "v": v_cache[idx].contiguous()}):
        got = tri(q, k_cache, v_cache, max_seqlen_q=max(q_lens), **kw, **new)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
