"""MODE 4's packed fp16 dot (``wo_packed._packed_asm``: INT4 and FP8, 1-4 rows) on the CPU: its inline PTX run
by a small interpreter of the instructions it uses (fp16 pairs rounded as the hardware rounds them), fed the
activations scaled as the kernel scales them, against the exact sum. The GPU tests run the kernel."""

from __future__ import annotations

import re

import numpy as np
import pytest

from infercore.quant import triton_wo, wo_packed


def _f16(bits: int) -> float:
    return float(np.array(bits & 0xFFFF, dtype=np.uint16).view(np.float16))


def _bits16(v: float) -> int:
    return int(np.array(v, dtype=np.float64).astype(np.float16).view(np.uint16))  # round to nearest even


def _pairwise(a: int, b: int, c: int | None, op) -> int:
    out = 0
    for sh in (0, 16):
        x, y = _f16(a >> sh), _f16(b >> sh)
        z = 0.0 if c is None else _f16(c >> sh)
        out |= _bits16(op(x, y, z)) << sh  # exact in float64, one rounding to fp16
    return out


def run_ptx(asm: str, args: list[int], outs: int = 1) -> list[float]:
    """Interpret ``asm`` (the subset ``_packed_asm`` emits) with ``$outs..`` = ``args`` (32-bit ints); returns
    ``$0 .. $(outs - 1)``."""
    reg: dict[str, object] = {f"${i + outs}": a for i, a in enumerate(args)}

    def val(o: str):
        o = o.strip()
        return int(o, 16) if o.startswith("0x") else int(o) if o.isdigit() else reg[o]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\S+)", rest).groups()
            reg[lo], reg[hi] = val(src) & 0xFFFF, (val(src) >> 16) & 0xFFFF
            continue
        d, *ops = [t.strip() for t in rest.split(",")]
        v = [val(o) for o in ops]
        if op == "lop3.b32":
            assert v[3] == 0xEA  # (a & b) | c
            reg[d] = (v[0] & v[1]) | v[2]
        elif op == "shr.u32":
            reg[d] = (v[0] & 0xFFFFFFFF) >> v[1]
        elif op == "shl.b32":
            reg[d] = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "and.b32":
            reg[d] = v[0] & v[1] & 0xFFFFFFFF
        elif op == "sub.rn.f16x2":
            reg[d] = _pairwise(v[0], v[1], None, lambda x, y, z: x - y)
        elif op == "mul.rn.f16x2":
            reg[d] = _pairwise(v[0], v[1], None, lambda x, y, z: x * y)
        elif op == "fma.rn.f16x2":
            reg[d] = _pairwise(v[0], v[1], v[2], lambda x, y, z: x * y + z)
        elif op == "cvt.f32.f16":
            reg[d] = _f16(v[0])
        elif op == "add.f32":
            reg[d] = float(np.float32(np.float32(v[0]) + np.float32(v[1])))
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return [float(reg[f"${r}"]) for r in range(outs)]


def _scaled(x: np.ndarray) -> tuple[np.ndarray, float]:
    """``x`` times the kernel's power of two (largest |x| into [2**10, 2**11)) and the inverse."""
    mx = np.float32(np.abs(x).max())
    e = max((int(np.array(mx, dtype=np.float32).view(np.int32)) >> 23) & 0xFF, 11)
    sc = float(np.array((264 - e) << 23, dtype=np.int32).view(np.float32))
    inv = float(np.array((e - 10) << 23, dtype=np.int32).view(np.float32))
    return x.astype(np.float32) * np.float32(sc), inv


def packed_dot(q: np.ndarray, x: np.ndarray, z: int) -> list[float]:
    """The kernel's INT4 step for 4 words and R rows: ``q [4, 8]`` codes (word i, nibble j), ``x [R, 4, 8]`` each
    row's activations of those codes; returns ``sum (q - z) x`` per row as the kernel forms it (scaled, fp16,
    then unscaled)."""
    words = [sum(int(q[i, j]) << (4 * j) for j in range(8)) for i in range(4)]
    pairs, invs = [], []
    for xr in x:
        xs, inv = _scaled(xr)
        pairs += [_bits16(xs[i, j]) | (_bits16(xs[i, j + 4]) << 16) for i in range(4) for j in range(4)]
        invs.append(inv)
    mz = [0x54005400 | (z * 65537), 0x44004400 | (z * 65537 << 4)]
    got = run_ptx(wo_packed._packed_asm(False, len(x)), words + pairs + mz, len(x))
    return [g * inv * 16 for g, inv in zip(got, invs)]


def packed_dot_fp8(b: np.ndarray, x: np.ndarray) -> list[float]:
    """The kernel's FP8 step: ``b [4, 4]`` e4m3 bytes (word i, byte j), ``x [R, 4, 4]``; ``sum e4m3 * x`` per row."""
    words = [sum(int(b[i, j]) << (8 * j) for j in range(4)) for i in range(4)]
    pairs, invs = [], []
    for xr in x:
        xs, inv = _scaled(xr)
        for i in range(4):  # bytes 1 and 3, then 0 and 2
            pairs += [_bits16(xs[i, 1]) | (_bits16(xs[i, 3]) << 16), _bits16(xs[i, 0]) | (_bits16(xs[i, 2]) << 16)]
        invs.append(inv)
    got = run_ptx(wo_packed._packed_asm(True, len(x)), words + pairs, len(x))
    return [g * inv * 256 for g, inv in zip(got, invs)]


