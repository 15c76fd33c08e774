"""MODE 9 (``quant/cuda_mma.py``, the CUDA stream-K weight-only kernel) against the dispatcher's Triton kernels, bf16
``F.linear`` (cuBLAS) and tinygemm INT4, on the Llama-3.1-8B linear shapes at 1-16 rows.

Stage 1 checks MODE 9 against ``dequantize()`` + an fp32 matmul on odd shapes (padded channels, per-channel and
g256 groups, fp16 and bf16, every row count 1-16). Stage 2 sweeps its ring depth and CTAs per SM on the MLP shape;
stage 3 times the best launch on every shape next to the peers. All timings: one CUDA graph of many calls
rotating over weight copies larger than the L2 (``_common.time_graph``), as ``bench_wo_dispatch.py`` times.

    python benchmarks/probe_mma_wo.py --out $OUT/probe_mma_wo.json      # H200, ~3 min
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, rel_err, time_graph, write_results  # noqa: E402
from sweep_quant_wo import SHAPES, WORKING_SET, copy_bandwidth, tinygemm_calls  # noqa: E402

from infercore.quant import FP8Weight, IntWeight  # noqa: E402
from infercore.quant import cuda_mma as CM  # noqa: E402
from infercore.quant import triton_wo as TW  # noqa: E402


def quantize(kind: str, w: torch.Tensor, **kw):
    if kind == "int4":
        return IntWeight.quantize(w, bits=4, group_size=kw.get("group", 128), symmetric=kw.get("sym", False),
                                  clip_search=False)
    return FP8Weight.quantize(w, **({"block_size": kw["block"]} if kw.get("block") else {}))


def repack(kind: str, q):
    return CM.repack_int4(q) if kind == "int4" else CM.repack_fp8(q)


def weight_copies(kind: str, n: int, k: int) -> int:
    """How many quantized copies of an ``[n, k]`` weight exceed WORKING_SET bytes of codes (at least 2), so calls
    cycling through them read the codes from HBM, not the L2."""
    return max(2, math.ceil(WORKING_SET / (n * k // (2 if kind == "int4" else 1))))


def check(log: list) -> None:
    torch.manual_seed(1)
    cases = [("int4", 600, 384, {"group": 128}), ("int4", 512, 640, {"group": None, "sym": True}),
             ("int4", 4096, 1024, {"group": 256}), ("int4", 14336, 4096, {}), ("fp8", 328, 256, {}),
             ("fp8", 640, 512, {"block": 128}), ("fp8", 4096, 14336, {})]
    for kind, n, k, kw in cases:
        w = torch.randn(n, k, device="cuda") * 0.02
        q = quantize(kind, w, **kw)
        words, sc = repack(kind, q)
        wref = q.dequantize(torch.float32)
        for dtype in (torch.bfloat16, torch.float16):
            for m in (1, 2, 3, 8, 9, 16):
                x = torch.randn(m, k, device="cuda").to(dtype)
                for st, ct in ((4, 1), (3, 2)):
                    y = CM.matmul(x, kind, words, sc, n, k, stages=st, ctas=ct)
                    y2 = CM.matmul(x, kind, words, sc, n, k, stages=st, ctas=ct)  # flags must be clear again
                    err = rel_err(y, x.float() @ wref.T)
                    ok = err < 1e-2 and torch.equal(y, y2)
                    log.append({"check": f"{kind} {n}x{k} {kw} {dtype} M={m} st{st} c{ct}", "rel_err": err, "ok": ok})
                    if not ok:
                        print("FAIL", log[-1], flush=True)
    bad = [r for r in log if not r["ok"]]
    print(f"checks: {len(log) - len(bad)} ok, {len(bad)} failed", flush=True)
    if bad:
        raise SystemExit(1)


best_launch: dict = {}  # (kind, m) -> (stages, ctas): the sweep on the first shape, reused on the others


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--sweep", default="3:1,4:1,5:1,6:1,3:2,4:2")
    ap.add_argument("--shapes", default="")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    launches = [tuple(int(a) for a in v.split(":")) for v in args.sweep.split(",")]
    t0 = time.time()
    checks: list = []
    check(checks)
    print(f"checks done {time.time() - t0:.0f}s", flush=True)
    bw = copy_bandwidth()
    rows, cases = [], []
    shapes = {s: v for s, v in SHAPES.items() if not args.shapes or s.split(" ")[0] in args.shapes.split(",")}
    for si, (sname, (n, k)) in enumerate(shapes.items()):
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda") * 0.02
        w16 = w.to(torch.bfloat16)
        w16s = [w16] + [w16.clone() for _ in range(math.ceil(WORKING_SET / (w16.numel() * 2)) - 1)]
        for kind in ("int4", "fp8"):
            q = quantize(kind, w)
            copies = weight_copies(kind, n, k)
            qs = [q] + [dataclasses.replace(q, **{a: b.clone() for a, b in q.tensors().items()})
                        for _ in range(copies - 1)]
            packs = [repack(kind, qq) for qq in qs]
            pbytes = sum(t.numel() * t.element_size() for t in packs[0])
            fn = TW.wq_matmul_triton if kind == "int4" else TW.fp8_wo_matmul_triton
            wref = q.dequantize(torch.float32)
            for m in ms:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                ref = x.float() @ wref.T
                err = rel_err(CM.matmul(x, kind, *packs[0], n, k), ref)
                for qq in qs:
                    fn(x, qq)
                sweep = launches if si == 0 else [best_launch[(kind, m)]]
                timed = {}
                for st, ct in sweep:
                    CM.matmul(x, kind, *packs[0], n, k, stages=st, ctas=ct)
                    nc = len(packs) * 8
                    timed[(st, ct)] = time_graph(
                        lambda i: CM.matmul(x, kind, *packs[i % len(packs)], n, k, stages=st, ctas=ct), nc,
                        reps=7) * 1e6
                if si == 0:
                    best_launch[(kind, m)] = min(timed, key=timed.get)
                b = min(timed, key=timed.get)
                us = timed[b]
                nq = len(qs) * 8
                disp = time_graph(lambda i: fn(x, qs[i % len(qs)]), nq, reps=7) * 1e6
                bf = time_graph(lambda i: F.linear(x, w16s[i % len(w16s)]), len(w16s) * 8, reps=7) * 1e6
                peers = {"bf16 F.linear": bf, "dispatcher (Triton)": disp}
                if kind == "int4":
                    tg = tinygemm_calls(n, k, len(qs), x)
                    peers["tinygemm int4 g128"] = time_graph(tg, nq, reps=7) * 1e6
                floor_us = pbytes / bw * 1e6
                row = {"shape": sname, "kind": kind, "m": m, "mode9_us": us, "launch": b,
                       "sweep_us": {f"st{a}c{c}": v for (a, c), v in timed.items()}, "peers_us": peers,
                       "rel_err": err, "x_bf16": bf / us, "floor_us": floor_us}
                rows.append(row)
                print(json.dumps(row), flush=True)
                flops = 2 * m * n * k
                cases.append(case(f"{kind} {sname} M={m}", metric="effective throughput", unit="TFLOP/s",
                                  ours=flops / us * 1e-6, peers={p: flops / v * 1e-6 for p, v in peers.items()},
                                  floor=flops / floor_us * 1e-6, us=us, peers_us=peers))
    write_results(args.out, "probe_mma_wo", "h200", cases,
                  extra={"rows": rows, "checks": checks, "copy_bandwidth_Bps": bw})


if __name__ == "__main__":
    main()
