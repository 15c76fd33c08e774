"""Sweep the Triton paged prefill attention kernel's variants x tile configs against torch SDPA.

Cases (bf16, head_dim 128, 32 q / 8 kv heads, page 16, shuffled pages, as ``bench_ops.py`` measures):
  causal        one 8192-token prompt; this step's K/V passed contiguously (k = the rotated-k tensor,
                v = a column slice of a fused QKV output, as the Llama model passes them), so no key
                goes through the block table. Peer: SDPA causal on contiguous q/k/v with
                ``enable_gqa=True``. TFLOP/s = 2 * Hq * D * S^2 / t.
  causal_paged  the same prompt with every key read from the paged cache (no k/v passed).
  chunked       4 sequences of 2048 new tokens after a 2048-token cached prefix: prefix through the
                block table, new tokens from contiguous k/v; peer: SDPA on the same K/V made
                contiguous, lower-right causal mask (skipped if this torch cannot run it).
Configs that differ only in ``tma`` (ignored by the paged path) are timed once there. The variants the
H200 sweep found slower everywhere (hand-pipelined QK^T, block-fastest grid, forced int64 offsets,
warp-specialized prefix loop) are gone from the kernel; ``results/h200/prefill_attn.json`` keeps their rows.

Correctness first (bf16 relative error of our default config vs SDPA, both cases), then every config
(a compile failure is logged, not fatal), then a table of TFLOP/s and ratios to SDPA. The JSON holds
the conventional ``cases`` (best config per case), every ``rows`` entry and a ``best`` config dict
for each path: ``best_new_kv`` -> ``triton_prefill.TUNING_NEW_KV[128]``, ``best_paged`` ->
``triton_prefill.TUNING[128]``.

    python benchmarks/sweep_prefill_attn.py --out $OUT/sweep_prefill_attn.json     # H200, <= 2 min
    python benchmarks/sweep_prefill_attn.py --dry-run --out /tmp/x.json            # CPU interpreter
"""

from __future__ import annotations

import argparse
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
_T = {"block_m": 128, "block_n": 128, "num_warps": 8}
CONFIGS = [
    ("ws tma 128x128 w8 s3", {**_T, "num_stages": 3, "warp_spec": True, "tma": True}),
    ("ws tma 128x128 w8 s4", {**_T, "num_stages": 4, "warp_spec": True, "tma": True}),
    ("ws tma 128x128 w8 s3 r232", {**_T, "num_stages": 3, "warp_spec": True, "tma": True, "maxnreg": 232}),
    ("ws tma 256x128 w8 s2", {**_T, "block_m": 256, "num_stages": 2, "warp_spec": True, "tma": True}),
    ("ws tma 256x64 w8 s3", {**_T, "block_m": 256, "block_n": 64, "num_stages": 3, "warp_spec": True, "tma": True}),
    ("ws tma 128x128 w4 s3", {**_T, "num_warps": 4, "num_stages": 3, "warp_spec": True, "tma": True}),
    ("ws tma 128x64 w4 s4", {**_T, "block_n": 64, "num_warps": 4, "num_stages": 4, "warp_spec": True, "tma": True}),
    ("tma 128x128 w8 s3", {**_T, "num_stages": 3, "tma": True}),  # TMA without warp specialization
    ("ws ptr 128x128 w8 s3", {**_T, "num_stages": 3, "warp_spec": True, "tma": False}),  # = best paged one
    ("ws tma 128x64 w8 s3", {**_T, "block_n": 64, "num_stages": 3, "warp_spec": True, "tma": True}),
]
TUNING_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "maxnreg", "warp_spec", "tma")
NEW_KV_ONLY = ("tma",)  # the switch the paged-only path ignores


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
    # This step's K/V as the model hands them over: k is RoPE's fresh [T, Hk, D] output, v a column slice
    # of the fused QKV projection (row stride (Hq + 2 Hk) * D).
    k_new = k[:, :, ctx - new :].transpose(1, 2).reshape(B * new, Hk, D).contiguous()
    qkv = torch.empty(B * new, (Hq + 2 * Hk) * D, device=dev, dtype=dtype)
    v_new = qkv[:, (Hq + Hk) * D :].view(B * new, Hk, D)
    v_new.copy_(v[:, :, ctx - new :].transpose(1, 2).reshape(B * new, Hk, D))
    return dict(q=q, k=k, v=v, qt=qt, kc=kc, vc=vc, table=table, cu=cu, seq=seq, new=new, ctx=ctx,
                k_new=k_new, v_new=v_new)


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


def ours_fn(c: dict, scale: float, cfg: dict, new_kv: bool):
    out = torch.empty_like(c["qt"])
    kv = {"k": c["k_new"], "v": c["v_new"]} if new_kv else {}

    def run():
        triton_prefill._launch(c["qt"], c["kc"], c["vc"], out, c["cu"], c["seq"], c["table"], scale, None, None,
                               c["new"], cfg, **kv)  # fmt: skip
        return out

    return run


