"""MODE 7 (``gluon_frag``: MODE 6's INT4 / FP8 fragments streamed by TMA into a shared-memory ring, one warp per
64-channel block) against the dispatcher's choice (MODE 6 / 5 / 4) and bf16 ``F.linear``, over its STAGES and
SPLIT. Every config is first checked against ``dequantize()`` + an fp32 matmul, then all are timed in
alternating rounds (one CUDA graph per config over weight copies that exceed the L2, as ``sweep_quant_wo.py``),
the median of the rounds reported.

    python benchmarks/probe_tma_frag.py --out $OUT/r/probe_tma_frag.json     # H200, ~3 min
    python benchmarks/probe_tma_frag.py --cases fp8:gate_up/2:4,fp8:gate_up:1:silu --out ...   # FP8 (per-channel)
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

from infercore.quant import gluon_frag as GF  # noqa: E402
from infercore.quant import triton_frag as TF  # noqa: E402

SHAPES = {"gate_up/2": (14336, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096),
          "o_proj": (4096, 4096), "lm_head": (128256, 4096)}


GRID = [(1, 2, 4), (1, 2, 8), (2, 2, 2), (2, 2, 4), (2, 2, 8), (2, 3, 4), (2, 3, 8), (4, 2, 1), (4, 2, 2), (4, 2, 4),
        (4, 2, 8), (4, 3, 2), (4, 3, 4), (4, 4, 2), (4, 4, 4), (8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 4, 1), (8, 4, 2)]


def frags(q, act: bool, kind: str = "int4"):
    """The fragment words and scales the dispatcher's MODE 6 / 7 use for ``q`` (made once, cached)."""
    if kind == "fp8":
        n = q.shape[0]
        s = q.scales.float()[TF._act_rows(n, 32, q.scales.device)] if act else q.scales.float().contiguous()
        return TF.packed(q.qweight, ("fp8", act), lambda: (TF.pack_fp8(q.qweight, act), s))
    group = q.group_size if q.scales.shape[1] != 1 else q.padded_in_features
    return TF.packed(q.qweight, ("int4", act), lambda: TF.pack_int4(q.codes(), q.scales, q.zeros, group, act))


def main() -> None:  # noqa: C901 (one linear script)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="gate_up/2:1,gate_up/2:4,gate_up/2:16,gate_up:1,down:1,qkv:1")
    ap.add_argument("--grid", default="", help="W:STAGES:SPLIT[:MAXNREG[:TAGGED[:FLAGS]]],... (default GRID)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=400.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    cases, rows = [], []
    for spec in within_budget(args.cases.split(","), args.budget_s, t0):
        kind = "int4"
        if spec.startswith("fp8:"):
            kind, spec_ = "fp8", spec[4:]
        else:
            spec_ = spec
        shape, m, *rest = spec_.split(":")
        m = int(m)
        act = rest[0] if rest else None
        n, k = SHAPES[shape]
        w = torch.randn(n, k, device="cuda") * 0.02
        q, qs, fn, _ = quant_copies(kind, w)
        copies = len(qs)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = x.float() @ q.dequantize(torch.float32).T
        if act:
            ref = F.silu(ref[:, : n // 2].to(torch.bfloat16).float()) * ref[:, n // 2:].to(torch.bfloat16).float()
        w16s = bf16_copies(w)
        c16 = len(w16s)
        n_calls = math.ceil(max(copies, 24) / copies) * copies
        timed = {"bf16 F.linear": (lambda i: F.linear(x, w16s[i % c16]), math.ceil(n_calls / c16) * c16),
                 "dispatcher": (lambda i: fn(x, qs[i % copies], act=act), n_calls)}
        for qq in qs:
            fn(x, qq, act=act)
        err = rel_err(fn(x, q, act=act), ref)
        print(f"{spec}: dispatcher rel err {err:.3g}", flush=True)
        packs = [frags(qq, act is not None, kind) for qq in qs]
        extra = {"kind": kind, "fold": 2.0**120} if kind == "fp8" else {}
        descs = [GF.descriptor(p[0]) for p in packs]
        gk = k // 128
        grid = [tuple(int(v) for v in e.split(":")) for e in args.grid.split(",")] if args.grid else GRID
        for wq, stages, split, *opt in grid:
            if split > gk:
                continue
            cfg = {"W": wq, "STAGES": stages, "SPLIT": split, **({"MAXNREG": opt[0]} if opt and opt[0] else {}),
                   **({"TAGGED": bool(opt[1])} if len(opt) > 1 else {}),
                   **({"FLAGS": bool(opt[2])} if len(opt) > 2 else {})}
            label = json.dumps(cfg, sort_keys=True)
            try:
                words, sz = packs[0]
                err = rel_err(GF.launch(x, words, sz, n, cfg, descs[0], act=act, **extra), ref)
                if not err < 1e-2:
                    raise RuntimeError(f"rel err {err:.3g}")
                err2 = rel_err(GF.launch(x, words, sz, n, cfg, descs[0], act=act, **extra), ref)  # counters reset
                if not err2 < 1e-2:
                    raise RuntimeError(f"second call rel err {err2:.3g}")
            except Exception as e:  # noqa: BLE001
                rows.append({"case": spec, "config": cfg, "error": repr(e)[:400]})
                print(f"  {spec} {cfg}: FAILED {repr(e)[:300]}", flush=True)
                continue
            timed[label] = (lambda i, c=cfg: GF.launch(x, packs[i % copies][0], packs[i % copies][1], n, c,
                                                       descs[i % copies], act=act, **extra), n_calls)
        med = alternating_rounds(timed, args.rounds, rows, spec)
        mode7 = {lab: us for lab, us in med.items() if lab.startswith("{")}
        best = min(mode7.items(), key=lambda kv: kv[1]) if mode7 else (None, float("nan"))
        summary = {"case": spec, "dispatcher_us": med["dispatcher"], "bf16_us": med["bf16 F.linear"],
                   "best_mode7": {"config": best[0], "us": best[1]}}
        cases.append(summary)
        print(f"{spec}: dispatcher {med['dispatcher']:.2f} bf16 {med['bf16 F.linear']:.2f} | best MODE 7 "
              f"{best[1]:.2f} {best[0]}", flush=True)
        for lab, us in sorted(mode7.items(), key=lambda kv: kv[1])[:8]:
            print(f"    {us:7.2f} {lab}", flush=True)
        write_results(args.out, "probe_tma_frag", torch.cuda.get_device_name(), [],
                      {"summary": cases, "rows": rows, "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
