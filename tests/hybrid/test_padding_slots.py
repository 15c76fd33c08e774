"""Padding rows (state slot -1) in the recurrent decode ops, as the CUDA-graph batch buckets pass
them, and padding sequences in the ragged prefill ops: no state is read or written for them, the real
rows are unaffected, and the Triton kernels (TRITON_INTERPRET=1) agree with the references, padding
rows included (both start those rows from a zero state)."""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore import ops  # noqa: E402
from infercore.devices import implementation  # noqa: E402
from infercore.ops.conv1d import triton as conv_triton  # noqa: E402
from infercore.ops.gated_delta import chunk as gdr_chunk  # noqa: E402
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


# ---------------------------------------------------- the ragged prefill ops: a negative slot is a padding sequence

PREFILL_SLOTS = torch.tensor([2, -1, 0], dtype=torch.int32)  # sequence 1 (tokens 5-7) is padding
INIT = torch.tensor([True, True, False])
CU = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
CU1, INIT1 = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([True])
PAD1 = torch.tensor([-1], dtype=torch.int32)  # one sequence, padding


def _guarded_pool(*shape, generator):
    """``(pool, guarded)``: the pool (4 slots) is a view of ``guarded``, whose first and last slots lie
    just outside it, so a kernel that reads slot -1 gets random data and one that writes it shows."""
    guarded = torch.randn(6, *shape, generator=generator)
    return guarded[1:5], guarded


def _check_guarded(guarded, before, want_rows):
    """Slots of real sequences hold ``want_rows``; every other slot (the pool's last one and the guard
    slots too) is untouched."""
    for s in range(guarded.shape[0]):
        torch.testing.assert_close(guarded[s], want_rows.get(s - 1, before[s]), atol=1e-5, rtol=1e-4)


def _seqs():
    for b, slot in enumerate(PREFILL_SLOTS.tolist()):
        yield b, slot, slice(CU[b].item(), CU[b + 1].item())


@pytest.mark.parametrize("impl", IMPLS)
def test_conv1d_prefill_negative_slot_is_padding(impl):
    g = torch.Generator().manual_seed(0)
    C, W = 8, 4
    x, w, bias = torch.randn(12, C, generator=g), torch.randn(C, W, generator=g), torch.randn(C, generator=g)
    pool, guarded = _guarded_pool(C, W - 1, generator=g)
    before = guarded.clone()
    y = implementation("causal_conv1d_prefill_", impl)(
        x, w, pool, cu_seqlens=CU, state_slots=PREFILL_SLOTS, has_initial_state=INIT, bias=bias, activation="silu"
    )
    want_rows = {}
    for b, slot, t in _seqs():
        hist = before[slot + 1] if slot >= 0 and INIT[b] else torch.zeros(C, W - 1)
        xx = torch.cat([hist, x[t].t()], dim=1)  # [C, W - 1 + L]
        want = torch.stack([(xx[:, j : j + W] * w).sum(1) for j in range(t.stop - t.start)])
        torch.testing.assert_close(y[t], torch.nn.functional.silu(want + bias), atol=1e-5, rtol=1e-5)
        if slot >= 0:
            want_rows[slot] = xx[:, -(W - 1) :]
    _check_guarded(guarded, before, want_rows)


@pytest.mark.parametrize("impl", IMPLS)
def test_gated_delta_prefill_negative_slot_is_padding(impl):
    g = torch.Generator().manual_seed(1)
    Hk, Hv, K, V = 1, 2, 16, 16
    q, k = torch.randn(12, Hk, K, generator=g), torch.randn(12, Hk, K, generator=g)
    v = torch.randn(12, Hv, V, generator=g)
    gate, beta = -torch.rand(12, Hv, generator=g) * 0.3, torch.rand(12, Hv, generator=g)
    pool, guarded = _guarded_pool(Hv, K, V, generator=g)
    before = guarded.clone()
    fn = implementation("chunk_gated_delta_rule_", impl)
    if impl == "triton":  # the smallest chunk keeps the interpreter quick
        fn = lambda *a, **kw: gdr_chunk.chunk_gated_delta_rule_(*a, chunk_size=16, **kw)  # noqa: E731
    o = fn(q, k, v, gate, beta, pool, cu_seqlens=CU, state_slots=PREFILL_SLOTS, has_initial_state=INIT, scale=0.25,
           use_qk_l2norm=True)  # fmt: skip
    want_rows = {}
    for b, slot, t in _seqs():
        init = before[slot + 1] if slot >= 0 and INIT[b] else None
        ow, S = recurrent_gated_delta_rule(q[t], k[t], v[t], gate[t], beta[t], init, scale=0.25, use_qk_l2norm=True)
        torch.testing.assert_close(o[t], ow, atol=1e-5, rtol=1e-4)
        if slot >= 0:
            want_rows[slot] = S
    _check_guarded(guarded, before, want_rows)


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_scan_negative_slot_is_padding(impl):
    g = torch.Generator().manual_seed(2)
    H, P, G, N = 2, 4, 1, 8
    x, dt = torch.randn(12, H, P, generator=g), torch.randn(12, H, generator=g)
    A = -torch.rand(H, generator=g)
    Bm, Cm = torch.randn(12, G, N, generator=g), torch.randn(12, G, N, generator=g)
    pool, guarded = _guarded_pool(H, P, N, generator=g)
    before = guarded.clone()
    kw = dict(D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, math.inf))
    y = implementation("mamba_chunk_scan_", impl)(
        x, dt, A, Bm, Cm, pool, cu_seqlens=CU, state_slots=PREFILL_SLOTS, has_initial_state=INIT, z=None, **kw
    )
    want_rows = {}
    for b, slot, t in _seqs():
        init = before[slot + 1] if slot >= 0 and INIT[b] else None
        yw, S = ssd_recurrent(x[t], dt[t], A, Bm[t], Cm[t], init, z=None, **kw)
        torch.testing.assert_close(y[t], yw, atol=1e-5, rtol=1e-4)
        if slot >= 0:
            want_rows[slot] = S
    _check_guarded(guarded, before, want_rows)


def test_public_prefill_ops_accept_negative_slots():
    # Through the public wrappers (the references on the CPU): the pool's last slot is left alone.
    r = torch.randn
    pool = torch.zeros(2, 4, 2)
    ops.causal_conv1d_prefill_(r(3, 4), r(4, 3), pool, cu_seqlens=CU1, state_slots=PAD1, has_initial_state=INIT1)
    assert not pool.any()
    pool = torch.zeros(2, 2, 4, 4)
    ops.chunk_gated_delta_rule_(r(3, 2, 4), r(3, 2, 4), r(3, 2, 4), -torch.rand(3, 2), torch.rand(3, 2), pool,
                                cu_seqlens=CU1, state_slots=PAD1, has_initial_state=INIT1)  # fmt: skip
    assert not pool.any()
    pool = torch.zeros(2, 2, 4, 8)
    ops.mamba_chunk_scan_(r(3, 2, 4), r(3, 2), -torch.rand(2), r(3, 1, 8), r(3, 1, 8), pool, cu_seqlens=CU1,
                          state_slots=PAD1, has_initial_state=INIT1)  # fmt: skip
    assert not pool.any()
