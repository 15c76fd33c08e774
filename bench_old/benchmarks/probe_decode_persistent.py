"""Persistent decode attention (``_decode_persistent_kernel``: each program one flat loop over its items' key
tiles) against the per-item kernel, at the decode batches where no split is taken: batch 256 at the batch-256
decode step's contexts (577 / 640 / 768 keys), batch 128, and batch 64 x 4096 keys with one split. Every
variant is timed in alternating rounds (CUDA graphs of a few calls each), next to SDPA on contiguous KV and the
copy bandwidth; each output is checked against SDPA's.

    python benchmarks/probe_decode_persistent.py --out /tmp/probe_decode_persistent.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import alternating_rounds, case, copy_bandwidth, write_results  # noqa: E402
from bench_ops import decode_inputs, rel  # noqa: E402

from infercore.ops.attention import triton_decode as td  # noqa: E402

# (programs per SM, keys per tile, warps, stages)
CONFIGS = [(2, 64, 4, 3), (2, 64, 4, 2), (3, 64, 4, 2), (1, 64, 4, 4), (2, 32, 4, 4), (3, 32, 4, 3), (4, 32, 4, 2),
           (2, 64, 8, 3), (1, 128, 8, 3)]  # fmt: skip


def variant(default: dict, persistent: bool, cfg: tuple | None = None) -> None:
    td.TUNING.update(default)
    td.TUNING["persistent"] = persistent
    if cfg:
        td.TUNING.update(persistent_per_sm=cfg[0], persistent_block_n=cfg[1], persistent_warps=cfg[2],
                         persistent_stages=cfg[3])  # fmt: skip


def run_shape(B: int, L: int, rounds: int, bw: float, default: dict, rows: list) -> dict | None:
    q, kc, vc, table, seq, scale, nbytes, sdpa, ref = decode_inputs(B, L, 32, 8, 128, 16)
    timed, errs = {}, {}

    def attend(splits=1):
        return td.paged_attention_decode(q, kc, vc, seq_lens=seq, block_table=table, scale=scale, num_splits=splits)

    labels = [("per-item", False, None)] + [(f"persistent {c}", True, c) for c in CONFIGS]
    for lab, pers, cfg in labels:
        variant(default, pers, cfg)
        try:
            errs[lab] = rel(attend(), ref)
        except Exception as e:  # noqa: BLE001
            print(f"b{B} ctx{L} {lab}: {type(e).__name__} {str(e)[:200]}", flush=True)
            continue

        def call(i, pers=pers, cfg=cfg):
            variant(default, pers, cfg)
            attend()

        timed[lab] = (call, 4)
    timed["per-item, auto splits"] = (lambda i: (variant(default, False), attend(None)), 4)
    timed["sdpa (contiguous)"] = (lambda i: sdpa(), 4)
    case_rows: list = []
    med = alternating_rounds(timed, rounds, case_rows, f"b{B} ctx{L}")
    td.TUNING.update(default)
    for r in case_rows:
        r["TBps"] = nbytes / (r["us"] * 1e-6) / 1e12
        r["err"] = errs.get(r["config"])
        print(r["case"], r["config"], f"{r['us']:.1f} us {r['TBps']:.3f} TB/s err {r['err']}", flush=True)
    rows += case_rows
    best = min((lab for lab in med if lab.startswith("persistent")), key=med.get, default=None)
    if best is None:
        return None
    return case(f"paged decode attention b{B} ctx{L} 32/8 heads d128 page16 bf16", metric="time", unit="us",
                ours=med[best], peers={"per-item kernel": med["per-item"],
                                       "per-item kernel, auto splits": med["per-item, auto splits"],
                                       "sdpa (contiguous KV)": med["sdpa (contiguous)"]},
                floor=nbytes / bw * 1e6, best_config=best, kv_bytes=nbytes,
                ours_TBps=nbytes / (med[best] * 1e-6) / 1e12, copy_TBps=bw / 1e12)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="256x577,256x640,256x768,128x640,64x4096")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    bw = copy_bandwidth()
    default = dict(td.TUNING)
    cases, rows = [], []
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        row = run_shape(B, L, args.rounds, bw, default, rows)
        if row is not None:
            cases.append(row)
        torch.cuda.empty_cache()
    write_results(args.out, "probe_decode_persistent", torch.cuda.get_device_name(), cases,
                  extra={"rows": rows, "configs": CONFIGS})


if __name__ == "__main__":
    main()
