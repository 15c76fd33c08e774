"""Triton paged attention with a page size that is not a power of two (uniform hybrid layouts use
state-sized pages such as 1056 tokens) against the reference, under the interpreter."""

import torch

from infercore.devices import implementation


def test_decode_and_prefill_with_12_token_pages():
    torch.manual_seed(0)
    P, ps, Hk, Hq, D = 10, 12, 2, 4, 16
    kc, vc = torch.randn(P, ps, Hk, D), torch.randn(P, ps, Hk, D)
    bt = torch.randperm(P).to(torch.int32).view(2, 5)
    seq = torch.tensor([30, 47], dtype=torch.int32)
    q = torch.randn(2, Hq, D)
    args = dict(seq_lens=seq, block_table=bt, scale=0.25)
    ref = implementation("paged_attention_decode", "reference")(q, kc, vc, **args)
    tri = implementation("paged_attention_decode", "triton")(q, kc, vc, **args)
    torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    qq = torch.randn(12, Hq, D)
    ref = implementation("paged_attention_prefill", "reference")(qq, kc, vc, cu_seqlens_q=cu, **args)
    tri = implementation("paged_attention_prefill", "triton")(qq, kc, vc, cu_seqlens_q=cu, max_seqlen_q=7, **args)
    torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)
