"""Offline serving throughput of the Llama-3.1-8B shape: many requests of mixed lengths at once.

``--requests`` requests (prompt and output lengths drawn uniformly from ``--prompt-range`` and
``--output-range``, seeded; random bf16 weights, greedy, ``ignore_eos``) are added together and the
Engine runs them to completion under continuous batching (``--max-seqs`` running, chunked prefill with
a ``--budget``-token step), so most steps mix prefill chunks with decodes, as in a loaded server. Timed:
the whole run after a short warm-up run. Compared in the same process:

* ours: the engine's defaults (mixed steps' decodes through the decode kernel, ``SPLIT_DECODES_MIN``);
* peer "decodes in the prefill kernel": the same engine with that split off.

Floor: the run's output tokens over the time to read the weights once per step and every KV byte the
decode steps read, at the measured copy bandwidth, plus the prefill FLOPs at the measured matmul rate
(a lower bound that ignores that prefill and decode share steps).

    python benchmarks/bench_serving_throughput.py --out benchmarks/results/h200/serving.json   # H200, ~2 min
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, log_triton_compiles, matmul_flops, write_results  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.engine import runner  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402


def run(eng: Engine, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
    """Seconds to finish every request, and the number of engine steps."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for p, n in reqs:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - t, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--prompt-range", default="128,1024")
    ap.add_argument("--output-range", default="64,512")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw, flops = copy_bandwidth(), matmul_flops()
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(dict(LLAMA_8B, num_hidden_layers=args.layers)), dtype=torch.bfloat16,
                        device=dev, init="normal")  # fmt: skip
    read_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - 128256 * 4096 * 2
    kv_per_token = args.layers * 2 * 8 * 128 * 2
    (p_lo, p_hi), (o_lo, o_hi) = (map(int, r.split(",")) for r in (args.prompt_range, args.output_range))
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(p_lo, p_hi + 1, (args.requests,), generator=gen).tolist()
    outs = torch.randint(o_lo, o_hi + 1, (args.requests,), generator=gen).tolist()
    reqs = [(torch.randint(0, 128000, (n,), generator=gen).tolist(), m) for n, m in zip(lens, outs)]
    page = 16
    pages = args.max_seqs * -(-(p_hi + o_hi + page) // page) + 64
    eng = Engine(model, num_pages=pages, page_size=page, max_num_seqs=args.max_seqs,
                 max_num_batched_tokens=args.budget, max_model_len=p_hi + o_hi + page, enable_prefix_caching=False,
                 cuda_graph_max_batch=args.max_seqs)  # fmt: skip
    default_min = runner.SPLIT_DECODES_MIN
    run(eng, reqs[:64])  # warm-up: compiles the prefill / mixed-step kernels
    compiles: list[dict] = []
    log_triton_compiles(compiles)
    times, compiled = {}, {}
    for name, mode in (("split", default_min), ("whole", 10**9), ("split_again", default_min)):
        runner.SPLIT_DECODES_MIN = mode
        n = len(compiles)
        times[name] = run(eng, reqs)
        compiled[name] = [{"kernel": c["kernel"], "key": c["key"][:3000]} for c in compiles[n:]]  # inside the run
        print(f"{name}: {times[name][0]:.2f} s, {times[name][1]} steps, {len(compiled[name])} compiles, "
              f"{sum(outs) / times[name][0]:.0f} output tok/s", flush=True)
    runner.SPLIT_DECODES_MIN = default_min
    out_tokens, in_tokens = sum(outs), sum(lens)
    # floor: each decode step reads the weights once (steps >= the longest output), plus every decode's KV
    decode_kv = sum(m * (n + m / 2) for n, m in zip(lens, outs)) * kv_per_token
    min_steps = max(max(outs), -(-out_tokens // args.max_seqs))
    prefill_flops = 2 * in_tokens * (read_bytes / 2) + args.layers * 2 * 32 * 128 * sum(n * n for n in lens)
    floor_s = (min_steps * read_bytes + decode_kv) / bw + prefill_flops / flops
    best = min(times["split"][0], times["split_again"][0])
    cases = [case(
        f"llama3.1-8b-shape offline serving: {args.requests} requests, prompts {p_lo}-{p_hi}, outputs {o_lo}-{o_hi}, "
        f"{args.max_seqs} running, {args.budget}-token steps, bf16",
        metric="output tokens per second", unit="tok/s", ours=out_tokens / best,
        peers={"decodes in the prefill kernel": out_tokens / times["whole"][0]}, floor=out_tokens / floor_s,
        total_tok_s=(out_tokens + in_tokens) / best, run_s={k: v[0] for k, v in times.items()},
        steps={k: v[1] for k, v in times.items()}, compiles_in_run=compiled, output_tokens=out_tokens,
        prompt_tokens=in_tokens,
        copy_bw_TBps=bw / 1e12, matmul_TFLOPs=flops / 1e12,
    )]  # fmt: skip
    print(f"output {out_tokens / best:.0f} tok/s (total {(out_tokens + in_tokens) / best:.0f}), split off "
          f"{out_tokens / times['whole'][0]:.0f}, floor {out_tokens / floor_s:.0f}", flush=True)
    write_results(args.out, "serving", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
