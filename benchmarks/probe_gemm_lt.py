# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
"""Every cuBLASLt algorithm its heuristic offers for the decode-step GEMMs of the Llama-3.1-8B shape, timed against
``F.linear`` (H200 diagnostics for the batch-256 decode target).

torch takes the heuristic's first algorithm (cuBLAS or cuBLASLt backend alike). This asks
``cublasLtMatmulAlgoGetHeuristic`` for up to ``--count`` algorithms for ``y = x @ W^T`` (bf16, fp32 compute, the
same TN layout torch uses), runs each through ``cublasLtMatmul`` (ctypes, the process's own libcublasLt), checks it
against ``F.linear`` and times it the way ``probe_gemm_batch.py`` does (one CUDA graph of calls rotating over weight
copies larger than the L2), with ``F.linear`` timed in the same run.

    python benchmarks/probe_gemm_lt.py --out $OUT/probe_gemm_lt.json --ms 256      # H200, ~1 min
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _common import time_graph, write_results  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
L2_BYTES = 60 << 20
WORKSPACE = 32 << 20
CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F = 14, 0, 68
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
CFG = {"tile": (1, ctypes.c_uint32), "splitk": (2, ctypes.c_int32), "reduction": (3, ctypes.c_uint32),
       "swizzle": (4, ctypes.c_uint32), "stages": (6, ctypes.c_uint32), "cluster": (8, ctypes.c_uint16),
       "algo_id": (0, ctypes.c_int32)}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def _lib() -> ctypes.CDLL:
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # loads cuBLAS(Lt)
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "libcublasLt.so" in ln})
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    return ctypes.CDLL(paths[0])


class Lt:
    def __init__(self) -> None:
        self.lib = _lib()
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed (cublasStatus {rc})")

    def plan(self, m: int, n: int, k: int):
        lib = self.lib
        desc = ctypes.c_void_p()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate")
        t, nn = ctypes.c_int32(1), ctypes.c_int32(0)
        self._ok(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSA, ctypes.byref(t), 4), "TRANSA")
        self._ok(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSB, ctypes.byref(nn), 4), "TRANSB")
        lays = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):
            lay = ctypes.c_void_p()
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                     ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")
            lays.append(lay)
        return desc, lays

    def heuristics(self, plan, count: int) -> list[Heuristic]:
        desc, (la, lb, lc) = plan
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        wsz = ctypes.c_uint64(WORKSPACE)
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(wsz), 8),
                 "PREF_MAX_WORKSPACE")
        res = (Heuristic * count)()
        got = ctypes.c_int(0)
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, la, lb, lc, lc, pref, count, res,
                                                         ctypes.byref(got)), "AlgoGetHeuristic")
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def config(self, h: Heuristic) -> dict:
        out = {}
        for name, (attr, ct) in CFG.items():
            v, w = ct(0), ctypes.c_size_t(0)
            rc = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(h.algo), attr, ctypes.byref(v),
                                                               ctypes.sizeof(ct), ctypes.byref(w))
            out[name] = int(v.value) if rc == 0 else None
        out["workspace"] = int(h.workspace)
        out["waves"] = round(float(h.waves), 3)
        return out

    def matmul(self, plan, algo: Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        desc, (la, lb, lc) = plan
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), la,
            ctypes.c_void_p(x.data_ptr()), lb, ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), lc,
            ctypes.c_void_p(y.data_ptr()), lc, ctypes.byref(algo), ctypes.c_void_p(self.ws.data_ptr()),
            ctypes.c_size_t(WORKSPACE), stream), "cublasLtMatmul")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    lt = Lt()
    rows, summary = [], {}
    for m in (int(v) for v in args.ms.split(",")):
        torch.manual_seed(0)
        x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
        step_torch = step_best = 0.0
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            copies = max(2, math.ceil(2 * L2_BYTES / (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            xk = x[:, :k].contiguous()
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(xk, ws[0]).float()
            t_torch = time_graph(lambda i: F.linear(xk, ws[i % copies]), copies * 4, reps=7) * 1e6
            plan = lt.plan(m, n, k)
            hs = lt.heuristics(plan, args.count)
            best = (float("inf"), None)
            for rank, h in enumerate(hs):
                row = {"m": m, "shape": name, "n": n, "k": k, "rank": rank, **lt.config(h), "torch_us": t_torch}
                try:
                    y.zero_()
                    lt.matmul(plan, h.algo, xk, ws[0], y)
                    err = float((y.float() - ref).norm() / ref.norm())
                    row["rel_err"] = err
                    if err > 2e-2:
                        raise RuntimeError(f"wrong result (rel_err {err:.3g})")
                    us = time_graph(lambda i: lt.matmul(plan, h.algo, xk, ws[i % copies], y), copies * 4,
                                    reps=7) * 1e6
                    row["us"] = us
                    row["x_torch"] = t_torch / us
                    best = min(best, (us, rank), key=lambda v: v[0])
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:200]
                rows.append(row)
                print({kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
            mult = 1 if name == "lm_head" else args.layers
            step_torch += mult * t_torch
            step_best += mult * (best[0] if best[1] is not None else t_torch)
            summary[f"M={m} {name}"] = {"torch_us": t_torch, "best_us": best[0], "best_rank": best[1],
                                         "algos": len(hs), "flop_tflops_best": 2 * m * n * k / best[0] / 1e6}
            print(f"== M={m} {name}: torch {t_torch:.2f} us, best {best[0]:.2f} us (rank {best[1]} of {len(hs)})",
                  flush=True)
            ws = None  # frees the copies before the next shape
        summary[f"M={m} step linears ms"] = {"torch": step_torch / 1e3, "best": step_best / 1e3}
        print(f"== M={m} step linears: torch {step_torch / 1e3:.3f} ms, best algos {step_best / 1e3:.3f} ms",
              flush=True)
    write_results(args.out, "probe_gemm_lt", "h200", [], extra={"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
