"""Quantized GEMM/GEMV on one GPU at a Llama-8B MLP shape (N=14336, K=4096) vs peers and the floor.

Peers, timed in the same process: bf16 ``x @ W.T`` (cuBLAS), ``torch._scaled_mm`` FP8 with
row-wise scales, tinygemm ``torch.ops.aten._weight_int4pack_mm`` (INT4 g128), ``torch._int_mm``.
Metric: effective TFLOP/s (``2*M*N*K / time``; higher is better). Floor: the TFLOP/s at
``max(bytes moved / measured copy bandwidth, FLOPs / measured peak matmul rate of that dtype)``.
Each case also records its median time in ms and its relative error against the reference.

    python benchmarks/bench_quant.py --out benchmarks/results/h200/quant.json
"""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from infercore.quant import FP8Weight, Int8Weight, IntWeight  # noqa: E402
from infercore.quant import naive as R  # noqa: E402
from infercore.quant import triton_w8a8 as TW  # noqa: E402
from infercore.quant import triton_wo as TO  # noqa: E402

N, K = 14336, 4096
DEV = "cuda"


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def rel(y, r) -> float:
    return ((y.float() - r.float()).norm() / r.float().norm()).item()


def measure_ceilings() -> dict:
    a = torch.empty(1 << 28, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a))
    bw = 2 * a.numel() / (t * 1e-3)  # read + write bytes/s
    s = 8192
    x = torch.randn(s, s, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(s, s, device=DEV, dtype=torch.bfloat16)
    bf16 = 2 * s**3 / (bench(lambda: x @ y) * 1e-3)
    out = {"copy_bw": bw, "bf16_flops": bf16}
    try:
        x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn)
        one = torch.ones((), device=DEV)
        out["fp8_flops"] = 2 * s**3 / (bench(lambda: torch._scaled_mm(x8, y8.t(), scale_a=one, scale_b=one,
                                                                        out_dtype=torch.bfloat16)) * 1e-3)
    except Exception:
        out["fp8_flops"] = 2 * bf16
    try:
        i8 = torch.randint(-100, 100, (s, s), device=DEV, dtype=torch.int8)
        out["int8_flops"] = 2 * s**3 / (bench(lambda: torch._int_mm(i8, i8.t())) * 1e-3)
    except Exception:
        out["int8_flops"] = 2 * bf16
    return out


