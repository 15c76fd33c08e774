"""The ready-flag split-K finish of MODE 4 / 5 (``triton_wo._gemv_finish`` with ``FLAGS``) against the arrival
counter (``"FLAGS": False``), on the dispatcher's own configs for the Llama-3.1-8B linear shapes where it runs
MODE 4 or 5 with 2-8 splits. Both are checked against ``dequantize()`` + an fp32 matmul, then timed in alternating
rounds (one CUDA graph per variant over weight copies that exceed the L2, as ``sweep_quant_wo.py``).

    python benchmarks/probe_gemv_flags.py --out $OUT/r/probe_gemv_flags.json     # H200, ~2 min
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import alternating_rounds, rel_err, within_budget, write_results  # noqa: E402
from sweep_quant_wo import SHAPES, weight_cases  # noqa: E402

from infercore.quant import triton_wo as TW  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="2,4,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=240.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows, cases = [], []
    ms = tuple(int(v) for v in args.ms.split(","))
    for wc in within_budget(weight_cases(SHAPES, ms), args.budget_s, t0):
        kind, m, x, fn, q, qs, n, k = wc.kind, wc.m, wc.x, wc.fn, wc.q, wc.qs, wc.n, wc.k
        if TW._mode6_entry(kind, n, k, m, TW._num_sms(x.device), TW._mode7_ok(kind, x)) is not None:
            continue  # MODE 6 / 7 (gluon_frag has its own finish)
        kp = q.qweight.shape[1] * (2 if kind == "int4" else 1)
        cfg = TW._small_cfg(kind, n, kp, m, kp, x.device, None)
        if cfg["MODE"] not in (4, 5):
            continue
        for qq in qs:
            fn(x, qq)  # repacks and the split the launcher settles, outside the graphs
        if cfg.get("SPLIT", 0) == 1 or cfg.get("SPLIT", 0) > 8:
            continue  # (SPLIT 0: the launcher's heuristic, 1-16 splits)
        spec = f"{kind} {wc.sname} M={m}"
        errs = {f: rel_err(fn(x, q, config={**cfg, "FLAGS": f}), wc.ref) for f in (True, False)}
        if not max(errs.values()) < 1e-2:
            raise RuntimeError(f"{spec}: relative errors {errs}")
        copies = len(qs)
        n_calls = math.ceil(max(copies, 24) / copies) * copies
        timed = {f"flags {f}": (lambda i, f=f: fn(x, qs[i % copies], config={**cfg, "FLAGS": f}), n_calls)
                 for f in (True, False)}
        med = alternating_rounds(timed, args.rounds, rows, spec)
        cases.append({"case": spec, "config": cfg, "flags_us": med["flags True"], "counter_us": med["flags False"]})
        print(f"{spec:40s} MODE {cfg['MODE']} SPLIT {cfg['SPLIT']}: flags {med['flags True']:7.2f} us, "
              f"counter {med['flags False']:7.2f} us", flush=True)
    write_results(args.out, "probe_gemv_flags", torch.cuda.get_device_name(), [],
                  {"summary": cases, "rows": rows, "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
