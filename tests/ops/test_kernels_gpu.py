"""Triton kernels at real shapes in bf16 on a CUDA GPU (run on the H200 with ``pytest -m gpu``).

Each kernel is compared with its reference running on the same GPU (fp32 math) by relative RMSE;
bf16 operands land between 1e-3 and 1e-2. Sampling: greedy exact, distribution over many seeds.
"""

import pytest
import torch

import infercore.ops  # noqa: F401
from infercore.devices import implementation, resolve
from infercore.ops.sampling import SamplingTensors, apply_top_k_top_p_min_p

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def both(op, *args, **kwargs):
    return implementation(op, "triton")(*args, **kwargs), implementation(op, "reference")(*args, **kwargs)


def test_triton_selected_on_cuda():
    for op in (
        "rms_norm",
        "fused_add_rms_norm",
        "silu_and_mul",
        "gelu_and_mul",
        "apply_rope",
        "write_kv_cache_",
        "rope_and_write_kv",
        "paged_attention_decode",
        "rope_write_decode_attention",
        "paged_attention_prefill",
        "sample",
    ):
        assert resolve(op, DEV).name == "triton", op


def test_norms_and_activations_bf16():
    x = torch.randn(512, 4096, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=BF16)
    got, want = both("rms_norm", x, w, eps=1e-6)
    assert rel(got, want) < 5e-3
    (y, nr), (y_ref, nr_ref) = both("fused_add_rms_norm", x, r, w, eps=1e-6, offset=1.0)
    assert torch.equal(nr, nr_ref) and rel(y, y_ref) < 5e-3
    g = torch.randn(512, 2 * 14336, device=DEV, dtype=BF16)
    got, want = both("silu_and_mul", g)
    assert rel(got, want) < 5e-3
    got, want = both("gelu_and_mul", g, approximate="tanh")
    assert rel(got, want) < 5e-3


@pytest.mark.parametrize("is_neox,rot", [(True, 128), (False, 64)])
def test_rope_and_kv_write_bf16(is_neox, rot):
    T, Hq, Hk, D, page = 777, 32, 8, 128, 16
    q = torch.randn(T, Hq, D, device=DEV, dtype=BF16)
    k = torch.randn(T, Hk, D, device=DEV, dtype=BF16)
    v = torch.randn(T, Hk, D, device=DEV, dtype=BF16)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    cache = infercore.ops.rope_cos_sin_cache(rotary_dim=rot, max_positions=8192, base=500000.0, device=DEV)
    (qo, ko), (qr, kr) = both("apply_rope", q, k, pos, cache, is_neox=is_neox)
    assert rel(qo, qr) < 5e-3 and rel(ko, kr) < 5e-3
    slots = torch.randperm(64 * page, device=DEV)[:T].to(torch.int32)
    slots[::7] = -1
    kc = torch.zeros(64, page, Hk, D, device=DEV, dtype=BF16)
    vc, kc_r, vc_r = kc.clone(), kc.clone(), kc.clone()
    q1 = implementation("rope_and_write_kv", "triton")(q, k, v, pos, cache, kc, vc, slots, is_neox=is_neox)
    q2 = implementation("rope_and_write_kv", "reference")(q, k, v, pos, cache, kc_r, vc_r, slots, is_neox=is_neox)
    assert rel(q1, q2) < 5e-3 and rel(kc, kc_r) < 5e-3 and torch.equal(vc, vc_r)


