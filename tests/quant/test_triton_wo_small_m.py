"""Small-M (decode) weight-only kernels, every MODE and split-K, vs the references (interpreter).

Tiny fp32/fp16 shapes: the interpreter's bf16 dot/arithmetic is unreliable, and fp8 numerics are
checked through the integer decode only (bit-exact elsewhere).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated; tests/conftest.py decides first

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore.quant import FP8Weight, IntWeight, triton_wo, wo_gemv  # noqa: E402
from infercore.quant import naive as R  # noqa: E402


def _err(y, r):
    return ((y.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item()


def _cfg(mode, split, bn=16, bk=64):
    return {"MODE": mode, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("bits,sym,group", [(4, False, 64), (4, True, None), (8, False, 32)])
@pytest.mark.parametrize("m", [1, 3])
def test_wq_small_modes(mode, bits, sym, group, m):
    torch.manual_seed(mode * 10 + m)
    w = IntWeight.quantize(torch.randn(40, 200), bits=bits, group_size=group, symmetric=sym)  # K padded
    x = torch.randn(m, 200)
    r = R.wq_matmul_ref(x, w)
    for split in (1, 2):
        y = triton_wo.wq_matmul_triton(x, w, config=_cfg(mode, split, bk=min(64, group or 64)))
        assert y.shape == (m, 40) and _err(y, r) < 1e-5, (split, _err(y, r))


@pytest.mark.parametrize("mode", [1, 2])
def test_wq_small_fp16_rows_up_to_16(mode):
    torch.manual_seed(1)
    w = IntWeight.quantize(torch.randn(48, 128), bits=4, group_size=32)
    x = torch.randn(16, 128).half()
    bias = torch.randn(48)
    y = triton_wo.wq_matmul_triton(x, w, bias, config=_cfg(mode, 2, bk=32))
    assert y.dtype == torch.float16 and _err(y, R.wq_matmul_ref(x, w, bias)) < 2e-3


@pytest.mark.parametrize("m", [17, 40, 64, 65])
def test_rows_up_to_words_max_take_the_small_path(m, monkeypatch):
    """16-bit activations with INT4 / FP8 weights stay on the small-M kernels up to WORDS_M_MAX rows
    (MODE 5 on the GPU, its interpreter stand-in here), then move to the tiled GEMM."""
    torch.manual_seed(m)
    w4 = IntWeight.quantize(torch.randn(48, 256), bits=4, group_size=64)
    f8 = FP8Weight.quantize(torch.randn(48, 256))
    x = torch.randn(m, 256).half()
    calls = []
    real = triton_wo._small_plan
    monkeypatch.setattr(triton_wo, "_small_plan", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    assert _err(triton_wo.wq_matmul_triton(x, w4), R.wq_matmul_ref(x, w4)) < 2e-3
    assert _err(triton_wo.fp8_wo_matmul_triton(x, f8), x.float() @ f8.dequantize().T) < 2e-3
    assert calls == (["int4", "fp8"] if m <= triton_wo.WORDS_M_MAX else [])
    w8 = IntWeight.quantize(torch.randn(48, 256), bits=8, group_size=64)  # INT8: no MODE 5, so the GEMM
    assert _err(triton_wo.wq_matmul_triton(x, w8), R.wq_matmul_ref(x, w8)) < 2e-3
    assert len(calls) == (2 if m <= triton_wo.WORDS_M_MAX else 0)


def test_wq_small_default_config_picks_split():
    w = IntWeight.quantize(torch.randn(32, 1024), bits=4, group_size=64)
    cfg = triton_wo._small_cfg("int4", 32, 1024, 1, 64, torch.device("cpu"), None)
    assert cfg["MODE"] == 4 and cfg["BLOCK_M"] == 1
    tiles = 32 // cfg["BLOCK_N"]
    split, _ = wo_gemv._gemv_split(tiles, 1024 // 8, cfg["BLOCK_K"] // 8, torch.device("cpu"), 0)
    assert split > 1
    x = torch.randn(1, 1024)
    assert _err(triton_wo.wq_matmul_triton(x, w), R.wq_matmul_ref(x, w)) < 1e-5


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (4, torch.float32), (3, torch.float16)])
def test_fp8_small_modes(mode, block, m, dtype):
    torch.manual_seed(mode + m)
    w = FP8Weight.quantize(torch.randn(40, 288), block_size=block)  # K not a multiple of BLOCK_K
    x = torch.randn(m, 288).to(dtype)
    r = R.fp8_wo_matmul_ref(x, w)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for split in (1, 3):
        y = triton_wo.fp8_wo_matmul_triton(x, w, config=_cfg(mode, split))
        assert y.dtype == dtype and _err(y, r) < tol, (split, _err(y, r))


def _gemv(split, bk=64, stages=2):
    return {"MODE": 4, "BLOCK_N": 8, "BLOCK_K": bk, "SPLIT": split, "num_warps": 4, "num_stages": stages}


@pytest.mark.parametrize("bits,sym,group", [(4, False, 64), (4, True, None), (8, False, 32), (8, True, 128)])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_wq_gemv_words(bits, sym, group, m, dtype):
    """MODE 4 over the interleaved words; bf16 x is widened by the load (no bf16 math in the
    kernel, so the interpreter can run it); split-K is reduced inside the kernel."""
    torch.manual_seed(bits + m)
    w = IntWeight.quantize(torch.randn(37, 256), bits=bits, group_size=group, symmetric=sym)  # odd N
    x = torch.randn(m, 256).to(dtype)
    r = R.wq_matmul_ref(x.float(), w)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for split in (1, 2, 4):
        y = triton_wo.wq_matmul_triton(x, w, config=_gemv(split))
        assert y.dtype == dtype and _err(y, r) < tol, (split, _err(y, r))


def test_wq_gemv_unaligned_rows():
    # K = 198 (per-channel): 99 bytes per row; the interleaved words pad the codes to 256.
    torch.manual_seed(3)
    w = IntWeight.quantize(torch.randn(24, 198), bits=4, group_size=None)
    x = torch.randn(1, 198)
    assert _err(triton_wo.wq_matmul_triton(x, w, config=_gemv(1)), R.wq_matmul_ref(x, w)) < 1e-5


def test_wq_gemv_rows_above_gemv_max_take_the_dot():
    torch.manual_seed(4)
    w = IntWeight.quantize(torch.randn(24, 256), bits=4, group_size=64)
    x = torch.randn(6, 256)
    assert _err(triton_wo.wq_matmul_triton(x, w, config=_gemv(1)), R.wq_matmul_ref(x, w)) < 1e-5


@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (4, torch.float32), (3, torch.bfloat16), (2, torch.float16)])
def test_fp8_gemv_words(block, m, dtype):
    torch.manual_seed(m)
    w = FP8Weight.quantize(torch.randn(40, 288), block_size=block)
    x = torch.randn(m, 288).to(dtype)
    r = R.fp8_wo_matmul_ref(x.float(), w)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for split in (1, 3):
        y = triton_wo.fp8_wo_matmul_triton(x, w, config=_gemv(split))
        assert _err(y, r) < tol, (split, _err(y, r))


def test_fp8_gemv_decode_bit_exact():
    """Every e4m3 byte (subnormals, both signs; NaN codes excluded) through the GEMV's decode with
    a one-hot activation equals torch's float8_e4m3fn conversion times the scale, exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 254 codes
    q = codes.view(-1, 1).repeat(1, 8)  # [254, 8]: row n holds code n
    w = FP8Weight(q.contiguous(), torch.ones(q.shape[0]), None)
    x = torch.zeros(1, 8)
    x[0, 5] = 1.0
    y = triton_wo.fp8_wo_matmul_triton(x, w, config=_gemv(1, bk=8, stages=1))
    assert torch.equal(y[0], codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("mode", [0, 3, 6, None])
def test_small_config_rejects_unknown_mode(mode):
    w = IntWeight.quantize(torch.randn(16, 64), bits=4, group_size=32)
    f = FP8Weight.quantize(torch.randn(16, 64))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="MODE"):
        triton_wo.wq_matmul_triton(x, w, config={**_cfg(2, 1), "MODE": mode})
    with pytest.raises(ValueError, match="MODE"):
        triton_wo.fp8_wo_matmul_triton(x, f, config={**_cfg(2, 1), "MODE": mode})


