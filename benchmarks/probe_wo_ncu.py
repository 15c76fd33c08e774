"""A few weight-only calls at 14336x4096 (INT4 g128, one bf16 row) for Nsight Compute.

MODE 5 (128 x 128 tile, split 4) and MODE 4 (4 x 2048, 2 warps), each three times, so a profiler
can pick the kernels out (H200 run: results/h200/sweeps/ncu_wo_14336x4096.txt):

    ncu -k regex:"_words_small_kernel|_gemv4_kernel" -c 2 --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        --section MemoryWorkloadAnalysis python benchmarks/probe_wo_ncu.py

``--mode6``: instead, MODE 6 at its dispatched INT4 tile (4 warps x 4 repetitions, split 2) and
the FP8 MODE 4 tile the dispatcher runs at this shape (results/h200/sweeps/ncu_mode6_14336x4096.txt).

``--wn``: MODE 6 with the warps splitting N: INT4 one row at its dispatched tile (4 warps x 4, split 8,
two iterations in flight), FP8 four rows at the WN sweep's best tile (2 warps x 4, split 16), and FP8
one row through MODE 4 (results/h200/sweeps/ncu_mode6_wn_14336x4096.txt).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from infercore.quant import FP8Weight, IntWeight  # noqa: E402
from infercore.quant import triton_wo as TW  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    n, k = 14336, 4096
    w = torch.randn(n, k, device="cuda") * 0.02
    q4 = IntWeight.quantize(w, bits=4, group_size=128, clip_search=False)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if "--wn" in sys.argv:
        f8 = FP8Weight.quantize(w)
        x4 = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
        c6 = {"MODE": 6, "WN": 1, "WARPS": 4, "REPS": 4, "SPLIT": 8, "DEPTH": 2}
        c6f = {"MODE": 6, "WN": 1, "WARPS": 2, "REPS": 4, "SPLIT": 16, "DEPTH": 1}
        c4 = {"MODE": 4, "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 2, "SPLIT": 0}
        for _ in range(3):
            TW.wq_matmul_triton(x, q4, config=c6)
            TW.fp8_wo_matmul_triton(x4, f8, config=c6f)
            TW.fp8_wo_matmul_triton(x, f8, config=c4)
        torch.cuda.synchronize()
        return
    if "--mode6" in sys.argv:
        f8 = FP8Weight.quantize(w)
        c6 = {"MODE": 6, "WARPS": 4, "REPS": 4, "SPLIT": 2}
        c4 = {"MODE": 4, "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 2, "SPLIT": 0}
        for _ in range(3):
            TW.wq_matmul_triton(x, q4, config=c6)
            TW.fp8_wo_matmul_triton(x, f8, config=c4)
        torch.cuda.synchronize()
        return
    c5 = {"MODE": 5, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "SPLIT": 4}
    c4 = {"MODE": 4, "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 2, "num_stages": 2, "SPLIT": 1}
    for _ in range(3):
        TW.wq_matmul_triton(x, q4, config=c5)
        TW.wq_matmul_triton(x, q4, config=c4)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
