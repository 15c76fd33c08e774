"""Host time of eager weight-only calls (no CUDA graph): back-to-back calls on one 14336x4096 weight, INT4 g128
and emulated FP8, M = 1 / 16 / 128, with a cProfile of the M = 1 / 16 calls (where the host's dispatch, not
the GPU, bounds them). Prints only; the log of a run is committed beside the results.

    python benchmarks/probe_eager_dispatch.py > $OUT/r/probe_eager_dispatch.log      # H200, ~20 s
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import eager_us  # noqa: E402
from sweep_quant_wo import make_weights  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    n, k = 14336, 4096
    w = torch.randn(n, k, device="cuda") * 0.02
    for kind in ("int4", "fp8"):
        q, _, fn, _ = make_weights(kind, w, 1)
        for m in (1, 16, 128):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            print(f"{kind} M={m}: {eager_us(lambda: fn(x, q), n=500):.1f} us per eager call (host-bound loop)",
                  flush=True)
            if m in (1, 16):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(300):
                    fn(x, q)
                pr.disable()
                torch.cuda.synchronize()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
                print(s.getvalue()[:5000], flush=True)


if __name__ == "__main__":
    main()
