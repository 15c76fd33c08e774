# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
"""MODE 9 compile variants (``wo_mma.cu`` -D switches) and launch shapes side by side: each variant is checked
against ``dequantize()`` + an fp32 matmul, then timed the way ``bench_wo_dispatch.py`` times (one CUDA graph of
many calls rotating over weight copies larger than the L2), with bf16 ``F.linear`` in the same run.

    python benchmarks/probe_mma_variants.py --out $OUT/v.json --cases int4:14336:4096 --ms 8,16 \\
        --launches 6:1:1,6:1:2 --variants ";FP8DEC=0" --layouts 8:2,7:1 --grids wave,blocks

A launch is ``STAGES:CTAS[:KSPLIT]``; a layout ``WARPS:MT`` (the repack's unit: warps x m16 tiles per warp, MT
ignored for FP8); a grid ``wave`` (the one-wave stream-K default) or ``blocks`` (one CTA per channel block where
they fit in one wave: no partial exchange). A variant with ``TIMING=1`` also reads the stamps each CTA wrote (clock64 at
the first stage's arrival, at the last segment's end before and after polling for partials, at exit; globaltimer
at entry and exit) and reports their spread; the stamp area is reset to the sentinel afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import rel_err, time_graph, write_results  # noqa: E402
from probe_mma_wo import quantize, weight_copies  # noqa: E402
from sweep_quant_wo import WORKING_SET  # noqa: E402

from infercore.quant import cuda_mma as CM  # noqa: E402
from infercore.quant import triton_wo as TW  # noqa: E402


def stamps(x, kind, pack, n, k, st, ct, ks, raw: bool = False, lay=(None, None), grid=None) -> dict:
    """One launch's per-CTA stamps (wo_mma.cu, TIMING): cycles from entry to the first stage, the last segment's
    end, the end of polling and exit, polling rounds; the spread of entry and exit times (ns). ``raw`` keeps every
    CTA's row."""
    torch.cuda.synchronize()
    CM.matmul(x, kind, *pack, n, k, stages=st, ctas=ct, ksplit=ks, warps=lay[0], mt=lay[1], grid=grid)
    torch.cuda.synchronize()
    nw, mt = CM._layout(kind, *lay)
    units = math.ceil(n / CM.block_n(kind, nw, mt)) * (k // CM.BK)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, _, occ = CM._kernel(kind, x.dtype, x.device, x.shape[0] > 8, st, ct, ks, nw, mt)
    g = CM.grid_size(units, sms, ct, occ) if grid is None else grid
    ws = CM._partials(x.device, sms * CM.MAX_CTAS_PER_SM)
    tiles = mt * (2 if x.shape[0] > 8 else 1)
    off = g * tiles * 32 * nw * 4
    t = ws[off:off + g * 16].view(torch.int64).view(g, 8).cpu()
    ws[off:off + g * 16].view(torch.int32).fill_(-1)
    torch.cuda.synchronize()
    q = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)

    def pct(v):
        return [round(float(a), 1) for a in torch.quantile(v.double(), q)]
    # raw: every CTA's [entry_ns, first, last_seg, polled, exit_ns, exit, poll rounds, first round]
    out = {"raw": t.tolist()} if raw else {}
    return {**out, "first_stage_cyc": pct(t[:, 1]), "last_seg_cyc": pct(t[:, 2]), "polled_cyc": pct(t[:, 3]),
            "exit_cyc": pct(t[:, 5]), "entry_ns": pct(t[:, 0] - t[:, 0].min()), "exit_ns": pct(t[:, 4] - t[:, 0].min()),
            "poll_rounds": pct(t[:, 6])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="int4:14336:4096,fp8:14336:4096")
    ap.add_argument("--ms", default="4,16")
    ap.add_argument("--launches", default="6:1,5:2")
    ap.add_argument("--variants", default="", help="';'-separated sets of ','-separated -D switches")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--triton", action="store_true", help="also time the dispatcher with MODE 9 off (its Triton "
                    "kernels) in the same run")
    ap.add_argument("--raw-stamps", action="store_true", help="keep every CTA's TIMING stamps in the rows")
    ap.add_argument("--layouts", default="", help="','-separated WARPS:MT unit layouts (default: cuda_mma.LAYOUT)")
    ap.add_argument("--grids", default="wave", help="','-separated: wave (stream-K) and / or blocks (one CTA per "
                    "channel block)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for cs in args.cases.split(","):
        kind, n, k = cs.split(":")
        n, k = int(n), int(k)
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda") * 0.02
        q = quantize(kind, w)
        ref_w = q.dequantize(torch.float32)
        copies = weight_copies(kind, n, k)
        layouts = [tuple(int(v) for v in la.split(":")) for la in args.layouts.split(",") if la] or [(None, None)]
        qs_all = [q] + [quantize(kind, w) for _ in range(copies - 1)]
        packs_by = {lay: [CM.repack_int4(qq, *lay) if kind == "int4" else CM.repack_fp8(qq, lay[0])
                          for qq in qs_all] for lay in layouts}
        del qs_all
        wb = [w.to(dtype) for _ in range(max(2, math.ceil(WORKING_SET / (n * k * 2))))]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda").to(dtype)
            ref = x.float() @ ref_w.T
            bf16 = time_graph(lambda i: F.linear(x, wb[i % len(wb)]), len(wb) * 8, reps=7) * 1e6
            triton_us = None
            if args.triton:
                fn = TW.wq_matmul_triton if kind == "int4" else TW.fp8_wo_matmul_triton
                qs = [q] + [quantize(kind, w) for _ in range(copies - 1)]
                CM.ENABLED = False
                for qq in qs:
                    fn(x, qq)
                triton_us = time_graph(lambda i: fn(x, qs[i % len(qs)]), len(qs) * 8, reps=7) * 1e6
                CM.ENABLED = True
                del qs
            for var, lay, gname, la in ((v, y_, gn, l_) for v in args.variants.split(";") for y_ in layouts
                                        for gn in args.grids.split(",") for l_ in args.launches.split(",")):
                CM.DEFINES = tuple(d for d in var.split(",") if d)
                packs = packs_by[lay]
                st, ct, ks = ([int(v) for v in la.split(":")] + [1])[:3]
                nbk = math.ceil(n / CM.block_n(kind, *lay))
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                if gname == "blocks" and nbk > sms * ct:
                    continue
                grid = nbk if gname == "blocks" else None
                kw = {"stages": st, "ctas": ct, "ksplit": ks, "warps": lay[0], "mt": lay[1], "grid": grid}
                row = {"case": cs, "m": m, "defines": var, "stages": st, "ctas": ct, "ksplit": ks,
                       "layout": list(CM._layout(kind, *lay)), "grid": gname, "bf16_us": bf16, "triton_us": triton_us}
                try:
                    y = CM.matmul(x, kind, *packs[0], n, k, **kw)
                    row["rel_err"] = rel_err(y.float(), ref)
                    row["us"] = time_graph(lambda i: CM.matmul(x, kind, *packs[i % len(packs)], n, k, **kw),
                                           len(packs) * 8, reps=7) * 1e6
                    row["x_bf16"] = bf16 / row["us"]
                    # again after the timed calls: now an early (programmatic) launch behind the previous call
                    ys = [CM.matmul(x, kind, *packs[0], n, k, **kw) for _ in range(3)]
                    row["rel_err_pdl"] = max(rel_err(v.float(), ref) for v in ys)
                    if "TIMING=1" in var:
                        row["stamps"] = stamps(x, kind, packs[0], n, k, st, ct, ks, args.raw_stamps, lay, grid)
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            CM.DEFINES = ()
    write_results(args.out, "probe_mma_variants", "h200", [], extra={"rows": rows})


if __name__ == "__main__":
    main()
