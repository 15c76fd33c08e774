"""Batch-1 decode step of the Llama-3.1-8B shape (random bf16 weights): where the step's time goes.

One process, one model, three linear layouts, each in its own Engine (CUDA-graph decode, bucket 1):

1. ``cublas``: plain ``nn.Linear`` (F.linear -> cuBLAS);
2. ``gemv``: ``models.gpu_layout.use_triton_gemv_(model, fuse_act=False)`` (Triton skinny GEMV where
   its tuning table beats cuBLAS);
3. ``gemv+act``: ``use_triton_gemv_(model)``: also the gated MLP with SiLU-and-mul in the
   ``gate_up_proj`` GEMV's epilogue (one launch less per layer).

The swaps happen before each Engine is built, since the Engine captures its graphs in its
constructor. Before that, a short tuning of the fused gate_up+SiLU kernel at M = 1 picks its config
(installed in ``ops.linear.triton.TUNED_ACT``; the JSON's ``fused_act_best`` pastes there).

Per mode: steady decode tok/s through ``Engine.step`` (host included), the device time of one graph
replay (CUDA events), greedy agreement of the first 16 tokens with mode 1, and a torch.profiler
kernel breakdown of graph replays (top kernels by total time per step). Floor: (weight bytes except
the embedding + KV bytes at the mean context) / copy bandwidth (read + write, outside graphs).

    python benchmarks/bench_decode_step.py --out $OUT/decode_step.json      # H200, ~1.5-2 min
    python benchmarks/bench_decode_step.py --dry-run --out /tmp/ds.json    # CPU interpreter, tiny model
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, rel_err, time_graph, write_results  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402
from infercore.models.gpu_layout import use_triton_gemv_  # noqa: E402
from infercore.ops.activation import triton as A  # noqa: E402
from infercore.ops.linear import triton as T  # noqa: E402

TINY = dict(LLAMA_8B, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip

# Fused gate_up + SiLU candidates at M = 1 (block_n counts gate + up rows, so it is even).
ACT_CANDIDATES = [
    T.GemvConfig("fma", 4, 1024, 4, 1),
    T.GemvConfig("fma", 2, 1024, 4, 1),
    T.GemvConfig("fma", 2, 2048, 4, 1),
    T.GemvConfig("fma", 4, 512, 4, 1),
    T.GemvConfig("fma", 8, 512, 4, 1),
    T.GemvConfig("fma", 4, 2048, 8, 1),
    T.GemvConfig("fma", 8, 1024, 8, 1),
    T.GemvConfig("fma", 4, 1024, 4, 1, evict_first=False),
]


def time_calls(fn, dry: bool, n_calls: int = 20) -> float:
    """Seconds per ``fn()``: a CUDA graph of ``n_calls`` calls, median of 10 replays (launch gaps
    inside a graph included, as in the decode step)."""
    if dry:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return time_graph(lambda i: fn(), n_calls)


def tune_fused_act(model, dev, dry: bool) -> dict:
    """Pick the fused gate_up+SiLU config for M = 1 on layer 0's weight and record it in TUNED_ACT
    with its speedup over cuBLAS + the SiLU-and-mul kernel."""
    w = model.model.layers[0].mlp.gate_up_proj.weight
    n, k = w.shape
    x = torch.randn(1, k, device=dev, dtype=w.dtype)
    ref = F.silu(F.linear(x.float(), w.float())[:, : n // 2]) * F.linear(x.float(), w.float())[:, n // 2 :]
    plain_cfg = T.pick_config(n, k, 1)
    peers = {
        "cuBLAS + silu_and_mul": time_calls(lambda: A.silu_and_mul(F.linear(x, w)), dry),
        "GEMV + silu_and_mul": time_calls(lambda: A.silu_and_mul(T.gemv(x, w, None, plain_cfg)), dry),
    }
    rows = []
    for cfg in ACT_CANDIDATES if not dry else ACT_CANDIDATES[:2]:
        try:
            err = rel_err(T.gemv(x, w, None, cfg, "silu"), ref)
            t = time_calls(lambda cfg=cfg: T.gemv(x, w, None, cfg, "silu"), dry) if err < 2e-2 else float("inf")
        except Exception as e:  # a config that fails to compile is logged, not fatal
            print(f"fused act config {cfg} failed: {type(e).__name__}: {e}", flush=True)
            err, t = float("nan"), float("inf")
        rows.append({"config": cfg.as_dict(), "rel_err": err, "us": t * 1e6})
        print(f"  fused gate_up+silu {cfg}: {t * 1e6:.1f} us (rel err {err:.1e})", flush=True)
    best = min(rows, key=lambda r: r["us"])
    speedup = peers["cuBLAS + silu_and_mul"] / (best["us"] * 1e-6)
    cfg = T.GemvConfig(**best["config"])
    T.TUNED_ACT[(n, k, 1)] = (cfg, round(speedup, 3))
    print(f"fused gate_up+silu [{n}x{k}] M=1: best {best['us']:.1f} us, "
          + ", ".join(f"{p} {t * 1e6:.1f} us" for p, t in peers.items()) + f" -> speedup {speedup:.3f}", flush=True)
    nbytes = n * k * w.element_size()
    return {"shape": [n, k], "rows": rows, "peers_us": {p: t * 1e6 for p, t in peers.items()},
            "best": {"config": best["config"], "speedup": speedup}, "bytes": nbytes}


def kernel_breakdown(graph, replays: int, top: int) -> dict:
    """torch.profiler over ``replays`` graph replays: per-step kernel time by name (us)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if t and t > 0:
            rows.append({"kernel": ev.key[:120], "us_per_step": t / replays, "calls_per_step": ev.count / replays})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    calls = sum(r["calls_per_step"] for r in rows)
    return {"kernel_us_per_step": total, "kernels_per_step": calls, "top": rows[:top]}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def steady_decode(eng: Engine, prompt: list[int], new: int) -> float:
    """Decode tokens/s of one request once past its prefill (``Engine.step``, host work included)."""
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    (req,) = eng.requests.values()
    while not req.output_token_ids:
        eng.step()
    steps = max(1, new - 2 - len(req.output_token_ids))
    sync(eng.device)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(eng.device)
    rate = steps / (time.perf_counter() - t)
    while eng.has_unfinished():
        eng.step()
    return rate