def _paged(lens, hk, d, page, dtype=BF16):
    per_seq = -(-max(lens) // page) + 1
    n = len(lens) * per_seq + 7
    kc = torch.randn(n, page, hk, d, device=DEV, dtype=dtype)
    vc = torch.randn_like(kc)
    table = torch.randperm(n, device=DEV)[: len(lens) * per_seq].view(len(lens), per_seq).to(torch.int32)
    return kc, vc, table


@pytest.mark.parametrize(
    "hq,hk,d,page,window,softcap,splits",
    [
        (32, 8, 128, 16, None, None, None),
        (32, 8, 128, 16, 1000, None, 4),
        (16, 2, 64, 64, None, 50.0, None),
        (8, 8, 128, 8, None, None, 1),
        (12, 4, 96, 32, 333, 30.0, 3),
    ],
)
def test_decode_bf16(hq, hk, d, page, window, softcap, splits):
    lens = [1, 17, 4096, 3000, 0, 2500, 129, 2048]
    kc, vc, table = _paged(lens, hk, d, page)
    q = torch.randn(len(lens), hq, d, device=DEV, dtype=BF16)
    kw = dict(
        seq_lens=torch.tensor(lens, device=DEV, dtype=torch.int32),
        block_table=table,
        scale=d**-0.5,
        sliding_window=window,
        softcap=softcap,
    )
    want = implementation("paged_attention_decode", "reference")(q, kc, vc, **kw)
    got = implementation("paged_attention_decode", "triton")(q, kc, vc, num_splits=splits, **kw)
    assert rel(got, want) < 1e-2
    assert torch.equal(got[4], torch.zeros_like(got[4]))


@pytest.mark.parametrize("lens", [[577], [1, 17, 4096, 0], [577, 2000, 64, 300, 129, 33]])
@pytest.mark.parametrize("neox", [True, False])
def test_rope_write_decode_attention_bf16(lens, neox):
    # The decode kernel with the new token's RoPE + KV write folded in (rope_write_decode_attention)
    # against the unfused Triton pair on a copy of the caches; batches <= 4 take the PDL read-ahead.
    hq, hk, d, page = 32, 8, 128, 16
    kc, vc, table = _paged(lens, hk, d, page)
    b = len(lens)
    q = torch.randn(b, hq, d, device=DEV, dtype=BF16)
    k = torch.randn(b, hk, d, device=DEV, dtype=BF16)
    v = torch.randn(b, hk, d, device=DEV, dtype=BF16)
    pos = torch.tensor([max(n - 1, 0) for n in lens], device=DEV)
    slots = torch.tensor([int(table[i, (n - 1) // page]) * page + (n - 1) % page if n else -1
                          for i, n in enumerate(lens)], device=DEV, dtype=torch.int32)  # fmt: skip
    cs = infercore.ops.rope_cos_sin_cache(rotary_dim=d, max_positions=8192, base=500000.0, device=DEV)
    kw = dict(seq_lens=torch.tensor(lens, device=DEV, dtype=torch.int32), block_table=table, scale=d**-0.5)
    kc2, vc2 = kc.clone(), vc.clone()
    q_rot = implementation("rope_and_write_kv", "triton")(q, k, v, pos, cs, kc2, vc2, slots, is_neox=neox)
    want = implementation("paged_attention_decode", "triton")(q_rot, kc2, vc2, **kw)
    got = implementation("rope_write_decode_attention", "triton")(q, k, v, pos, cs, kc, vc, slots, is_neox=neox,
                                                                   **kw)  # fmt: skip
    assert rel(got, want) < 2e-3
    # the same rows written (k may differ in the last bf16 bit: FMA contraction can differ per kernel)
    assert torch.equal(vc, vc2) and rel(kc, kc2) < 1e-3 and ((kc != kc2).any(-1).any(-1).sum() <= b)


@pytest.mark.parametrize(
    "hq,hk,d,page,window,softcap",
    [
        (32, 8, 128, 16, None, None),
        (32, 8, 128, 16, 700, None),
        (16, 2, 64, 8, None, 30.0),
        (12, 4, 96, 32, None, None),
    ],
)
def test_prefill_bf16(hq, hk, d, page, window, softcap):
    q_lens, lens = [1000, 1, 513, 64], [1000, 2000, 1500, 64]  # fresh, decode-like, chunked, short
    kc, vc, table = _paged(lens, hk, d, page)
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=BF16)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), device=DEV, dtype=torch.int32)
    kw = dict(
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(lens, device=DEV, dtype=torch.int32),
        block_table=table,
        scale=d**-0.5,
        sliding_window=window,
        softcap=softcap,
        max_seqlen_q=max(q_lens),
    )
    got, want = both("paged_attention_prefill", q, kc, vc, **kw)
    assert rel(got, want) < 1e-2


