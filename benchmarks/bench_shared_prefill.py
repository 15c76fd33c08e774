"""Requests that share a prompt prefix, submitted together: the scheduler's in-flight prefix sharing
(``Scheduler.share_prefills``: a request waits for the pages another running request is computing, then takes
them from the prefix cache) against the same engine with it off (prefix caching alone, which only helps
requests admitted after the pages were computed).

Two workloads, each ``generate()`` from a cold prefix cache, alternating on / off for ``--rounds``, best kept:

- ``n`` sampled completions of one prompt (seeds 0..n-1, ``temperature=1``), as ``n`` / best-of users submit them;
- ``n`` questions behind one shared system prompt.

Prompts are token runs of ``pydoc_data.topics`` (ships with Python). Default model: SmolLM2-135M-Instruct over its
own GGUF Q4_1 blocks on the CPU (the demo's); ``--device cuda`` runs it in bf16 on a GPU, and ``--llama8b`` takes a
random bf16 model of the Llama-3.1-8B shape instead (``bench_e2e``'s; prompts are then random token ids).

    python benchmarks/bench_shared_prefill.py --out benchmarks/results/cpu/shared_prefill.json
    python benchmarks/bench_shared_prefill.py --device cuda --llama8b --n 16 --prompt-tokens 2048 --out ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from _common import case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402


def run(eng: Engine, prompts: list[list[int]], params: list[SamplingParams], share: bool) -> tuple[float, int, list]:
    """Seconds of one cold ``generate``, prompt tokens computed (not cache hits), and the outputs' tokens."""
    eng.block_manager.reset_prefix_cache()
    eng.scheduler.share_prefills = share
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    computed = sum(len(p) - o.metrics.num_cached_tokens for p, o in zip(prompts, outs))
    return dt, computed, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8, help="requests per workload")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="the shared prompt / system prompt")
    ap.add_argument("--question-tokens", type=int, default=48, help="each request's own tail (system-prompt case)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=0, help="max_num_batched_tokens (0: the engine's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--llama8b", action="store_true", help="a random bf16 model of the Llama-3.1-8B shape")
    ap.add_argument("--layers", type=int, default=32, help="its layers (--llama8b)")
    ap.add_argument("--out", default="benchmarks/results/cpu/shared_prefill.json")
    args = ap.parse_args()
    n, p, q = args.n, args.prompt_tokens, args.question_tokens
    kw = dict(max_num_batched_tokens=args.budget) if args.budget else {}
    if args.llama8b:
        from bench_e2e import LLAMA_8B

        from infercore.models import ModelConfig, build_model

        cfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
        model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device=args.device, init="normal")
        eng = Engine(model, None, max_model_len=p + n * q + args.max_tokens + 16, **kw)
        ids = torch.randint(0, cfg["vocab_size"], (p + n * q,), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        from pydoc_data.topics import topics

        if args.device == "cpu":
            kw["quantization"] = "gguf"
        eng = Engine.from_pretrained(device=args.device, dtype=torch.bfloat16, **kw)
        ids = eng.tokenizer.encode(" ".join(topics.values()), add_special_tokens=False)
    same = [ids[:p]] * n
    system = [ids[:p] + ids[p + i * q : p + (i + 1) * q] for i in range(n)]
    workloads = {
        f"{n} sampled completions of one {p}-token prompt": (
            same, [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
                   for i in range(n)]),
        f"{n} requests behind one {p}-token system prompt ({q} own tokens each)": (
            system, [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)] * n),
    }
    run(eng, same[:2], workloads[next(iter(workloads))][1][:2], True)  # warm-up
    cases = []
    for name, (prompts, params) in workloads.items():
        best = {True: float("inf"), False: float("inf")}
        computed, tokens = {}, {}
        for _ in range(args.rounds):
            for share in (True, False):
                dt, computed[share], tokens[share] = run(eng, prompts, params, share)
                best[share] = min(best[share], dt)
        same_tokens = tokens[True] == tokens[False]
        print(f"{name}: shared {best[True]:.3f} s ({computed[True]} prompt tokens computed), without "
              f"{best[False]:.3f} s ({computed[False]}); same tokens: {same_tokens}", flush=True)
        cases.append(case(
            name, metric="time-based speedup of generate() over the engine without in-flight prefix sharing",
            unit="x", ours=best[False] / best[True], peers={}, floor=None,
            seconds={"shared": best[True], "without": best[False]},
            prompt_tokens_computed={"shared": computed[True], "without": computed[False]},
            prompt_tokens_total=sum(len(x) for x in prompts), same_tokens=same_tokens,
            max_tokens=args.max_tokens, max_num_batched_tokens=eng.config.max_num_batched_tokens,
            threads=torch.get_num_threads()))
    device = torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu"
    model_name = "random Llama-3.1-8B shape, bf16" if args.llama8b else "SmolLM2-135M-Instruct"
    write_results(args.out, "shared_prefill", device, cases, extra={"model": model_name})


if __name__ == "__main__":
    main()
