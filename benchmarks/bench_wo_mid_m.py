"""Weight-only matmuls between decode and prefill sizes (M = 17-128): which kernel should serve them.

For W4A16 g128 and emulated FP8 on Llama-3.1-8B linear shapes: the tensor-core words kernel (MODE 5, the
small-M path, here allowed up to 128 rows), the fused Triton GEMM, the weight decode + cuBLAS path, and
bf16 ``F.linear`` on the same weight, timed in one run as CUDA-graph replays over weight copies larger than
the L2 (``sweep_quant_wo.py``'s timing), each checked against ``dequantize()`` + an fp32 matmul first.
``ours`` is what the dispatcher picks at its committed thresholds (``triton_wo.WORDS_M_MAX``,
``triton_dequant.DEQUANT_M_MIN``).

    python benchmarks/bench_wo_mid_m.py --out $OUT/r/quant_wo_mid_m.json     # H200, ~2 min
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, rel_err, time_graph, write_results  # noqa: E402
from sweep_quant_wo import SHAPES, weight_cases  # noqa: E402

from infercore.quant import triton_dequant as TD  # noqa: E402
from infercore.quant import triton_wo as TW  # noqa: E402

MS = (17, 24, 32, 48, 64, 96, 128)
PATHS = {  # (WORDS_M_MAX, DEQUANT_M_MIN) that force each path for 17 <= M <= 128
    "MODE 5 words kernel": (128, 0),
    "fused Triton GEMM": (16, 0),
    "decode + cuBLAS": (16, 1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="gate_up/2,qkv,down")
    args = ap.parse_args()
    shapes = {k: v for k, v in SHAPES.items() if any(s in k for s in args.shapes.split(","))}
    timer = lambda c, n: time_graph(c, n, reps=5, warmup=1)
    words0, deq0 = TW.WORDS_M_MAX, dict(TD.DEQUANT_M_MIN)
    cases = []
    for wc in weight_cases(shapes, MS, at_least=2):
        sname, n, k, kind, m, x, fn, q, qs = wc.sname, wc.n, wc.k, wc.kind, wc.m, wc.x, wc.fn, wc.q, wc.qs
        copies, c16 = len(qs), len(wc.w16s)
        times, errs = {}, {}
        for label, (words, deq) in PATHS.items():
            TW.WORDS_M_MAX, TD.DEQUANT_M_MIN = words, {"int4": deq, "fp8": deq}
            errs[label] = rel_err(fn(x, q), wc.ref)
            times[label] = timer(lambda i: fn(x, qs[i % copies]), 2 * copies) * 1e6
        TW.WORDS_M_MAX, TD.DEQUANT_M_MIN = words0, dict(deq0)
        times["bf16 F.linear"] = timer(lambda i: F.linear(x, wc.w16s[i % c16]), 2 * c16) * 1e6
        if max(errs.values()) > 1e-2:
            raise RuntimeError(f"{kind} {sname} M={m}: relative errors {errs}")
        if m <= words0:
            path = "MODE 5 words kernel"
        elif 0 < deq0[kind] <= m:
            path = "decode + cuBLAS"
        else:
            path = "fused Triton GEMM"
        tf = lambda t: 2 * m * n * k / (t * 1e-6) / 1e12
        label = "W4A16 g128" if kind == "int4" else "FP8 weight-only emulated"
        cases.append(case(f"{label} {sname} M={m}", metric="effective TFLOP/s", unit="TFLOP/s",
                          ours=tf(times[path]), peers={"bf16 F.linear": tf(times["bf16 F.linear"])},
                          floor=None, dispatched=path, times_us=times, rel_err=errs))
        print(f"{kind:4s} {sname:24s} M={m:4d} " + " | ".join(f"{p} {t:7.1f}" for p, t in times.items())
              + f" | dispatched: {path}", flush=True)
    write_results(args.out, "quant_wo_mid_m", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
