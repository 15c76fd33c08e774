"""Routed experts on the host CPU: one Qwen3-30B-A3B-shaped MoE layer's experts (128 x [1536 x 2048, 2048 x 768],
bf16, 1.2 GB) at decode sizes -- the work of ``offload.offload_experts_``'s host path and of a CPU-resident MoE
model.

* ours: ``models.layout.CPUPackedExperts`` (bf16: the native host kernel, ``ops.moe.cpu_native``, one call per
  layer over the plain weights; key ``ms_onednn_packed``: the same class on each expert's oneDNN-packed weights);
* peers: transformers' ``Qwen3MoeExperts`` (its default per-expert loop, plain ``F.linear``), and our reference
  loop (``ops.moe.naive.moe_experts_ref``: plain ``matmul``), on the same tensors;
* floor: the distinct routed experts' bytes / host read bandwidth measured in the same run (a summing read of a
  2 GiB buffer with every thread).

Routing: ``T`` tokens, top-8 of 128 drawn at random per token (distinct experts per layer as random routing
gives them).

    python benchmarks/bench_cpu_moe.py --out benchmarks/results/cpu/cpu_moe.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import best_of, case, host_read_bandwidth, write_results  # noqa: E402

from infercore.models.layout import CPUPackedExperts, cpu_packing_supported  # noqa: E402
from infercore.offload.host_experts import NativeQuantExperts, _quant_experts, _QuantLinear  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402
from infercore.ops.moe.naive import moe_experts_ref  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/cpu/cpu_moe.json")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--schemes", default="w4a16-g128,w8a16", help="quantized host experts also timed ('' : none)")
    args = ap.parse_args()
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, k, H, I = args.experts, args.top_k, args.hidden, args.intermediate
    dtype = torch.bfloat16
    if not cpu_packing_supported(dtype):
        raise SystemExit("oneDNN on this CPU cannot pack bf16 weights")
    bw = host_read_bandwidth()
    print(f"host read {bw / 1e9:.1f} GB/s, {torch.get_num_threads()} threads", flush=True)
    torch.manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, dtype=dtype) * 0.02
    down = torch.randn(E, H, I, dtype=dtype) * 0.02
    t = time.perf_counter()
    packed = CPUPackedExperts(gate_up, down)
    pack_s = time.perf_counter() - t
    onednn = CPUPackedExperts(gate_up, down, native=False) if packed.native else None
    print(f"experts: {'native kernels (' + cpu_native.status() + ')' if packed.native else 'oneDNN-packed'}",
          flush=True)
    hcfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k)
    with torch.device("meta"):
        hf = Qwen3MoeExperts(hcfg)
    hf.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    hf.down_proj = torch.nn.Parameter(down, requires_grad=False)
    quant, aten, expert_bytes_q = {}, {}, {}
    for scheme in args.schemes.split(",") if args.schemes else []:
        t = time.perf_counter()
        lists = ([_QuantLinear(gate_up[e], scheme, dtype) for e in range(E)],
                 [_QuantLinear(down[e], scheme, dtype) for e in range(E)])
        stacked = NativeQuantExperts.build(*lists)
        expert_bytes_q[scheme] = sum(q.nbytes for qs in lists for q in qs) / E
        quant[scheme] = (lambda x, w, ids, s=stacked: s(x, w, ids, None)) if stacked else (
            lambda x, w, ids, qs=lists: _quant_experts(x, *qs, w, ids, None))
        if stacked:  # ATen's INT4 / INT8 kernel, per expert, for comparison
            with cpu_native.disabled():
                qs = ([_QuantLinear(gate_up[e], scheme, dtype) for e in range(E)],
                      [_QuantLinear(down[e], scheme, dtype) for e in range(E)])
            aten[scheme] = lambda x, w, ids, qs=qs: _quant_experts(x, *qs, w, ids, None)
        print(f"{scheme}: quantized and packed in {time.perf_counter() - t:.0f} s (native: {bool(stacked)})",
              flush=True)
    expert_bytes = 3 * H * I * 2
    g = torch.Generator().manual_seed(1)
    cases = []
    for T in [int(x) for x in args.tokens.split(",")]:
        x = torch.randn(T, H, dtype=dtype, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.softmax(torch.randn(T, k, generator=g), -1)
        distinct = int(torch.unique(ids).numel())
        with torch.inference_mode():
            want = moe_experts_ref(x, gate_up, down, w, ids)
            got = packed(x, w, ids)
            err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
            t_ours = best_of(lambda x=x, w=w, ids=ids: packed(x, w, ids), args.reps)
            t_ref = best_of(lambda x=x, w=w, ids=ids: moe_experts_ref(x, gate_up, down, w, ids), args.reps)
            t_hf = best_of(lambda x=x, w=w, ids=ids: hf(x, ids, w.to(dtype)), args.reps)
            t_dnn = best_of(lambda x=x, w=w, ids=ids: onednn(x, w, ids), args.reps) if onednn else None
        floor_s = distinct * expert_bytes / bw
        if t_dnn:
            print(f"T={T}: oneDNN-packed {t_dnn * 1e3:.2f} ms", flush=True)
        print(f"T={T} ({distinct} experts): ours {t_ours * 1e3:.2f} ms, reference {t_ref * 1e3:.2f} ms, "
              f"transformers {t_hf * 1e3:.2f} ms, floor {floor_s * 1e3:.2f} ms; max rel diff {err:.2e}", flush=True)
        peers = {"transformers Qwen3MoeExperts": 1 / t_hf, "reference loop (plain matmul)": 1 / t_ref}
        cases.append(case(
            f"qwen3-30b-a3b-shape experts (128 x 2048/768, top-8), T={T}, bf16, host CPU",
            metric="expert-layer calls", unit="calls/s", ours=1 / t_ours, peers=peers, floor=1 / floor_s,
            ms_ours=t_ours * 1e3, ms_transformers=t_hf * 1e3, ms_reference=t_ref * 1e3, distinct_experts=distinct,
            bytes_read=distinct * expert_bytes, achieved_GBps=distinct * expert_bytes / t_ours / 1e9,
            host_read_GBps=bw / 1e9, threads=torch.get_num_threads(), max_rel_diff_vs_reference=err,
            pack_seconds=pack_s, native=packed.native, native_isa=cpu_native.status() if packed.native else None,
            ms_onednn_packed=t_dnn * 1e3 if t_dnn else None,
        ))  # fmt: skip
        for scheme, run in quant.items():
            with torch.inference_mode():
                qerr = (run(x, w, ids).float() - want.float()).abs().max().item()
                t_q = best_of(lambda x=x, w=w, ids=ids, run=run: run(x, w, ids), args.reps)
                t_a = best_of(lambda x=x, w=w, ids=ids, r=aten[scheme]: r(x, w, ids), args.reps) if scheme in aten \
                    else None
            qbytes = int(torch.unique(ids).numel()) * expert_bytes_q[scheme]
            print(f"  {scheme}: {t_q * 1e3:.2f} ms ({qbytes / t_q / 1e9:.1f} GB/s of its bytes, floor "
                  f"{qbytes / bw * 1e3:.2f} ms)" + (f"; ATen's kernel {t_a * 1e3:.2f} ms" if t_a else ""),
                  flush=True)
            cases.append(case(
                f"qwen3-30b-a3b-shape experts (128 x 2048/768, top-8), T={T}, {scheme} host experts, host CPU",
                metric="expert-layer calls", unit="calls/s", ours=1 / t_q, peers=peers, floor=bw / qbytes,
                ms_ours=t_q * 1e3, bf16_packed_ms=t_ours * 1e3, distinct_experts=distinct, bytes_read=qbytes,
                achieved_GBps=qbytes / t_q / 1e9, host_read_GBps=bw / 1e9, threads=torch.get_num_threads(),
                max_rel_diff_vs_bf16=qerr / want.float().abs().max().item(), native=scheme in aten,
                ms_aten=t_a * 1e3 if t_a else None,  # ATen's INT4 / INT8 kernel per expert
            ))  # fmt: skip
    write_results(args.out, "cpu_moe", "cpu", cases)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