def test_bad_activations_raise_naming_x():
    w = IntWeight.quantize(torch.randn(16, 64), bits=4, group_size=32)
    f = FP8Weight.quantize(torch.randn(16, 64))
    for fn, wt in ((triton_wo.wq_matmul_triton, w), (triton_wo.fp8_wo_matmul_triton, f)):
        with pytest.raises(ValueError, match="x must be"):
            fn(torch.randn(1, 65), wt)  # K mismatch
        with pytest.raises(ValueError, match="x must be"):
            fn(torch.randn(64), wt)  # not 2-D
        with pytest.raises(TypeError, match="x must be"):
            fn(torch.randn(1, 64).double(), wt)


@pytest.mark.parametrize("bits", [4, 8])
def test_interleave_words_layout(bits):
    """MODE 4 layout: word i of each block holds codes i + (block words) * j at bits * j."""
    cpw = 32 // bits
    codes = torch.randint(0, 2**bits, (3, 256))
    words = triton_wo.interleave_words(codes, bits, 128)
    gw = 128 // cpw
    assert words.dtype == torch.int32 and words.shape == (3, 256 // cpw)
    u = words.to(torch.int64) & 0xFFFFFFFF
    for blk in range(2):
        for i in range(gw):
            for j in range(cpw):
                got = (u[:, blk * gw + i] >> (bits * j)) & (2**bits - 1)
                assert torch.equal(got, codes[:, blk * 128 + i + gw * j])
    with pytest.raises(ValueError, match="codes"):
        triton_wo.interleave_words(codes[:, :100], bits, 128)
    with pytest.raises(ValueError, match="bits"):
        triton_wo.interleave_words(codes, 3, 128)
    with pytest.raises(TypeError, match="codes"):
        triton_wo.interleave_words(codes[0], bits, 128)


def test_gemv4_words_cached_per_weight():
    torch.manual_seed(5)
    w = IntWeight.quantize(torch.randn(16, 256), bits=4, group_size=64)
    x = torch.randn(1, 256)
    y1 = triton_wo.wq_matmul_triton(x, w, config=_gemv(1))
    words = wo_gemv._ILV_CACHE[id(w.qweight)][1]
    y2 = triton_wo.wq_matmul_triton(x, w, config=_gemv(2))
    assert wo_gemv._ILV_CACHE[id(w.qweight)][1] is words
    assert _err(y1, y2) < 1e-6 and _err(y1, R.wq_matmul_ref(x, w)) < 1e-5


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_gemv4_ragged_last_tile(kind):
    """K whose words do not fill the last tile (KW % tile != 0): the overhang reads no x, scale or
    zero point past K (it did once, giving NaN at K = 14336)."""
    torch.manual_seed(7)
    k = 384
    x = torch.randn(2, k)
    if kind == "fp8":
        w = FP8Weight.quantize(torch.randn(24, k), block_size=128)
        y = triton_wo.fp8_wo_matmul_triton(x, w, config=_gemv(1, bk=256))
        r = R.fp8_wo_matmul_ref(x, w)
    else:
        w = IntWeight.quantize(torch.randn(24, k), bits=int(kind[3:]), group_size=128, symmetric=False)
        y = triton_wo.wq_matmul_triton(x, w, config=_gemv(1, bk=256))
        r = R.wq_matmul_ref(x, w)
    assert torch.isfinite(y).all() and _err(y, r) < 1e-5


def _act_ref(y, act):
    g, u = y.float().chunk(2, dim=-1)
    if act == "silu":
        a = g * torch.sigmoid(g)
    else:
        a = torch.nn.functional.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")
    return a * u


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv4_fused_act(act, kind, m):
    """MODE 4 with the gated epilogue on a merged [gate; up] weight (D = 13, odd, so the last
    program is partial) equals act(gate) * up of the reference product; a bias, or a dot (MODE 2)
    config, takes the unfused path with the same result."""
    torch.manual_seed(m)
    k = 256
    wt = torch.randn(26, k)
    x = torch.randn(m, k)
    if kind == "fp8":
        w = FP8Weight.quantize(wt, block_size=128)
        fn, ref = triton_wo.fp8_wo_matmul_triton, R.fp8_wo_matmul_ref(x, w)
    else:
        w = IntWeight.quantize(wt, bits=int(kind[3:]), group_size=64)
        fn, ref = triton_wo.wq_matmul_triton, R.wq_matmul_ref(x, w)
    want = _act_ref(ref, act)
    for cfg in ({**_gemv(1), "BLOCK_N": 4}, {**_gemv(1), "BLOCK_N": 3}, _cfg(2, 2)):
        y = fn(x, w, config=cfg, act=act)
        assert y.shape == (m, 13) and _err(y, want) < 1e-5, (cfg, _err(y, want))
    bias = torch.randn(26)
    y = fn(x, w, bias, config=_gemv(1), act=act)
    assert _err(y, _act_ref(ref + bias, act)) < 1e-5


def test_fused_act_rejects_bad_act():
    w = IntWeight.quantize(torch.randn(8, 64), bits=4, group_size=32)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="act"):
        triton_wo.wq_matmul_triton(x, w, act="relu")
    w7 = IntWeight.quantize(torch.randn(7, 64), bits=4, group_size=32)
    with pytest.raises(ValueError, match="act"):
        triton_wo.wq_matmul_triton(x, w7, act="silu")


