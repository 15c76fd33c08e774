"""Returning multi-turn sessions with a GPU KV pool too small for them all: the CPU KV tier vs recompute.

Llama-3.1-8B shape, random bf16 weights, one GPU. ``--sessions`` sessions with 2-3.5k-token histories
(turn 1, untimed) share a KV pool that holds about ``--pool-sessions`` of them. Then every session comes
back (its prompt: its history, its answer and ``--user`` new tokens), first one at a time in turn-1 order
(least recently used first: each return finds its pages evicted by the others), then all at once. Two
engines run the same protocol: ``EngineConfig.cpu_kv_cache_bytes`` set (evicted pages were copied to
pinned host memory and come back by host-to-device copies) and 0 (evicted history is recomputed).

Reported: prompt tokens served per second of the returning turns (tokens of their prompts / wall time of
the turns, decode of ``--new`` tokens included), higher is better; time-to-first-token of the returning
turns in ms as extra keys. Floor: the returning prompts' tokens / (bytes the tier loaded / host-to-device
bandwidth of pinned copies measured in the same run), i.e. the rate if moving the history back were the
only cost.

    python benchmarks/bench_kv_tier.py --out benchmarks/results/h200/kv_tier.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, write_results  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.kv import bytes_per_page  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402

PAGE = 16


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pinned_bandwidth(nbytes: int = 1 << 29) -> tuple[float, float]:
    """Host-to-device and device-to-host bytes/s of pinned copies."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = nbytes / (bench_ms(lambda: dev.copy_(host, non_blocking=True), warmup=3, rep=20) * 1e-3)
    d2h = nbytes / (bench_ms(lambda: host.copy_(dev, non_blocking=True), warmup=3, rep=20) * 1e-3)
    return h2d, d2h


