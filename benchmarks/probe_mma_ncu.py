"""A few MODE 9 launches for Nsight Compute (one shape, kind and row count; three launches each).

    ncu -k regex:wo_mma -s 2 -c 1 --set full -o $OUT/rep python benchmarks/probe_mma_ncu.py --kind int4 --m 16

``--defines`` adds compile switches (``wo_mma.cu``), ``--launch STAGES:CTAS`` overrides the launch table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from probe_mma_wo import quantize, repack  # noqa: E402

from infercore.quant import cuda_mma as CM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="int4")
    ap.add_argument("--shape", default="14336x4096")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--launch", default="")
    ap.add_argument("--defines", default="")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda") * 0.02
    pack = repack(args.kind, quantize(args.kind, w))
    CM.DEFINES = tuple(d for d in args.defines.split(",") if d)
    st, ct = ((int(v) for v in args.launch.split(":")) if args.launch else (None, None))
    x = torch.randn(args.m, k, device="cuda").to(torch.bfloat16)
    for _ in range(3):
        CM.matmul(x, args.kind, *pack, n, k, stages=st, ctas=ct)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
