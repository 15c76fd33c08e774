"""Split the chrome traces of ``probe_l2_prefetch.py --trace`` into per-kernel times of a decoder layer.

With PDL a kernel starts before its predecessor ends, so a kernel's own share of the step is taken as
``end - max(previous end, start)`` over the main stream's kernels (the prefetch kernels left out, so a
chained prefetch's cost lands on the kernel after it). Layers are found by their decode-attention kernel
(rms_in, qkv, attn, merge, o_proj, rms_post, gate_up, down); the first and last layer are dropped.

    python benchmarks/trace_layer_split.py DIR "variant 0;variant 1;..." --out split.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys

LAYER = ("rms_in", "qkv", "attn", "merge", "o_proj", "rms_post", "gate_up", "down")


def split(path: str) -> dict:
    with (gzip.open if path.endswith(".gz") else open)(path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    ev.sort(key=lambda e: e["ts"])
    main = [e for e in ev if "l2_prefetch" not in e["name"]]
    pf = [e for e in ev if "l2_prefetch" in e["name"]]
    at = [j for j, e in enumerate(main) if e["name"].startswith("_decode_kernel")]
    own: dict[str, list[float]] = {k: [] for k in LAYER}
    for j0 in at[1:-1]:
        for k, name in enumerate(LAYER):
            e, p = main[j0 - 2 + k], main[j0 - 3 + k]
            own[name].append(e["ts"] + e["dur"] - max(p["ts"] + p["dur"], e["ts"]))
    out = {k: round(statistics.median(v), 3) for k, v in own.items()}
    out["layer"] = round(sum(out[k] for k in LAYER), 3)
    out["prefetch_kernels"] = len(pf)
    out["prefetch_kernel_us_mean"] = round(statistics.mean(e["dur"] for e in pf), 3) if pf else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("variants", help="';'-separated variant names, in the order of trace_0, trace_1, ...")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = {}
    for i, name in enumerate(args.variants.split(";")):
        path = os.path.join(args.dir, f"trace_{i}.json.gz")
        if os.path.exists(path):
            rows[name] = split(path)
            print(name, rows[name])
    with open(args.out, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "source": args.dir,
                   "unit": "us, median over 30 layers of 2 steps", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
