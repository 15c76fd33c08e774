"""The decode-step GEMMs of the Llama-3.1-8B shape at one batch size, per BLAS backend (H200 diagnostics).

At batch 256 a decode step's linears are cuBLAS GEMMs with M = 256 (probe_decode_batch.py: ~6 ms of a
~13 ms step). This times ``F.linear`` at that M for each linear shape under torch's BLAS backends
(``torch.backends.cuda.preferred_blas_library``: "cublas", the default, and "cublaslt"), in a CUDA
graph of calls that rotates over weight copies larger than the L2 (weights stream from HBM as in
decode), with the weight-read floor and the tensor-core ceiling (989 TFLOP/s dense bf16) beside it.

    python benchmarks/probe_gemm_batch.py --out $OUT/probe_gemm_m256.json      # H200, ~30 s

``--inductor`` adds a third row per shape: ``torch.compile(mode="max-autotune-no-cudagraphs")`` of the
same ``F.linear``, whose autotuner times cuBLAS against Inductor's Triton GEMM templates (persistent
TMA ones included) and keeps the fastest; the pick is timed the same way (a few minutes of compiles).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, time_graph, write_results  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PEAK_TFLOPS = 989.0  # H200 dense bf16 tensor-core peak (datasheet)


def _linear(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.linear(a, b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32, help="layers per step, for the per-step total")
    ap.add_argument("--inductor", action="store_true", help="also time torch.compile max-autotune's pick")
    args = ap.parse_args()
    bw = copy_bandwidth()
    torch.manual_seed(0)
    m = args.m
    x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    cases, per_backend, first = [], {}, {}
    backends = ["cublas", "cublaslt"] + (["inductor"] if args.inductor else [])
    for backend in backends:
        torch.backends.cuda.preferred_blas_library("cublas" if backend == "inductor" else backend)
        linear = F.linear
        if backend == "inductor":
            import torch._inductor.config as icfg

            icfg.triton.enable_persistent_tma_matmul = True
            linear = torch.compile(_linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        step_us = 0.0
        for name, (n, k) in SHAPES.items():
            copies = max(1, math.ceil((256 << 20) / (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            xk = x[:, :k]
            call = lambda i, xk=xk, ws=ws, c=copies, f=linear: f(xk, ws[i % c])  # noqa: E731
            call(0)  # eager first: creates the BLAS handle / picks the algorithm outside the capture
            us = time_graph(call, copies * 4, reps=7, warmup=1) * 1e6
            floor_us = (n * k * 2 + m * (n + k) * 2) / bw * 1e6
            flop = 2 * m * n * k
            tflops = flop / (us * 1e-6) / 1e12
            ceiling = min(PEAK_TFLOPS, flop / (floor_us * 1e-6) / 1e12)  # tensor cores or weight bytes
            step_us += us * (1 if name == "lm_head" else args.layers)
            peers = {} if backend == "cublas" else {"cublas": first[name]}
            first.setdefault(name, tflops)
            cases.append(case(f"F.linear M={m} {name} ({n}x{k}) backend={backend}", metric="matmul throughput",
                              unit="TFLOP/s", ours=tflops, peers=peers, floor=ceiling, us=us, bytes_floor_us=floor_us))
            print(f"{backend:9s} {name:8s} {us:8.2f} us  {tflops:6.1f} TFLOP/s  floor {floor_us:7.2f} us", flush=True)
        per_backend[backend] = step_us
        print(f"{backend}: linears per step ({args.layers} layers + lm_head) {step_us / 1e3:.3f} ms", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    write_results(args.out, "probe_gemm_batch", torch.cuda.get_device_name(), cases,
                  {"step_linears_ms": {b: v / 1e3 for b, v in per_backend.items()}, "copy_bw_TBps": bw / 1e12})


if __name__ == "__main__":
    main()
