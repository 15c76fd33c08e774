"""MODE 6 (weights stored as MMA fragments, ``quant.triton_frag``) vs the shipping small-M path and peers.

For the Llama-3.1-8B linear shapes, W4A16 g128 and emulated FP8 (per channel), M = 1, 4, 16: every
MODE 6 tile (warps x repetitions) at the default split, then split-K 1/2/4/8 for the best two, each
first checked against ``dequantize()`` + an fp32 matmul (relative error < 1e-2), timed in one CUDA
graph over weight copies that exceed the L2 (as ``sweep_quant_wo.py``). Peers in the same run: the
call without a config (the dispatcher's choice: MODE 4 / 5, or MODE 6 where ``MODE6_TUNED`` lists the
shape), bf16 ``F.linear``, torch tinygemm
INT4 (``_weight_int4pack_mm``); the floor is the bytes moved over the copy bandwidth measured here.
Also: the fused gated-MLP epilogue (``act="silu"``) on the merged gate_up shape, against the same call
without MODE 6.

    python benchmarks/sweep_frag.py --out $OUT/r/sweep_frag.json      # H200, ~3 min

``table`` in the JSON is Python literal lines for ``MODE6_TUNED`` in ``quant/wo_tables.py``.
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, rel_err, time_graph, within_budget, write_results  # noqa: E402
from sweep_quant_wo import SHAPES, WORKING_SET, copy_bandwidth, make_weights, tinygemm_calls  # noqa: E402

from infercore.quant import triton_frag as TF  # noqa: E402

# (warps, repetitions per iteration). The run behind quant_wo_mode6.json also tried an L2 bulk prefetch
# 2-4 iterations ahead ("PF", since removed: it measured 0-8% slower); its rows keep that key.
# DEPTH: iterations whose loads are in flight ahead of the MMAs (1 or 2; DEPTH 3, the same two unrolled without
# register rotation, is measured by probe_frag_depth.py).
TILES = ((4, 4, 1), (4, 4, 2), (4, 2, 2), (2, 4, 2), (8, 2, 2), (8, 1, 2))
# The same kernel with the warps splitting N ("WN": each warp its own channel block, no cross-warp sum;
# more split-K to keep as many warps busy): (warps, repetitions, depth), swept with --wn.
TILES_WN = ((4, 4, 1), (4, 4, 2), (2, 4, 1), (2, 4, 2), (8, 4, 1), (4, 2, 2))
MS = (1, 4, 16)


def main() -> None:  # noqa: C901 (one linear script)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="", help="comma-separated subset of shape names (default: all)")
    ap.add_argument("--kinds", default="int4,fp8")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--wn", choices=["off", "also", "only"], default="off",
                    help="the warps-split-N tiles (TILES_WN) too, or only them")
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = "cuda"
    shapes = SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if any(s in k for s in args.shapes.split(","))}
    bw = copy_bandwidth()
    timer = lambda c, n: time_graph(c, n, reps=7, warmup=1)
    rows, cases, best = [], [], {}
    torch.manual_seed(0)
    for sname, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev) * 0.02
        w16 = w.to(torch.bfloat16)
        copies16 = max(1, math.ceil(WORKING_SET / (n * k * 2)))
        w16s = [w16] + [w16.clone() for _ in range(copies16 - 1)]
        for kind in args.kinds.split(","):
            wb = n * k // 2 if kind == "int4" else n * k
            copies = max(1, math.ceil(WORKING_SET / wb))
            q, qs, fn, qbytes = make_weights(kind, w, copies)
            wref = q.dequantize(torch.float32)
            for m in within_budget(MS, args.budget_s, t0):
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                ref = x.float() @ wref.T
                n_calls = math.ceil(max(copies, 24) / copies) * copies
                peers = {"bf16 F.linear": timer(lambda i: F.linear(x, w16s[i % copies16]),
                                                math.ceil(n_calls / copies16) * copies16) * 1e6}
                if kind == "int4":
                    peers["tinygemm int4"] = timer(tinygemm_calls(n, k, copies, x), n_calls) * 1e6
                for qq in qs:  # eager first calls: repacks made outside the graph
                    fn(x, qq)
                peers["dispatcher default (no config)"] = timer(lambda i: fn(x, qs[i % copies]), n_calls) * 1e6
                floor_us = (qbytes + (m * k + m * n) * 2) / bw * 1e6
                key = f"{kind},{n},{k},{m}"
                res = []

                def run(cfg):
                    try:
                        y = fn(x, q, config=cfg)
                        err = rel_err(y, ref)
                        if not err < 1e-2:
                            raise RuntimeError(f"rel err {err:.3g}")
                        for qq in qs:
                            fn(x, qq, config=cfg)
                        us = timer(lambda i: fn(x, qs[i % copies], config=cfg), n_calls) * 1e6
                    except Exception as e:  # noqa: BLE001
                        rows.append({"key": key, "config": cfg, "error": repr(e)[:300]})
                        print(f"  {key} {cfg}: FAILED {repr(e)[:300]}", flush=True)
                        return
                    rows.append({"key": key, "config": cfg, "us": us, "rel_err": err})
                    res.append((us, cfg))

                if args.wn != "only":
                    for warps, reps, depth in TILES:
                        run({"MODE": 6, "WARPS": warps, "REPS": reps, "DEPTH": depth})
                if args.wn != "off":
                    blocks = n // (64 if kind == "int4" else 32)
                    for warps, reps, depth in TILES_WN:
                        if blocks % warps == 0:  # SPLIT: ~12 warps (each a block x a K range) per SM
                            run({"MODE": 6, "WN": 1, "WARPS": warps, "REPS": reps, "DEPTH": depth,
                                 "SPLIT": max(1, 12 * 132 // blocks)})
                tried = {json.dumps(c, sort_keys=True) for _, c in res}
                for _, cfg in sorted(res, key=lambda r: r[0])[:3]:
                    for split in (1, 2, 4, 8, 16, 32):
                        c = {**cfg, "SPLIT": split}
                        if json.dumps(c, sort_keys=True) not in tried:
                            tried.add(json.dumps(c, sort_keys=True))
                            run(c)
                if not res:
                    continue
                us, cfg = min(res, key=lambda r: r[0])
                full = {**TF.default_config(kind, n, k, m, torch.cuda.get_device_properties(0).multi_processor_count),
                        **cfg}
                flops = 2 * m * n * k
                tf = lambda t: flops / (t * 1e-6) / 1e12
                best[key] = {"config": full, "us": us, "floor_us": floor_us, "peers_us": peers}
                label = "W4A16 g128" if kind == "int4" else "FP8 weight-only emulated"
                cases.append(case(f"{label} MODE 6 {sname} M={m}", metric="effective TFLOP/s", unit="TFLOP/s",
                                  ours=tf(us), peers={p: tf(t) for p, t in peers.items()}, floor=tf(floor_us),
                                  ours_us=us, peers_us=peers, floor_us=floor_us, config=full,
                                  vs_bf16=peers["bf16 F.linear"] / us))
                prev = peers["dispatcher default (no config)"]
                print(f"{kind:4s} {sname:24s} M={m:2d} MODE6 {us:7.2f} us | prev {prev:7.2f}"
                      f" bf16 {peers['bf16 F.linear']:7.2f} tinygemm {peers.get('tinygemm int4', float('nan')):7.2f}"
                      f" floor {floor_us:6.2f} | x bf16 {peers['bf16 F.linear'] / us:5.2f} | {full}", flush=True)
                write_results(args.out, "sweep_frag", torch.cuda.get_device_name(), cases)
    # the fused gated epilogue on the merged gate_up weight
    n, k = SHAPES["gate_up (28672x4096)"]
    w = torch.randn(n, k, device=dev) * 0.02
    fused = {}
    for kind in args.kinds.split(","):
        copies = max(1, math.ceil(WORKING_SET / (n * k // (2 if kind == "int4" else 1))))
        q, qs, fn, qbytes = make_weights(kind, w, copies)
        for m in (1, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            h = (x.float() @ q.dequantize(torch.float32).T).to(torch.bfloat16).float()
            ref = F.silu(h[:, : n // 2]) * h[:, n // 2:]
            b = best.get(f"{kind},{n},{k},{m}")
            cfg = {**b["config"]} if b else {"MODE": 6}
            n_calls = math.ceil(max(copies, 24) / copies) * copies
            out = {}
            for label, c in (("MODE 6 fused", cfg), ("dispatcher default (no config)", None)):
                y = fn(x, q, config=c, act="silu")
                for qq in qs:
                    fn(x, qq, config=c, act="silu")
                out[label] = {"us": timer(lambda i: fn(x, qs[i % copies], config=c, act="silu"), n_calls) * 1e6,
                              "rel_err": rel_err(y, ref)}
            fused[f"{kind},{n},{k},{m}"] = out
            print(f"fused silu {kind} M={m}: {out}", flush=True)
    table = [f'    ("{kk.split(",")[0]}", {kk.split(",")[1]}, {kk.split(",")[2]}, {kk.split(",")[3]}): '
             f'{ {c: v for c, v in b["config"].items() if c in ("WARPS", "REPS", "SPLIT", "DEPTH", "WN")} },'
             for kk, b in best.items()]
    write_results(args.out, "sweep_frag", torch.cuda.get_device_name(), cases,
                  {"rows": rows, "best": best, "fused_act": fused, "table": table, "copy_bw_TBps": bw / 1e12,
                   "wall_s": time.perf_counter() - t0})
    print("\n".join(table))
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
