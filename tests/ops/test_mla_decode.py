"""MLA decode (absorbed form, DeepSeek) over a paged latent cache: the reference and the Triton kernel (interpreter)
against a plain computation written here (each sequence's latent rows gathered one by one, softmax over
``q . [c_kv | k_pe]``, times ``c_kv``); the public wrapper's checks; bf16 at DeepSeek's widths under ``gpu``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops import paged_mla_decode  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _case(seq_lens, H, R, P, page, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    per_seq = max(-(-max(seq_lens) // page), 1) + 1
    num_pages = len(seq_lens) * per_seq + 3
    cache = torch.randn(num_pages, page, 1, R + P, generator=gen)
    # slots past each sequence's end hold huge values: reading one shows in the result
    table = torch.randperm(num_pages, generator=gen)[: len(seq_lens) * per_seq].view(len(seq_lens), per_seq)
    for b, n in enumerate(seq_lens):
        for j in range(n, per_seq * page):
            cache[table[b, j // page], j % page] = 1e4
    q = torch.randn(len(seq_lens), H, R + P, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    t = lambda x: x.to(device)  # noqa: E731
    return t(q.to(dtype)), t(cache.to(dtype)), t(lens), t(table.to(torch.int32).contiguous())


def _want(q, cache, lens, table, scale, R):
    page = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], R)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        rows = cache[table[b, pos // page].long().cpu(), pos % page, 0].float().cpu()  # [n, R + P]
        p = torch.softmax(q[b].float().cpu() @ rows.T * scale, dim=-1)
        out[b] = p @ rows[:, :R]
    return out


CASES = [
    # seq_lens, H, R, P, page, num_splits (Triton)
    ([5, 40, 1, 0], 4, 32, 16, 8, 1),  # ragged + a padding row
    ([33, 17], 20, 64, 16, 16, 3),  # heads past one 16-head block, split-K
    ([70], 16, 32, 8, 4, 2),  # rope width below 16 (padded in the kernel)
    ([9, 64, 3], 2, 48, 16, 16, 4),  # kv_lora_rank not a power of two
]


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seq_lens,H,R,P,page,splits", CASES)
def test_mla_decode_matches_plain(impl, dtype, seq_lens, H, R, P, page, splits):
    q, cache, lens, table = _case(seq_lens, H, R, P, page, dtype)
    scale = (R + P) ** -0.5
    kw = {"num_splits": splits} if impl == "triton" else {}
    got = implementation("paged_mla_decode", impl)(q, cache, seq_lens=lens, block_table=table, scale=scale,
                                                   kv_lora_rank=R, **kw)  # fmt: skip
    assert got.shape == (len(seq_lens), H, R) and got.dtype == dtype
    want = _want(q, cache, lens, table, scale, R)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_mla_decode_public_wrapper_dispatches_and_equals_reference():
    q, cache, lens, table = _case([12, 3], 8, 32, 16, 8, torch.float32)
    got = paged_mla_decode(q, cache, seq_lens=lens, block_table=table, scale=0.1, kv_lora_rank=32)
    want = _want(q, cache, lens, table, 0.1, 32)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_mla_decode_bad_inputs_name_the_argument():
    q, cache, lens, table = _case([4], 4, 32, 16, 8, torch.float32)
    kw = dict(seq_lens=lens, block_table=table, scale=0.1, kv_lora_rank=32)
    with pytest.raises(ValueError, match="kv_cache holds one latent head"):
        paged_mla_decode(q, cache.expand(-1, -1, 2, -1), **kw)
    with pytest.raises(ValueError, match="kv_cache width"):
        paged_mla_decode(q[..., :40], cache, **kw)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        paged_mla_decode(q, cache, **{**kw, "kv_lora_rank": 49})
    with pytest.raises(TypeError, match="kv_cache"):
        paged_mla_decode(q, cache.half(), **kw)
    with pytest.raises(TypeError, match="seq_lens"):
        paged_mla_decode(q, cache, **{**kw, "seq_lens": lens.long()})
    with pytest.raises(ValueError, match="one entry per sequence"):
        paged_mla_decode(q, cache, **{**kw, "seq_lens": torch.tensor([4, 4], dtype=torch.int32)})
    with pytest.raises(ValueError, match="scale"):
        paged_mla_decode(q, cache, **{**kw, "scale": -1.0})


@pytest.mark.gpu
@pytest.mark.parametrize("H,B,L", [(16, 8, 1000), (128, 4, 2049), (128, 64, 300)])
def test_mla_decode_gpu_deepseek_widths(H, B, L):
    lens = [max(L - 7 * i, 1) for i in range(B)]
    q, cache, lens_t, table = _case(lens, H, 512, 64, 16, torch.bfloat16, device="cuda")
    scale = 192**-0.5
    got = implementation("paged_mla_decode", "triton")(q, cache, seq_lens=lens_t, block_table=table, scale=scale,
                                                       kv_lora_rank=512)  # fmt: skip
    want = _want(q, cache, lens_t, table, scale, 512)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
