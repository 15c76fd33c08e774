"""ops.moe.cpu_native: the C host kernels (built here with the system compiler) against the references: the routed
experts against ``moe_experts_ref`` (bf16: one rounding per token instead of one per pair, other fp32 summation
order), in several shapes (K not a multiple of the vector width, repeated experts, tokens with no pair under
expert parallelism, more tokens per expert than one pass takes), the dense GEMV against fp32 ``F.linear``; the
out-of-range id named; the layout classes on top of them; and the switch that turns them off."""

import pytest
import torch
import torch.nn.functional as F

from infercore.ops.moe import cpu_native
from infercore.ops.moe.naive import moe_experts_ref


def test_the_kernels_build_here():
    assert cpu_native.available(), cpu_native.status()
    assert cpu_native.status() in ("avx512-bf16", "avx512", "scalar")


def _case(T, k, E, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1).bfloat16()
    return x, gate_up, down, w, ids


@pytest.mark.parametrize("T,k,E,H,I", [(1, 2, 5, 64, 32), (3, 4, 8, 100, 40), (17, 2, 3, 48, 24), (40, 8, 16, 256, 96)])
def test_moe_experts_match_the_reference(T, k, E, H, I):
    x, gate_up, down, w, ids = _case(T, k, E, H, I, T * 100 + k)
    want = moe_experts_ref(x.float(), gate_up.float(), down.float(), w.float(), ids)
    got = cpu_native.moe_experts_bf16(x, gate_up, down, w, ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    ref16 = moe_experts_ref(x, gate_up, down, w, ids)  # the bf16 reference rounds at the same points
    assert (got.float() - ref16.float()).abs().max() <= (ref16.float() - want).abs().max() * 2 + 2e-2


def test_expert_parallel_offsets_and_unrouted_tokens():
    x, gate_up, down, w, ids = _case(6, 2, 8, 64, 32, 7)
    ids[2] = torch.tensor([0, 1])  # token 2 routes to no expert of this rank
    part = cpu_native.moe_experts_bf16(x, gate_up[4:7], down[4:7], w, ids, expert_offset=4)
    want = moe_experts_ref(x.float(), gate_up[4:7].float(), down[4:7].float(), w.float(), ids, 4)
    torch.testing.assert_close(part.float(), want, atol=3e-2, rtol=3e-2)
    assert torch.equal(part[2], torch.zeros_like(part[2]))
    none = cpu_native.moe_experts_bf16(x, gate_up[4:5], down[4:5], w, torch.zeros_like(ids), expert_offset=4)
    assert torch.equal(none, torch.zeros_like(x))
    bad = ids.clone()
    bad[0, 0] = 8
    with pytest.raises(ValueError, match="expert id 8"):
        cpu_native.moe_experts_bf16(x, gate_up, down, w, bad)


@pytest.mark.parametrize("M,K,N", [(1, 576, 1536), (3, 100, 70), (4, 33, 17), (9, 64, 48)])
def test_linear_matches_fp32(M, K, N):
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).bfloat16()
    wt = torch.randn(N, K, generator=g).bfloat16()
    got = cpu_native.linear_dense(x, wt)
    want = F.linear(x.float(), wt.float())
    # one bf16 rounding of an fp32 sum: within half an ulp of bf16 plus the summation-order difference
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-3 * K**0.5).all()


@pytest.mark.parametrize("M,K,N", [(1, 576, 1536), (1, 1000, 33), (3, 100, 70), (4, 15, 17), (9, 64, 48)])
def test_fp32_linear_matches_fp64(M, K, N):
    g = torch.Generator().manual_seed(M * K + 1)
    x, wt = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    got = cpu_native.linear_dense(x, wt)  # fp32 operands: the fp32 kernel
    assert got.dtype == torch.float32 and got.shape == (M, N)
    want = F.linear(x.double(), wt.double())
    assert ((got.double() - want).abs() <= 1e-6 * K**0.5 * (x.abs().max() * wt.abs().max()).item()).all()


def test_linear_dense_refuses_what_it_cannot_take():
    with pytest.raises(TypeError, match="must both be bf16 or both fp32"):
        cpu_native.linear_dense(torch.ones(1, 8).half(), torch.ones(4, 8).half())
    with pytest.raises(TypeError, match="must both be bf16 or both fp32"):
        cpu_native.linear_dense(torch.ones(1, 8), torch.ones(4, 8).bfloat16())
    with pytest.raises(ValueError, match="x has K = 8"):
        cpu_native.linear_dense(torch.ones(1, 8), torch.ones(4, 9))


