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


FUSED_ROPE_CASES = [
    # seq_lens, Hq, Hk, D, rotary dim, neox, page, window, softcap, num_splits
    ([5, 40, 1, 0], 4, 2, 32, 32, True, 8, None, None, 1),  # ragged + a padding row (slot -1)
    ([33, 70], 8, 2, 16, 16, False, 16, 16, None, 3),  # interleaved pairs, window, split-K
    ([50, 17], 2, 2, 24, 16, True, 8, None, 30.0, 2),  # partial rotary, head_dim 24, softcap
    ([64, 9], 4, 1, 64, 64, True, 32, 7, 5.0, None),  # GQA 4, automatic split count
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", FUSED_ROPE_CASES)
@pytest.mark.parametrize("prewait", [False, True])
def test_rope_write_decode_attention(dtype, case, prewait, monkeypatch):
    # RoPE + the new token's KV write inside the decode kernel against the composition of the two
    # references: the same output and the same cache contents (the new rows written, nothing else).
    from infercore.ops import rope_cos_sin_cache
    from infercore.ops.attention import triton_decode as td

    # the fused kernel reads the first tile's older rows ahead of its RoPE (with or without PDL)
    # unless INFERCORE_DECODE_PREWAIT=0
    monkeypatch.setitem(td.TUNING, "prewait", prewait)
    lens, hq, hk, d, rot, neox, page, window, softcap, splits = case
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, dtype)
    b = len(lens)
    q = torch.randn(b, hq, d, dtype=dtype)
    k = torch.randn(b, hk, d, dtype=dtype)
    v = torch.randn(b, hk, d, dtype=dtype)
    positions = torch.tensor([max(n - 1, 0) for n in lens])
    slots = torch.tensor([int(table[i, (n - 1) // page]) * page + (n - 1) % page if n else -1
                          for i, n in enumerate(lens)], dtype=torch.int32)  # fmt: skip
    cs = rope_cos_sin_cache(rotary_dim=rot, max_positions=128, base=10000.0, dtype=torch.float32)
    kw = dict(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, scale=d**-0.5,
              sliding_window=window, softcap=softcap, is_neox=neox)  # fmt: skip
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    want = implementation("rope_write_decode_attention", "reference")(q, k, v, positions, cs, kc_ref, vc_ref, slots,
                                                                      **kw)  # fmt: skip
    got = td.rope_write_decode_attention(q, k, v, positions, cs, k_cache, v_cache, slots, num_splits=splits, **kw)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k_cache, kc_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(v_cache, vc_ref, atol=0, rtol=0)


def test_rope_write_decode_attention_kernel_rejects_quantized_caches():
    from infercore.ops.attention import triton_decode as td

    k_cache, v_cache, table = _paged_kv([5], 2, 16, 8, torch.float32)
    q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    kw = dict(seq_lens=torch.tensor([5], dtype=torch.int32), block_table=table, scale=0.25)
    with pytest.raises(ValueError, match="k_cache"):
        td.rope_write_decode_attention(q, k, v, torch.tensor([4]), torch.randn(32, 16), k_cache.to(torch.int8),
                                       v_cache.to(torch.int8), torch.tensor([0], dtype=torch.int32), **kw)


def test_llama_decode_with_rope_fused_into_attention_keeps_logits(monkeypatch):
    # INFERCORE_FUSED_ROPE_ATTENTION: decode-only steps of the Llama layer call the fused kernel (here
    # through the interpreter) instead of RoPE / KV write + attention; the logits stay those of the
    # unfused path, and the cache rows written by the fused steps serve the later steps.
    from llama_helpers import run_tiny_llama, tiny_llama

    from infercore.models import llama

    model = tiny_llama()
    want = run_tiny_llama(model, [5, 17, 3, 40, 22], 4)
    calls = []
    fused = implementation("rope_write_decode_attention", "triton")
    real_dispatch = llama.dispatch

    def fake_dispatch(op, device):
        if op == "rope_write_decode_attention":
            return lambda *a, **kw: calls.append(1) or fused(*a, **kw)
        return real_dispatch(op, device)

    monkeypatch.setattr(llama, "_fused_rope_attention", lambda device, rows: True)
    monkeypatch.setattr(llama, "dispatch", fake_dispatch)
    got = run_tiny_llama(model, [5, 17, 3, 40, 22], 4)
    assert len(calls) == 4 * 2  # 4 decode steps x 2 layers; the prefill step keeps the unfused ops
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_public_rope_write_decode_attention_checks_and_matches_the_composition():
    from infercore.ops import rope_cos_sin_cache, rope_write_decode_attention

    k_cache, v_cache, table = _paged_kv([9, 3], 2, 16, 4, torch.float32)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    pos = torch.tensor([8, 2])
    slots = torch.tensor([int(table[0, 2]) * 4, int(table[1, 0]) * 4 + 2], dtype=torch.int32)
    cs = rope_cos_sin_cache(rotary_dim=16, max_positions=32, base=10000.0)
    kw = dict(seq_lens=torch.tensor([9, 3], dtype=torch.int32), block_table=table, scale=0.25)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = rope_write_decode_attention(q, k, v, pos, cs, k_cache, v_cache, slots, **kw)  # CPU: the reference
    want = implementation("rope_write_decode_attention", "triton")(q, k, v, pos, cs, kc, vc, slots, **kw)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(k_cache, kc, atol=2e-5, rtol=2e-5)
    # the argument checks of rope_and_write_kv_cache_ (check_rope_write_args), plus the decode ones
    bad = [
        (TypeError, "k must have the dtype of q", dict(k=k.half())),
        (ValueError, "slot_mapping", dict(slots=slots[:1])),
        (ValueError, "positions", dict(pos=pos.repeat(2))),
        (ValueError, "k_cache heads", dict(k=k[:, :1], v=v[:, :1])),
        (ValueError, "rotary_dim 15", dict(cs=cs[:, :15])),
        (ValueError, "quantized", dict(k_cache=k_cache.to(torch.int8), v_cache=v_cache.to(torch.int8))),
        (TypeError, "positions must be", dict(pos=[8, 2])),
        (TypeError, "positions must have dtype", dict(pos=pos.float())),
    ]
    for exc, words, over in bad:
        a = {**dict(q=q, k=k, v=v, pos=pos, cs=cs, k_cache=k_cache, v_cache=v_cache, slots=slots), **over}
        with pytest.raises(exc, match=words):
            rope_write_decode_attention(a["q"], a["k"], a["v"], a["pos"], a["cs"], a["k_cache"], a["v_cache"],
                                        a["slots"], **kw)
    with pytest.raises(ValueError, match="seq_lens has 1 entries"):
        rope_write_decode_attention(q, k, v, pos, cs, k_cache, v_cache, slots,
                                    **{**kw, "seq_lens": kw["seq_lens"][:1], "block_table": table[:1]})


@pytest.mark.parametrize("setting,rows,want", [("auto", 1, True), ("auto", 4, True), ("auto", 5, False),
                                               ("1", 256, True), ("0", 1, False)])  # fmt: skip
def test_llama_fused_rope_attention_policy(setting, rows, want, monkeypatch):
    # INFERCORE_FUSED_ROPE_ATTENTION: auto = decode-only steps of <= FUSED_ROPE_MAX_ROWS sequences
    # (where the fused kernel measured faster), 1 = all, 0 = none; never without a kernel for it.
    from types import SimpleNamespace

    from infercore.models import llama

    monkeypatch.setattr(llama, "FUSED_ROPE_ATTENTION", setting)
    monkeypatch.setattr(llama, "resolve", lambda op, device: SimpleNamespace(name="triton"))
    assert llama._fused_rope_attention(torch.device("cuda"), rows) is want
    monkeypatch.setattr(llama, "resolve", lambda op, device: SimpleNamespace(name="reference"))
    assert not llama._fused_rope_attention(torch.device("cpu"), rows)


SPLIT_CASES = [
    # q_lens, seq_lens, Hq, Hk, D, page, window
    ([1, 1, 1, 4, 6], [9, 30, 1, 12, 6], 4, 2, 16, 8, None),  # one-query rows first: views
    ([1, 5, 1, 1, 3, 1], [20, 5, 33, 2, 40, 7], 4, 1, 32, 8, 10),  # scattered: indexed, with a window
]


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_mixed_step_with_its_decodes_split_off(case):
    # A mixed step's one-query sequences go through the decode kernel; the prefill kernel leaves their
    # rows untouched, and the two together give the reference's result.
    from infercore.ops import AttentionMetadata
    from infercore.ops.attention import attend_split_decodes, split_decodes, triton_prefill

    q_lens, lens, hq, hk, d, page, window = case
    k_cache, v_cache, table = _paged_kv(lens, hk, d, page, torch.float32)
    q = torch.randn(sum(q_lens), hq, d)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=sl, block_table=table,
                             slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int32), max_seqlen_q=max(q_lens),
                             max_seqlen_k=max(lens), decode_only=False)  # fmt: skip
    singles = [i for i, n in enumerate(q_lens) if n == 1]
    assert meta.mark_split_decodes(q_lens, min_rows=len(singles) + 1) == 0 and meta.num_split_decodes == 0
    assert meta.mark_split_decodes(q_lens, min_rows=2) == len(singles) == meta.num_split_decodes
    prefix = singles == list(range(len(singles)))
    assert (meta.decode_seqs is None) == prefix
    if not prefix:
        assert meta.decode_seqs.tolist() == singles
        assert meta.decode_tokens.tolist() == [int(cu[i]) for i in singles]
    kw = dict(cu_seqlens_q=cu, seq_lens=sl, block_table=table, scale=d**-0.5, sliding_window=window, softcap=None)
    want = implementation("paged_attention_prefill", "reference")(q, k_cache, v_cache, **kw)

    pre = implementation("paged_attention_prefill", "triton")
    assert split_decodes(meta, pre) and not split_decodes(meta, implementation("paged_attention_prefill", "reference"))
    out = torch.full_like(q, float("nan"))
    triton_prefill._launch(q, k_cache, v_cache, out, cu, sl, table, d**-0.5, window, None, max(q_lens),
                           {"block_m": 16, "block_n": 16, "tma": False}, seqs=meta.prefill_seqs)  # fmt: skip
    rows = torch.tensor([int(cu[i]) for i in singles])
    others = torch.tensor([t for t in range(sum(q_lens)) if t not in rows.tolist()])
    assert out[rows].isnan().all() and not out[others].isnan().any()
    torch.testing.assert_close(out[others], want[others], atol=TOL[torch.float32], rtol=TOL[torch.float32])

    assert meta.prefill_seqs.tolist() == [i for i, n in enumerate(q_lens) if n != 1]
    got = pre(q, k_cache, v_cache, only_seqs=meta.prefill_seqs, **kw)
    attend_split_decodes(got, q, k_cache, v_cache, meta, implementation("paged_attention_decode", "triton"),
                         scale=d**-0.5, sliding_window=window, softcap=None)  # fmt: skip
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_engine_mixed_steps_with_decodes_split_off_keep_the_tokens(split_attention_through_triton):
    # Engine steps that mix prefill chunks with decodes, the Llama layer's attention through the Triton
    # kernels (interpreter) with the decodes split off, give the tokens of the CPU engine.
    from llama_helpers import tiny_llama

    from infercore import Engine, SamplingParams
    from infercore.models import llama

    model = tiny_llama()
    prompts = [[(7 * i + j) % 61 for j in range(3 + (5 * i) % 11)] for i in range(7)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cfg = dict(num_pages=64, page_size=4, max_num_batched_tokens=16, cpu_packed_linears=False)
    want = [o.token_ids for o in Engine(model, **cfg).generate(prompts, sp)]
    split_steps = split_attention_through_triton(llama)
    got = [o.token_ids for o in Engine(model, **cfg).generate(prompts, sp)]
    assert got == want
    assert split_steps and max(split_steps) >= 2  # mixed steps did split their decodes off


def test_paged_attention_splits_mixed_steps_where_the_prefill_kernel_can(monkeypatch):
    # The generic op (the hybrid models' attention) with a marked mixed step: the Triton prefill kernel
    # skips the one-query sequences, the decode kernel fills them; the reference's result either way.
    from infercore.ops import AttentionMetadata, attention

    q_lens, lens = [1, 6, 1, 1, 2, 1], [12, 6, 30, 3, 20, 9]
    k_cache, v_cache, table = _paged_kv(lens, 2, 16, 8, torch.float32)
    q = torch.randn(sum(q_lens), 4, 16)
    meta = AttentionMetadata.from_lists(query_lens=q_lens, seq_lens=lens, block_tables=table.tolist(),
                                        slot_mapping=[0] * sum(q_lens))  # fmt: skip
    assert meta.mark_split_decodes(q_lens, min_rows=4) == 4
    want = attention.paged_attention(q, k_cache, v_cache, meta, scale=0.25, sliding_window=7)  # CPU kernels
    calls = []
    kernels = {op: implementation(op, "triton") for op in ("paged_attention_prefill", "paged_attention_decode")}
    real_dispatch, real_attend = attention.dispatch, attention.attend_split_decodes
    monkeypatch.setattr(attention, "dispatch", lambda op, device: kernels.get(op) or real_dispatch(op, device))
    monkeypatch.setattr(attention, "attend_split_decodes", lambda *a, **kw: calls.append(1) or real_attend(*a, **kw))
    got = attention.paged_attention(q, k_cache, v_cache, meta, scale=0.25, sliding_window=7)
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_split_decode_arguments_are_checked():
    from infercore.ops import AttentionMetadata, paged_attention_prefill

    k_cache, v_cache, table = _paged_kv([5, 9], 2, 16, 8, torch.float32)
    q = torch.randn(6, 4, 16)
    kw = dict(cu_seqlens_q=torch.tensor([0, 1, 6], dtype=torch.int32), seq_lens=torch.tensor([5, 9], dtype=torch.int32),
              block_table=table, scale=0.25)  # fmt: skip
    with pytest.raises(TypeError, match="only_seqs"):
        paged_attention_prefill(q, k_cache, v_cache, only_seqs=torch.tensor([1]), **kw)  # int64
    with pytest.raises(ValueError, match="only_seqs"):
        paged_attention_prefill(q, k_cache, v_cache, only_seqs=torch.tensor([[1]], dtype=torch.int32), **kw)
    meta = AttentionMetadata.from_lists(query_lens=[1, 5], seq_lens=[5, 9], block_tables=table.tolist(),
                                        slot_mapping=[0] * 6)  # fmt: skip
    with pytest.raises(ValueError, match="query_lens"):
        meta.mark_split_decodes([1, 5, 1])
    # the reference ignores only_seqs (computes every row): same result as without it
    got = paged_attention_prefill(q, k_cache, v_cache, only_seqs=torch.tensor([1], dtype=torch.int32), **kw)
    torch.testing.assert_close(got, paged_attention_prefill(q, k_cache, v_cache, **kw))
