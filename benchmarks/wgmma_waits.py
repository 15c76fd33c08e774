"""How the W8A8 GEMM's main loop waits on its tensor-core MMAs, INT8 vs FP8, from an offline sm90 compile.

No GPU needed: Triton compiles ``_scaled_mm_kernel`` for ``cuda:90`` on the CPU; the script prints the
wgmma instruction shape and the ``wgmma.wait_group`` counts of the PTX. ``pendings 0`` right after
the MMA group means the loop waits for every group (no MMA in flight across iterations); FP8 (fp32
accumulator) shows ``1``. Static facts about the code, not timings (the Triton here may differ from
the GPU machine's).

    python benchmarks/wgmma_waits.py [--block-m 128 --block-n 256 --block-k 128 --warps 8 --stages 4]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from infercore.quant import triton_w8a8 as W  # noqa: E402


def compile_mm(int8: bool, bm: int, bn: int, bk: int, warps: int, stages: int):
    et = "*i8" if int8 else "*fp8e4nv"
    ptr = {"a_ptr": et, "b_ptr": et, "sa_ptr": "*fp32", "sb_ptr": "*fp32", "xo_ptr": "*bf16", "wo_ptr": "*bf16",
           "bias_ptr": "*bf16", "c_ptr": "*bf16"}  # fmt: skip
    ints = {n: "i32" for n in ("M", "N", "K", "n_out", "num_progs", "stride_am", "stride_bn", "stride_om",
                               "stride_won", "stride_cm")}  # fmt: skip
    ce = dict(IS_INT8=int8, HAS_OUTLIERS=False, HAS_BIAS=False, OUT_PRECISION="tf32", USE_TMA=False, TMA_OUT=False,
              TMA_C=False, EVEN_K=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_O=64, OUT_STAGES=2, GROUP_M=8,
              PERSISTENT=False, FLATTEN=False)  # fmt: skip
    sig = {**ptr, **ints, **{k: "constexpr" for k in ce}}
    names = list(sig)
    aligned = (*ptr, "N", "K", "stride_am", "stride_bn", "stride_cm")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=W._scaled_mm_kernel, signature=sig, constexprs=ce, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=256)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    a = ap.parse_args()
    for int8 in (True, False):
        ptx = compile_mm(int8, a.block_m, a.block_n, a.block_k, a.warps, a.stages).asm["ptx"]
        shapes = sorted(set(re.findall(r"wgmma\.mma_async\S*", ptx)))
        waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
        print(f"{'int8' if int8 else 'fp8 '}: {shapes}, wait_group pendings in order: {waits}")


if __name__ == "__main__":
    main()
