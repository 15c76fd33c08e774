"""What a kernel that only reads the weight bytes of a small-M GEMV costs, timed like the GEMVs.

The weight-only targets are set against the copy bandwidth (bytes / 4.2 TB/s). A GEMV of a few
microseconds also pays a launch inside the CUDA graph, the first loads' latency and a tail. This
probe times, in one CUDA graph over buffer copies that exceed the L2 (as ``sweep_frag.py``):

* an empty Triton kernel (one program): the graph's per-kernel cost;
* a read-only kernel over ``nbytes`` (each program sums its slice with 16-byte loads, one fp32 out),
  over a few grid sizes and loads in flight: the practical floor of reading that many bytes once;

for the INT4 (N x K / 2 bytes) and FP8 (N x K) weights of the 8B MLP shape 14336 x 4096.

    python benchmarks/probe_read_floor.py --out $OUT/r/read_floor.json     # H200, ~20 s
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, time_graph, write_results  # noqa: E402
from sweep_quant_wo import WORKING_SET, copy_bandwidth  # noqa: E402


@triton.jit
def _empty(y_ptr):
    tl.store(y_ptr, 0.0)


@triton.jit
def _read(x_ptr, y_ptr, n_words, per_prog, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Sum int32 words ``[pid * per_prog, +per_prog)`` (< n_words) into ``y[pid]``."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    offs = tl.arange(0, BLOCK)
    for i in range(0, per_prog, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            o = base + i + u * BLOCK + offs
            acc += tl.load(x_ptr + o, mask=o < n_words, other=0, eviction_policy="evict_first")
    tl.store(y_ptr + pid, tl.sum(acc, 0).to(tl.float32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bw = copy_bandwidth()
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    y = torch.zeros(1 << 16, device="cuda")
    cases = []
    t = time_graph(lambda i: _empty[(1,)](y), 64, reps=9)
    print(f"empty kernel {t * 1e6:.2f} us", flush=True)
    cases.append(case("empty Triton kernel (1 program)", metric="time per call in a CUDA graph", unit="us",
                      ours=t * 1e6, peers={}, floor=None))
    for label, nbytes in (("int4 14336x4096", 14336 * 4096 // 2), ("fp8 14336x4096", 14336 * 4096)):
        words = nbytes // 4
        copies = max(1, math.ceil(WORKING_SET / nbytes))
        bufs = [torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        floor_us = nbytes / bw * 1e6
        best = None
        for progs_per_sm in (1, 2, 4, 8, 16):
            for block, unroll, warps in ((1024, 2, 4), (1024, 4, 4), (2048, 2, 8), (512, 4, 4), (2048, 4, 8)):
                progs = n_sms * progs_per_sm
                step = block * unroll
                per = triton.cdiv(triton.cdiv(words, progs), step) * step
                progs = triton.cdiv(words, per)
                fn = lambda i: _read[(progs,)](bufs[i % copies], y, words, per, BLOCK=block, UNROLL=unroll,
                                               num_warps=warps)
                t = time_graph(fn, 4 * copies, reps=9)
                us = t * 1e6
                row = {"programs": progs, "BLOCK": block, "UNROLL": unroll, "num_warps": warps, "us": us}
                if best is None or us < best["us"]:
                    best = row
        print(f"{label}: read {best['us']:.2f} us, floor {floor_us:.2f} us, best {best}", flush=True)
        cases.append(case(f"read-only {label} ({nbytes} B), best grid", metric="time per call in a CUDA graph",
                          unit="us", ours=best["us"], peers={}, floor=None, copy_bw_floor_us=floor_us,
                          fraction_of_copy_bw=floor_us / best["us"], config=best))
    for c in cases:
        c["copy_bw_TBps"] = bw / 1e12
    write_results(args.out, "read_floor", "h200", cases)


if __name__ == "__main__":
    main()
