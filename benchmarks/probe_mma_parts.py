# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
"""Where MODE 9's time goes: the kernel as is (PROBE 0), without decode / MMA (1), without weight loads (2), on a
few shapes and launches. Results of probes 1 / 2 are wrong by design; only their times mean anything.

    python benchmarks/probe_mma_parts.py --out $OUT/probe_mma_parts.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import time_graph, write_results  # noqa: E402
from probe_mma_wo import quantize, repack, weight_copies  # noqa: E402

from infercore.quant import cuda_mma as CM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="int4:14336:4096,int4:4096:4096,fp8:14336:4096")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--launches", default="4:1,4:2")
    ap.add_argument("--probes", default="0,1,2")
    ap.add_argument("--defines", default="", help="extra -D switches for every compile, e.g. TIMING=1")
    args = ap.parse_args()
    rows = []
    for cs in args.cases.split(","):
        kind, n, k = cs.split(":")
        n, k = int(n), int(k)
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda") * 0.02
        copies = weight_copies(kind, n, k)
        packs = [repack(kind, quantize(kind, w)) for _ in range(copies)]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for la in args.launches.split(","):
                st, ct = (int(v) for v in la.split(":"))
                row = {"case": cs, "m": m, "stages": st, "ctas": ct, "defines": args.defines}
                for pr in (int(v) for v in args.probes.split(",")):
                    extra = tuple(d for d in args.defines.split(",") if d)
                    CM.DEFINES = ((f"PROBE={pr}",) if pr else ()) + extra
                    CM.matmul(x, kind, *packs[0], n, k, stages=st, ctas=ct)
                    row[f"probe{pr}_us"] = time_graph(
                        lambda i: CM.matmul(x, kind, *packs[i % len(packs)], n, k, stages=st, ctas=ct),
                        len(packs) * 8, reps=7) * 1e6
                CM.DEFINES = ()
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_results(args.out, "probe_mma_parts", "h200", [], extra={"rows": rows})


if __name__ == "__main__":
    main()
