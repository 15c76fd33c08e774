"""Config sweep of the W8A8 GEMM kernels (INT8, FP8 native, INT8 + 128 bf16 outliers) on one GPU.

For each kernel variant and M it first checks every config against the reference (relative error),
then times it (``triton.testing.do_bench`` median, random non-zero data) next to the peers run in
the same process: bf16 ``F.linear`` (cuBLAS), ``torch._scaled_mm`` FP8 (row-wise scales when
supported, else tensor-wise; the JSON says which) and ``torch._int_mm``. It prints the best config
per (variant, shape), the issue-5 target ratios, and a ``MM_CONFIGS`` table to paste into
``src/infercore/quant/triton_w8a8.py``. A config that fails to compile or run is logged, not fatal.

    python benchmarks/sweep_w8a8.py --out $OUT/sweep_w8a8.json            # H200, ~150 s
    TRITON_INTERPRET=1 python benchmarks/sweep_w8a8.py --dry-run --out /tmp/s.json   # CPU smoke

Shape: N=14336, K=4096 (Llama-8B MLP up), M in {1, 16, 128, 2048}; also N x K = 4096 x 4096 and
28672 x 4096 at M=2048 with the best few large-M configs (generality check).
"""

# ruff: noqa: B023  (each closure is timed inside the loop iteration that defines it)
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from infercore.quant import Int8Weight  # noqa: E402
from infercore.quant import naive as R  # noqa: E402
from infercore.quant import triton_w8a8 as TW  # noqa: E402
from infercore.quant.triton_w8a8 import MMConfig  # noqa: E402

C = MMConfig
# Candidate configs per M class, most promising first (the budget guard drops the tail).
# smem per stage = (BM + BN) * BK bytes for 8-bit operands; H200 has 227 KB per CTA.
LARGE = [
    C(128, 256, 128, 8, 8, 3), C(128, 256, 128, 8, 8, 4), C(128, 128, 128, 8, 8, 4),
    C(128, 256, 64, 8, 8, 4), C(128, 256, 64, 8, 8, 5), C(256, 128, 128, 8, 8, 3),
    C(128, 128, 128, 8, 8, 5), C(128, 128, 128, 8, 4, 4), C(128, 128, 256, 8, 8, 3),
    C(256, 128, 64, 8, 8, 4), C(128, 256, 128, 8, 8, 3, tma=False), C(128, 128, 128, 8, 8, 4, tma=False),
]
MID = [
    C(64, 128, 128, 8, 4, 4), C(128, 64, 128, 8, 4, 4), C(64, 64, 256, 8, 4, 4),
    C(64, 128, 256, 8, 4, 3), C(128, 128, 128, 8, 8, 4), C(64, 256, 128, 8, 4, 3),
    C(64, 128, 128, 8, 4, 4, tma=False),
]
SMALL = [
    C(16, 64, 256, 1, 4, 4), C(16, 128, 128, 1, 4, 4), C(16, 32, 256, 1, 4, 4),
    C(16, 64, 128, 1, 4, 6), C(16, 128, 256, 1, 4, 3), C(16, 64, 256, 1, 4, 4, tma=False),
]
MIXED_LARGE = [
    C(128, 256, 128, 8, 8, 3), C(128, 128, 128, 8, 8, 4), C(128, 256, 64, 8, 8, 4),
    C(128, 256, 128, 8, 8, 3, block_o=32), C(128, 128, 128, 8, 8, 4, block_o=128),
    C(256, 128, 128, 8, 8, 3), C(128, 128, 128, 8, 8, 5), C(128, 256, 64, 8, 8, 5),
    C(128, 128, 128, 8, 4, 4), C(128, 256, 128, 8, 8, 3, tma=False),
]
MIXED_MID = [C(64, 128, 128, 8, 4, 4), C(128, 64, 128, 8, 4, 4), C(64, 64, 256, 8, 4, 4),
             C(128, 128, 128, 8, 8, 4), C(64, 128, 128, 8, 4, 4, tma=False)]
MIXED_SMALL = [C(16, 64, 256, 1, 4, 4), C(16, 128, 128, 1, 4, 4), C(16, 32, 256, 1, 4, 4),
               C(16, 64, 256, 1, 4, 4, tma=False)]


def candidates(variant: str, m: int) -> list[MMConfig]:
    if TW._INTERPRET:
        return [TW._INTERP_CONFIG, TW._INTERP_CONFIG._replace(tma=True)]
    mixed = variant == "mixed"
    if m <= 32:
        return MIXED_SMALL if mixed else SMALL
    if m <= 256:
        return MIXED_MID if mixed else MID
    return MIXED_LARGE if mixed else LARGE


