"""Multi-LoRA shrink + expand at the 8B Llama projection shapes, by batch.

Ours: ``ops.lora_shrink`` then ``ops.lora_expand_`` (Triton) as the engine calls them, the step's tokens sorted
by slot once on the host (``order``): the per-token BGMV kernels, or the grouped ones from
``ops.lora.triton.GROUPED_MIN_TOKENS`` tokens when that is set. ``grouped_graph_us``: the grouped kernels (tiles of
tokens per adapter, tensor-core products) asked for at every size, beside them. Peer in the same run: torch
gathering each token's adapter (``a[indices]``, ``b[indices]``) then ``torch.bmm`` (one per slice for the expand).
Shapes: K = 4096; qkv N = 6144 with slices (4096, 1024, 1024);
gate_up N = 28672 with slices (14336, 14336); S = 8 slots, rank 16, tokens spread over the slots (``t % S``).

Metric: effective bandwidth = the bytes the update must move (the distinct adapters' A and B read once, x
read, y read and written) / time, against the copy bandwidth measured here (the floor in time is those
bytes over it). Times: one CUDA graph of 16 calls rotating over weight copies larger than the L2, so launch
gaps are gone and every call reads its adapters from HBM, as the layers of a model do (``graph_us``);
``eager_us``: ``do_bench`` medians of single eager calls (L2 flushed), bound by the host's launch cost.

    python benchmarks/bench_lora.py --out benchmarks/results/h200/lora.json     # H200, ~1 min
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, copy_bandwidth, rel_err, time_graph, write_results  # noqa: E402

from infercore.devices import implementation  # noqa: E402
from infercore.ops import lora_expand_, lora_shrink  # noqa: E402
from infercore.ops.lora import triton as lora_triton  # noqa: E402

GROUPED = lora_triton.GROUPED_MIN_TOKENS

K = 4096
SHAPES = {"qkv": (6144, (4096, 5120)), "gate_up": (28672, (14336,))}
L2_SPAN = 256 << 20  # weight bytes the graph timing rotates over: several times any GPU's L2


def torch_peer(y, x, a, b, idx, bounds):
    """Gather every token's adapter, then batched GEMVs (cuBLAS): what plain torch does without a kernel."""
    r = b.shape[2]
    s = torch.bmm(a[idx], x.unsqueeze(-1))  # [T, R, 1]
    bg = b[idx]  # [T, N, r]
    edges = (0, *bounds, y.shape[1])
    for j, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        y[:, lo:hi] += torch.bmm(bg[:, lo:hi], s[:, j * r : (j + 1) * r]).squeeze(-1)
    return y


def ours(y, x, a, b, idx, bounds, order=None):
    """The public ops as the engine calls them: the step's slot order sorted once on the host and passed in."""
    return lora_expand_(y, lora_shrink(x, a, idx, order=order), b, idx, slice_bounds=bounds, order=order)


def grouped(y, x, a, b, idx, bounds, order):
    """Our grouped (SGMV) kernels, asked for at every size (by default they run from GROUPED_MIN_TOKENS tokens)."""
    s = lora_triton.lora_shrink(x, a, idx, grouped=True, order=order)
    return lora_triton.lora_expand_(y, s, b, idx, slice_bounds=bounds, grouped=True, order=order)


