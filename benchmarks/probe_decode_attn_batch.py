"""Decode-attention kernel configs at a large decode batch (diagnostic): batch 256, 576 keys per
sequence (the batch-256 decode step of the 8B shape), 32 q / 8 kv heads, head dim 128, page 16;
each config's time and effective KV bandwidth next to SDPA on contiguous KV and the copy bandwidth.

    python benchmarks/probe_decode_attn_batch.py --out /tmp/probe_decode_attn_batch.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, copy_bandwidth  # noqa: E402
from bench_ops import decode_inputs, rel  # noqa: E402

from infercore.devices import implementation  # noqa: E402
from infercore.ops.attention import triton_decode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=576, help="a multiple of the page (16)")
    ap.add_argument("--layouts", default="nhd",
                    help="comma list of cache layouts: nhd = [pages, page, Hk, D] (the pool's), hnd = the same "
                         "logical view over head-major storage [pages, Hk, page, D]")
    ap.add_argument("--quick", action="store_true", help="only the default tile")
    args = ap.parse_args()
    B, L, Hq, Hk, D, page = args.batch, args.ctx, 32, 8, 128, 16
    q, kc, vc, table, seq, scale, nbytes, sdpa, ref = decode_inputs(B, L, Hq, Hk, D, page)
    fn = implementation("paged_attention_decode", "triton")
    bw = copy_bandwidth()
    default = dict(triton_decode.TUNING)
    rows = []
    tiles = [(64, 4, 3), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 3), (64, 4, 4), (128, 4, 2), (128, 8, 2),
             (16, 4, 3)]  # fmt: skip
    if args.quick:
        tiles = [(default["block_n"], default["num_warps"], default["num_stages"])]
    caches = {"nhd": (kc, vc)}
    # head-major storage, viewed in the pool's axis order: the kernel reads through the strides
    caches["hnd"] = tuple(c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for c in (kc, vc))
    for layout, (bn, nw, ns), splits in itertools.product(args.layouts.split(","), tiles, [None, 1, 2]):
        kc, vc = caches[layout]
        triton_decode.TUNING.update(block_n=bn, num_warps=nw, num_stages=ns)
        call = lambda s=splits, k=kc, v=vc: fn(q, k, v, seq_lens=seq, block_table=table, scale=scale, num_splits=s)
        try:
            err = rel(call(), ref)
            t = bench_ms(call)
        except Exception as e:  # noqa: BLE001
            rows.append({"layout": layout, "block_n": bn, "num_warps": nw, "num_stages": ns, "num_splits": splits,
                         "error": type(e).__name__})  # fmt: skip
            continue
        row = {"layout": layout, "block_n": bn, "num_warps": nw, "num_stages": ns, "num_splits": splits or "auto",
               "ms": t, "TBps": nbytes / (t * 1e-3) / 1e12, "err": err}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    triton_decode.TUNING.update(default)
    t_sdpa = bench_ms(sdpa)
    out = {"name": "probe_decode_attn_batch", "device": torch.cuda.get_device_name(), "B": B, "ctx": L,
           "copy_TBps": bw / 1e12, "sdpa_ms": t_sdpa, "sdpa_TBps": nbytes / (t_sdpa * 1e-3) / 1e12,
           "default": default, "rows": rows}  # fmt: skip
    print(f"sdpa {t_sdpa:.4f} ms {out['sdpa_TBps']:.2f} TB/s; copy {bw / 1e12:.2f} TB/s")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
