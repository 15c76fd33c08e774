"""SASS instructions per code in the main loop of the FP4 GEMV (``triton_fp4._fp4_gemv_kernel``), MXFP4 and NVFP4,
from an offline sm90 compile (no GPU: Triton compiles for ``cuda:90`` on the CPU; ``sass_count``'s helpers find the
largest loop). Static counts, not timings; shared-memory traffic (STS / LDS / BAR) and local memory (STL / LDL) in
the loop mean the compiler exchanged values between threads or spilled.

    python benchmarks/sass_fp4.py --out benchmarks/results/cpu/sweeps/sass_fp4_gemv.json
    # an older kernel: git show <commit>:src/infercore/quant/triton_fp4.py > src/infercore/quant/_fp4_old.py
    python benchmarks/sass_fp4.py --module infercore.quant._fp4_old --out ...
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import write_results  # noqa: E402
from sass_count import largest_loop, sass_of  # noqa: E402


def compile_gemv(T, nv: bool, block_n: int, block_w: int, warps: int, stages: int, mr: int):
    fn = T._fp4_gemv_kernel
    while not isinstance(fn, triton.runtime.JITFunction):  # past the autotuner and the heuristics
        fn = fn.fn
    ptr = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "y_ptr": "*bf16"}
    ints = {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_sn", "stride_ym")}
    ce = dict(NV=nv, BS=16 if nv else 32, MR=mr, BLOCK_N=block_n, BLOCK_W=block_w, EVEN=True)
    types = {**ptr, **ints, "gscale": "fp32", **{k: "constexpr" for k in ce}}
    sig = {n: types[n] for n in fn.arg_names}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*ptr, *ints) if n != "M"}
    src = ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--module", default="infercore.quant.triton_fp4")
    args = ap.parse_args()
    T = importlib.import_module(args.module)
    rows = []
    # the autotuner's first two configs (M = 1) and a 4-row one
    for fmt in ("mxfp4", "nvfp4"):
        for bn, bw, warps, stages, mr in ((8, 512, 4, 3, 1), (8, 256, 2, 1, 1), (4, 512, 2, 3, 4)):
            ops = largest_loop(sass_of(compile_gemv(T, fmt == "nvfp4", bn, bw, warps, stages, mr))[0])
            n = sum(ops.values())
            codes = bn * bw * 8 / (warps * 32)
            row = {"fmt": fmt, "BLOCK_N": bn, "BLOCK_W": bw, "num_warps": warps, "num_stages": stages, "MR": mr,
                   "loop_instructions": n, "per_code": round(n / codes, 3),
                   "shared": sum(ops[k] for k in ("STS", "LDS", "LDSM", "BAR")), "local": ops["STL"] + ops["LDL"],
                   "top": dict(ops.most_common(10))}  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    write_results(args.out, "sass_fp4_gemv", "offline sm90 compile (no GPU)", [], extra={"rows": rows})


if __name__ == "__main__":
    main()
