"""A/B on the CPU: SmolLM2's GGUF blocks as stored (``quantization="gguf"``) with the tied lm_head dense (bf16,
57 MB a token) or run from the embedding's own Q8_0 blocks (``use_gguf_blocks(tied_lm_head=True)``, 30 MB a token,
the native INT8 GEMV), batch-1 greedy decode, interleaved rounds; plus the head alone.

    python benchmarks/probe_gguf_tied_head.py --out benchmarks/results/cpu/sweeps/cpu_gguf_tied_head.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402
from bench_cpu_decode import PROMPT, decode_rates, read_bandwidth  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402
from infercore.quant.gguf_native import use_gguf_blocks  # noqa: E402


def head_us(head, hidden: int, calls: int = 50) -> float:
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    best = float("inf")
    with torch.inference_mode():
        head(x)
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                head(x)
            best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_gguf_tied_head.json")
    ap.add_argument("--int8-activations", action="store_true",
                    help="the quantized linears (the Q8_0 head included) on 8-bit activations (cpu_native)")
    args = ap.parse_args()
    if args.int8_activations:
        from infercore.ops.moe import cpu_native

        if not cpu_native.set_int8_activations(True):
            raise SystemExit("--int8-activations: this host has no AVX512-VNNI")
    engines = {}
    for tied in (True, False):
        eng = Engine.from_pretrained(device="cpu", dtype=torch.bfloat16, enable_prefix_caching=False)
        use_gguf_blocks(eng.model, default_model_path(), tied_lm_head=tied)  # in place: the runner holds the modules
        engines[tied] = eng
    tok = engines[False].tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True),
                     add_special_tokens=False)

    def runner(eng):
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def run(n: int) -> list[int]:
            sp.max_tokens = n
            return eng.generate([ids], sp)[0].token_ids
        return run

    runs = [runner(engines[True]), runner(engines[False])]
    a, b = runs[0](args.tokens), runs[1](args.tokens)
    agree = sum(x == y for x, y in zip(a, b))
    r_q8, r_dense = decode_rates(runs, args.tokens, args.repeats)
    hidden = engines[False].model.config.hidden_size
    h_q8, h_dense = head_us(engines[True].model.lm_head, hidden), head_us(engines[False].model.lm_head, hidden)
    print(f"decode: Q8_0 head {r_q8:.1f} tok/s, dense bf16 head {r_dense:.1f}; head alone {h_q8:.0f} vs "
          f"{h_dense:.0f} us; {agree}/{args.tokens} greedy tokens agree", flush=True)
    bw = read_bandwidth()
    a8 = ", 8-bit activations" if args.int8_activations else ""
    cases = [case(f"smollm2-135m gguf-native-q4_1 decode bs1 bf16{a8}, tied lm_head from the Q8_0 blocks vs dense, "
                  f"{args.tokens} tokens", metric="decode throughput", unit="tok/s", ours=r_q8,
                  peers={"tied lm_head dense bf16": r_dense}, floor=None, greedy_tokens_agreeing=agree,
                  threads=torch.get_num_threads()),
             case(f"smollm2-135m lm_head 49152x576 M=1 alone{a8}, Q8_0 blocks vs dense bf16", metric="calls per second",
                  unit="1/s", ours=1e6 / h_q8, peers={"dense bf16": 1e6 / h_dense},
                  floor=bw / (49152 * (576 + 144)),  # codes and fp32 scales / zeros a row, as the kernel reads them
                  q8_us=h_q8, dense_us=h_dense)]
    write_results(args.out, "probe_gguf_tied_head", "cpu", cases, extra={"read_bandwidth_GBps": bw / 1e9})


if __name__ == "__main__":
    main()