def _acts(rng, kind: str, shape) -> np.ndarray:
    x = rng.standard_normal(shape)
    if kind == "tiny":
        x *= 1e-5
    elif kind == "huge":
        x *= 1e6
    elif kind == "mixed":
        x = np.where(rng.random(shape) < 0.1, x * 1e4, x * 1e-3)
    elif kind == "zeros":
        x[:] = 0.0
    return x.astype(np.float32)  # (bf16 activations are exact in fp32)


@pytest.mark.parametrize("kind", ["normal", "tiny", "huge", "mixed", "zeros"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_packed_dot_matches_exact(kind, rows):
    rng = np.random.default_rng(rows)
    for trial in range(20):
        q = rng.integers(0, 16, size=(4, 8))
        z = int(rng.integers(0, 16))
        x = _acts(rng, kind, (rows, 4, 8)) * np.logspace(-3, 3, rows)[:, None, None].astype(np.float32)
        got = packed_dot(q, x, z)
        for r in range(rows):
            exact = float(((q - z) * x[r].astype(np.float64)).sum())
            scale = float((np.abs(q - z) * np.abs(x[r].astype(np.float64))).sum())
            assert np.isfinite(got[r]) and abs(got[r] - exact) <= 2e-3 * scale + 1e-30, (kind, trial, r, got, exact)


def test_fp8_pair_decode_is_exact():
    """Every e4m3 byte but NaN, through the asm's decode, is ``torch``'s float8_e4m3fn value times 2**-8 in fp16
    (the dot with one-hot activations reads each decoded code back)."""
    import torch

    codes = [c for c in range(256) if c & 0x7F != 0x7F]
    want = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    for c, v in zip(codes, want):
        for pos in range(4):  # the byte in each position of a word (both decode paths)
            b = np.zeros((4, 4), dtype=np.int64)
            b[2, pos] = c
            x = np.zeros((1, 4, 4), dtype=np.float32)
            x[0, 2, pos] = 1.0
            x[0, 0, 0] = 1.0  # (code 0: the activation scale stays at 2**(137 - 127 - 0))
            assert packed_dot_fp8(b, x)[0] == v, (hex(c), pos)


@pytest.mark.parametrize("kind", ["normal", "tiny", "huge", "mixed", "zeros"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_packed_fp8_dot_matches_exact(kind, rows):
    import torch

    rng = np.random.default_rng(10 + rows)
    for trial in range(20):
        b = rng.integers(0, 256, size=(4, 4))
        b = np.where(b & 0x7F == 0x7F, b - 1, b)  # no NaN codes
        if trial % 4 == 0:  # the largest codes: 8 products per lane must stay in fp16's range
            b = np.where(rng.random((4, 4)) < 0.5, 0x7E, 0xFE)
        vals = torch.tensor(b.reshape(-1), dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy().reshape(4, 4)
        x = _acts(rng, kind, (rows, 4, 4)) * np.logspace(-3, 3, rows)[:, None, None].astype(np.float32)
        got = packed_dot_fp8(b, x)
        for r in range(rows):
            exact = float((vals * x[r].astype(np.float64)).sum())
            scale = float((np.abs(vals) * np.abs(x[r].astype(np.float64))).sum())
            assert np.isfinite(got[r]) and abs(got[r] - exact) <= 2e-3 * scale + 1e-30, (kind, trial, r, got, exact)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_packed_asm_operands_match_constraints(fp8, rows):
    """The kernel passes ``_packed_cons``' operands to ``_packed_asm``'s text: every ``$i`` it names is one of
    them, and it names each (outputs, words, every row's pairs, INT4's two zero pairs)."""
    asm, cons = wo_packed._packed_asm(fp8, rows), wo_packed._packed_cons(fp8, rows).split(",")
    used = {int(i) for i in re.findall(r"\$(\d+)", asm)}
    assert used == set(range(len(cons))), (sorted(set(range(len(cons))) - used), max(used), len(cons))
    assert cons[:rows] == ["=f"] * rows and set(cons[rows:]) == {"r"}


def test_tuned_packed_entries_are_runnable():
    """Every tuned entry that asks for the packed dot is a MODE 4 tile it can run in: at most 4 rows, and a
    thread's 4-word step inside its tile (``BLOCK_K`` codes >= 1024 (INT4) / 512 (FP8) x warps)."""
    entries = [(key, cfg) for key, cfg in triton_wo.SMALL_M_TUNED.items() if cfg.get("PACKED")]
    assert entries  # (FP8 at M = 1 / 2 and INT4 at M = 2 are tuned packed)
    for (kind, n, k, m), cfg in entries:
        assert cfg["MODE"] == 4 and m <= triton_wo.GEMV_M_MAX, (kind, n, k, m)
        cpw = 8 if kind == "int4" else 4
        assert cfg["BLOCK_K"] // cpw >= 128 * cfg["num_warps"], (kind, n, k, m, cfg)
