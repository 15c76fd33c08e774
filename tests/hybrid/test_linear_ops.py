"""Linear-attention / SSM ops: references against transformers' torch code and their own recurrences,
and the Triton kernels against the references (CPU, TRITON_INTERPRET=1, tiny fp32 shapes)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as hf_m2  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qn  # noqa: E402

from infercore.devices import implementation  # noqa: E402
from infercore.ops.conv1d import causal_conv1d_prefill_, causal_conv1d_update_  # noqa: E402
from infercore.ops.conv1d import triton as conv_triton  # noqa: E402
from infercore.ops.gated_delta import chunk_gated_delta_rule_, fused_recurrent_gated_delta_rule_  # noqa: E402
from infercore.ops.gated_delta import triton as gdr_triton  # noqa: E402
from infercore.ops.gated_delta.naive import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402
from infercore.ops.gated_norm import gated_rms_norm  # noqa: E402

# transformers 5.25 renamed MambaRMSNormGated to Mamba2RMSNormGated (same module, same forward)
MambaRMSNormGated = getattr(hf_m2, "Mamba2RMSNormGated", None) or hf_m2.MambaRMSNormGated
from infercore.ops.gated_norm import triton as norm_triton  # noqa: E402
from infercore.ops.mamba import mamba_chunk_scan_, selective_state_update_  # noqa: E402
from infercore.ops.mamba import triton as mamba_triton  # noqa: E402
from infercore.ops.mamba.naive import ssd_chunked, ssd_recurrent  # noqa: E402

# importing the kernel modules registers their "triton" implementations
_KERNELS = (conv_triton, gdr_triton, norm_triton, mamba_triton)

IMPLS = ["reference", "triton"]
i32 = torch.int32


def _ragged(lens):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=i32)
    return cu, int(cu[-1])


# ---------------------------------------------------------------------------------- gated delta


def _gdr_inputs(T, Hk=2, Hv=4, K=8, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, Hk, K, generator=g), torch.randn(T, Hk, K, generator=g)
    v = torch.randn(T, Hv, V, generator=g)
    gate = -torch.rand(T, Hv, generator=g) * 0.5
    beta = torch.rand(T, Hv, generator=g)
    return q, k, v, gate, beta


def test_gated_delta_recurrent_and_chunked_match_transformers():
    q, k, v, gate, beta = _gdr_inputs(37)
    S0 = torch.randn(4, 8, 8)
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, gate, beta, S0, scale=8**-0.5, use_qk_l2norm=True)
    o_chk, s_chk = chunk_gated_delta_rule(
        q, k, v, gate, beta, S0, scale=8**-0.5, use_qk_l2norm=True, chunk_size=16
    )
    o_hf, s_hf = hf_qn.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], gate[None], beta[None], initial_state=S0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    o_hfc, _ = hf_qn.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        gate[None],
        beta[None],
        initial_state=S0[None],
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o_rec, o_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_rec, s_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o_chk, o_hfc[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o_chk, o_rec, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_chk, s_rec, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_gated_delta_ragged_prefill_then_decode(impl):
    lens = [5, 1, 9]
    cu, T = _ragged(lens)
    q, k, v, gate, beta = _gdr_inputs(T + 3, seed=1)  # the last 3 tokens are one decode step
    pool = torch.randn(6, 4, 8, 8)
    slots = torch.tensor([4, 0, 2], dtype=i32)
    init = torch.tensor([True, False, True])
    want_pool = pool.clone()
    fn = implementation("chunk_gated_delta_rule_", impl)
    out = fn(q[:T], k[:T], v[:T], gate[:T], beta[:T], pool, cu_seqlens=cu, state_slots=slots,
             has_initial_state=init, scale=0.3, use_qk_l2norm=True)  # fmt: skip
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, S = recurrent_gated_delta_rule(q[s:e], k[s:e], v[s:e], gate[s:e], beta[s:e],
                                          want_pool[slots[b]] if init[b] else None, scale=0.3,
                                          use_qk_l2norm=True)  # fmt: skip
        torch.testing.assert_close(out[s:e], o, atol=1e-5, rtol=1e-4)
        want_pool[slots[b]] = S
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-4)  # untouched slots unchanged too
    step = implementation("fused_recurrent_gated_delta_rule_", impl)
    d = slice(T, T + 3)
    out = step(q[d], k[d], v[d], gate[d], beta[d], pool, state_slots=slots, scale=0.3, use_qk_l2norm=True)
    for b in range(3):
        t = slice(T + b, T + b + 1)
        o, S = recurrent_gated_delta_rule(q[t], k[t], v[t], gate[t], beta[t], want_pool[slots[b]], scale=0.3,
                                          use_qk_l2norm=True)  # fmt: skip
        torch.testing.assert_close(out[b], o[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(pool[slots[b]], S, atol=1e-5, rtol=1e-4)


def test_gated_delta_validates():
    q, k, v, gate, beta = _gdr_inputs(4)
    pool = torch.zeros(2, 4, 8, 8)
    cu, slots, init = torch.tensor([0, 4], dtype=i32), torch.tensor([0], dtype=i32), torch.tensor([False])
    with pytest.raises(ValueError, match="state_pool"):
        chunk_gated_delta_rule_(q, k, v, gate, beta, pool[:, :2], cu_seqlens=cu, state_slots=slots,
                                has_initial_state=init)  # fmt: skip
    with pytest.raises(TypeError, match="state_slots"):
        chunk_gated_delta_rule_(q, k, v, gate, beta, pool, cu_seqlens=cu, state_slots=slots.long(),
                                has_initial_state=init)  # fmt: skip
    with pytest.raises(ValueError, match="beta"):
        fused_recurrent_gated_delta_rule_(
            q, k, v, gate, beta[:, :2], pool, state_slots=torch.zeros(4, dtype=i32)
        )
    out = chunk_gated_delta_rule_(
        q, k, v, gate, beta, pool, cu_seqlens=cu, state_slots=slots, has_initial_state=init
    )
    assert out.shape == v.shape and pool[0].abs().sum() > 0 and pool[1].abs().sum() == 0


# ---------------------------------------------------------------------------------- conv1d


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bias", [True, False])
def test_conv1d_prefill_matches_transformers_and_chains(impl, bias):
    C, W = 6, 4
    lens = [7, 2, 1]
    cu, T = _ragged(lens)
    x = torch.randn(T, C)
    w, b = torch.randn(C, W), (torch.randn(C) if bias else None)
    pool = torch.randn(5, C, W - 1)
    slots = torch.tensor([3, 1, 0], dtype=i32)
    init = torch.tensor([False, True, True])
    old = pool.clone()
    fn = implementation("causal_conv1d_prefill_", impl)
    y = fn(x, w, pool, cu_seqlens=cu, state_slots=slots, has_initial_state=init, bias=b, activation="silu")
    # Sequence 0 starts from zeros: exactly HF's causal_conv1d_fn.
    want0 = hf_qn.causal_conv1d_fn(x[:7].t()[None], w, b, activation="silu")[0].t()
    torch.testing.assert_close(y[:7], want0, atol=1e-5, rtol=1e-5)
    # Sequences 1, 2 continue from their states: the same as convolving state + inputs.
    for i, (s, e) in enumerate([(7, 9), (9, 10)], start=1):
        xx = torch.cat([old[slots[i]].t(), x[s:e]])
        full = F.conv1d(xx.t()[None], w[:, None], b, groups=C)[0].t()
        torch.testing.assert_close(y[s:e], F.silu(full), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[slots[i]], xx[-(W - 1) :].t())
    torch.testing.assert_close(pool[3], x[4:7].t())
    torch.testing.assert_close(pool[[2, 4]], old[[2, 4]])


@pytest.mark.parametrize("impl", IMPLS)
def test_conv1d_update_matches_transformers(impl):
    B, C, W = 3, 5, 4
    x, w, b = torch.randn(B, C), torch.randn(C, W), torch.randn(C)
    pool = torch.randn(4, C, W - 1)
    slots = torch.tensor([2, 0, 3], dtype=i32)
    # HF keeps W inputs (the oldest is dropped by the conv); ours keeps W - 1.
    hf_state = torch.cat([torch.zeros(B, C, 1), pool[slots.long()]], dim=-1)
    want = hf_qn.causal_conv1d_update(x[:, :, None], hf_state, w, b, activation="silu")[:, :, 0]
    got = implementation("causal_conv1d_update_", impl)(
        x, w, pool, state_slots=slots, bias=b, activation="silu"
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots.long()], hf_state[:, :, 1:])


def test_conv1d_validates():
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update_(torch.randn(2, 4), torch.randn(4, 3), torch.zeros(2, 4, 3),
                              state_slots=torch.zeros(2, dtype=i32))  # fmt: skip
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_prefill_(torch.randn(2, 4), torch.randn(4, 3), torch.zeros(2, 4, 2),
                               cu_seqlens=torch.tensor([0, 2], dtype=i32),
                               state_slots=torch.zeros(1, dtype=i32),
                               has_initial_state=torch.tensor([False]), activation="gelu")  # fmt: skip


# ---------------------------------------------------------------------------------- mamba2


def _ssd_inputs(T, H=4, P=4, G=2, N=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(T, H, P, generator=g), dt=torch.randn(T, H, generator=g),
        A=-torch.rand(H, generator=g) * 2,
        B=torch.randn(T, G, N, generator=g), C=torch.randn(T, G, N, generator=g),
        D=torch.randn(H, generator=g), z=torch.randn(T, H, P, generator=g),
        dt_bias=torch.randn(H, generator=g),
    )  # fmt: skip


def test_ssd_chunked_matches_recurrence():
    a = _ssd_inputs(45)
    S0 = torch.randn(4, 4, 8)
    kw = dict(D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True, dt_limit=(0.0, float("inf")))
    y1, s1 = ssd_recurrent(a["x"], a["dt"], a["A"], a["B"], a["C"], S0, **kw)
    y2, s2 = ssd_chunked(a["x"], a["dt"], a["A"], a["B"], a["C"], S0, chunk_size=16, **kw)
    torch.testing.assert_close(y2, y1, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s2, s1, atol=1e-4, rtol=1e-4)
    # The recurrence itself, one step by hand (head 0, group 0).
    dt = F.softplus(a["dt"][0, 0] + a["dt_bias"][0])
    S = S0[0] * torch.exp(dt * a["A"][0]) + dt * a["x"][0, 0][:, None] * a["B"][0, 0][None, :]
    y = (S @ a["C"][0, 0] + a["D"][0] * a["x"][0, 0]) * F.silu(a["z"][0, 0])
    torch.testing.assert_close(y1[0, 0], y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.01, 0.5)])
def test_ssd_ragged_scan_then_update(impl, dt_limit):
    lens = [6, 3]
    cu, T = _ragged(lens)
    a = _ssd_inputs(T + 2, seed=2)
    pool = torch.randn(4, 4, 4, 8)
    slots = torch.tensor([1, 3], dtype=i32)
    init = torch.tensor([True, False])
    want = pool.clone()
    kw = dict(D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True, dt_limit=dt_limit)
    p = slice(0, T)
    y = implementation("mamba_chunk_scan_", impl)(
        a["x"][p], a["dt"][p], a["A"], a["B"][p], a["C"][p], pool, cu_seqlens=cu, state_slots=slots,
        has_initial_state=init, z=a["z"][p], **kw,
    )  # fmt: skip
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        yr, S = ssd_recurrent(a["x"][s:e], a["dt"][s:e], a["A"], a["B"][s:e], a["C"][s:e],
                              want[slots[b]] if init[b] else None, z=a["z"][s:e], **kw)  # fmt: skip
        torch.testing.assert_close(y[s:e], yr, atol=1e-5, rtol=1e-4)
        want[slots[b]] = S
    torch.testing.assert_close(pool, want, atol=1e-5, rtol=1e-4)
    d = slice(T, T + 2)
    y = implementation("selective_state_update_", impl)(
        a["x"][d], a["dt"][d], a["A"], a["B"][d], a["C"][d], pool, state_slots=slots, z=None, **kw
    )
    for b in range(2):
        t = slice(T + b, T + b + 1)
        yr, S = ssd_recurrent(
            a["x"][t], a["dt"][t], a["A"], a["B"][t], a["C"][t], want[slots[b]], z=None, **kw
        )
        torch.testing.assert_close(y[b], yr[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(pool[slots[b]], S, atol=1e-5, rtol=1e-4)


def test_mamba_validates():
    a = _ssd_inputs(3)
    with pytest.raises(ValueError, match="B and C"):
        selective_state_update_(a["x"], a["dt"], a["A"], a["B"][:, :, :4], a["C"], torch.zeros(3, 4, 4, 8),
                                state_slots=torch.zeros(3, dtype=i32))  # fmt: skip
    with pytest.raises(ValueError, match="dt_limit"):
        mamba_chunk_scan_(a["x"], a["dt"], a["A"], a["B"], a["C"], torch.zeros(1, 4, 4, 8),
                          cu_seqlens=torch.tensor([0, 3], dtype=i32), state_slots=torch.zeros(1, dtype=i32),
                          has_initial_state=torch.tensor([False]), dt_limit=(1.0, 0.5))  # fmt: skip


# ---------------------------------------------------------------------------------- gated norm


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rms_norm_matches_transformers(impl, dtype):
    x, gate = (torch.randn(5, 16) * 2).to(dtype), torch.randn(5, 16).to(dtype)
    fn = implementation("gated_rms_norm", impl)
    qn = hf_qn.Qwen3NextRMSNormGated(16, eps=1e-6)
    m2 = MambaRMSNormGated(16, group_size=4, eps=1e-6)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(16))
        m2.weight.copy_(torch.randn(16))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = qn.float()(x.float(), gate.float()).to(dtype)
    got = fn(x, gate, qn.weight.detach().to(dtype), eps=1e-6, group_size=None, norm_before_gate=True)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    want = m2.float()(x.float(), gate.float()).to(dtype)
    got = fn(x, gate, m2.weight.detach().to(dtype), eps=1e-6, group_size=4, norm_before_gate=False)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_gated_rms_norm_validates():
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm(torch.randn(2, 6), torch.randn(2, 6), torch.ones(6), eps=1e-6, group_size=4)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(torch.randn(2, 6), torch.randn(2, 5), torch.ones(6), eps=1e-6)


def test_ragged_prefill_ops_share_the_batch_checks():
    """cu_seqlens / has_initial_state are checked the same way by the three ragged prefill ops."""
    q, k, v, gate, beta = _gdr_inputs(4)
    a = _ssd_inputs(4)
    slots = torch.tensor([0], dtype=i32)
    calls = {
        "chunk_gated_delta_rule_": lambda cu, init: chunk_gated_delta_rule_(
            q, k, v, gate, beta, torch.zeros(2, 4, 8, 8), cu_seqlens=cu, state_slots=slots, has_initial_state=init),
        "mamba_chunk_scan_": lambda cu, init: mamba_chunk_scan_(
            a["x"], a["dt"], a["A"], a["B"], a["C"], torch.zeros(1, 4, 4, 8), cu_seqlens=cu, state_slots=slots,
            has_initial_state=init),
        "causal_conv1d_prefill_": lambda cu, init: causal_conv1d_prefill_(
            torch.randn(4, 6), torch.randn(6, 4), torch.zeros(1, 6, 3), cu_seqlens=cu, state_slots=slots,
            has_initial_state=init),
    }  # fmt: skip
    cu, init = torch.tensor([0, 4], dtype=i32), torch.tensor([False])
    for op, call in calls.items():
        call(cu, init)  # valid
        with pytest.raises(TypeError, match=f"{op}: cu_seqlens"):
            call(cu.long(), init)
        with pytest.raises(ValueError, match=f"{op}: cu_seqlens"):
            call(cu[:0], torch.zeros(0, dtype=torch.bool))
        with pytest.raises(ValueError, match=f"{op}: has_initial_state"):
            call(cu, init.int())
        with pytest.raises(ValueError, match=f"{op}: has_initial_state"):
            call(cu, torch.tensor([False, True]))