def as_bhsd(out: torch.Tensor, c: dict) -> torch.Tensor:
    B, Hq, new, D = c["q"].shape
    return out.view(B, new, Hq, D).transpose(1, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes under the Triton interpreter (CPU)")
    ap.add_argument("--budget", type=float, default=100.0, help="seconds; later configs are skipped past it")
    ap.add_argument("--rounds", type=int, default=7, help="head-to-head rounds of the best config vs SDPA")
    args = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(0)
    if args.dry_run:
        dev, dtype, Hq, Hk, D, page = "cpu", torch.float32, 4, 2, 16, 4
        shapes = {"causal": (1, 32, 32), "chunked": (2, 16, 32)}
        configs = [(n, {**cfg, "block_m": 16, "block_n": 16}) for n, cfg in CONFIGS[:4]]
        timer = lambda fn: (lambda t0: (fn(), time.perf_counter() - t0)[1] * 1e3)(time.perf_counter())
        device = "cpu-interpreter"
    else:
        dev, dtype, Hq, Hk, D, page = "cuda", torch.bfloat16, 32, 8, 128, 16
        shapes = {"causal": (1, 8192, 8192), "chunked": (4, 2048, 4096)}
        configs = CONFIGS
        timer = lambda fn: bench_ms(fn, warmup=10, rep=60)
        name = torch.cuda.get_device_name()
        device = "h200" if "H200" in name else name.replace(" ", "_")
    scale = D**-0.5
    data = {k: make_case(B, new, ctx, Hq, Hk, D, page, dev, dtype) for k, (B, new, ctx) in shapes.items()}
    # case -> (data, new K/V passed contiguously?)
    cases = {"causal": ("causal", True), "causal_paged": ("causal", False), "chunked": ("chunked", True)}
    flops = {k: B * Hq * D * 4 * (new * (ctx - new) + new * new / 2) for k, (B, new, ctx) in shapes.items()}
    tf = lambda k, ms: flops[cases[k][0]] / (ms * 1e-3) / 1e12

    # Correctness of the first config on every path (and the SDPA timings) first.
    refs, sdpa_ms, log = {}, {}, []
    for d, c in data.items():
        fn = sdpa_fn(c, scale)
        if fn is None:
            continue
        refs[d] = fn()
        sdpa_ms[d] = timer(fn)
        print(f"torch sdpa {d}: {flops[d] / (sdpa_ms[d] * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)
    for k, (d, new_kv) in cases.items():
        if d not in refs:
            continue
        try:
            err = rel(as_bhsd(ours_fn(data[d], scale, configs[0][1], new_kv)(), data[d]), refs[d])
        except Exception as e:
            err = float("nan")
            print(f"correctness {k}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        print(f"correctness {k}: {configs[0][0]} rel err vs SDPA {err:.2e}", flush=True)
        log.append({"check": k, "rel_err": err, "ok": err < 1e-2})

    rows, paged_seen = [], {}
    for name, cfg in configs:
        if time.time() - t_start > args.budget:
            print(f"{name}: skipped (budget {args.budget:.0f} s spent)")
            rows.append({"config": name, **cfg, "error": "skipped: budget"})
            continue
        row = {"config": name, **cfg}
        for k, (d, new_kv) in cases.items():
            if not new_kv:
                key = tuple(sorted((kk, v) for kk, v in cfg.items() if kk not in NEW_KV_ONLY))
                if key in paged_seen:  # the paged path ignores tma: already timed
                    src = paged_seen[key]
                    row.update({kk: v for kk, v in src.items() if kk.startswith(k + "_")})
                    row[f"{k}_same_as"] = src["config"]
                    continue
            fn = ours_fn(data[d], scale, cfg, new_kv)
            try:
                t0 = time.time()
                out = fn()
                row[f"{k}_compile_s"] = round(time.time() - t0, 2)
                err = rel(as_bhsd(out, data[d]), refs[d]) if d in refs else None
                ms = timer(fn)
            except Exception as e:  # one bad config must not end the sweep
                row[f"{k}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{name} {k}: {row[f'{k}_error'][:160]}", flush=True)
                if os.environ.get("SWEEP_TRACEBACK"):
                    traceback.print_exc()
                continue
            row.update({f"{k}_ms": ms, f"{k}_tflops": tf(k, ms), f"{k}_rel_err": err,
                        f"{k}_vs_sdpa": (sdpa_ms[d] / ms) if d in sdpa_ms else None})  # fmt: skip
            if not new_kv:
                paged_seen[key] = row
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
    pick = lambda r, drop=(): {kk: r[kk] for kk in TUNING_KEYS if kk in r and kk not in drop}
    best_new_kv = pick(best["causal"]) if "causal" in best else {}
    # Head to head: the best new-k/v config and SDPA alternately, several rounds, so both see the same
    # clocks and power state (SDPA alone at the start can read a different card than the sweep's end).
    h2h = None
    if "causal" in best and "causal" in sdpa_ms and not args.dry_run:
        d = "causal"
        ours = ours_fn(data[d], scale, {k_: best["causal"][k_] for k_ in TUNING_KEYS if k_ in best["causal"]}, True)
        ref = sdpa_fn(data[d], scale)
        o_ms, s_ms = [], []
        for _ in range(args.rounds):
            o_ms.append(timer(ours))
            s_ms.append(timer(ref))
        o_med, s_med = sorted(o_ms)[len(o_ms) // 2], sorted(s_ms)[len(s_ms) // 2]
        h2h = {"config": best["causal"]["config"], "ours_ms": o_ms, "sdpa_ms": s_ms, "ours_median_ms": o_med,
               "sdpa_median_ms": s_med, "ours_tflops": tf("causal", o_med),
               "sdpa_tflops": flops[d] / (s_med * 1e-3) / 1e12, "ratio": s_med / o_med}
        print(f"head to head ({args.rounds} rounds): ours {h2h['ours_tflops']:.0f} vs SDPA "
              f"{h2h['sdpa_tflops']:.0f} TFLOP/s = {h2h['ratio']:.3f}x", flush=True)
    best_paged = pick(best["causal_paged"], NEW_KV_ONLY) if "causal_paged" in best else {}

    cols = [("causal", "new k/v"), ("causal_paged", "paged"), ("chunked", "chunked")]
    print(f"\n{'config':30s} " + " ".join(f"{h + ' TF/s':>14s} {'x sdpa':>7s}" for _, h in cols) + f" {'err':>8s}")
    for d in data:
        if d in sdpa_ms:
            print(f"{'torch sdpa (' + d + ')':30s} {flops[d] / (sdpa_ms[d] * 1e-3) / 1e12:14.0f}")
    for r in rows:
        text = []
        for k, _ in cols:
            t_, x_ = r.get(f"{k}_tflops"), r.get(f"{k}_vs_sdpa")
            text.append(f"{t_:14.0f}" if t_ is not None else "-".rjust(14))
            text.append(f"{x_:7.3f}" if x_ is not None else "-".rjust(7))
        e = r.get("causal_rel_err")
        text.append(f"{e:8.1e}" if e is not None else "-".rjust(8))
        print(f"{r['config']:30s} " + " ".join(text))
    for k, r in best.items():
        print(f"best {k}: {r['config']} {r[f'{k}_tflops']:.0f} TFLOP/s, {r.get(f'{k}_vs_sdpa') or 0:.3f}x sdpa")
    print("best_new_kv (paste into triton_prefill.TUNING_NEW_KV[128]):", best_new_kv)
    print("best_paged (paste into triton_prefill.TUNING[128]):", best_paged)

    out_cases = []
    for k, r in best.items():
        d = cases[k][0]
        out_cases.append(case(
            f"paged_prefill_{k}_{'x'.join(map(str, shapes[d]))}_h{Hq}kv{Hk}_d{D}_page{page}",
            metric="attention throughput", unit="TFLOP/s", ours=r[f"{k}_tflops"],
            peers={"torch_sdpa_contiguous": flops[d] / (sdpa_ms[d] * 1e-3) / 1e12} if d in sdpa_ms else {},
            floor=None, config=r["config"], ours_ms=r[f"{k}_ms"], rel_err_vs_sdpa=r.get(f"{k}_rel_err"),
            new_kv_contiguous=cases[k][1],
        ))  # fmt: skip
    if h2h is not None:
        out_cases.append(case(
            f"paged_prefill_causal_head_to_head_{'x'.join(map(str, shapes['causal']))}_h{Hq}kv{Hk}_d{D}_page{page}",
            metric="attention throughput", unit="TFLOP/s", ours=h2h["ours_tflops"],
            peers={"torch_sdpa_contiguous": h2h["sdpa_tflops"]}, floor=None, config=h2h["config"],
            rounds=args.rounds, ours_ms=h2h["ours_ms"], sdpa_ms=h2h["sdpa_ms"], new_kv_contiguous=True,
        ))  # fmt: skip
    write_results(args.out, "sweep_prefill_attn", device, out_cases,
                  dict(checks=log, rows=rows, best=best_new_kv, best_new_kv=best_new_kv, best_paged=best_paged,
                       wall_s=round(time.time() - t_start, 1)))  # fmt: skip
    print(f"wrote {args.out} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
