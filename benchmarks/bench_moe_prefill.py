"""Routed MoE experts at prefill sizes (hundreds of rows per expert): compute-bound grouped GEMMs.

Ours: ``ops.moe_experts_routed`` (Triton, pairs sorted by expert on the device) in its two grouped forms: a program
per (block of an expert's rows, tile) -- the form taken from ``MBLOCK_MIN_ROWS`` rows per expert on -- and a program
per (expert, tile) walking all of its expert's rows in 16-row chunks (the form below it, which served prefill before).
Peer in the same run: ``torch._grouped_mm`` over the same sorted pairs (transformers' ``grouped_mm`` experts path:
gather, gate/up grouped GEMM, SiLU-and-mul, down grouped GEMM, scale, scatter-add). Reference ceiling: a dense cuBLAS
GEMM of the same FLOPs (``[P, H] x [H, 2I]`` then ``[P, I] x [I, H]``), i.e. the tensor-core rate this GPU reaches on
plain GEMMs of these sizes. Metric: TFLOP/s of the routed products (2 * P * 3 * H * I).

    python benchmarks/bench_moe_prefill.py --out $OUT/moe_prefill.json [--sweep]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, rel_err, write_results  # noqa: E402

from infercore.models.moe import route_topk  # noqa: E402
from infercore.ops import moe_experts_routed  # noqa: E402
from infercore.ops.moe import triton as moe_triton  # noqa: E402

SHAPES = {  # name: (E, H, I, top_k)
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
SWEEP = {
    "gate_up": [(128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 8, 4),
                (64, 64, 64, 4, 4)],
    "down": [(128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 4),
             (128, 256, 64, 8, 3)],
}  # fmt: skip


def grouped_mm_experts(x, gate_up, down, w, ids):
    """transformers' grouped_mm experts form over pairs sorted by expert (torch._grouped_mm, bf16)."""
    T, k = ids.shape
    E = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x.index_select(0, order // k)
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=offs)
    y = y * w.reshape(-1)[order, None]
    return torch.zeros(T, x.shape[1], dtype=y.dtype, device=x.device).index_add_(0, order // k, y)


def timed_ours(args, min_rows):
    old = moe_triton.MBLOCK_MIN_ROWS
    moe_triton.MBLOCK_MIN_ROWS = min_rows
    try:
        out = moe_experts_routed(*args)
        return bench_ms(lambda: moe_experts_routed(*args)), out
    finally:
        moe_triton.MBLOCK_MIN_ROWS = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="512,2048,4096,8192")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="time each tile configuration of SWEEP (4096 tokens)")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    cases, sweep = [], []
    for name in args.shapes.split(","):
        E, H, I, k = SHAPES[name]
        gate_up = (torch.randn(E, 2 * I, H, device=dev) * 0.02).to(dt)
        down = (torch.randn(E, H, I, device=dev) * 0.02).to(dt)
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, H, device=dev, dtype=dt)
            w, ids = route_topk(torch.randn(T, E, device=dev), top_k=k, renormalize=True)
            w = w.to(dt)
            P = T * k
            flops = 2 * P * 3 * H * I
            tf = lambda ms, f=flops: f / (ms * 1e-3) / 1e12  # noqa: E731
            a = (x, gate_up, down, w, ids)
            ms_block, out_block = timed_ours(a, 0)
            ms_loop, out_loop = timed_ours(a, 10**9)
            peers, errs = {}, {}
            try:
                ref = grouped_mm_experts(*a)
                peers["torch._grouped_mm (transformers grouped_mm)"] = tf(bench_ms(lambda a=a: grouped_mm_experts(*a)))
                errs = {"rel_err_vs_grouped_mm": rel_err(out_block, ref), "loop_rel_err": rel_err(out_loop, ref)}
            except Exception as e:  # noqa: BLE001 - keep our figures if the peer cannot run here
                errs = {"grouped_mm_error": f"{type(e).__name__}: {e}"[:300]}
            xa = torch.randn(P, H, device=dev, dtype=dt)
            wa = torch.randn(H, 2 * I, device=dev, dtype=dt)
            xb = torch.randn(P, I, device=dev, dtype=dt)
            wb = torch.randn(I, H, device=dev, dtype=dt)
            dense = tf(bench_ms(lambda m=(xa, wa, xb, wb): (m[0] @ m[1], m[2] @ m[3])))
            print(f"{name} T={T}: row blocks {tf(ms_block):6.1f} TFLOP/s ({ms_block * 1e3:8.1f} us), "
                  f"expert loop {tf(ms_loop):6.1f}, "
                  f"peers {({n: round(v, 1) for n, v in peers.items()})}, dense cuBLAS {dense:.1f}, {errs}", flush=True)
            cases.append(case(f"routed MoE {name} (E={E} H={H} I={I} top-{k}) prefill {T} tokens bf16",
                              metric="routed expert products", unit="TFLOP/s", ours=tf(ms_block), peers=peers,
                              floor=dense, floor_kind="dense cuBLAS GEMMs of the same FLOPs", us=ms_block * 1e3,
                              expert_loop_form_tflops=tf(ms_loop), expert_loop_form_us=ms_loop * 1e3,
                              rows_per_expert=P / E, **errs))  # fmt: skip
            if args.sweep and T == 4096:
                base = dict(moe_triton._MBLOCK_CFG)
                for kern, cfgs in SWEEP.items():
                    for cfg in cfgs:
                        moe_triton._MBLOCK_CFG = {**base, kern: cfg}
                        try:
                            ms, _ = timed_ours(a, 0)
                            sweep.append({"shape": name, "tokens": T, "kernel": kern, "cfg": cfg, "us": ms * 1e3})
                            print(f"  sweep {kern} {cfg}: {ms * 1e3:.1f} us", flush=True)
                        except Exception as e:  # noqa: BLE001 - a tile past shared memory: note it, go on
                            sweep.append({"shape": name, "tokens": T, "kernel": kern, "cfg": cfg,
                                          "error": f"{type(e).__name__}"})  # fmt: skip
                moe_triton._MBLOCK_CFG = base
    write_results(args.out, "moe_prefill", torch.cuda.get_device_name(), cases, {"sweep": sweep} if sweep else None)


if __name__ == "__main__":
    main()