def test_gemv4_repack_off_takes_the_dot(monkeypatch):
    """With the repack switched off no second copy is made and the result is the same."""
    monkeypatch.setattr(wo_gemv, "REPACK", False)
    torch.manual_seed(6)
    w = IntWeight.quantize(torch.randn(16, 256), bits=4, group_size=64)
    x = torch.randn(1, 256)
    y = triton_wo.wq_matmul_triton(x, w, config=_gemv(1))
    assert id(w.qweight) not in wo_gemv._ILV_CACHE
    assert _err(y, R.wq_matmul_ref(x, w)) < 1e-5


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("kind", ["int4_sym", "int4_asym", "int4_channel", "fp8", "fp8_block"])
def test_mode5_word_pairs(kind, m):
    """MODE 5 (stored bytes read as int32 words, two codes per decode instruction, fp16 here: the
    interpreter has no bf16 math) against the reference, with split-K finished in the kernel and a
    ragged last channel tile (N = 40 with 16-channel tiles)."""
    torch.manual_seed(m)
    wt = torch.randn(40, 512)
    x = torch.randn(m, 512).half()
    if kind.startswith("int4"):
        q = IntWeight.quantize(wt, bits=4, group_size=None if kind == "int4_channel" else 128,
                               symmetric=kind != "int4_asym")
        fn, ref, bk = triton_wo.wq_matmul_triton, R.wq_matmul_ref, 64
    else:
        q = FP8Weight.quantize(wt, block_size=128 if kind == "fp8_block" else None)
        fn, ref, bk = triton_wo.fp8_wo_matmul_triton, R.fp8_wo_matmul_ref, 32
    r = ref(x.float(), q)
    for split in (1, 3):
        for _ in range(2):  # the in-kernel split-K counters are reset for the next call
            y = fn(x, q, config=_cfg(5, split, bk=bk))
            assert y.dtype == torch.float16 and _err(y, r) < 2e-3, (split, _err(y, r))


