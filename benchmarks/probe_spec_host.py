"""Where the host time of an eager speculative step goes: cProfile over verification steps of the SmolLM2-135M
shape (random bf16 weights, oracle drafts that are all wrong, so every step feeds 1 + k tokens per request).

    python benchmarks/probe_spec_host.py --out prof.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_spec_step import SMOLLM2  # noqa: E402

import infercore.engine.engine as engine_mod  # noqa: E402
from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(SMOLLM2)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16, device=torch.device("cuda"), init="normal")
    eng = Engine(model, page_size=16, num_pages=512, max_num_seqs=4, max_model_len=1024,
                 enable_prefix_caching=False, num_speculative_tokens=args.k)
    engine_mod.propose_ngram = lambda tokens, n, *, min_n, max_n: [(tokens[-1] + 1 + i) % cfg.vocab_size
                                                                    for i in range(n)]
    prompt = torch.randint(0, cfg.vocab_size, (512,)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    for _ in range(2):
        eng.generate([prompt], sp)
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.generate([prompt], sp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    prof = cProfile.Profile()
    prof.enable()
    eng.generate([prompt], sp)
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
    with open(args.out, "w") as f:
        f.write(f"wall {wall:.4f} s for {args.new} tokens (k={args.k}, every draft wrong)\n")
        f.write(s.getvalue())
    print(f"wall {wall:.4f} s, {wall / args.new * 1e3:.2f} ms/step")


if __name__ == "__main__":
    main()
