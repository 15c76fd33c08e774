"""The CPU fast paths (ops/*/cpu.py) against the references, including the cases they hand back."""

import pytest
import torch

from infercore.devices import implementation
from infercore.ops.moe import cpu_native

torch.manual_seed(0)


@pytest.fixture(params=["native", "aten"], autouse=True)
def kernels(request):
    """Every case with the native layer kernels (where they build) and with them off (the ATen paths)."""
    if request.param == "native":
        yield request.param
    else:
        with cpu_native.disabled():
            yield request.param


def both(op):
    return implementation(op, "cpu"), implementation(op, "reference")


def tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norms(dtype, offset):
    x, r, w = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    fast, ref = both("rms_norm")
    torch.testing.assert_close(fast(x, w, eps=1e-6, offset=offset), ref(x, w, eps=1e-6, offset=offset), **tol(dtype))
    fast, ref = both("fused_add_rms_norm")
    (y1, r1), (y2, r2) = fast(x, r, w, eps=1e-6, offset=offset), ref(x, r, w, eps=1e-6, offset=offset)
    torch.testing.assert_close(y1, y2, **tol(dtype))
    assert torch.equal(r1, r2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations(dtype):
    x = torch.randn(7, 2 * 48, dtype=dtype)
    fast, ref = both("silu_and_mul")
    torch.testing.assert_close(fast(x), ref(x), **tol(dtype))
    fast, ref = both("gelu_and_mul")
    for approx in ("tanh", "none"):
        torch.testing.assert_close(fast(x, approximate=approx), ref(x, approximate=approx), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["neox", "interleaved", "partial", "skip_slot"])
def test_rope_and_write(dtype, variant):
    T, hq, hk, d, pages, ps = 6, 4, 2, 16, 8, 4
    from infercore.ops import rope_cos_sin_cache

    rd = 8 if variant == "partial" else d
    cache = rope_cos_sin_cache(rotary_dim=rd, max_positions=64, base=10000.0)
    q, k, v = (torch.randn(T, h, d, dtype=dtype) for h in (hq, hk, hk))
    pos = torch.tensor([3, 9, 0, 17, 40, 5])
    slots = torch.randperm(pages * ps)[:T].to(torch.int32)
    if variant == "skip_slot":
        slots[2] = -1
    outs = []
    for impl in both("rope_and_write_kv"):
        kc, vc = torch.zeros(pages, ps, hk, d, dtype=dtype), torch.zeros(pages, ps, hk, d, dtype=dtype)
        qr = impl(q, k, v, pos, cache, kc, vc, slots, is_neox=variant != "interleaved")
        outs.append((qr, kc, vc))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **tol(dtype))


def _paged(lens, hk, d, ps, dtype):
    need = sum(-(-n // ps) for n in lens) + 3
    kc, vc = torch.randn(need, ps, hk, d, dtype=dtype), torch.randn(need, ps, hk, d, dtype=dtype)
    perm = torch.randperm(need)
    width = max(-(-n // ps) for n in lens)
    table, i = torch.zeros(len(lens), width, dtype=torch.int32), 0
    for b, n in enumerate(lens):
        m = -(-n // ps)
        table[b, :m] = perm[i : i + m]
        i += m
    return kc, vc, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_decode_attention(dtype, window, softcap):
    lens = [1, 13, 0, 30]
    hq, hk, d, ps = 6, 2, 16, 4
    kc, vc, table = _paged(lens, hk, d, ps, dtype)
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    kw = dict(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=0.3, sliding_window=window,
              softcap=softcap)
    fast, ref = both("paged_attention_decode")
    torch.testing.assert_close(fast(q, kc, vc, **kw), ref(q, kc, vc, **kw), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4])
def test_prefill_attention_with_cached_prefix(dtype, window):
    lens, qlens = [9, 21, 7], [9, 5, 1]  # full prompt, prefix-cached chunk, decode row
    hq, hk, d, ps = 4, 4, 16, 4
    kc, vc, table = _paged(lens, hk, d, ps, dtype)
    q = torch.randn(sum(qlens), hq, d, dtype=dtype)
    cu = torch.tensor([0, 9, 14, 15], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=0.25,
              sliding_window=window)
    fast, ref = both("paged_attention_prefill")
    torch.testing.assert_close(fast(q, kc, vc, **kw), ref(q, kc, vc, **kw), **tol(dtype))
