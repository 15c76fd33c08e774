"""Quantized KV cache: paged decode attention over bf16 vs fp8 (e4m3) vs int8 caches, on one GPU.

Shape (bandwidth-bound decode): batch 64, context 4096, 32 q / 8 kv heads, head_dim 128, page 16.
Each quantized cache holds 1-byte codes plus one fp32 scale per (token, kv head): 132 bytes per
(token, head) instead of 256, so the kernel should run ~1.9x faster when it stays at the copy
bandwidth. Cases:

  decode_<fmt>   calls/s of the Triton decode kernel (fmt: bf16, int8, fp8 native, fp8 emulated =
                 the sm80 bit-trick path); peers: our bf16 kernel and SDPA on contiguous bf16 KV;
                 floor: copy bandwidth / bytes this format must read. Extra keys: ms, bytes, TB/s.
  write_<fmt>    fused RoPE + KV write of 8192 tokens (prefill-sized), GB/s of k/v read.
  prefill_dequant  the temporary-bf16 path of a cached prefix (4 x 4096 tokens), GB/s.

Correctness is checked first (relative error vs the reference on the same quantized cache, and vs
the bf16 cache). A small sweep of block_n / num_warps runs for each format (``--no-sweep`` skips it;
``--grid`` times given ``TUNING`` overrides instead, ``--rounds`` times in alternation).

    python benchmarks/bench_kvquant.py --out benchmarks/results/h200/kvquant.json
    TRITON_INTERPRET=1 python benchmarks/bench_kvquant.py --dry-run --out /tmp/kvq.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, copy_bandwidth, write_results  # noqa: E402

import infercore.ops as ops  # noqa: E402
from infercore.devices import capability, implementation  # noqa: E402
from infercore.ops.attention import triton_decode  # noqa: E402
from infercore.ops.kv_cache import dequantize_paged_kv  # noqa: E402
from infercore.ops.kv_cache.quant import quantize_kv_ref  # noqa: E402

FORMATS = {"bf16": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_emulated": torch.float8_e4m3fn}


def parse_tuning(spec: str) -> dict:
    """``"kv_f16=1,num_stages=2"`` -> TUNING overrides (ints; 0/1 stay ints, which the kernel reads as bools)."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key not in triton_decode.TUNING:
            raise ValueError(f"--grid: unknown TUNING key {key!r}")
        out[key] = int(val)
    return out


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def timer(dev: str):
    if dev == "cuda":
        return lambda fn: bench_ms(fn, warmup=10, rep=50)

    def cpu_ms(fn):
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return cpu_ms


