"""Does the order of a sequence's KV pages in the pool change the paged decode attention's speed? (diagnostic for
the batch-256 decode target: in the engine's step the kernel reads ~3.6-3.7 TB/s, in the probes over a pool holding
only the batch's pages 3.75-4.15 TB/s.)

Batch 256 x ``--ctx`` keys, 32 q / 8 kv heads, head dim 128, page 16, bf16; the same keys and values laid out as:

- ``contiguous``: each sequence's pages consecutive, the sequences one after another (a pool of exactly the batch);
- ``shuffled``: a random permutation of that pool (the ops benchmark's layout);
- ``engine``: the first 512 tokens' pages consecutive per sequence (a prompt admitted at once), each later page of
  every sequence taken in turn (decode growth), as a FIFO free list hands them out;
- ``scattered_xN``: the batch's pages at random places of a pool N times larger (a long-running engine's pool, whose
  free list has been shuffled by earlier requests);
- ``spread_xN``: ``engine``'s order, but over a pool N times larger, every N-th page (the same order, spread out).

Each layout is timed in alternating rounds (median of do_bench medians), with SDPA on contiguous KV and the copy
bandwidth in the same run.

    python benchmarks/probe_decode_page_order.py --out $OUT/probe_decode_page_order.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, copy_bandwidth  # noqa: E402

from infercore.devices import implementation  # noqa: E402


def tables(B: int, n_pages: int, prompt_pages: int, scale: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Block tables ``[B, n_pages]`` (int64, on the CPU) per layout; a table's pages index a pool of
    ``B * n_pages * factor`` pages (factor 1 unless the name ends in ``_x{scale}``)."""
    n = B * n_pages
    out = {"contiguous": torch.arange(n).view(B, n_pages)}
    out["shuffled"] = torch.randperm(n, generator=gen).view(B, n_pages)
    eng = torch.empty(B, n_pages, dtype=torch.long)
    eng[:, :prompt_pages] = torch.arange(B * prompt_pages).view(B, prompt_pages)
    rest = n_pages - prompt_pages
    eng[:, prompt_pages:] = B * prompt_pages + torch.arange(B * rest).view(rest, B).t()
    out["engine"] = eng
    out[f"scattered_x{scale}"] = torch.randperm(n * scale, generator=gen)[:n].view(B, n_pages)
    out[f"spread_x{scale}"] = eng * scale
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=640, help="keys per sequence, a multiple of the page (16)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--scale", type=int, default=8, help="pool size factor of the scattered / spread layouts")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    B, L, Hq, Hk, D, page = args.batch, args.ctx, 32, 8, 128, 16
    dev, bf16 = "cuda", torch.bfloat16
    n_pages = L // page
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, D, device=dev, dtype=bf16)
    k = torch.randn(B, Hk, L, D, device=dev, dtype=bf16)
    v = torch.randn(B, Hk, L, D, device=dev, dtype=bf16)
    seq = torch.full((B,), L, device=dev, dtype=torch.int32)
    scale = D**-0.5
    ref = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True).squeeze(2)
    kp = k.permute(0, 2, 1, 3).reshape(B * n_pages, page, Hk, D)  # sequence-major pages
    vp = v.permute(0, 2, 1, 3).reshape(B * n_pages, page, Hk, D)
    fn = implementation("paged_attention_decode", "triton")
    cases = {}
    for name, tab in tables(B, n_pages, args.prompt // page, args.scale, gen).items():
        pool = int(tab.max()) + 1
        pool = max(pool, B * n_pages * (args.scale if name.endswith(f"_x{args.scale}") else 1))
        kc = torch.zeros(pool, page, Hk, D, device=dev, dtype=bf16)
        vc = torch.zeros_like(kc)
        idx = tab.reshape(-1).to(dev)
        kc[idx], vc[idx] = kp, vp
        table = tab.to(dev, torch.int32)
        call = (lambda kc=kc, vc=vc, table=table:
                fn(q, kc, vc, seq_lens=seq, block_table=table, scale=scale))  # fmt: skip
        err = float(((call().float() - ref.float()).norm() / ref.float().norm()).item())
        cases[name] = (call, err, pool, (kc, vc))
    sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)  # noqa: E731
    times: dict[str, list[float]] = {name: [] for name in [*cases, "sdpa"]}
    for _ in range(args.rounds):
        for name, (call, *_rest) in cases.items():
            times[name].append(bench_ms(call))
        times["sdpa"].append(bench_ms(sdpa))
    nbytes = 2 * B * Hk * L * D * 2
    bw = copy_bandwidth()
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts)
        row = {"layout": name, "ms": ms, "TBps": nbytes / (ms * 1e-3) / 1e12, "ms_rounds": ts}
        if name in cases:
            row.update(rel_err=cases[name][1], pool_pages=cases[name][2])
        rows.append(row)
        print(row, flush=True)
    out = {"name": "probe_decode_page_order", "device": torch.cuda.get_device_name(),
           "command": "python benchmarks/probe_decode_page_order.py " + " ".join(sys.argv[1:]),
           "B": B, "ctx": L, "page": page, "copy_TBps": bw / 1e12, "kv_bytes": nbytes, "rows": rows}  # fmt: skip
    print(f"copy {bw / 1e12:.2f} TB/s")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
