"""The TMA-fed one-warp MODE 6 (``quant.gluon_frag``) against the dispatcher and bf16, small M.

For 8B shapes, INT4 g128 and emulated FP8 (per channel), M = 1, 4, 8: every (REPS, STAGES, SPLIT) of a
small grid, each first checked against ``dequantize()`` + an fp32 matmul (relative error < 1e-2) and
against the dispatcher's own result, then timed in one CUDA graph over weight copies that exceed the L2
(as ``sweep_frag.py``). Peers in the same run: the dispatcher (no config) and bf16 ``F.linear``; the
floor is the bytes moved over the copy bandwidth measured here.

    python benchmarks/probe_gluon_wn.py --out $OUT/r/gluon_wn.json      # H200, ~2-3 min
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, rel_err, time_graph, write_results  # noqa: E402
from sweep_quant_wo import SHAPES, bf16_copies, copy_bandwidth, quant_copies  # noqa: E402

from infercore.quant import gluon_frag as GF  # noqa: E402
from infercore.quant import triton_frag as TF  # noqa: E402


def packs(kind: str, q):
    if kind == "int4":
        words, sz = TF.pack_int4(q.codes(), q.scales, q.zeros, 128)
        return words, sz, 1.0
    return TF.pack_fp8(q.qweight), q.scales.float().contiguous(), None


def main() -> None:  # noqa: C901 (one linear script)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="gate_up/2,down")
    ap.add_argument("--kinds", default="int4,fp8")
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--grid", default="4:3,4,6,8:4,8,16,32;2:3,4,6,8:4,8,16,32",
                    help="REPS:STAGES list:SPLIT list, ';'-separated")
    args = ap.parse_args()
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    timer = lambda c, n: time_graph(c, n, reps=7, warmup=1)
    shapes = {k: v for k, v in SHAPES.items() if any(s in k for s in args.shapes.split(","))}
    cases, rows = [], []
    torch.manual_seed(0)
    for sname, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        w16s = bf16_copies(w)
        c16 = len(w16s)
        for kind in args.kinds.split(","):
            q, qs, fn, qbytes = quant_copies(kind, w)
            copies = len(qs)
            pk = [packs(kind, qq) for qq in qs]
            wref = q.dequantize(torch.float32)
            for m in (int(s) for s in args.ms.split(",")):
                if time.perf_counter() - t0 > args.budget_s:
                    print("budget reached", flush=True)
                    break
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                ref = x.float() @ wref.T
                n_calls = math.ceil(max(copies, 24) / copies) * copies
                for qq in qs:
                    fn(x, qq)
                print(f"{kind} {sname} M={m}: peers", flush=True)
                peers = {"bf16 F.linear": timer(lambda i: F.linear(x, w16s[i % c16]), math.ceil(n_calls / c16) * c16),
                         "dispatcher": timer(lambda i: fn(x, qs[i % copies]), n_calls)}
                y_disp = fn(x, q)
                fold = 2.0**120
                best = None
                grid = [(int(r), int(st), int(sp)) for part in args.grid.split(";")
                        for r, sts, sps in [part.split(":")] for st in sts.split(",") for sp in sps.split(",")]
                for reps, stages, split in grid:
                    if True:
                        if time.perf_counter() - t0 > args.budget_s:
                            break
                        if True:
                            cfg = {"REPS": reps, "STAGES": stages, "SPLIT": split}
                            run = lambda i: GF.launch(x, kind, pk[i][0], n, cfg, s=pk[i][1],
                                                      fold=pk[i][2] or fold)
                            try:
                                print(f"  {kind} {sname} M={m} {cfg}: first launch", flush=True)
                                y = run(0)
                                torch.cuda.synchronize()
                                print("    returned", flush=True)
                                err = rel_err(y, ref)
                                diff = rel_err(y, y_disp.float())
                                if not err < 1e-2:
                                    raise RuntimeError(f"rel err {err:.3g}")
                                for i in range(copies):
                                    run(i)
                                us = timer(lambda i: run(i % copies), n_calls) * 1e6
                            except Exception as e:  # noqa: BLE001
                                rows.append({"kind": kind, "shape": sname, "M": m, "config": cfg,
                                             "error": repr(e)[:300]})
                                print(f"  {kind} {sname} M={m} {cfg}: FAILED {repr(e)[:200]}", flush=True)
                                continue
                            rows.append({"kind": kind, "shape": sname, "M": m, "config": cfg, "us": us,
                                         "rel_err": err, "vs_dispatcher_rel": diff})
                            print(f"  {kind} {sname} M={m} {cfg}: {us:.2f} us (dispatcher "
                                  f"{peers['dispatcher'] * 1e6:.2f}) err {err:.2e}", flush=True)
                            if best is None or us < best[0]:
                                best = (us, cfg, err, diff)
                floor_us = (qbytes + (m * k + m * n) * 2) / bw * 1e6
                peers_us = {p: t * 1e6 for p, t in peers.items()}
                if best is None:
                    continue
                us, cfg, err, diff = best
                print(f"{kind:4s} {sname:24s} M={m} gluon {us:7.2f} us {cfg} | "
                      f"dispatcher {peers_us['dispatcher']:7.2f} bf16 {peers_us['bf16 F.linear']:7.2f} "
                      f"floor {floor_us:6.2f} | err {err:.2e} vs disp {diff:.1e}",
                      flush=True)
                tf = lambda t: 2 * m * n * k / (t * 1e-6) / 1e12
                label = "W4A16 g128" if kind == "int4" else "FP8 weight-only emulated"
                cases.append(case(f"{label} TMA-fed MODE 6 {sname} M={m}", metric="effective TFLOP/s", unit="TFLOP/s",
                                  ours=tf(us), peers={p: tf(t) for p, t in peers_us.items()}, floor=tf(floor_us),
                                  ours_us=us, peers_us=peers_us, floor_us=floor_us, config=cfg,
                                  vs_bf16=peers_us["bf16 F.linear"] / us, rel_err=err))
    res = write_results(args.out, "gluon_wn", "h200", cases)
    res["rows"] = rows
    res["copy_bw_TBps"] = bw / 1e12
    import json

    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
