"""Multi-LoRA shrink / expand: the reference against a per-token formula, the Triton kernels (under
TRITON_INTERPRET=1 on the CPU) against the reference, and bad arguments."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from infercore import ops  # noqa: E402
from infercore.devices import implementation, resolve  # noqa: E402
from infercore.ops.lora import triton as lora_triton  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (T, K, N, r, slice_bounds): odd sizes; slices of uneven widths, one as narrow as 3 columns.
CASES = [
    (5, 24, 19, 4, ()),
    (7, 40, 37, 5, (10,)),
    (6, 33, 37, 3, (10, 23)),
    (4, 17, 29, 2, (3, 11, 26)),
]
# Repeated adapters, -1 in the middle and at both ends, every slot of S = 3 used.
IDX = [-1, 2, 0, 2, -1, 1, 0, -1]


def shrink_formula(x, a, idx):
    """fp64, one token at a time: the definition, independent of the grouping the reference does."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(idx.tolist()):
        if slot >= 0:
            out[t] = a[slot].double() @ x[t].double()
    return out


def expand_formula(y, s, b, idx, bounds):
    """fp64 ``y + delta``: column n takes slice j = #(bounds <= n), gathered per column."""
    N, r = b.shape[1], b.shape[2]
    j = (torch.arange(N)[:, None] >= torch.tensor(bounds, dtype=torch.long)[None, :]).sum(1)
    out = y.double().clone()
    for t, slot in enumerate(idx.tolist()):
        if slot >= 0:
            s_cols = s[t].double().view(len(bounds) + 1, r)[j]  # [N, r]: the slice of s each column uses
            out[t] += (s_cols * b[slot].double()).sum(1)
    return out


