"""Probe: does an L2 prefetch of a weight, issued while another kernel runs, make the GEMV that reads it faster?

One CUDA graph per variant: write a 256 MB buffer (evicts L2) -> prefetch the GEMV's weight tensors ->
spin ~20 us (``torch.cuda._sleep``, the stand-in for attention) -> the GEMV. The GEMV's own time is the
graph's time minus the same graph without it. Prefetch variants: none, per-line ``prefetch.global.L2``
(evict_last / normal), ``cp.async.bulk.prefetch.L2`` (16 KB or 1 MB per program), and ``touch`` (a real
read of the words: a sum).

    python benchmarks/probe_l2_hit.py --out $OUT/r/probe_l2_hit.json
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("INFERCORE_QUANT_AUTOTUNE", "0")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, write_results  # noqa: E402
from _l2_prefetch import l2_prefetch  # noqa: E402
from probe_l2_prefetch import read_set  # noqa: E402

from infercore.quant import QuantLinear, quantize_weight  # noqa: E402

VARIANTS = ("none", "line", "normal", "bulk", "bulk1m", "touch")


def graph_ms(fn, reps: int = 30) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="4096x4096,6144x4096,4096x14336,28672x4096")
    ap.add_argument("--schemes", default="w4a16-g128,fp8-wo,bf16")
    ap.add_argument("--spin", type=int, default=40000, help="cycles of the stand-in kernel")
    args = ap.parse_args()
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    x = torch.randn(1, 14336, dtype=torch.bfloat16, device="cuda")
    cases, rows = [], []
    for scheme in args.schemes.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            if scheme == "bf16":
                lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
                lin.weight.data.copy_(w)
            else:
                lin = QuantLinear(quantize_weight(w, scheme))
            xi = x[:, :k]
            with torch.inference_mode():
                lin(xi)  # repacks made
                ts = read_set(lin)
                mb = sum(t.numel() * t.element_size() for t in ts) / 1e6
                res = {}
                for v in VARIANTS:
                    def pre(v=v, ts=ts):
                        flush.fill_(1)
                        for t in ts:
                            if v == "touch":
                                t.view(torch.uint8).sum(dtype=torch.int32)
                            elif v != "none":
                                l2_prefetch(t, bulk=v.startswith("bulk"), evict_last=v == "line",
                                            chunk=1 << 20 if v == "bulk1m" else 16384)
                        torch.cuda._sleep(args.spin)

                    full = graph_ms(lambda pre=pre, lin=lin, xi=xi: (pre(), lin(xi)))
                    base = graph_ms(pre)
                    res[v] = (full - base) * 1e3
                print(f"{scheme} {shape} {mb:.1f} MB: " + ", ".join(f"{v} {t:.2f}" for v, t in res.items()), flush=True)
                rows.append({"scheme": scheme, "shape": shape, "MB": mb, "gemv_us": res})
                for v in VARIANTS[1:]:
                    cases.append(case(f"{scheme} {shape} M=1 GEMV after prefetch [{v}] under a spin kernel",
                                      metric="GEMV time (graph minus graph without it)", unit="us", ours=res[v],
                                      peers={"no prefetch": res["none"]}, floor=None, read_MB=mb))
            del lin, w
    write_results(args.out, "probe_l2_hit", torch.cuda.get_device_name(), cases,
                  extra={"rows": rows, "note": "Whether L2 prefetch hints, issued before a ~20 us spin kernel, make "
                                               "the following M=1 GEMV faster (L2 evicted by a 256 MB write first)."})


if __name__ == "__main__":
    main()
