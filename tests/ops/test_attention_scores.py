"""attention_with_key_scores (H2O / SnapKV per-key scores) and select_kv_tokens.

CPU: the reference against a hand-written loop, the Triton kernels (interpreter, tiny shapes, fp32 /
fp16) against the reference, bad inputs. GPU (``-m gpu``): the kernels at real shapes in bf16.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation, resolve  # noqa: E402
from infercore.ops import attention_with_key_scores, select_kv_tokens  # noqa: E402
from infercore.ops.attention import triton_scores as ts  # noqa: E402

OP = "attention_with_key_scores"
I32 = torch.int32


def _cu(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32, device=device)


def _qkv(lens, hq, hk, d, dtype=torch.float32, device="cpu"):
    T = sum(lens)
    g = torch.Generator(device=device).manual_seed(sum(lens) * 7 + hq + d)
    return tuple(torch.randn(T, h, d, generator=g, device=device).to(dtype) for h in (hq, hk, hk))


def _loop_ref(q, k, v, lens, scale, softcap, window):
    """Attention and per-query-head scores one (query, head) at a time, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    T, hq, _ = q.shape
    group = hq // k.shape[1]
    out = torch.zeros_like(q)
    scores = torch.zeros(T, hq, dtype=torch.float64)
    s0 = 0
    for L in lens:
        for h in range(hq):
            for i in range(L):
                keys = k[s0 : s0 + i + 1, h // group]
                logits = scale * (keys @ q[s0 + i, h])
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                p = torch.softmax(logits, dim=0)
                out[s0 + i, h] = p @ v[s0 : s0 + i + 1, h // group]
                if window is None or i >= L - window:
                    scores[s0 : s0 + i + 1, h] += p
        s0 += L
    return out, scores


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 2.0), (20, 1.5)])
def test_reference_matches_a_hand_written_loop(window, softcap):
    lens, hq, hk, d = [6, 1, 9, 0, 4], 4, 2, 8
    q, k, v = _qkv(lens, hq, hk, d)
    out, key_scores, head_scores = implementation(OP, "reference")(
        q, k, v, cu_seqlens=_cu(lens), scale=0.4, softcap=softcap, score_window=window, head_scores=True)
    want_out, want_heads = _loop_ref(q, k, v, lens, 0.4, softcap, window)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head_scores.double(), want_heads, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(key_scores.double(), want_heads.view(-1, hk, hq // hk).sum(-1), atol=1e-5, rtol=1e-5)
    # every counted query's probabilities sum to one
    counted = sum(min(L, window or L) for L in lens)
    assert key_scores.sum().item() == pytest.approx(counted * hq, rel=1e-5)


# lens, Hq, Hk, D, window, softcap, config (None: the interpreter default, 16 x 16 tiles, one head share)
CASES = [
    ([37, 5, 50], 4, 2, 16, None, None, None),  # ragged GQA 2, H2O
    ([37, 0, 50, 1], 4, 2, 24, 7, None, None),  # an empty and a one-token sequence, head_dim 24, SnapKV window
    ([40, 33], 4, 1, 32, None, 5.0,  # softcap; query tiles twice the key tiles in K1, the reverse in K2
     {"fwd": {"block_m": 32, "block_n": 16}, "scores": {"block_m": 16, "block_n": 32, "split": 2}}),
    ([40, 33, 12], 4, 1, 16, 20, 3.0,  # window crossing tiles, shorter than it for one sequence; one head each
     {"fwd": {"block_m": 16, "block_n": 32}, "scores": {"block_m": 32, "block_n": 16, "split": 4}}),
    ([70, 3], 2, 2, 16, 1, None, None),  # MHA, window of one query
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(dtype, case):
    lens, hq, hk, d, window, softcap, cfg = case
    q, k, v = _qkv(lens, hq, hk, d, dtype)
    kw = dict(cu_seqlens=_cu(lens), scale=d**-0.5, softcap=softcap, score_window=window, head_scores=True)
    want = implementation(OP, "reference")(q, k, v, **kw)
    got = ts.attention_with_key_scores(q, k, v, max_seqlen=max(lens), config=cfg, **kw)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol)
    # Scores come from fp32 scores of the same inputs in either dtype: tight in both.
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_triton_at_gpu_tile_sizes():
    # The H200 configs (K1 128 x 64, K2 128 keys x 64 queries, the group split in two) on sequences that
    # are not multiples of the tiles: the band / interior / tail split of K2's query loop at real sizes.
    lens, hq, hk, d = [200, 130, 64], 4, 2, 16
    q, k, v = _qkv(lens, hq, hk, d)
    cfg = {"fwd": {"block_m": 128, "block_n": 64}, "scores": {"block_m": 64, "block_n": 128, "split": 2}}
    for window in (None, 70):
        kw = dict(cu_seqlens=_cu(lens), scale=0.3, score_window=window)
        want = implementation(OP, "reference")(q, k, v, **kw)
        got = ts.attention_with_key_scores(q, k, v, config=cfg, **kw)  # max_seqlen read from cu_seqlens
        torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=2e-5)
        assert got[2] is None


def test_public_op_dispatch_and_return_forms(monkeypatch):
    lens, hq, hk, d = [9, 20], 4, 2, 16
    q, k, v = _qkv(lens, hq, hk, d)
    kw = dict(cu_seqlens=_cu(lens), scale=0.25, score_window=4)
    assert resolve(OP, "cpu").name == "reference"
    out, scores = attention_with_key_scores(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and scores.shape == (29, hk) and scores.dtype == torch.float32
    out3, scores3, heads = attention_with_key_scores(q, k, v, return_head_scores=True, **kw)
    assert torch.equal(out3, out) and torch.equal(scores3, scores)
    torch.testing.assert_close(heads.view(29, hk, 2).sum(-1), scores)
    monkeypatch.setenv("INFERCORE_BACKEND", f"{OP}:triton")
    assert resolve(OP, "cpu").name == "triton"
    got = attention_with_key_scores(q.half(), k.half(), v.half(), max_seqlen=20, **kw)
    torch.testing.assert_close(got[0], out.half(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[1], scores, atol=1e-3, rtol=1e-3)
    empty = attention_with_key_scores(q[:0], k[:0], v[:0], cu_seqlens=_cu([0, 0]), scale=0.25)
    assert empty[0].shape == (0, hq, d) and empty[1].shape == (0, hk)


def test_default_config_for_the_h200(monkeypatch):
    # What the GPU would launch, checked here: the group split that fills 132 SMs, shared memory that fits.
    class Cap:
        multiprocessors = 132

    monkeypatch.setattr(ts, "triton_interpreter", lambda: False)
    monkeypatch.setattr(ts, "capability", lambda device: Cap)

    def cfg(T, hq, hk, d, window=None, dtype=torch.bfloat16, B=1):
        q, k = torch.empty(T, hq, d, dtype=dtype), torch.empty(T, hk, d, dtype=dtype)
        return ts.default_config(q, k, B, T, window)

    assert cfg(4096, 32, 8, 128)["scores"]["split"] == 4  # 256 key-tile programs -> 1024
    assert cfg(4096, 32, 8, 128)["scores"]["num_warps"] == 4 and cfg(4096, 32, 32, 128)["scores"]["num_warps"] == 8
    assert cfg(8192, 32, 8, 128)["scores"]["split"] == 2
    assert cfg(4096, 32, 8, 128, window=64)["scores"]["split"] == 1
    assert cfg(4096, 32, 8, 128, window=64)["scores"]["block_m"] == ts.TUNING[128]["scores_window"]["block_m"]
    assert cfg(4096, 32, 32, 128)["scores"]["split"] == 1  # MHA: nothing to split
    assert cfg(512, 12, 2, 64)["scores"]["split"] == 6  # never a share that does not divide the group
    for d in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            c = cfg(1024, 8, 2, d, dtype=dtype)
            fwd, sc = c["fwd"], c["scores"]
            elem = 2 if dtype == torch.bfloat16 else 4
            if elem == 2 and d in (64, 128):  # the tiles measured on the H200 run as they are (Triton's pipeline
                assert fwd == ts.TUNING[d]["fwd"]  # holds fewer buffers than the budget's estimate counts)
                continue
            assert (fwd["block_m"] + 2 * fwd["num_stages"] * fwd["block_n"]) * d * elem <= ts._SMEM_BUDGET
            assert (sc["block_n"] + sc["num_stages"] * sc["block_m"]) * d * elem <= ts._SMEM_BUDGET
            assert min(fwd["block_m"], fwd["block_n"], sc["block_m"], sc["block_n"]) >= 16  # tl.dot


# ---- bad inputs ----------------------------------------------------------------------------------

_Q, _K = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
_GOOD = dict(q=_Q, k=_K, v=_K.clone(), cu_seqlens=_cu([2, 3]), scale=0.3)


@pytest.mark.parametrize("change,err,match", [
    ({"q": _Q.double()}, TypeError, "q must have dtype"),
    ({"q": _Q[0]}, ValueError, "q must be 3-D"),
    ({"q": [1.0]}, TypeError, "q must be a torch.Tensor"),
    ({"k": _K.half()}, TypeError, "k must have the dtype of q"),
    ({"v": _K[:, :1].clone()}, ValueError, "v has shape"),
    ({"k": torch.randn(4, 2, 8)}, ValueError, "k has shape"),
    ({"k": torch.randn(5, 2, 4), "v": torch.randn(5, 2, 4)}, ValueError, "k has shape"),
    ({"k": torch.randn(5, 3, 8), "v": torch.randn(5, 3, 8)}, ValueError, "q heads \\(4\\) must be a multiple of k"),
    ({"cu_seqlens": _cu([2, 3]).long()}, TypeError, "cu_seqlens must have dtype"),
    ({"cu_seqlens": _cu([2, 3]).view(1, 3)}, ValueError, "cu_seqlens must be 1-D"),
    ({"cu_seqlens": _cu([2, 2])}, ValueError, "cu_seqlens must start at 0 and end at T"),
    ({"cu_seqlens": torch.tensor([0, 4, 3, 5], dtype=I32)}, ValueError, "cu_seqlens must be non-decreasing"),
    ({"scale": 0.0}, ValueError, "scale must be a finite number > 0"),
    ({"scale": math.nan}, ValueError, "scale"),
    ({"scale": "0.3"}, TypeError, "scale must be a number"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"score_window": 0}, ValueError, "score_window must be > 0"),
    ({"score_window": 2.0}, TypeError, "score_window must be an int"),
    ({"score_window": True}, TypeError, "score_window"),
    ({"max_seqlen": -1}, ValueError, "max_seqlen"),
    ({"return_head_scores": 1}, TypeError, "return_head_scores must be a bool"),
])  # fmt: skip
def test_bad_inputs_name_the_argument(change, err, match):
    with pytest.raises(err, match=f"attention_with_key_scores: {match}"):
        attention_with_key_scores(**{**_GOOD, **change})


def test_triton_rejects_a_split_that_does_not_divide_the_group():
    cfg = {"fwd": {"block_m": 16, "block_n": 16}, "scores": {"block_m": 16, "block_n": 16, "split": 3}}
    with pytest.raises(ValueError, match="split 3 must divide"):
        ts.attention_with_key_scores(_Q, _K, _K, cu_seqlens=_cu([5]), scale=0.3, config=cfg)


# ---- select_kv_tokens ----------------------------------------------------------------------------


def _pooled_loop(scores, lens, window, kernel):
    """Per sequence and head: each candidate's max score over its neighbours among the candidates."""
    r, out, s0 = kernel // 2, [], 0
    for L in lens:
        n = L - window
        s = scores[s0 : s0 + n].T.tolist()
        out.append([[max(row[max(0, i - r) : min(n, i + r + 1)]) for i in range(n)] for row in s])
        s0 += L
    return out


def _select_loop(scores, lens, budget, window, kernel):
    pooled, picked = _pooled_loop(scores, lens, window, kernel), []
    for b, L in enumerate(lens):
        n = L - window
        heads = []
        for row in pooled[b]:
            top = sorted(range(n), key=lambda i: -row[i])[: budget - window]
            heads.append(sorted(top + list(range(n, L))))
        picked.append(heads)
    return torch.tensor(picked)


@pytest.mark.parametrize("budget,window", [(8, 3), (5, 5), (9, 0), (1, 0)])
def test_select_kv_tokens_without_pooling_matches_a_loop(budget, window):
    lens = [12, 30, 9]
    scores = torch.rand(sum(lens), 3)  # continuous: no ties
    got = select_kv_tokens(scores, _cu(lens), budget, window=window, pool_kernel=1)
    assert got.dtype == torch.int64 and got.shape == (3, 3, budget)
    assert torch.equal(got, _select_loop(scores, lens, budget, window, 1))


@pytest.mark.parametrize("kernel", [3, 7, 31])
def test_select_kv_tokens_with_pooling(kernel):
    # Pooling makes plateaus (ties), which top-k may break either way: check the picked candidates are a
    # top set of the pooled scores, the window is kept, and the rest of the contract.
    lens, budget, window = [20, 41, 16], 12, 4
    scores = torch.rand(sum(lens), 2)
    scores[3] = 5.0  # a heavy hitter: its neighbours (in its own sequence only) inherit it
    got = select_kv_tokens(scores, _cu(lens), budget, window=window, pool_kernel=kernel)
    want = _select_loop(scores, lens, budget, window, kernel)
    pooled = _pooled_loop(scores, lens, window, kernel)
    for b, L in enumerate(lens):
        for h in range(2):
            idx = got[b, h].tolist()
            assert idx == sorted(set(idx)) and len(idx) == budget and 0 <= idx[0] and idx[-1] < L
            assert idx[budget - window :] == list(range(L - window, L))
            row = pooled[b][h]
            top = want[b, h, : budget - window].tolist()
            assert sorted(row[i] for i in idx[: budget - window]) == sorted(row[i] for i in top)
    if kernel <= 2 * (budget - window) - 1:  # the heavy hitter's whole neighbourhood fits in the budget
        hood = set(range(max(0, 3 - kernel // 2), 3 + kernel // 2 + 1))
        assert all(hood <= set(got[0, h].tolist()) for h in range(2))


def test_select_kv_tokens_keeps_the_heavy_hitters_of_real_scores():
    # End to end: SnapKV scores of a sequence whose queries all attend to two keys pick those keys.
    L, hq, hk, d = 48, 4, 2, 16
    q, k, v = _qkv([L], hq, hk, d)
    k[[5, 17]] = q[-8:].mean(0).view(hk, 2, d).mean(1) * 6  # aligned with the window's queries
    _, scores = attention_with_key_scores(q, k, v, cu_seqlens=_cu([L]), scale=d**-0.5, score_window=8)
    idx = select_kv_tokens(scores, _cu([L]), 10, window=8, pool_kernel=1)
    for h in range(hk):
        assert idx[0, h].tolist() == [5, 17, *range(40, 48)]


@pytest.mark.parametrize("change,err,match", [
    ({"budget": 6}, ValueError, "budget \\(6\\) exceeds the shortest sequence \\(5 tokens\\)"),
    ({"budget": 0}, ValueError, "budget must be > 0"),
    ({"budget": 2.0}, TypeError, "budget must be an int"),
    ({"window": 5}, ValueError, "window \\(5\\) must not exceed budget"),
    ({"window": -1}, ValueError, "window must be >= 0"),
    ({"pool_kernel": 4}, ValueError, "pool_kernel must be odd"),
    ({"pool_kernel": 0}, ValueError, "pool_kernel must be > 0"),
    ({"key_scores": torch.rand(12, 2, 1)}, ValueError, "key_scores must be 2-D"),
    ({"key_scores": torch.ones(12, 2, dtype=torch.int32)}, TypeError, "key_scores must be a floating tensor"),
    ({"cu_seqlens": _cu([5, 7]).long()}, TypeError, "cu_seqlens must have dtype"),
    ({"cu_seqlens": _cu([5, 6])}, ValueError, "cu_seqlens must start at 0 and end at T = 12"),
])  # fmt: skip
def test_select_kv_tokens_bad_inputs(change, err, match):
    kw = {"key_scores": torch.rand(12, 2), "cu_seqlens": _cu([5, 7]), "budget": 4, "window": 2, **change}
    with pytest.raises(err, match=f"select_kv_tokens: {match}"):
        select_kv_tokens(kw.pop("key_scores"), kw.pop("cu_seqlens"), kw.pop("budget"), **kw)


# ---- GPU: real shapes, bf16 ----------------------------------------------------------------------


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _gpu_check(lens, hq, hk, d, window, softcap, config=None, max_seqlen=None):
    q, k, v = _qkv(lens, hq, hk, d, torch.bfloat16, "cuda")
    kw = dict(cu_seqlens=_cu(lens, "cuda"), scale=d**-0.5, softcap=softcap, score_window=window)
    got = ts.attention_with_key_scores(q, k, v, head_scores=True, config=config, max_seqlen=max_seqlen, **kw)
    want = implementation(OP, "reference")(q, k, v, head_scores=True, **kw)
    errs = [_rel(g, w) for g, w in zip(got, want)]
    assert errs[0] < 1e-2 and errs[1] < 1e-3 and errs[2] < 1e-3, errs
    return got


GPU_CASES = [
    # lens, Hq, Hk, D, window, softcap
    ([1000, 4096, 37, 2053], 32, 8, 128, None, None),  # Llama-3-8B heads, H2O
    ([1000, 4096, 37, 2053], 32, 8, 128, 64, None),  # SnapKV window
    ([4096], 32, 32, 128, None, None),  # Llama-2-7B heads
    ([1500, 333], 16, 8, 256, 32, 50.0),  # Gemma-2-like: head_dim 256, softcap
    ([777, 2048, 1], 8, 8, 64, None, None),  # head_dim 64
    ([300, 129], 12, 4, 96, None, 30.0),  # head_dim 96 (padded to 128)
]


@pytest.mark.gpu
def test_gpu_triton_selected_on_cuda():
    assert resolve(OP, "cuda").name == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_bf16(case):
    _gpu_check(*case)


@pytest.mark.gpu
def test_gpu_public_op_matches_the_kernel():
    lens = [513, 2048]
    q, k, v = _qkv(lens, 32, 8, 128, torch.bfloat16, "cuda")
    kw = dict(cu_seqlens=_cu(lens, "cuda"), scale=128**-0.5, score_window=64)
    out, scores = attention_with_key_scores(q, k, v, **kw)
    o2, s2, _ = ts.attention_with_key_scores(q, k, v, **kw)
    assert torch.equal(out, o2) and torch.equal(scores, s2)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    {"fwd": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
     "scores": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "split": 1}},
    {"fwd": {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
     "scores": {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3, "split": 4}},
    {"fwd": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
     "scores": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "split": 2}},
])  # fmt: skip
def test_gpu_bf16_other_configs(config):
    # The configs the benchmark sweeps, on ragged GQA lengths, with and without a window.
    for window in (None, 64):
        _gpu_check([1000, 4096, 37], 32, 8, 128, window, None, config=config)


@pytest.mark.gpu
def test_gpu_offsets_past_2_31_elements():
    # 520 sequences x 1025 tokens x 32 heads x 128 = 2.18e9 elements of q: the last sequences' rows lie past
    # 2**31, where int32 offsets would wrap. Checked against the reference on the first and last sequences.
    lens, hq, hk, d = [1025] * 520, 32, 8, 128
    T = sum(lens)
    assert T * hq * d > 2**31
    q, k, v = (torch.randn(T, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))
    cu = _cu(lens, "cuda")
    out, scores, heads = ts.attention_with_key_scores(q, k, v, cu_seqlens=cu, scale=d**-0.5, max_seqlen=1025,
                                                      head_scores=True)  # fmt: skip
    ref = implementation(OP, "reference")
    for s0 in (0, T - 2 * 1025, T - 1025):
        sl = slice(s0, s0 + 1025)
        o, s, h = ref(q[sl], k[sl], v[sl], cu_seqlens=_cu([1025], "cuda"), scale=d**-0.5, head_scores=True)
        assert _rel(out[sl], o) < 1e-2 and _rel(scores[sl], s) < 1e-3 and _rel(heads[sl], h) < 1e-3, s0
