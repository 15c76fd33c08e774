"""CPU greedy decode of SmolLM2-135M-Instruct: infercore Engine vs transformers `generate`.

Both run in this process on the same dequantized GGUF weights, in the same dtype, the same
prompt and the same number of threads. Decode rate = (N - 1) / (t(N tokens) - t(1 token)), so the
prefill is excluded identically for both. The floor is the weight-read bound:
measured read bandwidth (a ``sum`` over 512 MiB, same threads) / weight bytes read per token.

    python benchmarks/bench_cpu_decode.py [--tokens 64] [--repeats 3]
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
from infercore.loading import default_model_path, load_checkpoint  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def read_bandwidth() -> float:
    """Bytes/s of a read-only pass over 512 MiB, best of 7 (the faster of torch's ``sum`` and the native read
    pass): what a weight-bound GEMV needs."""
    x = torch.randn(128 << 20)
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    bw = x.numel() * 4 / best
    return max(bw, cpu_native.read_bandwidth(512 << 20, repeats=7)) if cpu_native.available() else bw


def decode_rates(runs: list, n: int, repeats: int) -> list[float]:
    """Decode rate of each runner; their timings interleave so a drift of the machine's memory
    bandwidth (a shared VM) hits all of them alike. Best of ``repeats`` for each length."""
    for run in runs:
        run(1)
    t1 = [float("inf")] * len(runs)
    tn = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            t1[i] = min(t1[i], _timed(run, 1))
            tn[i] = min(tn[i], _timed(run, n))
    return [(n - 1) / (b - a) for a, b in zip(t1, tn)]


def _timed(run, n: int) -> float:
    t = time.perf_counter()
    run(n)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="benchmarks/results/cpu/cpu_decode.json")
    args = ap.parse_args()

    import transformers

    path = default_model_path()
    bw = read_bandwidth()
    cases = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        eng = Engine.from_pretrained(path, device="cpu", dtype=dtype, enable_prefix_caching=False)
        ids = eng.tokenizer.encode(
            eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True),
            add_special_tokens=False,
        )

        def ours(n: int, eng=eng, ids=ids) -> list[int]:
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            return eng.generate([ids], sp)[0].token_ids

        # transformers on the same dequantized weights in the same dtype (its GGUF loader would keep
        # them packed and run its own quantized kernels, which is another comparison).
        ckpt = load_checkpoint(path)
        hcfg = transformers.AutoConfig.for_model(**ckpt.config)
        hf = transformers.LlamaForCausalLM(hcfg).to(dtype).eval()
        missing, unexpected = hf.load_state_dict({k: v.to(dtype) for k, v in ckpt.weights()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        hf.tie_weights()
        x = torch.tensor([ids])

        @torch.inference_mode()
        def theirs(n: int, hf=hf, x=x, ids=ids) -> list[int]:
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=2)
            return out[0, len(ids):].tolist()

        def ours_onednn(n: int) -> list[int]:  # every native kernel off (oneDNN's packed GEMVs, ATen's ops)
            with cpu_native.disabled():
                return ours(n)

        def ours_aten_ops(n: int) -> list[int]:  # native GEMVs, ATen's norm / RoPE / attention / activation
            with cpu_native.layer_ops_disabled():
                return ours(n)

        def ours_op_by_op(n: int) -> list[int]:  # every op native, but one call per op, not per decoder layer
            with cpu_native.fused_layers_disabled():
                return ours(n)

        def ours_per_layer(n: int) -> list[int]:  # one native call per decoder layer, not one for the stack
            with cpu_native.layer_stack_disabled():
                return ours(n)

        same = ours(args.tokens) == theirs(args.tokens)
        native = cpu_native.available()
        runs = [ours, theirs] + ([ours_per_layer, ours_op_by_op, ours_aten_ops, ours_onednn] if native else [])
        rates = decode_rates(runs, args.tokens, args.repeats)
        r_ours, r_hf = rates[:2]
        r_layer, r_op_by_op, r_aten_ops, r_dnn = rates[2:] if native else (None, None, None, None)
        weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        floor = bw / weight_bytes
        if r_layer:
            print(f"{name}: infercore with one native call per decoder layer {r_layer:.1f} tok/s")
        if r_op_by_op:
            print(f"{name}: infercore op by op (native ops, no fused decoder layer) {r_op_by_op:.1f} tok/s")
        if r_aten_ops:
            print(f"{name}: infercore with ATen's layer ops instead of the native ones {r_aten_ops:.1f} tok/s")
        if r_dnn:
            print(f"{name}: infercore with every native kernel off {r_dnn:.1f} tok/s")
        print(f"{name}: infercore {r_ours:.1f} tok/s, transformers {r_hf:.1f} tok/s "
              f"({r_ours / r_hf:.2f}x), floor {floor:.1f} tok/s, same tokens: {same}")
        cases.append(case(
            f"smollm2-135m decode bs1 {name} {args.tokens} tokens",
            metric="decode throughput", unit="tok/s", ours=r_ours, peers={"transformers generate": r_hf},
            floor=floor, greedy_tokens_identical=same, weight_bytes=weight_bytes,
            read_bandwidth_GBps=bw / 1e9, threads=torch.get_num_threads(),
            native_gemv=native, native_layer_ops=native, ours_per_layer_calls_tok_s=r_layer,
            ours_op_by_op_tok_s=r_op_by_op,
            ours_aten_layer_ops_tok_s=r_aten_ops,
            ours_all_native_off_tok_s=r_dnn,
        ))
    write_results(args.out, "cpu_decode", "cpu", cases)


if __name__ == "__main__":
    main()
