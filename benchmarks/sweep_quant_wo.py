"""Weight-only quantized small-M sweep: W4A16 g128 and emulated FP8 kernels x configs vs peers.

For the Llama-3.1-8B linear shapes and decode M = 1, 4, 16 (the table's buckets 2 and 8 borrow 4 and 16),
every config of ``triton_wo``'s small-M kernels is first checked against ``dequantize()`` + an fp32
matmul (relative error < 1e-2), then timed in a CUDA graph of many calls that rotates over enough
weight copies (>= 256 MB, the H200 L2 is 60 MB) that weights stream from HBM as in decode.
Peers in the same run, timed the same way: bf16 ``F.linear`` (cuBLAS), torch tinygemm INT4 g128
(``_weight_int4pack_mm``); the floor is the bytes moved / the copy bandwidth measured here.
A second stage re-times each best config with every split-K factor (no recompiles).

    python benchmarks/sweep_quant_wo.py --out $OUT/sweep_quant_wo.json     # H200, <= 120 s
    python benchmarks/sweep_quant_wo.py --smoke --out /tmp/sq.json        # CPU interpreter, tiny

The JSON holds every row, CONVENTIONS cases (best config per kernel/shape/M, effective TFLOP/s)
and ``best``: ``"kind,N,K,M": {config, us, ...}``; ``table`` is the same as Python literal lines
to paste into ``SMALL_M_TUNED`` in ``src/infercore/quant/wo_tables.py``.
"""

# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, time_graph, write_results  # noqa: E402

from infercore.quant import FP8Weight, IntWeight  # noqa: E402
from infercore.quant import triton_wo as TW  # noqa: E402

SHAPES = {"gate_up/2 (14336x4096)": (14336, 4096), "qkv (6144x4096)": (6144, 4096),
          "o_proj (4096x4096)": (4096, 4096), "gate_up (28672x4096)": (28672, 4096),
          "down (4096x14336)": (4096, 14336)}
MS = {"int4": (1, 4, 16), "fp8": (1, 4, 16)}  # buckets 2 and 8 borrow the next larger entry
WORKING_SET = 256 << 20


