"""MODE 6's K loop with the two-set register rotation (DEPTH 2) against the same pipeline unrolled three
ways without it (DEPTH 3), optionally under a register cap (MAXNREG), at the tuned tiles and around them.

For each (kind, shape, M): the dispatcher's call (no config), the shipping MODE 6 entry where there is one,
and variants of it; every variant first checked against ``dequantize()`` + an fp32 matmul, then all timed
in alternating rounds (one CUDA graph per config over weight copies that exceed the L2, as
``sweep_quant_wo.py``), the median of the rounds reported. bf16 ``F.linear`` in the same rounds.

    python benchmarks/probe_frag_depth.py --out $OUT/r/probe_frag_depth.json     # H200, ~4 min
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

from _common import alternating_rounds, rel_err, within_budget, write_results  # noqa: E402
from sweep_quant_wo import bf16_copies, quant_copies  # noqa: E402

SHAPES = {"gate_up/2": (14336, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096),
          "o_proj": (4096, 4096), "lm_head": (128256, 4096), "70b_o_proj": (8192, 8192), "70b_qkv": (10240, 8192),
          "wide_k": (8192, 4096)}
# shapes outside the tuned tables: MODE 4's packed tiles next to MODE 6 (the dispatcher's default from 8192 channels)
UNTUNED = ("lm_head", "70b_o_proj", "70b_qkv", "wide_k")


def _wn(warps, reps, split, depth, maxnreg=0, wn=1):
    c = {"MODE": 6, "WARPS": warps, "REPS": reps, "SPLIT": split, "DEPTH": depth}
    if wn:
        c["WN"] = 1
    if maxnreg:
        c["MAXNREG"] = maxnreg
    return c


def variants(kind: str, shape: str, m: int, caps: bool) -> list[dict]:
    """The tuned entry's neighbourhood: DEPTH 2 (as shipped, where MODE 6 ships) vs 3 (and, with ``caps``,
    3 under a register cap: 128 with one B fragment, 168 with two), over warps and splits."""
    out = []
    splits = (4, 8, 16) if m == 1 else (1, 2, 4, 8)
    if shape == "down":
        splits = tuple(2 * s for s in splits)
    cap = 128 if m <= 8 else 168
    for warps in (2, 4, 8):
        for split in splits:
            out.append(_wn(warps, 4, split, 2))
            out.append(_wn(warps, 4, split, 3))
            if caps:
                out.append(_wn(warps, 4, split, 3, cap))
    if shape in UNTUNED:  # MODE 4's packed tiles and MODE 6 at DEPTH 2 / 3 with few splits too
        out = [_wn(w, 4, sp, d, 128 if d == 3 and kind == "int4" else 0) for w in (2, 4)
               for sp in ((1, 2, 4) if shape == "lm_head" else (4, 8, 16)) for d in (2, 3)]
        out += [{"MODE": 4, "BLOCK_N": bn, "BLOCK_K": 2048, "num_warps": w, "num_stages": 2, "SPLIT": sp,
                 "PACKED": True} for bn in (4, 8) for w in (2, 4) for sp in (0, 1)]
        return out
    if m > 1:  # the warps splitting K (the merged gate_up's M = 2..4 entry)
        for depth in (1, 2, 3):
            for split in (1, 2):
                out.append(_wn(4, 4, split, depth, wn=0))
    elif kind == "int4" and not caps:
        out += [_wn(4, 4, 8, 3, 128), _wn(2, 4, 8, 3, 128), _wn(2, 4, 4, 3, 128)]
    return out


def main() -> None:  # noqa: C901 (one linear script)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="int4:gate_up/2:1,int4:gate_up/2:4,int4:gate_up:1,int4:down:1,int4:qkv:1,"
                                        "fp8:gate_up/2:4,fp8:gate_up/2:16,fp8:gate_up/2:2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--caps", action="store_true", help="every DEPTH 3 tile also under a register cap")
    ap.add_argument("--budget-s", type=float, default=400.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    cases, rows = [], []
    for spec in within_budget(args.cases.split(","), args.budget_s, t0):
        kind, shape, m = spec.split(":")
        m = int(m)
        n, k = SHAPES[shape]
        w = torch.randn(n, k, device="cuda") * 0.02
        q, qs, fn, _ = quant_copies(kind, w)
        copies = len(qs)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = x.float() @ q.dequantize(torch.float32).T
        w16s = bf16_copies(w)
        c16 = len(w16s)
        n_calls = math.ceil(max(copies, 24) / copies) * copies
        timed = {"bf16 F.linear": (lambda i: F.linear(x, w16s[i % c16]), math.ceil(n_calls / c16) * c16),
                 "dispatcher": (lambda i: fn(x, qs[i % copies]), n_calls)}
        for qq in qs:
            fn(x, qq)
        for cfg in variants(kind, shape, m, args.caps):
            label = json.dumps(cfg, sort_keys=True)
            try:
                err = rel_err(fn(x, q, config=cfg), ref)
                if not err < 1e-2:
                    raise RuntimeError(f"rel err {err:.3g}")
                for qq in qs:
                    fn(x, qq, config=cfg)
            except Exception as e:  # noqa: BLE001
                rows.append({"case": spec, "config": cfg, "error": repr(e)[:300]})
                print(f"  {spec} {cfg}: FAILED {repr(e)[:200]}", flush=True)
                continue
            timed[label] = (lambda i, c=cfg: fn(x, qs[i % copies], config=c), n_calls)
        med = alternating_rounds(timed, args.rounds, rows, spec)
        d2 = {lab: us for lab, us in med.items() if '"DEPTH": 2' in lab}
        d3 = {lab: us for lab, us in med.items() if '"DEPTH": 3' in lab}
        best2 = min(d2.items(), key=lambda kv: kv[1]) if d2 else (None, float("nan"))
        best3 = min(d3.items(), key=lambda kv: kv[1]) if d3 else (None, float("nan"))
        summary = {"case": spec, "dispatcher_us": med["dispatcher"], "bf16_us": med["bf16 F.linear"],
                   "best_depth2": {"config": best2[0], "us": best2[1]},
                   "best_depth3": {"config": best3[0], "us": best3[1]}}
        cases.append(summary)
        print(f"{spec}: dispatcher {med['dispatcher']:.2f} bf16 {med['bf16 F.linear']:.2f} | best D2 {best2[1]:.2f} "
              f"{best2[0]} | best D3 {best3[1]:.2f} {best3[0]}", flush=True)
        write_results(args.out, "probe_frag_depth", torch.cuda.get_device_name(), [],
                      {"summary": cases, "rows": rows, "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
