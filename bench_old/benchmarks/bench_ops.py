"""Triton op kernels on one GPU vs torch peers and the measured physical ceilings.

Cases (bf16):
  decode   paged decode attention, batch 64, context 4096, 32 q / 8 kv heads, head_dim 128, page 16,
           vs ``F.scaled_dot_product_attention(enable_gqa=True)`` on contiguous KV.
           Metric: effective TB/s = K+V bytes / time; floor: measured copy bandwidth.
  prefill  causal prefill attention, 8192 tokens, 32/8 heads, head_dim 128, vs SDPA causal.
           Metric: TFLOP/s (2 * Hq * D * S^2 for causal); floor: measured bf16 matmul rate.
           This step's K/V are passed contiguously (``k=``/``v=``: the rotated k, v a column slice of
           the fused QKV output) the way the Llama model passes them, so only a cached prefix goes
           through the block table -- what FlashAttention varlen and FlashInfer's ragged prefill do
           too. The all-paged time is reported beside it (``paged_only_ms``).
  chunked  4 sequences of 2048 new tokens after a 2048-token cached prefix (ours only; new tokens'
           K/V contiguous, prefix paged).
  norm / silu / rope_kv: GB/s vs torch eager; floor: copy bandwidth.
  sample   64 x 128256 logits, temperature + top-k + top-p, vs torch sort-based filtering; greedy at
           batch 1 / 8 / 64 vs one program per row and ``torch.argmax`` (CUDA graphs).

    python benchmarks/bench_ops.py --out benchmarks/results/h200/ops.json [--sweep decode,prefill]

``--sweep decode,prefill`` first times a grid of kernel configurations, prints it, and uses
the best one for the reported numbers (the grid and the choice go into the JSON).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, copy_bandwidth, matmul_flops, time_graph, write_results  # noqa: E402

import infercore.ops as ops  # noqa: E402
from infercore.devices import implementation  # noqa: E402
from infercore.ops.attention import triton_decode, triton_prefill  # noqa: E402
from infercore.ops.sampling import SamplingTensors, apply_top_k_top_p_min_p  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def paged_from_contiguous(k: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [B, Hk, L, D]`` -> (cache ``[B*L/page, page, Hk, D]`` in shuffled page order, block table)."""
    B, Hk, L, D = k.shape
    n = B * L // page
    perm = torch.randperm(n, device=k.device)
    cache = torch.empty(n, page, Hk, D, device=k.device, dtype=k.dtype)
    cache[perm] = k.permute(0, 2, 1, 3).reshape(n, page, Hk, D)
    return cache, perm.view(B, L // page).to(torch.int32)


def decode_inputs(B: int, L: int, Hq: int, Hk: int, D: int, page: int):
    """A decode-attention case: q ``[B, Hq, D]``, contiguous k / v ``[B, Hk, L, D]`` (for SDPA), the
    same keys/values in shuffled pages (caches + block table), the int32 sequence lengths, the
    softmax scale, the KV bytes read, the SDPA peer (a callable) and its output ``[B, Hq, D]``."""
    q = torch.randn(B, Hq, D, device=DEV, dtype=BF16)
    k = torch.randn(B, Hk, L, D, device=DEV, dtype=BF16)
    v = torch.randn(B, Hk, L, D, device=DEV, dtype=BF16)
    kc, table = paged_from_contiguous(k, page)
    vc = torch.empty_like(kc)
    vc[table.view(-1).long()] = v.permute(0, 2, 1, 3).reshape(-1, page, Hk, D)
    seq = torch.full((B,), L, device=DEV, dtype=torch.int32)
    scale = D**-0.5
    sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)  # noqa: E731
    return q, kc, vc, table, seq, scale, 2 * B * Hk * L * D * 2, sdpa, sdpa().squeeze(2)