def make(T, K, N, r, bounds, dtype, S=3, idx_dtype=torch.int32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ns = len(bounds) + 1
    x = torch.randn(T, K, generator=g).to(dtype)
    a = (torch.randn(S, ns * r, K, generator=g) * 0.3).to(dtype)
    b = (torch.randn(S, N, r, generator=g) * 0.3).to(dtype)
    y = torch.randn(T, N, generator=g).to(dtype)
    idx = torch.tensor((IDX * (T // len(IDX) + 1))[:T], dtype=idx_dtype)
    return x, a, b, y, idx


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("T,K,N,r,bounds", CASES)
def test_reference_matches_formula(T, K, N, r, bounds, dtype):
    x, a, b, y, idx = make(T, K, N, r, bounds, dtype)
    s = ops.lora_shrink(x, a, idx)  # CPU: the reference serves
    assert s.dtype == F32 and s.shape == (T, (len(bounds) + 1) * r)
    torch.testing.assert_close(s.double(), shrink_formula(x, a, idx), rtol=1e-5, atol=1e-5)
    want = expand_formula(y, s, b, idx, bounds)
    y0 = y.clone()
    got = ops.lora_expand_(y, s, b, idx, slice_bounds=bounds)
    assert got is y and got.dtype == dtype
    tol = {F32: 1e-5, F16: 1e-3, BF16: 8e-3}[dtype]  # one rounding to y.dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    none = idx < 0
    assert torch.equal(s[none], torch.zeros_like(s[none])) and torch.equal(got[none], y0[none])
    assert not torch.equal(got[~none], y0[~none])


def test_cpu_dispatch_is_reference():
    assert resolve("lora_shrink", "cpu").name == "reference"
    assert resolve("lora_expand_", "cpu").name == "reference"


def test_slice_bounds_change_the_result():
    # Guards the formula tests against bounds that are ignored (every column on slice 0).
    x, a, b, y, idx = make(6, 16, 20, 4, (7, 13), F32)
    s = ops.lora_shrink(x, a, idx)
    y1 = ops.lora_expand_(y.clone(), s, b, idx, slice_bounds=(7, 13))
    y2 = ops.lora_expand_(y.clone(), s, b, idx, slice_bounds=(8, 13))
    torch.testing.assert_close(y1[:, :7], y2[:, :7])
    torch.testing.assert_close(y1[:, 8:], y2[:, 8:])
    assert (y1[idx >= 0, 7] - y2[idx >= 0, 7]).abs().min() > 1e-4


# --- Triton (interpreter) against the reference ----------------------------------------------------------

TOL = {F32: dict(rtol=1e-5, atol=1e-5), F16: dict(rtol=2e-3, atol=1e-3)}


def both(dtype, T, K, N, r, bounds, idx_dtype=torch.int32, shrink_kw=None, expand_kw=None, x=None):
    x0, a, b, y, idx = make(T, K, N, r, bounds, dtype, idx_dtype=idx_dtype)
    x = x0 if x is None else x
    s_ref = implementation("lora_shrink", "reference")(x, a, idx)
    s_tri = lora_triton.lora_shrink(x, a, idx, **(shrink_kw or {}))
    torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=1e-5)
    none = idx < 0
    assert torch.equal(s_tri[none], torch.zeros_like(s_tri[none]))
    y_ref = implementation("lora_expand_", "reference")(y.clone(), s_ref, b, idx, slice_bounds=bounds)
    y_tri = y.clone()
    out = lora_triton.lora_expand_(y_tri, s_ref, b, idx, slice_bounds=bounds, **(expand_kw or {}))
    assert out is y_tri
    torch.testing.assert_close(y_tri, y_ref, **TOL[dtype])
    assert torch.equal(y_tri[none], y[none])


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("T,K,N,r,bounds", CASES)
def test_triton_matches_reference(T, K, N, r, bounds, dtype):
    both(dtype, T, K, N, r, bounds)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_triton_split_k_and_small_blocks(dtype):
    # Shrink: 3 R blocks (one partial), a K loop of 2 blocks per split, 3 splits summed with atomics.
    # Expand: 3 N blocks straddling both bounds, the rank looped in 2 blocks (one partial).
    both(dtype, 7, 90, 37, 5, (10, 23), shrink_kw=dict(block_r=8, block_k=16, split_k=3),
         expand_kw=dict(block_n=16, block_r=4))  # fmt: skip


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("T,K,N,r,bounds", [*CASES, (37, 40, 70, 4, (16, 40))])
def test_triton_grouped_matches_reference(T, K, N, r, bounds, dtype):
    # Tiles of 16 tokens in slot order, several adapters (and tokens without one) within a tile; 37 tokens:
    # three tiles, the last partial.
    both(dtype, T, K, N, r, bounds, shrink_kw=dict(grouped=True), expand_kw=dict(grouped=True))


@pytest.mark.parametrize("dtype", [F32, F16])
def test_triton_grouped_split_k_blocks_and_given_order(dtype):
    # Shrink: K in 16-wide blocks over 3 splits summed with atomics; expand: 16-column tiles straddling the
    # bounds, the rank looped in one 16-wide block (r = 5 masked). The order passed in (int64, as the
    # engine's host sort gives it) is the one used: any permutation gives the right rows (sorting only makes
    # tiles hold fewer adapters), one that skips a token leaves its row unwritten.
    T = 21
    idx = torch.tensor((IDX * 3)[:T], dtype=torch.int32)
    order = torch.from_numpy(np.argsort(idx.numpy(), kind="stable"))
    both(dtype, T, 90, 37, 5, (10, 23), shrink_kw=dict(grouped=True, order=order, block_k=16, split_k=3),
         expand_kw=dict(grouped=True, order=order, block_n=16))  # fmt: skip
    shuffled = torch.randperm(T, generator=torch.Generator().manual_seed(3))
    both(dtype, T, 40, 37, 5, (10, 23), shrink_kw=dict(grouped=True, order=shuffled),
         expand_kw=dict(grouped=True, order=shuffled))  # fmt: skip
    x, a, b, y, idx = make(T, 24, 19, 4, (), dtype)
    skip = torch.arange(T)
    t = int((idx >= 0).nonzero()[0])
    skip[t] = (t + 1) % T  # token t never visited
    s_bad = lora_triton.lora_shrink(x, a, idx, grouped=True, order=skip, block_k=16, split_k=2)  # zeroed output
    s_ref = implementation("lora_shrink", "reference")(x, a, idx)
    assert torch.equal(s_bad[t], torch.zeros_like(s_bad[t])) and s_ref[t].abs().max() > 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_triton_grouped_sparse_slots(shuffle):
    # The experts' LoRA indexes slot * E + expert: a tile of 16 rows holds a few of hundreds of values. The grouped
    # kernels visit only the slots a tile holds (in any order of its rows), and each row gets its own adapter.
    T, K, N, r, S = 37, 24, 19, 4, 300
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, K, generator=g)
    a = torch.randn(S, r, K, generator=g) * 0.3
    b = torch.randn(S, N, r, generator=g) * 0.3
    y = torch.randn(T, N, generator=g)
    idx = torch.randint(0, S, (T,), generator=g, dtype=torch.int32)
    idx[::7] = -1
    idx[1] = idx[2] = S - 1
    order = torch.randperm(T, generator=g) if shuffle else torch.argsort(idx, stable=True)
    s_tri = lora_triton.lora_shrink(x, a, idx, grouped=True, order=order)
    torch.testing.assert_close(s_tri, shrink_formula(x, a, idx).float(), rtol=1e-5, atol=1e-5)
    y_tri = y.clone()
    lora_triton.lora_expand_(y_tri, s_tri, b, idx, grouped=True, order=order)
    torch.testing.assert_close(y_tri, expand_formula(y, s_tri, b, idx, ()).float(), rtol=1e-5, atol=1e-5)


def test_grouped_threshold_and_public_order(monkeypatch):
    # The public ops take order and check it; from GROUPED_MIN_TOKENS tokens (when set) the grouped kernels run.
    calls = []
    real = lora_triton._grouped_shrink
    monkeypatch.setattr(lora_triton, "_grouped_shrink", lambda *a: (calls.append(a[0].shape[0]), real(*a))[1])
    assert lora_triton.GROUPED_MIN_TOKENS == 32  # the default, from the H100 measurements
    x, a, b, y, idx = make(8, 24, 19, 4, (9,), F32)
    lora_triton.lora_shrink(x, a, idx)
    assert calls == []
    monkeypatch.setattr(lora_triton, "GROUPED_MIN_TOKENS", None)  # None: only when asked
    lora_triton.lora_shrink(x, a, idx)
    assert calls == []
    monkeypatch.setattr(lora_triton, "GROUPED_MIN_TOKENS", 8)
    lora_triton.lora_shrink(x[:7], a, idx[:7])
    assert calls == []
    order = torch.argsort(idx, stable=True)
    s = lora_triton.lora_shrink(x, a, idx, order=order)
    assert calls == [8]
    torch.testing.assert_close(s, implementation("lora_shrink", "reference")(x, a, idx), rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.lora_shrink(x, a, idx, order=order), ops.lora_shrink(x, a, idx))  # CPU: the reference
    with pytest.raises(ValueError, match="order"):
        ops.lora_shrink(x, a, idx, order=order[:-1])
    with pytest.raises(TypeError, match="order"):
        ops.lora_expand_(y, s, b, idx, slice_bounds=(9,), order=order.float())


def test_triton_int64_indices_and_strided_inputs():
    # x rows strided (a column slice of a wider buffer); a and b slots strided (every other slot of a pool).
    big = torch.randn(8, 64)
    x, a, b, y, idx = make(8, 40, 29, 4, (9,), F32, idx_dtype=torch.int64)
    x = big[:, 3:43]
    a_pool = torch.randn(6, *a.shape[1:])
    a_pool[::2] = a
    b_pool = torch.randn(6, *b.shape[1:])
    b_pool[::2] = b
    a_v, b_v = a_pool[::2], b_pool[::2]
    assert not a_v.is_contiguous() and not x.is_contiguous()
    s = lora_triton.lora_shrink(x, a_v, idx)
    torch.testing.assert_close(s, implementation("lora_shrink", "reference")(x, a, idx), rtol=1e-5, atol=1e-5)
    y1, y2 = y.clone(), y.clone()
    lora_triton.lora_expand_(y1, s, b_v, idx, slice_bounds=(9,))
    implementation("lora_expand_", "reference")(y2, s, b, idx, slice_bounds=(9,))
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)


def test_triton_all_without_adapter_and_empty_batch():
    x, a, b, y, _ = make(3, 16, 12, 2, (5,), F32)
    idx = torch.full((3,), -1, dtype=torch.int32)
    for kw in ({}, dict(block_k=8, split_k=2)):
        s = lora_triton.lora_shrink(x, a, idx, **kw)
        assert torch.equal(s, torch.zeros(3, 4))
    y0 = y.clone()
    lora_triton.lora_expand_(y, torch.randn(3, 4), b, idx, slice_bounds=(5,))
    assert torch.equal(y, y0)
    empty = torch.zeros(0, dtype=torch.int32)
    assert lora_triton.lora_shrink(x[:0], a, empty).shape == (0, 4)
    assert lora_triton.lora_expand_(y[:0], torch.zeros(0, 4), b, empty, slice_bounds=(5,)).shape == (0, 12)


def test_triton_bf16_weights_fp32_output():
    # b in another dtype than y (bf16 weights into an fp32 output): the kernel upcasts on load.
    x, a, b, y, idx = make(6, 16, 20, 4, (), F32)
    s = implementation("lora_shrink", "reference")(x, a, idx)
    b16 = b.to(F16)
    y1, y2 = y.clone(), y.clone()
    lora_triton.lora_expand_(y1, s, b16, idx)
    implementation("lora_expand_", "reference")(y2, s, b16, idx)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)