def test_decode_is_graph_capturable():
    lens = [100, 2000, 37]
    kc, vc, table = _paged(lens, 8, 128, 16)
    q = torch.randn(3, 32, 128, device=DEV, dtype=BF16)
    sl = torch.tensor(lens, device=DEV, dtype=torch.int32)
    fn = implementation("paged_attention_decode", "triton")
    fn(q, kc, vc, seq_lens=sl, block_table=table, scale=0.1)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(q, kc, vc, seq_lens=sl, block_table=table, scale=0.1)
    sl.copy_(torch.tensor([5, 6, 7], device=DEV))
    g.replay()
    want = implementation("paged_attention_decode", "reference")(q, kc, vc, seq_lens=sl, block_table=table, scale=0.1)
    assert rel(out, want) < 1e-2


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)  # Triton 3.x: device -> (kernels, ...)
    if caches is not None:
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in kernel.cache.values())


def test_decode_split_count_does_not_recompile():
    """Eager decode sees a new batch size (so a new split count) almost every step; the split count is
    a runtime argument, so one compiled decode kernel (and one merge kernel per power-of-two bucket)
    serves them all."""
    from infercore.ops.attention import triton_decode as td

    lens = [100, 2000, 37]
    kc, vc, table = _paged(lens, 8, 128, 16)
    q = torch.randn(3, 32, 128, device=DEV, dtype=BF16)
    sl = torch.tensor(lens, device=DEV, dtype=torch.int32)
    ref = implementation("paged_attention_decode", "reference")(q, kc, vc, seq_lens=sl, block_table=table, scale=0.1)
    td.paged_attention_decode(q, kc, vc, seq_lens=sl, block_table=table, scale=0.1, num_splits=17)
    before = _compiled_variants(td._decode_kernel)
    for splits in (18, 19, 21, 23, 25, 27, 29, 31):
        out = td.paged_attention_decode(q, kc, vc, seq_lens=sl, block_table=table, scale=0.1, num_splits=splits)
        assert rel(out, ref) < 1e-2
    assert _compiled_variants(td._decode_kernel) == before


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_sampling_greedy_exact(dtype):
    B, V = 64, 128256
    logits = (torch.randn(B, V, device=DEV) * 4).to(dtype)
    prev = torch.randint(-1, V, (B, 32), device=DEV)
    params = SamplingTensors.from_lists(temperature=[0.0] * B, repetition_penalty=[1.2] * B, device=DEV)
    got, want = both("sample", logits, params, prev_tokens=prev)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("B", [1, 2, 8])
def test_sampling_greedy_small_batch_slices(dtype, B):
    # Few rows: the first pass runs over slices of each row in parallel; a tie across slices must
    # still give the first occurrence, and a row whose maximum sits in the last slice must find it.
    from infercore.ops.sampling import triton as ts

    V = 128256
    assert ts._parts(B, V, 4096, torch.device(DEV)) > 1
    logits = (torch.randn(B, V, device=DEV) * 4).to(dtype)
    logits[0, 5000] = logits[0, 120000] = 100.0
    logits[-1, V - 1] = 200.0
    params = SamplingTensors.from_lists(temperature=[0.0] * B, device=DEV)
    got, want = both("sample", logits, params)
    assert torch.equal(got, want)
    assert got[0].item() == (5000 if B > 1 else V - 1) and got[-1].item() == V - 1


