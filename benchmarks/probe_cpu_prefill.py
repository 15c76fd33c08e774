"""CPU prefill (time to first token) of SmolLM2-135M-Instruct over its own GGUF Q4_1 blocks (the package's file,
``quantization="gguf"``): prompts of ``--contexts`` tokens of ``pydoc_data.topics``, ours (prefix caching off, so
every run prefills the whole prompt) against llama.cpp on the same file (llama-cpp-python where installed, its
context reset before each run), interleaved rounds, best of ``--repeats``; and the two forms of the decoded-weight
GEMM at ``--gemm-rows`` rows (:func:`gemm_forms_case`).

    python benchmarks/probe_cpu_prefill.py [--out benchmarks/results/cpu/sweeps/cpu_prefill.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import best_interleaved, case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402


def gemm_forms_case(m: int, n: int, k: int, rounds: int) -> dict:
    """The two ways ``quant.cpu._decoded_matmul`` can multiply ``m`` rows by a decoded ``[n, k]`` bf16 weight in slices
    of its rows: ``x W^T`` into the output's column slices (what it does) against ``W x^T`` into row slices followed
    by a transpose (what it did before the fortieth session)."""
    from infercore.quant import cpu as QC

    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    rows = min(n, max(16, QC.DECODE_SLICE_BYTES // (2 * k) // 16 * 16))

    def columns():
        y = torch.empty(m, n, dtype=torch.bfloat16)
        for r0 in range(0, n, rows):
            torch.mm(x, w[r0 : r0 + rows].t(), out=y[:, r0 : r0 + rows])
        return y

    def transposed():
        yt = torch.empty(n, m, dtype=torch.bfloat16)
        for r0 in range(0, n, rows):
            torch.mm(w[r0 : r0 + rows], x.t(), out=yt[r0 : r0 + rows])
        return yt.t().contiguous()

    best = best_interleaved({"columns": columns, "transposed": transposed}, rounds)
    print(f"{m} x {k} @ {n} x {k}^T: x W^T into column slices {best['columns'] * 1e3:.1f} ms, W x^T then transposed "
          f"{best['transposed'] * 1e3:.1f} ms", flush=True)
    return case(f"decoded-weight GEMM of {m} rows by a {n} x {k} bf16 weight in slices of {rows} rows (SmolLM2's "
                "gate_up shape)", metric="time-based speedup over W x^T then a transpose", unit="x",
                ours=best["transposed"] / best["columns"], peers={}, floor=None,
                time_ms={key: v * 1e3 for key, v in best.items()}, threads=torch.get_num_threads())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,2000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="time llama.cpp too")
    ap.add_argument("--gemm-rows", type=int, default=2000, help="rows of the GEMM-form row (0: none)")
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_prefill.json")
    args = ap.parse_args()
    from pydoc_data.topics import topics

    eng = Engine.from_pretrained(device="cpu", dtype=torch.bfloat16, quantization="gguf", enable_prefix_caching=False)
    text_ids = eng.tokenizer.encode(" ".join(topics.values()), add_special_tokens=False)
    contexts = [int(c) for c in args.contexts.split(",") if c]  # --contexts "": the GEMM row alone
    try:
        if not args.peer or not contexts:
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

        best = best_interleaved({"ours": ours, **({"peer": theirs} if llm is not None else {})}, args.repeats)
        rate = {key: n / v for key, v in best.items()}
        print(f"{n} tokens: ours {best['ours'] * 1e3:.0f} ms ({rate['ours']:.0f} tok/s)"
              + (f", {peer} {best['peer'] * 1e3:.0f} ms ({rate['peer']:.0f} tok/s)" if llm is not None else ""),
              flush=True)
        cases.append(case(f"smollm2-135m Q4_1 (the package's file, blocks as stored) prefill of a {n}-token prompt, "
                          "time to first token", metric="prefill throughput", unit="tok/s", ours=rate["ours"],
                          peers={peer: rate["peer"]} if llm is not None else {}, floor=None,
                          ttft_ms=best["ours"] * 1e3, peer_ttft_ms=best["peer"] * 1e3 if llm is not None else None,
                          threads=torch.get_num_threads()))
    if args.gemm_rows:
        cases.append(gemm_forms_case(args.gemm_rows, 3072, 576, args.repeats))
    write_results(args.out, "probe_cpu_prefill", "cpu", cases)


if __name__ == "__main__":
    main()