def rel(y: torch.Tensor, r: torch.Tensor) -> float:
    return ((y.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,128,2048")
    ap.add_argument("--budget", type=float, default=165.0, help="seconds; later configs are skipped")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU interpreter smoke test)")
    args = ap.parse_args()
    t_start = time.time()
    dry = args.dry_run
    dev = "cpu" if dry else "cuda"
    n0, k0 = (64, 128) if dry else (14336, 4096)
    ms = [1, 16] if dry else [int(v) for v in args.ms.split(",")]
    extra_shapes = [] if dry else [(2048, 4096, 4096), (2048, 28672, 4096)]
    act_dtype = torch.float32 if dry else torch.bfloat16  # the interpreter has no bf16 dot

    if dry:
        def bench(fn) -> float:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    else:
        from triton.testing import do_bench

        def bench(fn) -> float:
            return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))

    torch.manual_seed(0)
    gpu = "cpu (dry run)" if dry else torch.cuda.get_device_name()
    result = {
        "name": "sweep_w8a8", "device": gpu, "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/sweep_w8a8.py " + " ".join(sys.argv[1:]),
        "env": {"torch": torch.__version__, "triton": triton.__version__, "gpu": gpu},
        "ceilings": {}, "peers": [], "rows": [], "best": {}, "targets": {},
    }

    def write() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    # Ceilings measured in this run (8192^3 dense matmuls).
    scaled_mode = None
    if not dry:
        s = 8192
        xa = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
        xb = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
        result["ceilings"]["bf16_TFLOPs"] = 2 * s**3 / bench(lambda: xa @ xb) / 1e9
        try:
            fa, fb = xa.to(torch.float8_e4m3fn), xb.to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            result["ceilings"]["fp8_TFLOPs"] = 2 * s**3 / bench(
                lambda: torch._scaled_mm(fa, fb.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e9
        except Exception as e:  # noqa: BLE001
            print("fp8 ceiling unavailable:", repr(e)[:200])
        try:
            ia = torch.randint(-100, 100, (s, s), device=dev, dtype=torch.int8)
            result["ceilings"]["int8_TOPs"] = 2 * s**3 / bench(lambda: torch._int_mm(ia, ia.t())) / 1e9
        except Exception as e:  # noqa: BLE001
            print("int8 ceiling unavailable:", repr(e)[:200])
        del xa, xb
        print("ceilings:", json.dumps({k: round(v, 1) for k, v in result["ceilings"].items()}), flush=True)

    weights: dict[tuple[int, int], dict] = {}

    def get_weights(n: int, k: int) -> dict:
        if (n, k) not in weights:
            weights.clear()
            w = torch.randn(n, k, device=dev) * 0.02
            idx = torch.randperm(k, device=dev)[:128].to(torch.int32).sort().values
            weights[(n, k)] = {
                "bf16": w.to(act_dtype),
                "int8": Int8Weight.quantize(w),
                "fp8": Int8Weight.quantize(w, act="fp8"),
                "mixed": Int8Weight.quantize(w, outlier_idx=idx, outlier_dtype=act_dtype),
            }
        return weights[(n, k)]

    def peers_for(m: int, n: int, k: int, x: torch.Tensor, ws: dict) -> dict:
        nonlocal scaled_mode
        out = {"bf16 F.linear": bench(lambda: F.linear(x, ws["bf16"]))}
        if dry:
            return out
        q8, s8, _ = TW.per_token_quant_triton(x, act="fp8")
        wq8 = ws["fp8"].qweight.view(torch.float8_e4m3fn)
        sa, sb = s8[:, None].contiguous(), ws["fp8"].scales[None, :].contiguous()
        try:
            out["torch._scaled_mm fp8"] = bench(
                lambda: torch._scaled_mm(q8, wq8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
            scaled_mode = "rowwise"
        except Exception as e:  # noqa: BLE001
            print("_scaled_mm rowwise unavailable, using tensorwise:", repr(e)[:160])
            one = torch.ones((), device=dev)
            try:
                out["torch._scaled_mm fp8"] = bench(
                    lambda: torch._scaled_mm(q8, wq8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
                scaled_mode = "tensorwise"
            except Exception as e2:  # noqa: BLE001
                print("_scaled_mm unavailable:", repr(e2)[:160])
        qi, _, _ = TW.per_token_quant_triton(x)
        try:
            out["torch._int_mm"] = bench(lambda: torch._int_mm(qi, ws["int8"].qweight.t()))
        except Exception as e:  # noqa: BLE001
            print(f"_int_mm unavailable at M={m}:", repr(e)[:120])
        return out

    def sweep(variant: str, m: int, n: int, k: int, x: torch.Tensor, ws: dict, cfgs: list[MMConfig],
              deadline: float) -> list[dict]:
        w = ws[variant]
        act = "fp8" if variant == "fp8" else "int8"
        q, s, xo = TW.per_token_quant_triton(x, act=act, outlier_idx=w.outlier_idx)
        ref = R.w8a8_matmul_ref(q, s, w, x_out=xo, out_dtype=torch.float32)
        rows = []
        for cfg in cfgs:
            row = {"variant": variant, "M": m, "N": n, "K": k, "config": cfg._asdict()}
            if time.time() > deadline:
                row["error"] = "skipped: budget"
                rows.append(row)
                continue
            try:
                fn = lambda: TW.w8a8_matmul_triton(q, s, w, x_out=xo, out_dtype=act_dtype, config=cfg)
                row["rel_err"] = rel(fn(), ref)
                if not row["rel_err"] < 1e-2:
                    row["error"] = f"wrong result: rel_err {row['rel_err']:.3g}"
                else:
                    row["ms"] = bench(fn)
                    row["TFLOPs"] = 2 * m * n * k / row["ms"] / 1e9
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
                if "out of resource" not in row["error"].lower():
                    traceback.print_exc(limit=2)
            rows.append(row)
            result["rows"].append(row)
        return rows

    # Time slices: the large-M configs compile slowest and matter most.
    shapes = [(m, n0, k0) for m in ms] + extra_shapes
    weight_of = {1: 1.0, 16: 1.0, 128: 2.0, 2048: 4.0}
    total_w = sum(weight_of.get(m, 2.0) * (0.5 if (n, k) != (n0, k0) else 1.0) for m, n, k in shapes)
    summary = []
    for m, n, k in shapes:
        ws = get_weights(n, k)
        x = torch.randn(m, k, device=dev, dtype=act_dtype)
        peers = peers_for(m, n, k, x, ws)
        result["peers"].append({"M": m, "N": n, "K": k, "ms": peers, "scaled_mm_scales": scaled_mode})
        share = weight_of.get(m, 2.0) * (0.5 if (n, k) != (n0, k0) else 1.0) / total_w
        slice_s = share * (args.budget - (time.time() - t_start))
        slice_end = time.time() + max(slice_s, 5.0)
        best_here = {}
        for i, variant in enumerate(("int8", "fp8", "mixed")):
            cfgs = candidates(variant, m)
            if (n, k) != (n0, k0):  # generality check: the table entry plus the best 2 at the main shape
                top = [C(**r["config"]) for r in sorted(
                    (r for r in result["rows"] if r.get("ms") and r["variant"] == variant and r["M"] == m
                     and r["N"] == n0), key=lambda r: r["ms"])[:2]]
                cfgs = list(dict.fromkeys([TW.pick_config(variant, m), *top]))
            deadline = time.time() + (slice_end - time.time()) / (3 - i)
            rows = sweep(variant, m, n, k, x, ws, cfgs, deadline)
            ok = [r for r in rows if r.get("ms")]
            if not ok:
                print(f"{variant} M={m} N={n} K={k}: no config ran", flush=True)
                continue
            b = min(ok, key=lambda r: r["ms"])
            best_here[variant] = b
            ratios = {f"vs {p}": v / b["ms"] for p, v in peers.items()}  # >1: ours faster
            result["best"][f"{variant}/M={m}/N={n}/K={k}"] = {
                "config": b["config"], "ms": b["ms"], "TFLOPs": b["TFLOPs"], "rel_err": b["rel_err"],
                "speedup": ratios}
            summary.append((variant, m, n, k, b))
            print(f"{variant:5s} M={m:5d} N={n:5d} K={k}: best {b['ms'] * 1e3:8.1f} us "
                  f"{b['TFLOPs']:7.1f} TFLOP/s  {C(**b['config'])}  "
                  + "  ".join(f"{p}: {v:.2f}x" for p, v in ratios.items()), flush=True)
        if "mixed" in best_here and "int8" in best_here:
            result["best"][f"mixed/M={m}/N={n}/K={k}"]["mixed_over_int8_time"] = (
                best_here["mixed"]["ms"] / best_here["int8"]["ms"])
        write()

    # Issue-5 targets at M=2048, N=14336, K=4096.
    def get(variant: str, m: int = 2048):
        return result["best"].get(f"{variant}/M={m}/N={n0}/K={k0}")

    peer_big = next((p["ms"] for p in result["peers"] if p["M"] == 2048 and p["N"] == n0), {})
    tg = {}
    if get("fp8") and "torch._scaled_mm fp8" in peer_big:
        tg["fp8 / _scaled_mm (>= 0.9)"] = peer_big["torch._scaled_mm fp8"] / get("fp8")["ms"]
    if get("int8"):
        tg["int8 / bf16 (>= 1.6)"] = peer_big["bf16 F.linear"] / get("int8")["ms"]
    if get("mixed"):
        tg["mixed / bf16 (>= 1.5)"] = peer_big["bf16 F.linear"] / get("mixed")["ms"]
        if get("int8"):
            tg["mixed time / int8 time (<= 1.10)"] = get("mixed")["ms"] / get("int8")["ms"]
    result["targets"] = tg
    result["elapsed_s"] = time.time() - t_start
    write()

    print("\n== targets (M=2048, N=14336, K=4096) ==")
    for name, v in tg.items():
        print(f"  {name}: {v:.3f}")
    print(f"  _scaled_mm scales: {scaled_mode}")
    print("\n== paste into MM_CONFIGS (triton_w8a8.py); bucket bounds from the M values swept ==")
    bounds = {1: 8, 16: 64, 128: 256, 2048: "1 << 62"}
    for variant in ("int8", "fp8", "mixed"):
        print(f'    "{variant}": [')
        for m in ms:
            b = get(variant, m)
            if b and m in bounds:
                print(f"        ({bounds[m]}, {C(**b['config'])!r}),")
        print("    ],")
    print(f"\nelapsed {result['elapsed_s']:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
