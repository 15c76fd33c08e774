"""Padding rows (state slot -1) in the recurrent decode ops, as the CUDA-graph batch buckets pass
them: no state is read or written for them, the real rows are unaffected, and the Triton kernels
(TRITON_INTERPRET=1) agree with the references, padding rows included (both start those rows
from a zero state)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore.devices import implementation  # noqa: E402
from infercore.ops.conv1d import triton as conv_triton  # noqa: E402
from infercore.ops.gated_delta import triton as gdr_triton  # noqa: E402
from infercore.ops.gated_delta.naive import recurrent_gated_delta_rule  # noqa: E402
from infercore.ops.mamba import triton as mamba_triton  # noqa: E402
from infercore.ops.mamba.naive import ssd_recurrent  # noqa: E402

_KERNELS = (conv_triton, gdr_triton, mamba_triton)
IMPLS = ["reference", "triton"]
SLOTS = torch.tensor([2, -1, 0, -1], dtype=torch.int32)  # rows 1 and 3 are padding


def _check_pool(pool, before, want_rows):
    """Slots of real rows hold ``want_rows``; every other slot is untouched."""
    for s in range(pool.shape[0]):
        want = want_rows.get(s, before[s])
        torch.testing.assert_close(pool[s], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_gated_delta_decode_padding_rows(impl):
    g = torch.Generator().manual_seed(0)
    B, Hk, Hv, K, V = 4, 1, 2, 16, 16
    q, k = torch.randn(B, Hk, K, generator=g), torch.randn(B, Hk, K, generator=g)
    v = torch.randn(B, Hv, V, generator=g)
    gate, beta = -torch.rand(B, Hv, generator=g), torch.rand(B, Hv, generator=g)
    pool = torch.randn(3, Hv, K, V, generator=g)
    before = pool.clone()
    out = implementation("fused_recurrent_gated_delta_rule_", impl)(
        q, k, v, gate, beta, pool, state_slots=SLOTS, scale=0.25, use_qk_l2norm=True
    )
    want_rows = {}
    for b, slot in enumerate(SLOTS.tolist()):
        t = slice(b, b + 1)
        init = before[slot] if slot >= 0 else torch.zeros_like(before[0])
        o, S = recurrent_gated_delta_rule(q[t], k[t], v[t], gate[t], beta[t], init, scale=0.25, use_qk_l2norm=True)
        torch.testing.assert_close(out[b], o[0], atol=1e-5, rtol=1e-4)
        if slot >= 0:
            want_rows[slot] = S
    _check_pool(pool, before, want_rows)


@pytest.mark.parametrize("impl", IMPLS)
def test_conv1d_update_padding_rows(impl):
    g = torch.Generator().manual_seed(1)
    B, C, W = 4, 8, 4
    x, w, bias = torch.randn(B, C, generator=g), torch.randn(C, W, generator=g), torch.randn(C, generator=g)
    pool = torch.randn(3, C, W - 1, generator=g)
    before = pool.clone()
    y = implementation("causal_conv1d_update_", impl)(x, w, pool, state_slots=SLOTS, bias=bias, activation="silu")
    want_rows = {}
    for b, slot in enumerate(SLOTS.tolist()):
        hist = before[slot] if slot >= 0 else torch.zeros(C, W - 1)
        xx = torch.cat([hist, x[b][:, None]], dim=1)  # [C, W]
        torch.testing.assert_close(y[b], torch.nn.functional.silu((xx * w).sum(1) + bias), atol=1e-5, rtol=1e-5)
        if slot >= 0:
            want_rows[slot] = xx[:, 1:]
    _check_pool(pool, before, want_rows)


@pytest.mark.parametrize("impl", IMPLS)
def test_selective_state_update_padding_rows(impl):
    g = torch.Generator().manual_seed(2)
    B, H, P, G, N = 4, 4, 4, 2, 8
    x, dt = torch.randn(B, H, P, generator=g), torch.randn(B, H, generator=g)
    A = -torch.rand(H, generator=g) * 2
    Bm, Cm = torch.randn(B, G, N, generator=g), torch.randn(B, G, N, generator=g)
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g)
    pool = torch.randn(3, H, P, N, generator=g)
    before = pool.clone()
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, float("inf")))
    y = implementation("selective_state_update_", impl)(x, dt, A, Bm, Cm, pool, state_slots=SLOTS, z=None, **kw)
    want_rows = {}
    for b, slot in enumerate(SLOTS.tolist()):
        t = slice(b, b + 1)
        init = before[slot] if slot >= 0 else torch.zeros_like(before[0])
        yr, S = ssd_recurrent(x[t], dt[t], A, Bm[t], Cm[t], init, z=None, **kw)
        torch.testing.assert_close(y[b], yr[0], atol=1e-5, rtol=1e-4)
        if slot >= 0:
            want_rows[slot] = S
    _check_pool(pool, before, want_rows)
