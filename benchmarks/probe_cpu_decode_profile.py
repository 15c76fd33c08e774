"""Where a CPU decode step of SmolLM2-135M-Instruct spends its time: wall time per token of the Engine's greedy
decode, and cProfile's totals for the native kernels' wrappers (every call's ctypes, OpenMP region and kernel),
ATen's linears and the layer modules, per token.

    python benchmarks/probe_cpu_decode_profile.py [--dtype bfloat16] [--scheme gguf] [--tokens 33]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402
from bench_cpu_decode import PROMPT  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scheme", default=None, help="quantization passed to Engine.from_pretrained (e.g. gguf)")
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/probe_cpu_decode_profile.json")
    args = ap.parse_args()
    eng = Engine.from_pretrained(device="cpu", dtype=getattr(torch, args.dtype), quantization=args.scheme,
                                 enable_prefix_caching=False)
    ids = eng.tokenizer.encode(
        eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True),
        add_special_tokens=False)

    def run(n: int) -> None:
        eng.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    def timed(n: int) -> float:
        t = time.perf_counter()
        run(n)
        return time.perf_counter() - t

    run(4)
    n = args.tokens
    t1, tn = min(timed(1) for _ in range(3)), min(timed(n) for _ in range(3))
    ms_token = (tn - t1) / (n - 1) * 1e3
    prof = cProfile.Profile()
    prof.enable()
    run(n)
    prof.disable()
    prof.create_stats()
    rows = {}
    for (file, _, func), (_, ncalls, tottime, cumtime, _) in prof.stats.items():
        where = os.path.relpath(file, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) \
            if file.startswith("/") else file
        if "infercore" in where or "mkldnn" in func or "linear" in func:
            rows[f"{where}:{func}"] = dict(calls_per_token=ncalls / n, tottime_ms_per_token=tottime / n * 1e3,
                                           cumtime_ms_per_token=cumtime / n * 1e3)
    top = dict(sorted(rows.items(), key=lambda kv: -kv[1]["tottime_ms_per_token"])[:25])
    profiled_ms = sum(v[2] for v in prof.stats.values()) / n * 1e3
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    print(f"{args.dtype} {args.scheme or 'dense'}: {ms_token:.2f} ms a token unprofiled, {profiled_ms:.2f} profiled")
    write_results(args.out, "probe_cpu_decode_profile", "cpu", [case(
        f"smollm2-135m decode bs1 {args.dtype} {args.scheme or 'dense'} profile", metric="ms per token", unit="ms",
        ours=ms_token, peers={}, floor=None, profiled_ms_per_token=profiled_ms, functions_by_self_time=top,
        threads=torch.get_num_threads())])


if __name__ == "__main__":
    main()