# --- bad arguments -----------------------------------------------------------------------------------------

X, A, I = torch.randn(4, 8), torch.randn(2, 6, 8), torch.tensor([0, 1, -1, 0], dtype=torch.int32)
Y, S_, B = torch.randn(4, 10), torch.randn(4, 6), torch.randn(2, 10, 3)
META = torch.device("meta")


def _shrink(x=X, a=A, indices=I):
    return ops.lora_shrink(x, a, indices)


def _expand(y=None, s=S_, b=B, indices=I, slice_bounds=(4,)):
    return ops.lora_expand_(Y.clone() if y is None else y, s, b, indices, slice_bounds=slice_bounds)


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda: _shrink(x=X.numpy()), TypeError, "lora_shrink: x must be a torch.Tensor"),
        (lambda: _shrink(x=X.int()), TypeError, "lora_shrink: x"),
        (lambda: _shrink(x=X[None]), ValueError, "lora_shrink: x must be 2-D"),
        (lambda: _shrink(x=torch.randn(8, 4).T), ValueError, "lora_shrink: x must be contiguous"),
        (lambda: _shrink(a=A.half()), TypeError, "lora_shrink: a must have the dtype of x"),
        (lambda: _shrink(a=A[0]), ValueError, "lora_shrink: a must be 3-D"),
        (lambda: _shrink(a=torch.randn(2, 6, 9)), ValueError, "lora_shrink: a [S, R, K] must have K"),
        (lambda: _shrink(a=A[:0]), ValueError, "lora_shrink: a must have S"),
        (lambda: _shrink(a=A[:, :0]), ValueError, "lora_shrink: a must have rows"),
        (lambda: _shrink(indices=I.float()), TypeError, "lora_shrink: indices"),
        (lambda: _shrink(indices=I.short()), TypeError, "lora_shrink: indices"),
        (lambda: _shrink(indices=I[:3]), ValueError, "lora_shrink: indices must be 1-D [4]"),
        (lambda: _shrink(indices=I[None]), ValueError, "lora_shrink: indices must be 1-D [4]"),
        (lambda: _shrink(a=A.to(META)), ValueError, "lora_shrink: a is on meta"),
        (lambda: _shrink(indices=I.to(META)), ValueError, "lora_shrink: indices is on meta"),
        (lambda: _expand(y=Y.long()), TypeError, "lora_expand_: y"),
        (lambda: _expand(y=Y[0]), ValueError, "lora_expand_: y must be 2-D"),
        (lambda: _expand(y=torch.randn(10, 4).T), ValueError, "lora_expand_: y must be contiguous"),
        (lambda: _expand(s=S_.half()), TypeError, "lora_expand_: s"),
        (lambda: _expand(s=S_[:, :5]), ValueError, "lora_expand_: s must be [T, n_slices * r] = [4, 2 * 3]"),
        (lambda: _expand(s=S_[:3]), ValueError, "lora_expand_: s must be"),
        (lambda: _expand(s=S_[None]), ValueError, "lora_expand_: s must be 2-D"),
        (lambda: _expand(b=B.int()), TypeError, "lora_expand_: b"),
        (lambda: _expand(b=B[0]), ValueError, "lora_expand_: b must be 3-D"),
        (lambda: _expand(b=torch.randn(2, 11, 3)), ValueError, "lora_expand_: b [S, N, r] must have N"),
        (lambda: _expand(b=B[..., :0]), ValueError, "lora_expand_: b must have r"),
        (lambda: _expand(slice_bounds=()), ValueError, "lora_expand_: s must be [T, n_slices * r] = [4, 1 * 3]"),
        (lambda: _expand(slice_bounds=(0,)), ValueError, "lora_expand_: slice_bounds must be strictly"),
        (lambda: _expand(slice_bounds=(10,)), ValueError, "lora_expand_: slice_bounds must be strictly"),
        (lambda: _expand(s=torch.randn(4, 9), slice_bounds=(5, 5)), ValueError, "lora_expand_: slice_bounds"),
        (lambda: _expand(s=torch.randn(4, 9), slice_bounds=(6, 3)), ValueError, "lora_expand_: slice_bounds"),
        (lambda: _expand(slice_bounds=(4.0,)), TypeError, "lora_expand_: slice_bounds must hold ints"),
        (lambda: _expand(slice_bounds=(True,)), TypeError, "lora_expand_: slice_bounds must hold ints"),
        (lambda: _expand(slice_bounds=4), TypeError, "lora_expand_: slice_bounds must be a tuple"),
        (lambda: _expand(s=torch.randn(4, 15), slice_bounds=(1, 2, 3, 4)), ValueError, "at most 4 slices"),
        (lambda: _expand(indices=I.float()), TypeError, "lora_expand_: indices"),
        (lambda: _expand(indices=I[:2]), ValueError, "lora_expand_: indices must be 1-D [4]"),
        (lambda: _expand(b=B.to(META)), ValueError, "lora_expand_: b is on meta"),
        (lambda: _expand(s=S_.to(META)), ValueError, "lora_expand_: s is on meta"),
    ],
)
def test_bad_arguments(call, exc, words):
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        call()


def test_valid_variants_accepted():
    # The checks above must not reject what the ops take: int64 indices, bf16 b into an fp32 y, a list of bounds.
    _shrink(indices=I.long())
    y = _expand(b=B.bfloat16(), slice_bounds=[4])
    assert y.shape == (4, 10)
    y = _expand(s=torch.randn(4, 12), slice_bounds=(1, 5, 9))
    assert y.shape == (4, 10)
