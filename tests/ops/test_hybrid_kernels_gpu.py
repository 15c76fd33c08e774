"""Hybrid-model kernels (gated delta rule, Mamba2 SSD, causal conv1d, gated RMSNorm) in bf16 at real
model shapes on a CUDA GPU (run on the H200 with ``pytest -m gpu``).

Each Triton kernel runs on bf16 inputs; its reference runs on the same values upcast to fp32 (fp32
math, fp32 states). Outputs and final states are compared by relative RMSE; ragged batches mix
lengths that are not multiples of the chunk size, including 1.
"""

import pytest
import torch
import torch.nn.functional as F

import infercore.ops  # noqa: F401  (registers the Triton kernels)
from infercore.devices import implementation, resolve

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
i32 = torch.int32
LENS = [1000, 1, 63, 2048, 300, 64]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _ragged(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=i32, device=DEV)


def _f32(*ts):
    return tuple(None if t is None else t.float() for t in ts)


def test_triton_selected_for_hybrid_ops():
    for op in (
        "chunk_gated_delta_rule_",
        "fused_recurrent_gated_delta_rule_",
        "mamba_chunk_scan_",
        "selective_state_update_",
        "causal_conv1d_prefill_",
        "causal_conv1d_update_",
        "gated_rms_norm",
    ):
        assert resolve(op, DEV).name == "triton", op


def _gdr_inputs(T, Hk=16, Hv=32, K=128, V=128):
    # Qwen3-Next-style: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), q/k l2-normed in kernel
    q = torch.randn(T, Hk, K, device=DEV, dtype=BF16)
    k = torch.randn(T, Hk, K, device=DEV, dtype=BF16)
    v = torch.randn(T, Hv, V, device=DEV, dtype=BF16)
    g = -torch.rand(Hv, device=DEV).mul(2).exp() * F.softplus(torch.randn(T, Hv, device=DEV) - 2)
    beta = torch.randn(T, Hv, device=DEV).sigmoid().to(BF16)
    return q, k, v, g, beta


def test_gated_delta_prefill_bf16():
    Hv, K, V = 32, 128, 128
    cu = _ragged(LENS)
    T = int(cu[-1])
    q, k, v, g, beta = _gdr_inputs(T)
    B = len(LENS)
    pool = torch.randn(B + 4, Hv, K, V, device=DEV) * 0.3
    slots = torch.randperm(B + 4, device=DEV)[:B].to(i32)
    init = torch.tensor([b % 2 == 0 for b in range(B)], device=DEV)
    got_pool, want_pool = pool.clone(), pool.clone()
    kw = dict(cu_seqlens=cu, state_slots=slots, has_initial_state=init, scale=K**-0.5, use_qk_l2norm=True)
    got = implementation("chunk_gated_delta_rule_", "triton")(q, k, v, g, beta, got_pool, **kw)
    want = implementation("chunk_gated_delta_rule_", "reference")(*_f32(q, k, v, g, beta), want_pool, **kw)
    assert got.dtype == BF16
    assert rel(got, want) < 2e-2
    assert rel(got_pool[slots.long()], want_pool[slots.long()]) < 2e-2
    others = torch.ones(B + 4, dtype=torch.bool, device=DEV)
    others[slots.long()] = False
    assert torch.equal(got_pool[others], pool[others])


def test_gated_delta_prefill_long_single_sequence_bf16():
    # one 8192-token sequence, the benchmark shape: errors must not grow along 128 chunks
    cu = _ragged([8192])
    q, k, v, g, beta = _gdr_inputs(8192, Hk=16, Hv=16)
    pool = torch.zeros(1, 16, 128, 128, device=DEV)
    got_pool, want_pool = pool.clone(), pool.clone()
    kw = dict(cu_seqlens=cu, state_slots=torch.zeros(1, dtype=i32, device=DEV),
              has_initial_state=torch.tensor([False], device=DEV), scale=128**-0.5, use_qk_l2norm=True)  # fmt: skip
    got = implementation("chunk_gated_delta_rule_", "triton")(q, k, v, g, beta, got_pool, **kw)
    want = implementation("chunk_gated_delta_rule_", "reference")(*_f32(q, k, v, g, beta), want_pool, **kw)
    assert rel(got, want) < 2e-2 and rel(got_pool, want_pool) < 2e-2


def test_gated_delta_decode_bf16():
    B, Hv = 256, 32
    q, k, v, g, beta = _gdr_inputs(B, Hv=Hv)
    pool = torch.randn(B + 16, Hv, 128, 128, device=DEV) * 0.3
    slots = torch.randperm(B + 16, device=DEV)[:B].to(i32)
    got_pool, want_pool = pool.clone(), pool.clone()
    kw = dict(state_slots=slots, scale=128**-0.5, use_qk_l2norm=True)
    got = implementation("fused_recurrent_gated_delta_rule_", "triton")(q, k, v, g, beta, got_pool, **kw)
    want = implementation("fused_recurrent_gated_delta_rule_", "reference")(*_f32(q, k, v, g, beta), want_pool, **kw)
    assert rel(got, want) < 1e-2
    assert rel(got_pool, want_pool) < 1e-5  # fp32 state, fp32 math: only summation order differs


