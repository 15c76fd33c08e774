"""Launch configurations of the FP4 kernels at 14336 x 4096, MXFP4 and NVFP4: the GEMV (``--kernel gemv``,
``triton_fp4._fp4_gemv_kernel``, M = 1 / 2 / 4) or the tiled kernel (``--kernel tiled``, ``triton_fp4._fp4_kernel``,
5-95 rows; the grid's lists by flag). Each config is timed in a CUDA graph over weight copies past the L2 (as
``bench_fp4.py`` times), checked against the reference first; prints the best per case and writes every row.

    python benchmarks/sweep_fp4_gemv.py --out $OUT/r/sweep_fp4_gemv.json
    python benchmarks/sweep_fp4_gemv.py --kernel tiled --ms 16,64 --out $OUT/r/sweep_fp4_tiled.json
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


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def gemv_case(args, q, x, y, m, n, k, copies):
    """``(config dict, launch(i))`` of every GEMV config: (BLOCK_N, BLOCK_W, warps, stages)."""
    kern = T._fp4_gemv_kernel.fn  # past the autotuner: the heuristics (EVEN) and the kernel
    ws = [T.fp4_words(q) for _ in range(copies)]
    ss = [q.scales.clone() for _ in range(copies)]
    for bn, bw, warps, stages in itertools.product([1, 2, 4, 8, 16], [128, 256, 512], [1, 2, 4, 8], [1, 3]):
        if bn * bw < warps * 32 * 4 or bn * bw * 8 // (warps * 32) > 256:
            continue  # fewer than 4 words a thread, or more than 256 codes
        yield {"BLOCK_N": bn, "BLOCK_W": bw, "num_warps": warps, "num_stages": stages}, lambda i: kern[
            (triton.cdiv(n, bn),)](x, ws[i % copies], ss[i % copies], y, m, n, k, x.stride(0), ws[0].stride(0),
                                   ss[0].stride(0), y.stride(0), q.global_scale, NV=q.fmt == "nvfp4", BS=q.block,
                                   MR=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_W=bw, num_warps=warps,
                                   num_stages=stages)  # fmt: skip


def tiled_case(args, q, x, y, m, n, k, copies):
    """``(config dict, launch(i))`` of every tiled-kernel config of the flags' lists."""
    kern = T._fp4_kernel.fn  # past the autotuner
    qs = [q.qweight.clone() for _ in range(copies)]
    ss = [q.scales.clone() for _ in range(copies)]
    grid = itertools.product(*(_ints(getattr(args, a)) for a in ("bm", "bn", "bk", "warps", "stages")))
    for bm, bn, bk, warps, stages in grid:
        if bm > max(16, triton.next_power_of_2(m)) or bk < q.block:
            continue
        yield {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}, lambda i: kern[
            (triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
                x, qs[i % copies], ss[i % copies], y, m, n, k, _m_bucket(m), x.stride(0), qs[0].stride(0),
                ss[0].stride(0), y.stride(0), q.global_scale, NV=q.fmt == "nvfp4", BS=q.block, DOT_PRECISION="tf32",
                F16=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernel", choices=["gemv", "tiled"], default="gemv")
    ap.add_argument("--ms", default=None, help="rows (default: 1 for the GEMV, 8,16,32,64 for the tiled kernel)")
    ap.add_argument("--fmts", default="mxfp4")
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--bm", default="16,32,64", help="tiled: BLOCK_M list")
    ap.add_argument("--bn", default="32,64,128", help="tiled: BLOCK_N list")
    ap.add_argument("--bk", default="64,128,256", help="tiled: BLOCK_K list")
    ap.add_argument("--warps", default="4,8", help="tiled: num_warps list")
    ap.add_argument("--stages", default="2,3,4", help="tiled: num_stages list")
    args = ap.parse_args()
    n, k, dev = args.n, args.k, torch.device("cuda")
    cases = gemv_case if args.kernel == "gemv" else tiled_case
    ms = _ints(args.ms or ("1" if args.kernel == "gemv" else "8,16,32,64"))
    torch.manual_seed(0)
    base = torch.randn(n, k, device=dev) * 0.02
    rows = []
    for fmt in args.fmts.split(","):
        q = FP4Weight.quantize(base, fmt=fmt)
        copies = max(2, math.ceil(1e8 / (q.qweight.numel() + q.scales.numel())))
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = naive.fp4_matmul_ref(x, q)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            case_rows = []
            for cfg, call in cases(args, q, x, y, m, n, k, copies):
                try:
                    call(0)
                    err = rel_err(y, ref.float())
                    if err > 1e-2:
                        raise RuntimeError(f"error {err}")
                    for i in range(copies):
                        call(i)
                    us = time_graph(call, math.ceil(max(copies, 24) / copies) * copies, reps=5, warmup=1) * 1e6
                except Exception as e:  # noqa: BLE001
                    print(fmt, m, cfg, "failed", repr(e)[:120], flush=True)
                    continue
                case_rows.append({"kernel": args.kernel, "fmt": fmt, "m": m, **cfg, "us": us, "err": err})
            case_rows.sort(key=lambda r: r["us"])
            for r in case_rows[:6]:
                print(r, flush=True)
            rows += case_rows
    write_results(args.out, f"sweep_fp4_{args.kernel}", torch.cuda.get_device_name(), [], extra={"rows": rows})


if __name__ == "__main__":
    main()