def test_mode5_falls_back_where_it_cannot_run():
    """fp32 activations and INT8 codes take the MODE 2 tile instead (same results)."""
    torch.manual_seed(0)
    w8 = IntWeight.quantize(torch.randn(32, 256), bits=8, group_size=64)
    x = torch.randn(2, 256)
    plan = triton_wo._small_plan("int8", x.half(), w8.qweight, 32, 256, 64, _cfg(5, 1), lambda: None)[0]
    assert plan["MODE"] == 2
    w4 = IntWeight.quantize(torch.randn(32, 256), bits=4, group_size=64)
    assert triton_wo._small_plan("int4", x, w4.qweight, 32, 256, 64, _cfg(5, 1), lambda: None)[0]["MODE"] == 2
    assert triton_wo._small_plan("int4", x.half(), w4.qweight, 32, 256, 64, _cfg(5, 1), lambda: None)[0]["MODE"] == 5
    assert _err(triton_wo.wq_matmul_triton(x, w8, config=_cfg(5, 1)), R.wq_matmul_ref(x, w8)) < 1e-5
    assert _err(triton_wo.wq_matmul_triton(x, w4, config=_cfg(5, 1)), R.wq_matmul_ref(x, w4)) < 1e-5


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("tiles", [1, 2])
def test_gemv4_first_tiles_read_before_the_pdl_wait(kind, tiles, monkeypatch):
    """With PDL, MODE 4 loads its first 1 or 2 weight tiles before waiting for the previous kernel
    (PREWAIT) and consumes them ahead of the K loop; the interpreter has no PDL, so force the variant:
    same results, split or not (one to three tiles per split), ragged last tile, fused activation."""
    monkeypatch.setattr(wo_gemv, "pdl_enabled", lambda t: True)
    monkeypatch.setattr(wo_gemv, "pdl_launch", lambda use: {})
    monkeypatch.setattr(wo_gemv, "GEMV_PREWAIT", tiles)
    torch.manual_seed(11)
    k = 384
    x = torch.randn(3, k)
    wt = torch.randn(26, k)
    if kind == "fp8":
        w = FP8Weight.quantize(wt, block_size=128)
        fn, ref = triton_wo.fp8_wo_matmul_triton, R.fp8_wo_matmul_ref(x, w)
    else:
        w = IntWeight.quantize(wt, bits=int(kind[3:]), group_size=128, symmetric=False)
        fn, ref = triton_wo.wq_matmul_triton, R.wq_matmul_ref(x, w)
    for split, bk in ((1, 256), (2, 64), (3, 64)):
        y = fn(x, w, config=_gemv(split, bk=bk))
        assert _err(y, ref) < 1e-5, (split, bk, _err(y, ref))
    y = fn(x, w, config={**_gemv(1), "BLOCK_N": 4}, act="silu")
    assert _err(y, _act_ref(ref, "silu")) < 1e-5


