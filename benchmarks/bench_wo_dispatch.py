"""Weight-only small-M GEMV/GEMM as the dispatcher runs them (no config): W4A16 g128 and emulated FP8 on
the Llama-3.1-8B linear shapes, M = 1, 2, 4, 16 (``--ms``), against bf16 ``F.linear`` (cuBLAS) and torch tinygemm INT4
(``_weight_int4pack_mm``), all timed the same way in one run: a CUDA graph of many calls that rotates
over weight copies larger than the L2 (``sweep_quant_wo.py``'s timing), so the weights stream from HBM
as in decode. Each call is first checked against ``dequantize()`` + an fp32 matmul. The floor is the
bytes moved over the copy bandwidth measured here. Per case: which kernel the dispatcher chose
(MODE 4 / 5 / 6, WN), the ratio to bf16, and ``eager_us_per_call``: back-to-back eager calls on one weight,
which the host's dispatch (Python and Triton's launcher) bounds at these sizes.

    python benchmarks/bench_wo_dispatch.py --out $OUT/r/quant_wo_dispatch.json     # H200, ~2 min
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

from _common import case, eager_us, rel_err, time_graph, write_results  # noqa: E402
from sweep_quant_wo import SHAPES, copy_bandwidth, tinygemm_calls, weight_cases  # noqa: E402

from infercore.quant import triton_wo as TW  # noqa: E402


def _dispatched(kind: str, x: torch.Tensor, q, n: int, k: int) -> str:
    """The kernel the dispatcher picks for this call (a label for the JSON)."""
    m = x.shape[0]
    if kind in ("int4", "fp8") and TW.mode9_default(x, q):
        return (f"MODE 9 (cuda_mma, stages {TW.CM.STAGES[kind]}, CTAs/SM {TW.CM.CTAS_PER_SM[kind]}, "
                f"K parts {TW.CM.KSPLIT[kind]}{', -D ' + ' '.join(TW.CM.DEFINES) if TW.CM.DEFINES else ''})")
    tuned = TW._mode6_entry(kind, n, k, m, TW._num_sms(x.device), TW._mode7_ok(kind, x))
    if tuned is not None:
        return f"MODE {tuned.get('MODE', 6)} {tuned}"
    kp = q.qweight.shape[1] * (2 if kind == "int4" else 1)
    cfg = TW._small_cfg(kind, n, kp, m, kp, x.device, None)
    return f"MODE {cfg['MODE']} {cfg}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,2,4,16", help="comma-separated row counts")
    ap.add_argument("--kinds", default="int4,fp8")
    ap.add_argument("--shapes", default="", help="comma-separated shape-name prefixes (default: all)")
    args = ap.parse_args()
    pick = args.shapes.split(",") if args.shapes else [""]
    shapes = {s: v for s, v in SHAPES.items() if any(s.startswith(p) for p in pick)}
    ms = tuple(int(v) for v in args.ms.split(","))
    bw = copy_bandwidth()
    timer = lambda c, n: time_graph(c, n, reps=7, warmup=1)
    cases = []
    for wc in weight_cases(shapes, ms, kinds=tuple(args.kinds.split(","))):
        sname, n, k, kind, m, x, fn, q, qs = wc.sname, wc.n, wc.k, wc.kind, wc.m, wc.x, wc.fn, wc.q, wc.qs
        copies, c16 = len(qs), len(wc.w16s)
        err = rel_err(fn(x, q), wc.ref)
        if not err < 1e-2:
            raise RuntimeError(f"{kind} {sname} M={m}: relative error {err:.3g}")
        for qq in qs:  # eager first calls: repacks made outside the graph
            fn(x, qq)
        n_calls = math.ceil(max(copies, 24) / copies) * copies
        us = timer(lambda i: fn(x, qs[i % copies]), n_calls) * 1e6
        peers = {"bf16 F.linear": timer(lambda i: F.linear(x, wc.w16s[i % c16]),
                                        math.ceil(n_calls / c16) * c16) * 1e6}
        if kind == "int4":
            peers["tinygemm int4"] = timer(tinygemm_calls(n, k, copies, x), n_calls) * 1e6
        # eager: back-to-back calls on one weight (host-bound when the host's dispatch is the longer)
        eager = eager_us(lambda: fn(x, q))
        floor_us = (wc.qbytes + (m * k + m * n) * 2) / bw * 1e6
        tf = lambda t: 2 * m * n * k / (t * 1e-6) / 1e12
        label = "W4A16 g128" if kind == "int4" else "FP8 weight-only emulated"
        kernel = _dispatched(kind, x, q, n, k)
        cases.append(case(f"{label} {sname} M={m}", metric="effective TFLOP/s", unit="TFLOP/s", ours=tf(us),
                          peers={p: tf(t) for p, t in peers.items()}, floor=tf(floor_us), ours_us=us,
                          peers_us=peers, floor_us=floor_us, vs_bf16=peers["bf16 F.linear"] / us,
                          kernel=kernel, rel_err=err, eager_us_per_call=eager))
        print(f"{kind:4s} {sname:24s} M={m:2d} {us:7.2f} us | bf16 {peers['bf16 F.linear']:7.2f}"
              f" tinygemm {peers.get('tinygemm int4', float('nan')):7.2f} floor {floor_us:6.2f}"
              f" | x bf16 {peers['bf16 F.linear'] / us:5.2f} | eager {eager:6.1f} | {kernel}", flush=True)
    write_results(args.out, "quant_wo_dispatch", torch.cuda.get_device_name(), cases, {"copy_bw_TBps": bw / 1e12})


if __name__ == "__main__":
    main()