def test_sampling_distribution_small_batch():
    # The top-p total mass starts from the smallest finite logit, reduced over the row's slices.
    V, draws = 32000, 3000
    g = torch.Generator().manual_seed(99)
    row = torch.randn(V, generator=g) * 2
    row[torch.randperm(V, generator=g)[:8]] += 6.0
    row = row.to(DEV)
    params = SamplingTensors.from_lists(temperature=[1.1, 1.1], top_p=[0.85] * 2, seeds=[3, 4], device=DEV)
    fn = implementation("sample", "triton")
    got = []
    for off in range(draws // 2):
        params.offsets.fill_(off)
        got.append(fn(torch.stack([row, row]), params))
    got = torch.cat(got)
    probs = apply_top_k_top_p_min_p(row[None] / 1.1, params.top_k[:1], params.top_p[:1], params.min_p[:1])
    probs = probs.softmax(-1)[0].double()
    assert (probs[got] > 0).all(), "sampled a token outside the filtered support"
    failures = _sampling_failures(got, probs)
    assert not failures, failures


def _sampling_failures(got: torch.Tensor, probs: torch.Tensor, z: float = 5.0, min_count: float = 50.0) -> list[str]:
    """Frequency check valid at small counts (see tests/ops/test_sampling_stats.py, which tests it):
    tokens expected >= min_count times on their own, rarer ones pooled into groups of ~min_count
    expected draws, plus a chi-square over all groups. A per-token normal check fails an exact
    sampler ~40% of the time when top-p keeps thousands of rare tokens."""
    n, probs = got.numel(), probs.double().cpu()
    counts = torch.bincount(got.cpu(), minlength=probs.numel()).double()
    lam = probs * n
    groups = [i.view(1) for i in torch.nonzero(lam >= min_count).flatten()]
    small = torch.nonzero((lam > 0) & (lam < min_count)).flatten()
    small = small[lam[small].argsort(descending=True)]
    gid = (lam[small].cumsum(0) / min_count).floor().long()
    if len(small) and gid.max() > 0 and lam[small][gid == gid.max()].sum() < min_count:
        gid[gid == gid.max()] -= 1
    groups += [small[gid == g] for g in gid.unique()]
    out, chi2, k = [], 0.0, 0
    for idx in groups:
        p, c = probs[idx].sum().item(), counts[idx].sum().item()
        var = n * p * (1 - p)
        if var == 0:
            continue
        if abs(c - n * p) > z * var**0.5:
            out.append(f"tokens {idx.tolist()[:5]}: drawn {c:.0f}, expected {n * p:.1f}")
        chi2 += (c - n * p) ** 2 / var
        k += 1
    if k and chi2 > k + 6 * (2 * k) ** 0.5:
        out.append(f"chi2 {chi2:.1f} over {k} groups")
    return out


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(0.8, 20, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 50, 0.9, 0.05)]
)
def test_sampling_distribution(temperature, top_k, top_p, min_p):
    N, V = 40000, 32000
    g = torch.Generator().manual_seed(1234)  # the row must not depend on which tests ran before
    row = torch.randn(V, generator=g) * 2
    row[torch.randperm(V, generator=g)[:8]] += 6.0  # a handful of likely tokens
    row = row.to(DEV)
    logits = row.expand(N, V).contiguous()
    params = SamplingTensors.from_lists(
        temperature=[temperature] * N,
        top_k=[top_k] * N,
        top_p=[top_p] * N,
        min_p=[min_p] * N,
        seeds=list(range(N)),
        offsets=[5] * N,
        device=DEV,
    )
    probs = apply_top_k_top_p_min_p(row[None] / temperature, params.top_k[:1], params.top_p[:1], params.min_p[:1])
    probs = probs.softmax(-1)[0].double()
    got = implementation("sample", "triton")(logits, params)
    support = probs > 0
    assert support[got].all(), "sampled a token outside the filtered support"
    failures = _sampling_failures(got, probs)
    assert not failures, failures
    # Every token with >= 0.2% probability shows up (support equality where it is observable).
    freq = torch.bincount(got, minlength=V).double() / N
    assert (freq[probs > 2e-3] > 0).all()


