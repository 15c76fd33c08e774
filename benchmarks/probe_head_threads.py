"""The tied lm_head of SmolLM2 (49152 x 576) at one decode row on the host, cold as it is in a decode step (a
256 MB read evicts it before every call): dense bf16 (57 MB) against GGUF Q8_0 blocks run by the native INT8
GEMV (30 MB of codes + scales), at several thread counts. Random weights; no model file needed, so it runs on
any host (the H200 machine's 16 cores included).

    python benchmarks/probe_head_threads.py --threads 1,2,4,8,16 --out benchmarks/results/cpu/sweeps/head_threads.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402

from infercore.ops.moe import cpu_native  # noqa: E402
from infercore.quant import GGUFWeight  # noqa: E402
from infercore.quant.cpu import native_operands  # noqa: E402


def cold_us(fn, flush: torch.Tensor, calls: int) -> float:
    lib = cpu_native._need()
    times = []
    for _ in range(calls):
        lib.infercore_read_pass(flush.data_ptr(), flush.numel(), torch.get_num_threads())
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/head_threads.json")
    args = ap.parse_args()
    if not cpu_native.available():
        raise SystemExit(f"native host kernels unavailable: {cpu_native.status()}")
    N, K = 49152, 576
    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.05
    dense = w.to(torch.bfloat16).contiguous()
    codes, sz, bits = native_operands(GGUFWeight.quantize(w, qtype="q8_0"))
    assert bits == 8
    x = torch.randn(1, K).to(torch.bfloat16)
    flush = torch.ones(256 << 20, dtype=torch.uint8)
    q8_bytes = codes.numel() * codes.element_size() + sz.numel() * sz.element_size()
    cases = []
    for nt in [int(t) for t in args.threads.split(",") if int(t) <= os.cpu_count()]:
        torch.set_num_threads(nt)
        bw = cpu_native.read_bandwidth(1 << 30, repeats=3)
        cpu_native.linear_dense(x, dense), cpu_native.linear_q8(x, codes, sz)
        t_dense = cold_us(lambda: cpu_native.linear_dense(x, dense), flush, args.calls)
        t_q8 = cold_us(lambda: cpu_native.linear_q8(x, codes, sz), flush, args.calls)
        print(f"{nt} threads: read {bw / 1e9:.1f} GB/s; cold head dense bf16 {t_dense:.0f} us, Q8_0 {t_q8:.0f} us "
              f"({t_dense / t_q8:.2f}x)", flush=True)
        cases.append(case(f"lm_head 49152x576 M=1 cold, GGUF Q8_0 native vs dense bf16, {nt} threads",
                          metric="calls per second", unit="1/s", ours=1e6 / t_q8, peers={"dense bf16": 1e6 / t_dense},
                          floor=bw / q8_bytes, threads=nt, read_bandwidth_GBps=bw / 1e9, q8_us=t_q8,
                          dense_us=t_dense, dense_floor_us=N * K * 2 / bw * 1e6, q8_bytes=q8_bytes))
    write_results(args.out, "probe_head_threads", "cpu", cases)


if __name__ == "__main__":
    main()
