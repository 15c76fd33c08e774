"""Attention with per-key scores (H2O / SnapKV): our two Triton kernels against materializing peers, in one run.

Cases: Llama-2-7B heads (32 q / 32 kv, D 128) and Llama-3-8B heads (32 / 8), one sequence of 4096 and
8192 tokens, bf16, scores over every query (H2O) and over the last 64 queries (SnapKV). Per case:

* ours: ``infercore.ops.attention_with_key_scores`` (K1 flash forward + row LSE, K2 per-key-tile score
  recompute; default launch configs), with K1 and K2 also timed alone;
* peers: the eager materializing version (``dense_attention_with_scores``: bf16 matmuls, fp32 softmax
  over the full ``[Hq, T, T]`` matrix, HF-eager style) where memory allows, ``torch.compile`` of the same
  function (Inductor), and SDPA (causal, output only, no scores: the cost of plain attention);
* floor: the case's FLOPs over the bf16 matmul rate measured in this run; FLOPs = K1's ``4 * T^2/2 * Hq * D``
  plus K2's recompute, ``2 * T^2/2 * Hq * D`` (H2O) or ``2 * window * T * Hq * D`` (SnapKV).

Metric: TFLOP/s = the case's FLOPs / time, for every entry (peers included, so ratios are time ratios;
SDPA does less work than the others). Milliseconds are recorded as extra keys. Each case first checks
ours (and each swept config) against the fp32 materializing reference; a config sweep of each kernel
(``SWEEP_FWD`` x ``SWEEP_SCORES``) reports the best config beside the default. The published mark
(FlashTensor, H100, Llama-2-7B prefill at 4k, per layer): H2O kernel 1.30 ms, Inductor 4.13 ms, eager 13.0 ms.

    python benchmarks/bench_attn_scores.py --out benchmarks/results/h200/attn_scores.json
    python benchmarks/bench_attn_scores.py --check      # correctness only at the benchmark shapes; rc 1 on mismatch
    python benchmarks/bench_attn_scores.py --dry-run    # tiny shapes on the CPU (TRITON_INTERPRET=1), no timing

Exits 1 (after writing the JSON) when ours disagrees with the reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

DRY = "--dry-run" in sys.argv
if DRY:
    # The interpreter, with our op forced onto the Triton kernels on the CPU; fp32 (bf16 dots are wrong there).
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["INFERCORE_BACKEND"] = "attention_with_key_scores:triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_ms, case, matmul_flops, rel_err, write_results  # noqa: E402

from infercore.ops import attention_with_key_scores  # noqa: E402
from infercore.ops.attention import triton_scores as ts  # noqa: E402
from infercore.ops.attention.scores_naive import dense_attention_with_scores  # noqa: E402

DEV = "cpu" if DRY else "cuda"
DTYPE = torch.float32 if DRY else torch.bfloat16
MODELS = {"llama2-7b": (4, 4, 32), "llama3-8b": (4, 2, 32)} if DRY else {"llama2-7b": (32, 32, 128),
                                                                        "llama3-8b": (32, 8, 128)}  # fmt: skip
LENGTHS = (64, 80) if DRY else (4096, 8192)
MODES = {"h2o": None, "snapkv": 16 if DRY else 64}
TOL_OUT, TOL_SCORES = 1e-2, 1e-3  # relative RMSE against the fp32 reference (bf16 output; scores in fp32)

# Configs swept per kernel (each checked against the reference). K2's split is tried at 1, 2 and the group size.
if DRY:
    SWEEP_FWD = [{"block_m": 16, "block_n": 32}, {"block_m": 32, "block_n": 16, "warp_spec": True}]
    SWEEP_SCORES = [{"block_m": 32, "block_n": 16}]
else:
    SWEEP_FWD = [
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
        {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 4},
        # the paged prefill kernel's tuned H200 config (warp-specialized key loop, register cap)
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "warp_spec": True, "maxnreg": 232},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "warp_spec": True},
    ]
    SWEEP_SCORES = [
        {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 3},
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
        {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3},
        {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 32, "block_n": 128, "num_warps": 4, "num_stages": 4},
    ]
# FlashTensor (PPoPP 2025), H100, Llama-2-7B prefill at 4k, one layer's H2O attention: milliseconds
PUBLISHED = {"flashtensor": 1.30, "inductor": 4.13, "eager": 13.0}
LOG: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def timed(fn) -> float:
    """Median milliseconds (one untimed call first); in a dry run one call's wall time."""
    if DRY:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return bench_ms(fn)


def fits(nbytes: float) -> bool:
    if DRY:
        return True
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.8 * free


