"""Launch configurations of the FP4 tiled kernel (``triton_fp4._fp4_kernel``) at 14336 x 4096, MXFP4 and NVFP4,
M = 8 / 16 / 32 / 64 by default (``--ms``; the grid's lists by flag): each config timed in a CUDA graph over weight
copies past the L2 (as ``bench_fp4.py`` times), checked against the reference first; prints the best per case and
writes every row.

    python benchmarks/sweep_fp4_tiled.py --out $OUT/r/sweep_fp4_tiled.json
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import rel_err, time_graph, write_results  # noqa: E402

from infercore.quant import FP4Weight, naive  # noqa: E402
from infercore.quant import triton_fp4 as T  # noqa: E402
from infercore.quant.wo_tiles import _m_bucket  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="8,16,32,64")
    ap.add_argument("--fmts", default="mxfp4,nvfp4")
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--bm", default="16,32,64")
    ap.add_argument("--bn", default="32,64,128")
    ap.add_argument("--bk", default="64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    args = ap.parse_args()
    n, k, dev = args.n, args.k, torch.device("cuda")
    torch.manual_seed(0)
    base = torch.randn(n, k, device=dev) * 0.02
    kern = T._fp4_kernel.fn  # past the autotuner
    rows = []
    grid_cfgs = list(itertools.product(*([int(v) for v in getattr(args, a).split(",")]
                                         for a in ("bm", "bn", "bk", "warps", "stages"))))
    for fmt in args.fmts.split(","):
        q = FP4Weight.quantize(base, fmt=fmt)
        copies = max(2, math.ceil(1e8 / (q.qweight.numel() + q.scales.numel())))
        qs = [q.qweight.clone() for _ in range(copies)]
        ss = [q.scales.clone() for _ in range(copies)]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = naive.fp4_matmul_ref(x, q)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            case_rows = []
            for bm, bn, bk, warps, stages in grid_cfgs:
                if bm > max(16, triton.next_power_of_2(m)) or bk < q.block:
                    continue

                def call(i):
                    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
                    kern[grid](x, qs[i % copies], ss[i % copies], y, m, n, k, _m_bucket(m), x.stride(0),
                               qs[0].stride(0), ss[0].stride(0), y.stride(0), q.global_scale, NV=fmt == "nvfp4",
                               BS=q.block, DOT_PRECISION="tf32", F16=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               GROUP_M=8, num_warps=warps, num_stages=stages)

                try:
                    call(0)
                    err = rel_err(y, ref.float())
                    if err > 1e-2:
                        raise RuntimeError(f"error {err}")
                    for i in range(copies):
                        call(i)
                    us = time_graph(call, math.ceil(max(copies, 24) / copies) * copies, reps=5, warmup=1) * 1e6
                except Exception as e:  # noqa: BLE001
                    print(fmt, m, (bm, bn, bk, warps, stages), "failed", repr(e)[:120], flush=True)
                    continue
                case_rows.append({"fmt": fmt, "m": m, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                                  "num_warps": warps, "num_stages": stages, "us": us, "err": err})
            case_rows.sort(key=lambda r: r["us"])
            for r in case_rows[:6]:
                print(r, flush=True)
            rows += case_rows
    write_results(args.out, "sweep_fp4_tiled", torch.cuda.get_device_name(), [], extra={"rows": rows})


if __name__ == "__main__":
    main()