def test_tuned_tables_keep_one_repacked_copy(monkeypatch):
    """Over M = 1..16 the dispatch tables make at most one repacked copy of a weight (MODE 4's words or
    MODE 6's fragments), and the check sees a table that would make two."""
    from infercore.quant import triton_wo

    shapes = {(kind, n, k) for (kind, n, k, _) in (*triton_wo.SMALL_M_TUNED, *triton_wo.MODE6_TUNED,
                                                    *triton_wo.MODE7_TUNED)}
    assert shapes
    for kind, n, k in shapes:
        assert len(triton_wo.repacked_layouts(kind, n, k)) <= 1, (kind, n, k)
    # the lookup both tables share: an unswept bucket borrows the next larger one; None entries are found
    assert triton_wo._tuned(triton_wo.SMALL_M_TUNED, "int4", 14336, 4096, 2, 4) == (
        True, triton_wo.SMALL_M_TUNED[("int4", 14336, 4096, 4)])
    assert triton_wo._tuned(triton_wo.MODE6_TUNED, "int4", 6144, 4096, 1, 2) == (True, None)
    assert triton_wo._tuned(triton_wo.MODE6_TUNED, "int4", 4096, 4096, 1, 2) == (False, None)
    assert triton_wo.repacked_layouts("int4", 4096, 4096) == {"mode4"}
    monkeypatch.setitem(triton_wo.MODE6_TUNED, ("int4", 4096, 4096, 16), {"WARPS": 2, "REPS": 4, "SPLIT": 8})
    assert triton_wo.repacked_layouts("int4", 4096, 4096) == {"mode4", "mode6"}


def test_untuned_int4_m1_default_tiles(monkeypatch):
    """Shapes outside the tables: INT4 at M=1 takes MODE 6 from MODE6_MIN_N channels and MODE6_MIN_BYTES
    of codes (split-K filling ~12 warps per SM, >= 8 iterations per split; one repacked copy over
    M = 1..16) and MODE 4's packed 2-warp tile below; FP8 keeps MODE 4."""
    from infercore.quant import triton_frag, triton_wo

    lm_head = triton_wo._mode6_entry("int4", 128256, 4096, 1, 132)
    assert lm_head == {"MODE": 6, "WN": 1, "WARPS": 4, "REPS": 4, "SPLIT": 1, "DEPTH": 3, "MAXNREG": 128}
    assert triton_frag.m1_config(14336, 4096, 132)["SPLIT"] == 8  # the tuned entry's split
    assert triton_frag.m1_config(8192, 1024, 132)["SPLIT"] == 2  # 16 iterations: 8 per split
    assert triton_frag.m1_config(8192, 8192, 132)["SPLIT"] == 16  # the split measured fastest there
    assert triton_frag.m1_config(151936, 4096, 132)["WARPS"] == 2  # 2374 blocks of 64: WN needs WARPS | blocks
    assert triton_wo._mode6_entry("int4", 128256, 4096, 2, 132) is None  # M > 1: MODE 5 on the stored words
    assert triton_wo._mode6_entry("int4", 4096, 8192, 1, 132) is None  # below MODE6_MIN_N
    assert triton_wo._mode6_entry("int4", 8192, 4096, 1, 132) is None  # below MODE6_MIN_BYTES (16 MiB of codes)
    assert triton_wo._mode6_entry("int4", 8192, 8192, 1, 132)["SPLIT"] == 16
    assert triton_wo._mode6_entry("fp8", 128256, 4096, 1, 132) is None
    assert triton_wo.repacked_layouts("int4", 128256, 4096) == {"mode6"}
    assert triton_wo.repacked_layouts("int4", 4096, 8192) == {"mode4"}
    monkeypatch.setattr(triton_wo, "_INTERPRET", False)  # (the GPU's tiles, not the interpreter's)
    cfg = triton_wo._small_cfg("int4", 4096, 8192, 1, 128, torch.device("cpu"), None)
    assert (cfg["MODE"], cfg["BLOCK_N"], cfg["num_warps"]) == (4, 8, 2)
    cfg = triton_wo._small_cfg("fp8", 4096, 8192, 1, 128, torch.device("cpu"), None)
    assert (cfg["MODE"], cfg["BLOCK_N"], cfg["num_warps"]) == (4, 4, 4)


