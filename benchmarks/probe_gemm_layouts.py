"""The batch-256 decode GEMMs of the Llama-3.1-8B shape under other operand layouts (H200 diagnostics).

``F.linear(x, W)`` with ``W [N, K]`` row-major is what the engine runs. cuBLAS picks its kernel from the
problem's layout, so the same product can run faster written another way, if the consumer of the output
accepts it (our own kernels take strides):

* ``linear``   ``F.linear(x, W)``: ``[M, N]``, the engine's form;
* ``swap``     ``W @ x^T``: the output transposed, ``[N, M]`` row-major (the same weights);
* ``wt``       ``x @ Wt`` with the weight stored ``[K, N]`` row-major;
* ``swap_wt``  ``Wt^T @ x^T``: transposed output from the ``[K, N]`` weight.

Each is timed in one CUDA graph over weight copies larger than the L2, in alternating rounds, per BLAS
backend (``preferred_blas_library`` "cublas" / "cublaslt"), with the weight-read floor and the
989 TFLOP/s bf16 ceiling beside it.

    python benchmarks/probe_gemm_layouts.py --out $OUT/probe_gemm_layouts.json      # H200, ~1-2 min
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _common import alternating_rounds, case, copy_bandwidth, write_results  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
PEAK_TFLOPS = 989.0
VARIANTS = ("linear", "swap", "wt", "swap_wt")


def _call(variant: str, x: torch.Tensor, xt: torch.Tensor, w: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    if variant == "linear":
        return F.linear(x, w)
    if variant == "swap":
        return torch.mm(w, xt)
    if variant == "wt":
        return torch.mm(x, wt)
    return torch.mm(wt.t(), xt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="256")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bw = copy_bandwidth()
    torch.manual_seed(0)
    cases, rows, steps = [], [], {}
    for m in [int(v) for v in args.ms.split(",")]:
        xfull = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
        for name, (n, k) in SHAPES.items():
            copies = max(1, math.ceil((256 << 20) / (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            wts = [w.t().contiguous() for w in ws]
            x = xfull[:, :k].contiguous()
            xt = x.t()
            ref = F.linear(x, ws[0]).float()
            timed = {}
            for backend in ("cublas", "cublaslt"):
                for v in VARIANTS:
                    torch.backends.cuda.preferred_blas_library(backend)
                    out = _call(v, x, xt, ws[0], wts[0]).float()
                    got = out if out.shape == ref.shape else out.t()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise AssertionError(f"{name} {v} {backend}: relative error {err}")

                    def call(i, v=v, b=backend, x=x, xt=xt, ws=ws, wts=wts, c=copies):
                        torch.backends.cuda.preferred_blas_library(b)  # host side: fixes the pick at capture
                        return _call(v, x, xt, ws[i % c], wts[i % c])

                    timed[f"{v}/{backend}"] = (call, copies * 4)
            us = alternating_rounds(timed, args.rounds, rows, f"M={m} {name}")
            torch.backends.cuda.preferred_blas_library("cublas")
            flop = 2 * m * n * k
            floor_us = (n * k * 2 + m * (n + k) * 2) / bw * 1e6
            base = us["linear/cublas"]
            for lab, t in us.items():
                steps.setdefault(f"M={m} {lab}", 0.0)
                steps[f"M={m} {lab}"] += t * args.layers
                cases.append(case(f"GEMM M={m} {name} ({n}x{k}) {lab}", metric="matmul throughput", unit="TFLOP/s",
                                  ours=flop / (t * 1e-6) / 1e12,
                                  peers={"linear/cublas": flop / (base * 1e-6) / 1e12},
                                  floor=min(PEAK_TFLOPS, flop / (floor_us * 1e-6) / 1e12), us=t,
                                  bytes_floor_us=floor_us))
                print(f"M={m} {name:8s} {lab:18s} {t:8.2f} us  {flop / (t * 1e-6) / 1e12:6.1f} TFLOP/s  "
                      f"(linear/cublas {base:.2f})", flush=True)
            best = min(us, key=us.get)
            steps.setdefault(f"M={m} best of each", 0.0)
            steps[f"M={m} best of each"] += us[best] * args.layers
    for lab, t in sorted(steps.items()):
        print(f"{lab:32s} {t / 1e3:7.3f} ms per step (4 linears x {args.layers} layers)", flush=True)
    write_results(args.out, "probe_gemm_layouts", torch.cuda.get_device_name(), cases,
                  {"step_linears_ms": {k: v / 1e3 for k, v in steps.items()}, "copy_bw_TBps": bw / 1e12,
                   "rows": rows})


if __name__ == "__main__":
    main()