def bench_decode(bw: float, sweep: bool, log: list) -> dict:
    q, kc, vc, table, seq, scale, nbytes, sdpa, ref = decode_inputs(64, 4096, 32, 8, 128, 16)
    fn = implementation("paged_attention_decode", "triton")
    chosen = None
    if sweep:
        best = None
        for (bn, nw, ns), splits in itertools.product(
            [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3)], [1, 2, 4]
        ):
            triton_decode.TUNING.update(block_n=bn, num_warps=nw, num_stages=ns)
            call = lambda splits=splits: fn(q, kc, vc, seq_lens=seq, block_table=table, scale=scale, num_splits=splits)
            try:
                err = rel(call(), ref)
                t = bench_ms(call)
            except Exception as e:  # a config the compiler rejects (shared memory) is skipped
                print(f"decode bn={bn} warps={nw} stages={ns} splits={splits}: {type(e).__name__}")
                continue
            row = {
                "block_n": bn,
                "num_warps": nw,
                "num_stages": ns,
                "num_splits": splits,
                "ms": t,
                "err": err,
            }
            log.append({"decode": row})
            print("decode", row, flush=True)
            if err < 1e-2 and (best is None or t < best["ms"]):
                best = row
        triton_decode.TUNING.update(block_n=best["block_n"], num_warps=best["num_warps"], num_stages=best["num_stages"])
        chosen = best
    splits = chosen["num_splits"] if chosen else None
    ours_fn = lambda: ops.paged_attention_decode(q, kc, vc, seq_lens=seq, block_table=table, scale=scale)
    if splits is not None:
        ours_fn = lambda: fn(q, kc, vc, seq_lens=seq, block_table=table, scale=scale, num_splits=splits)
    err = rel(ours_fn(), ref)
    t_ours, t_sdpa = bench_ms(ours_fn), bench_ms(sdpa)
    tbs = lambda t: nbytes / (t * 1e-3) / 1e12
    print(f"decode: ours {t_ours:.4f} ms ({tbs(t_ours):.2f} TB/s), sdpa {t_sdpa:.4f} ms ({tbs(t_sdpa):.2f} TB/s)")
    return case(
        "paged_decode_b64_ctx4096_h32kv8_d128_page16_bf16",
        metric="effective KV bandwidth",
        unit="TB/s",
        ours=tbs(t_ours),
        peers={"torch_sdpa_contiguous_kv": tbs(t_sdpa)},
        floor=bw / 1e12,
        ours_ms=t_ours,
        peers_ms={"torch_sdpa_contiguous_kv": t_sdpa},
        rel_err_vs_sdpa=err,
        config={**triton_decode.TUNING, "num_splits": splits or "auto"},
    )