def measure(proj: str, N: int, bounds: tuple[int, ...], T: int, ws: list, S: int, r: int, bw: float) -> dict:
    """One case: ``ws`` holds the weight copies ``(a, b)`` the graph timing rotates over."""
    dev, dt = "cuda", torch.bfloat16
    a, b = ws[0]
    x = torch.randn(T, K, device=dev, dtype=dt)
    y = (torch.randn(T, N, device=dev) * 0.1).to(dt)
    idx = torch.arange(T, device=dev, dtype=torch.int32) % S
    order = torch.argsort(idx.cpu(), stable=True).to(dev)
    distinct = min(T, S)
    nbytes = distinct * (a[0].numel() + b[0].numel()) * 2 + T * K * 2 + 2 * T * N * 2
    floor_us = nbytes / bw * 1e6
    # correctness on this shape: both against the fp32 reference
    s_ref = implementation("lora_shrink", "reference")(x.float(), a.float(), idx)
    want = implementation("lora_expand_", "reference")(y.float(), s_ref, b.float(), idx, slice_bounds=bounds)
    err = rel_err(ours(y.clone(), x, a, b, idx, bounds, order), want)
    err_grouped = rel_err(grouped(y.clone(), x, a, b, idx, bounds, order), want)
    err_peer = rel_err(torch_peer(y.clone(), x, a, b, idx, bounds), want)
    us = bench_ms(lambda: ours(y, x, a, b, idx, bounds, order)) * 1e3
    peer_us = bench_ms(lambda: torch_peer(y, x, a, b, idx, bounds)) * 1e3
    g_us = time_graph(lambda i: ours(y, x, *ws[i % len(ws)], idx, bounds, order), 16) * 1e6
    g_grouped_us = time_graph(lambda i: grouped(y, x, *ws[i % len(ws)], idx, bounds, order), 16) * 1e6
    g_peer_us = time_graph(lambda i: torch_peer(y, x, *ws[i % len(ws)], idx, bounds), 16) * 1e6
    print(f"{proj:7s} T={T:4d}: ours graph {g_us:6.1f} us (eager {us:6.1f})  grouped graph {g_grouped_us:6.1f}  "
          f"torch gather+bmm graph {g_peer_us:6.1f} (eager {peer_us:6.1f})  floor {floor_us:6.2f} us  "
          f"rel err {err:.1e} / grouped {err_grouped:.1e} / peer {err_peer:.1e}", flush=True)  # fmt: skip
    tbps = lambda t_us: nbytes / (t_us * 1e-6) / 1e12  # noqa: E731
    return case(
        f"LoRA shrink+expand {proj} K={K} N={N} slices={len(bounds) + 1} rank={r} S={S}, {T} tokens",
        metric="effective bandwidth (in a CUDA graph)", unit="TB/s", ours=tbps(g_us),
        peers={"torch gather+bmm": tbps(g_peer_us)}, floor=bw / 1e12, graph_us=g_us,
        peers_graph_us={"torch gather+bmm": g_peer_us}, grouped_graph_us=g_grouped_us,
        grouped_TBps=tbps(g_grouped_us),
        floor_us=floor_us, bytes=nbytes, eager_us=us, peers_eager_us={"torch gather+bmm": peer_us},
        graph_weight_copies=len(ws), adapters_touched=distinct,
        kernels="grouped" if GROUPED is not None and T >= GROUPED else "bgmv",
        rel_err_vs_ref=err, grouped_rel_err_vs_ref=err_grouped, peer_rel_err_vs_ref=err_peer,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON path")
    ap.add_argument("--batches", default="1,16,64,256", help="token counts, comma-separated")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8, help="adapter slots S")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_lora: needs a CUDA GPU")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    dev, dt, S, r = "cuda", torch.bfloat16, args.slots, args.rank
    torch.manual_seed(0)
    cases = []
    for proj, (N, bounds) in SHAPES.items():
        R = (len(bounds) + 1) * r
        copies = max(1, min(16, L2_SPAN // (S * (R * K + N * r) * 2)))
        ws = [((torch.randn(S, R, K, device=dev) * K**-0.5).to(dt), (torch.randn(S, N, r, device=dev) * r**-0.5).to(dt))
              for _ in range(copies)]  # fmt: skip
        for T in (int(t) for t in args.batches.split(",")):
            cases.append(measure(proj, N, bounds, T, ws, S, r, bw))
        del ws
    write_results(args.out, "bench_lora", torch.cuda.get_device_name(), cases, extra={"copy_bandwidth_Bps": bw})


if __name__ == "__main__":
    main()
