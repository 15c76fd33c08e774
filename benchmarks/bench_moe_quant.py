"""Weight-only quantized routed experts (int8 / fp8 codes with per-channel or 128 x 128 block scales) against the
same op on bf16 experts, by batch, at the Qwen3-30B-A3B and DeepSeek-V2-Lite expert shapes.

Ours: ``ops.moe_experts_routed(..., gate_up_scale=, down_scale=)`` (Triton; the codes read and scaled in registers),
CUDA-graph timed (decode sizes) or ``do_bench`` (prefill sizes). Baseline in the same run: the op on the bf16
experts (what a model runs without quantized experts). Floor: the routed experts' bytes in each format (codes +
scales) over the copy bandwidth measured here. Prefill sizes are compute-bound and report TFLOP/s.

    python benchmarks/bench_moe_quant.py --out $OUT/moe_quant.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, copy_bandwidth, rel_err, time_graph, write_results  # noqa: E402

from infercore.models.moe import quantize_expert_weights, route_topk  # noqa: E402
from infercore.ops import moe_experts_routed  # noqa: E402
from infercore.ops.moe import dequantize_experts  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v2-lite": (64, 2048, 1408, 6)}


def timed(call, prefill: bool) -> float:
    """Microseconds per call: ``do_bench`` at prefill sizes, a CUDA graph of 8 calls below."""
    if prefill:
        return bench_ms(call) * 1e3
    return time_graph(lambda i: call(), 8, reps=7, warmup=1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,16,64,4096")
    ap.add_argument("--kinds", default="int8,fp8,fp8-block")
    args = ap.parse_args()
    bw = copy_bandwidth()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    cases = []
    for name, (E, H, I, k) in SHAPES.items():
        gate_up = (torch.randn(E, 2 * I, H, device=dev) * 0.02).to(dt)
        down = (torch.randn(E, H, I, device=dev) * 0.02).to(dt)
        quant = {kind: (quantize_expert_weights(gate_up, kind), quantize_expert_weights(down, kind))
                 for kind in args.kinds.split(",")}
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, H, device=dev, dtype=dt)
            w, ids = route_topk(torch.randn(T, E, device=dev), top_k=k, renormalize=True)
            w = w.to(dt)
            touched = int(torch.unique(ids).numel())
            prefill = T * k >= 16 * E

            base_args = (x, gate_up, down, w, ids)
            moe_experts_routed(*base_args)
            us_bf16 = timed(lambda a=base_args: moe_experts_routed(*a), prefill)
            for kind, ((gq, gs), (dq, ds)) in quant.items():
                q = dict(gate_up_scale=gs, down_scale=ds)
                a = (x, gq, dq, w, ids)
                got = moe_experts_routed(*a, **q)
                want = moe_experts_routed(x, dequantize_experts(gq, gs, dt), dequantize_experts(dq, ds, dt), w, ids)
                us = timed(lambda a=a, q=q: moe_experts_routed(*a, **q), prefill)
                per_expert = (gq[0].numel() + dq[0].numel()) + 4 * (gs[0].numel() + ds[0].numel())
                bytes_read = touched * per_expert + 2 * T * H * 2
                if prefill:
                    flops = 2 * T * k * 3 * H * I
                    ours, metric, unit, floor = flops / us / 1e6, "routed expert products", "TFLOP/s", None
                    peers = {"same op, bf16 experts": flops / us_bf16 / 1e6}
                else:
                    ours, metric, unit = bytes_read / us / 1e6, "effective bandwidth (quantized bytes)", "TB/s"
                    floor = bw / 1e12
                    peers = {"same op, bf16 experts (at the quantized bytes)": bytes_read / us_bf16 / 1e6}
                print(f"{name} T={T} {kind}: {us:8.1f} us vs bf16 {us_bf16:8.1f} us ({us_bf16 / us:.2f}x), "
                      f"{ours:.2f} {unit}, err vs dequantized {rel_err(got, want):.1e}", flush=True)
                cases.append(case(f"routed MoE {name} (E={E} H={H} I={I} top-{k}) {kind} experts, {T} tokens",
                                  metric=metric, unit=unit, ours=ours, peers=peers, floor=floor, us=us,
                                  bf16_us=us_bf16, speedup_vs_bf16=us_bf16 / us, experts_touched=touched,
                                  floor_us=bytes_read / bw * 1e6, rel_err_vs_dequantized=rel_err(got, want)))
    write_results(args.out, "moe_quant", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