def _ssd_inputs(T, H=128, P=64, G=8, N=128):
    # Mamba2-2.7B-like: 128 heads of 64, 8 groups, state 128
    return dict(
        x=torch.randn(T, H, P, device=DEV, dtype=BF16), dt=torch.randn(T, H, device=DEV, dtype=BF16),
        A=-torch.rand(H, device=DEV) * 8, B=torch.randn(T, G, N, device=DEV, dtype=BF16),
        C=torch.randn(T, G, N, device=DEV, dtype=BF16), D=torch.randn(H, device=DEV),
        z=torch.randn(T, H, P, device=DEV, dtype=BF16), dt_bias=torch.randn(H, device=DEV) - 2,
    )  # fmt: skip


def test_mamba_chunk_scan_bf16():
    cu = _ragged(LENS)
    T, B = int(cu[-1]), len(LENS)
    a = _ssd_inputs(T)
    pool = torch.randn(B + 2, 128, 64, 128, device=DEV) * 0.3
    slots = torch.randperm(B + 2, device=DEV)[:B].to(i32)
    init = torch.tensor([b % 2 == 1 for b in range(B)], device=DEV)
    got_pool, want_pool = pool.clone(), pool.clone()
    kw = dict(cu_seqlens=cu, state_slots=slots, has_initial_state=init, dt_softplus=True, dt_limit=(0.0, float("inf")))
    x, dt, A, Bm, Cm, D, z, dtb = (a[n] for n in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"))
    got = implementation("mamba_chunk_scan_", "triton")(x, dt, A, Bm, Cm, got_pool, D=D, z=z, dt_bias=dtb, **kw)
    xf, dtf, Bf, Cf, zf = _f32(x, dt, Bm, Cm, z)
    want = implementation("mamba_chunk_scan_", "reference")(xf, dtf, A, Bf, Cf, want_pool, D=D, z=zf, dt_bias=dtb, **kw)
    assert rel(got, want) < 1e-2
    assert rel(got_pool[slots.long()], want_pool[slots.long()]) < 1e-2


def test_selective_state_update_bf16():
    B = 256
    a = _ssd_inputs(B)
    pool = torch.randn(B + 8, 128, 64, 128, device=DEV) * 0.3
    slots = torch.randperm(B + 8, device=DEV)[:B].to(i32)
    got_pool, want_pool = pool.clone(), pool.clone()
    x, dt, A, Bm, Cm, D, z, dtb = (a[n] for n in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"))
    kw = dict(state_slots=slots, D=D, dt_bias=dtb, dt_softplus=True, dt_limit=(0.0, float("inf")))
    got = implementation("selective_state_update_", "triton")(x, dt, A, Bm, Cm, got_pool, z=z, **kw)
    xf, dtf, Bf, Cf, zf = _f32(x, dt, Bm, Cm, z)
    want = implementation("selective_state_update_", "reference")(xf, dtf, A, Bf, Cf, want_pool, z=zf, **kw)
    assert rel(got, want) < 1e-2
    assert rel(got_pool, want_pool) < 1e-4


def test_causal_conv1d_bf16():
    C, W = 8192, 4  # Qwen3-Next conv_dim = 2 * key_dim + value_dim
    cu = _ragged(LENS)
    T, B = int(cu[-1]), len(LENS)
    x = torch.randn(T, C, device=DEV, dtype=BF16)
    w = torch.randn(C, W, device=DEV, dtype=BF16) * 0.5
    bias = torch.randn(C, device=DEV, dtype=BF16)
    pool = torch.randn(B + 2, C, W - 1, device=DEV, dtype=BF16)
    slots = torch.randperm(B + 2, device=DEV)[:B].to(i32)
    init = torch.tensor([b % 2 == 0 for b in range(B)], device=DEV)
    got_pool, want_pool = pool.clone(), pool.float()
    kw = dict(cu_seqlens=cu, state_slots=slots, has_initial_state=init, activation="silu")
    got = implementation("causal_conv1d_prefill_", "triton")(x, w, got_pool, bias=bias, **kw)
    want = implementation("causal_conv1d_prefill_", "reference")(*_f32(x, w), want_pool, bias=bias.float(), **kw)
    assert rel(got, want) < 1e-2
    assert torch.equal(got_pool.float(), want_pool)  # states are copies of inputs: exact
    xd = torch.randn(B, C, device=DEV, dtype=BF16)
    kw = dict(state_slots=slots, activation="silu")
    got = implementation("causal_conv1d_update_", "triton")(xd, w, got_pool, bias=bias, **kw)
    want = implementation("causal_conv1d_update_", "reference")(*_f32(xd, w), want_pool, bias=bias.float(), **kw)
    assert rel(got, want) < 1e-2
    assert torch.equal(got_pool.float(), want_pool)


@pytest.mark.parametrize(
    "shape,group_size,norm_before_gate",
    [((4096 * 32, 128), None, True), ((4096, 8192), 1024, False)],  # Qwen3-Next per head; Mamba2 groups
)
def test_gated_rms_norm_bf16(shape, group_size, norm_before_gate):
    x = torch.randn(*shape, device=DEV, dtype=BF16) * 3
    gate = torch.randn(*shape, device=DEV, dtype=BF16)
    w = torch.randn(shape[-1], device=DEV, dtype=BF16)
    kw = dict(eps=1e-6, group_size=group_size, norm_before_gate=norm_before_gate)
    got = implementation("gated_rms_norm", "triton")(x, gate, w, **kw)
    want = implementation("gated_rms_norm", "reference")(*_f32(x, gate, w), **kw)
    assert got.dtype == BF16 and rel(got, want) < 1e-2