def _c(mode, bn, bk, warps, stages=1):
    return {"MODE": mode, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


# Candidate configs (SPLIT from the heuristic, refined in stage 2 without recompiling). MODE 4 is
# the interleaved-word streaming GEMV (M <= 4; BLOCK_K codes per tile across groups);
# MODEs 1/2 are the tensor-core tiles for M = 16; MODE 5 the tensor-core tiles over the stored words.
# A tight grid: the H200 run must stay < 240 s.
def _c4(bn, bk, warps, stages):
    return {"MODE": 4, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


def _c5(bn, bk, warps, stages):
    return {"MODE": 5, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


# (stages 1: weights load straight into registers, no shared-memory pipeline; measured best on some shapes)
_W5 = {"int4": [_c5(128, 128, 4, 3), _c5(128, 128, 4, 1), _c5(64, 128, 4, 1), _c5(64, 128, 4, 3)],
       "fp8": [_c5(128, 128, 4, 3), _c5(128, 256, 4, 3), _c5(64, 128, 4, 1), _c5(128, 128, 4, 1)]}
CONFIGS = {
    ("int4", 1): [_c4(4, 2048, 2, 2), _c4(4, 4096, 4, 1), *_W5["int4"]],
    ("int4", 16): _W5["int4"],
    ("fp8", 1): [_c4(4, 2048, 4, 2), _c4(4, 1024, 2, 2), *_W5["fp8"]],
    ("fp8", 16): _W5["fp8"],
}
# M = 4: MODE 4's best tile and the MODE 5 tiles (whose cost does not grow with M up to 16).
CONFIGS_M4 = {"int4": [_c4(4, 2048, 4, 2), *_W5["int4"]], "fp8": [_c4(4, 1024, 4, 2), *_W5["fp8"]]}
SMOKE_CONFIGS = [_c4(8, 256, 4, 2), _c(2, 16, 64, 4), _c5(16, 64, 4, 1)]


def wide_mode5(kind: str) -> list[dict]:
    """A wider MODE 5 grid (``--grid wide``): narrow and wide channel tiles, long K steps (FP8 per-channel
    scales allow any; INT4 steps stay inside a 128-code group), 4 or 8 warps, 1-4 stages. Tiles over
    32 KB of codes per 4 warps are left out (registers)."""
    bks = (256, 512, 1024) if kind == "fp8" else (64, 128)
    out = []
    for bn in (16, 32, 64, 128, 256):
        for bk in bks:
            for warps in (4, 8):
                if bn * bk // (1 if kind == "fp8" else 2) > 8192 * warps:
                    continue
                out += [_c5(bn, bk, warps, st) for st in (1, 2, 3, 4)]
    return out


# ``--grid packed``: MODE 4 tiles with the packed fp16 dot (``triton_wo.PACKED_DOT``; at one INT4 row with the
# fp32 path too). The per-thread step needs BLOCK_K >= 1024 (INT4) / 512 (FP8) codes x warps.
_PACKED_BASE = [(4, 2048, 2, 2), (4, 2048, 2, 1), (4, 4096, 4, 1), (4, 4096, 4, 2), (8, 2048, 2, 2), (8, 4096, 4, 1),
                (2, 4096, 4, 1), (16, 2048, 2, 2), (4, 1024, 1, 2), (8, 1024, 1, 2), (8, 1024, 1, 1)]
_PACKED_ROWS = {"int4": [(4, 2048, 2, 2), (8, 2048, 2, 2), (4, 1024, 1, 2), (2, 2048, 2, 2), (8, 1024, 1, 2)],
                "fp8": [(4, 2048, 4, 2), (8, 2048, 4, 2), (4, 1024, 2, 2), (8, 1024, 2, 2)]}


def packed_mode4(kind: str, m: int = 1) -> list[dict]:
    if kind == "int4" and m == 1:
        return [{**_c4(*t), "PACKED": p} for t in _PACKED_BASE for p in (False, True)]
    return [{**_c4(*t), "PACKED": True} for t in _PACKED_ROWS[kind]]


def configs_for(kind: str, m: int, smoke: bool, grid: str = "default") -> list[dict]:
    if grid == "wide" and not smoke:
        return wide_mode5(kind)
    if grid == "packed" and not smoke:
        return packed_mode4(kind, m)
    if smoke:
        return SMOKE_CONFIGS if m <= 4 else SMOKE_CONFIGS[1:]
    if m == 1:
        return list(CONFIGS[(kind, 1)])
    if m <= 4:
        return list(CONFIGS_M4[kind])
    return list(CONFIGS[(kind, 16)])


def time_eager(calls, n_calls: int) -> float:
    t = time.perf_counter()
    for i in range(n_calls):
        calls(i)
    return (time.perf_counter() - t) / n_calls


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device copy, timed eagerly with do_bench: in a
    CUDA graph the copy runs on the copy engine (2.7 TB/s on the H200), not the SMs (4.25 TB/s)."""
    from triton.testing import do_bench

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    t_ms = do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    bw = 2 * a.numel() / (t_ms * 1e-3)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    return bw


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def make_weights(kind: str, w: torch.Tensor, copies: int):
    if kind == "int4":
        q = IntWeight.quantize(w, bits=4, group_size=128, clip_search=False)
        fn = TW.wq_matmul_triton
    else:
        q = FP8Weight.quantize(w)
        fn = TW.fp8_wo_matmul_triton
    qs = [q] + [dataclasses.replace(q, **{k: v.clone() for k, v in q.tensors().items()})
                for _ in range(copies - 1)]
    nbytes = sum(t.numel() * t.element_size() for t in q.tensors().values())
    return q, qs, fn, nbytes


def bf16_copies(w: torch.Tensor, at_least: int = 1) -> list[torch.Tensor]:
    """``w`` in bf16 and enough clones (> WORKING_SET bytes in all) that calls cycling through them read the
    weights from HBM, not the L2."""
    w16 = w.to(torch.bfloat16)
    n = max(at_least, math.ceil(WORKING_SET / (w16.numel() * 2)))
    return [w16] + [w16.clone() for _ in range(n - 1)]


def quant_copies(kind: str, w: torch.Tensor, at_least: int = 1):
    """``make_weights(kind, w, copies)`` with enough copies (> WORKING_SET bytes of codes) for the same."""
    n, k = w.shape
    return make_weights(kind, w, max(at_least, math.ceil(WORKING_SET / (n * k // (2 if kind == "int4" else 1)))))


def weight_cases(shapes: dict, ms, at_least: int = 1, kinds=("int4", "fp8")):
    """The loop the weight-only benchmarks share (seeded once, 0): for each shape ``(n, k)``, kind and row
    count ``m``, a namespace with ``sname, n, k, kind, m``; ``w16s`` (bf16 copies) and ``qs`` (quantized
    copies, ``q = qs[0]``) from ``bf16_copies`` / ``quant_copies``; ``fn`` the dispatcher entry, ``qbytes``,
    ``x [m, k]`` bf16 activations and ``ref = x @ dequantize().T`` in fp32."""
    import types

    torch.manual_seed(0)
    for sname, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        w16s = bf16_copies(w, at_least)
        for kind in kinds:
            q, qs, fn, qbytes = quant_copies(kind, w, at_least)
            wref = q.dequantize(torch.float32)
            for m in ms:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                yield types.SimpleNamespace(sname=sname, n=n, k=k, kind=kind, m=m, w16s=w16s, q=q, qs=qs, fn=fn,
                                            qbytes=qbytes, x=x, ref=x.float() @ wref.T)


def tinygemm_calls(n: int, k: int, copies: int, xs: torch.Tensor):
    """tinygemm INT4 g128 (timing only: random codes and scales), one packed weight per copy."""
    wps, szs = [], []
    for _ in range(copies):
        q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
        wps.append(torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8))
        szs.append(torch.rand(k // 128, n, 2, device="cuda", dtype=torch.bfloat16))
    return lambda i: torch.ops.aten._weight_int4pack_mm(xs, wps[i % copies], 128, szs[i % copies])


def main() -> None:  # noqa: C901 (one linear script)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    ap.add_argument("--budget-s", type=float, default=220.0, help="stop starting new configs after this")
    ap.add_argument("--shapes", default="", help="comma-separated subset of shape names (default: all)")
    ap.add_argument("--kinds", default="int4,fp8", help="comma-separated subset of int4, fp8")
    ap.add_argument("--ms", default="", help="comma-separated row counts (default: 1, 4, 16)")
    ap.add_argument("--grid", choices=("default", "wide", "packed"), default="default",
                    help="candidate tiles: the tight default grid, wide_mode5's MODE 5 grid or packed_mode4's")
    args = ap.parse_args()
    if not set(args.kinds.split(",")) <= {"int4", "fp8"}:
        ap.error(f"--kinds: a comma-separated subset of int4, fp8, got {args.kinds!r}")
    t_start = time.perf_counter()
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    act = torch.float16 if smoke else torch.bfloat16  # the interpreter cannot do bf16 math
    shapes = {"tiny (48x256)": (48, 256)} if smoke else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if any(s in k for s in args.shapes.split(","))}
    ms = {"int4": (1, 3, 8), "fp8": (1, 3)} if smoke else MS
    if args.ms:
        ms = {kind: tuple(int(v) for v in args.ms.split(",")) for kind in ms}
    if smoke:
        bw = 3.0e12
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s (assumed: smoke run)", flush=True)
    else:
        bw = copy_bandwidth()  # (printed)
    timer = (lambda c, n: time_eager(c, n)) if smoke else (lambda c, n: time_graph(c, n, reps=7, warmup=1))
    rows, cases, best = [], [], {}
    torch.manual_seed(0)

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    for sname, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev) * 0.02
        w16 = w.to(act)
        copies_bf16 = 1 if smoke else max(1, math.ceil(WORKING_SET / (n * k * 2)))
        w16s = [w16] + [w16.clone() for _ in range(copies_bf16 - 1)]
        for kind in args.kinds.split(","):
            wb = n * k // 2 if kind == "int4" else n * k
            copies = 1 if smoke else max(1, math.ceil(WORKING_SET / wb))
            q, qs, fn, qbytes = make_weights(kind, w, copies)
            wref = q.dequantize(torch.float32)
            for m in ms[kind]:
                x = torch.randn(m, k, device=dev).to(act)
                ref = x.float() @ wref.T
                io_bytes = (m * k + m * n) * 2
                n_calls = max(copies, 24 if not smoke else 1)
                n_calls = math.ceil(n_calls / copies) * copies
                peers_us = {}
                if not smoke:
                    n16 = math.ceil(n_calls / copies_bf16) * copies_bf16
                    peers_us["bf16 F.linear"] = timer(lambda i: F.linear(x, w16s[i % copies_bf16]), n16) * 1e6
                    if kind == "int4":
                        try:
                            tg = tinygemm_calls(n, k, copies, x)
                            peers_us["tinygemm int4"] = timer(tg, n_calls) * 1e6
                        except Exception as e:  # noqa: BLE001
                            print("tinygemm unavailable:", repr(e)[:160], flush=True)
                floor_us = (qbytes + io_bytes) / bw * 1e6
                key = f"{kind},{n},{k},{m}"
                results = []  # (us, cfg)

                def run_cfg(cfg, label):
                    try:
                        y = fn(x, q, config=cfg)
                        err = rel_err(y, ref)
                        if not err < 1e-2:
                            raise RuntimeError(f"rel err {err:.3g}")
                        for qq in qs:  # eager first calls: MODE 4 makes each copy's words outside the graph
                            fn(x, qq, config=cfg)
                        us = timer(lambda i: fn(x, qs[i % copies], config=cfg), n_calls) * 1e6
                    except Exception as e:  # noqa: BLE001
                        msg = repr(e).splitlines()[0][:200] if str(e) else traceback.format_exc()[-200:]
                        rows.append({"kind": kind, "shape": sname, "N": n, "K": k, "M": m, "config": cfg,
                                     "label": label, "error": msg})
                        print(f"  {key} {label} {cfg}: FAILED {msg}", flush=True)
                        return None
                    full = TW._small_cfg(kind, n, k, m, 128 if kind == "int4" else 1 << 30, x.device, cfg)
                    rows.append({"kind": kind, "shape": sname, "N": n, "K": k, "M": m, "config": full,
                                 "label": label, "us": us, "rel_err": err, "floor_us": floor_us,
                                 "vs_bf16": peers_us.get("bf16 F.linear", float("nan")) / us})
                    if cfg is not None:
                        results.append((us, full))
                    return us

                default_us = run_cfg(None, "default")
                for cfg in configs_for(kind, m, smoke, args.grid):
                    if over_budget():
                        print("  budget reached: skipping remaining configs", flush=True)
                        break
                    run_cfg(cfg, "sweep")
                if results:  # stage 2: split-K factors of the best tile (SPLIT is a runtime arg)
                    us0, cfg0 = min(results, key=lambda r: r[0])
                    for split in (1, 2, 4, 8):
                        if split != cfg0["SPLIT"] and k // split >= cfg0["BLOCK_K"] and not over_budget():
                            run_cfg({**cfg0, "SPLIT": split}, "split")
                if not results:
                    continue
                us, cfg = min(results, key=lambda r: r[0])
                flops = 2 * m * n * k
                tf = lambda t_us: flops / (t_us * 1e-6) / 1e12
                peers = {name: tf(t) for name, t in peers_us.items()}
                best[key] = {"config": cfg, "us": us, "default_us": default_us, "floor_us": floor_us,
                             "peers_us": peers_us}
                cases.append(case(f"{'W4A16 g128' if kind == 'int4' else 'FP8 weight-only emulated'} "
                                  f"{sname} M={m}", metric="effective TFLOP/s", unit="TFLOP/s", ours=tf(us),
                                  peers=peers, floor=tf(floor_us), ours_us=us, peers_us=peers_us,
                                  floor_us=floor_us, default_config_us=default_us, config=cfg))
                bf = peers_us.get("bf16 F.linear")
                tg = peers_us.get("tinygemm int4")
                print(f"{kind:4s} {sname:24s} M={m:2d} best {us:7.2f} us (default {default_us or float('nan'):7.2f})"
                      f" bf16 {bf or float('nan'):7.2f} tinygemm {tg or float('nan'):7.2f} floor {floor_us:6.2f}"
                      f" | x bf16 {(bf or float('nan')) / us:5.2f} | {cfg}", flush=True)
                write_results(args.out, "sweep_quant_wo", "cpu" if smoke else torch.cuda.get_device_name(),
                              cases)
    table = []
    for key, b in best.items():
        kind, n, k, m = key.split(",")
        c = {kk: v for kk, v in b["config"].items() if kk != "BLOCK_M"}
        table.append(f'    ("{kind}", {n}, {k}, {m}): {c},')
    write_results(args.out, "sweep_quant_wo", "cpu" if smoke else torch.cuda.get_device_name(), cases,
                  {"rows": rows, "best": best, "table": table, "copy_bw_TBps": bw / 1e12,
                   "wall_s": time.perf_counter() - t_start})
    if not table:
        print("\nno config passed: SMALL_M_TUNED left as it is (see the FAILED lines)")
    else:
        print("\n# paste into src/infercore/quant/wo_tables.py\n"
              "SMALL_M_TUNED: dict[tuple[str, int, int, int], dict] = {\n" + "\n".join(table) + "\n}")
    print(f"wall {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
