# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
"""CUTLASS 3 sm90 GEMMs (``benchmarks/cutlass_sm90``) against ``F.linear`` (cuBLAS) on the decode-step GEMMs of the
Llama-3.1-8B shape (H200 diagnostics for the batch-256 decode target).

Each configuration (tile, cluster, schedule, persistent or stream-K scheduler; stream-K builds also per
decomposition) is checked against ``F.linear`` and timed in alternating rounds (``_common.alternating_rounds``: one
CUDA graph of calls rotating over weight copies larger than the L2 per entry and round), ``F.linear`` in each round.

    python benchmarks/probe_cutlass_gemm.py --out $OUT/probe_cutlass_gemm.json --ms 256   # needs nvcc + CUTLASS

CUTLASS's headers: ``pip install nvidia-cutlass`` (its wheel carries them) or ``INFERCORE_CUTLASS_DIR``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import cutlass_sm90.cutlass_gemm as cutlass  # noqa: E402
from _common import alternating_rounds, case, rel_err, write_results  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
L2_BYTES = 60 << 20


def entries(name: str) -> list[tuple[str, str, int]]:
    """(config, mode, splits) to time for one shape."""
    out = []
    for cfg, spec in cutlass.CONFIGS.items():
        if spec[6]:  # stream-K build
            out += [(cfg, "heuristic", 1), (cfg, "dp", 1), (cfg, "streamk", 1)]
            if name in ("down", "o_proj", "qkv"):
                out.append((cfg, "splitk", 2))
        else:
            out.append((cfg, "heuristic", 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="", help="comma-separated subset of cutlass.CONFIGS")
    args = ap.parse_args()
    if args.configs:
        keep = set(args.configs.split(","))
        for k in list(cutlass.CONFIGS):
            if k not in keep:
                del cutlass.CONFIGS[k]
    t0 = time.time()
    cutlass.build()
    build_s = time.time() - t0
    print(f"built {len(cutlass.CONFIGS)} configs in {build_s:.1f} s", flush=True)
    cases, rows, errors = [], [], []
    torch.manual_seed(0)
    for m in (int(v) for v in args.ms.split(",")):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            copies = max(2, math.ceil(2 * L2_BYTES / (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            timed = {"F.linear": (lambda i: torch.matmul(x, ws[i % copies].t(), out=y), copies * 4)}
            for cfg, mode, splits in entries(name):
                lab = f"{cfg}/{mode}" + (f"{splits}" if mode == "splitk" else "")
                try:
                    got = cutlass.gemm(x, ws[0], config=cfg, mode=mode, splits=splits)
                    torch.cuda.synchronize()
                    err = rel_err(got, ref)
                except Exception as e:  # noqa: BLE001
                    errors.append({"case": f"{name} M={m}", "config": lab, "error": repr(e)[:500]})
                    print(f"  {name} M={m} {lab}: FAILED {repr(e)[:300]}", flush=True)
                    continue
                if not err < 2e-2:
                    errors.append({"case": f"{name} M={m}", "config": lab, "rel_err": err})
                    print(f"  {name} M={m} {lab}: WRONG rel_err {err}", flush=True)
                    continue
                timed[lab] = (lambda i, c=cfg, md=mode, s=splits: cutlass.gemm(x, ws[i % copies], config=c, mode=md,
                                                                              splits=s, out=y), copies * 4)
            cname = f"M={m} {name} ({n}x{k})"
            med = alternating_rounds(timed, args.rounds, rows, cname)
            flop = 2.0 * m * n * k
            base = med["F.linear"]
            best_lab = min((lab for lab in med if lab != "F.linear" and med[lab] == med[lab]), key=lambda b: med[b],
                           default=None)
            if best_lab is not None:
                cases.append(case(f"best CUTLASS vs F.linear, {cname}", metric="matmul throughput", unit="TFLOP/s",
                                  ours=flop / med[best_lab] * 1e-6, peers={"F.linear (cuBLAS)": flop / base * 1e-6},
                                  floor=None, config=best_lab, us=med[best_lab], us_cublas=base))
            print(f"{cname}: F.linear {base:.2f} us; best {best_lab} {med.get(best_lab, float('nan')):.2f} us",
                  flush=True)
            ws = None
    write_results(args.out, "probe_cutlass_gemm", torch.cuda.get_device_name(), cases,
                  extra={"rows": rows, "errors": errors, "build_s": build_s,
                         "configs": {k: list(v) for k, v in cutlass.CONFIGS.items()},
                         "config_fields": ["tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "pingpong",
                                           "streamk"]})


if __name__ == "__main__":
    main()