def build_caches(B, L, Hk, D, page, dev, dt):
    """Shuffled pages of random bf16 K/V ([B*L/page, page, Hk, D]) plus their int8 / fp8 codes."""
    n = B * L // page
    perm = torch.randperm(n, device=dev)
    table = perm.view(B, L // page).to(torch.int32).contiguous()
    kc = torch.randn(n, page, Hk, D, device=dev, dtype=dt)
    vc = torch.randn(n, page, Hk, D, device=dev, dtype=dt)
    caches = {"bf16": (kc, vc, None, None)}
    for name in ("int8", "fp8"):
        qk, sk = quantize_kv_ref(kc, FORMATS[name])
        qv, sv = quantize_kv_ref(vc, FORMATS[name])
        caches[name] = (qk, qv, sk, sv)
    caches["fp8_emulated"] = caches["fp8"]
    return caches, table


def cache_bytes(c) -> int:
    return sum(t.numel() * t.element_size() for t in c if t is not None)


def bench_decode(args, dev, dt, bw, ms, log) -> list[dict]:
    B, L, Hq, Hk, D, page = (2, 64, 4, 2, 32, 16) if args.dry_run else (64, 4096, 32, 8, 128, 16)
    caches, table = build_caches(B, L, Hk, D, page, dev, dt)
    q = torch.randn(B, Hq, D, device=dev, dtype=dt)
    seq = torch.full((B,), L, device=dev, dtype=torch.int32)
    scale = D**-0.5
    fn = implementation("paged_attention_decode", "triton")
    ref_fn = implementation("paged_attention_decode", "reference")

    def call(fmt, **kw):
        kc, vc, ks, vs = caches[fmt]
        extra = {} if ks is None else {"k_scale": ks, "v_scale": vs, "fp8_emulation": fmt == "fp8_emulated"}
        return lambda: fn(q, kc, vc, seq_lens=seq, block_table=table, scale=scale, **extra, **kw)

    base = ref_fn(q, caches["bf16"][0], caches["bf16"][1], seq_lens=seq, block_table=table, scale=scale)
    # SDPA peer on contiguous bf16 K/V [B, Hk, L, D] (gathered once, outside the timing).
    k_cont = caches["bf16"][0][table.long()].reshape(B, L, Hk, D).transpose(1, 2).contiguous()
    v_cont = caches["bf16"][1][table.long()].reshape(B, L, Hk, D).transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k_cont, v_cont, scale=scale, enable_gqa=True)
    results, errs = {}, {}
    for fmt in FORMATS:
        kc, vc, ks, vs = caches[fmt]
        try:
            out = call(fmt)()
            want = ref_fn(q, kc, vc, seq_lens=seq, block_table=table, scale=scale, k_scale=ks, v_scale=vs)
            errs[fmt] = (rel(out, want), rel(out, base))
            log.append(f"decode {fmt}: rel err vs reference on same cache {errs[fmt][0]:.2e}, vs bf16 cache "
                       f"{errs[fmt][1]:.2e}")  # fmt: skip
            if errs[fmt][0] > 2e-2 or errs[fmt][1] > 8e-2:
                log.append(f"decode {fmt}: ERROR above tolerance, not timed")
                continue
        except Exception as e:  # a format that fails to compile must not sink the others
            log.append(f"decode {fmt}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc()
            continue
        grid = [{}]
        if args.grid:
            grid = [parse_tuning(g) for g in args.grid.split(";")]
        elif args.sweep and not args.dry_run:
            grid = [dict(block_n=bn, block_n_codes=bn, block_n_fp8=bn, num_warps=nw, num_warps_codes=nw,
                         num_warps_fp8=nw) for bn, nw in ((32, 1), (64, 2), (64, 4), (128, 4), (128, 8))]
        best, timed = None, []
        for _ in range(args.rounds):
            for tune in grid:
                saved = dict(triton_decode.TUNING)
                try:
                    triton_decode.TUNING.update(tune)
                    if tune:
                        err = rel(call(fmt)(), want)
                        if err > 2e-2:
                            log.append(f"  {fmt} {tune}: ERROR rel err {err:.2e}, not timed")
                            continue
                    t = ms(call(fmt))
                    log.append(f"  {fmt} {tune or 'defaults'}: {t * 1e3:.1f} us")
                    timed.append({"tuning": tune, "us": t * 1e3})
                    if best is None or t < best[0]:
                        best = (t, tune)
                except Exception as e:
                    log.append(f"  {fmt} {tune}: FAILED {type(e).__name__}: {e}")
                finally:
                    triton_decode.TUNING.clear()
                    triton_decode.TUNING.update(saved)
        if best is not None:
            results[fmt] = (*best, timed)
    t_sdpa = ms(sdpa)
    rows = []
    for fmt, (t, tune, timed) in results.items():
        nbytes = cache_bytes(caches[fmt]) * B * L // (caches[fmt][0].shape[0] * page)  # all pages are read
        peers = {"sdpa_bf16_contiguous": 1e3 / t_sdpa}
        if fmt != "bf16" and "bf16" in results:
            peers["ours_bf16"] = 1e3 / results["bf16"][0]
        rows.append(case(
            f"decode_{fmt}", metric="decode calls/s (b64 ctx4096 32/8 d128 p16)" if not args.dry_run else "calls/s",
            unit="1/s", ours=1e3 / t, peers=peers, floor=bw / nbytes, ms=t, bytes=nbytes,
            achieved_TBps=nbytes / (t * 1e-3) / 1e12,
            bf16_equivalent_TBps=cache_bytes(caches["bf16"]) / (t * 1e-3) / 1e12,
            rel_err_vs_same_cache=errs[fmt][0], rel_err_vs_bf16_cache=errs[fmt][1], tuning=tune,
            **({"grid_us": timed} if len(timed) > 1 else {}),
        ))  # fmt: skip
    return rows


def bench_write(args, dev, dt, bw, ms, log) -> list[dict]:
    T, Hq, Hk, D, page = (8, 4, 2, 32, 16) if args.dry_run else (8192, 32, 8, 128, 16)
    pages = T // page + 4
    q = torch.randn(T, Hq, D, device=dev, dtype=dt)
    k = torch.randn(T, Hk, D, device=dev, dtype=dt)
    v = torch.randn(T, Hk, D, device=dev, dtype=dt)
    pos = torch.arange(T, device=dev)
    slots = torch.randperm(pages * page, device=dev)[:T].to(torch.int32)
    cs = ops.rope_cos_sin_cache(rotary_dim=D, max_positions=max(T, 16), base=5e5, device=dev)
    fn = implementation("rope_and_write_kv", "triton")
    rows = []
    for fmt in ("bf16", "int8", "fp8"):
        cdt = FORMATS[fmt] or dt
        if args.dry_run and fmt == "fp8":
            continue  # the interpreter's fp32->fp8 conversion is unreliable
        kc = torch.zeros(pages, page, Hk, D, device=dev, dtype=cdt)
        vc = torch.zeros_like(kc)
        extra = {}
        if fmt != "bf16":
            zs = (pages, page, Hk)
            extra = {"k_scale": torch.zeros(zs, device=dev), "v_scale": torch.zeros(zs, device=dev)}
        try:
            call = lambda kc=kc, vc=vc, extra=extra: fn(q, k, v, pos, cs, kc, vc, slots, **extra)
            call()
            want_k = ops.apply_rope(q, k, pos, cs)[1]
            got_k = kc.view(-1, Hk, D)[slots.long()].float()
            if fmt != "bf16":
                got_k = got_k * extra["k_scale"].view(-1, Hk)[slots.long()][..., None]
            err = rel(got_k, want_k)
            log.append(f"write {fmt}: rel err of the stored k {err:.2e}")
            t = ms(call)
        except Exception as e:
            log.append(f"write {fmt}: FAILED {type(e).__name__}: {e}")
            continue
        nbytes = (q.numel() * 2 + k.numel() + v.numel()) * q.element_size() + q.numel() * q.element_size()
        nbytes += (k.numel() + v.numel()) * kc.element_size()
        nbytes += sum(x.numel() // D * 4 for x in (k, v)) * (fmt != "bf16")  # scales
        rows.append(case(f"write_{fmt}", metric=f"fused rope+KV write {T} tokens, bytes moved/s", unit="GB/s",
                         ours=nbytes / (t * 1e-3) / 1e9, peers={}, floor=bw / 1e9, ms=t, rel_err=err))  # fmt: skip
    return rows


def bench_prefill_dequant(args, dev, dt, bw, ms, log) -> list[dict]:
    B, L, Hk, D, page = (2, 32, 2, 32, 16) if args.dry_run else (4, 4096, 8, 128, 16)
    caches, table = build_caches(B, L, Hk, D, page, dev, dt)
    kc, vc, ks, vs = caches["int8"]
    seq = torch.full((B,), L, device=dev, dtype=torch.int32)
    call = lambda: dequantize_paged_kv(kc, vc, ks, vs, block_table=table, seq_lens=seq, dtype=dt)
    kt, _, bt = call()
    err = rel(kt[bt.long()].reshape(-1), (kc.float() * ks[..., None])[table.long()].reshape(-1))
    t = ms(call)
    nbytes = cache_bytes(caches["int8"]) + cache_bytes(caches["bf16"])  # read codes+scales, write bf16
    log.append(f"prefill dequant: rel err {err:.1e}, {t:.3f} ms for {B}x{L} tokens")
    return [case("prefill_dequant_int8", metric=f"dequantize {B}x{L} prefix tokens to bf16, bytes moved/s",
                 unit="GB/s", ours=nbytes / (t * 1e-3) / 1e9, peers={}, floor=bw / 1e9, ms=t, rel_err=err)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--grid", default="", help="';'-separated TUNING overrides timed for each format instead of the "
                    "sweep, e.g. ';kv_v16=0;block_n_fp8=64,num_warps_fp8=2' (an empty entry is the defaults)")
    ap.add_argument("--rounds", type=int, default=1, help="times through the grid (alternating)")
    args = ap.parse_args()
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.dry_run:
        sys.exit("no CUDA device: use --dry-run with TRITON_INTERPRET=1")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter cannot do bf16 math
    torch.manual_seed(0)
    ms = timer(dev)
    bw = copy_bandwidth(dev) if dev == "cuda" else copy_bandwidth_cpu()
    log = [f"device {dev}, copy bandwidth {bw / 1e12:.2f} TB/s, native fp8: {capability(dev).native_fp8}"]
    rows = []
    for part in (bench_decode, bench_write, bench_prefill_dequant):
        try:
            rows += part(args, dev, dt, bw, ms, log)
        except Exception as e:
            log.append(f"{part.__name__}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc()
        if dev == "cuda":
            torch.cuda.empty_cache()
    rows.append(case("copy", metric="device copy (read+write)", unit="TB/s", ours=bw / 1e12, peers={}, floor=None))
    print("\n".join(log))
    print(f"\n{'case':24} {'ours':>12} {'unit':>6} {'ms':>9} {'vs best peer':>13} {'of floor':>9}")
    for r in rows:
        vs = f"{r['ours_vs_best_peer']:.2f}x" if r["ours_vs_best_peer"] else "-"
        fl = f"{r['ours_over_floor']:.2f}" if r["ours_over_floor"] else "-"
        print(f"{r['case']:24} {r['ours']:12.4g} {r['unit']:>6} {r.get('ms', float('nan')):9.4f} {vs:>13} {fl:>9}")
    dec = {r["case"]: r for r in rows if r["case"].startswith("decode_")}
    if "decode_bf16" in dec:
        for fmt in ("int8", "fp8", "fp8_emulated"):
            if f"decode_{fmt}" in dec:
                print(f"speedup {fmt} vs bf16 cache: {dec['decode_bf16']['ms'] / dec[f'decode_{fmt}']['ms']:.2f}x")
    write_results(args.out, "kvquant", capability(dev).name if dev == "cuda" else "cpu-interpreter", rows)
    print(f"wrote {args.out} in {time.time() - t0:.1f} s")


def copy_bandwidth_cpu(nbytes: int = 1 << 24) -> float:
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    b = torch.empty_like(a)
    t = time.perf_counter()
    b.copy_(a)
    return 2 * nbytes / (time.perf_counter() - t)


if __name__ == "__main__":
    main()