def test_mode7_entries_and_config_checks():
    """MODE 7 (TMA-fed fragments) takes its table's entries only where it can run (sm90+ with Gluon), on the
    words MODE 6 repacks (still one copy per weight); elsewhere MODE 6's entries stand. Its configs are
    validated before any launch."""
    from infercore.quant import gluon_frag, triton_wo

    for key, entry in triton_wo.MODE7_TUNED.items():
        kind, n, k, m = key
        assert kind == "int4" and (entry is None or entry["MODE"] == 7)
        assert triton_wo._mode6_entry(kind, n, k, m, 132, True) == entry
        fallback = triton_wo._mode6_entry(kind, n, k, m, 132, False)
        assert fallback is None or fallback.get("MODE", 6) == 6
        assert triton_wo.repacked_layouts(kind, n, k) == {"mode6"}
    assert triton_wo._mode6_entry("int4", 14336, 4096, 16, 132, True)["SPLIT"] == 4  # M 9-16: MODE 7
    assert triton_wo._mode6_entry("int4", 14336, 4096, 6, 132, True)["SPLIT"] == 4  # M 5-8: MODE 7
    assert triton_wo._mode6_entry("int4", 6144, 4096, 16, 132, True) is None  # qkv M 9-16: MODE 5
    assert triton_wo._mode6_entry("int4", 6144, 4096, 8, 132, True)["SPLIT"] == 4
    assert triton_wo._mode6_entry("int4", 4096, 14336, 1, 132, True)["SPLIT"] == 28  # down: ~4 groups a warp
    assert triton_wo._mode6_entry("int4", 14336, 4096, 16, 132, False) is None  # no TMA: MODE 5
    assert triton_wo._mode6_entry("int4", 14336, 4096, 3, 132, True)["MODE"] == 7  # bucket 4
    assert triton_wo._mode6_entry("fp8", 14336, 4096, 1, 132, True) is None  # (FP8: MODE 4 there)
    assert gluon_frag.check_config({"W": 2, "STAGES": 3, "SPLIT": 4}) == (2, 3, 4)
    assert gluon_frag.check_config({}) == (1, 2, 1)
    for key, bad in (("W", 3), ("STAGES", 0), ("STAGES", 9), ("STAGES", 2.0), ("SPLIT", 0)):
        with pytest.raises(ValueError, match=key):
            gluon_frag.check_config({key: bad})
    with pytest.raises(ValueError, match="W"):
        gluon_frag.check_config({"W": True})
    with pytest.raises(ValueError, match="TAGGED"):
        gluon_frag.check_config({"TAGGED": "yes"})
    with pytest.raises(ValueError, match="FLAGS"):
        gluon_frag.check_config({"FLAGS": 1})
    words = torch.zeros(2, 4, 8, 32, 4, dtype=torch.int32)
    d = gluon_frag.descriptor(words)
    assert list(d.shape) == [2 * 4 * 8, 128] and list(d.block_shape) == [8, 128]
    # launch checks its operands as MODE 6 does (the shared triton_frag.check_operands), naming the argument
    sz = torch.zeros(2, 4, 8, 4, dtype=torch.int64)
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: MODE 7 needs a CUDA \\(sm90\\+\\)"):  # well formed: stops at the device
        gluon_frag.launch(x, words, sz, 128, {})
    with pytest.raises(ValueError, match="n:"):
        gluon_frag.launch(x, words, sz, 96, {})
    with pytest.raises(ValueError, match="s: expected"):
        gluon_frag.launch(x, words, sz.float(), 128, {})
    with pytest.raises(ValueError, match="frags"):
        gluon_frag.launch(x, words, sz, 128, {}, kind="fp8")
