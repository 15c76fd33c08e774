"""CPU prefill-sized rows through weight-only quantized linears: the weight decoded to bf16 slice by slice into a
dense GEMM (``quant.cpu._decoded_matmul``, from ``DECODE_MIN_ROWS`` rows) against the packed kernels it replaced
(ATen's INT4 / INT8 kernels, the native INT8 GEMV for GGUF Q8_0) and the dense bf16 GEMM, in the same process; and
SmolLM2's time to first token over its GGUF Q4_1 blocks (a long prompt) both ways.

    python benchmarks/probe_cpu_prefill_quant.py --out benchmarks/results/cpu/sweeps/cpu_quant_decoded_prefill.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import best_of, case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402
from infercore.quant import GGUFWeight, QuantLinear, quantize  # noqa: E402
from infercore.quant import cpu as QC  # noqa: E402
from infercore.quant.gguf_native import use_gguf_blocks  # noqa: E402

NEVER = 1 << 30


def best_ms(fn, repeats: int) -> float:
    return best_of(fn, repeats) * 1e3


def both(fn, repeats: int) -> tuple[float, float]:
    """(decoded, packed) ms, alternating."""
    dec, old = float("inf"), float("inf")
    for _ in range(repeats):
        QC.DECODE_MIN_ROWS = QC.DECODE_MIN_ROWS_Q8_0 = NEVER
        old = min(old, best_ms(fn, 1))
        QC.DECODE_MIN_ROWS, QC.DECODE_MIN_ROWS_Q8_0 = 32, 16
        dec = min(dec, best_ms(fn, 1))
    return dec, old


def linear_cases(ms: list[int], repeats: int) -> list[dict]:
    torch.manual_seed(0)
    cases = []
    for n, k in ((4096, 4096), (3072, 576)):
        w = torch.randn(n, k) * 0.02
        dense = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        dense.weight.data = w.bfloat16()
        mods = {}
        for scheme in ("w4a16-g128", "w8a16"):
            m = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16))
            m[0].weight.data = w.bfloat16()
            quantize(m, scheme)
            mods[scheme] = m
        for qtype in ("q4_1", "q8_0"):
            mods[f"gguf {qtype}"] = QuantLinear(GGUFWeight.quantize(w, qtype=qtype))
        for m_rows in ms:
            x = torch.randn(m_rows, k, dtype=torch.bfloat16)
            with torch.inference_mode():
                t_dense = best_ms(lambda d=dense, a=x: d(a), repeats)
                for name, mod in mods.items():
                    dec, old = both(lambda f=mod, a=x: f(a), repeats)
                    print(f"{n}x{k} M={m_rows} {name}: decoded {dec:.2f} ms, packed {old:.2f}, dense bf16 "
                          f"{t_dense:.2f}", flush=True)
                    flops = 2 * m_rows * n * k
                    cases.append(case(f"{name} {n}x{k} M={m_rows} bf16 activations", metric="matmul throughput",
                                      unit="GFLOP/s", ours=flops / dec / 1e6,
                                      peers={"packed kernel (before)": flops / old / 1e6,
                                             "dense bf16 F.linear": flops / t_dense / 1e6},
                                      floor=None, decoded_ms=dec, packed_ms=old, dense_ms=t_dense))
    return cases


def ttft_case(prompt_tokens: int, repeats: int) -> dict:
    eng = Engine.from_pretrained(device="cpu", dtype=torch.bfloat16, enable_prefix_caching=False,
                                 max_num_batched_tokens=prompt_tokens)
    use_gguf_blocks(eng.model, default_model_path())
    ids = (eng.tokenizer.encode("The history of the printing press begins in the fifteenth century. ") * 200)
    ids = ids[:prompt_tokens]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    dec, old = both(lambda: eng.generate([ids], sp), repeats)
    print(f"SmolLM2 gguf-native-q4_1 {prompt_tokens}-token prompt, first token: decoded {dec:.1f} ms, packed "
          f"{old:.1f}", flush=True)
    return case(f"smollm2-135m gguf-native-q4_1 time to first token, {prompt_tokens}-token prompt, bf16",
                metric="prefill throughput", unit="tok/s", ours=prompt_tokens / dec * 1e3,
                peers={"packed kernels (before)": prompt_tokens / old * 1e3}, floor=None, decoded_ms=dec,
                packed_ms=old, threads=torch.get_num_threads())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16,32,64,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_quant_decoded_prefill.json")
    args = ap.parse_args()
    cases = linear_cases([int(v) for v in args.ms.split(",")], args.repeats)
    cases.append(ttft_case(args.prompt, args.repeats))
    write_results(args.out, "probe_cpu_prefill_quant", "cpu", cases)


if __name__ == "__main__":
    main()
