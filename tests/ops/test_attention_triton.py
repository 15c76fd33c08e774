"""Triton paged decode / prefill attention against the references (CPU interpreter, tiny shapes)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _paged_kv(seq_lens, hk, d, page, dtype):
    """Random caches with shuffled, non-contiguous pages and a block table padded with junk ids."""
    per_seq = max(-(-max(seq_lens) // page), 1) + 1
    num_pages = len(seq_lens) * per_seq + 3
    k_cache = torch.randn(num_pages, page, hk, d, dtype=dtype)
    v_cache = torch.randn(num_pages, page, hk, d, dtype=dtype)
    table = torch.randperm(num_pages)[: len(seq_lens) * per_seq].view(len(seq_lens), per_seq)
    return k_cache, v_cache, table.to(torch.int32).contiguous()


DECODE_CASES = [
    # seq_lens, Hq, Hk, D, page, window, softcap, num_splits
    ([5, 40, 1, 0], 4, 2, 32, 8, None, None, 1),  # ragged + an empty (padding) row
    ([33, 70], 8, 2, 16, 16, 16, None, 3),  # sliding window, split-K
    ([50, 17], 2, 2, 24, 8, None, 30.0, 2),  # MHA, head_dim 24 (padded to 32), softcap
    ([64, 9], 4, 1, 64, 32, 7, 5.0, None),  # GQA 4, window + softcap, automatic split count
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode(dtype, case):
    lens, hq, hk, d, page, window, softcap, splits = case
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, dtype)
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    kw = dict(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=d**-0.5,
              sliding_window=window, softcap=softcap)  # fmt: skip
    want = implementation("paged_attention_decode", "reference")(q, k_cache, v_cache, **kw)
    got = implementation("paged_attention_decode", "triton")(q, k_cache, v_cache, num_splits=splits, **kw)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_reading_ahead_of_the_pdl_wait(case, monkeypatch):
    # With PDL the kernel reads the first tile's older rows before waiting for the RoPE / KV-write
    # kernel and the newest row after (PREWAIT); the interpreter has no PDL, so force the variant.
    from infercore.ops.attention import triton_decode as td

    monkeypatch.setattr(td, "pdl_enabled", lambda t: True)
    monkeypatch.setattr(td, "pdl_launch", lambda use: {})
    lens, hq, hk, d, page, window, softcap, splits = case
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, torch.float32)
    q = torch.randn(len(lens), hq, d)
    kw = dict(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=d**-0.5,
              sliding_window=window, softcap=softcap)  # fmt: skip
    want = implementation("paged_attention_decode", "reference")(q, k_cache, v_cache, **kw)
    for n in (splits, 1, 4):
        got = td.paged_attention_decode(q, k_cache, v_cache, num_splits=n, **kw)
        torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_decode_split_counts_agree():
    # The merge of partial softmaxes must not depend on how the keys were split.
    k_cache, v_cache, table = _paged_kv([61, 23], 2, 16, 8, torch.float32)
    q = torch.randn(2, 4, 16)
    kw = dict(seq_lens=torch.tensor([61, 23], dtype=torch.int32), block_table=table, scale=0.25)
    fn = implementation("paged_attention_decode", "triton")
    one = fn(q, k_cache, v_cache, num_splits=1, **kw)
    for splits in (2, 5):
        torch.testing.assert_close(
            fn(q, k_cache, v_cache, num_splits=splits, **kw), one, atol=1e-5, rtol=1e-5
        )


PREFILL_CASES = [
    # q_lens, seq_lens, Hq, Hk, D, page, window, softcap
    ([5, 20, 1], [5, 40, 9], 4, 2, 32, 8, None, None),  # fresh prompt, cached prefix, decode-like row
    ([33, 7], [70, 7], 4, 1, 16, 16, 10, None),  # chunked prefill with a window
    ([17, 0, 3], [50, 4, 3], 2, 2, 24, 8, None, 20.0),  # empty query row, head_dim 24, softcap
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill(dtype, case):
    q_lens, lens, hq, hk, d, page, window, softcap = case
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, dtype)
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
              scale=d**-0.5, sliding_window=window, softcap=softcap)  # fmt: skip
    want = implementation("paged_attention_prefill", "reference")(q, k_cache, v_cache, **kw)
    got = implementation("paged_attention_prefill", "triton")(
        q, k_cache, v_cache, max_seqlen_q=max(q_lens), **kw
    )
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    # max_seqlen_q omitted: read from cu_seqlens_q; same result.
    again = implementation("paged_attention_prefill", "triton")(q, k_cache, v_cache, **kw)
    assert torch.equal(again, got)


def test_prefill_matches_decode_for_single_queries():
    lens = [30, 12]
    k_cache, v_cache, table = _paged_kv(lens, 2, 16, 8, torch.float32)
    q = torch.randn(2, 4, 16)
    sl = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    pre = implementation("paged_attention_prefill", "triton")(
        q, k_cache, v_cache, cu_seqlens_q=cu, seq_lens=sl, block_table=table, scale=0.25
    )
    dec = implementation("paged_attention_decode", "triton")(
        q, k_cache, v_cache, seq_lens=sl, block_table=table, scale=0.25
    )
    torch.testing.assert_close(pre, dec, atol=1e-5, rtol=1e-5)
