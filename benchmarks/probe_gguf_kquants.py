"""A llama.cpp Q4_K_M file decoded on the CPU: SmolLM2-135M-Instruct re-quantized by llama.cpp's own quantizer
(``llama_model_quantize``, from the package's Q4_1 file: its 576-wide rows fall back to Q5_0 / Q8_0 as llama.cpp
decides, ffn_down takes Q4_K / Q6_K), run with its blocks as stored (``quantization="gguf"``) against the same file
dequantized at load (bf16), the dequantizing reference, and llama.cpp on the same file, in interleaved rounds.
``--synthetic H,I,L,HEADS,KV`` instead writes a Llama of those widths with random F16 weights (N(0, 0.02); SmolLM2's
tokenizer) and has llama.cpp quantize it to Q4_K_M: with widths that are multiples of 256, its tensors are the
Q4_K / Q6_K mix of a common Q4_K_M file. Needs llama-cpp-python.

    python benchmarks/probe_gguf_kquants.py --out benchmarks/results/cpu/sweeps/cpu_gguf_kquants.json
    python benchmarks/probe_gguf_kquants.py --synthetic 1024,2816,16,16,4 \
        --out benchmarks/results/cpu/sweeps/cpu_gguf_kquants_synthetic.json
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


def synthetic_f16(path: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> str:
    """A Llama GGUF at ``path`` with random F16 weights (N(0, 0.02), norms 1, an untied output) and the tokenizer of
    the package's SmolLM2 file."""
    import gguf
    import numpy as np

    src = gguf.GGUFReader(str(default_model_path()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    for key, v in (("context_length", 4096), ("embedding_length", hidden), ("feed_forward_length", inter),
                   ("block_count", layers), ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                   ("rope.dimension_count", hidden // heads), ("vocab_size", vocab)):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            v = field.contents()
            vt = field.types[0]
            if vt == gguf.GGUFValueType.ARRAY:
                w.add_array(key, v)
            else:
                w.add_key_value(key, v, vt)

    def mat(n, k):
        return (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16)

    hd = hidden // heads
    w.add_tensor("token_embd.weight", mat(vocab, hidden))
    w.add_tensor("output.weight", mat(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, (n, k) in {"attn_q": (hidden, hidden), "attn_k": (kv_heads * hd, hidden),
                             "attn_v": (kv_heads * hd, hidden), "attn_output": (hidden, hidden),
                             "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
                             "ffn_down": (hidden, inter)}.items():
            w.add_tensor(f"blk.{i}.{name}.weight", mat(n, k))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def requantize(dst: str, ftype_name: str = "LLAMA_FTYPE_MOSTLY_Q4_K_M", src: str | None = None) -> None:
    """``src`` (default: the package's SmolLM2 GGUF) quantized by llama.cpp to ``ftype_name`` at ``dst`` (its log
    silenced)."""
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = getattr(llama_cpp, ftype_name), True, torch.get_num_threads()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        rc = llama_cpp.llama_model_quantize(str(src or default_model_path()).encode(), dst.encode(), ctypes.byref(p))
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
    ap.add_argument("--synthetic", default="", help="H,I,L,HEADS,KV: a random-weight Llama of these widths")
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_gguf_kquants.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model-q4_k_m.gguf")
        if args.synthetic:
            dims = [int(v) for v in args.synthetic.split(",")]
            requantize(path, src=synthetic_f16(os.path.join(tmp, "f16.gguf"), *dims))
            name = "random-weight llama H{} I{} L{} heads {}/{}".format(*dims)
        else:
            requantize(path)
            name = "smollm2-135m"
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
        cases = [case(f"{name} Q4_K_M (llama.cpp quantizer) decode bs1 bf16 {args.tokens} tokens, blocks as stored",
                      metric="decode throughput", unit="tok/s", ours=r_fast,
                      peers={"same file dequantized at load (bf16)": r_dense,
                             "reference (dequantize + matmul)": r_ref,
                             f"llama.cpp {lcpp[1]} (llama-cpp-python, same GGUF file)": r_lcpp},
                      floor=None, file_tensor_types=file_types, swapped_linears_by_format=swapped,
                      greedy_tokens_identical_to_reference=same_ref, greedy_tokens_agreeing_with_dense=agree_dense,
                      greedy_tokens_agreeing_with_llama_cpp=agree_lcpp, threads=torch.get_num_threads())]
    write_results(args.out, "probe_gguf_kquants", "cpu", cases)


if __name__ == "__main__":
    main()