def replay_ms(graph, n: int = 50) -> float:
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def run_mode(model, mode: str, args, dev, prompt: list[int]) -> dict:
    cuda = dev.type == "cuda"
    page = 16
    max_len = args.prompt + args.new + 2 * page
    eng = Engine(model, num_pages=-(-max_len // page) * 2 + 8, page_size=page, max_num_seqs=1,
                 max_num_batched_tokens=max(2048, args.prompt), max_model_len=max_len, enable_prefix_caching=False,
                 cuda_graph_max_batch=1 if cuda else 0, cpu_packed_linears=False,
                 gpu_gemv_linears=False)  # fmt: skip  (the layout is this script's choice, per mode)
    sp = SamplingParams(temperature=0, max_tokens=16 if cuda else 3, ignore_eos=True)
    first16 = eng.generate([prompt], sp)[0].token_ids
    out = {"mode": mode, "first16": list(first16)}
    out["tok_s"] = steady_decode(eng, prompt, args.new)
    if cuda and eng.graph_runner is not None and 1 in eng.graph_runner.graphs:
        g = eng.graph_runner.graphs[1]  # its inputs still hold the last step's (valid) metadata
        out["graph_replay_ms"] = replay_ms(g)
        try:
            out["profile"] = kernel_breakdown(g, args.replays, args.top)
        except Exception as e:
            out["profile"] = {"error": f"{type(e).__name__}: {e}"}
    del eng
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/decode_step.json")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (Triton interpreter)")
    args = ap.parse_args()
    dry = args.dry_run
    t_start = time.perf_counter()
    if dry:
        dev, dtype, cfg = torch.device("cpu"), torch.float32, dict(TINY)
        args.prompt, args.new = 8, 4
        bw = 1e11
    else:
        dev, dtype, cfg = torch.device("cuda"), torch.bfloat16, dict(LLAMA_8B, num_hidden_layers=args.layers)
        bw = copy_bandwidth()
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(cfg), dtype=dtype, device=dev, init="normal")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_bytes = weight_bytes - model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    mc = model.config
    kv_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * torch.finfo(dtype).bits // 8
    mean_ctx = args.prompt + args.new / 2
    floor = bw / (read_bytes + mean_ctx * kv_per_token)
    print(f"copy bw {bw / 1e12:.2f} TB/s, bytes/step {(read_bytes + mean_ctx * kv_per_token) / 1e9:.2f} GB, "
          f"floor {floor:.1f} tok/s ({1e3 / floor:.2f} ms/step)", flush=True)

    tuned = None
    try:
        tuned = tune_fused_act(model, dev, dry)
    except Exception:
        traceback.print_exc()
        print("fused-act tuning failed: mode 3 uses the TUNED fallback config", flush=True)

    prompt = torch.randint(0, mc.vocab_size - 1, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    for mode in ("cublas", "gemv", "gemv+act"):
        try:
            if mode == "gemv":
                use_triton_gemv_(model, max_m=16, fuse_act=False, force=dry)
            elif mode == "gemv+act":
                use_triton_gemv_(model, max_m=16, fuse_act=True, force=dry)
            r = run_mode(model, mode, args, dev, prompt)
        except Exception as e:
            traceback.print_exc()
            r = {"mode": mode, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        nan = float("nan")
        print(f"{mode}: {r.get('tok_s', nan):.1f} tok/s, replay {r.get('graph_replay_ms', nan):.3f} ms"
              f" [{time.perf_counter() - t_start:.0f}s]", flush=True)

    base = results[0]
    cases = []
    for r in results:
        if "tok_s" not in r:
            continue
        agree = sum(int(a == b) for a, b in zip(r["first16"], base.get("first16", [])))
        peers = {"cublas linears (same engine)": base["tok_s"]} if r is not base and "tok_s" in base else {}
        cases.append(case(f"llama3.1-8b-shape decode bs1 prompt{args.prompt} new{args.new} bf16 linears={r['mode']}",
                          metric="decode throughput", unit="tok/s", ours=r["tok_s"], peers=peers, floor=floor,
                          graph_replay_ms=r.get("graph_replay_ms"),
                          graph_replay_tok_s=1e3 / r["graph_replay_ms"] if r.get("graph_replay_ms") else None,
                          greedy_first16_agree_with_cublas=agree, profile=r.get("profile"),
                          copy_bw_TBps=bw / 1e12, bytes_per_step=read_bytes + mean_ctx * kv_per_token))  # fmt: skip
    if tuned is not None:
        best_s = tuned["best"]["config"]
        us = min(row["us"] for row in tuned["rows"])
        cases.append(case(f"fused gate_up+silu GEMV {tuned['shape'][0]}x{tuned['shape'][1]} M=1 bf16",
                          metric="weight bandwidth", unit="TB/s", ours=tuned["bytes"] / (us * 1e-6) / 1e12,
                          peers={p: tuned["bytes"] / (t * 1e-6) / 1e12 for p, t in tuned["peers_us"].items()},
                          floor=bw / 1e12, fused_act_best={f"{tuned['shape'][0]},{tuned['shape'][1]},1":
                                                           {"config": best_s, "speedup": tuned["best"]["speedup"]}},
                          rows=tuned["rows"]))  # fmt: skip
    write_results(args.out, "decode_step", torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", cases)

    print(f"\n{'mode':10s} {'tok/s':>8s} {'/floor':>7s} {'replay ms':>10s} {'kernels':>8s} {'kern us':>8s}")
    for r in results:
        p = r.get("profile") or {}
        print(f"{r['mode']:10s} {r.get('tok_s', float('nan')):8.1f} {r.get('tok_s', float('nan')) / floor:7.3f} "
              f"{r.get('graph_replay_ms', float('nan')):10.3f} {p.get('kernels_per_step', float('nan')):8.0f} "
              f"{p.get('kernel_us_per_step', float('nan')):8.0f}")
    for r in results:
        top = (r.get("profile") or {}).get("top") or []
        if top:
            print(f"\ntop kernels, {r['mode']} (us/step, calls/step):")
            for row in top[:12]:
                print(f"  {row['us_per_step']:8.1f} {row['calls_per_step']:5.0f}  {row['kernel'][:90]}")
    print(f"floor {floor:.1f} tok/s; wrote {args.out} in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
