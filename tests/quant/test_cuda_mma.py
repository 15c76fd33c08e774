"""MODE 9 (``quant.cuda_mma``, the CUDA stream-K weight-only kernel) on the CPU: the repacks round-trip, and a torch
emulation of what the kernel computes from the packed layout (its nibble / byte map, A fragments, the magic-number
decode and its zero point, the FP8 byte-permute decode with its 2^-120 fold, the per-unit scale words)
matches dequantize() + matmul. The kernel itself runs in test_cuda_mma_gpu.py."""

import math

import pytest
import torch

from infercore.quant import FP8Weight, IntWeight
from infercore.quant import cuda_mma as CM


def _int4(n, k, group=128, sym=False, seed=0):
    torch.manual_seed(seed)
    return IntWeight.quantize(torch.randn(n, k), bits=4, group_size=group, symmetric=sym, clip_search=False)


LAYOUTS_INT4 = [(8, 2), (7, 1), (4, 2)]  # (warps, mt): the default, the 112-channel unit, a 128-channel one


@pytest.mark.parametrize("layout", LAYOUTS_INT4)
@pytest.mark.parametrize("n,k,group,sym", [(300, 256, 128, False), (512, 384, None, True), (256, 512, 256, False),
                                           (264, 128, 128, True)])
def test_int4_repack_round_trip(n, k, group, sym, layout):
    q = _int4(n, k, group, sym)
    words, sw = CM.repack_int4(q, *layout)
    kt = q.padded_in_features // 128
    bn = 16 * layout[0] * layout[1]
    assert CM.block_n("int4", *layout) == bn and CM.unit_bytes("int4", *layout) == bn * 64
    assert words.dtype == torch.int32 and words.numel() == math.ceil(n / bn) * kt * bn * 16
    assert sw.numel() == math.ceil(n / bn) * kt * bn
    codes, s, z = CM.unpack_int4(words, sw, n, q.padded_in_features, *layout)
    assert torch.equal(codes, q.codes())
    groups = CM._unit_groups(q, kt)
    assert torch.equal(z, q.zero_points()[:, groups].int())
    torch.testing.assert_close(s, q.scales[:, groups], rtol=2.0**-18, atol=0)


def _emulate_int4(x: torch.Tensor, words, sw, n, kp, nw=8, mt=2):
    """What wo_mma.cu computes for INT4: per unit and warp, A fragments from the words (word i = s mt + p of a
    lane is component i % 4 of its uint4 i / 4: K step s, m16 tile p; nibble i of lane (g, c) = channel
    g + 8 ((i >> 1) & 1), k = 2c + (i >> 2) + 8 (i & 1)), 128 + q MMAs, the zero point through sum(x), the scale per
    unit."""
    m = x.shape[0]
    wn = 16 * mt
    bn = nw * wn
    nbk, kt = math.ceil(n / bn), kp // 128
    w = words.view(nbk, kt, nw, 2 * mt, 32, 4)  # [nb, kt, warp, j, lane, e]
    sww = sw.view(nbk, kt, nw, 8, 2 * mt)  # [nb, kt, warp, channel g, tile]
    y = torch.zeros(m, nbk * bn, dtype=torch.float64)
    for nb in range(nbk):
        for t in range(kt):
            xt = x[:, t * 128:(t + 1) * 128].double()
            xsum = xt.sum(1)
            for warp in range(nw):
                wq = torch.zeros(wn, 128, dtype=torch.float64)  # channels of the warp x K, 128 + q
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    for j in range(2 * mt):
                        for e in range(4):
                            s, p = (4 * j + e) // mt, (4 * j + e) % mt
                            word = int(w[nb, t, warp, j, lane, e]) & 0xFFFFFFFF
                            for i in range(8):
                                ch = p * 16 + g + 8 * ((i >> 1) & 1)
                                kk = s * 16 + 2 * c + (i >> 2) + 8 * (i & 1)
                                wq[ch, kk] = 128 + ((word >> (4 * i)) & 15)
                tmp = xt @ wq.T  # [m, wn]
                words_sz = sww[nb, t, warp].T.reshape(wn)  # tile t, channel g: channel t * 8 + g of the warp
                scale = (words_sz & ~15).view(torch.float32).double()
                mz = 128 + (words_sz & 15).double()
                y[:, nb * bn + warp * wn:nb * bn + warp * wn + wn] += (tmp - mz * xsum[:, None]) * scale
    return y[:, :n]