def ms_stats(xs: list[float], prefix: str) -> dict[str, float]:
    xs = sorted(x * 1e3 for x in xs)
    return {f"{prefix}_mean": statistics.fmean(xs), f"{prefix}_median": statistics.median(xs),
            f"{prefix}_p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))]}


def ttft(out) -> float:
    return out.metrics.first_token_time - out.metrics.arrival_time


def run_protocol(eng: Engine, histories: list[list[int]], args, rng: torch.Generator) -> dict:
    """Turn 1 (all sessions), then the sessions' returns one at a time, then all at once."""
    sp = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    tier = eng.cpu_tier
    page_bytes = tier.page_bytes if tier is not None else 0

    def user_tokens() -> list[int]:
        return torch.randint(0, 100000, (args.user,), generator=rng).tolist()

    res: dict = {}
    sync()
    t = time.perf_counter()
    outs = eng.generate(histories, sp)
    sync()
    res["turn1_s"] = time.perf_counter() - t
    prompts = [h + o.token_ids + user_tokens() for h, o in zip(histories, outs)]

    # returns one at a time
    loaded0 = tier.stats.loaded if tier else 0
    demoted0 = tier.stats.demoted if tier else 0
    seq_outs, seq_times = [], []
    for p in prompts:
        sync()
        t = time.perf_counter()
        seq_outs += eng.generate([p], sp)
        sync()
        seq_times.append(time.perf_counter() - t)
    res["seq"] = dict(
        prompt_tokens=sum(len(p) for p in prompts), wall_s=sum(seq_times), ttfts=[ttft(o) for o in seq_outs],
        cpu_hit=sum(o.metrics.num_cpu_cached_tokens for o in seq_outs),
        gpu_hit=sum(o.metrics.num_gpu_cached_tokens for o in seq_outs),
        loaded_bytes=((tier.stats.loaded - loaded0) if tier else 0) * page_bytes,
        demoted_bytes=((tier.stats.demoted - demoted0) if tier else 0) * page_bytes,
        tokens=[o.token_ids for o in seq_outs],
    )  # fmt: skip
    prompts = [p + o.token_ids + user_tokens() for p, o in zip(prompts, seq_outs)]

    # returns all at once
    loaded0 = tier.stats.loaded if tier else 0
    demoted0 = tier.stats.demoted if tier else 0
    sync()
    t = time.perf_counter()
    outs = eng.generate(prompts, sp)
    sync()
    res["all"] = dict(
        prompt_tokens=sum(len(p) for p in prompts), wall_s=time.perf_counter() - t, ttfts=[ttft(o) for o in outs],
        cpu_hit=sum(o.metrics.num_cpu_cached_tokens for o in outs),
        gpu_hit=sum(o.metrics.num_gpu_cached_tokens for o in outs),
        preemptions=sum(o.metrics.num_preemptions for o in outs),
        loaded_bytes=((tier.stats.loaded - loaded0) if tier else 0) * page_bytes,
        demoted_bytes=((tier.stats.demoted - demoted0) if tier else 0) * page_bytes,
        tokens=[o.token_ids for o in outs],
    )  # fmt: skip
    return res


def warm_up(eng: Engine, args, lengths: list[int]) -> None:
    """Run the whole protocol once on histories of the same lengths but tokens no session uses, then
    forget the cache (the tier's too): every kernel specialization the timed run meets (Triton
    specializes integer arguments by divisibility, e.g. the new-token counts of prefills over a cached
    prefix) is compiled before it, and the host-side pinned index buffers are cached."""
    g = torch.Generator().manual_seed(99)
    histories = [torch.randint(100000, 128000, (n,), generator=g).tolist() for n in lengths]
    run_protocol(eng, histories, args, torch.Generator().manual_seed(98))
    sync()
    eng.block_manager.reset_prefix_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/kv_tier.json")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--min-history", type=int, default=2048)
    ap.add_argument("--max-history", type=int, default=3584)
    ap.add_argument("--user", type=int, default=64, help="new user tokens per returning turn")
    ap.add_argument("--new", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--pool-sessions", type=float, default=4.0, help="GPU KV pool size, in longest sessions")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--smoke", action="store_true",
                    help="check the script on the CPU: a narrow model (hidden 64), 4 short sessions")
    args = ap.parse_args()
    t_start = time.perf_counter()

    cfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
    if args.smoke:
        dev = torch.device("cpu")
        cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2)
        args.sessions, args.min_history, args.max_history, args.user, args.new = 4, 200, 400, 16, 4
        args.pool_sessions = 1.5
        h2d = d2h = float("nan")
    else:
        dev = torch.device("cuda")
        h2d, d2h = pinned_bandwidth()
    print(f"pinned copies: host->device {h2d / 1e9:.1f} GB/s, device->host {d2h / 1e9:.1f} GB/s", flush=True)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device=dev, init="normal")
    print(f"model built ({time.perf_counter() - t_start:.0f} s)", flush=True)

    g = torch.Generator().manual_seed(1)
    n = args.sessions
    lengths = [args.min_history + (args.max_history - args.min_history) * i // max(1, n - 1) for i in range(n)]
    histories = [torch.randint(0, 100000, (L,), generator=g).tolist() for L in lengths]
    longest = args.max_history + 3 * (args.new + args.user) + 2 * PAGE
    max_model_len = -(-longest // PAGE) * PAGE + PAGE
    pages_per_session = -(-longest // PAGE)
    pool_pages = int(args.pool_sessions * pages_per_session)
    kv_page_bytes = bytes_per_page(model.kv_specs(), PAGE, torch.bfloat16)
    # the tier holds every session's pages with room to spare
    tier_bytes = int(1.15 * n * pages_per_session * kv_page_bytes)
    common = dict(page_size=PAGE, num_pages=pool_pages, max_num_seqs=n, max_num_batched_tokens=8192,
                  max_model_len=max_model_len, cuda_graph_max_batch=n, async_scheduling=not args.smoke)
    print(f"{n} sessions of {lengths[0]}-{lengths[-1]} tokens; KV pool {pool_pages} pages "
          f"({pool_pages * kv_page_bytes / 2**30:.2f} GiB, ~{args.pool_sessions:g} sessions); "
          f"tier {tier_bytes / 2**30:.2f} GiB", flush=True)

    results = {}
    for mode in ("recompute", "tier"):
        t = time.perf_counter()
        eng = Engine(model, cpu_kv_cache_bytes=tier_bytes if mode == "tier" else 0, **common)
        warm_up(eng, args, lengths)
        results[mode] = run_protocol(eng, histories, args, torch.Generator().manual_seed(2))
        r = results[mode]
        print(f"{mode}: turn 1 {r['turn1_s']:.2f} s; returns one at a time {r['seq']['wall_s']:.2f} s "
              f"(TTFT median {statistics.median(r['seq']['ttfts']) * 1e3:.1f} ms, cpu hits {r['seq']['cpu_hit']}, "
              f"gpu hits {r['seq']['gpu_hit']}); all at once {r['all']['wall_s']:.2f} s (TTFT median "
              f"{statistics.median(r['all']['ttfts']) * 1e3:.1f} ms, cpu hits {r['all']['cpu_hit']}, "
              f"preemptions {r['all']['preemptions']}) [{time.perf_counter() - t:.0f} s]", flush=True)
        if eng.cpu_tier is not None:
            print(f"  tier stats {eng.cpu_tier.stats}", flush=True)
        sync()  # the tier's copies are done before its buffers go
        del eng
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    cases = []
    for key, label in (("seq", "returning one at a time"), ("all", "returning all at once")):
        tr, rc = results["tier"][key], results["recompute"][key]
        ours = tr["prompt_tokens"] / tr["wall_s"]
        peer = rc["prompt_tokens"] / rc["wall_s"]
        floor = tr["prompt_tokens"] / (tr["loaded_bytes"] / h2d) if tr["loaded_bytes"] and h2d == h2d else None
        agree = [a == b for x, y in zip(tr["tokens"], rc["tokens"]) for a, b in zip(x, y)]
        extra = {**ms_stats(tr["ttfts"], "ttft_ms_tier"), **ms_stats(rc["ttfts"], "ttft_ms_recompute")}
        cases.append(case(
            f"llama3.1-8b-shape {n} sessions {lengths[0]}-{lengths[-1]}-token history, {label}, pool ~"
            f"{args.pool_sessions:g} sessions, bf16 KV", metric="returning-turn prompt tokens served", unit="tok/s",
            ours=ours, peers={"recompute (no CPU tier)": peer}, floor=floor, **extra,
            ttft_speedup_median=extra["ttft_ms_recompute_median"] / extra["ttft_ms_tier_median"],
            wall_s_tier=tr["wall_s"], wall_s_recompute=rc["wall_s"], prompt_tokens=tr["prompt_tokens"],
            cpu_tier_hit_tokens=tr["cpu_hit"], gpu_hit_tokens_tier=tr["gpu_hit"],
            gpu_hit_tokens_recompute=rc["gpu_hit"],
            loaded_GB=tr["loaded_bytes"] / 1e9, demoted_GB=tr["demoted_bytes"] / 1e9,
            h2d_GBps=h2d / 1e9, d2h_GBps=d2h / 1e9, greedy_tokens_agree=sum(agree) / max(1, len(agree)),
            preemptions_tier=tr.get("preemptions"), preemptions_recompute=rc.get("preemptions"),
            ttfts_ms_tier=[round(x * 1e3, 2) for x in tr["ttfts"]],
            ttfts_ms_recompute=[round(x * 1e3, 2) for x in rc["ttfts"]],
        ))  # fmt: skip
        print(f"{label}: tier {ours:.0f} tok/s vs recompute {peer:.0f} tok/s ({ours / peer:.2f}x); floor "
              f"{floor or float('nan'):.0f} tok/s; TTFT median {extra['ttft_ms_tier_median']:.1f} ms vs "
              f"{extra['ttft_ms_recompute_median']:.1f} ms", flush=True)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
    write_results(args.out, "kv_tier", device, cases,
                  extra={"config": {**vars(args), "pool_pages": pool_pages, "tier_bytes": tier_bytes,
                                    "history_lengths": lengths}})
    print(f"wrote {args.out} ({time.perf_counter() - t_start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