def _packed_linear(k: int, n: int, *, bias: bool = False, dtype=torch.float32):
    from infercore.models.layout import CPUPackedLinear

    lin = torch.nn.Linear(k, n, bias=bias, dtype=dtype)
    lin.__class__ = CPUPackedLinear
    lin._pack()
    return lin


def _native_rows(monkeypatch) -> list[int]:
    """The row counts of the native dense GEMV's calls from here on."""
    seen, real = [], cpu_native.linear_dense
    monkeypatch.setattr(cpu_native, "linear_dense", lambda *a: seen.append(a[0].shape[0]) or real(*a))
    return seen


def test_fp32_packed_linear_takes_the_native_gemv_for_decode_rows(monkeypatch):
    lin = _packed_linear(64, 48)
    seen = _native_rows(monkeypatch)
    for rows in (1, 4, 5):
        xr = torch.randn(rows, 64)
        torch.testing.assert_close(lin(xr), F.linear(xr, lin.weight), atol=1e-5, rtol=1e-5)
    assert seen == [1, 4]
    biased = _packed_linear(64, 48, bias=True)  # a bias: the native GEMV, the bias added to its output
    xr = torch.randn(1, 64)
    torch.testing.assert_close(biased(xr), F.linear(xr, biased.weight, biased.bias), atol=1e-5, rtol=1e-5)
    assert seen == [1, 4, 1]