@pytest.mark.parametrize("layout", LAYOUTS_INT4)
@pytest.mark.parametrize("group,sym", [(128, False), (None, True)])
def test_int4_kernel_math_emulated(group, sym, layout):
    n, k = 264, 256
    q = _int4(n, k, group, sym, seed=3)
    words, sw = CM.repack_int4(q, *layout)
    x = torch.randn(3, k)
    ref = x.double() @ q.dequantize(torch.float64).T
    got = _emulate_int4(x, words, sw, n, k, *layout)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # scale words: 2^-19


def _prmt(w: int, sel: int, b: int = 0) -> int:
    """PTX ``prmt.b32 d, w, b, sel`` (default mode): result byte i is byte ``sel_i & 7`` of (w, b), replaced by its
    sign bit replicated when ``sel_i & 8``."""
    src = [(w >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 15
        v = src[s & 7]
        out |= ((255 if v & 0x80 else 0) if s & 8 else v) << (8 * i)
    return out


def _fp8x2(w: int, sel: int, bf16: bool = True) -> int:
    """The kernel's fp8x2(): two e4m3 bytes of ``w`` (0, 1 for sel 0x9180; 2, 3 for 0xB3A2) -> two 16-bit floats,
    the value times 2^-120 (bf16) or 2^-8 (fp16)."""
    p = _prmt(w, sel)
    return ((p << 4) & 0x87F087F0) if bf16 else ((p << 7) & 0xBF80BF80)


@pytest.mark.parametrize("bf16", [True, False])
def test_fp8_decode_is_exact(bf16):
    torch.manual_seed(0)
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()  # e4m3 has no infinity; 0x7F / 0xFF are NaN
    dt, fold = (torch.bfloat16, 2.0**120) if bf16 else (torch.float16, 2.0**8)
    for other in torch.randint(0, 256, (4,)).tolist():  # the neighbouring bytes must not leak in
        for pos in range(4):
            got = torch.empty(256)
            for b in range(256):
                w = (other * 0x01010101) & ~(255 << (8 * pos)) | (b << (8 * pos))
                d = _fp8x2(w, 0x9180 if pos < 2 else 0xB3A2, bf16)
                half = (d >> (16 * (pos & 1))) & 0xFFFF
                got[b] = torch.tensor([half], dtype=torch.int32).to(torch.int16).view(dt).float() * fold
            assert torch.equal(got[finite], want[finite])


@pytest.mark.parametrize("warps", [8, 7])
@pytest.mark.parametrize("n,k,block", [(200, 256, None), (256, 384, 128), (130, 128, 128)])
def test_fp8_repack_round_trip(n, k, block, warps):
    torch.manual_seed(1)
    q = FP8Weight.quantize(torch.randn(n, k), **({"block_size": block} if block else {}))
    words, s = CM.repack_fp8(q, warps)
    assert words.numel() == math.ceil(n / (16 * warps)) * (k // 128) * warps * 512
    b, ss = CM.unpack_fp8(words, s, n, k, warps)
    assert torch.equal(b, q.qweight.view(torch.uint8))
    per_unit = q.scale_per_element()[:, ::128]
    assert torch.equal(ss, per_unit.float())


@pytest.mark.parametrize("nw", [8, 7])
def test_fp8_kernel_math_emulated(nw):
    n, k = 136, 256
    torch.manual_seed(2)
    q = FP8Weight.quantize(torch.randn(n, k), block_size=128)
    words, s = CM.repack_fp8(q, nw)
    bn = 16 * nw
    nbk, kt = math.ceil(n / bn), k // 128
    w = words.view(nbk, kt, nw, 4, 32, 4)
    sc = s.view(nbk, kt, nw, 8, 2)  # [nb, kt, warp, g, p]
    x = torch.randn(2, k).double()
    y = torch.zeros(2, nbk * bn, dtype=torch.float64)
    for nb in range(nbk):
        for t in range(kt):
            for warp in range(nw):
                wv = torch.zeros(16, 128, dtype=torch.float64)
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    for j in range(4):
                        for e in range(4):
                            st, p = 2 * j + e // 2, e % 2  # word p: channel g + 8 p
                            word = int(w[nb, t, warp, j, lane, e]) & 0xFFFFFFFF
                            for bb in range(4):
                                bits = (_fp8x2(word, 0x9180 if bb < 2 else 0xB3A2) >> (16 * (bb & 1))) & 0xFFFF
                                v = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
                                wv[g + 8 * p, st * 16 + 2 * c + (bb & 1) + 8 * (bb >> 1)] = v.double().item()
                scale = sc[nb, t, warp].T.reshape(16).double() * 2.0**120
                y[:, nb * bn + warp * 16:nb * bn + warp * 16 + 16] += (x[:, t * 128:(t + 1) * 128] @ wv.T) * scale
    ref = x @ q.dequantize(torch.float64).T
    torch.testing.assert_close(y[:, :n], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind,warps,mt", [("int4", w, m) for w, m in LAYOUTS_INT4] + [("fp8", 8, None),
                                                                                     ("fp8", 7, None)])
def test_stage_puts_the_activation_tile_256_byte_aligned(kind, warps, mt):
    # wo_mma.cu XORs the K step into bits 5-7 of the tile's offset (its swizzle): the tile must start on 256 bytes
    # after the unit's weight and scale words (a 112-channel unit's end at 7616 bytes once made it read past them)
    x_off = CM.stage_bytes(kind, warps, mt) - 16 * CM.BK * 2
    assert x_off % 256 == 0
    assert 0 <= x_off - (CM.unit_bytes(kind, warps, mt) + 4 * CM.block_n(kind, warps, mt)) < 256


def test_repack_refuses_unsupported_weights():
    with pytest.raises(ValueError, match="w:"):
        CM.repack_int4(IntWeight.quantize(torch.randn(64, 192), bits=4, group_size=64))
    with pytest.raises(ValueError, match="w:"):
        CM.repack_int4(IntWeight.quantize(torch.randn(64, 256), bits=8, group_size=128))
    with pytest.raises(ValueError, match="w:"):
        CM.repack_fp8(FP8Weight.quantize(torch.randn(64, 200)))
    assert not CM.int4_ok(IntWeight.quantize(torch.randn(64, 256), bits=4, group_size=64))
    assert CM.fp8_ok(FP8Weight.quantize(torch.randn(64, 256), block_size=128))


def test_mode9_layout_table(monkeypatch):
    from infercore.quant import triton_wo as TW

    assert TW.mode9_layout("int4", 14336, 4096) == (None, None, False)  # the default layout, stream-K grid
    monkeypatch.setitem(TW.MODE9_LAYOUTS, "int4", ((14336, 4096, 7, 1, True), (4096, 4096, 4, 2, False)))
    assert TW.mode9_layout("int4", 14336, 4096) == (7, 1, True)
    assert TW.mode9_layout("int4", 4096, 4096) == (4, 2, False)
    assert TW.mode9_layout("int4", 4096, 14336) == (None, None, False)
    assert TW.mode9_layout("fp8", 14336, 4096) == (None, None, False)


def test_unavailable_on_cpu():
    assert not CM.available(torch.randn(2, 256, dtype=torch.bfloat16))


def test_a_variant_that_cannot_build_is_reported_once_and_remembered(monkeypatch):
    monkeypatch.setattr(CM, "_FAILED", {})
    dev = torch.device("cuda", 0)  # no CUDA here: the build fails for real
    with pytest.warns(RuntimeWarning, match="MODE 9"):
        assert not CM.compiles("int4", torch.bfloat16, dev, True)
    assert len(CM._FAILED) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not CM.compiles("int4", torch.bfloat16, dev, True)  # remembered: no second try, no second warning


def test_matmul_names_bad_arguments_before_launching():
    q = _int4(300, 256)
    words, sw = CM.repack_int4(q)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kind:"):
        CM.matmul(x, "int8", words, sw, 300, 256)
    with pytest.raises(ValueError, match="n, kp:"):
        CM.matmul(x, "int4", words, sw, 300, 200)
    with pytest.raises(ValueError, match="stages:"):
        CM.matmul(x, "int4", words, sw, 300, 256, stages=1)
    with pytest.raises(ValueError, match="ctas:"):
        CM.matmul(x, "int4", words, sw, 300, 256, ctas=9)
    with pytest.raises(ValueError, match="ksplit:"):
        CM.matmul(x, "int4", words, sw, 300, 256, ksplit=4)
    with pytest.raises(ValueError, match="words:"):
        CM.matmul(x, "int4", words[:-4], sw, 300, 256)
    with pytest.raises(ValueError, match="scales:"):
        CM.matmul(x, "int4", words, sw.float(), 300, 256)
    with pytest.raises(ValueError, match="words:"):
        CM.matmul(x, "fp8", words, sw, 300, 256)  # an INT4 repack handed in as FP8
    with pytest.raises(ValueError, match="warps:"):
        CM.matmul(x, "int4", words, sw, 300, 256, warps=9)
    with pytest.raises(ValueError, match="mt:"):
        CM.matmul(x, "int4", words, sw, 300, 256, mt=3)
    with pytest.raises(ValueError, match="words:"):  # a (7, 1) layout pads 300 channels to 336, not 512
        CM.matmul(x, "int4", words, sw, 300, 256, warps=7, mt=1)
    with pytest.raises(ValueError, match="x:"):  # real repacks pass the checks; a CPU tensor cannot run
        CM.matmul(x, "int4", words, sw, 300, 256)
    torch.manual_seed(0)
    fw, fs = CM.repack_fp8(FP8Weight.quantize(torch.randn(200, 256)))
    with pytest.raises(ValueError, match="x:"):
        CM.matmul(x, "fp8", fw, fs, 200, 256)


def test_a_repack_is_first_launched_without_the_early_launch():
    # The first launch of a words tensor may directly follow the kernels that wrote it: no programmatic early
    # launch then (it reads the weight before its wait); later launches of the same tensor may.
    a, b = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    assert not CM._launched_before(a)
    assert CM._launched_before(a) and CM._launched_before(a)
    assert not CM._launched_before(b)
    key = id(a)
    del a
    assert key not in CM._LAUNCHED  # forgotten with the tensor: a new one at the same address starts over


# ---- NF4 (bitsandbytes 4-bit codebook weights): the INT4 unit layout with each word's nibbles paired ----


def _bperm(a: int, b: int, sel: int) -> int:
    """CUDA ``__byte_perm(a, b, sel)``: result byte i is byte ``sel_i & 7`` of (a, b)."""
    src = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _nf4_quad(s: int, t: list) -> tuple[int, int]:
    """wo_mma.cu's nf4_quad(): the codes in the low 16 bits of ``s`` -> (codes 0, 1), (codes 2, 3) as 16-bit pairs."""
    q, tt = s & 0x7777, s & 0x8888
    m = _prmt(0, (tt >> 1) | tt | 0x3210, 0x80808080)
    la, lb = _bperm(t[0], t[1], q), _bperm(t[2], t[3], q)
    ha, hb = _bperm(t[4], t[5], q), _bperm(t[6], t[7], q)
    lo, hi = la ^ ((la ^ lb) & m), ha ^ ((ha ^ hb) & m)
    return _bperm(lo, hi, 0x5140), _bperm(lo, hi, 0x7362)


def _nf4(n, k, bs=64, seed=0):
    from infercore.quant import NF4Weight

    torch.manual_seed(seed)
    return NF4Weight.quantize(torch.randn(n, k), blocksize=bs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nf4_byte_permute_lookup(dtype):
    # every code in every position of a word: the looked-up 16-bit value is the codebook entry rounded to dtype
    q = _nf4(16, 128)
    t = [int(v) & 0xFFFFFFFF for v in CM.lut_tables(q.codebook, dtype)]
    want = q.codebook.to(dtype).view(torch.int16).int() & 0xFFFF
    torch.manual_seed(1)
    for word in [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98, *torch.randint(0, 2**31, (200,)).tolist()]:
        for half in (0, 1):
            a, b = _nf4_quad(word >> (16 * half), t)
            codes = [(word >> (16 * half + 4 * i)) & 15 for i in range(4)]
            got = [a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16]
            assert got == [int(want[c]) for c in codes]


def test_lut_tables_checks():
    book = torch.linspace(-1, 1, 16)
    assert CM.lut_tables(book, torch.float16).shape == (9,)
    with pytest.raises(TypeError, match="dtype"):
        CM.lut_tables(book, torch.float32)
    with pytest.raises(ValueError, match="codebook: expected a float tensor of 16"):
        CM.lut_tables(book[:8], torch.bfloat16)


@pytest.mark.parametrize("n,k,bs", [(300, 256, 64), (256, 384, 128), (264, 256, 256)])
def test_nf4_repack_round_trip(n, k, bs):
    q = _nf4(n, k, bs)
    words, s = CM.repack_nf4(q)
    assert CM.nf4_ok(q) and words.numel() == math.ceil(n / 256) * (k // 128) * 256 * 16
    assert s.numel() == math.ceil(n / 256) * (k // 128) * 256 * 2
    codes, am = CM.unpack_nf4(words, s, n, k)
    from infercore.quant.fp4 import unpack_nibbles

    assert torch.equal(codes, unpack_nibbles(q.qweight).int())
    assert torch.equal(am, q.absmax.float()[:, (torch.arange(k // 64) * 64) // bs])
    assert not CM.nf4_ok(_nf4(64, 256, 32)) and not CM.nf4_ok(_nf4(64, 192, 64))
    with pytest.raises(ValueError, match="absmax blocks of 64"):
        CM.repack_nf4(_nf4(64, 256, 32))


def _lut4_unit(w_unit, t: list, dt, scale) -> torch.Tensor:
    """One warp's weights of one unit ``[16 mt, 128]`` (float64) as wo_mma.cu's LUT kinds decode them: each word of
    ``w_unit [2 mt, 32 lanes, 4]`` looked up by nf4_quad into the A registers (low half a0, a2; high half a1, a3),
    each 16-bit value times ``scale(lane group g, channel slot, K step)`` (1.0 for NF4: its absmax comes after the
    MMA)."""
    mt = w_unit.shape[0] // 2
    wq = torch.zeros(16 * mt, 128, dtype=torch.float64)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for j in range(2 * mt):
            for e in range(4):
                st, p = (4 * j + e) // mt, (4 * j + e) % mt
                word = int(w_unit[j, lane, e]) & 0xFFFFFFFF
                a0, a2 = _nf4_quad(word, t)
                a1, a3 = _nf4_quad(word >> 16, t)
                for reg, dch, dk in ((a0, 0, 0), (a1, 8, 0), (a2, 0, 8), (a3, 8, 8)):
                    sc = scale(g, 2 * p + dch // 8, st)
                    for h in (0, 1):
                        bits = (reg >> (16 * h)) & 0xFFFF
                        v = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(dt).double().item() * sc
                        assert v == float(torch.tensor(v, dtype=torch.float64).to(dt))  # exact in the 16-bit type
                        wq[p * 16 + g + dch, st * 16 + 2 * c + dk + h] = v
    return wq


def test_nf4_kernel_math_emulated():
    """What wo_mma.cu computes for NF4: per unit and warp the looked-up weights (``_lut4_unit``), the two 64-K halves
    accumulated apart and scaled by their absmax."""
    from infercore.quant.fp4 import unpack_nibbles

    n, k, nw, mt = 264, 256, 8, 2
    q = _nf4(n, k, 64, seed=3)
    words, s = CM.repack_nf4(q)
    dt = torch.bfloat16
    t = [int(v) & 0xFFFFFFFF for v in CM.lut_tables(q.codebook, dt)]
    x = torch.randn(2, k).to(dt)
    wn, bn = 16 * mt, 16 * nw * mt
    nbk, kt = math.ceil(n / bn), k // 128
    w = words.view(nbk, kt, nw, 2 * mt, 32, 4)
    sw = s.view(nbk, kt, nw, 8, 2, 2 * mt)  # [nb, kt, warp, g, half, tile]
    y = torch.zeros(2, nbk * bn, dtype=torch.float64)
    for nb in range(nbk):
        for u in range(kt):
            xt = x[:, u * 128:(u + 1) * 128].double()
            for warp in range(nw):
                wq = _lut4_unit(w[nb, u, warp], t, dt, lambda g, slot, st: 1.0)
                scale = sw[nb, u, warp].permute(1, 2, 0).reshape(2, wn).double()  # [half, channel t * 8 + g]
                for h in (0, 1):
                    part = xt[:, 64 * h:64 * h + 64] @ wq[:, 64 * h:64 * h + 64].T
                    y[:, nb * bn + warp * wn:nb * bn + (warp + 1) * wn] += part * scale[h]
    codes = unpack_nibbles(q.qweight).long()
    ref = x.double() @ (q.codebook.to(dt).double()[codes] * q.absmax.double().repeat_interleave(64, 1)).T
    torch.testing.assert_close(y[:, :n], ref, rtol=1e-9, atol=1e-9)


# ---- FP4 (MXFP4 / NVFP4): the NF4 layout and lookup with the e2m1 table, block scales multiplied into the pairs ----


def _fp4(n, k, fmt, seed=0):
    from infercore.quant import FP4Weight

    torch.manual_seed(seed)
    return FP4Weight.quantize(torch.randn(n, k) * 0.05, fmt=fmt)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("n,k", [(300, 256), (256, 384)])
def test_fp4_repack_round_trip(fmt, n, k):
    from infercore.quant.fp4 import unpack_nibbles

    q = _fp4(n, k, fmt)
    words, sw = CM.repack_fp4(q)
    assert CM.fp4_ok(q) and sw.dtype == torch.int32
    assert sw.numel() == math.ceil(n / 256) * (k // 128) * 256 * (2 if fmt == "nvfp4" else 1)
    codes, sb = CM.unpack_fp4(words, sw, n, k, fmt)
    assert torch.equal(codes, unpack_nibbles(q.qweight).int()) and torch.equal(sb, q.scales)
    with pytest.raises(ValueError, match="K % 128"):
        CM.repack_fp4(_fp4(64, 192, fmt))


def _fp4_scale(sv: list, t: int, s: int, fmt: str) -> float:
    """wo_mma.cu's fp4_scale2() as a float: the scale of K step s for channel slot t."""
    if fmt == "mxfp4":
        e = (sv[t] >> (8 * (s >> 1))) & 0xFF
        return 2.0 ** (e - 127)
    b = (sv[2 * t + (s >> 2)] >> (8 * (s & 3))) & 0xFF
    return torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).double().item()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_kernel_math_emulated(fmt):
    """What wo_mma.cu computes for FP4: the NF4 lookup with the e2m1 table, each K step's pairs times the block scale
    of their channel in bf16 (exact; ``_lut4_unit``), one accumulation, NVFP4's tensor scale on y."""
    from infercore.quant.fp4 import e2m1_decode

    n, k, nw, mt = 264, 256, 8, 2
    q = _fp4(n, k, fmt, seed=5)
    if fmt == "nvfp4":
        q.global_scale = 0.37
    words, sw = CM.repack_fp4(q)
    dt = torch.bfloat16
    tab = CM.lut_tables(e2m1_decode(torch.arange(16, dtype=torch.uint8)), dt, q.global_scale)
    t = [int(v) & 0xFFFFFFFF for v in tab]
    x = torch.randn(2, k).to(dt)
    wn, bn = 16 * mt, 16 * nw * mt
    nbk, kt = math.ceil(n / bn), k // 128
    w = words.view(nbk, kt, nw, 2 * mt, 32, 4)
    swv = sw.view(nbk, kt, nw, 8, -1)  # [nb, kt, warp, g, words]
    y = torch.zeros(2, nbk * bn, dtype=torch.float64)
    for nb in range(nbk):
        for u in range(kt):
            xt = x[:, u * 128:(u + 1) * 128].double()
            for warp in range(nw):
                sv = [[int(v) & 0xFFFFFFFF for v in swv[nb, u, warp, g]] for g in range(8)]
                wq = _lut4_unit(w[nb, u, warp], t, dt, lambda g, slot, st, sv=sv: _fp4_scale(sv[g], slot, st, fmt))
                y[:, nb * bn + warp * wn:nb * bn + (warp + 1) * wn] += xt @ wq.T
    y *= tab[8].view(torch.float32).item()  # the kernel's fp32 tensor scale (1.0 for MXFP4)
    ref = x.double() @ q.dequantize(torch.float64).T  # fp32 products of the scales: 2^-24 relative
    torch.testing.assert_close(y[:, :n], ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
