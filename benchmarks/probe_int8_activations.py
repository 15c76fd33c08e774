"""The native CPU INT4 / INT8 GEMVs on 8-bit activations (``cpu_native.set_int8_activations``) against the same
model with bf16 activations and against llama.cpp on the same GGUF file, decode rates in interleaved rounds, and how
many greedy tokens the 8-bit run shares with the bf16 one. Models: SmolLM2-135M-Instruct's own Q4_1 blocks (the
package's file, ``--model smollm2``), or with ``--synthetic H,I,L,HEADS,KV`` a random-weight Llama quantized to
Q4_K_M by llama.cpp (``probe_gguf_kquants.py``; its Q4_K linears through the INT4 GEMV, its Q6_K ones through the
INT8 one, both on 8-bit activations: the INT8 GEMV takes them where K is a multiple of 64).
Needs llama-cpp-python for the llama.cpp peer.

    python benchmarks/probe_int8_activations.py --out benchmarks/results/cpu/sweeps/cpu_int8_activations.json
    python benchmarks/probe_int8_activations.py --synthetic 1024,2816,16,16,4 \
        --out benchmarks/results/cpu/sweeps/cpu_int8_activations_synthetic.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402
from bench_cpu_decode import PROMPT, decode_rates  # noqa: E402
from bench_cpu_quant import llama_cpp_runner  # noqa: E402
from probe_gguf_kquants import requantize, synthetic_f16  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--synthetic", default="", help="H,I,L,HEADS,KV: a random-weight Llama of these widths, Q4_K_M")
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_int8_activations.json")
    args = ap.parse_args()
    if not cpu_native.q4_supported():
        raise SystemExit(f"the native INT4 kernels do not run here: {cpu_native.status()}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            dims = [int(v) for v in args.synthetic.split(",")]
            path = os.path.join(tmp, "model-q4_k_m.gguf")
            requantize(path, src=synthetic_f16(os.path.join(tmp, "f16.gguf"), *dims))
            name = "random-weight llama H{} I{} L{} heads {}/{} Q4_K_M".format(*dims)
        else:
            path, name = str(default_model_path()), "smollm2-135m Q4_1 (the package's file)"
        eng = Engine.from_pretrained(path, device="cpu", dtype=torch.bfloat16, quantization="gguf",
                                     enable_prefix_caching=False)
        tok = eng.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True),
                         add_special_tokens=False)

        def runner(a8: bool):
            def run(n: int) -> list[int]:
                with cpu_native.int8_activations() if a8 else contextlib.nullcontext():
                    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                    return eng.generate([ids], sp)[0].token_ids
            return run

        bf16, a8 = runner(False), runner(True)
        with cpu_native.int8_activations() as on:
            if not on:
                raise SystemExit("8-bit activations are not available here (AVX512-VNNI)")
        runs, names = [bf16, a8], ["bf16 activations", "8-bit activations"]
        lcpp = llama_cpp_runner(ids, path)
        if lcpp is not None:
            runs.append(lcpp[0])
            names.append(f"llama.cpp {lcpp[1]} (llama-cpp-python, same GGUF file)")
        t_bf16, t_a8 = bf16(args.tokens), a8(args.tokens)
        agree = next((i for i, (a, b) in enumerate(zip(t_bf16, t_a8)) if a != b), len(t_a8))
        rates = decode_rates(runs, args.tokens, args.repeats)
        print(", ".join(f"{n} {r:.1f} tok/s" for n, r in zip(names, rates))
              + f"; the 8-bit run's greedy tokens equal the bf16 run's for the first {agree} of {args.tokens}",
              flush=True)
        cases = [case(f"{name} decode bs1, blocks as stored, INT4 GEMVs on 8-bit activations, {args.tokens} tokens",
                      metric="decode throughput", unit="tok/s", ours=rates[1],
                      peers=dict(zip(names[:1] + names[2:], rates[:1] + rates[2:])), floor=None,
                      greedy_prefix_shared_with_bf16_activations=agree, threads=torch.get_num_threads())]
    write_results(args.out, "probe_int8_activations", "cpu", cases)


if __name__ == "__main__":
    main()
