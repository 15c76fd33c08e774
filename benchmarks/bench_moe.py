"""Routed MoE experts at the Qwen3-Next-80B expert shape (E=512, H=2048, I=512, top-10), by batch.

Ours: ``ops.moe_experts_routed`` (Triton grouped GEMM over the pairs sorted by expert on the device,
CUDA-graph timed). Peers in the same run: the dense form (every expert on every token, two bmm, also
graph-timed) and the grouped form (cuBLAS GEMMs per active expert after one host sync; eager
``do_bench``). Metric: effective bandwidth = bytes of the experts the batch routes to (each read
once) / time, against the copy bandwidth measured here (the floor in time is those bytes over it).

    python benchmarks/bench_moe.py --out $OUT/moe.json      # H200, ~30 s
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, copy_bandwidth, time_graph, write_results  # noqa: E402

from infercore.models.moe import moe_experts_dense, moe_experts_grouped, route_topk  # noqa: E402
from infercore.ops import moe_experts_routed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,16,64,256,1024")
    args = ap.parse_args()
    bw = copy_bandwidth()
    torch.manual_seed(0)
    E, H, I, k = 512, 2048, 512, 10
    dev, dt = "cuda", torch.bfloat16
    gate_up = (torch.randn(E, 2 * I, H, device=dev) * 0.02).to(dt)
    down = (torch.randn(E, H, I, device=dev) * 0.02).to(dt)
    expert_bytes = (2 * I * H + H * I) * 2
    cases = []
    for T in (int(b) for b in args.batches.split(",")):
        x = torch.randn(T, H, device=dev, dtype=dt)
        w, ids = route_topk(torch.randn(T, E, device=dev), top_k=k, renormalize=True)
        w = w.to(dt)
        touched = int(torch.unique(ids).numel())
        floor_us = (touched * expert_bytes + 2 * T * H * 2) / bw * 1e6
        ref = moe_experts_grouped(x, gate_up, down, w, ids)
        ours_out = moe_experts_routed(x, gate_up, down, w, ids)
        err = float((ours_out.float() - ref.float()).norm() / ref.float().norm())
        args3 = (x, gate_up, down, w, ids)
        us = time_graph(lambda i, a=args3: moe_experts_routed(*a), 8, reps=7, warmup=1) * 1e6
        moe_experts_dense(*args3)
        dense_us = time_graph(lambda i, a=args3: moe_experts_dense(*a), 4, reps=5, warmup=1) * 1e6
        grouped_us = bench_ms(lambda a=args3: moe_experts_grouped(*a)) * 1e3
        print(f"T={T:4d} experts touched {touched:3d}: routed {us:8.1f} us  dense {dense_us:9.1f} us  "
              f"grouped {grouped_us:8.1f} us  floor {floor_us:7.1f} us  rel err {err:.2e}", flush=True)
        tbps = lambda t_us, b=touched * expert_bytes: b / (t_us * 1e-6) / 1e12  # noqa: E731
        cases.append(case(f"routed MoE E=512 H=2048 I=512 top-10, {T} tokens", metric="effective bandwidth",
                          unit="TB/s", ours=tbps(us),
                          peers={"dense (bmm)": tbps(dense_us), "grouped (cuBLAS per expert)": tbps(grouped_us)},
                          floor=bw / 1e12, us=us, peers_us={"dense (bmm)": dense_us, "grouped": grouped_us},
                          floor_us=floor_us, experts_touched=touched, rel_err_vs_grouped=err))
    write_results(args.out, "bench_moe", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