def test_sampling_is_graph_capturable():
    B, V = 8, 4096
    logits = torch.randn(B, V, device=DEV)
    params = SamplingTensors.from_lists(temperature=[1.0] * B, top_p=[0.9] * B, seeds=list(range(B)), device=DEV)
    fn = implementation("sample", "triton")
    first = fn(logits, params).clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(logits, params)
    g.replay()
    assert torch.equal(out, first)  # same seeds/offsets: same draw
    params.offsets.add_(1)
    draws = set()
    for _ in range(5):
        g.replay()
        draws.add(tuple(out.tolist()))
        params.offsets.add_(1)
    assert len(draws) > 1


@pytest.mark.parametrize("dtype,d", [(torch.float32, 128), (torch.float16, 64), (BF16, 256)])
def test_attention_other_dtypes_and_head_dims(dtype, d):
    # Exercises the shared-memory fitting of the tuned configs (fp32 caches, head_dim 256).
    q_lens, lens = [300, 1, 77], [300, 900, 500]
    kc, vc, table = _paged(lens, 2, d, 16, dtype)
    sl = torch.tensor(lens, device=DEV, dtype=torch.int32)
    q = torch.randn(sum(q_lens), 8, d, device=DEV, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), device=DEV, dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, seq_lens=sl, block_table=table, scale=d**-0.5)
    got, want = both("paged_attention_prefill", q, kc, vc, **kw)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel(got, want) < tol
    qd = torch.randn(len(lens), 8, d, device=DEV, dtype=dtype)
    got, want = both("paged_attention_decode", qd, kc, vc, seq_lens=sl, block_table=table, scale=d**-0.5)
    assert rel(got, want) < tol


@pytest.mark.parametrize("T", [1, 7, 64, 300])
def test_moe_routed_bf16(T):
    """Routed MoE experts at a Qwen3-Next-like expert shape (E 64, H 2048, I 512, top-10), against
    the reference loop in fp32 on the same GPU; 300 tokens give several BLOCK_M chunks per expert."""
    torch.manual_seed(T)
    E, H, I, k = 64, 2048, 512, 10
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    gate_up = (torch.randn(E, 2 * I, H, device=DEV) * 0.02).to(BF16)
    down = (torch.randn(E, H, I, device=DEV) * 0.02).to(BF16)
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), k, dim=-1)
    got = implementation("moe_experts_routed", "triton")(x, gate_up, down, w.to(BF16), ids)
    want = implementation("moe_experts_routed", "reference")(x.float(), gate_up.float(), down.float(), w, ids)
    assert resolve("moe_experts_routed", DEV).name == "triton"
    assert got.dtype == BF16 and rel(got, want) < 1e-2


def test_moe_experts_prefill_runs_routed_chunks(monkeypatch):
    """A prefill longer than a chunk runs the routed op chunk by chunk (2500 = 1024 + 1024 + 452 tokens with the
    per-pair outputs bounded to 1 MiB: the minimum chunk) and matches the reference."""
    from infercore.models import moe as moe_mod
    from infercore.models.moe import moe_experts, routed_chunk_rows

    monkeypatch.setattr(moe_mod, "ROUTED_CHUNK_BYTES", 1 << 20)
    torch.manual_seed(0)
    T, E, H, I, k = 2500, 32, 512, 256, 4
    assert T > 2 * routed_chunk_rows(k, H) and routed_chunk_rows(k, H) == moe_mod.ROUTED_MIN_CHUNK
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    gate_up = (torch.randn(E, 2 * I, H, device=DEV) * 0.05).to(BF16)
    down = (torch.randn(E, H, I, device=DEV) * 0.05).to(BF16)
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), k, dim=-1)
    got = moe_experts(x, gate_up, down, w.to(BF16), ids)
    want = implementation("moe_experts_routed", "reference")(x.float(), gate_up.float(), down.float(), w, ids)
    assert got.shape == (T, H) and rel(got, want) < 1e-2