def tinygemm(w_bf16: torch.Tensor, x: torch.Tensor):
    """tinygemm INT4 g128 (timing only: random codes and scales)."""
    q = torch.randint(0, 16, (N, K), device=DEV, dtype=torch.int32)
    packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    wp = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    sz = torch.rand(K // 128, N, 2, device=DEV, dtype=torch.bfloat16)
    return lambda: torch.ops.aten._weight_int4pack_mm(x, wp, 128, sz)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/quant.json")
    ap.add_argument("--ms", default="1,16,128,2048")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceil = measure_ceilings()
    w = torch.randn(N, K, device=DEV) * 0.02
    w_bf16 = w.to(torch.bfloat16)
    w4 = IntWeight.quantize(w, bits=4, group_size=128, clip_search=False)
    f8 = FP8Weight.quantize(w)
    i8 = Int8Weight.quantize(w)
    out_idx = torch.randperm(K, device=DEV)[:128].to(torch.int32).sort().values
    mx = Int8Weight.quantize(w, outlier_idx=out_idx)
    f8a = Int8Weight.quantize(w, act="fp8")
    result = {
        "name": "quant",
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/bench_quant.py " + " ".join(sys.argv[1:]),
        "env": {"torch": torch.__version__, "triton": triton.__version__,
                "gpu": torch.cuda.get_device_name()},
        "ceilings": {"copy_TBps": ceil["copy_bw"] / 1e12, "bf16_TFLOPs": ceil["bf16_flops"] / 1e12,
                     "fp8_TFLOPs": ceil["fp8_flops"] / 1e12, "int8_TOPs": ceil["int8_flops"] / 1e12},
        "cases": [],
    }

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def add(case, m, ours_ms, peers_ms, bytes_moved, peak, err):
        flops = 2 * m * N * K
        tf = lambda ms: flops / (ms * 1e-3) / 1e12
        floor_s = max(bytes_moved / ceil["copy_bw"], flops / peak)  # copy_bw: bytes moved per second
        peers = {k: tf(v) for k, v in peers_ms.items() if v is not None}
        row = {"case": f"{case} M={m}", "metric": "effective TFLOP/s", "unit": "TFLOP/s", "ours": tf(ours_ms),
               "peers": peers, "floor": flops / floor_s / 1e12,
               "ours_over_floor": tf(ours_ms) / (flops / floor_s / 1e12),
               "ours_vs_best_peer": tf(ours_ms) / max(peers.values()) if peers else None,
               "ours_ms": ours_ms, "peers_ms": {k: v for k, v in peers_ms.items() if v is not None},
               "floor_ms": floor_s * 1e3, "rel_err_vs_reference": err}
        result["cases"].append(row)
        keys = ("case", "ours_ms", "peers_ms", "floor_ms", "rel_err_vs_reference")
        print(json.dumps({k: row[k] for k in keys}),
              flush=True)
        write()

    for m in [int(v) for v in args.ms.split(",")]:
        x = torch.randn(m, K, device=DEV, dtype=torch.bfloat16)
        t_bf16 = bench(lambda: x @ w_bf16.T)
        act_bytes = m * K * 2 + m * N * 2
        try:
            # W4A16 g128 vs bf16 and tinygemm.
            try:
                t_tiny = bench(tinygemm(w_bf16, x))
            except Exception as e:  # noqa: BLE001
                print("tinygemm unavailable:", repr(e)[:200])
                t_tiny = None
            y = TO.wq_matmul_triton(x, w4)
            err = rel(y, R.wq_matmul_ref(x, w4))
            add("W4A16 g128", m, bench(lambda: TO.wq_matmul_triton(x, w4)),
                {"bf16 torch": t_bf16, "tinygemm int4": t_tiny},
                N * K / 2 + w4.scales.numel() * 4 + w4.zeros.numel() + act_bytes, ceil["bf16_flops"], err)
            # FP8 weight-only, emulated decode.
            y = TO.fp8_wo_matmul_triton(x, f8)
            err = rel(y, R.fp8_wo_matmul_ref(x, f8))
            xs = x.to(torch.float8_e4m3fn)
            sa = torch.ones(m, 1, device=DEV)
            sb = torch.ones(1, N, device=DEV)
            wq8 = f8a.qweight.view(torch.float8_e4m3fn)
            try:
                t_sm = bench(lambda: torch._scaled_mm(xs, wq8.t(), scale_a=sa, scale_b=sb,
                                                      out_dtype=torch.bfloat16))
            except Exception as e:  # noqa: BLE001
                print("_scaled_mm unavailable:", repr(e)[:200])
                t_sm = None
            add("FP8 weight-only emulated", m, bench(lambda: TO.fp8_wo_matmul_triton(x, f8)),
                {"bf16 torch": t_bf16, "torch._scaled_mm fp8": t_sm}, N * K + N * 4 + act_bytes,
                ceil["bf16_flops"], err)
            if m < 128:
                continue
            # FP8 W8A8 native (GEMM only, activations pre-quantized) vs _scaled_mm.
            q, s, _ = TW.per_token_quant_triton(x, act="fp8")
            y = TW.w8a8_matmul_triton(q, s, f8a)
            err = rel(y, R.w8a8_matmul_ref(q, s, f8a))
            sa = s[:, None].contiguous()
            sb = f8a.scales[None, :].contiguous()
            t_sm = bench(lambda: torch._scaled_mm(q, wq8.t(), scale_a=sa, scale_b=sb,
                                                  out_dtype=torch.bfloat16))
            add("FP8 W8A8 native (GEMM)", m, bench(lambda: TW.w8a8_matmul_triton(q, s, f8a)),
                {"torch._scaled_mm fp8 rowwise": t_sm, "bf16 torch": t_bf16}, N * K + m * K + act_bytes / 2,
                ceil["fp8_flops"], err)
            # INT8 W8A8: GEMM alone and with the fused per-token quantizer.
            q, s, _ = TW.per_token_quant_triton(x)
            y = TW.w8a8_matmul_triton(q, s, i8)
            err = rel(y, R.w8a8_matmul_ref(q, s, i8))
            t_int = bench(lambda: torch._int_mm(q, i8.qweight.t()))
            t_i8 = bench(lambda: TW.w8a8_matmul_triton(q, s, i8))
            add("INT8 W8A8 (GEMM)", m, t_i8, {"bf16 torch": t_bf16, "torch._int_mm (no scales)": t_int},
                N * K + m * K + act_bytes / 2, ceil["int8_flops"], err)

            def quant_and_gemm():
                qq, ss, _ = TW.per_token_quant_triton(x)
                return TW.w8a8_matmul_triton(qq, ss, i8)

            add("INT8 W8A8 (quantizer + GEMM)", m, bench(quant_and_gemm), {"bf16 torch": t_bf16},
                N * K + m * K * 3 + act_bytes, ceil["int8_flops"], err)
            # Mixed INT8 + 128 bf16 outlier channels, one fused epilogue.
            q, s, xo = TW.per_token_quant_triton(x, outlier_idx=mx.outlier_idx)
            y = TW.w8a8_matmul_triton(q, s, mx, x_out=xo)
            err = rel(y, R.w8a8_matmul_ref(q, s, mx, x_out=xo))
            t_mx = bench(lambda: TW.w8a8_matmul_triton(q, s, mx, x_out=xo))
            add("Mixed INT8 + 128 outliers (GEMM)", m, t_mx,
                {"bf16 torch": t_bf16, "ours pure INT8 (GEMM)": t_i8},
                N * K + m * K + act_bytes / 2 + N * 256,
                ceil["int8_flops"], err)
        except Exception:
            traceback.print_exc()
    write()


if __name__ == "__main__":
    main()
