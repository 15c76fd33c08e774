"""CPU prefill (time to first token) of SmolLM2-135M-Instruct over its own GGUF Q4_1 blocks (the package's file,
``quantization="gguf"``): prompts of ``--contexts`` tokens of ``pydoc_data.topics``, ours (prefix caching off, so
every run prefills the whole prompt) against llama.cpp on the same file (llama-cpp-python where installed, its
context reset before each run), interleaved rounds, best of ``--repeats``.

    python benchmarks/probe_cpu_prefill.py [--out benchmarks/results/cpu/sweeps/cpu_prefill.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,2000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="time llama.cpp too")
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_prefill.json")
    args = ap.parse_args()
    from pydoc_data.topics import topics

    eng = Engine.from_pretrained(device="cpu", dtype=torch.bfloat16, quantization="gguf", enable_prefix_caching=False)
    text_ids = eng.tokenizer.encode(" ".join(topics.values()), add_special_tokens=False)
    contexts = [int(c) for c in args.contexts.split(",")]
    try:
        if not args.peer:
            raise ImportError
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(default_model_path()), n_threads=torch.get_num_threads(),
                              n_ctx=max(contexts) + 64, n_batch=512, verbose=False, seed=0)
        peer = f"llama.cpp {llama_cpp.__version__} (llama-cpp-python, same GGUF file)"
    except ImportError:
        llm = peer = None
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cases = []
    for n in contexts:
        ids = text_ids[:n]

        def ours(ids=ids):
            return eng.generate([ids], sp)[0].token_ids

        def theirs(ids=ids):
            llm.reset()
            return next(iter(llm.generate(ids, top_k=1, temp=0.0, reset=True)))

        runs = {"ours": ours, **({"peer": theirs} if llm is not None else {})}
        for fn in runs.values():
            fn()
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeats):
            for key, fn in runs.items():
                t = time.perf_counter()
                fn()
                best[key] = min(best[key], time.perf_counter() - t)
        rate = {key: n / v for key, v in best.items()}
        print(f"{n} tokens: ours {best['ours'] * 1e3:.0f} ms ({rate['ours']:.0f} tok/s)"
              + (f", {peer} {best['peer'] * 1e3:.0f} ms ({rate['peer']:.0f} tok/s)" if llm is not None else ""),
              flush=True)
        cases.append(case(f"smollm2-135m Q4_1 (the package's file, blocks as stored) prefill of a {n}-token prompt, "
                          "time to first token", metric="prefill throughput", unit="tok/s", ours=rate["ours"],
                          peers={peer: rate["peer"]} if llm is not None else {}, floor=None,
                          ttft_ms=best["ours"] * 1e3, peer_ttft_ms=best["peer"] * 1e3 if llm is not None else None,
                          threads=torch.get_num_threads()))
    write_results(args.out, "probe_cpu_prefill", "cpu", cases)


if __name__ == "__main__":
    main()
