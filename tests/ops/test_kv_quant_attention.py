"""Quantized (int8 / fp8 e4m3) paged KV: quantize-on-write, decode attention reading the codes, prefill
through a dequantized temporary cache, allocation, and a tiny Llama end to end (CPU, Triton interpreter).

The interpreter's fp32->fp8 conversion is unreliable, so FP8 caches are always quantized on the torch
side here; Triton FP8 *writes* are checked on the GPU (tests/ops/test_kv_quant_gpu.py).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.kv import FullAttentionSpec, allocate_kv_caches, bytes_per_page, pages_for_budget  # noqa: E402
from infercore.kv.cache import QuantizedKVCache  # noqa: E402
from infercore.ops import paged_attention_decode, paged_attention_prefill, write_kv_cache_  # noqa: E402
from infercore.ops.kv_cache.quant import dequantize_kv_ref, quantize_kv_ref  # noqa: E402
from infercore.quant import quantize_kv  # noqa: E402

DT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _quant_paged_kv(seq_lens, hk, d, page, kv, *, outlier_head=True):
    """Quantized caches over shuffled pages (table padded with junk ids), and their fp32 dequantization."""
    per_seq = max(-(-max(seq_lens) // page), 1) + 1
    num_pages = len(seq_lens) * per_seq + 3
    k = torch.randn(num_pages * page, hk, d)
    v = torch.randn(num_pages * page, hk, d)
    if outlier_head:  # one head 30x larger: per-(token, head) scales must keep the others intact
        k[:, 0] *= 30.0
    kc, ks = quantize_kv_ref(k, DT[kv])
    vc, vs = quantize_kv_ref(v, DT[kv])
    shape = (num_pages, page, hk, d)
    caches = (kc.view(shape), vc.view(shape), ks.view(shape[:3]), vs.view(shape[:3]))
    deq = (dequantize_kv_ref(caches[0], caches[2]), dequantize_kv_ref(caches[1], caches[3]))
    table = torch.randperm(num_pages)[: len(seq_lens) * per_seq].view(len(seq_lens), per_seq)
    table[:, -1] = 10_000  # junk past every sequence's pages: must never be read
    return caches, deq, table.to(torch.int32).contiguous()


DECODE_CASES = [
    # seq_lens, Hq, Hk, D, page, window, softcap, num_splits
    ([5, 40, 1, 0], 4, 2, 32, 8, None, None, 1),  # ragged + an empty (padding) row
    ([33, 70], 8, 2, 16, 16, 16, None, 3),  # sliding window, split-K
    ([50, 17], 2, 2, 24, 8, None, 30.0, 2),  # MHA, head_dim 24 (padded to 32), softcap
]


@pytest.mark.parametrize("kv", ["int8", "fp8", "fp8-emulated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_triton_decode_reads_quantized_cache(kv, dtype, case):
    lens, hq, hk, d, page, window, softcap, splits = case
    (kc, vc, ks, vs), (kd, vd), table = _quant_paged_kv(lens, hk, d, page, kv.split("-")[0])
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    kw = dict(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=d**-0.5,
              sliding_window=window, softcap=softcap)  # fmt: skip
    # Spec: attention over the dequantized values, in fp32.
    want = implementation("paged_attention_decode", "reference")(q.float(), kd, vd, **kw)
    got = implementation("paged_attention_decode", "triton")(
        q, kc, vc, k_scale=ks, v_scale=vs, num_splits=splits, fp8_emulation=kv == "fp8-emulated", **kw)
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_reference_and_cpu_decode_read_quantized_cache(kv, impl):
    (kc, vc, ks, vs), (kd, vd), table = _quant_paged_kv([37, 5, 0, 64], 2, 16, 8, kv)
    q = torch.randn(4, 4, 16)
    kw = dict(seq_lens=torch.tensor([37, 5, 0, 64], dtype=torch.int32), block_table=table, scale=0.25)
    want = implementation("paged_attention_decode", "reference")(q, kd, vd, **kw)
    got = implementation("paged_attention_decode", impl)(q, kc, vc, k_scale=ks, v_scale=vs, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # ... and the public op dispatches to a scale-aware path
    torch.testing.assert_close(paged_attention_decode(q, kc, vc, k_scale=ks, v_scale=vs, **kw), want,
                               atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_prefill_with_quantized_prefix_matches_dequantized(kv):
    lens, qlens = [21, 9, 30], [5, 9, 1]  # cached prefixes of 16, 0 and 29 tokens
    (kc, vc, ks, vs), (kd, vd), table = _quant_paged_kv(lens, 2, 16, 4, kv)
    # Two sequences share their first pages (prefix caching): the temporary cache holds them once.
    table[1, :2] = table[0, :2]
    q = torch.randn(sum(qlens), 4, 16)
    kw = dict(cu_seqlens_q=torch.tensor([0, 5, 14, 15], dtype=torch.int32),
              seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=0.25)  # fmt: skip
    want = implementation("paged_attention_prefill", "reference")(q, kd, vd, **kw)
    got = paged_attention_prefill(q, kc, vc, k_scale=ks, v_scale=vs, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_write_quantizes_int8(impl):
    torch.manual_seed(1)
    t, hk, d, pages, page = 9, 3, 24, 6, 4
    k = torch.randn(t, hk, d, dtype=torch.float16) * torch.tensor([1.0, 40.0, 0.01], dtype=torch.float16)[:, None]
    v = torch.randn(t, hk, d, dtype=torch.float16)
    slots = torch.tensor([3, 7, -1, 0, 22, 13, 9, 14, 23], dtype=torch.int32)
    kc = torch.zeros(pages, page, hk, d, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(pages, page, hk)
    vs = torch.zeros_like(ks)
    implementation("write_kv_cache_", impl)(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    keep = slots >= 0
    rows = slots[keep].long()
    for x, c, s in ((k, kc, ks), (v, vc, vs)):
        want_c, want_s = quantize_kv(x[keep], kv_dtype="int8")
        torch.testing.assert_close(s.view(-1, hk)[rows], want_s, rtol=1e-6, atol=0)
        # Division may differ in the last ulp at an exact .5: at most one code step apart.
        assert (c.view(-1, hk, d)[rows].int() - want_c.int()).abs().max() <= 1
        assert (c.view(-1, hk, d)[rows].int() != want_c.int()).float().mean() < 0.01
        untouched = torch.ones(pages * page, dtype=torch.bool)
        untouched[rows] = False
        assert torch.all(s.view(-1, hk)[untouched] == 0) and torch.all(c.view(-1, hk, d)[untouched] == 0)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("kind", ["float", "int8"])
def test_write_into_page_strided_views(impl, kind):
    """The hybrid pool hands each layer a view whose page stride spans the other layers of the small
    page; writes land in that layer's slots only, and slot -1 (graph padding) writes nothing."""
    torch.manual_seed(3)
    t, hk, d, pages, page, layers = 5, 2, 16, 4, 4, 3
    dtype = torch.float32 if kind == "float" else torch.int8
    pool = torch.zeros(pages, layers, 2, page, hk, d, dtype=dtype)  # [page, layer, k|v, slot, head, dim]
    scales = torch.zeros(pages, layers, 2, page, hk)
    k, v = torch.randn(t, hk, d), torch.randn(t, hk, d)
    slots = torch.tensor([6, -1, 0, 15, 9], dtype=torch.int32)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    extra = {} if kind == "float" else {"k_scale": scales[:, 1, 0], "v_scale": scales[:, 1, 1]}
    implementation("write_kv_cache_", impl)(k, v, kc, vc, slots, **extra)
    want = torch.zeros_like(pool)
    for x, j in ((k, 0), (v, 1)):
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                row = x[i] if kind == "float" else quantize_kv(x[i : i + 1], kv_dtype="int8")[0][0]
                want[s // page, 1, j, s % page] = row
    if kind == "float":
        assert torch.equal(pool, want)
    else:
        assert (pool.int() - want.int()).abs().max() <= 1  # a last-ulp tie may round either way
        assert torch.count_nonzero(scales[:, [0, 2]]) == 0 and torch.count_nonzero(scales[:, 1]) == 4 * 2 * hk


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_fused_rope_write_quantizes_int8(impl):
    torch.manual_seed(2)
    t, hq, hk, d, pages, page = 6, 4, 2, 16, 4, 4
    q = torch.randn(t, hq, d)
    k = torch.randn(t, hk, d) * 5
    v = torch.randn(t, hk, d)
    pos = torch.tensor([0, 3, 7, 8, 2, 11])
    cs = infercore.ops.rope_cos_sin_cache(rotary_dim=d, max_positions=32, base=10000.0)
    slots = torch.tensor([1, 5, -1, 15, 8, 2], dtype=torch.int32)
    kc = torch.zeros(pages, page, hk, d, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    ks, vs = torch.zeros(pages, page, hk), torch.zeros(pages, page, hk)
    fn = implementation("rope_and_write_kv", impl)
    q_rot = fn(q, k, v, pos, cs, kc, vc, slots, k_scale=ks, v_scale=vs)
    want_q, want_k = implementation("apply_rope", "reference")(q, k, pos, cs)
    torch.testing.assert_close(q_rot, want_q, atol=1e-5, rtol=1e-5)
    keep = slots >= 0
    rows = slots[keep].long()
    got_k = dequantize_kv_ref(kc.view(-1, hk, d)[rows], ks.view(-1, hk)[rows])
    got_v = dequantize_kv_ref(vc.view(-1, hk, d)[rows], vs.view(-1, hk)[rows])
    # int8 with a per-(token, head) scale: error <= half a step (amax / 254) per element.
    for got, x in ((got_k, want_k[keep]), (got_v, v[keep])):
        step = x.abs().amax(-1, keepdim=True) / 127
        assert ((got - x).abs() <= 0.5 * step * (1 + 1e-4) + 1e-7).all()


def test_errors_name_the_scales():
    kc = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
    q = torch.randn(1, 1, 8)
    kw = dict(seq_lens=torch.tensor([3], dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32),
              scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_decode(q, kc, kc.clone(), **kw)
    with pytest.raises(ValueError, match="k_scale"):
        implementation("paged_attention_decode", "triton")(q, kc, kc.clone(), **kw)
    with pytest.raises(TypeError, match="k_scale"):
        paged_attention_decode(q, kc.float(), kc.float(), k_scale=torch.zeros(2, 4, 1), v_scale=torch.zeros(2, 4, 1),
                               **kw)  # fmt: skip
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention_decode(q, kc, kc.clone(), k_scale=torch.zeros(2, 4, 1), v_scale=torch.zeros(2, 4), **kw)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache_(torch.randn(1, 1, 8), torch.randn(1, 1, 8), kc, kc.clone(), torch.zeros(1, dtype=torch.int32))


def test_allocation_accounts_for_codes_and_scales():
    specs = [FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)] * 3
    bf16 = bytes_per_page(specs, 16, torch.bfloat16)
    for name in ("int8", "fp8"):
        q = bytes_per_page(specs, 16, torch.bfloat16, kv_cache_dtype=name)
        assert q == 3 * 2 * 16 * 8 * (128 + 4)
        budget = 1 << 30
        ratio = pages_for_budget(specs, 16, dtype=torch.bfloat16, budget_bytes=budget, kv_cache_dtype=name) / (
            pages_for_budget(specs, 16, dtype=torch.bfloat16, budget_bytes=budget))
        assert 1.9 < ratio < 1.95
    assert bytes_per_page(specs, 16, torch.bfloat16, kv_cache_dtype="auto") == bf16
    caches = allocate_kv_caches(specs[:1], 5, 16, dtype=torch.bfloat16, device="cpu", kv_cache_dtype="fp8")
    (entry,) = caches
    assert isinstance(entry, QuantizedKVCache)
    k, v = entry
    assert k.dtype == v.dtype == torch.float8_e4m3fn and k.shape == (5, 16, 8, 128)
    assert entry.k_scale.shape == (5, 16, 8) and entry.v_scale.dtype == torch.float32
    plain = allocate_kv_caches(specs[:1], 5, 16, dtype=torch.bfloat16, device="cpu")
    assert not isinstance(plain[0], QuantizedKVCache) and plain[0][0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        allocate_kv_caches(specs, 5, 16, dtype=torch.bfloat16, device="cpu", kv_cache_dtype="int4")


# ------------------------------------------------------------------ end to end: tiny SmolLM2-style Llama


def _tiny_llama(tmp_path):
    import transformers as tf

    from infercore.models import load_model

    # SmolLM2's shape family (GQA 3:1 -> here 4:2, tied embeddings, rope 1e5), shrunk.
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         initializer_range=0.1, bos_token_id=1, eos_token_id=None, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    model, _, _ = load_model(tmp_path, dtype=torch.float32, device="cpu")
    return model


def _generate(model, prompts, steps, kv_cache_dtype, page=4, forced=None):
    """Prefill all prompts (one ragged step) then greedy decode; returns (tokens [B, steps], logits
    [steps, B, V], caches). ``forced`` ``[B, steps]`` feeds those tokens instead (teacher forcing), so
    two runs see the same histories and their logits stay comparable at every step."""
    from infercore.ops import AttentionMetadata

    caches = allocate_kv_caches(model.kv_specs(), 40, page, dtype=torch.float32, device="cpu",
                                kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    free = list(range(40))[::-1]
    pages = [[] for _ in prompts]
    lens = [0] * len(prompts)

    def step(new):
        ids, pos, slots, qlens, seq_lens = [], [], [], [], []
        for i, toks in enumerate(new):
            for _ in toks:
                if lens[i] % page == 0:
                    pages[i].append(free.pop())
                slots.append(pages[i][-1] * page + lens[i] % page)
                pos.append(lens[i])
                lens[i] += 1
            ids += toks
            qlens.append(len(toks))
            seq_lens.append(lens[i])
        meta = AttentionMetadata.from_lists(query_lens=qlens, seq_lens=seq_lens, block_tables=[list(p) for p in pages],
                                            slot_mapping=slots, device="cpu")  # fmt: skip
        with torch.inference_mode():
            h = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
            return model.compute_logits(h)

    logits = step(prompts)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    all_logits = [logits[ends]]
    out = [all_logits[0].argmax(-1)]
    for i in range(steps - 1):
        feed = out[-1] if forced is None else forced[:, i]
        all_logits.append(step([[t] for t in feed.tolist()]))
        out.append(all_logits[-1].argmax(-1))
    return torch.stack(out, 1), torch.stack(all_logits), caches


PROMPTS = [[1, 17, 42, 99, 5, 230, 7, 64, 12, 150, 33], [1, 250, 4, 4, 19], [1, 88, 120, 7, 56, 290, 14, 3, 77]]


def _rel_err(logits, ref):
    """Per step: max |logit error| over batch and vocab, in units of the reference logits' std."""
    return ((logits - ref).abs().amax(dim=(1, 2)) / ref.std(dim=(1, 2))).max().item()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_tiny_llama_quantized_kv_end_to_end(kv, tmp_path):
    model = _tiny_llama(tmp_path)
    ref_tokens, ref_logits, _ = _generate(model, PROMPTS, 8, "auto")  # fp32 KV
    tokens, _, caches = _generate(model, PROMPTS, 8, kv)
    assert isinstance(caches[0], QuantizedKVCache) and caches[0][0].dtype == DT[kv]
    assert caches[0].k_scale.abs().sum() > 0  # the write path really quantized into the side tensors
    # Logits under teacher forcing (same histories); yardstick: a bf16 KV cache of the same fp32 model.
    _, logits, _ = _generate(model, PROMPTS, 8, kv, forced=ref_tokens)
    _, bf16_logits, _ = _generate(model, PROMPTS, 8, torch.bfloat16, forced=ref_tokens)
    err, bf16_err = _rel_err(logits, ref_logits), _rel_err(bf16_logits, ref_logits)
    # Why these bounds: per element, int8 with a per-(token, head) scale errs by <= amax/254 (~0.5% of
    # a Gaussian row's std at D=32), about 4x bf16's 2**-9 relative rounding; e4m3 by <= 2**-4
    # relative, ~15x bf16. Measured here: bf16 0.02, int8 0.06, fp8 0.35 (max over 8 steps, in units
    # of the logits' std); the bounds leave ~2x headroom and stay far below a broken cache (>= 1).
    assert 0 < err < (8 * bf16_err if kv == "int8" else 40 * bf16_err), (err, bf16_err)
    assert err < (0.12 if kv == "int8" else 0.7), err
    # Free-running greedy: a random tiny model has near-tied logits, so a few late flips are expected
    # (measured 23/24 tokens identical for int8, 21/24 for fp8).
    match = (tokens == ref_tokens).float().mean().item()
    assert match >= (0.9 if kv == "int8" else 0.75), (match, tokens, ref_tokens)
    assert torch.equal(tokens[:, :2], ref_tokens[:, :2])


def test_tiny_llama_int8_kv_through_triton_kernels(tmp_path, monkeypatch):
    """The same model with the fused RoPE+write and decode attention forced to the Triton kernels
    (interpreter): must match the reference quantized path, not just the fp32 one."""
    model = _tiny_llama(tmp_path)
    prompts = [p[:6] for p in PROMPTS[:2]]
    want_tokens, want_logits, want_caches = _generate(model, prompts, 3, "int8")
    monkeypatch.setenv("INFERCORE_BACKEND", "rope_and_write_kv:triton,paged_attention_decode:triton")
    tokens, logits, caches = _generate(model, prompts, 3, "int8")
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, atol=2e-3 * want_logits.abs().max(), rtol=0)
    # Codes written by the Triton kernel match the reference write (up to one step at exact .5 ties).
    assert (caches[0][0].int() - want_caches[0][0].int()).abs().max() <= 1


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fused_rope_write_quantizes_as_the_reference(kv, dtype, monkeypatch):
    """The CPU kernel's quantize-on-write equals the reference bit for bit (codes and scales), ties included: rows at
    position 0 (RoPE leaves them as they are) whose scale is 1, so x / scale lands on .5 (int8) or halfway between two
    e4m3 values, normal and subnormal (fp8); random rows at other positions; a skipped slot."""
    from infercore.ops.moe import cpu_native

    assert cpu_native.available(), cpu_native.status()
    native = []
    real = cpu_native.rope_write_kv
    monkeypatch.setattr(cpu_native, "rope_write_kv", lambda *a: native.append(1) or real(*a))
    torch.manual_seed(4)
    hq, hk, d, pages, page = 2, 2, 16, 4, 4
    qmax = 127.0 if kv == "int8" else 448.0
    ties = torch.tensor([0.5, 1.5, -2.5, 3.5, 17.0, -19.0, 0.0029296875, 0.0048828125, 0.001953125, 240.0, 13.0,
                         -0.0087890625, 100.5, 0.25, -6.5, 0.0]) if kv == "fp8" else \
        torch.tensor([0.5, 1.5, -2.5, 3.5, 10.5, -11.5, 126.5, 0.49999997, 63.5, -0.5, 2.5, 5.5, 7.5, 0.0, 1.0, -3.0])
    ties[-1] = qmax  # amax = qmax: scale 1
    t = 6
    k = torch.randn(t, hk, d) * 3
    v = torch.randn(t, hk, d)
    k[0, 0], v[0, 1], v[3, 0] = ties, ties, -ties
    q = torch.randn(t, hq, d)
    pos = torch.tensor([0, 3, 7, 0, 2, 11])
    slots = torch.tensor([1, 5, -1, 15, 8, 2], dtype=torch.int32)
    cs = infercore.ops.rope_cos_sin_cache(rotary_dim=d, max_positions=32, base=10000.0)
    outs = []
    for impl in ("cpu", "reference"):
        kc = torch.zeros(pages, page, hk, d, dtype=DT[kv])
        vc = torch.zeros_like(kc)
        ks, vs = torch.zeros(pages, page, hk), torch.zeros(pages, page, hk)
        q_rot = implementation("rope_and_write_kv", impl)(q.to(dtype), k.to(dtype), v.to(dtype), pos, cs, kc, vc,
                                                         slots, k_scale=ks, v_scale=vs)
        outs.append((q_rot, kc.view(torch.uint8), vc.view(torch.uint8), ks, vs))
    assert native == [1]  # the cpu implementation ran the native kernel
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    assert torch.count_nonzero(outs[0][3]) == 5 * hk  # five stored rows
