"""Distil a ``sweep_w8a8.py`` result into the shared result format: one case per (variant, M, N, K)
with the best swept config, its peers from the same run and the targets.

    python benchmarks/distill_w8a8.py benchmarks/results/h200/sweeps/sweep_w8a8_2cta.json \
        benchmarks/results/h200/w8a8_m2048.json
"""

from __future__ import annotations

import json
import sys

FLOPS = lambda m, n, k: 2.0 * m * n * k  # noqa: E731


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    sweep = json.load(open(src))
    peers = {(p["M"], p["N"], p["K"]): p["ms"] for p in sweep["peers"]}
    cases = []
    for key, best in sweep["best"].items():
        variant, *dims = key.split("/")
        m, n, k = (int(d.split("=")[1]) for d in dims)
        flops = FLOPS(m, n, k)
        peer_tf = {name: flops / (ms * 1e-3) / 1e12 for name, ms in peers[(m, n, k)].items()}
        cases.append({
            "case": f"W8A8 {variant} GEMM M={m} N={n} K={k}", "metric": "matmul throughput", "unit": "TFLOP/s",
            "ours": best["TFLOPs"], "peers": peer_tf, "floor": None, "ours_over_floor": None,
            "ours_vs_best_peer": best["TFLOPs"] / max(peer_tf.values()), "config": best["config"],
            "rel_err": best["rel_err"], "ms": best["ms"], "peers_ms": peers[(m, n, k)], "speedup": best["speedup"],
        })  # fmt: skip
    out = {
        "name": "w8a8", "device": sweep["device"], "date": sweep["date"],
        "command": f"{sweep['command']}; python benchmarks/distill_w8a8.py {src} {dst}",
        "env": sweep["env"], "cases": cases, "targets": sweep["targets"], "ceilings": sweep["ceilings"],
        "diagnostics": sweep.get("diagnostics"),
        "note": f"Cases distilled from {src.split('results/h200/')[-1]} (one run): best swept config per kernel and "
                "shape; peers timed in the same process.",
    }  # fmt: skip
    with open(dst, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {dst}: {len(cases)} cases; targets {out['targets']}")


if __name__ == "__main__":
    main()
