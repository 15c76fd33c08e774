"""MODE 4's packed fp16 INT4 dot (``triton_wo._int4_dot4``) on the CPU: its inline PTX run by a small
interpreter of the instructions it uses (fp16 pairs rounded as the hardware rounds them), fed the
activations scaled as the kernel scales them, against the exact sum. The GPU test runs the kernel."""

from __future__ import annotations

import re

import numpy as np
import pytest

from infercore.quant import triton_wo


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


def run_ptx(asm: str, args: list[int]) -> float:
    """Interpret ``asm`` (the subset ``_int4_dot_asm`` emits) with ``$1..`` = ``args`` (32-bit ints); ``$0``."""
    reg: dict[str, object] = {f"${i + 1}": a for i, a in enumerate(args)}

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
    return float(reg["$0"])


def packed_dot(q: np.ndarray, x: np.ndarray, z: int) -> float:
    """The kernel's step for 4 words: ``q [4, 8]`` codes (word i, nibble j), ``x [4, 8]`` the activations of
    those codes; returns ``sum (q - z) x`` as the kernel forms it (scaled, fp16, then unscaled)."""
    words = [sum(int(q[i, j]) << (4 * j) for j in range(8)) for i in range(4)]
    mx = np.float32(np.abs(x).max())
    e = max((int(np.array(mx, dtype=np.float32).view(np.int32)) >> 23) & 0xFF, 11)
    sc = float(np.array((264 - e) << 23, dtype=np.int32).view(np.float32))
    inv = float(np.array((e - 10) << 23, dtype=np.int32).view(np.float32))
    xs = x.astype(np.float32) * np.float32(sc)
    pairs = [_bits16(xs[i, j]) | (_bits16(xs[i, j + 4]) << 16) for i in range(4) for j in range(4)]
    mz = [0x54005400 | (z * 65537), 0x44004400 | (z * 65537 << 4)]
    return run_ptx(triton_wo._int4_dot_asm(4), words + pairs + mz) * inv * 16


@pytest.mark.parametrize("kind", ["normal", "tiny", "huge", "mixed", "zeros"])
def test_packed_dot_matches_exact(kind):
    rng = np.random.default_rng(0)
    for trial in range(20):
        q = rng.integers(0, 16, size=(4, 8))
        z = int(rng.integers(0, 16))
        x = rng.standard_normal((4, 8))
        if kind == "tiny":
            x *= 1e-5
        elif kind == "huge":
            x *= 1e6
        elif kind == "mixed":
            x = np.where(rng.random((4, 8)) < 0.1, x * 1e4, x * 1e-3)
        elif kind == "zeros":
            x[:] = 0.0
        x = x.astype(np.float32)  # (bf16 activations are exact in fp32)
        exact = float(((q - z) * x.astype(np.float64)).sum())
        got = packed_dot(q, x, z)
        scale = float((np.abs(q - z) * np.abs(x.astype(np.float64))).sum())
        assert np.isfinite(got) and abs(got - exact) <= 2e-3 * scale + 1e-30, (kind, trial, got, exact)
