"""Skinny GEMV sweep: Triton ``ops.linear`` variants x configs vs cuBLAS (``F.linear``) at decode M.

For the five Llama-3.1-8B linear shapes (bf16) and M in 1, 2, 4, 8, 16, every config is first
checked against an fp32 matmul (relative error < 1e-2), then timed in a CUDA graph of many calls
that rotates over enough weight copies (>= 256 MB working set, the H200 L2 is 60 MB) that the
weights come from HBM as in a real decode step. Metric: weight+activation bytes / time (GB/s),
also as a fraction of the measured device copy bandwidth (read + write, same run).

A decode-step emulation then captures 32 layers x (qkv, o, gate_up, down) + lm_head at M = 1 with
distinct weights (16 GB) once with cuBLAS and once with the best config per shape.

    python benchmarks/sweep_gemv.py --out $OUT/sweep_gemv.json        # H200, ~2 min
    python benchmarks/sweep_gemv.py --dry-run --out /tmp/g.json        # CPU interpreter, tiny shapes

The JSON holds every row, the CONVENTIONS cases (best config per shape/M) and a ``best`` dict:
``"N,K,M": {"config": {...}, "speedup": x}`` -> paste into ``TUNED`` of ops/linear/triton.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, rel_err, time_graph, write_results  # noqa: E402

from infercore.ops.linear import triton as T  # noqa: E402

SHAPES = {  # name -> (N, K) of the Llama-3.1-8B linears
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
MS = (1, 2, 4, 8, 16)
WORKING_SET = 256 << 20

# fma tiles per M bucket as (block_n, block_k, num_warps): the fp32 accumulators take
# M*BLOCK_N*BLOCK_K/(32*warps) registers per thread, kept in 16-64. M >= 8 only uses dot.
# (A captured D2D copy becomes a copy-engine memcpy node at ~2.7 TB/s: the ceiling is timed eagerly.)
FMA_TILES = {
    1: [(2, 1024, 4), (4, 1024, 4), (2, 2048, 4), (1, 2048, 4), (4, 512, 4), (8, 512, 4), (4, 2048, 8), (8, 1024, 8)],
    2: [(2, 1024, 4), (4, 512, 4), (2, 512, 4), (4, 1024, 8), (1, 2048, 4)],
    4: [(2, 512, 4), (4, 256, 4), (1, 1024, 4), (2, 1024, 8), (4, 512, 8)],
}
DOT_TILES = [(16, 256, 4), (16, 512, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4), (16, 512, 8), (32, 256, 8)]


def configs_for(n: int, k: int, m: int) -> list[T.GemvConfig]:
    # Split-K only where N alone gives too few programs (N <= 8192 with >= 2-row tiles).
    splits = (1, 2, 4) if n <= 8192 else (1,)
    out = []
    if m in FMA_TILES:
        for bn, bk, w in FMA_TILES[m]:
            for s in splits:
                out.append(T.GemvConfig("fma", bn, bk, w, s, True))
        bn, bk, w = FMA_TILES[m][0]
        out.append(T.GemvConfig("fma", bn, bk, w, 1, False))  # does the streaming hint matter?
        out.append(T.GemvConfig("fma", bn, bk, w, 1, True, 1))  # or software pipelining?
    if m >= 2:
        for bn, bk, w in DOT_TILES:
            for s in splits:
                if n // bn * s >= 256:
                    out.append(T.GemvConfig("dot", bn, bk, w, s, True))
    return out


def time_once(calls, n_calls: int) -> float:
    """``--dry-run`` timer (the interpreter has no CUDA graphs): one eager call, in seconds."""
    s = time.perf_counter()
    calls(0)
    return time.perf_counter() - s


def sweep_shape(name, n, k, dtype, dev, ms, bw, rows, n_calls_min, dry):
    elem = torch.finfo(dtype).bits // 8
    wbytes = n * k * elem
    copies = 1 if dry else max(1, math.ceil(WORKING_SET / wbytes))
    n_calls = max(n_calls_min, copies)
    n_calls = math.ceil(n_calls / copies) * copies
    ws = [torch.randn(n, k, dtype=dtype, device=dev) * 0.02 for _ in range(copies)]
    timer = time_once if dry else time_graph
    best = {}
    for m in ms:
        x = torch.randn(m, k, dtype=dtype, device=dev)
        ref = x.float() @ ws[0].float().T
        nbytes = wbytes + (m * k + m * n) * elem

        def record(impl, cfg, t, err, m=m, nbytes=nbytes):
            gbps = nbytes / t / 1e9
            row = {"shape": name, "N": n, "K": k, "M": m, "impl": impl, "config": cfg and cfg.as_dict(),
                   "us": t * 1e6, "GBps": gbps, "frac_copy": gbps * 1e9 / bw, "rel_err": err}  # fmt: skip
            rows.append(row)
            return row

        err = rel_err(F.linear(x, ws[0]), ref)
        cub = record("cublas", None, timer(lambda i, x=x: F.linear(x, ws[i % copies]), n_calls), err)
        best_row = None
        for cfg in configs_for(n, k, m):
            try:
                err = rel_err(T.gemv(x, ws[0], None, cfg), ref)
                if not err < 1e-2:
                    record("triton", cfg, float("inf"), err)["error"] = "wrong result"
                    continue
                t = timer(lambda i, x=x, cfg=cfg: T.gemv(x, ws[i % copies], None, cfg), n_calls)
            except Exception as e:  # a config that fails to compile or launch is logged, not fatal
                rows.append({"shape": name, "M": m, "impl": "triton", "config": cfg.as_dict(), "error": repr(e)[:300]})
                continue
            row = record("triton", cfg, t, err)
            if best_row is None or row["us"] < best_row["us"]:
                best_row = row
        if best_row is not None:
            best[(n, k, m)] = (best_row, cub)
    return best


def decode_step(best, dtype, bw, layers: int) -> dict:
    """Per-token linear time of the 8B shape at M = 1: 32 layers of distinct weights + lm_head."""
    dev = "cuda"
    names = ["qkv", "o_proj", "gate_up", "down"]
    weights = [[torch.randn(*SHAPES[s], dtype=dtype, device=dev) * 0.02 for s in names] for _ in range(layers)]
    lm = torch.randn(*SHAPES["lm_head"], dtype=dtype, device=dev) * 0.02
    xs = {s: torch.randn(1, SHAPES[s][1], dtype=dtype, device=dev) for s in SHAPES}
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer) + lm.numel() * lm.element_size()

    def cfg_of(s):
        hit = best.get((*SHAPES[s], 1))
        return None if hit is None else T.GemvConfig(**hit[0]["config"])

    def speedup(s):
        hit = best.get((*SHAPES[s], 1))
        return 0.0 if hit is None else hit[1]["us"] / hit[0]["us"]

    def step(use_ours, mixed):
        def lin(s, w):
            cfg = cfg_of(s)
            if use_ours and cfg is not None and (not mixed or speedup(s) > 1.0):
                return T.gemv(xs[s], w, None, cfg)
            return F.linear(xs[s], w)

        def run(_):
            for layer in weights:
                for s, w in zip(names, layer):
                    lin(s, w)
            lin("lm_head", lm)

        return run

    out = {"bytes": nbytes, "layers": layers}
    for label, ours, mixed in (("cublas", False, False), ("ours", True, False), ("mixed", True, True)):
        step(ours, mixed)(0)  # compile outside the capture
        t = time_graph(step(ours, mixed), 1, reps=10)
        out[label] = {"ms": t * 1e3, "GBps": nbytes / t / 1e9, "frac_copy": nbytes / t / bw}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    t0 = time.time()
    dtype, rows, best = torch.bfloat16, [], {}
    ms = [int(v) for v in args.ms.split(",")]
    if args.dry_run:
        # The interpreter cannot do bf16 math or CUDA graphs: fp16 tiny shapes, eager timing.
        SHAPES.clear()
        SHAPES.update({"tiny_a": (48, 64), "tiny_b": (16, 96)})
        dtype, dev, bw = torch.float16, "cpu", 1e9
        for name, (n, k) in SHAPES.items():
            best.update(sweep_shape(name, n, k, dtype, dev, ms[:2], bw, rows, 1, True))
    else:
        dev = "cuda"
        bw = copy_bandwidth()
        print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            ts = time.time()
            best.update(sweep_shape(name, n, k, dtype, dev, ms, bw, rows, 16, False))
            print(f"  {name}: {time.time() - ts:.1f} s", flush=True)
    bad = [r for r in rows if "error" in r]
    print(f"\n{len(rows)} rows, {len(bad)} failed configs, sweep {time.time() - t0:.1f} s")
    for r in bad[:8]:
        print("  FAIL", r["shape"], r["M"], r["config"], r["error"][:160])
    print(f"\n{'shape':8} {'M':>3} {'cuBLAS us':>9} {'frac':>5} {'ours us':>8} {'frac':>5} {'speedup':>7}  config")
    cases, best_json = [], {}
    for (n, k, m), (r, c) in sorted(best.items(), key=lambda kv: (list(SHAPES.values()).index(kv[0][:2]), kv[0][2])):
        sp = c["us"] / r["us"]
        cf = r["config"]
        desc = f"{cf['variant']} bn{cf['block_n']} bk{cf['block_k']} w{cf['num_warps']} s{cf['split_k']}" + (
            "" if cf["evict_first"] else " noevict"
        )
        print(
            f"{r['shape']:8} {m:>3} {c['us']:9.2f} {c['frac_copy']:5.2f} {r['us']:8.2f} {r['frac_copy']:5.2f}"
            f" {sp:7.2f}  {desc}"
        )
        best_json[f"{n},{k},{m}"] = {"config": cf, "speedup": round(sp, 3)}
        cases.append(case(f"gemv {r['shape']} N={n} K={k} M={m}", metric="bandwidth", unit="TB/s",
                          ours=r["GBps"] / 1e3, peers={"cublas": c["GBps"] / 1e3}, floor=bw / 1e12,
                          config=cf))  # fmt: skip
    step = None
    if not args.dry_run and args.layers > 0:
        torch.cuda.empty_cache()
        step = decode_step(best, dtype, bw, args.layers)
        print(f"\ndecode-step linears at M=1 ({step['layers']} layers + lm_head, {step['bytes'] / 1e9:.2f} GB):")
        for label in ("cublas", "ours", "mixed"):
            s = step[label]
            print(f"  {label:7} {s['ms']:.3f} ms/token  {s['GBps']:.0f} GB/s  {s['frac_copy']:.2f} of copy")
        cases.append(case("decode-step linears 8B M=1", metric="bandwidth", unit="TB/s",
                          ours=step["mixed"]["GBps"] / 1e3, peers={"cublas": step["cublas"]["GBps"] / 1e3},
                          floor=bw / 1e12))  # fmt: skip
    write_results(args.out, "sweep_gemv", "h200" if not args.dry_run else "cpu-dry-run", cases,
                  {"copy_bandwidth": bw, "rows": rows, "best": best_json, "decode_step": step,
                   "seconds": time.time() - t0})  # fmt: skip
    print(f"\ntotal {time.time() - t0:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
