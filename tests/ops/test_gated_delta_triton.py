"""Gated delta rule Triton kernels (chunked prefill, decode) against the fp32 reference,
under TRITON_INTERPRET=1 on the CPU: tiny fp32 shapes, ragged batches with lengths that are not
multiples of the chunk (including 1 and 0), grouped value heads, l2-normalised q/k, state slots."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore.devices import implementation  # noqa: E402
from infercore.ops.gated_delta import chunk as gdr_chunk  # noqa: E402
from infercore.ops.gated_delta import triton as gdr_triton  # noqa: E402
from infercore.ops.gated_delta.naive import (  # noqa: E402
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule,
)

i32 = torch.int32


def _inputs(lens, Hk, Hv, K, V, seed=0, normalize_k=False):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=i32)
    T = int(cu[-1])
    q, k = torch.randn(T, Hk, K, generator=g), torch.randn(T, Hk, K, generator=g)
    if normalize_k:  # without in-kernel l2norm, unit keys keep the delta rule contractive
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(T, Hv, V, generator=g)
    gate = -torch.rand(T, Hv, generator=g) * 0.3
    beta = torch.rand(T, Hv, generator=g)
    return cu, q, k, v, gate, beta


def _check_prefill(fn, lens, Hk, Hv, K, V, l2, seed=0, atol=2e-5):
    cu, q, k, v, gate, beta = _inputs(lens, Hk, Hv, K, V, seed=seed, normalize_k=not l2)
    B = len(lens)
    pool = torch.randn(B + 3, Hv, K, V)
    slots = torch.randperm(B + 3)[:B].to(i32)
    init = torch.tensor([b % 3 != 1 for b in range(B)])
    got_pool, want_pool = pool.clone(), pool.clone()
    kw = dict(cu_seqlens=cu, state_slots=slots, has_initial_state=init, scale=0.25, use_qk_l2norm=l2)
    got = fn(q, k, v, gate, beta, got_pool, **kw)
    want = chunk_gated_delta_rule_ref(q, k, v, gate, beta, want_pool, **kw)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    # final states in their slots; slots no sequence owns stay untouched
    torch.testing.assert_close(got_pool, want_pool, atol=atol, rtol=1e-4)


@pytest.mark.parametrize(
    "chunk,lens,l2",
    [
        (16, [37, 1, 16, 20], True),
        (32, [33, 0, 64, 5], False),
        (64, [70, 1, 63], True),
        (64, [129], False),
    ],
)
def test_chunked_prefill_matches_reference(chunk, lens, l2):
    fn = lambda *a, **kw: gdr_chunk.chunk_gated_delta_rule_(*a, chunk_size=chunk, **kw)  # noqa: E731
    _check_prefill(fn, lens, Hk=2, Hv=4, K=16, V=32, l2=l2)


def test_chunked_prefill_odd_head_dims_and_registered_default():
    # K=24, V=20: not powers of two, so the kernels' K/V masks are exercised; "triton" = chunked, C=64.
    _check_prefill(implementation("chunk_gated_delta_rule_", "triton"), [66, 3], Hk=1, Hv=2, K=24, V=20, l2=True)


def test_chunked_prefill_head_dim_32():
    fn = lambda *a, **kw: gdr_chunk.chunk_gated_delta_rule_(*a, chunk_size=32, **kw)  # noqa: E731
    _check_prefill(fn, [45, 2], Hk=2, Hv=2, K=32, V=32, l2=True, seed=3)


def test_chunk_layout_ragged():
    cu = torch.tensor([0, 3, 3, 67, 68], dtype=i32)  # lengths 3, 0, 64, 1
    off, info = gdr_chunk.chunk_layout(cu, 68, 16)
    assert off.tolist() == [0, 1, 1, 5, 6]
    assert info.shape == (68 // 16 + 4, 2)
    assert info[:6].tolist() == [[0, 0], [2, 3], [2, 19], [2, 35], [2, 51], [3, 67]]
    assert (info[6:, 0] == -1).all()


@pytest.mark.parametrize("block_v,l2", [(None, True), (16, False)])
def test_decode_matches_recurrence_in_place(block_v, l2):
    B, Hk, Hv, K, V = 3, 2, 4, 32, 32
    _, q, k, v, gate, beta = _inputs([B], Hk, Hv, K, V, seed=5, normalize_k=not l2)
    pool = torch.randn(5, Hv, K, V)
    slots = torch.tensor([4, 0, 2], dtype=i32)
    want_pool = pool.clone()
    # block_v=16 splits the value dim across two programs per head
    out = gdr_triton.fused_recurrent_gated_delta_rule_(
        q, k, v, gate, beta, pool, state_slots=slots, scale=0.3, use_qk_l2norm=l2, block_v=block_v
    )
    for b in range(B):
        t = slice(b, b + 1)
        o, S = recurrent_gated_delta_rule(
            q[t], k[t], v[t], gate[t], beta[t], want_pool[slots[b]], scale=0.3, use_qk_l2norm=l2
        )
        torch.testing.assert_close(out[b], o[0], atol=1e-5, rtol=1e-4)
        want_pool[slots[b]] = S
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-4)


def test_decode_registered_handles_strided_inputs():
    B, Hk, Hv, K, V = 2, 1, 2, 16, 16
    _, q, k, v, gate, beta = _inputs([B], Hk, Hv, K, V, seed=7)
    qkv = torch.cat([q, k], dim=-1)  # q as a strided view of a projection, k with other strides
    kpad = torch.cat([k, torch.zeros(B, Hk, 8)], dim=-1)
    pool = torch.randn(3, Hv, K, V)
    want_pool = pool.clone()
    slots = torch.tensor([2, 0], dtype=i32)
    step = implementation("fused_recurrent_gated_delta_rule_", "triton")
    out = step(qkv[..., :K], kpad[..., :K], v, gate, beta, pool, state_slots=slots, scale=0.5, use_qk_l2norm=True)
    ref = implementation("fused_recurrent_gated_delta_rule_", "reference")
    want = ref(q, k, v, gate, beta, want_pool, state_slots=slots, scale=0.5, use_qk_l2norm=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-4)


def test_chunked_prefill_strided_views():
    cu, q, k, v, gate, beta = _inputs([40, 7], 2, 2, 16, 16, seed=9)
    qkv = torch.cat([q, k, v], dim=-1)  # q, k, v as views of one projection, as in the models
    pool = torch.randn(2, 2, 16, 16)
    want_pool = pool.clone()
    kw = dict(cu_seqlens=cu, state_slots=torch.tensor([1, 0], dtype=i32), has_initial_state=torch.tensor([True, True]),
              scale=0.25, use_qk_l2norm=True)  # fmt: skip
    got = gdr_chunk.chunk_gated_delta_rule_(
        qkv[..., :16], qkv[..., 16:32], qkv[..., 32:], gate, beta, pool, chunk_size=16, **kw
    )
    want = chunk_gated_delta_rule_ref(q, k, v, gate, beta, want_pool, **kw)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool, want_pool, atol=2e-5, rtol=1e-4)


def test_chunked_prefill_tiled_configs():
    # K and V split into 16-wide tiles in every kernel that tiles them (the GPU configs use 64-128).
    cfg = {"wu": {"BK": 16, "BV": 16}, "state": {"BV": 16}, "output": {"BV": 16}}
    fn = lambda *a, **kw: gdr_chunk.chunk_gated_delta_rule_(*a, config=cfg, **kw)  # noqa: E731
    _check_prefill(fn, [70, 5], Hk=1, Hv=2, K=32, V=32, l2=True, seed=11)
    _check_prefill(fn, [33], Hk=1, Hv=1, K=32, V=24, l2=False, seed=12)


def test_decode_default_config():
    # H200 sweep: 64-wide value blocks at 4 warps for 128-dim heads
    assert gdr_triton.decode_config(128, 128) == (64, 4)


def test_kernel_knobs_rejected_by_name():
    cu, q, k, v, gate, beta = _inputs([5], 1, 1, 16, 16)
    pool = torch.zeros(1, 1, 16, 16)
    kw = dict(cu_seqlens=cu, state_slots=torch.zeros(1, dtype=i32), has_initial_state=torch.tensor([False]),
              scale=0.25, use_qk_l2norm=True)  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size"):
        gdr_chunk.chunk_gated_delta_rule_(q, k, v, gate, beta, pool, chunk_size=48, **kw)
    with pytest.raises(ValueError, match=r"config\['scan'\]"):
        gdr_chunk.chunk_gated_delta_rule_(q, k, v, gate, beta, pool, config={"scan": {"BV": 16}}, **kw)
    with pytest.raises(ValueError, match=r"config\['wu'\]"):
        gdr_chunk.chunk_gated_delta_rule_(q, k, v, gate, beta, pool, config={"wu": {"BLOCK": 16}}, **kw)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, gate, beta, None, scale=0.25, chunk_size=0)
    with pytest.raises(ValueError, match="block_v"):
        gdr_triton.fused_recurrent_gated_delta_rule_(
            q, k, v, gate, beta, pool, state_slots=kw["state_slots"], scale=0.25, use_qk_l2norm=True, block_v=24
        )
