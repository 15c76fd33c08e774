"""Every variant of the Triton prefill kernel (grid order, hand-pipelined QK^T, warp-specialized loop,
int64 offsets, tile shapes) against the reference, under the interpreter with tiny shapes."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops.attention import triton_prefill  # noqa: E402

VARIANTS = [
    {"block_m": 16, "block_n": 16},
    {"block_m": 16, "block_n": 16, "heads_fast": False},
    {"block_m": 16, "block_n": 16, "pipe_qk": True},
    {"block_m": 32, "block_n": 16, "pipe_qk": True, "off64": True},
    {"block_m": 16, "block_n": 32, "warp_spec": True},
]

CASES = [
    # q_lens, seq_lens, Hq, Hk, D, page, window, softcap
    ([40, 3, 0], [40, 75, 5], 4, 2, 16, 8, None, None),  # fresh prompt, cached prefix, empty row
    ([20, 33], [70, 33], 2, 1, 24, 16, None, 15.0),  # chunked prefill, head_dim 24, softcap
    ([37], [60], 2, 2, 16, 8, 9, None),  # sliding window
]


def _case(case, dtype):
    q_lens, lens, hq, hk, d, page, window, softcap = case
    per_seq = -(-max(lens) // page) + 1
    n = len(lens) * per_seq + 2
    kc = torch.randn(n, page, hk, d, dtype=dtype)
    vc = torch.randn(n, page, hk, d, dtype=dtype)
    table = torch.randperm(n)[: len(lens) * per_seq].view(len(lens), per_seq).to(torch.int32).contiguous()
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
              scale=d**-0.5, sliding_window=window, softcap=softcap)  # fmt: skip
    return q, kc, vc, kw, max(q_lens)


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("case", CASES, ids=["prefix", "chunk_softcap", "window"])
def test_variant_matches_reference(cfg, case):
    torch.manual_seed(0)
    q, kc, vc, kw, max_q = _case(case, torch.float32)
    want = implementation("paged_attention_prefill", "reference")(q, kc, vc, **kw)
    got = torch.full_like(q, float("nan"))
    triton_prefill._launch(q, kc, vc, got, kw["cu_seqlens_q"], kw["seq_lens"], kw["block_table"], kw["scale"],
                           kw["sliding_window"], kw["softcap"], max_q, cfg)  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_pipelined_variant_fp16():
    torch.manual_seed(1)
    q, kc, vc, kw, max_q = _case(CASES[0], torch.float16)
    want = implementation("paged_attention_prefill", "reference")(q, kc, vc, **kw)
    got = torch.empty_like(q)
    triton_prefill._launch(q, kc, vc, got, kw["cu_seqlens_q"], kw["seq_lens"], kw["block_table"], kw["scale"],
                           None, None, max_q, {"block_m": 16, "block_n": 16, "pipe_qk": True})  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
