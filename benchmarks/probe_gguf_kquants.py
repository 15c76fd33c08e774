"""A llama.cpp Q4_K_M file decoded on the CPU: SmolLM2-135M-Instruct re-quantized by llama.cpp's own quantizer
(``llama_model_quantize``, from the package's Q4_1 file: its 576-wide rows fall back to Q5_0 / Q8_0 as llama.cpp
decides, ffn_down takes Q4_K / Q6_K), run with its blocks as stored (``quantization="gguf"``) against the same file
dequantized at load (bf16), the dequantizing reference, and llama.cpp on the same file, in interleaved rounds.
Needs llama-cpp-python.

    python benchmarks/probe_gguf_kquants.py --out benchmarks/results/cpu/sweeps/cpu_gguf_kquants.json
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402
from bench_cpu_decode import PROMPT, decode_rates  # noqa: E402
from bench_cpu_quant import llama_cpp_runner  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402
from infercore.quant import QuantLinear  # noqa: E402


def requantize(dst: str, ftype_name: str = "LLAMA_FTYPE_MOSTLY_Q4_K_M") -> None:
    """The package's SmolLM2 GGUF re-quantized by llama.cpp to ``ftype_name`` at ``dst`` (its log silenced)."""
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = getattr(llama_cpp, ftype_name), True, torch.get_num_threads()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        rc = llama_cpp.llama_model_quantize(str(default_model_path()).encode(), dst.encode(), ctypes.byref(p))
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_gguf_kquants.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "smollm2-135m-q4_k_m.gguf")
        requantize(path)
        from infercore.loading import GGUFFile

        file_types = dict(collections.Counter(GGUFFile(path).raw(n)[1].name for n in GGUFFile(path).tensors))
        ours = Engine.from_pretrained(path, device="cpu", dtype=torch.bfloat16, quantization="gguf",
                                      enable_prefix_caching=False)
        dense = Engine.from_pretrained(path, device="cpu", dtype=torch.bfloat16, enable_prefix_caching=False)
        swapped = dict(collections.Counter(m.qweight_format.qtype for m in ours.model.modules()
                                           if isinstance(m, QuantLinear)))
        tok = ours.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True),
                         add_special_tokens=False)

        def runner(eng, backend=None):
            def run(n: int) -> list[int]:
                if backend:
                    os.environ["INFERCORE_BACKEND"] = backend
                try:
                    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                    return eng.generate([ids], sp)[0].token_ids
                finally:
                    os.environ.pop("INFERCORE_BACKEND", None)
            return run

        fast, ref, dense_run = runner(ours), runner(ours, "quant.gguf_matmul:reference"), runner(dense)
        lcpp = llama_cpp_runner(ids, path)
        toks = fast(args.tokens)
        same_ref = toks == ref(args.tokens)
        agree_dense = sum(a == b for a, b in zip(toks, dense_run(args.tokens)))
        agree_lcpp = sum(a == b for a, b in zip(toks, lcpp[0](args.tokens)))
        r_fast, r_dense, r_lcpp, r_ref = decode_rates([fast, dense_run, lcpp[0], ref], args.tokens, args.repeats)
        print(f"Q4_K_M file {file_types}; swapped linears by format {swapped}; decode: blocks as stored "
              f"{r_fast:.1f} tok/s, dequantized at load (bf16) {r_dense:.1f}, reference {r_ref:.1f}, llama.cpp "
              f"{lcpp[1]} {r_lcpp:.1f}; greedy tokens: reference {'same' if same_ref else 'differ'}, "
              f"{agree_dense}/{args.tokens} as the dense bf16 model, {agree_lcpp}/{args.tokens} as llama.cpp",
              flush=True)
        cases = [case(f"smollm2-135m Q4_K_M (llama.cpp requantized) decode bs1 bf16 {args.tokens} tokens, blocks as "
                      "stored", metric="decode throughput", unit="tok/s", ours=r_fast,
                      peers={"same file dequantized at load (bf16)": r_dense,
                             "reference (dequantize + matmul)": r_ref,
                             f"llama.cpp {lcpp[1]} (llama-cpp-python, same GGUF file)": r_lcpp},
                      floor=None, file_tensor_types=file_types, swapped_linears_by_format=swapped,
                      greedy_tokens_identical_to_reference=same_ref, greedy_tokens_agreeing_with_dense=agree_dense,
                      greedy_tokens_agreeing_with_llama_cpp=agree_lcpp, threads=torch.get_num_threads())]
    write_results(args.out, "probe_gguf_kquants", "cpu", cases)


if __name__ == "__main__":
    main()
