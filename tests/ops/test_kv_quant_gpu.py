"""Quantized KV (int8 / fp8 e4m3) on a CUDA GPU at real shapes, bf16 (run with ``pytest -m gpu``).

Kernels are compared with the references on the same GPU (fp32 math) by relative RMSE. The decode
kernel is checked against the reference reading the *same* quantized cache (so the tolerance is bf16
operand rounding, ~1e-2), and the quantized cache against a bf16 cache for the total error.
"""

import pytest
import torch

import infercore.ops  # noqa: F401
from infercore.devices import capability, implementation, resolve
from infercore.ops.kv_cache.quant import quantize_kv_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
DT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cache(b, ctx, hk, d, page, kv, *, ragged=True):
    gen = torch.Generator(device=DEV).manual_seed(0)
    per_seq = -(-ctx // page)
    num_pages = b * per_seq + 7
    k = torch.randn(num_pages * page, hk, d, device=DEV, generator=gen, dtype=BF16)
    v = torch.randn(num_pages * page, hk, d, device=DEV, generator=gen, dtype=BF16)
    k[:, 0] *= 20  # an outlier head
    shape = (num_pages, page, hk, d)
    table = torch.randperm(num_pages, device=DEV)[: b * per_seq].view(b, per_seq).int().contiguous()
    lens = torch.randint(1, ctx + 1, (b,), device=DEV, generator=gen) if ragged else torch.full((b,), ctx, device=DEV)
    lens = lens.int()
    if kv == "bf16":
        return (k.view(shape), v.view(shape), None, None), table, lens
    kc, ks = quantize_kv_ref(k, DT[kv])
    vc, vs = quantize_kv_ref(v, DT[kv])
    return (kc.view(shape), vc.view(shape), ks.view(shape[:3]), vs.view(shape[:3])), table, lens


def test_scale_aware_selection_on_cuda():
    from infercore.ops.kv_cache import scale_aware

    assert resolve("paged_attention_decode", DEV).name == "triton"
    assert scale_aware("paged_attention_decode", DEV) is implementation("paged_attention_decode", "triton")
    assert scale_aware("rope_and_write_kv", DEV) is implementation("rope_and_write_kv", "triton")
    assert scale_aware("write_kv_cache_", DEV) is implementation("write_kv_cache_", "triton")


@pytest.mark.parametrize("kv", ["int8", "fp8", "fp8-emulated"])
@pytest.mark.parametrize("b,ctx,hq,hk,d,page,window", [
    (64, 4096, 32, 8, 128, 16, None),
    (8, 1000, 32, 8, 128, 16, 256),
    (5, 700, 14, 2, 64, 32, None),
    (3, 333, 9, 3, 64, 16, None),  # SmolLM2 heads
])  # fmt: skip
def test_decode_quantized_bf16(kv, b, ctx, hq, hk, d, page, window):
    fmt = kv.split("-")[0]
    (kc, vc, ks, vs), table, lens = _cache(b, ctx, hk, d, page, fmt)
    q = torch.randn(b, hq, d, device=DEV, dtype=BF16)
    kw = dict(seq_lens=lens, block_table=table, scale=d**-0.5, sliding_window=window)
    got = implementation("paged_attention_decode", "triton")(
        q, kc, vc, k_scale=ks, v_scale=vs, fp8_emulation=kv == "fp8-emulated", **kw)
    want = implementation("paged_attention_decode", "reference")(q, kc, vc, k_scale=ks, v_scale=vs, **kw)
    assert rel(got, want) < 1e-2
    # Total error vs the dequantized cache rounded to bf16 (that rounding alone is ~0.4% per element,
    # so the bound is looser than the kernel-vs-reference one above).
    k_bf = (kc.float() * ks[..., None]).to(BF16)
    v_bf = (vc.float() * vs[..., None]).to(BF16)
    base = implementation("paged_attention_decode", "reference")(q, k_bf, v_bf, **kw)
    assert rel(got, base) < 2e-2


@pytest.mark.parametrize("kv", ["int8", "fp8", "fp8-emulated"])
@pytest.mark.parametrize("tuning", [
    {"kv_v16": False, "fp8_f16": False},  # codes staged as they are, q's dtype
    {"kv_v16": True, "fp8_f16": False},
    {"kv_v16": False, "fp8_f16": True},
    {"block_n_codes": 128, "num_warps_codes": 4, "block_n_fp8": 128, "num_warps_fp8": 4},
])  # fmt: skip
def test_decode_quantized_operand_paths(kv, tuning, monkeypatch):
    """Both ways of feeding 1-byte codes to the dots (``TUNING``'s defaults take one per format) agree with the
    reference; queries far outside bf16's usual range are not clipped by the fp16 operands (|q| < 65504)."""
    from infercore.ops.attention import triton_decode

    for key, val in tuning.items():
        monkeypatch.setitem(triton_decode.TUNING, key, val)
    fmt = kv.split("-")[0]
    (kc, vc, ks, vs), table, lens = _cache(6, 1500, 4, 128, 16, fmt)
    q = torch.randn(6, 16, 128, device=DEV, dtype=BF16) * 300  # peaked softmax, large fp16 products
    kw = dict(seq_lens=lens, block_table=table, scale=128**-0.5, k_scale=ks, v_scale=vs)
    got = implementation("paged_attention_decode", "triton")(q, kc, vc, fp8_emulation=kv == "fp8-emulated", **kw)
    want = implementation("paged_attention_decode", "reference")(q, kc, vc, **kw)
    assert rel(got, want) < 1e-2


def test_fp8_emulation_matches_native():
    (kc, vc, ks, vs), table, lens = _cache(16, 2048, 8, 128, 16, "fp8")
    q = torch.randn(16, 32, 128, device=DEV, dtype=BF16)
    fn = implementation("paged_attention_decode", "triton")
    kw = dict(seq_lens=lens, block_table=table, scale=128**-0.5, k_scale=ks, v_scale=vs)
    emulated = fn(q, kc, vc, fp8_emulation=True, **kw)
    if capability(DEV).native_fp8:
        # Both decodes are exact, so only the accumulation order may differ.
        assert rel(emulated, fn(q, kc, vc, fp8_emulation=False, **kw)) < 2e-3
    else:
        # No native conversion on this GPU: the emulated kernel is the only one; hold it to the reference.
        want = implementation("paged_attention_decode", "reference")(q, kc, vc, **kw)
        assert rel(emulated, want) < 1e-2


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("fused", [False, True])
def test_quantized_write_bf16(kv, fused):
    t, hq, hk, d, pages, page = 300, 32, 8, 128, 40, 16
    k = torch.randn(t, hk, d, device=DEV, dtype=BF16) * 4
    v = torch.randn(t, hk, d, device=DEV, dtype=BF16)
    q = torch.randn(t, hq, d, device=DEV, dtype=BF16)
    pos = torch.randint(0, 4000, (t,), device=DEV)
    slots = torch.randperm(pages * page, device=DEV)[:t].int()
    slots[::7] = -1
    cs = infercore.ops.rope_cos_sin_cache(rotary_dim=d, max_positions=4096, base=5e5, device=DEV)
    out = {}
    for impl in ("triton", "reference"):
        kc = torch.zeros(pages, page, hk, d, device=DEV, dtype=DT[kv])
        vc = torch.zeros_like(kc)
        ks, vs = torch.zeros(pages, page, hk, device=DEV), torch.zeros(pages, page, hk, device=DEV)
        if fused:
            implementation("rope_and_write_kv", impl)(q, k, v, pos, cs, kc, vc, slots, k_scale=ks, v_scale=vs)
        else:
            implementation("write_kv_cache_", impl)(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
        out[impl] = [(c.float() * s[..., None]) for c, s in ((kc, ks), (vc, vs))]
    for got, want in zip(out["triton"], out["reference"]):
        # Same formula; codes may differ by one step where rounding ties break differently.
        assert rel(got, want) < (2e-3 if kv == "int8" else 2e-2)


def test_quantized_decode_is_graph_capturable():
    (kc, vc, ks, vs), table, lens = _cache(8, 512, 8, 128, 16, "int8")
    q = torch.randn(8, 32, 128, device=DEV, dtype=BF16)
    fn = implementation("paged_attention_decode", "triton")
    kw = dict(seq_lens=lens, block_table=table, scale=128**-0.5, k_scale=ks, v_scale=vs)
    eager = fn(q, kc, vc, **kw)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn(q, kc, vc, **kw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(q, kc, vc, **kw)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_model_forward_quantized_kv_cuda(kv):
    """A tiny Llama on the GPU in bf16: int8/fp8 KV vs bf16 KV logits (prefill + decode)."""
    import transformers as tf

    from infercore.kv import allocate_kv_caches
    from infercore.models import ModelConfig, build_model
    from infercore.ops import AttentionMetadata

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(cfg.to_dict()), dtype=BF16, device=DEV)
    prompt = torch.randint(0, 512, (40,), device=DEV, dtype=torch.int32)
    results = {}
    for dt in ("auto", kv):
        caches = allocate_kv_caches(model.kv_specs(), 8, 16, dtype=BF16, device=DEV, kv_cache_dtype=dt)
        meta = AttentionMetadata.from_lists(query_lens=[39], seq_lens=[39], block_tables=[[3, 5, 1]],
                                            slot_mapping=[[3, 5, 1][i // 16] * 16 + i % 16 for i in range(39)],
                                            device=DEV)  # fmt: skip
        with torch.inference_mode():
            h = model(prompt[:39], torch.arange(39, device=DEV, dtype=torch.int32), caches, meta)
            pre = model.compute_logits(h[-1:])
            meta = AttentionMetadata.from_lists(query_lens=[1], seq_lens=[40], block_tables=[[3, 5, 1]],
                                                slot_mapping=[1 * 16 + 7], device=DEV)  # fmt: skip
            h = model(prompt[39:], torch.tensor([39], device=DEV, dtype=torch.int32), caches, meta)
            results[dt] = (pre, model.compute_logits(h))
    for got, want in zip(results[kv], results["auto"]):
        assert rel(got, want) < (3e-2 if kv == "int8" else 1e-1)