def new_kv_like_model(k: torch.Tensor, v: torch.Tensor, Hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``/``v`` ``[T, Hk, D]`` laid out as the Llama model passes them to prefill: k contiguous (RoPE's
    output), v a column slice of the fused QKV projection output ``[T, (Hq + 2 Hk) * D]``."""
    T, Hk, D = v.shape
    qkv = torch.empty(T, (Hq + 2 * Hk) * D, device=v.device, dtype=v.dtype)
    v_view = qkv[:, (Hq + Hk) * D :].view(T, Hk, D)
    v_view.copy_(v)
    return k.contiguous(), v_view


def bench_prefill(peak: float, sweep: bool, log: list) -> list[dict]:
    S, Hq, Hk, D, page = 8192, 32, 8, 128, 16
    q = torch.randn(1, Hq, S, D, device=DEV, dtype=BF16)
    k = torch.randn(1, Hk, S, D, device=DEV, dtype=BF16)
    v = torch.randn(1, Hk, S, D, device=DEV, dtype=BF16)
    kc, table = paged_from_contiguous(k, page)
    vc = torch.empty_like(kc)
    vc[table.view(-1).long()] = v.permute(0, 2, 1, 3).reshape(-1, page, Hk, D)
    qt = q[0].transpose(0, 1).contiguous()  # [S, Hq, D]
    cu = torch.tensor([0, S], device=DEV, dtype=torch.int32)
    seq = torch.tensor([S], device=DEV, dtype=torch.int32)
    scale = D**-0.5
    flops = 2 * Hq * D * S * S  # causal: half of 4 * S^2 * D per head
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    ref = sdpa()[0].transpose(0, 1)
    k_new, v_new = new_kv_like_model(k[0].transpose(0, 1), v[0].transpose(0, 1), Hq)
    ours = lambda: ops.paged_attention_prefill(
        qt, kc, vc, cu_seqlens_q=cu, seq_lens=seq, block_table=table, scale=scale, max_seqlen_q=S,
        k=k_new, v=v_new,
    )
    paged_only = lambda: ops.paged_attention_prefill(
        qt, kc, vc, cu_seqlens_q=cu, seq_lens=seq, block_table=table, scale=scale, max_seqlen_q=S
    )
    if sweep:
        # The public op reads the tuning table, so each candidate is swapped into it; the best (or, if
        # every candidate failed, the tuned one) stays there for the timings below.
        best, tuned = None, dict(triton_prefill.TUNING_NEW_KV[128])
        for bm, bn, nw, ns in [
            (128, 128, 8, 3),
            (128, 128, 8, 2),
            (128, 64, 8, 3),
            (64, 64, 4, 3),
        ]:
            triton_prefill.TUNING_NEW_KV[128] = {
                "block_m": bm,
                "block_n": bn,
                "num_warps": nw,
                "num_stages": ns,
                "warp_spec": True,
                "tma": True,
            }
            try:
                err = rel(ours(), ref)
                t = bench_ms(ours)
            except Exception as e:
                print(f"prefill {bm}x{bn} warps={nw} stages={ns}: {type(e).__name__}")
                continue
            row = dict(triton_prefill.TUNING_NEW_KV[128])
            row.update(ms=t, err=err)
            log.append({"prefill": row})
            print("prefill", row, flush=True)
            if err < 1e-2 and (best is None or t < best["ms"]):
                best = row
        triton_prefill.TUNING_NEW_KV[128] = (
            {k_: v_ for k_, v_ in best.items() if k_ not in ("ms", "err")} if best is not None else tuned
        )
    err = rel(ours(), ref)
    t_ours, t_sdpa, t_paged = bench_ms(ours), bench_ms(sdpa), bench_ms(paged_only)
    tf = lambda t: flops / (t * 1e-3) / 1e12
    print(f"prefill: ours {t_ours:.3f} ms ({tf(t_ours):.0f} TF/s), sdpa {t_sdpa:.3f} ms ({tf(t_sdpa):.0f} TF/s)")
    rows = [
        case(
            "paged_prefill_causal_8192_h32kv8_d128_page16_bf16",
            metric="attention throughput",
            unit="TFLOP/s",
            ours=tf(t_ours),
            peers={"torch_sdpa_causal_contiguous": tf(t_sdpa)},
            floor=peak / 1e12,
            ours_ms=t_ours,
            peers_ms={"torch_sdpa_causal_contiguous": t_sdpa},
            rel_err_vs_sdpa=err,
            config=dict(triton_prefill.TUNING_NEW_KV[128]),
            paged_only_ms=t_paged,
            paged_only_tflops=tf(t_paged),
            paged_only_config=dict(triton_prefill.TUNING[128]),
        )
    ]
    # Chunked prefill: 4 sequences, 2048 new tokens each after a 2048-token cached prefix.
    B, new, ctx = 4, 2048, 4096
    k2 = torch.randn(B, Hk, ctx, D, device=DEV, dtype=BF16)
    v2 = torch.randn(B, Hk, ctx, D, device=DEV, dtype=BF16)
    kc2, table2 = paged_from_contiguous(k2, page)
    vc2 = torch.empty_like(kc2)
    vc2[table2.view(-1).long()] = v2.permute(0, 2, 1, 3).reshape(-1, page, Hk, D)
    last = lambda x: x[:, :, ctx - new :].transpose(1, 2).reshape(B * new, Hk, D)  # the new tokens, ragged
    k2_new, v2_new = new_kv_like_model(last(k2), last(v2), Hq)
    q2 = torch.randn(B * new, Hq, D, device=DEV, dtype=BF16)
    cu2 = torch.arange(0, B * new + 1, new, device=DEV, dtype=torch.int32)
    seq2 = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
    chunk = lambda: ops.paged_attention_prefill(
        q2, kc2, vc2, cu_seqlens_q=cu2, seq_lens=seq2, block_table=table2, scale=scale, max_seqlen_q=new,
        k=k2_new, v=v2_new,
    )
    t_chunk = bench_ms(chunk)
    flops2 = B * Hq * D * 4 * (new * (ctx - new) + new * new / 2)
    rows.append(
        case(
            "paged_prefill_chunked_4x2048_after_2048_h32kv8_d128_bf16",
            metric="attention throughput",
            unit="TFLOP/s",
            ours=flops2 / (t_chunk * 1e-3) / 1e12,
            peers={},
            floor=peak / 1e12,
            ours_ms=t_chunk,
        )
    )
    return rows


def _bandwidth_case(name: str, nbytes: int, bw: float, ours, peers: dict, check=None) -> dict:
    """Time ``ours`` and each peer (CUDA events), report TB/s over ``nbytes`` moved; ``check``: the
    reference to compare ``ours()``'s result with (relative error)."""
    tbs = lambda t_ms: nbytes / (t_ms * 1e-3) / 1e12
    t_o = bench_ms(ours)
    extra = {} if check is None else {"rel_err_vs_reference": rel(check[0](ours()), check[1]())}
    return case(name, metric="bandwidth", unit="TB/s", ours=tbs(t_o),
                peers={p: tbs(bench_ms(fn)) for p, fn in peers.items()}, floor=bw / 1e12, ours_ms=t_o, **extra)


def bench_elementwise(bw: float) -> list[dict]:
    T, H, I = 8192, 4096, 14336
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(H, device=DEV, dtype=BF16)
    ours = lambda: ops.fused_add_rms_norm(x, r, w, eps=1e-6)
    eager = lambda: implementation("fused_add_rms_norm", "reference")(x, r, w, eps=1e-6)
    rows = [_bandwidth_case("fused_add_rms_norm_8192x4096_bf16", 4 * T * H * 2, bw, ours, {"torch_eager": eager},
                            check=(lambda y: y[0], lambda: eager()[0]))]
    g = torch.randn(T, 2 * I, device=DEV, dtype=BF16)
    eager = lambda: F.silu(g[:, :I]) * g[:, I:]
    rows.append(_bandwidth_case("silu_and_mul_8192x14336_bf16", 3 * T * I * 2, bw, lambda: ops.silu_and_mul(g),
                                {"torch_eager": eager}, check=(lambda y: y, eager)))
    Tq, Hq, Hk, D, page = 8192, 32, 8, 128, 16
    q = torch.randn(Tq, Hq, D, device=DEV, dtype=BF16)
    k = torch.randn(Tq, Hk, D, device=DEV, dtype=BF16)
    v = torch.randn(Tq, Hk, D, device=DEV, dtype=BF16)
    pos = torch.arange(Tq, device=DEV)
    cs = ops.rope_cos_sin_cache(rotary_dim=D, max_positions=Tq, base=500000.0, device=DEV)
    kc = torch.empty(Tq // page, page, Hk, D, device=DEV, dtype=BF16)
    vc = torch.empty_like(kc)
    slots = torch.randperm(Tq, device=DEV).to(torch.int32)
    fused = implementation("rope_and_write_kv", "triton")
    ref_fn = implementation("rope_and_write_kv", "reference")
    two_ops = lambda: (lambda qk: ops.write_kv_cache_(qk[1], v, kc, vc, slots))(ops.apply_rope(q, k, pos, cs))
    rows.append(_bandwidth_case(
        "rope_and_write_kv_8192tok_h32kv8_d128_bf16", 2 * Tq * Hq * D * 2 + 2 * 2 * Tq * Hk * D * 2, bw,
        lambda: fused(q, k, v, pos, cs, kc, vc, slots, is_neox=True),
        {"torch_eager": lambda: ref_fn(q, k, v, pos, cs, kc, vc, slots, is_neox=True),
         "triton_apply_rope_then_write_kv": two_ops}))  # fmt: skip
    return rows


def _one_program_per_row(run):
    """``run()`` with the sampler's first pass left to the sampling program (no row slices)."""
    from infercore.ops.sampling import triton as ts

    real = ts._parts
    ts._parts = lambda *a: 0
    try:
        return run()
    finally:
        ts._parts = real


def bench_sampling() -> list[dict]:
    B, V = 64, 128256
    logits = torch.randn(B, V, device=DEV) * 3
    rows = []
    for name, kw in [
        ("topk50_topp0.9_t0.8", dict(top_k=[50] * B, top_p=[0.9] * B)),
        ("topp0.9_t0.8", dict(top_p=[0.9] * B)),
        ("plain_t0.8", {}),
    ]:
        p = SamplingTensors.from_lists(temperature=[0.8] * B, seeds=list(range(B)), device=DEV, **kw)
        ours = lambda p=p: ops.sample(logits, p)

        def torch_sort_based(p=p):
            x = logits / p.temperature[:, None]
            x = apply_top_k_top_p_min_p(x, p.top_k, p.top_p, p.min_p)
            e = torch.empty_like(x).exponential_()
            return (x.softmax(-1) / e).argmax(-1)

        t_o, t_t = bench_ms(ours), bench_ms(torch_sort_based)
        t_seq = _one_program_per_row(lambda ours=ours: bench_ms(ours))
        rows.append(
            case(
                f"sample_b64_v128256_{name}",
                metric="sampling rate",
                unit="rows/ms",
                ours=B / t_o,
                peers={"torch_sort_based": B / t_t, "one program per row": B / t_seq},
                floor=None,
                ours_ms=t_o,
            )
        )
    # Greedy decode at small batches (the decode step's sampling): the first pass over slices of
    # each row in parallel vs one program per row scanning it (the path for large batches) and
    # torch.argmax; 32 calls per CUDA graph on fp32 logits as the models return them (L2-resident,
    # as right after the lm_head, so no DRAM floor applies).
    from infercore.ops.sampling import triton as ts

    fn = implementation("sample", "triton")
    for b in (1, 8, 64):
        x = torch.randn(b, V, device=DEV) * 3
        p = SamplingTensors.from_lists(temperature=[0.0] * b, device=DEV)
        t_par = time_graph(lambda i, x=x, p=p: fn(x, p), 32) * 1e3
        t_seq = _one_program_per_row(lambda x=x, p=p: time_graph(lambda i: fn(x, p), 32) * 1e3)
        t_arg = time_graph(lambda i, x=x: x.argmax(-1), 32) * 1e3
        rows.append(case(f"sample_greedy_b{b}_v128256", metric="sampling rate", unit="rows/ms", ours=b / t_par,
                         peers={"one program per row": b / t_seq, "torch.argmax": b / t_arg}, floor=None,
                         ours_ms=t_par, parts=ts._parts(b, V, 4096, torch.device(DEV))))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/ops.json")
    ap.add_argument("--sweep", default="", help="comma list of decode,prefill: time a grid of kernel configs first")
    ap.add_argument("--only", default="", help="comma list of: decode,prefill,elementwise,sample")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    want = lambda s: not only or s in only
    torch.manual_seed(0)
    bw = copy_bandwidth()
    peak = matmul_flops()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    cases, log = [], []
    device = "h200" if "H200" in torch.cuda.get_device_name() else torch.cuda.get_device_name().replace(" ", "_")

    def flush():
        write_results(args.out, "ops", device, cases,
                      {"ceilings": {"copy_TBps": bw / 1e12, "bf16_matmul_TFLOPs": peak / 1e12},
                       **({"sweep": log} if log else {})})

    for name, run in [
        ("decode", lambda: [bench_decode(bw, "decode" in args.sweep, log)]),
        ("prefill", lambda: bench_prefill(peak, "prefill" in args.sweep, log)),
        ("elementwise", lambda: bench_elementwise(bw)),
        ("sample", bench_sampling),
    ]:
        if want(name):
            try:
                cases.extend(run())
            except Exception as e:  # keep the other cases if one fails
                import traceback

                traceback.print_exc()
                cases.append({"case": name, "error": f"{type(e).__name__}: {e}"})
            flush()
    print(f"{'case':58s} {'ours':>9s} {'best peer':>9s} {'vs peer':>8s} {'/floor':>7s}")
    for c in cases:
        if "error" in c:
            print(f"{c['case']:58s} ERROR {c['error'][:60]}")
            continue
        best = max(c["peers"].values()) if c["peers"] else float("nan")
        vs = c["ours_vs_best_peer"] or float("nan")
        fl = c["ours_over_floor"] or float("nan")
        print(f"{c['case']:58s} {c['ours']:9.3f} {best:9.3f} {vs:8.3f} {fl:7.3f}  {c['unit']}")


if __name__ == "__main__":
    main()
