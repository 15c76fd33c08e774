"""MLA decode (DeepSeek, absorbed form) over the paged latent cache: the Triton MLA kernel against peers in the same
run, and the copy-bandwidth floor.

Peers: torch eager absorbed attention on a contiguous latent (``q @ kv^T``, softmax, ``@ c_kv``: what a plain
implementation runs), and the generic paged decode kernel with the latent cache as K and V (expected to exceed the
GPU's shared memory at the 576-wide latent; its error is recorded). Metric: TB/s of latent read
(``B * L * 576 * 2`` bytes per call), floor: the measured copy bandwidth. A tile sweep over the kernel's launch
knobs runs first at two shapes; its best config is reported beside the default.

    python benchmarks/bench_mla_decode.py [--out benchmarks/results/h200/mla_decode.json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, copy_bandwidth, rel_err, write_results  # noqa: E402

from infercore.devices import capability  # noqa: E402
from infercore.ops.attention import triton_decode as td  # noqa: E402
from infercore.ops.attention import triton_mla as tm  # noqa: E402
from infercore.ops.attention.mla import paged_mla_decode_ref  # noqa: E402

R, P, PAGE = 512, 64, 16


def make(H: int, B: int, L: int):
    n = B * (L // PAGE + 1) + 8
    cache = torch.randn(n, PAGE, 1, R + P, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(n, device="cuda")[: B * (L // PAGE + 1)].view(B, -1).to(torch.int32)
    q = torch.randn(B, H, R + P, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, cache, lens, table


def eager_peer(q, cache, lens, table, scale):
    """torch eager on a contiguous latent [B, L, 576] (gathered once, outside the timing)."""
    B, L = q.shape[0], int(lens[0])
    kv = cache[table.long()].view(B, -1, R + P)[:, :L]

    def run():
        s = torch.bmm(q, kv.transpose(1, 2)).float() * scale
        return torch.bmm(torch.softmax(s, dim=-1).to(q.dtype), kv[..., :R])

    return run


def mla_call(q, cache, lens, table, scale, cfg=None):
    return lambda: tm.paged_mla_decode(q, cache, seq_lens=lens, block_table=table, scale=scale, kv_lora_rank=R,
                                       config=cfg)  # fmt: skip


def sweep_shape(H: int, B: int, L: int, grid: list[dict], scale: float, rows: list[dict]) -> dict | None:
    q, cache, lens, table = make(H, B, L)
    nbytes = B * L * (R + P) * 2
    best = None
    for cfg in grid:
        if cfg["block_h"] > 16 and H <= 16:
            continue
        try:
            ms = bench_ms(mla_call(q, cache, lens, table, scale, cfg), warmup=5, rep=30)
        except Exception as e:  # noqa: BLE001 (configs past the GPU's resources are part of the sweep)
            rows.append({"H": H, "B": B, "L": L, **cfg, "error": type(e).__name__})
            continue
        rows.append({"H": H, "B": B, "L": L, **cfg, "us": ms * 1e3, "tbps": nbytes / (ms * 1e-3) / 1e12})
        if best is None or ms < best[0]:
            best = (ms, cfg)
    print(f"sweep H={H} B={B} L={L}: best {best}", flush=True)
    return best[1] if best else None


def measure(H: int, B: int, L: int, scale: float, floor_tbps: float, best_cfg: dict | None) -> dict:
    q, cache, lens, table = make(H, B, L)
    nbytes = B * L * (R + P) * 2
    ref = paged_mla_decode_ref(q.float(), cache.float(), seq_lens=lens, block_table=table, scale=scale,
                               kv_lora_rank=R)  # fmt: skip
    ours = mla_call(q, cache, lens, table, scale)
    err = rel_err(ours(), ref)
    t_ours = bench_ms(ours)
    peers, notes = {}, {}
    t_eager = bench_ms(eager_peer(q, cache, lens, table, scale))
    peers["torch eager (contiguous latent)"] = nbytes / (t_eager * 1e-3) / 1e12

    def generic():
        return td.paged_attention_decode(q, cache, cache, seq_lens=lens, block_table=table, scale=scale)

    try:
        generic()
        peers["generic paged decode kernel (K = V = latent)"] = nbytes / (bench_ms(generic) * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 (a shape the generic kernel cannot compile is the finding)
        notes["generic_kernel_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    extra = {}
    if best_cfg:
        t_best = bench_ms(mla_call(q, cache, lens, table, scale, best_cfg))
        extra = {"best_sweep_config": best_cfg, "best_sweep_tbps": nbytes / (t_best * 1e-3) / 1e12}
    tbps = nbytes / (t_ours * 1e-3) / 1e12
    print(f"H={H} B={B} L={L}: {t_ours * 1e3:.1f} us {tbps:.2f} TB/s err {err:.1e} peers "
          f"{ {k: round(v, 2) for k, v in peers.items()} } {notes} {extra}", flush=True)
    return case(f"MLA decode H={H} B={B} ctx={L} (latent 512+64, page {PAGE}, bf16)", metric="latent read",
                unit="TB/s", ours=tbps, peers=peers, floor=floor_tbps, us=t_ours * 1e3, rel_err=err, **notes,
                **extra)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/mla_decode.json")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    scale = 192**-0.5
    floor_tbps = copy_bandwidth() / 1e12
    print(f"copy bandwidth {floor_tbps:.3f} TB/s", flush=True)
    sweep_rows, best_cfg = [], {}
    if not args.no_sweep:
        grid = [dict(block_h=h, block_n=n, num_warps=w, num_stages=s)
                for h, n, w, s in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (2, 3))]  # fmt: skip
        for H, B, L in ((128, 64, 4096), (16, 64, 4096)):
            best_cfg[(H, B, L)] = sweep_shape(H, B, L, grid, scale, sweep_rows)
            torch.cuda.empty_cache()
    cases = []
    shapes = ((128, 64, 4096), (16, 64, 4096), (128, 1, 4096), (128, 16, 4096), (128, 128, 2048), (128, 64, 16384),
              (16, 1, 4096), (16, 256, 2048))
    for H, B, L in shapes:
        cases.append(measure(H, B, L, scale, floor_tbps, best_cfg.get((H, B, L))))
        torch.cuda.empty_cache()
        # after every case: a run stopped by the device's time limit keeps what it measured
        write_results(args.out, "mla_decode", capability("cuda").name, cases,
                      {"copy_bandwidth_tbps": floor_tbps, "default_configs": [tm.TUNING, tm.TUNING_WIDE],
                       "sweep": sweep_rows,
                       "best_configs": {f"H{k[0]}_B{k[1]}_L{k[2]}": v for k, v in best_cfg.items()}})  # fmt: skip


if __name__ == "__main__":
    main()
