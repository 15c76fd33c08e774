"""End-to-end decode throughput at a fixed KV budget: multi-granularity pages vs the uniform layout.

Two hybrid shapes with random bf16 weights and their layer count scaled down:

* ``gemma3_27b`` -- Gemma-3-27B (5 sliding layers of window 1024 per global layer);
* ``qwen3_next_80b`` -- Qwen3-Next-80B-A3B (3 gated-DeltaNet layers per gated-attention layer,
  512 experts, top-10).

Each runs the same workload (``N`` requests of ``prompt`` random tokens, ``new`` greedy tokens,
EOS ignored, prefix caching off) through the Engine twice, with ``kv_layout="multi"`` and
``"uniform"``, at the same KV byte budget. Reported per layout: decode tok/s (tokens sampled in
decode-only steps / their wall time), end-to-end output tok/s, mean and peak decode batch, and
how many such requests the empty pool holds at once (from the KV manager, no forward). The
headline is ``ours_vs_best_peer`` = multi / uniform decode tok/s. The floor is the weight-read
bound at multi's mean decode batch: ``batch * bandwidth / weight bytes`` (KV reads ignored, so it
is a loose upper bound). Each launch is timed synchronized on both sides, and three decode-only
steps (from the 50th) run under torch.profiler: ``decode_profile`` lists where their time went
(device kernels on CUDA, CPU ops otherwise).

    python benchmarks/bench_hybrid_e2e.py --out benchmarks/results/h200     # H200, ~2-4 min
    python benchmarks/bench_hybrid_e2e.py --tiny --out /tmp/hybrid          # CPU smoke test

The DeltaNet / conv / gated-norm ops dispatch to their Triton kernels on CUDA; to time the
references instead, set e.g. ``INFERCORE_BACKEND=chunk_gated_delta_rule_:reference``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, log_triton_compiles, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.kv.hybrid import HybridBlockManager  # noqa: E402
from infercore.models import Gemma3Config, Qwen3NextConfig, build_model  # noqa: E402


def gemma3_27b(layers: int) -> Gemma3Config:
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    return Gemma3Config(
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_layers=layers, num_heads=32,
        num_kv_heads=16, head_dim=128, sliding_window=1024, layer_types=types, max_position_embeddings=131072,
        rope_theta=1_000_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_theta=10000.0,
        query_pre_attn_scalar=168.0, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
    )  # fmt: skip


def qwen3_next_80b(layers: int) -> Qwen3NextConfig:
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return Qwen3NextConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_layers=layers, num_heads=16,
        num_kv_heads=2, head_dim=256, layer_types=types, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        partial_rotary_factor=0.25, max_position_embeddings=262144, rope_theta=10_000_000.0,
    )  # fmt: skip


def tiny_gemma3() -> Gemma3Config:
    return Gemma3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
        head_dim=16, sliding_window=16, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=1024, query_pre_attn_scalar=16.0, tie_word_embeddings=True,
    )  # fmt: skip


def tiny_qwen3_next() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=1024, partial_rotary_factor=0.5,
    )  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capacity(eng: Engine, num_tokens: int, chunk: int) -> int:
    """Requests of ``num_tokens`` tokens an empty pool of ``eng``'s layout holds once their prompts
    are in (sliding pages beyond the window released), counted on a fresh manager."""
    bm = eng.block_manager
    fresh = HybridBlockManager(bm.layout, bm.pool.num_large, enable_prefix_caching=False)
    n = 0
    while fresh.allocate(n, [], min(chunk, num_tokens), max_cached_tokens=0) is not None:
        ok = True
        for end in range(min(chunk, num_tokens), num_tokens + 1, chunk):
            fresh.mark_computed(n, [0] * end, end)
            if not fresh.grow(n, min(end + chunk, num_tokens)):
                ok = False
                break
        if not ok:
            fresh.free(n)
            break
        fresh.mark_computed(n, [0] * num_tokens, num_tokens)
        n += 1
    return n


PROFILE_FROM, PROFILE_STEPS = 50, 3  # decode-only steps profiled (kernel breakdown in the JSON)


def _activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _add_profile(acc: dict, prof, batch: int, device: torch.device) -> None:
    """Accumulate self time per kernel (CUDA: device time) or op (CPU) over the profiled steps."""
    acc.setdefault("batches", []).append(batch)
    kernels = acc.setdefault("us", {})
    for ev in prof.key_averages():
        if device.type == "cuda":  # the attribute's older name, as bench_decode_step reads it too
            t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
        else:
            t = ev.self_cpu_time_total
        if t > 0:
            kernels[ev.key[:100]] = kernels.get(ev.key[:100], 0.0) + t


def _summarize_profile(acc: dict, top: int = 25) -> dict | None:
    if not acc:
        return None
    n = len(acc["batches"])
    rows = sorted(((k, v / n) for k, v in acc["us"].items()), key=lambda r: -r[1])
    return {"steps": n, "batches": acc["batches"], "us_per_step_total": sum(v for _, v in rows),
            "top": [{"name": k, "us_per_step": v} for k, v in rows[:top]]}


COMPILES: list[dict] = []  # Triton JIT compiles (_common.log_triton_compiles)


def _changed_args(c: dict) -> list[str] | str:
    """Where the compile's cache key (argument types and specializations) differs from the kernel's
    previous compile: the differing comma-separated fields, new (old)."""
    prev = [p for p in COMPILES if p["kernel"] == c["kernel"] and p["at"] < c["at"]]
    if not prev:
        return "first compile of this kernel"
    a, b = c["key"].split(", "), prev[-1]["key"].split(", ")
    return [f"#{i}: {x} (was {y})" for i, (x, y) in enumerate(zip(a, b)) if x != y] or [c["key"][:2000]]


def run(model, layout: str, args, device: torch.device) -> dict:
    eng = Engine(model, page_size=args.page, kv_cache_bytes=args.kv_gib_bytes, kv_layout=layout,
                 max_num_seqs=args.max_seqs, max_num_batched_tokens=args.chunk,
                 enable_prefix_caching=False)  # fmt: skip
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # Warm-up, not timed: Triton specializes integer arguments (== 1, divisible by 16), so run
    # batches of several sizes through prefill and decode for both layouts alike.
    for n in (1, 16, 17):
        eng.generate([torch.randint(0, vocab, (32 + i,), generator=gen).tolist() for i in range(n)],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.requests)]

    steps: list[tuple[bool, int, float]] = []  # (decode only, batch size, seconds)
    other: list[tuple[int, float, int]] = []  # steps with prefill tokens: (tokens, seconds, Triton compiles)
    compiled: list[dict] = []  # the compiles inside those steps
    profile: dict = {}

    def timed(launch):
        # Each step's launch, synchronized on both sides: its device time plus its host work (the
        # async engine would overlap the host work of step n+1 with step n; here it does not).
        # Decode-only steps 50-52 (fewer new tokens: from new / 2) also run under torch.profiler:
        # where a decode step's time goes.
        def timed_launch(batch, gather):
            decode = max(batch.num_new_tokens) == 1
            first = min(PROFILE_FROM, args.new // 2)
            n_compiled = len(COMPILES)
            prof = decode and first <= sum(d for d, _, _ in steps) < first + PROFILE_STEPS
            sync(device)
            t = time.perf_counter()
            if prof:
                with torch.profiler.profile(activities=_activities(device)) as p:
                    out = launch(batch, gather)
                    sync(device)
                _add_profile(profile, p, len(batch), device)
            else:
                out = launch(batch, gather)
            sync(device)
            dt = time.perf_counter() - t
            steps.append((decode, len(batch), dt))
            if not decode:
                other.append((sum(batch.num_new_tokens), dt, len(COMPILES) - n_compiled))
                compiled.extend(COMPILES[n_compiled:])
            return out

        return timed_launch

    for runner in (eng.runner, eng.graph_runner):
        if runner is not None:
            runner.launch = timed(runner.launch)
    sync(device)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    sync(device)
    total = time.perf_counter() - t0
    assert all(len(o.token_ids) == args.new for o in outs)
    dec = [(b, s) for d, b, s in steps if d]
    dec_tokens, dec_time = sum(b for b, _ in dec), sum(s for _, s in dec)
    res = {
        "decode_tok_s": dec_tokens / dec_time,
        "e2e_tok_s": args.requests * args.new / total,
        "mean_decode_batch": dec_tokens / max(1, len(dec)),
        "peak_batch": max(b for _, b, _ in steps),
        "capacity": capacity(eng, args.prompt + args.new, args.chunk),
        "large_page_bytes": eng.block_manager.layout.large_bytes,
        "page_tokens": eng.block_manager.layout.page_tokens,
        "steps": len(steps),
        "seconds": total,
        "decode_profile": _summarize_profile(profile),
        # steps with prompt tokens (prefill chunks, mixed prefill + decode), run eagerly: their time and
        # the Triton JIT compiles inside them (new specializations the warm-up did not cover)
        "prefill_steps": {"steps": len(other), "tokens": sum(o[0] for o in other),
                          "seconds": sum(o[1] for o in other), "compiles": sum(o[2] for o in other),
                          "seconds_of_steps_with_compiles": sum(o[1] for o in other if o[2]),
                          "compiled": [{"kernel": c["kernel"], "changed": _changed_args(c)} for c in compiled]},
        "decode_seconds": dec_time,
    }
    del eng
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/h200", help="directory (or .json path) for the results")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--models", default="gemma3_27b,qwen3_next_80b")
    ap.add_argument("--gemma-layers", type=int, default=12)
    ap.add_argument("--qwen-layers", type=int, default=8)
    args = ap.parse_args()

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        log_triton_compiles(COMPILES)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16

    # Workloads: (config, prompt, new, requests, KV budget GiB, chunk). The Gemma budget holds ~15
    # uniform requests; the Qwen3-Next requests are short, where uniform's state-sized pages
    # (1056 tokens) waste the most -- at long contexts both layouts hold the same number. Even
    # here the pool model (benchmarks/sim_hybrid_kv.py) bounds the gain: 66 vs 61 requests, 1.08x.
    if args.tiny:
        work = {"gemma3_27b": (tiny_gemma3(), 96, 32, 16, 1 / 1024, 64),
                "qwen3_next_80b": (tiny_qwen3_next(), 24, 16, 16, 1 / 1024, 64)}  # fmt: skip
    else:
        work = {"gemma3_27b": (gemma3_27b(args.gemma_layers), 4096, 256, 64, 6.0, 2048),
                "qwen3_next_80b": (qwen3_next_80b(args.qwen_layers), 512, 256, 192, 1.0, 2048)}  # fmt: skip
    bw = copy_bandwidth() if device.type == "cuda" else None

    cases = []
    for name in args.models.split(","):
        cfg, prompt, new, requests, gib, chunk = work[name]
        torch.manual_seed(0)
        model = build_model(cfg, dtype=dtype, device=device)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ns = argparse.Namespace(page=16, kv_gib_bytes=int(gib * (1 << 30)), max_seqs=512, chunk=chunk,
                                prompt=prompt, new=new, requests=requests)  # fmt: skip
        res = {layout: run(model, layout, ns, device) for layout in ("multi", "uniform")}
        m, u = res["multi"], res["uniform"]
        floor = m["mean_decode_batch"] * bw / weight_bytes if bw else None
        shape = f"{name}: {cfg.num_layers} layers, {requests} x ({prompt} + {new}) tokens, KV {gib:g} GiB"
        for key in ("decode_tok_s", "e2e_tok_s"):
            cases.append(case(
                f"{shape}, {key.removesuffix('_tok_s')}", metric=key, unit="tok/s", ours=m[key],
                peers={"uniform": u[key]}, floor=floor if key == "decode_tok_s" else None,
                multi=m, uniform=u, weight_bytes=weight_bytes,
            ))  # fmt: skip
        print(f"{shape}: decode multi {m['decode_tok_s']:.0f} tok/s (batch {m['mean_decode_batch']:.1f}, "
              f"capacity {m['capacity']}) vs uniform {u['decode_tok_s']:.0f} tok/s (batch "
              f"{u['mean_decode_batch']:.1f}, capacity {u['capacity']}): "
              f"{m['decode_tok_s'] / u['decode_tok_s']:.2f}x")  # fmt: skip
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    path = args.out if args.out.endswith(".json") else os.path.join(args.out, "hybrid_e2e.json")
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    write_results(path, "hybrid_e2e", dev_name, cases)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
