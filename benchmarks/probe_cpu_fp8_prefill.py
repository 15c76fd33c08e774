"""CPU prefill-sized rows through FP8 weight-only linears (per channel and 128 x 128 blocks): the native e4m3 GEMV
(``cpu_native.linear_fp8``), the weight decoded to bf16 slice by slice into the dense GEMM
(``cpu_native.dequant_fp8_rows`` + ``torch.mm``) and the reference (the whole weight dequantized to fp32 each call),
against the dense bf16 GEMM, in the same process; and SmolLM2's time to first token (a long prompt) with the
``fp8-wo-block`` scheme through the decoded GEMM against the reference it replaced.

    python benchmarks/probe_cpu_fp8_prefill.py --out benchmarks/results/cpu/cpu_fp8_prefill.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import best_of, case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402
from infercore.quant import FP8Weight, naive  # noqa: E402
from infercore.quant import cpu as QC  # noqa: E402


def best_ms(fn, repeats: int) -> float:
    return best_of(fn, repeats) * 1e3


def linear_cases(ms: list[int], repeats: int) -> list[dict]:
    torch.manual_seed(0)
    cases = []
    for n, k in ((4096, 4096), (1536, 576)):
        w = torch.randn(n, k) * 0.02
        dense = w.bfloat16()
        for block in (None, 128):
            q = FP8Weight.quantize(w, block_size=block)
            codes, scales = q.qweight.contiguous(), q.scales.float().contiguous()
            name = "fp8-wo" if block is None else "fp8-wo-block"

            def decoded(x, c=codes, s=scales, b=block, n=n, k=k):
                return QC._sliced_matmul(x, n, k, lambda r0, r1, slab: cpu_native.dequant_fp8_rows(c, s, b, r0, r1,
                                                                                                    slab))

            for m in ms:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                with torch.inference_mode():
                    t_dense = best_ms(lambda a=x, d=dense: a @ d.t(), repeats)
                    t_native = best_ms(lambda a=x, c=codes, s=scales, b=block: cpu_native.linear_fp8(a, c, s, b),
                                       repeats)
                    t_dec = best_ms(lambda a=x, f=decoded: f(a), repeats)
                    t_ref = best_ms(lambda a=x, w8=q: naive.fp8_wo_matmul_ref(a, w8), max(1, repeats // 2))
                ours = t_native if m <= QC.FP8_NATIVE_MAX_ROWS else t_dec  # the path quant/cpu.py takes
                print(f"{name} {n}x{k} M={m}: native {t_native:.2f} ms, decoded {t_dec:.2f}, reference {t_ref:.2f}, "
                      f"dense bf16 {t_dense:.2f}", flush=True)
                flops = 2 * m * n * k
                cases.append(case(f"{name} {n}x{k} M={m} bf16 activations", metric="matmul throughput",
                                  unit="GFLOP/s", ours=flops / ours / 1e6,
                                  peers={"native e4m3 GEMV": flops / t_native / 1e6,
                                         "decoded bf16 slices + GEMM": flops / t_dec / 1e6,
                                         "reference (dequantize all, fp32)": flops / t_ref / 1e6,
                                         "dense bf16 matmul": flops / t_dense / 1e6},
                                  floor=None, native_ms=t_native, decoded_ms=t_dec, reference_ms=t_ref,
                                  dense_ms=t_dense, ours_ms=ours, native_max_rows=QC.FP8_NATIVE_MAX_ROWS))
    return cases


def ttft_case(prompt_tokens: int, repeats: int) -> dict:
    eng = Engine.from_pretrained(device="cpu", dtype=torch.bfloat16, enable_prefix_caching=False,
                                 max_num_batched_tokens=prompt_tokens, quantization="fp8-wo-block")
    ids = (eng.tokenizer.encode("The history of the printing press begins in the fifteenth century. ") * 200)
    ids = ids[:prompt_tokens]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    dec = best_ms(lambda: eng.generate([ids], sp), repeats)
    fast = eng.generate([ids], sp)[0].token_ids
    # the reference (before): bf16 rows past FP8_NATIVE_MAX_ROWS dequantized the whole weight to fp32 each call.
    # Forced by reporting the native kernels unavailable (quant/cpu.py then takes the reference); the prompt's rows
    # are all prefill rows, and the one token generated needs no decode step.
    old_q4 = cpu_native.q4_supported
    cpu_native.q4_supported = lambda: False
    try:
        ref = best_ms(lambda: eng.generate([ids], sp), max(1, repeats // 2))
        slow = eng.generate([ids], sp)[0].token_ids
    finally:
        cpu_native.q4_supported = old_q4
    print(f"SmolLM2 fp8-wo-block {prompt_tokens}-token prompt, first token: decoded {dec:.1f} ms, reference "
          f"{ref:.1f}, same token {fast == slow}", flush=True)
    return case(f"smollm2-135m fp8-wo-block time to first token, {prompt_tokens}-token prompt, bf16",
                metric="prefill throughput", unit="tok/s", ours=prompt_tokens / dec * 1e3,
                peers={"reference (before)": prompt_tokens / ref * 1e3}, floor=None, decoded_ms=dec,
                reference_ms=ref, same_first_token=fast == slow, native_max_rows=QC.FP8_NATIVE_MAX_ROWS,
                threads=torch.get_num_threads())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,8,16,32,64,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu/cpu_fp8_prefill.json")
    args = ap.parse_args()
    cases = linear_cases([int(v) for v in args.ms.split(",")], args.repeats)
    cases.append(ttft_case(args.prompt, args.repeats))
    write_results(args.out, "probe_cpu_fp8_prefill", "cpu", cases)


if __name__ == "__main__":
    main()