def test_layout_classes_run_the_native_kernels(monkeypatch):
    from infercore.models.layout import CPUPackedExperts

    x, gate_up, down, w, ids = _case(2, 4, 8, 64, 32, 3)
    packed = CPUPackedExperts(gate_up, down)
    assert packed.native and packed.gate_up.data_ptr() == gate_up.data_ptr()  # no second copy
    calls = []
    real = cpu_native.moe_experts_bf16
    monkeypatch.setattr(cpu_native, "moe_experts_bf16", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = packed(x, w, ids)
    assert calls and torch.equal(out, real(x, gate_up, down, w, ids))
    lin = _packed_linear(64, 48, dtype=torch.bfloat16)
    seen = _native_rows(monkeypatch)
    for rows in (1, 4, 5):
        xr = torch.randn(rows, 64).bfloat16()
        y = lin(xr)
        assert y.shape == (rows, 48)
        torch.testing.assert_close(y.float(), F.linear(xr.float(), lin.weight.float()), atol=5e-2, rtol=2e-2)
    assert seen == [1, 4]  # more rows than NATIVE_MAX_ROWS take oneDNN's packed GEMM
    y3 = lin(torch.ones(2, 3, 64).bfloat16())  # leading dims kept
    assert y3.shape == (2, 3, 48)
    from infercore.models import layout

    calls.clear()  # a long prefill (32+ pairs per expert on average) takes oneDNN's GEMMs on the plain weights
    xl, _, _, wl, idsl = _case(8 * layout.NATIVE_MAX_PAIRS_PER_EXPERT // 4, 4, 8, 64, 32, 4)
    torch.testing.assert_close(packed(xl, wl, idsl).float(), moe_experts_ref(xl, gate_up, down, wl, idsl).float(),
                               atol=3e-2, rtol=3e-2)
    assert not calls
    onednn = CPUPackedExperts(gate_up, down, native=False)
    assert not onednn.native and isinstance(onednn.gate_up, list)
    torch.testing.assert_close(onednn(x, w, ids).float(), out.float(), atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="native host kernels take bf16"):
        CPUPackedExperts(gate_up.float(), down.float(), native=True)
    with pytest.raises(TypeError, match="native must be a bool"):
        CPUPackedExperts(gate_up, down, native="yes")


def test_turned_off(monkeypatch):
    monkeypatch.setattr(cpu_native, "_tried", True)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_error", "disabled by INFERCORE_NATIVE_CPU=0")
    assert not cpu_native.available() and cpu_native.status().startswith("unavailable: disabled")
    with pytest.raises(RuntimeError, match="native host kernels"):
        cpu_native.linear_dense(torch.ones(1, 8).bfloat16(), torch.ones(4, 8).bfloat16())
    from infercore.models.layout import CPUPackedExperts

    x, gate_up, down, w, ids = _case(2, 2, 4, 64, 32, 5)
    packed = CPUPackedExperts(gate_up, down)  # the oneDNN-packed copies instead
    assert not packed.native and isinstance(packed.gate_up, list)
    torch.testing.assert_close(packed(x, w, ids).float(), moe_experts_ref(x, gate_up, down, w, ids).float(),
                               atol=3e-2, rtol=3e-2)


def _q4(shape, seed, group=128):
    from infercore.quant.formats import IntWeight

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * shape[-1] ** -0.5
    return IntWeight.quantize(w, bits=4, group_size=group)


def _close(got, want, K):
    return ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-3 * K**0.5).all()


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("N,K,M", [(64, 256, 1), (48, 384, 3), (16, 128, 6), (32, 200, 2), (16, 96, 4)])
def test_q4_linear_matches_the_dequantized_weight(N, K, M, group):
    assert cpu_native.q4_supported(), cpu_native.status()
    q = _q4((N, K), N + K, group)
    codes, sz = cpu_native.pack_q4(q)
    kp = q.padded_in_features  # K padded to the group (K % 64 = 32 with groups of 32: the 16-byte tail)
    assert codes.shape == (N, kp // 2) and codes.dtype == torch.uint8 and sz.shape == (N, 2, kp // group)
    x = torch.randn(M, K).bfloat16()
    want = F.linear(x.float(), q.dequantize().float()[:, :K])
    got = cpu_native.linear_q4(x, codes, sz)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    assert _close(got, want, K)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1"])
@pytest.mark.parametrize("K", [32, 96, 576])
def test_q4_linear_runs_gguf_blocks(qtype, K):
    from infercore.quant.formats import GGUFWeight

    assert cpu_native.q4_supported(), cpu_native.status()
    g = torch.Generator().manual_seed(K)
    w = GGUFWeight.quantize(torch.randn(48, K, generator=g), qtype=qtype)
    codes, sz = cpu_native.pack_gguf_q4(w)
    assert codes.shape == (48, K // 2) and sz.shape == (48, 2, K // 32)
    for M in (1, 2, 4):
        x = torch.randn(M, K, generator=g).bfloat16()
        want = F.linear(x.float(), w.dequantize())
        assert _close(cpu_native.linear_q4(x, codes, sz), want, K)
    assert cpu_native.pack_gguf_q4(GGUFWeight.quantize(torch.randn(16, 64), qtype="q8_0")) is None


def _a8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """What the INT4 GEMV computes with 8-bit activations, in fp32: x rounded to int8 in blocks of 32 (scale
    max |x| / 127, nearest even) against ``codes * scale``, plus the exact bf16 x against the zeros (``w = codes *
    scale + zero``, scale / zero ``[N, K / g]``)."""
    M, K = x.shape
    N, g = codes.shape[0], K // scale.shape[1]
    xb = x.float().reshape(M, K // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = (torch.round(xb * inv) * (amax / 127)).reshape(M, K)
    ws = (codes.float().reshape(N, K // g, g) * scale[..., None]).reshape(N, K)
    wz = zero[..., None].expand(N, K // g, g).reshape(N, K)
    return xq @ ws.T + x.float() @ wz.T


# (format, K): K = 96 ends in a 32-element tail (groups of 32) or pads to the group; Q4_K / Q6_K take whole
# super-blocks of 256
_A8_INT4 = [(f, k) for f in ("int4 g32", "int4 g64", "int4 g128", "int4 g256", "q4_0", "q4_1") for k in (96, 512)] \
    + [("q4_k", 512)]
_A8_INT8 = [("w8a16", 96), ("w8a16", 512), ("q8_0", 96), ("q8_0", 512), ("q6_k", 512)]


@pytest.mark.parametrize("fmt,K", _A8_INT4)
def test_int4_gemv_with_8bit_activations(fmt, K):
    """``set_int8_activations``: the INT4 GEMV over int8 activations (vpdpbusd) gives the int8 reference's values
    (bf16 output rounding apart), differs from the bf16-activation path, and is off again outside the block."""
    from infercore.quant.formats import GGUFWeight, IntWeight

    assert cpu_native.q4_supported(), cpu_native.status()
    g = torch.Generator().manual_seed(K + len(fmt))
    dense = torch.randn(40, K, generator=g) * K**-0.5
    if fmt.startswith("int4"):
        w = IntWeight.quantize(dense, bits=4, group_size=int(fmt[6:]))
        codes, sz = cpu_native.pack_q4(w)
        s = w.scales.float()
        u, scale, zero = w.codes(), s, -w.zero_points() * s  # w = (u - z) s over the padded K
    else:
        w = GGUFWeight.quantize(dense, qtype=fmt) if fmt != "q4_k" else _q4k_blocks(40, K, g)
        codes, sz = cpu_native.pack_gguf_q4(w)
        u, scale, zero = w.affine()
    for M in (1, 2, 3, 4):
        x = torch.randn(M, K, generator=g).bfloat16()
        plain = cpu_native.linear_q4(x, codes, sz)
        with cpu_native.int8_activations() as on:
            assert on
            got = cpu_native.linear_q4(x, codes, sz)
        assert not cpu_native.int8_activations_on()
        want = _a8_reference(F.pad(x, (0, u.shape[1] - K)), u, scale, zero)  # x zero-padded as the GEMV pads it
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 2**-7, (M, float(err))
        assert not torch.equal(got, plain)  # the 8-bit path ran
        assert torch.equal(cpu_native.linear_q4(x, codes, sz), plain)


@pytest.mark.parametrize("fmt,K", _A8_INT8)
def test_int8_gemv_with_8bit_activations(fmt, K):
    """The INT8 GEMV on 8-bit activations where K is a multiple of 64 (per-channel w8a16, GGUF Q8_0 blocks, Q6_K in
    the two-level form), the int8 reference's values; with other K it keeps bf16 activations."""
    from infercore.quant.formats import GGUFWeight, IntWeight

    assert cpu_native.q4_supported(), cpu_native.status()
    g = torch.Generator().manual_seed(K + len(fmt))
    dense = torch.randn(40, K, generator=g) * K**-0.5
    if fmt == "w8a16":
        w = IntWeight.quantize(dense, bits=8, group_size=None, symmetric=True, clip_search=False)
        codes, sz = cpu_native.pack_q8(w)
        s = w.scales.float()
        u, scale, zero = w.codes(), s, -w.zero_points() * s
    else:
        w = GGUFWeight.quantize(dense, qtype="q8_0") if fmt == "q8_0" else _q6k_blocks(40, K, g)
        codes, sz = cpu_native.pack_gguf_q8(w)
        u, scale, zero = w.affine()
    for M in (1, 2, 4):
        x = torch.randn(M, K, generator=g).bfloat16()
        plain = cpu_native.linear_q8(x, codes, sz)
        with cpu_native.int8_activations():
            got = cpu_native.linear_q8(x, codes, sz)
        if K % 64:
            assert torch.equal(got, plain)
            continue
        want = _a8_reference(x, u, scale, zero)
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 2**-7, (M, float(err))
        assert not torch.equal(got, plain)


def _q6k_blocks(n: int, k: int, g: torch.Generator):
    from infercore.quant.formats import GGUFWeight

    raw = torch.randint(0, 256, (n, k // 256, 210), generator=g, dtype=torch.uint8)
    raw[..., 208:210] = ((torch.rand(n, k // 256, 1, generator=g) * 2 - 1) * 1e-3).half().view(torch.uint8)
    return GGUFWeight.from_blocks(raw, "q6_k")


def _q4k_blocks(n: int, k: int, g: torch.Generator):
    from infercore.quant.formats import GGUFWeight

    raw = torch.randint(0, 256, (n, k // 256, 144), generator=g, dtype=torch.uint8)
    for off in (0, 2):  # finite fp16 d and dmin
        raw[..., off : off + 2] = ((torch.rand(n, k // 256, 1, generator=g) * 2 - 1) * 1e-3).half().view(torch.uint8)
    return GGUFWeight.from_blocks(raw, "q4_k")


@pytest.mark.parametrize("N,K", [(64, 256), (48, 100), (16, 576), (32, 8)])
def test_q8_linear_matches_the_dequantized_weight(N, K):
    from infercore.quant.api import quantize_weight

    assert cpu_native.q4_supported(), cpu_native.status()
    g = torch.Generator().manual_seed(N + K)
    q = quantize_weight(torch.randn(N, K, generator=g) * K**-0.5, "w8a16")
    codes, sz = cpu_native.pack_q8(q)
    assert codes.shape == (N, q.padded_in_features) and codes.dtype == torch.uint8 and sz.shape == (N, 2, 1)
    for M in (1, 2, 3, 4):  # K % 32 != 0: the masked tail
        x = torch.randn(M, K, generator=g).bfloat16()
        want = F.linear(x.float(), q.dequantize().float()[:, :K])
        got = cpu_native.linear_q8(x, codes, sz)
        assert got.shape == (M, N) and got.dtype == torch.bfloat16
        assert _close(got, want, K)
    assert cpu_native.pack_q8(quantize_weight(torch.randn(16, 256), "w4a16-g128")) is None
    assert cpu_native.pack_q8(torch.randn(16, 256)) is None


@pytest.mark.parametrize("K", [32, 96, 576])
def test_q8_linear_runs_gguf_q8_0_blocks(K):
    from infercore.quant.formats import GGUFWeight

    assert cpu_native.q4_supported(), cpu_native.status()
    g = torch.Generator().manual_seed(K)
    w = GGUFWeight.quantize(torch.randn(48, K, generator=g), qtype="q8_0")
    codes, sz = cpu_native.pack_gguf_q8(w)
    assert codes.shape == (48, K) and sz.shape == (48, 2, K // 32)
    for M in (1, 3, 7):  # any row count (GGUF Q8_0 has no ATen kernel)
        x = torch.randn(M, K, generator=g).bfloat16()
        assert _close(cpu_native.linear_q8(x, codes, sz), F.linear(x.float(), w.dequantize()), K)
    assert cpu_native.pack_gguf_q8(GGUFWeight.quantize(torch.randn(16, 64), qtype="q4_1")) is None


def test_quantized_gemvs_name_bad_inputs():
    from infercore.quant.api import quantize_weight

    q4 = cpu_native.pack_q4(quantize_weight(torch.randn(16, 256), "w4a16-g128"))
    q8 = cpu_native.pack_q8(quantize_weight(torch.randn(16, 256), "w8a16"))
    for fn, ops in ((cpu_native.linear_q4, q4), (cpu_native.linear_q8, q8)):
        with pytest.raises(TypeError, match="x must be a bf16 CPU tensor"):
            fn(torch.randn(2, 256), *ops)  # fp32 would be read as bf16
        with pytest.raises(ValueError, match=r"K <= 256"):
            fn(torch.randn(2, 300).bfloat16(), *ops)
        with pytest.raises(ValueError, match=r"\[M, K\]"):
            fn(torch.randn(256).bfloat16(), *ops)


def test_pack_q4_takes_int4_groups_of_32_to_256():
    from infercore.quant.api import quantize_weight
    from infercore.quant.formats import IntWeight

    assert cpu_native.pack_q4(quantize_weight(torch.randn(16, 256), "w8a16")) is None
    for group in (32, 64, 128, 256):
        assert cpu_native.pack_q4(IntWeight.quantize(torch.randn(16, 256), bits=4, group_size=group)) is not None
    assert cpu_native.pack_q4(IntWeight.quantize(torch.randn(16, 256), bits=4, group_size=16)) is None
    assert cpu_native.pack_q4(torch.randn(16, 256)) is None


@pytest.mark.parametrize("scheme", ["w4a16-g128", "w8a16"])
@pytest.mark.parametrize("T,k,E", [(1, 2, 6), (5, 3, 8), (12, 2, 4)])
def test_quantized_experts_match_the_reference_and_host_experts_use_them(T, k, E, scheme):
    from infercore.offload.host_experts import NativeQuantExperts, _QuantLinear

    H, I = 256, 128
    g = torch.Generator().manual_seed(T)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16()
    qg = [_QuantLinear(gate_up[e], scheme, torch.bfloat16) for e in range(E)]
    qd = [_QuantLinear(down[e], scheme, torch.bfloat16) for e in range(E)]
    kind = "native4" if scheme == "w4a16-g128" else "native8"
    assert all(q.kind == kind for q in qg + qd)
    experts = NativeQuantExperts.build(qg, qd)
    assert experts is not None and experts.kind == kind
    assert experts.gate_up[0].shape == (E, 2 * I, H // 2 if kind == "native4" else H)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1).bfloat16()
    from infercore.quant.api import quantize_weight

    deq_gu = torch.stack([quantize_weight(gate_up[e], scheme).dequantize() for e in range(E)])
    deq_dn = torch.stack([quantize_weight(down[e], scheme).dequantize() for e in range(E)])
    want = moe_experts_ref(x.float(), deq_gu.float(), deq_dn.float(), w.float(), ids)
    got = experts(x, w, ids, None)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    part = experts(x, w, ids + 2, 2)  # expert parallelism: ids shifted by the offset
    torch.testing.assert_close(part.float(), got.float())
    with cpu_native.disabled():  # ATen's kernels instead where the native ones are off
        assert _QuantLinear(gate_up[0], scheme, torch.bfloat16).kind == ("int4" if kind == "native4" else "int8")
