"""Weight-only matmuls at prefill sizes: the fused Triton GEMM vs decode-once + cuBLAS (``triton_dequant``).

For W4A16 g128 and emulated FP8 on the Llama-3.1-8B MLP shapes, M from 32 to 4096: the fused GEMM
(``INFERCORE_WO_DEQUANT_M`` off), the one-pass decode + ``F.linear`` path, the decode alone, and bf16
``F.linear`` (cuBLAS) on the same weight, timed in one run as CUDA-graph replays over weight copies
larger than the L2 (``sweep_quant_wo.py``'s timing). Each path is first checked against
``dequantize()`` + an fp32 matmul. ``ours`` is the path the dispatcher takes at its default thresholds;
``crossover`` in the JSON: the smallest M from which the decode path wins on every shape (what
``DEQUANT_M_MIN``'s defaults were set from).

    python benchmarks/bench_wo_large_m.py --out $OUT/r/quant_wo_large_m.json     # H200, ~2 min
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
from sweep_quant_wo import weight_cases  # noqa: E402

from infercore.quant import triton_dequant as TD  # noqa: E402

SHAPES = {"gate_up/2 (14336x4096)": (14336, 4096), "down (4096x14336)": (4096, 14336),
          "gate_up (28672x4096)": (28672, 4096)}
MS = (32, 64, 128, 192, 256, 384, 512, 1024, 2048, 4096)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="", help="comma-separated subset of shape names")
    args = ap.parse_args()
    shapes = {k: v for k, v in SHAPES.items() if not args.shapes or any(s in k for s in args.shapes.split(","))}
    timer = lambda c, n: time_graph(c, n, reps=5, warmup=1)
    cases, wins = [], {}
    for wc in weight_cases(shapes, MS, at_least=2):
        sname, n, k, kind, m, x, fn, q, qs = wc.sname, wc.n, wc.k, wc.kind, wc.m, wc.x, wc.fn, wc.q, wc.qs
        copies, c16 = len(qs), len(wc.w16s)
        dec = TD.dequant_int_triton if kind == "int4" else TD.dequant_fp8_triton
        times, errs = {}, {}
        default = dict(TD.DEQUANT_M_MIN)
        for label, thr in (("fused Triton GEMM", 0), ("decode + cuBLAS", 1)):
            TD.DEQUANT_M_MIN = {"int4": thr, "fp8": thr}
            errs[label] = rel_err(fn(x, q), wc.ref)
            times[label] = timer(lambda i: fn(x, qs[i % copies]), 2 * copies) * 1e6
        TD.DEQUANT_M_MIN = default
        times["decode alone"] = timer(lambda i: dec(qs[i % copies], torch.bfloat16), 2 * copies) * 1e6
        times["bf16 F.linear"] = timer(lambda i: F.linear(x, wc.w16s[i % c16]), 2 * c16) * 1e6
        if max(errs.values()) > 1e-2:
            raise RuntimeError(f"{kind} {sname} M={m}: relative errors {errs}")
        tf = lambda t: 2 * m * n * k / (t * 1e-6) / 1e12
        thr = default[kind]
        path = "decode + cuBLAS" if 0 < thr <= m else "fused Triton GEMM"
        label = "W4A16 g128" if kind == "int4" else "FP8 weight-only emulated"
        cases.append(case(f"{label} {sname} M={m}", metric="effective TFLOP/s", unit="TFLOP/s",
                          ours=tf(times[path]), peers={"bf16 F.linear": tf(times["bf16 F.linear"])}, floor=None,
                          dispatched=path, times_us=times, rel_err=errs))
        wins.setdefault((kind, m), []).append(times["decode + cuBLAS"] < times["fused Triton GEMM"])
        print(f"{kind:4s} {sname:24s} M={m:5d} fused {times['fused Triton GEMM']:8.1f} us | decode+cuBLAS "
              f"{times['decode + cuBLAS']:8.1f} (decode {times['decode alone']:6.1f}) | bf16 "
              f"{times['bf16 F.linear']:8.1f}", flush=True)
    crossover = {kind: next((m for m in MS if all(all(wins[(kind, mm)]) for mm in MS if mm >= m)), None)
                 for kind in ("int4", "fp8")}
    print("crossover (decode path wins from here on every shape):", crossover, flush=True)
    write_results(args.out, "quant_wo_large_m", torch.cuda.get_device_name(), cases, {"crossover": crossover})


if __name__ == "__main__":
    main()
