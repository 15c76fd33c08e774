"""Gated delta rule kernels against fla-core, in one run: chunked prefill and recurrent decode.

Cases (Qwen3-Next-like heads: H = 16, K = V = 128, bf16 activations, fp32 states, q/k l2-normalised
in the kernel, log-space gates):

* prefill, one sequence of 8192 tokens and a ragged batch of 8 x 1024: tokens/s, ours
  (``chunk_gated_delta_rule_``, states read from / written to slots) vs fla-core's
  ``chunk_gated_delta_rule`` (dense initial state, final state returned). The floor is the
  memory floor: bytes of q, k, v, o and the states over the copy bandwidth measured here.
* decode, batch 256: state traffic in TB/s (state read + write bytes / time), ours (in place in
  the slot pool) vs fla-core's ``fused_recurrent_gated_delta_rule`` (dense state in, new state out)
  and vs the copy bandwidth measured in the same run (the floor). Our decode kernel's
  ``(BLOCK_V, num_warps)`` choices are swept and the best is reported beside the default.
* prefill config sweep: each of the four chunked kernels (kkt, wu, state, output) timed alone under
  <= 12 launch configs (``SWEEP``), each config's whole-prefill output checked against the fp32
  reference; then the prefill with every kernel at its best swept config. Budget ~75 s of sweeps.

Outputs are checked first: ours and fla against the fp32 reference, and against each other.
fla-core is not installed here; on the GPU machine run first::

    pip install --no-deps .wheels/fla_core-0.6.0-py3-none-any.whl
    python benchmarks/bench_gdn.py --out $OUT/gdn.json

``--dry-run`` runs tiny shapes on the CPU under TRITON_INTERPRET=1 (no timing, no fla) to check the
script end to end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

DRY = "--dry-run" in sys.argv
if DRY:
    # The interpreter: Triton kernels forced on the CPU, fp32 activations (bf16 dots are wrong there).
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["INFERCORE_BACKEND"] = "chunk_gated_delta_rule_:triton,fused_recurrent_gated_delta_rule_:triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_ms, case, copy_bandwidth, write_results  # noqa: E402

from infercore.devices import implementation  # noqa: E402
from infercore.ops.gated_delta import chunk as gdr_chunk  # noqa: E402
from infercore.ops.gated_delta import chunk_gated_delta_rule_, fused_recurrent_gated_delta_rule_  # noqa: E402
from infercore.ops.gated_delta import triton as gdr_triton  # noqa: E402

BF16 = torch.float32 if DRY else torch.bfloat16
LOG: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def timed(fn) -> float:
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return bench_ms(fn)


def load_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure means "no peer", not a crash
        log(f"fla-core unavailable: {type(e).__name__}: {e}")
        return None, None


def inputs(T: int, H: int, K: int, V: int, dev: str):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, K, device=dev, dtype=BF16, generator=g)
    k = torch.randn(T, H, K, device=dev, dtype=BF16, generator=g)
    v = torch.randn(T, H, V, device=dev, dtype=BF16, generator=g)
    # Qwen3-Next gates: g = -exp(A_log) * softplus(a + dt_bias) (log space, fp32), beta = sigmoid(b)
    a_log = torch.rand(H, device=dev, generator=g) * 2 - 1
    gate = -a_log.exp() * F.softplus(torch.randn(T, H, device=dev, generator=g) - 2)
    beta = torch.randn(T, H, device=dev, generator=g).sigmoid().to(BF16)
    return q, k, v, gate, beta


def bench_prefill(name, lens, H, K, V, dev, fla_chunk, mem_bw, cases, sweep_kernels=()):
    T, B = sum(lens), len(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q, k, v, gate, beta = inputs(T, H, K, V, dev)
    pool = torch.randn(B + 2, H, K, V, device=dev) * 0.1
    slots = torch.arange(B, dtype=torch.int32, device=dev) + 1
    init = torch.ones(B, dtype=torch.bool, device=dev)
    kw = dict(cu_seqlens=cu, state_slots=slots, has_initial_state=init, scale=K**-0.5, use_qk_l2norm=True)
    h0 = pool[slots.long()].clone()

    # correctness: ours (bf16) and fla (bf16) against the fp32 reference on the same values
    p_ours, p_ref = pool.clone(), pool.clone()
    o_ours = chunk_gated_delta_rule_(q, k, v, gate, beta, p_ours, **kw)
    ref = implementation("chunk_gated_delta_rule_", "reference")
    o_ref = ref(q.float(), k.float(), v.float(), gate, beta.float(), p_ref, **kw)
    check = {"rel_err_ours": rel(o_ours, o_ref), "rel_err_state_ours": rel(p_ours[1 : B + 1], p_ref[1 : B + 1])}
    fla_fn = None
    if fla_chunk is not None:
        # fla: [1, T, H, D] with cu_seqlens (int64), dense initial state [B, H, K, V], log-space g
        fq, fk, fv, fg, fb = (t[None] for t in (q, k, v, gate, beta))
        cu64 = cu.long()

        def fla_fn():
            return fla_chunk(fq, fk, fv, fg, fb, scale=K**-0.5, initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, cu_seqlens=cu64)  # fmt: skip

        try:
            o_fla, s_fla = fla_fn()
            check.update(rel_err_fla=rel(o_fla[0], o_ref), rel_err_state_fla=rel(s_fla, p_ref[1 : B + 1]),
                         rel_ours_vs_fla=rel(o_ours, o_fla[0]))  # fmt: skip
        except Exception:  # noqa: BLE001
            log(f"{name}: fla failed\n{traceback.format_exc()}")
            fla_fn = None
    log(f"{name}: " + ", ".join(f"{k_}={v_:.2e}" for k_, v_ in check.items()))
    ok = check["rel_err_ours"] < 2e-2 and check["rel_err_state_ours"] < 2e-2
    if not ok:
        log(f"{name}: OURS FAILS the correctness check; timing anyway")

    p_run = pool.clone()
    t_ours = timed(lambda: chunk_gated_delta_rule_(q, k, v, gate, beta, p_run, **kw))
    peers = {}
    if fla_fn is not None:
        peers["fla-core chunk_gated_delta_rule"] = T / (timed(fla_fn) * 1e-3)
    nbytes = T * H * (2 * K + 2 * V) * 2 + 2 * B * H * K * V * 4
    row = case(
        name, metric="prefill tokens/s", unit="tok/s", ours=T / (t_ours * 1e-3), peers=peers,
        floor=(T / (nbytes / mem_bw)) if mem_bw else None, ms_ours=t_ours, correct=ok, **check,
    )  # fmt: skip
    if peers:
        row["ms_fla"] = T / next(iter(peers.values())) * 1e3
    cases.append(row)
    if not DRY:
        row["kernel_us"] = kernel_breakdown(lambda: chunk_gated_delta_rule_(q, k, v, gate, beta, p_run, **kw))
        log(f"{name}: per-kernel us {row['kernel_us']}")
    if sweep_kernels:
        row["config_sweep"] = sweep_prefill(name, sweep_kernels, (q, k, v, gate, beta, pool), kw, o_ref)
        best = {kn: r["best"] for kn, r in row["config_sweep"].items() if r.get("best") is not None}
        if best:
            cfg = {kn: SWEEP[kn][i] for kn, i in best.items()}
            p_b = pool.clone()
            t_b = timed(lambda: gdr_chunk.chunk_gated_delta_rule_(q, k, v, gate, beta, p_b, config=cfg, **kw))
            row["best_swept_config"] = {kn: dict(c) for kn, c in cfg.items()}
            row["ms_ours_best_swept"] = t_b
            log(f"{name}: best swept configs {cfg}: {t_b * 1e3:.1f} us total (default {t_ours * 1e3:.1f} us)")


# Per-kernel launch configs swept by the benchmark (each <= 12); see chunk.DEFAULT_PREFILL_CONFIG.
_WS = ((4, 1), (4, 2), (8, 2))
SWEEP: dict[str, list[dict]] = {
    "kkt": [{"num_warps": w, "num_stages": 1} for w in (1, 2, 4, 8)] + [{"num_warps": 4, "PREC": "tf32x3"}],
    "wu": [{"BK": b, "BV": b, "num_warps": w, "num_stages": s} for b in (64, 128) for (w, s) in _WS],
    "state": [{"BV": b, "num_warps": w, "num_stages": s} for b in (16, 32, 64) for (w, s) in ((4, 2), (4, 3), (8, 2))],
    "output": [{"BV": b, "num_warps": w, "num_stages": s} for b in (64, 128) for (w, s) in _WS],
}
SWEEP_BUDGET_S = 75.0  # all sweeps together; the rest is skipped (and logged) past it
_SWEEP_T0: list[float] = []


def sweep_prefill(name, kernels, tensors, kw, o_ref) -> dict:
    """Time each kernel alone under each of its configs (the other kernels at their defaults), and
    check the output of the whole prefill under that config against the fp32 reference."""
    q, k, v, gate, beta, pool = tensors
    if not _SWEEP_T0:
        _SWEEP_T0.append(time.time())
    out: dict = {}
    for kn in kernels:
        res: dict = {"configs": [], "best": None}
        best_us = float("inf")
        for i, cfg in enumerate(SWEEP[kn][:1] if DRY else SWEEP[kn]):
            if time.time() - _SWEEP_T0[0] > SWEEP_BUDGET_S:
                log(f"{name}: sweep budget spent, skipping {kn} {cfg}")
                continue
            entry = {"config": dict(cfg)}
            try:
                p = pool.clone()
                stages, o, final = gdr_chunk.prefill_stages(q, k, v, gate, beta, p, config={kn: cfg}, **kw)
                for _, launch in stages:
                    launch()
                entry["rel_err"] = rel(o, o_ref)
                launch = dict(stages)[kn]
                entry["us"] = timed(launch) * 1e3 if DRY else bench_ms(launch, warmup=5, rep=30) * 1e3
                if entry["rel_err"] < 2e-2 and entry["us"] < best_us:
                    best_us, res["best"] = entry["us"], i
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result, not a crash
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["configs"].append(entry)
        out[kn] = res
        log(f"{name}: sweep {kn}")
        for e in res["configs"]:
            tag = e.get("error") or f"{e['us']:9.1f} us  rel_err {e['rel_err']:.2e}"
            log(f"    {str(e['config']):62s} {tag}")
    return out


def kernel_breakdown(fn, iters: int = 10) -> dict[str, float]:
    """Mean device time per call of each kernel (torch profiler); {} if the profiler fails."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            if t:
                out[ev.key[:60]] = round(t / iters, 2)
        return out
    except Exception as e:  # noqa: BLE001
        log(f"profiler failed: {e}")
        return {}


