"""FP4 weight-only (MXFP4 / NVFP4, emulated decode: ``quant.fp4_matmul``) at the Llama-3.1-8B MLP shape (N=14336,
K=4096) and M = 1, 4, 16, 128, 2048, against bf16 ``F.linear`` (cuBLAS) and the INT4 W4A16 g128 dispatcher, all
timed the same way in one run: a CUDA graph of calls rotating over weight copies larger than the L2, so weights
stream from HBM as in decode. Each call is first checked against the reference. Floor: the FP4 weight's bytes
(codes + scales) over the copy bandwidth measured here. ``--fmts nf4`` times bitsandbytes-style NF4 weights
(``NF4Weight``, ``quant.nf4_matmul``, absmax per 64) the same way, beside bitsandbytes' own CUDA kernels
(``bnb.matmul_4bit`` over the same weights quantized by bitsandbytes, fp32 absmax) where bitsandbytes is installed.

    python benchmarks/bench_fp4.py --out $OUT/r/fp4.json     # GPU, ~1-2 min
    python benchmarks/bench_fp4.py --fmts nf4 --out $OUT/r/nf4.json
    python benchmarks/bench_fp4.py --fmts nf4 --variants triton,mode9,mma --out ...  # MODE 9 off / on / from one row
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, rel_err, time_graph, write_results  # noqa: E402

from infercore.quant import FP4Weight, IntWeight, NF4Weight, fp4_matmul, naive, nf4_matmul, wq_matmul  # noqa: E402

L2_BYTES = 50e6 * 2  # rotate over at least this many weight bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,4,8,16,32,128,2048")
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--fmts", default="mxfp4,nvfp4", help="of mxfp4, nvfp4, nf4")
    ap.add_argument("--nf4-dequant-min", type=int, default=0, help="override triton_nf4.DEQUANT_M_MIN (a sweep)")
    ap.add_argument("--nf4-gemv-max", type=int, default=-1, help="override triton_nf4.GEMV_M_MAX (a sweep)")
    ap.add_argument("--variants", default="",
                    help="comma list of extra rows of every format: 'triton' (MODE 9 off), 'mode9' (MODE 9 on at its "
                         "rows), 'mma' (MODE 9 on from one row)")
    args = ap.parse_args()
    bad = [v for v in args.variants.split(",") if v and v not in ("triton", "mode9", "mma")]
    if bad:
        ap.error(f"--variants: expected triton, mode9 or mma, got {bad}")
    from infercore.quant import triton_fp4, triton_nf4

    if args.nf4_dequant_min:
        triton_nf4.DEQUANT_M_MIN = args.nf4_dequant_min
    if args.nf4_gemv_max >= 0:
        triton_nf4.GEMV_M_MAX = args.nf4_gemv_max
    n, k, dev = args.n, args.k, torch.device("cuda")
    bw = copy_bandwidth()
    torch.manual_seed(0)
    base = torch.randn(n, k, device=dev) * 0.02
    w16 = base.to(torch.bfloat16)
    fmts = args.fmts.split(",")
    fp4 = {f: NF4Weight.quantize(base) if f == "nf4" else FP4Weight.quantize(base, fmt=f) for f in fmts}

    def parts(q):  # (matmul, reference, weight bytes, a copy)
        if isinstance(q, NF4Weight):
            return (nf4_matmul, naive.nf4_matmul_ref, q.qweight.numel() + 4 * q.absmax.numel(),
                    lambda: NF4Weight(q.qweight.clone(), q.absmax.clone(), q.codebook.clone(), q.blocksize))
        return (fp4_matmul, naive.fp4_matmul_ref, q.qweight.numel() + q.scales.numel(),
                lambda: FP4Weight(q.qweight.clone(), q.scales.clone(), q.fmt, q.global_scale))
    int4 = IntWeight.quantize(base, bits=4, group_size=128)
    bnb = _bnb_weights(w16) if "nf4" in fmts else None

    def copies_of(nbytes):
        return max(2, math.ceil(L2_BYTES / nbytes))

    def rotate(t, c):
        return [t] + [t.clone() for _ in range(c - 1)]

    c16 = copies_of(w16.numel() * 2)
    w16s = rotate(w16, c16)
    cases, rows = [], []
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        def timer(calls, c):
            for i in range(c):  # eager first: cuBLAS handles, repacks and compiles stay out of the capture
                calls(i)
            return time_graph(calls, math.ceil(max(c, 24) / c) * c, reps=7, warmup=1) * 1e6

        bf16_us = timer(lambda i: F.linear(x, w16s[i % c16]), c16)
        peers = {"bf16 F.linear (cuBLAS)": bf16_us}
        c4 = copies_of(int4.qweight.numel() + int4.scales.numel() * 4)
        i4s = [int4] + [IntWeight(int4.qweight.clone(), int4.scales.clone(), None if int4.zeros is None else
                                  int4.zeros.clone(), 4, 128, k) for _ in range(c4 - 1)]  # fmt: skip
        wq_matmul(x, int4)
        peers["int4 w4a16-g128 (dispatcher)"] = timer(lambda i: wq_matmul(x, i4s[i % c4]), c4)
        if bnb is not None:
            mm4, bq = bnb
            try:
                peers["bitsandbytes matmul_4bit nf4"] = timer(lambda i: mm4(x, bq[i % len(bq)][0].t(),
                                                                            quant_state=bq[i % len(bq)][1]), len(bq))
            except Exception as e:  # noqa: BLE001  (printed: a peer that could not be timed the same way)
                print("bitsandbytes matmul_4bit not timed:", repr(e)[:300], flush=True)
        runs = [(fmt, q, None) for fmt, q in fp4.items()]
        if args.variants:
            runs += [(f"{f}[{v}]", q, v) for f, q in fp4.items() for v in args.variants.split(",")]
        for fmt, q, variant in runs:
            mm, ref, nbytes, copy = parts(q)
            saved = triton_nf4.MMA_ROWS, triton_fp4.MMA_ROWS, triton_nf4.MMA, triton_fp4.MMA
            mrows = {"triton": (0, -1), "mma": (1, 16), "mode9": None}.get(variant)
            if variant in ("mma", "mode9"):
                triton_nf4.MMA = triton_fp4.MMA = True
            if mrows:
                triton_nf4.MMA_ROWS = triton_fp4.MMA_ROWS = mrows
            err = rel_err(mm(x, q), ref(x, q))
            cq = copies_of(nbytes)
            qs = [q] + [copy() for _ in range(cq - 1)]
            us = timer(lambda i: mm(x, qs[i % cq]), cq)
            triton_nf4.MMA_ROWS, triton_fp4.MMA_ROWS, triton_nf4.MMA, triton_fp4.MMA = saved
            floor = nbytes / bw * 1e6
            row = {"fmt": fmt, "m": m, "us": us, "bf16_us": bf16_us, "x_bf16": bf16_us / us,
                   "int4_us": peers["int4 w4a16-g128 (dispatcher)"], "floor_us": floor, "err": err,
                   "bnb_us": peers.get("bitsandbytes matmul_4bit nf4") if fmt.startswith("nf4") else None}
            rows.append(row)
            print(row, flush=True)
            label = fmt if fmt.startswith("nf4") else f"fp4 weight-only {fmt}"
            cases.append(case(f"{label} N={n} K={k} M={m} bf16", metric="time", unit="us", ours=us,
                              peers=peers, floor=floor, speedup_vs_bf16=bf16_us / us, rel_err=err,
                              weight_bytes=nbytes, copy_bw_TBps=bw / 1e12))  # fmt: skip
    write_results(args.out, "nf4" if fmts == ["nf4"] else "fp4", torch.cuda.get_device_name(), cases,
                  extra={"rows": rows})


def _bnb_weights(w16):
    """bitsandbytes' ``matmul_4bit`` and one copy of the weight NF4-quantized by bitsandbytes (fp32 absmax per 64)
    per rotation slot, or None without bitsandbytes (it is not on the GPU machine's image unless carried)."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as BF
    except Exception as e:  # noqa: BLE001
        print("bitsandbytes unavailable:", repr(e)[:200], flush=True)
        return None
    copies = max(2, math.ceil(L2_BYTES / (w16.numel() // 2)))
    return bnb.matmul_4bit, [BF.quantize_4bit(w16, blocksize=64, quant_type="nf4", compress_statistics=False)
                             for _ in range(copies)]


if __name__ == "__main__":
    main()
