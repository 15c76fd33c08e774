"""Kernel-level profile of Engine decode steps (torch.profiler), for finding where a step's time goes.

    python benchmarks/profile_decode.py --batches 1,256 [--layers 32]
    python benchmarks/profile_decode.py --batches 1 --scheme w4a16-g128 --rows 30   # a quantized model
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402
from infercore.quant import quantize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--scheme", default="", help="quantize(model, scheme) first (lm_head stays bf16)")
    ap.add_argument("--rows", type=int, default=18, help="kernels listed per batch")
    args = ap.parse_args()
    cfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
    model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device="cuda", init="normal")
    if args.scheme:
        quantize(model, args.scheme)
    batches = [int(b) for b in args.batches.split(",")]
    B = max(batches)
    eng = Engine(model, num_pages=B * 50 + 64, page_size=16, max_num_seqs=B, max_num_batched_tokens=16384,
                 max_model_len=800, enable_prefix_caching=False, cuda_graph_max_batch=B if args.graphs else 0)
    for b in batches:
        for _ in range(b):
            eng.add_request(torch.randint(0, 128000, (args.prompt,)).tolist(),
                            SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.requests.values()):
            eng.step()
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t) / 10 * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                eng.step()
            torch.cuda.synchronize()
        print(f"=== batch {b}: {step_ms:.2f} ms/step wall")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        for rid in list(eng.requests):
            eng.abort(rid)


if __name__ == "__main__":
    main()
