"""Sweep the Triton paged prefill attention kernel's variants x tile configs against torch SDPA.

Cases (bf16, head_dim 128, 32 q / 8 kv heads, page 16, shuffled pages, as ``bench_ops.py`` measures):
  causal   one 8192-token prompt, all K/V read from the paged cache; peer: SDPA causal on contiguous
           q/k/v with ``enable_gqa=True``. TFLOP/s = 2 * Hq * D * S^2 / t.
  chunked  4 sequences of 2048 new tokens after a 2048-token cached prefix; peer: SDPA on the same
           K/V made contiguous, lower-right causal mask (skipped if this torch cannot run it).

Correctness first (bf16 relative error of our default config vs SDPA, both cases), then every config
(a compile failure is logged, not fatal), then a table of TFLOP/s and ratios to SDPA. The JSON holds
the conventional ``cases`` (best config per case), every ``rows`` entry and a ``best`` config dict
to paste into ``triton_prefill.TUNING[128]``.

    python benchmarks/sweep_prefill_attn.py --out $OUT/sweep_prefill_attn.json     # H200, ~2 min
    python benchmarks/sweep_prefill_attn.py --dry-run --out /tmp/x.json            # CPU interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, write_results  # noqa: E402

from infercore.ops.attention import triton_prefill  # noqa: E402

# (name, config); the first is the default path's guess, ordered by how much we expect to learn.
CONFIGS = [
    ("hf 128x128 w8 s3", {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}),
    ("old-grid int64 128x128 w8 s3", {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3,
                                      "heads_fast": False, "off64": True}),  # fmt: skip  (= previous kernel)
    ("hf 128x128 w8 s2", {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2}),
    ("hf 128x64 w8 s3", {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}),
    ("hf 128x64 w8 s4", {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 4}),
    ("pipe 128x64 w8 s3", {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "pipe_qk": True}),
    ("pipe 128x64 w8 s2", {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "pipe_qk": True}),
    ("pipe 128x128 w8 s2", {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "pipe_qk": True}),
    ("ws 128x128 w8 s3", {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "warp_spec": True}),
    ("ws 128x64 w8 s3", {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "warp_spec": True}),
    ("hf 64x64 w4 s2", {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}),
    ("hf 64x128 w4 s2", {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2}),
]
TUNING_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "heads_fast", "pipe_qk", "warp_spec")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def paged(x: torch.Tensor, perm: torch.Tensor, page: int) -> torch.Tensor:
    """``x [B, Hk, L, D]`` -> cache ``[B*L/page, page, Hk, D]`` with logical page i stored at ``perm[i]``."""
    B, Hk, L, D = x.shape
    cache = torch.empty(B * L // page, page, Hk, D, device=x.device, dtype=x.dtype)
    cache[perm] = x.permute(0, 2, 1, 3).reshape(-1, page, Hk, D)
    return cache


def make_case(B: int, new: int, ctx: int, Hq: int, Hk: int, D: int, page: int, dev: str, dtype):
    """B sequences of ``new`` queries at the end of ``ctx`` keys; K/V shared by the cache and SDPA."""
    q = torch.randn(B, Hq, new, D, device=dev, dtype=dtype)
    k = torch.randn(B, Hk, ctx, D, device=dev, dtype=dtype)
    v = torch.randn(B, Hk, ctx, D, device=dev, dtype=dtype)
    perm = torch.randperm(B * ctx // page, device=dev)
    kc, vc = paged(k, perm, page), paged(v, perm, page)
    table = perm.view(B, ctx // page).to(torch.int32).contiguous()
    qt = q.transpose(1, 2).reshape(B * new, Hq, D).contiguous()  # [T, Hq, D]
    cu = torch.arange(0, B * new + 1, new, device=dev, dtype=torch.int32)
    seq = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    return dict(q=q, k=k, v=v, qt=qt, kc=kc, vc=vc, table=table, cu=cu, seq=seq, new=new, ctx=ctx)


def sdpa_fn(c: dict, scale: float):
    """SDPA on contiguous q/k/v (queries are the last ``new`` positions); None if unsupported here."""
    q, k, v = c["q"], c["k"], c["v"]
    if c["new"] == c["ctx"]:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(c["new"], c["ctx"])
    fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    try:
        fn()
        return fn
    except Exception as e:  # older torch: no GQA with a causal bias; expand K/V instead
        print(f"sdpa lower-right with enable_gqa failed ({type(e).__name__}); expanding k/v")
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    fn = lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask, scale=scale)
    try:
        fn()
        return fn
    except Exception as e:
        print(f"sdpa chunked peer unavailable: {type(e).__name__}: {e}")
        return None


def ours_fn(c: dict, scale: float, cfg: dict):
    out = torch.empty_like(c["qt"])

    def run():
        triton_prefill._launch(c["qt"], c["kc"], c["vc"], out, c["cu"], c["seq"], c["table"], scale, None, None,
                               c["new"], cfg)  # fmt: skip
        return out

    return run


def as_bhsd(out: torch.Tensor, c: dict) -> torch.Tensor:
    B, Hq, new, D = c["q"].shape
    return out.view(B, new, Hq, D).transpose(1, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes under the Triton interpreter (CPU)")
    ap.add_argument("--budget", type=float, default=140.0, help="seconds; later configs are skipped past it")
    args = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(0)
    if args.dry_run:
        dev, dtype, Hq, Hk, D, page = "cpu", torch.float32, 4, 2, 16, 4
        shapes = {"causal": (1, 32, 32), "chunked": (2, 16, 32)}
        configs = [(n, {**cfg, "block_m": 16, "block_n": 16}) for n, cfg in CONFIGS[:3] + CONFIGS[5:6] + CONFIGS[8:9]]
        timer = lambda fn: (lambda t0: (fn(), time.perf_counter() - t0)[1] * 1e3)(time.perf_counter())
        device = "cpu-interpreter"
    else:
        dev, dtype, Hq, Hk, D, page = "cuda", torch.bfloat16, 32, 8, 128, 16
        shapes = {"causal": (1, 8192, 8192), "chunked": (4, 2048, 4096)}
        configs = CONFIGS
        timer = bench_ms
        name = torch.cuda.get_device_name()
        device = "h200" if "H200" in name else name.replace(" ", "_")
    scale = D**-0.5
    cases = {k: make_case(B, new, ctx, Hq, Hk, D, page, dev, dtype) for k, (B, new, ctx) in shapes.items()}
    flops = {k: B * Hq * D * 4 * (new * (ctx - new) + new * new / 2) for k, (B, new, ctx) in shapes.items()}
    tf = lambda k, ms: flops[k] / (ms * 1e-3) / 1e12

    # Correctness of the default path (and the reference timings) first.
    refs, sdpa_ms, log = {}, {}, []
    for k, c in cases.items():
        fn = sdpa_fn(c, scale)
        if fn is None:
            continue
        refs[k] = fn()
        sdpa_ms[k] = timer(fn)
        default = ours_fn(c, scale, configs[0][1])
        err = rel(as_bhsd(default(), c), refs[k])
        print(f"correctness {k}: default config rel err vs SDPA {err:.2e}  (sdpa {tf(k, sdpa_ms[k]):.0f} TFLOP/s)",
              flush=True)  # fmt: skip
        log.append({"check": k, "rel_err": err, "ok": err < 1e-2})

    rows = []
    for name, cfg in configs:
        if time.time() - t_start > args.budget:
            print(f"{name}: skipped (budget {args.budget:.0f} s spent)")
            rows.append({"config": name, **cfg, "error": "skipped: budget"})
            continue
        row = {"config": name, **cfg}
        for k, c in cases.items():
            fn = ours_fn(c, scale, cfg)
            try:
                t0 = time.time()
                out = fn()
                row[f"{k}_compile_s"] = round(time.time() - t0, 2)
                err = rel(as_bhsd(out, c), refs[k]) if k in refs else None
                ms = timer(fn)
            except Exception as e:  # one bad config must not end the sweep
                row[f"{k}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{name} {k}: {row[f'{k}_error'][:160]}", flush=True)
                if os.environ.get("SWEEP_TRACEBACK"):
                    traceback.print_exc()
                continue
            row.update({f"{k}_ms": ms, f"{k}_tflops": tf(k, ms), f"{k}_rel_err": err,
                        f"{k}_vs_sdpa": (sdpa_ms[k] / ms) if k in sdpa_ms else None})  # fmt: skip
        rows.append(row)
        print(name, {k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in row.items() if k_ != "config"},
              flush=True)  # fmt: skip

    def ok(r, k):
        e = r.get(f"{k}_rel_err")
        return f"{k}_ms" in r and (e is None or e < 1e-2)

    best = {}
    for k in cases:
        good = [r for r in rows if ok(r, k)]
        if good:
            best[k] = min(good, key=lambda r: r[f"{k}_ms"])
    best_cfg = {kk: best["causal"][kk] for kk in TUNING_KEYS if kk in best["causal"]} if "causal" in best else {}

    print(f"\n{'config':32s} {'causal TF/s':>11s} {'x sdpa':>7s} {'chunk TF/s':>10s} {'x sdpa':>7s} {'err':>8s}")
    for k in cases:
        if k in sdpa_ms:
            print(f"{'torch sdpa (' + k + ')':32s} {tf(k, sdpa_ms[k]):11.0f}")
    for r in rows:
        cells = [("causal_tflops", "11.0f"), ("causal_vs_sdpa", "7.3f"), ("chunked_tflops", "10.0f"),
                 ("chunked_vs_sdpa", "7.3f"), ("causal_rel_err", "8.1e")]  # fmt: skip
        width = lambda fmt: int(fmt.split(".")[0])
        text = [format(r[key], fmt) if r.get(key) is not None else "-".rjust(width(fmt)) for key, fmt in cells]
        print(f"{r['config']:32s} " + " ".join(text))
    print("best (paste into triton_prefill.TUNING[128]):", best_cfg)

    out_cases = []
    for k, r in best.items():
        out_cases.append(case(
            f"paged_prefill_{k}_{'x'.join(map(str, shapes[k]))}_h{Hq}kv{Hk}_d{D}_page{page}",
            metric="attention throughput", unit="TFLOP/s", ours=r[f"{k}_tflops"],
            peers={"torch_sdpa_contiguous": tf(k, sdpa_ms[k])} if k in sdpa_ms else {}, floor=None,
            config=r["config"], ours_ms=r[f"{k}_ms"], rel_err_vs_sdpa=r.get(f"{k}_rel_err"),
        ))  # fmt: skip
    doc = write_results(args.out, "sweep_prefill_attn", device, out_cases)
    doc.update(checks=log, rows=rows, best=best_cfg, wall_s=round(time.time() - t_start, 1))
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {args.out} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
