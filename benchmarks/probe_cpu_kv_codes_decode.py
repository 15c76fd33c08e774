"""CPU decode of SmolLM2-135M-Instruct over its own GGUF Q4_1 blocks with int8 / fp8 KV caches (``kv_cache_dtype``):
the fused decoder layers (every layer in one native call, the new rows quantized in its RoPE step, the codes read by
its attention) against the op-by-op path with the native RoPE-write and attention, and against the path these caches
took before the forty-first session (op by op, the reference RoPE-write quantizing in torch: ``INFERCORE_BACKEND=
rope_and_write_kv:reference``, which also keeps the fused layers off). A ``--prompt``-token prompt of
``pydoc_data.topics`` text, ``--new`` greedy tokens, interleaved rounds, best of ``--rounds``; the bf16 cache
("auto") for reference.

    python benchmarks/probe_cpu_kv_codes_decode.py [--out benchmarks/results/cpu/sweeps/cpu_kv_codes_decode.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, engine_decode_rate, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=500)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_kv_codes_decode.json")
    args = ap.parse_args()
    from pydoc_data.topics import topics

    engines = {kv: Engine.from_pretrained(device="cpu", quantization="gguf", kv_cache_dtype=kv,
                                          enable_prefix_caching=False) for kv in ("auto", "int8", "fp8")}
    tok = engines["auto"].tokenizer
    prompt = tok.encode("\n".join(topics.values()), add_special_tokens=False)[: args.prompt]

    def decode_rate(eng) -> tuple[float, list[int]]:
        eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # warm
        return engine_decode_rate(eng, prompt, args.new)

    def run(kv: str, mode: str) -> tuple[float, list[int]]:
        eng = engines[kv]
        if mode == "fused":
            return decode_rate(eng)
        if mode == "op_by_op":
            with cpu_native.fused_layers_disabled():
                return decode_rate(eng)
        os.environ["INFERCORE_BACKEND"] = "rope_and_write_kv:reference"
        try:
            return decode_rate(eng)
        finally:
            del os.environ["INFERCORE_BACKEND"]

    variants = [("auto", "fused")] + [(kv, m) for kv in ("int8", "fp8") for m in ("fused", "op_by_op", "before")]
    best = {v: 0.0 for v in variants}
    tokens = {}
    for _ in range(args.rounds):
        for v in variants:
            rate, ids = run(*v)
            best[v] = max(best[v], rate)
            tokens[v] = ids
    cases = []
    for kv in ("int8", "fp8"):
        agree = sum(a == b for a, b in zip(tokens[kv, "fused"], tokens[kv, "op_by_op"]))
        cases.append(case(
            f"smollm2-135m gguf-native-q4_1 decode bs1 bf16, {kv} KV cache, prompt {args.prompt}, {args.new} tokens",
            metric="decode throughput", unit="tok/s", ours=best[kv, "fused"],
            peers={"op by op, native RoPE-write and attention": best[kv, "op_by_op"],
                   "op by op, reference RoPE-write (before)": best[kv, "before"]},
            floor=None, bf16_cache_fused_tok_s=best["auto", "fused"],
            greedy_tokens_equal_to_op_by_op=f"{agree}/{len(tokens[kv, 'fused'])}"))
        print(f"{kv}: fused {best[kv, 'fused']:.1f}, op by op {best[kv, 'op_by_op']:.1f}, before "
              f"{best[kv, 'before']:.1f} tok/s (bf16 cache {best['auto', 'fused']:.1f}); tokens agree {agree}",
              flush=True)
    write_results(args.out, "probe_cpu_kv_codes_decode", "cpu", cases,
                  {"note": "Decode rate = (new - 1) / (time of prompt + new tokens - time of prompt + 1 token), "
                           "best of interleaved rounds; prefix caching off."})


if __name__ == "__main__":
    main()