def test_moe_routed_in_cuda_graph():
    """No host sync inside: the op captures in a CUDA graph and replays with new routing."""
    torch.manual_seed(0)
    E, H, I, k, T = 32, 256, 128, 4, 5
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    gate_up = (torch.randn(E, 2 * I, H, device=DEV) * 0.05).to(BF16)
    down = (torch.randn(E, H, I, device=DEV) * 0.05).to(BF16)
    w = torch.rand(T, k, device=DEV, dtype=BF16)
    ids = torch.randint(0, E, (T, k), device=DEV)
    fn = implementation("moe_experts_routed", "triton")
    fn(x, gate_up, down, w, ids)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x, gate_up, down, w, ids)
    for seed in (1, 2):
        torch.manual_seed(seed)
        ids.copy_(torch.randint(0, E, (T, k), device=DEV))
        x.copy_(torch.randn(T, H, device=DEV, dtype=BF16))
        g.replay()
        ref = implementation("moe_experts_routed", "reference")
        assert rel(out, ref(x.float(), gate_up.float(), down.float(), w.float(), ids)) < 1e-2


@pytest.mark.parametrize("scattered", [False, True])
def test_mixed_step_decodes_split_off_bf16(scattered):
    # Llama-8B heads: 48 decodes (contexts up to ~1.5k) and two prefill chunks, the decodes through the
    # decode kernel and the prefill kernel skipping them, against the reference and the unsplit kernel.
    from infercore.ops import AttentionMetadata
    from infercore.ops.attention import attend_split_decodes, split_decodes

    torch.manual_seed(0)
    hq, hk, d, page = 32, 8, 128, 16
    q_lens = [1] * 48 + [300, 517]
    lens = [int(x) for x in torch.randint(20, 1500, (48,))] + [300, 900]
    if scattered:
        order = torch.randperm(len(q_lens)).tolist()
        q_lens, lens = [q_lens[i] for i in order], [lens[i] for i in order]
    per = -(-max(lens) // page)
    num_pages = per * len(lens) + 4
    kc = torch.randn(num_pages, page, hk, d, device=DEV, dtype=BF16)
    vc = torch.randn(num_pages, page, hk, d, device=DEV, dtype=BF16)
    table = torch.randperm(num_pages, device=DEV)[: per * len(lens)].view(len(lens), per).int()
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=BF16)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=sl, block_table=table,
                             slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int32, device=DEV),
                             max_seqlen_q=max(q_lens), max_seqlen_k=max(lens), decode_only=False)  # fmt: skip
    assert meta.mark_split_decodes(q_lens, min_rows=8) == 48 and (meta.decode_seqs is not None) == scattered
    kw = dict(cu_seqlens_q=cu, seq_lens=sl, block_table=table, scale=d**-0.5, sliding_window=None, softcap=None)
    pre = implementation("paged_attention_prefill", "triton")
    assert split_decodes(meta, pre)
    whole = pre(q, kc, vc, max_seqlen_q=max(q_lens), **kw)
    got = pre(q, kc, vc, max_seqlen_q=max(q_lens), only_seqs=meta.prefill_seqs, **kw)
    attend_split_decodes(got, q, kc, vc, meta, implementation("paged_attention_decode", "triton"), scale=d**-0.5,
                         sliding_window=None, softcap=None)  # fmt: skip
    want = implementation("paged_attention_prefill", "reference")(q.float(), kc.float(), vc.float(), **kw)
    assert rel(got, want) < 1e-2 and rel(whole, want) < 1e-2
    assert rel(got, whole) < 1e-2
