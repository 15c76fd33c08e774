"""The native CPU GEMVs over each GGUF format's blocks as stored (``quant.cpu.native_operands``: Q4_0 / Q4_1 / Q4_K
through the INT4 kernel, Q5_0 / Q5_1 / Q5_K the 5-bit one, Q8_0 / Q6_K the INT8 one), one token row against a
4096 x 4096 weight of random blocks: best time cache-warm (the call repeated) and evicted (64 MB written between
calls), with bf16 activations and with 8-bit ones (``cpu_native.set_int8_activations``, where the kernel takes
them); dense bf16 (``cpu_native.linear_dense``) beside them.

    python benchmarks/probe_gguf_gemv.py [--out benchmarks/results/cpu/sweeps/cpu_gguf_gemv.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402

from infercore.ops.moe import cpu_native  # noqa: E402
from infercore.quant import GGUFWeight  # noqa: E402
from infercore.quant.cpu import native_operands  # noqa: E402
from infercore.quant.gguf import BLOCK_BYTES, BLOCK_ELEMS  # noqa: E402

N = K = 4096
F16 = {"q4_0": (0,), "q4_1": (0, 2), "q8_0": (0,), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2),
       "q6_k": (208,)}  # byte offsets of each format's fp16 fields


def random_blocks(qtype: str) -> GGUFWeight:
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, size=(N, K // BLOCK_ELEMS[qtype], BLOCK_BYTES[qtype]), dtype=np.uint8)
    for off in F16[qtype]:
        b[..., off : off + 2] = rng.uniform(-1e-3, 1e-3, size=b.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    return GGUFWeight.from_blocks(torch.from_numpy(b), qtype)


def best_us(fn, evict: torch.Tensor | None, reps: int = 25) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if evict is not None:
            evict.add_(1)
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_gguf_gemv.json")
    args = ap.parse_args()
    if not cpu_native.q4_supported():
        raise SystemExit(f"the native quantized GEMVs do not run here: {cpu_native.status()}")
    fns = {4: cpu_native.linear_q4, 5: cpu_native.linear_q5, 8: cpu_native.linear_q8}
    x = torch.randn(1, K).bfloat16()
    big = torch.empty(64 << 20, dtype=torch.uint8)
    dense = torch.randn(N, K).bfloat16()
    bf16 = {"warm": best_us(lambda: cpu_native.linear_dense(x, dense), None),
            "evicted": best_us(lambda: cpu_native.linear_dense(x, dense), big)}
    cases = []
    for qtype in F16:
        codes, sz, bits = native_operands(random_blocks(qtype))
        run = lambda f=fns[bits], c=codes, s=sz: f(x, c, s)  # noqa: E731
        row = {"warm": best_us(run, None), "evicted": best_us(run, big)}
        with cpu_native.int8_activations() as on:
            a8 = {"int8_activations_warm_us": best_us(run, None), "int8_activations_evicted_us": best_us(run, big)} \
                if on and bits != 5 else {}
        print(f"{qtype}: kernel {bits}-bit, warm {row['warm']:.0f} us, evicted {row['evicted']:.0f} us"
              + (f"; 8-bit activations {a8['int8_activations_warm_us']:.0f} / "
                 f"{a8['int8_activations_evicted_us']:.0f} us" if a8 else ""), flush=True)
        cases.append(case(f"gguf {qtype} {N}x{K} one row, evicted", metric="GEMV time", unit="us",
                          ours=row["evicted"], peers={"dense bf16 (native GEMV)": bf16["evicted"]}, floor=None,
                          kernel_bits=bits, warm_us=row["warm"], operand_bytes=codes.numel() + 4 * sz.numel(),
                          dense_bf16_warm_us=bf16["warm"], **a8))
    write_results(args.out, "probe_gguf_gemv", "cpu", cases)


if __name__ == "__main__":
    main()
