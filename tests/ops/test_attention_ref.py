import math

import pytest
import torch
import torch.nn.functional as F

from infercore.ops import (
    AttentionMetadata,
    paged_attention,
    paged_attention_decode,
    paged_attention_prefill,
    write_kv_cache_,
)


def dense_attention(q, k, v, *, scale, window=None, softcap=None):
    """Textbook attention for one sequence, one head at a time, float64, explicit mask.

    q ``[q_len, Hq, D]`` are the last q_len positions of the ``L = k.shape[0]`` keys.
    """
    q_len, hq, _ = q.shape
    seq_len, hk, _ = k.shape
    group = hq // hk
    out = torch.empty(q_len, hq, v.shape[-1], dtype=torch.float64)
    pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    mask = (j <= pos) & ((j > pos - window) if window is not None else True)
    for h in range(hq):
        s = q[:, h].double() @ k[:, h // group].double().T * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ v[:, h // group].double()
    return out


def build_paged(seq_lens, hk, d, page_size, *, dtype=torch.float32, seed=0, extra_pages=3):
    """Random K/V per sequence, written through write_kv_cache_ into shuffled pages of a NaN-filled cache."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + extra_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    k_cache = torch.full((num_pages, page_size, hk, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, keys, vals = [], [], []
    for s, n in zip(seq_lens, pages_per_seq):
        table, perm = perm[:n], perm[n:]
        k = torch.randn(s, hk, d, generator=g).to(dtype)
        v = torch.randn(s, hk, d, generator=g).to(dtype)
        slots = torch.tensor(
            [table[j // page_size] * page_size + j % page_size for j in range(s)], dtype=torch.int32
        )
        write_kv_cache_(k, v, k_cache, v_cache, slots)
        tables.append(table)
        keys.append(k)
        vals.append(v)
    width = max(pages_per_seq) + 2
    # Padding entries point past the pool on purpose: they must never be read.
    block_table = torch.tensor([t + [10**6] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_table, keys, vals


PREFILL_CASES = [
    # seq_lens, q_lens, hq, hk, page_size, window, softcap
    ([5, 17, 33, 1], [5, 17, 33, 1], 4, 4, 4, None, None),  # plain causal prefill, MHA
    ([9, 40, 23], [9, 6, 1], 6, 2, 8, None, None),  # GQA + prefix-cached sequences
    ([30, 12, 19], [30, 5, 19], 9, 3, 4, 7, None),  # sliding window (SmolLM2-like head layout)
    ([21, 16], [21, 3], 4, 2, 16, None, 5.0),  # softcap
    ([45, 8, 27], [10, 8, 27], 8, 1, 4, 6, 3.0),  # MQA + window + softcap + prefix
]


@pytest.mark.parametrize("seq_lens,q_lens,hq,hk,page_size,window,softcap", PREFILL_CASES)
def test_prefill_matches_dense(seq_lens, q_lens, hq, hk, page_size, window, softcap):
    d = 16
    k_cache, v_cache, block_table, keys, vals = build_paged(seq_lens, hk, d, page_size)
    torch.manual_seed(1)
    q = torch.randn(sum(q_lens), hq, d)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    scale = d**-0.5
    out = paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        scale=scale,
        sliding_window=window,
        softcap=softcap,
        max_seqlen_q=max(q_lens),
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    for b in range(len(seq_lens)):
        ref = dense_attention(
            q[cu[b] : cu[b + 1]], keys[b], vals[b], scale=scale, window=window, softcap=softcap
        )
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 4.0), (3, 10.0)])
def test_decode_matches_dense(window, softcap):
    seq_lens = [1, 9, 17, 64, 4]
    hq, hk, d, page_size = 9, 3, 16, 8
    k_cache, v_cache, block_table, keys, vals = build_paged(seq_lens, hk, d, page_size, seed=3)
    torch.manual_seed(2)
    q = torch.randn(len(seq_lens), hq, d)
    out = paged_attention_decode(
        q,
        k_cache,
        v_cache,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        scale=0.3,
        sliding_window=window,
        softcap=softcap,
    )
    for b in range(len(seq_lens)):
        ref = dense_attention(q[b : b + 1], keys[b], vals[b], scale=0.3, window=window, softcap=softcap)
        torch.testing.assert_close(out[b : b + 1].double(), ref, rtol=1e-5, atol=1e-5)


def test_decode_equals_last_row_of_prefill():
    seq_lens = [13, 29]
    k_cache, v_cache, block_table, _, _ = build_paged(seq_lens, 2, 32, 4, seed=5)
    q = torch.randn(2, 4, 32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    dec = paged_attention_decode(q, k_cache, v_cache, seq_lens=sl, block_table=block_table, scale=0.2)
    pre = paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=sl,
        block_table=block_table,
        scale=0.2,
    )
    torch.testing.assert_close(dec, pre, rtol=1e-6, atol=1e-6)


def test_decode_zero_length_padding_row_is_zero():
    k_cache, v_cache, block_table, _, _ = build_paged([6, 6], 1, 8, 4, seed=7)
    q = torch.randn(2, 2, 8)
    out = paged_attention_decode(
        q,
        k_cache,
        v_cache,
        seq_lens=torch.tensor([6, 0], dtype=torch.int32),
        block_table=block_table,
        scale=1.0,
    )
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros(2, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_prefill_matches_torch_sdpa(dtype):
    seq_lens = [37, 20]
    hq, hk, d = 6, 2, 32
    k_cache, v_cache, block_table, keys, vals = build_paged(seq_lens, hk, d, 8, dtype=dtype, seed=9)
    q = torch.randn(sum(seq_lens), hq, d).to(dtype)
    cu = torch.tensor([0, 37, 57], dtype=torch.int32)
    out = paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        scale=d**-0.5,
    )
    assert out.dtype == dtype
    for b in range(2):
        qb = q[cu[b] : cu[b + 1]].float().transpose(0, 1)
        kb = keys[b].float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)
        vb = vals[b].float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True).transpose(0, 1)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].float(), ref, rtol=tol, atol=tol)


def test_paged_attention_dispatches_on_metadata():
    seq_lens, q_lens = [7, 12], [3, 12]
    k_cache, v_cache, _, _, _ = build_paged(seq_lens, 2, 8, 4, seed=11)
    # rebuild block table through the metadata helper from the same pages
    _, _, block_table, _, _ = build_paged(seq_lens, 2, 8, 4, seed=11)
    tables = [[p for p in row if p < k_cache.shape[0]] for row in block_table.tolist()]
    meta = AttentionMetadata.from_lists(
        query_lens=q_lens, seq_lens=seq_lens, block_tables=tables, slot_mapping=[-1] * sum(q_lens)
    )
    assert not meta.decode_only and meta.max_seqlen_q == 12 and meta.max_seqlen_k == 12
    q = torch.randn(15, 4, 8)
    out = paged_attention(q, k_cache, v_cache, meta, scale=0.5, sliding_window=4)
    ref = paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        seq_lens=meta.seq_lens,
        block_table=meta.block_table,
        scale=0.5,
        sliding_window=4,
    )
    assert torch.equal(out, ref)
    dmeta = AttentionMetadata.from_lists(
        query_lens=[1, 1], seq_lens=seq_lens, block_tables=tables, slot_mapping=[-1, -1]
    )
    assert dmeta.decode_only
    qd = torch.randn(2, 4, 8)
    out = paged_attention(qd, k_cache, v_cache, dmeta, scale=0.5, softcap=2.0)
    ref = paged_attention_decode(
        qd, k_cache, v_cache, seq_lens=dmeta.seq_lens, block_table=dmeta.block_table, scale=0.5, softcap=2.0
    )
    assert torch.equal(out, ref)


def test_attention_errors_name_the_argument():
    k_cache = torch.zeros(4, 4, 2, 8)
    q = torch.randn(3, 4, 8)
    sl = torch.tensor([3], dtype=torch.int32)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)

    def prefill(**over):
        args = dict(
            q=q, k_cache=k_cache, v_cache=k_cache, cu_seqlens_q=cu, seq_lens=sl, block_table=bt, scale=1.0
        )
        args.update(over)
        return paged_attention_prefill(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)

    with pytest.raises(ValueError, match="paged_attention_prefill: q"):
        prefill(q=q[0])
    with pytest.raises(TypeError, match="paged_attention_prefill: q"):
        prefill(q=q.int())
    with pytest.raises(TypeError, match="paged_attention_prefill: block_table"):
        prefill(block_table=bt.long())
    with pytest.raises(ValueError, match="paged_attention_prefill: block_table"):
        prefill(block_table=bt[0])
    with pytest.raises(TypeError, match="paged_attention_prefill: seq_lens"):
        prefill(seq_lens=sl.float())
    with pytest.raises(ValueError, match="paged_attention_prefill: cu_seqlens_q"):
        prefill(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="paged_attention_prefill: q heads"):
        prefill(q=torch.randn(3, 3, 8))
    with pytest.raises(ValueError, match="paged_attention_prefill: k_cache head_dim"):
        prefill(q=torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match="paged_attention_prefill: v_cache"):
        prefill(v_cache=torch.zeros(4, 4, 1, 8))
    with pytest.raises(TypeError, match="paged_attention_prefill: v_cache"):
        prefill(v_cache=k_cache.half())
    with pytest.raises(ValueError, match="paged_attention_prefill: k_cache"):
        prefill(k_cache=k_cache[0], v_cache=k_cache[0])
    with pytest.raises(ValueError, match="paged_attention_prefill: scale"):
        prefill(scale=0.0)
    with pytest.raises(ValueError, match="paged_attention_prefill: sliding_window"):
        prefill(sliding_window=0)
    with pytest.raises(ValueError, match="paged_attention_prefill: softcap"):
        prefill(softcap=-1.0)
    with pytest.raises(ValueError, match="paged_attention_decode: seq_lens"):
        paged_attention_decode(q, k_cache, k_cache, seq_lens=sl, block_table=bt, scale=1.0)
    with pytest.raises(TypeError, match="paged_attention: meta"):
        paged_attention(q, k_cache, k_cache, {"decode_only": True}, scale=1.0)
