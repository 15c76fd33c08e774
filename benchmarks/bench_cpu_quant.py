# ruff: noqa: B023  (closures are run inside the loop iteration that defines them)
"""Weight-only INT4 / INT8 on the CPU: the fast path (``quant/cpu.py``: the native kernels for decode rows, ATen's
packed kernels past them, bf16 activations) against the reference it replaced (dequantize, then matmul), ATen's
kernels alone and the dense bf16 weight, same threads, same process.

1. One linear (``quant.wq_matmul``) at 1-64 rows: a 4096 x 4096 weight (the 8B shape's o_proj) and SmolLM2's merged
   gate_up (3072 x 576); INT4 g128 with zero points, INT8 per channel, GGUF Q4_1 / Q8_0 blocks and FP8 e4m3
   (``quant.fp8_wo_matmul``) per channel and per 128 x 128 block. Peers: the reference (of the op the format calls),
   ATen's packed kernel alone (native kernels off) and ``F.linear`` on the dense bf16 weight. Floor (1 row): bytes
   of the weight as stored / the measured read bandwidth.
   Where the native INT4 / INT8 GEMVs run, also with 8-bit activations (``cpu_native.set_int8_activations``).
2. Greedy decode of SmolLM2-135M-Instruct in bf16, batch 1 (decode rate as ``bench_cpu_decode.py``: prefill
   excluded): each scheme, and the checkpoint's own Q4_1 blocks run as stored (``gguf-native-q4_1``), through the
   fast path (the whole decoder stack in one native call), one call per layer, op by op, with every native kernel
   off and through the reference (``INFERCORE_BACKEND``), next to the unquantized model; llama.cpp on the same GGUF
   file where llama-cpp-python is installed. A scheme suffixed "+a8" runs its INT4 GEMVs on 8-bit activations.

    python benchmarks/bench_cpu_quant.py [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402
from bench_cpu_decode import PROMPT, decode_rates, read_bandwidth  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402
from infercore.quant import (  # noqa: E402
    FP8Weight,
    GGUFWeight,
    IntWeight,
    NF4Weight,
    QuantLinear,
    fp8_wo_matmul,
    gguf_matmul,
    nf4_matmul,
    quantize,
    wq_matmul,
)
from infercore.quant import cpu as QC  # noqa: E402
from infercore.quant.gguf_native import use_gguf_blocks  # noqa: E402

A8 = "+a8"  # a scheme's suffix: its INT4 GEMVs on 8-bit activations (cpu_native.set_int8_activations)
NATIVE_Q4_1 = "gguf-native-q4_1"  # the checkpoint's own Q4_1 blocks (quant.gguf_native), not a requantization
SHAPES = {"4096x4096": (4096, 4096), "smollm2 gate_up 3072x576": (3072, 576)}
FORMATS = {  # name: the quantizer of a dense [N, K] weight
    "int4 g128": lambda d: IntWeight.quantize(d, clip_search=False, bits=4, group_size=128),
    "int8 per channel": lambda d: IntWeight.quantize(d, clip_search=False, bits=8, group_size=None, symmetric=True),
    "gguf q4_1": lambda d: GGUFWeight.quantize(d, qtype="q4_1"),
    "gguf q8_0": lambda d: GGUFWeight.quantize(d, qtype="q8_0"),
    "fp8 per channel": lambda d: FP8Weight.quantize(d),
    "fp8 block 128": lambda d: FP8Weight.quantize(d, block_size=128),
    "nf4 absmax 64": lambda d: NF4Weight.quantize(d),
}


def calls_per_s(fn, budget_s: float = 1.0, max_calls: int = 200) -> float:
    """Calls per second of ``fn``: one warm-up call, then as many as fit ``budget_s`` (at least 3), best of 3 runs."""
    fn()
    t = time.perf_counter()
    fn()
    once = time.perf_counter() - t
    n = max(3, min(max_calls, int(budget_s / 3 / max(once, 1e-6))))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return 1.0 / best


def linear_cases(ms: list[int], bw: float, formats: list[str] | None = None) -> list[dict]:
    cases = []
    for sname, (n, k) in SHAPES.items():
        torch.manual_seed(0)
        dense = torch.randn(n, k) * 0.02
        for fname, make in FORMATS.items():
            if formats and fname not in formats:
                continue
            w = make(dense)
            wb = w.dequantize(torch.bfloat16)
            nbytes = sum(t.numel() * t.element_size() for t in w.tensors().values())  # as stored
            gguf = isinstance(w, GGUFWeight)
            mm = (gguf_matmul if gguf else fp8_wo_matmul if isinstance(w, FP8Weight) else nf4_matmul
                  if isinstance(w, NF4Weight) else wq_matmul)
            op = {gguf_matmul: "quant.gguf_matmul", fp8_wo_matmul: "quant.fp8_wo_matmul",
                  nf4_matmul: "quant.nf4_matmul"}.get(mm, "quant.wq_matmul")
            for m in ms:
                x = torch.randn(m, k).to(torch.bfloat16)
                ours = calls_per_s(lambda: mm(x, w))
                os.environ["INFERCORE_BACKEND"] = f"{op}:reference"
                ref = calls_per_s(lambda: mm(x, w), budget_s=0.5, max_calls=20)
                del os.environ["INFERCORE_BACKEND"]
                bf16 = calls_per_s(lambda: F.linear(x, wb))
                with cpu_native.disabled():  # ATen's packed kernels alone (no native INT4 rows)
                    aten = calls_per_s(lambda: mm(x, w))
                a8 = {}
                if m <= QC.NATIVE_Q4_MAX_ROWS and (QC.native_q4(w) or QC.native_q8(w)) is not None:  # 8-bit acts
                    with cpu_native.int8_activations() as on:
                        if on:
                            a8 = dict(int8_activations_us=1e6 / calls_per_s(lambda: mm(x, w)))
                row = case(f"{fname} {sname} M={m} bf16 activations", metric="linear calls", unit="calls/s",
                           ours=ours, peers={"reference (dequantize + matmul)": ref, "bf16 F.linear, dense": bf16},
                           floor=bw / nbytes if m == 1 else None, kernel=QC.cpu_kind(w), weight_bytes=nbytes,
                           ours_us=1e6 / ours, reference_us=1e6 / ref, bf16_us=1e6 / bf16, aten_us=1e6 / aten,
                           native=(m <= QC.FP8_NATIVE_MAX_ROWS and cpu_native.q4_supported()) if mm is fp8_wo_matmul
                           else (m <= QC.NF4_NATIVE_MAX_ROWS and cpu_native.q4_supported()) if mm is nf4_matmul
                           else m <= QC.NATIVE_Q4_MAX_ROWS and (QC.native_q4(w) or QC.native_q8(w)) is not None,
                           **a8)
                print(f"{row['case']}: {1e6 / ours:.0f} us (reference {1e6 / ref:.0f}, bf16 dense {1e6 / bf16:.0f}, "
                      f"ATen alone {1e6 / aten:.0f}" + (f", 8-bit activations {a8['int8_activations_us']:.0f}" if a8
                                                        else "") + ")", flush=True)
                cases.append(row)
    return cases


def llama_cpp_runner(ids: list[int], path=None, n_ctx: int = 1024, **kwargs):
    """``(run, version)``: greedy decode of GGUF file ``path`` (default: the package's SmolLM2 Q4_1) through
    llama-cpp-python (an optional peer; None where it is not installed), with torch's thread count and prompt
    ``ids`` (``n_ctx``: its context size; ``kwargs``: further ``llama_cpp.Llama`` options). Like our runs
    (``ignore_eos``), it
    goes on past an end-of-sequence token. llama.cpp keeps the prompt's KV between calls; the decode rate's
    two-length difference removes the prefill either way."""
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python not installed: no llama.cpp peer", flush=True)
        return None
    llm = llama_cpp.Llama(model_path=str(path or default_model_path()), n_threads=torch.get_num_threads(), n_ctx=n_ctx,
                          verbose=False, seed=0, **kwargs)

    def run(n: int) -> list[int]:
        toks = []
        for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            toks.append(t)
            if len(toks) == n:
                break
        return toks

    return run, llama_cpp.__version__


def e2e_cases(schemes: list[str], tokens: int, repeats: int) -> list[dict]:
    base = Engine.from_pretrained(device="cpu", dtype=torch.bfloat16, enable_prefix_caching=False)
    ids = base.tokenizer.encode(
        base.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True),
        add_special_tokens=False)

    def runner(eng, backend=None, ctx=contextlib.nullcontext):
        def run(n: int) -> list[int]:
            if backend:
                os.environ["INFERCORE_BACKEND"] = backend
            try:
                with ctx():
                    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                    return eng.generate([ids], sp)[0].token_ids
            finally:
                os.environ.pop("INFERCORE_BACKEND", None)
        return run

    cases = []
    dense_run = runner(base)
    for scheme in schemes:
        # "+a8": the INT4 GEMVs on 8-bit activations (cpu_native.set_int8_activations) in the fast path's runs
        scheme, a8 = (scheme[: -len(A8)], True) if scheme.endswith(A8) else (scheme, False)
        eng = Engine.from_pretrained(device="cpu", dtype=torch.bfloat16, enable_prefix_caching=False)
        # in place: the engine's runner holds the same modules
        if scheme == NATIVE_Q4_1:
            use_gguf_blocks(eng.model, default_model_path())
        else:
            quantize(eng.model, scheme)
        # the op whose reference the "reference" run forces: the one the model's quantized linears call
        kinds = {m.qweight_format.kind for m in eng.model.modules() if isinstance(m, QuantLinear)}
        op = {"gguf": "quant.gguf_matmul", "fp8": "quant.fp8_wo_matmul", "fp4": "quant.fp4_matmul",
              "w8a8": "quant.w8a8_matmul", "nf4": "quant.nf4_matmul"}.get(
            kinds.pop() if len(kinds) == 1 else "", "quant.wq_matmul")
        def with_a8(ctx):  # the native paths of a "+a8" scheme on 8-bit activations
            if not a8:
                return ctx

            @contextlib.contextmanager
            def both():
                with cpu_native.int8_activations(), ctx():
                    yield
            return both

        fast = runner(eng, ctx=with_a8(contextlib.nullcontext))
        ref, aten = runner(eng, f"{op}:reference"), runner(eng, ctx=cpu_native.disabled)
        per_layer, op_by_op = runner(eng, ctx=with_a8(cpu_native.layer_stack_disabled)), runner(
            eng, ctx=with_a8(cpu_native.fused_layers_disabled))
        same = fast(tokens) == ref(tokens)
        r_fast, r_ref, r_dense, r_aten, r_layer, r_ops = decode_rates([fast, ref, dense_run, aten, per_layer, op_by_op],
                                                                      tokens, repeats)  # fmt: skip
        scheme += A8 if a8 else ""
        print(f"{scheme}: fast path {r_fast:.1f} tok/s (one native call per layer {r_layer:.1f}, op by op {r_ops:.1f}, "
              f"native host kernels off: {r_aten:.1f}), reference {r_ref:.1f}, unquantized bf16 {r_dense:.1f}; same "
              f"tokens as the reference: {same}", flush=True)
        peers = {"reference (dequantize + matmul)": r_ref, "unquantized bf16": r_dense}
        extra = {}
        if scheme.startswith(NATIVE_Q4_1) and (lcpp := llama_cpp_runner(ids)) is not None:
            # the same file's blocks through llama.cpp, timed interleaved with ours
            r_fast2, r_lcpp = decode_rates([fast, lcpp[0]], tokens, repeats)
            agree = sum(a == b for a, b in zip(fast(tokens), lcpp[0](tokens)))
            print(f"{scheme}: llama.cpp {lcpp[1]} on the same GGUF {r_lcpp:.1f} tok/s, ours {r_fast2:.1f} in the "
                  f"same rounds; {agree}/{tokens} greedy tokens agree", flush=True)
            peers[f"llama.cpp {lcpp[1]} (llama-cpp-python, same GGUF file)"] = r_lcpp
            extra = dict(ours_in_llama_cpp_rounds_tok_s=r_fast2, greedy_tokens_agreeing_with_llama_cpp=agree)
        cases.append(case(f"smollm2-135m decode bs1 bf16 {scheme} {tokens} tokens", metric="decode throughput",
                          unit="tok/s", ours=r_fast, peers=peers,
                          floor=None, greedy_tokens_identical_to_reference=same, threads=torch.get_num_threads(),
                          native_kernels_off_tok_s=r_aten, per_layer_calls_tok_s=r_layer, op_by_op_tok_s=r_ops,
                          native=cpu_native.status(), **extra))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--schemes", default=f"w4a16-g128,w8a16,{NATIVE_Q4_1}")
    ap.add_argument("--formats", default="", help=f"linear cases of these formats only (of {', '.join(FORMATS)})")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu/cpu_quant.json")
    args = ap.parse_args()
    bw = read_bandwidth()
    # --ms "": model decode rates only
    cases = linear_cases([int(v) for v in args.ms.split(",") if v], bw, [f for f in args.formats.split(",") if f])
    cases += e2e_cases([s for s in args.schemes.split(",") if s], args.tokens, args.repeats)
    write_results(args.out, "cpu_quant", "cpu", cases, extra={"read_bandwidth_GBps": bw / 1e9})


if __name__ == "__main__":
    main()
