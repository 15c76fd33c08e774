"""Every variant of the Triton prefill kernel (warp-specialized loop, TMA or pointer loads of the new
K/V, int64 offsets, tile shapes) against the reference, under the interpreter with tiny shapes."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops.attention import triton_prefill  # noqa: E402

VARIANTS = [
    {"block_m": 16, "block_n": 16},
    {"block_m": 32, "block_n": 16},
    {"block_m": 16, "block_n": 32, "warp_spec": True},
]

CASES = [
    # q_lens, seq_lens, Hq, Hk, D, page, window, softcap
    ([40, 3, 0], [40, 75, 5], 4, 2, 16, 8, None, None),  # fresh prompt, cached prefix, empty row
    ([20, 33], [70, 33], 2, 1, 24, 16, None, 15.0),  # chunked prefill, head_dim 24, softcap
    ([37], [60], 2, 2, 16, 8, 9, None),  # sliding window
]


def _launch(q, kc, vc, kw, max_q, cfg, **new_kv):
    got = torch.full_like(q, float("nan"))
    triton_prefill._launch(q, kc, vc, got, kw["cu_seqlens_q"], kw["seq_lens"], kw["block_table"], kw["scale"],
                           kw["sliding_window"], kw["softcap"], max_q, cfg, **new_kv)  # fmt: skip
    return got


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
    got = _launch(q, kc, vc, kw, max_q, cfg)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_variant_fp16():
    torch.manual_seed(1)
    q, kc, vc, kw, max_q = _case(CASES[0], torch.float16)
    want = implementation("paged_attention_prefill", "reference")(q, kc, vc, **kw)
    got = _launch(q, kc, vc, kw, max_q, {"block_m": 16, "block_n": 16, "warp_spec": True})
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("new_kv", [False, True], ids=["paged", "new_kv"])
def test_int64_offsets(monkeypatch, new_kv):
    """The int64 key offsets that caches of 2**31 elements or more take, forced on tiny ones."""
    monkeypatch.setattr(triton_prefill, "_INT32_SPAN", 0)
    torch.manual_seed(10)
    q, kc, vc, k, v, kw, max_q = _new_kv_case(NEW_KV_CASES[1], torch.float32)
    kv = {"k": k, "v": v} if new_kv else {}
    if not new_kv:  # the cache must hold the new tokens then
        _write_new_kv(kc, vc, k, v, kw["block_table"], NEW_KV_CASES[1])
    want = implementation("paged_attention_prefill", "reference")(q, kc, vc, **kv, **kw)
    got = _launch(q, kc, vc, kw, max_q, {"block_m": 16, "block_n": 16, "tma": False}, **kv)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_launch_rejects_unknown_config_keys():
    q, kc, vc, kw, max_q = _case(CASES[0], torch.float32)
    with pytest.raises(ValueError, match="unknown config keys"):
        _launch(q, kc, vc, kw, max_q, {"block_m": 16, "block_n": 16, "pipe_qk": True})


# --- the new tokens' K/V passed contiguously (k/v [T, Hk, D]); only the cached prefix is paged ---

NEW_KV_VARIANTS = [
    {"block_m": 16, "block_n": 16, "tma": False},
    {"block_m": 16, "block_n": 16, "tma": True},
    {"block_m": 32, "block_n": 16, "tma": True, "warp_spec": True},
    {"block_m": 16, "block_n": 32, "tma": False, "warp_spec": True},
]

NEW_KV_CASES = CASES + [
    ([9, 16, 5], [9, 40, 21], 4, 1, 16, 4, None, None),  # GQA 4:1, unaligned cached lengths, page 4
    ([12, 30], [50, 30], 2, 2, 16, 8, 7, 20.0),  # window + softcap, one sequence with a prefix
]
NEW_KV_IDS = ["prefix", "chunk_softcap", "window", "gqa_unaligned", "window_softcap"]


def _new_token_slots(table, case):
    """(row of k/v, page, row in page) of every new token's cache slot."""
    q_lens, lens, page = case[0], case[1], case[5]
    slots = [(b, pos) for b, (ql, n) in enumerate(zip(q_lens, lens)) for pos in range(n - ql, n)]
    return [(t, int(table[b, pos // page]), pos % page) for t, (b, pos) in enumerate(slots)]


def _write_new_kv(kc, vc, k, v, table, case):
    for t, p, r in _new_token_slots(table, case):
        kc[p, r], vc[p, r] = k[t], v[t]


def _new_kv_case(case, dtype):
    """As `_case`, plus the new tokens' K/V; the cache slots of the new tokens hold NaN, so any read of
    them (instead of k/v) poisons the output."""
    q, kc, vc, kw, max_q = _case(case, dtype)
    hk, d = case[3], case[4]
    k = torch.randn(q.shape[0], hk, d, dtype=dtype)
    v = torch.randn(q.shape[0], hk, d, dtype=dtype)
    for _, p, r in _new_token_slots(kw["block_table"], case):
        kc[p, r] = vc[p, r] = float("nan")
    return q, kc, vc, k, v, kw, max_q


@pytest.mark.parametrize("cfg", NEW_KV_VARIANTS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("case", NEW_KV_CASES, ids=NEW_KV_IDS)
def test_new_kv_variant_matches_reference(cfg, case):
    torch.manual_seed(2)
    q, kc, vc, k, v, kw, max_q = _new_kv_case(case, torch.float32)
    want = implementation("paged_attention_prefill", "reference")(q, kc, vc, k=k, v=v, **kw)
    assert not want.isnan().any()  # the reference, too, must not read the new tokens' cache slots
    got = _launch(q, kc, vc, kw, max_q, cfg, k=k, v=v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_new_kv_reference_equals_cache_path():
    """With the cache holding the same new K/V, passing k/v changes nothing (the contract)."""
    torch.manual_seed(3)
    q, kc, vc, k, v, kw, _ = _new_kv_case(NEW_KV_CASES[3], torch.float32)
    _write_new_kv(kc, vc, k, v, kw["block_table"], NEW_KV_CASES[3])
    ref = implementation("paged_attention_prefill", "reference")
    torch.testing.assert_close(ref(q, kc, vc, k=k, v=v, **kw), ref(q, kc, vc, **kw), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tma", [False, True])
def test_new_kv_fp16(tma):
    torch.manual_seed(4)
    q, kc, vc, k, v, kw, max_q = _new_kv_case(NEW_KV_CASES[3], torch.float16)
    want = implementation("paged_attention_prefill", "reference")(q, kc, vc, k=k, v=v, **kw)
    got = _launch(q, kc, vc, kw, max_q, {"block_m": 16, "block_n": 16, "tma": tma}, k=k, v=v)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_new_kv_strided_views_like_the_model():
    """k/v as column slices of one fused QKV output (row stride > Hk * D), as the model passes them."""
    torch.manual_seed(5)
    q, kc, vc, k, v, kw, max_q = _new_kv_case(NEW_KV_CASES[0], torch.float32)
    T, hk, d = k.shape
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    qv = qkv[:, : q[0].numel()].view(T, -1, d)
    kv_ = qkv[:, q[0].numel() : q[0].numel() + hk * d].view(T, hk, d)
    vv = qkv[:, q[0].numel() + hk * d :].view(T, hk, d)
    want = implementation("paged_attention_prefill", "reference")(q, kc, vc, k=k, v=v, **kw)
    got = triton_prefill.paged_attention_prefill(qv, kc, vc, k=kv_, v=vv, max_seqlen_q=max_q, **kw)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_public_wrapper_validates_new_kv():
    from infercore.ops import paged_attention_prefill

    q, kc, vc, k, v, kw, _ = _new_kv_case(CASES[0], torch.float32)
    with pytest.raises(ValueError, match="both k and v"):
        paged_attention_prefill(q, kc, vc, k=k, **kw)
    with pytest.raises(ValueError, match="k has shape"):
        paged_attention_prefill(q, kc, vc, k=k[:-1], v=v, **kw)
    with pytest.raises(TypeError, match="v must have the dtype of q"):
        paged_attention_prefill(q, kc, vc, k=k, v=v.half(), **kw)


def test_public_wrapper_new_kv_on_cpu_dispatch():
    """Float cache: the CPU fast path (no k/v argument) reads the cache, which holds the same values."""
    from infercore.ops import paged_attention_prefill

    torch.manual_seed(6)
    q, kc, vc, k, v, kw, _ = _new_kv_case(NEW_KV_CASES[3], torch.float32)
    want = implementation("paged_attention_prefill", "reference")(q, kc, vc, k=k, v=v, **kw)
    _write_new_kv(kc, vc, k, v, kw["block_table"], NEW_KV_CASES[3])
    torch.testing.assert_close(paged_attention_prefill(q, kc, vc, k=k, v=v, **kw), want, atol=1e-5, rtol=1e-5)


def test_public_wrapper_new_kv_with_quantized_cache():
    """int8 cache: the new tokens attend to the exact k/v (their cache scales are NaN here, so reading
    the codes would show), the prefix to the dequantized pages."""
    from infercore.ops import paged_attention_prefill
    from infercore.ops.kv_cache.quant import dequantize_kv_ref, quantize_kv_ref

    torch.manual_seed(7)
    q, kc, vc, k, v, kw, _ = _new_kv_case(NEW_KV_CASES[3], torch.float32)
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    (kq, ks), (vq, vs) = quantize_kv_ref(kc, torch.int8), quantize_kv_ref(vc, torch.int8)
    kq, vq = kq.view(kc.shape), vq.view(vc.shape)
    ks, vs = ks.view(kc.shape[:3]).clone(), vs.view(vc.shape[:3]).clone()
    kd, vd = dequantize_kv_ref(kq, ks), dequantize_kv_ref(vq, vs)
    for _, p, r in _new_token_slots(kw["block_table"], NEW_KV_CASES[3]):
        ks[p, r] = vs[p, r] = float("nan")
    want = implementation("paged_attention_prefill", "reference")(q, kd, vd, k=k, v=v, **kw)
    got = paged_attention_prefill(q, kq, vq, k_scale=ks, v_scale=vs, k=k, v=v, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_llama_prefill_passes_new_kv_to_the_triton_kernel(monkeypatch):
    """A tiny Llama through the Triton prefill kernel (interpreter), which takes the rotated k and v
    contiguously, matches the default CPU path (cache reads only): a fresh prompt, then a chunk after a
    cached prefix, with GQA and a sliding window on one layer."""
    from infercore.kv import allocate_kv_caches
    from infercore.models import ModelConfig, build_model
    from infercore.models.llama import prefill_takes_new_kv
    from infercore.ops import AttentionMetadata

    hf = dict(model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=64, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
              sliding_window=9, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(8)
    model = build_model(ModelConfig.from_hf(hf), dtype=torch.float32, device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    page, steps = 4, [(20, 0), (11, 20)]  # (new tokens, cached prefix)

    def run():
        caches = allocate_kv_caches(model.kv_specs(), 16, page, dtype=torch.float32, device="cpu")
        ids = torch.randint(0, 64, (31,), generator=torch.Generator().manual_seed(9))
        table = list(range(8))
        outs, takes = [], []
        for new, ctx in steps:
            n = ctx + new
            meta = AttentionMetadata.from_lists(query_lens=[new], seq_lens=[n], block_tables=[table],
                                                slot_mapping=list(range(ctx, n)), device="cpu")  # fmt: skip
            takes.append(prefill_takes_new_kv(meta, torch.device("cpu")))
            with torch.inference_mode():
                outs.append(model.compute_logits(model(ids[ctx:n], torch.arange(ctx, n), caches, meta)))
        return torch.cat(outs), takes

    want, takes = run()
    assert takes == [False, False]  # the CPU fast path reads the cache
    monkeypatch.setenv("INFERCORE_BACKEND", "paged_attention_prefill:triton")
    got, takes = run()
    assert takes == [True, True]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