def bench_decode(B, H, K, V, dev, fla_rec, copy_bw, cases):
    q, k, v, gate, beta = inputs(B, H, K, V, dev)
    n_slots = B + 8
    pool = torch.randn(n_slots, H, K, V, device=dev) * 0.1
    slots = torch.randperm(n_slots, device=dev)[:B].to(torch.int32)
    kw = dict(state_slots=slots, scale=K**-0.5, use_qk_l2norm=True)
    h0 = pool[slots.long()].clone()
    p_ours, p_ref = pool.clone(), pool.clone()
    o_ours = fused_recurrent_gated_delta_rule_(q, k, v, gate, beta, p_ours, **kw)
    ref = implementation("fused_recurrent_gated_delta_rule_", "reference")
    o_ref = ref(q.float(), k.float(), v.float(), gate, beta.float(), p_ref, **kw)
    check = {"rel_err_ours": rel(o_ours, o_ref), "rel_err_state_ours": rel(p_ours, p_ref)}
    fla_fn = None
    if fla_rec is not None:
        fq, fk, fv, fg, fb = (t[:, None] for t in (q, k, v, gate, beta))  # [B, 1, H, D]

        def fla_fn():
            return fla_rec(fq, fk, fv, g=fg, beta=fb, scale=K**-0.5, initial_state=h0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)  # fmt: skip

        try:
            o_fla, s_fla = fla_fn()
            check.update(rel_err_fla=rel(o_fla[:, 0], o_ref), rel_err_state_fla=rel(s_fla, p_ref[slots.long()]),
                         rel_ours_vs_fla=rel(o_ours, o_fla[:, 0]))  # fmt: skip
        except Exception:  # noqa: BLE001
            log(f"decode: fla failed\n{traceback.format_exc()}")
            fla_fn = None
    log("decode: " + ", ".join(f"{k_}={v_:.2e}" for k_, v_ in check.items()))
    ok = check["rel_err_ours"] < 1e-2 and check["rel_err_state_ours"] < 1e-4

    state_bytes = 2 * B * H * K * V * 4  # fp32 state read + written
    p_run = pool.clone()
    t_default = timed(lambda: fused_recurrent_gated_delta_rule_(q, k, v, gate, beta, p_run, **kw))
    sweep = {}
    if not DRY:
        for bv in (16, 32, 64, 128):
            for nw in (2, 4, 8):
                try:
                    t = timed(lambda bv=bv, nw=nw: gdr_triton.fused_recurrent_gated_delta_rule_(
                        q, k, v, gate, beta, p_run, block_v=bv, num_warps=nw, **kw))  # fmt: skip
                    sweep[f"BV{bv}_w{nw}"] = round(state_bytes / (t * 1e-3) / 1e12, 3)
                except Exception as e:  # noqa: BLE001
                    log(f"decode config BV={bv} warps={nw} failed: {type(e).__name__}: {e}")
        log(f"decode sweep TB/s: {sweep}")
    peers = {}
    if fla_fn is not None:
        peers["fla-core fused_recurrent_gated_delta_rule"] = state_bytes / (timed(fla_fn) * 1e-3) / 1e12
    ours = state_bytes / (t_default * 1e-3) / 1e12
    cases.append(
        case(
            f"decode B={B} H={H} K={K} V={V} fp32 state",
            metric="state traffic",
            unit="TB/s",
            ours=ours,
            peers=peers,
            floor=copy_bw / 1e12 if copy_bw else None,
            us_ours=t_default * 1e3,
            correct=ok,
            default_config=list(gdr_triton.decode_config(K, V)),
            sweep_tb_s=sweep,
            best_swept_tb_s=max(sweep.values()) if sweep else None,
            **check,
        )  # fmt: skip
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/h200/gdn.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter, no timing")
    args = ap.parse_args()
    dev = "cpu" if DRY else "cuda"
    if DRY:
        H, K, V = 2, 32, 32
        prefill = [("prefill T=130 (1 seq)", [130]), ("prefill 3 ragged", [64, 1, 65])]
        dec_b = 4
        fla_chunk, fla_rec = None, None
        copy_bw = None
    else:
        H, K, V = 16, 128, 128
        prefill = [("prefill T=8192 (1 seq) H=16 D=128 bf16", [8192]),
                   ("prefill 8x1024 ragged H=16 D=128 bf16", [1024] * 8)]  # fmt: skip
        dec_b = 256
        fla_chunk, fla_rec = load_fla()
        copy_bw = copy_bandwidth()
        log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    cases: list = []
    t0 = time.time()
    # The per-chunk kernels behave alike in both cases; the sequential scan is swept in each.
    sweeps = [("kkt", "wu", "state", "output"), ("state",)]
    for (name, lens), sw in zip(prefill, sweeps):
        try:
            bench_prefill(name, lens, H, K, V, dev, fla_chunk, copy_bw, cases, sweep_kernels=sw)
        except Exception:  # noqa: BLE001
            log(f"{name} failed\n{traceback.format_exc()}")
    try:
        bench_decode(dec_b, H, K, V, dev, fla_rec, copy_bw, cases)
    except Exception:  # noqa: BLE001
        log(f"decode failed\n{traceback.format_exc()}")
    device = "cpu-interpreter" if DRY else torch.cuda.get_device_name()
    doc = write_results(args.out, "gdn", device, cases)
    doc_cases = doc["cases"]
    print(f"\n{'case':48s} {'unit':6s} {'ours':>12s} {'best peer':>12s} {'ours/peer':>9s} {'ours/floor':>10s} ok")
    for c in doc_cases:
        best = max(c["peers"].values()) if c["peers"] else float("nan")
        vs = c["ours_vs_best_peer"] or float("nan")
        fl = c["ours_over_floor"] or float("nan")
        print(f"{c['case'][:48]:48s} {c['unit']:6s} {c['ours']:12.4g} {best:12.4g} {vs:9.3f} {fl:10.3f} {c['correct']}")
    print(f"total {time.time() - t0:.1f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