def work(T: int, hq: int, d: int, window: int | None) -> tuple[float, float]:
    """FLOPs of K1 and K2 (causal halves)."""
    k1 = 4 * T * T / 2 * hq * d
    k2 = 2 * hq * d * (T * T / 2 if window is None else window * T)
    return k1, k2


def inputs(T: int, hq: int, hk: int, d: int):
    g = torch.Generator(device=DEV).manual_seed(T + hk)
    q, k, v = (torch.randn(T, h, d, device=DEV, generator=g).to(DTYPE) for h in (hq, hk, hk))
    return q, k, v, torch.tensor([0, T], dtype=torch.int32, device=DEV)


def reference(q, k, v, scale, window):
    """fp32 materializing reference: (out, key_scores)."""
    T, hq, _ = q.shape
    hk = k.shape[1]
    out, heads = dense_attention_with_scores(q.float(), k.float(), v.float(), scale=scale, score_window=window)
    return out, heads.view(T, hk, hq // hk).sum(-1)


def errors(out, scores, ref) -> dict:
    return {"rel_err_out": rel_err(out, ref[0]), "rel_err_scores": rel_err(scores, ref[1])}


def is_ok(err: dict) -> bool:
    return err["rel_err_out"] < TOL_OUT and err["rel_err_scores"] < TOL_SCORES


def check_only() -> int:
    bad = 0
    for model, (hq, hk, d) in MODELS.items():
        for T in LENGTHS:
            for mode, window in MODES.items():
                q, k, v, cu = inputs(T, hq, hk, d)
                if not fits(14 * hq * T * T):
                    log(f"{model} T={T} {mode}: reference does not fit in memory, skipped")
                    continue
                ref = reference(q, k, v, d**-0.5, window)
                out, scores = attention_with_key_scores(q, k, v, cu_seqlens=cu, scale=d**-0.5, score_window=window)
                err = errors(out, scores, ref)
                ok = is_ok(err)
                bad += not ok
                log(f"{model} T={T} {mode}: {'ok' if ok else 'MISMATCH'} " + ", ".join(f"{a}={b:.2e}" for a, b in
                                                                                          err.items()))  # fmt: skip
                del ref, out, scores
                if not DRY:
                    torch.cuda.empty_cache()
    log(f"check: {'FAILED, ' + str(bad) + ' case(s)' if bad else 'all cases match'}")
    return 1 if bad else 0


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> bool:
        return time.perf_counter() - self.t0 < self.seconds


def sweep(q, k, v, cu, scale, window, ref, budget: Budget) -> dict:
    """Each kernel alone under each swept config (the other at its default); returns the timings and the best."""
    T, hq, _ = q.shape
    group = hq // k.shape[1]
    res: dict = {"fwd": [], "scores": []}
    for cfg in SWEEP_FWD:
        if not budget.left():
            log("  sweep: budget spent")
            break
        entry = {"config": dict(cfg)}
        try:
            out, _ = ts.forward_with_lse(q, k, v, cu, scale=scale, softcap=None, max_seqlen=T, cfg=cfg)
            entry["rel_err_out"] = rel_err(out, ref[0])
            entry["ms"] = timed(lambda c=cfg: ts.forward_with_lse(q, k, v, cu, scale=scale, softcap=None,
                                                                  max_seqlen=T, cfg=c))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result, not a crash
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["fwd"].append(entry)
    default = ts.default_config(q, k, 1, T, window)
    _, lse = ts.forward_with_lse(q, k, v, cu, scale=scale, softcap=None, max_seqlen=T, cfg=default["fwd"])
    splits = sorted({1, min(2, group) if group % 2 == 0 else 1, group})
    for base in SWEEP_SCORES:
        for split in splits:
            if not budget.left():
                break
            cfg = {**base, "split": split}
            entry = {"config": dict(cfg)}
            try:
                kw = dict(scale=scale, softcap=None, score_window=window, max_seqlen=T, cfg=cfg)
                scores, _ = ts.scores_from_lse(q, k, cu, lse, **kw)
                entry["rel_err_scores"] = rel_err(scores, ref[1])
                entry["ms"] = timed(lambda: ts.scores_from_lse(q, k, cu, lse, **kw))  # noqa: B023
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["scores"].append(entry)

    def best(entries, key, tol):
        ok = [e for e in entries if "ms" in e and e[key] < tol]
        return min(ok, key=lambda e: e["ms"]) if ok else None

    res["best_fwd"] = best(res["fwd"], "rel_err_out", TOL_OUT)
    res["best_scores"] = best(res["scores"], "rel_err_scores", TOL_SCORES)
    return res


def run_case(model, hq, hk, d, T, mode, window, mm_rate, compiled, args, budget: Budget, cases: list) -> bool:
    """Check, time and append one case's row to ``cases``; returns whether ours matched the reference."""
    name = f"{model} T={T} {mode}"
    scale = d**-0.5
    q, k, v, cu = inputs(T, hq, hk, d)
    k1, k2 = work(T, hq, d, window)
    flops = k1 + k2
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    extra: dict = {"T": T, "q_heads": hq, "kv_heads": hk, "head_dim": d, "score_window": window,
                   "flops": flops, "flops_k1": k1, "flops_k2": k2}  # fmt: skip

    # correctness first (fp32 materializing reference on the same bf16 values)
    ref = reference(q, k, v, scale, window) if fits(14 * hq * T * T) else None
    ours = lambda: attention_with_key_scores(q, k, v, cu_seqlens=cu, scale=scale, score_window=window,  # noqa: E731
                                             max_seqlen=T)  # fmt: skip
    out, scores = ours()
    ok = True
    if ref is not None:
        err = errors(out, scores, ref)
        ok = is_ok(err)
        extra.update(err)
        log(f"{name}: ours {'ok' if ok else 'MISMATCH'} " + ", ".join(f"{a}={b:.2e}" for a, b in err.items()))
    extra["correct"] = ok
    cfg = ts.default_config(q, k, 1, T, window)
    extra["config"] = cfg

    ms = {"ours": timed(ours)}
    ms["k1"] = timed(lambda: ts.forward_with_lse(q, k, v, cu, scale=scale, softcap=None, max_seqlen=T,
                                                 cfg=cfg["fwd"]))  # fmt: skip
    _, lse = ts.forward_with_lse(q, k, v, cu, scale=scale, softcap=None, max_seqlen=T, cfg=cfg["fwd"])
    ms["k2"] = timed(lambda: ts.scores_from_lse(q, k, cu, lse, scale=scale, softcap=None, score_window=window,
                                                max_seqlen=T, cfg=cfg["scores"]))  # fmt: skip

    peers: dict[str, float] = {}
    dense = lambda fn: (lambda: fn(q, k, v, scale=scale, score_window=window))  # noqa: E731
    if fits(12 * hq * T * T):
        try:
            ms["eager"] = timed(dense(dense_attention_with_scores))
            peers["eager materializing (bf16 matmuls, fp32 softmax)"] = tflops(ms["eager"])
        except torch.OutOfMemoryError:
            log(f"{name}: eager out of memory")
        if not DRY:
            torch.cuda.empty_cache()
    else:
        log(f"{name}: eager skipped (memory)")
    if compiled is None:
        extra["compile"] = "skipped (dry run or --no-compile)"
    elif not budget.left():
        extra["compile"] = "skipped (time budget)"
        log(f"{name}: torch.compile skipped (time budget)")
    else:
        try:
            t0 = time.perf_counter()
            dense(compiled)()
            if not DRY:
                torch.cuda.synchronize()
            extra["compile_s"] = time.perf_counter() - t0
            ms["inductor"] = timed(dense(compiled))
            peers["torch.compile (Inductor) of the eager version"] = tflops(ms["inductor"])
        except Exception as e:  # noqa: BLE001 - a peer that fails is a result
            extra["compile"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            log(f"{name}: torch.compile failed\n{traceback.format_exc()[-2000:]}")
        if not DRY:
            torch.cuda.empty_cache()
    # SDPA on [1, H, T, D]; with GQA both through enable_gqa and with the KV heads repeated beforehand (in case
    # enable_gqa sent it to a slower backend): the faster one is the peer.
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    kr, vr = (t.repeat_interleave(hq // hk, dim=1) for t in (kh, vh))
    ms["sdpa_repeated_kv"] = timed(lambda: F.scaled_dot_product_attention(qh, kr, vr, is_causal=True, scale=scale))
    if hk != hq:
        try:
            gqa = lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,  # noqa: E731
                                                         enable_gqa=True)  # fmt: skip
            ms["sdpa_enable_gqa"] = timed(gqa)
        except Exception as e:  # noqa: BLE001 - an SDPA without enable_gqa
            log(f"{name}: SDPA with enable_gqa failed: {type(e).__name__}: {str(e)[:200]}")
    ms["sdpa"] = min(ms.get("sdpa_enable_gqa", float("inf")), ms["sdpa_repeated_kv"])
    peers["SDPA causal, output only (no scores)"] = tflops(ms["sdpa"])

    del ref

    floor_ms = flops / mm_rate * 1e3
    extra.update({f"ms_{key}": val for key, val in ms.items()})
    extra["floor_ms"] = floor_ms
    row = case(name, metric="TFLOP/s (case FLOPs / time)", unit="TFLOP/s", ours=tflops(ms["ours"]), peers=peers,
               floor=mm_rate / 1e12, **extra)  # fmt: skip
    cases.append(row)
    log(f"{name}: ours {ms['ours']:.3f} ms (K1 {ms['k1']:.3f} + K2 {ms['k2']:.3f}) = {row['ours']:.0f} TFLOP/s; "
        + ", ".join(f"{key} {val:.3f} ms" for key, val in ms.items() if key not in ("ours", "k1", "k2"))
        + f"; floor {floor_ms:.3f} ms")  # fmt: skip
    if not DRY:
        torch.cuda.empty_cache()
    return ok


def sweep_case(row: dict, budget: Budget) -> None:
    """The config sweep of one measured case (second pass, while the time budget lasts); adds its results and
    the best swept configs' total time to ``row``."""
    T, hq, hk, d, window = (row[key] for key in ("T", "q_heads", "kv_heads", "head_dim", "score_window"))
    if not fits(14 * hq * T * T):
        return
    q, k, v, cu = inputs(T, hq, hk, d)
    ref = reference(q, k, v, d**-0.5, window)
    sw = sweep(q, k, v, cu, d**-0.5, window, ref, budget)
    row["sweep"] = sw
    if sw["best_fwd"] and sw["best_scores"]:
        ms = sw["best_fwd"]["ms"] + sw["best_scores"]["ms"]
        row["ms_ours_best_swept"] = ms
        row["tflops_ours_best_swept"] = row["flops"] / (ms * 1e-3) / 1e12
        log(f"{row['case']}: best swept K1 {sw['best_fwd']['config']} {sw['best_fwd']['ms']:.3f} ms, "
            f"K2 {sw['best_scores']['config']} {sw['best_scores']['ms']:.3f} ms (default {row['ms_ours']:.3f} ms)")
    if not DRY:
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/attn_scores.json")
    ap.add_argument("--check", action="store_true", help="correctness only, at the benchmark shapes; rc 1 on mismatch")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the config sweep")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="after this many seconds the optional parts (compile peer, sweeps) are skipped")
    args = ap.parse_args()
    if not DRY and not torch.cuda.is_available():
        sys.exit("bench_attn_scores: needs a CUDA GPU (or --dry-run)")
    if args.check:
        return check_only()
    budget = Budget(args.budget_s)
    if DRY:
        x = torch.randn(256, 256)
        t = time.perf_counter()
        x @ x
        mm_rate = 2 * 256**3 / (time.perf_counter() - t)
    else:
        mm_rate = matmul_flops(DEV, dtype=torch.bfloat16)
    log(f"bf16 matmul 8192^3: {mm_rate / 1e12:.0f} TFLOP/s")
    compiled = None
    if not (DRY or args.no_compile):
        from torch import _dynamo

        for knob in ("cache_size_limit", "recompile_limit"):  # one compile per case's shapes and window
            if hasattr(_dynamo.config, knob):
                setattr(_dynamo.config, knob, 64)
        compiled = torch.compile(dense_attention_with_scores, dynamic=False)
    cases: list = []
    all_ok = True

    def save():  # after every step, so a run stopped by the device's time limit keeps what it measured
        write_results(args.out, "attn_scores", "cpu-dry-run" if DRY else "h200", cases,
                      extra={"matmul_tflops": mm_rate / 1e12, "all_correct": all_ok,
                             "published_h100_llama2_7b_4k_h2o_ms": PUBLISHED,
                             "log": LOG})  # fmt: skip

    # Pass 1: every case with its peers. Pass 2: config sweeps while the budget lasts, the published case first.
    for model, (hq, hk, d) in MODELS.items():
        for T in LENGTHS:
            for mode, window in MODES.items():
                try:
                    all_ok &= run_case(model, hq, hk, d, T, mode, window, mm_rate, compiled, args, budget, cases)
                except Exception:  # noqa: BLE001 - keep the other cases
                    log(f"{model} T={T} {mode}: FAILED\n{traceback.format_exc()}")
                    all_ok = False
                    if not DRY:
                        torch.cuda.empty_cache()
                save()
    if args.sweep:
        for row in sorted(cases, key=lambda r: (r["T"], r["score_window"] is not None, r["kv_heads"] != r["q_heads"])):
            if not budget.left():
                log("sweep: time budget spent, remaining cases not swept")
                break
            try:
                sweep_case(row, budget)
            except Exception:  # noqa: BLE001
                log(f"{row['case']}: sweep FAILED\n{traceback.format_exc()}")
            save()
    log(f"wrote {args.out}" + ("" if all_ok else "; SOME CASES FAILED the correctness check"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
