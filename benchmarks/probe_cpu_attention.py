"""The native CPU decode attention (``ops/cpu_kernels.c``): its AVX-512 tiles against its scalar loops
(``cpu_native.scalar_attention``), without its key splits (``cpu_native.unsplit_attention``) and torch's SDPA, one
token row over a paged bf16 cache, at the head shapes of SmolLM2-135M (9 / 3 x 64), a 1B-class Llama (16 / 4 x 64)
and Llama-3.1-8B (32 / 8 x 128) and 256-4096 keys, cache-resident and read from DRAM, best time of interleaved
rounds with torch's thread count; then SmolLM2's own Q4_1 blocks decoding after a long prompt (``--context`` tokens
of ``pydoc_data.topics``), ours with each attention path against llama.cpp on the same file (llama-cpp-python where
installed; its default options, and with ``flash_attn=True``).

    python benchmarks/probe_cpu_attention.py [--out benchmarks/results/cpu/sweeps/cpu_attention.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _common import best_interleaved, case, write_results  # noqa: E402
from bench_cpu_decode import decode_rates  # noqa: E402
from bench_cpu_quant import llama_cpp_runner  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402

SHAPES = {"smollm2-135m 9/3 x 64": (9, 3, 64), "1b-class 16/4 x 64": (16, 4, 64), "llama-8b 32/8 x 128": (32, 8, 128)}
PAGE = 16


def time_shape(hq: int, hk: int, d: int, n: int, rounds: int, cold: bool) -> tuple[dict[str, float], float]:
    """Best microseconds of each path over ``n`` keys, and the vector path's largest difference from SDPA. ``cold``:
    each call reads another set of pages of a pool of > 256 MB (a decode step's caches come from DRAM), else the
    same pages every call (cache-resident at these sizes)."""
    pp = n // PAGE + 1  # pages a set
    sets = max(2, (256 << 20) // (pp * PAGE * hk * d * 4)) if cold else 1
    kc, vc = (torch.randn(sets * pp, PAGE, hk, d).bfloat16() for _ in range(2))
    q = torch.randn(1, hq, d).bfloat16()
    tables = [torch.arange(r * pp, (r + 1) * pp, dtype=torch.int32)[None] for r in range(sets)]
    lens = torch.tensor([n], dtype=torch.int32)
    kv = [tuple(c[r * pp:(r + 1) * pp].reshape(-1, hk, d)[:n].transpose(0, 1)[None] for c in (kc, vc))
          for r in range(sets)]
    calls = [0]

    def native():
        calls[0] += 1
        return cpu_native.decode_attention(q, kc, vc, lens, tables[calls[0] % sets], d ** -0.5, None)

    def scalar():
        with cpu_native.scalar_attention():
            return native()

    def unsplit():
        with cpu_native.unsplit_attention():
            return native()

    def sdpa():  # the cache's keys already gathered contiguous: only the product is timed
        calls[0] += 1
        k, v = kv[calls[0] % sets]
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

    fns = {"vector": native, "unsplit": unsplit, "scalar": scalar, "sdpa": sdpa}
    best = best_interleaved(fns, rounds)
    calls[0] = -1  # both on set 0
    err = (native().float() - sdpa().float()[:, :, 0]).abs().max().item()
    return {key: v * 1e6 for key, v in best.items()}, err


PEERS = {"unsplit": "vector, no key splits", "scalar": "scalar loops (the previous kernel)",
         "sdpa": "torch SDPA (contiguous K/V, enable_gqa)"}


def op_case(name: str, us: dict[str, float], kv_bytes: int, **extra) -> dict:
    """A result row of one shape: the rate each path reads the K / V bytes at (GB/s, higher is better), the times
    beside it."""
    return case(name, metric="K/V read rate", unit="GB/s", ours=kv_bytes / us["vector"] / 1e3,
                peers={PEERS[k]: kv_bytes / us[k] / 1e3 for k in PEERS}, floor=None, time_us=us,
                speedup_over_scalar=us["scalar"] / us["vector"], speedup_over_sdpa=us["sdpa"] / us["vector"],
                kv_bytes=kv_bytes, **extra)


def op_cases(contexts: list[int], rounds: int) -> list[dict]:
    torch.manual_seed(0)
    cases = []
    for cold in (False, True):
        where = "caches read from DRAM (a pool of > 256 MB, another page set each call)" if cold else \
            "the same pages each call (cache-resident)"
        for name, (hq, hk, d) in SHAPES.items():
            for n in contexts:
                us, err = time_shape(hq, hk, d, n, rounds, cold)
                splits = cpu_native.attention_splits(1, hk, d, hq // hk, n)
                print(f"{name} {n} keys{' cold' if cold else ''}: vector {us['vector']:.1f} us ({splits} key splits), "
                      f"unsplit {us['unsplit']:.1f}, scalar {us['scalar']:.1f}, sdpa {us['sdpa']:.1f}", flush=True)
                cases.append(op_case(f"decode attention {name}, {n} keys, bf16 paged cache, one row, {where}", us,
                                     2 * n * hk * d * 2, key_splits=splits, threads=torch.get_num_threads(),
                                     max_abs_diff_vs_sdpa=err))
    return cases


def time_codes(hq: int, hk: int, d: int, n: int, rounds: int) -> dict[str, float]:
    """Best microseconds over ``n`` keys of 1-byte caches (int8 / fp8 codes, fp32 scales per slot and KV head) read
    by the vector path, of the same caches through the op's previous CPU path (each sequence's context dequantized,
    then SDPA), and of the bf16 cache through the vector path; DRAM-read pools as in time_shape."""
    from infercore.ops.attention import cpu as attn_cpu
    from infercore.ops.kv_cache.quant import quantize_kv_ref

    pp = n // PAGE + 1
    sets = max(2, (256 << 20) // (pp * PAGE * hk * d * 4))
    kb, vb = (torch.randn(sets * pp, PAGE, hk, d).bfloat16() for _ in range(2))
    q = torch.randn(1, hq, d).bfloat16()
    tables = [torch.arange(r * pp, (r + 1) * pp, dtype=torch.int32)[None] for r in range(sets)]
    lens = torch.tensor([n], dtype=torch.int32)
    quant = {}
    for label, dt in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        (kc, ks), (vc, vs) = (quantize_kv_ref(c.float(), dt) for c in (kb, vb))
        quant[label] = (kc, vc, ks.reshape(kc.shape[:3]), vs.reshape(kc.shape[:3]))
    calls = [0]

    def table():
        calls[0] += 1
        return tables[calls[0] % sets]

    def run(label, fallback=False):
        kc, vc, ks, vs = quant[label]
        if not fallback:
            return cpu_native.decode_attention(q, kc, vc, lens, table(), d ** -0.5, None, ks, vs)
        real = cpu_native.decode_attention
        cpu_native.decode_attention = lambda *a, **k: None  # the op's previous path for these caches
        try:
            return attn_cpu.paged_attention_decode_cpu(q, kc, vc, seq_lens=lens, block_table=table(),
                                                       scale=d ** -0.5, k_scale=ks, v_scale=vs)
        finally:
            cpu_native.decode_attention = real

    fns = {"int8": lambda: run("int8"), "fp8": lambda: run("fp8"),
           "bf16": lambda: cpu_native.decode_attention(q, kb, vb, lens, table(), d ** -0.5, None),
           "int8 dequantized + SDPA": lambda: run("int8", True), "fp8 dequantized + SDPA": lambda: run("fp8", True)}
    best = best_interleaved(fns, rounds)
    return {k: v * 1e6 for k, v in best.items()}


def kv_cases(contexts: list[int], rounds: int) -> list[dict]:
    torch.manual_seed(0)
    cases = []
    for name, (hq, hk, d) in SHAPES.items():
        for n in contexts:
            us = time_codes(hq, hk, d, n, rounds)
            print(f"{name} {n} keys, 1-byte caches: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()), flush=True)
            for label in ("int8", "fp8"):
                cases.append(case(f"decode attention {name}, {n} keys, {label} paged cache (codes and fp32 scales), "
                                  "one row, caches read from DRAM", metric="speedup over the previous path "
                                  "(dequantize + SDPA), from best times", unit="x",
                                  ours=us[f"{label} dequantized + SDPA"] / us[label], peers={}, floor=None,
                                  time_us=us, threads=torch.get_num_threads()))
    return cases


def e2e_case(context: int, tokens: int, repeats: int, model: str | None = None, a8: bool = False) -> dict:
    from pydoc_data.topics import topics

    # prefix caching on: the timed runs reuse the prompt's KV as llama.cpp's do (its generate keeps the matching
    # prefix), so the two-length difference is not a difference of two long prefills
    eng = Engine.from_pretrained(model, device="cpu", dtype=torch.bfloat16, quantization="gguf",
                                 enable_prefix_caching=True)
    if a8 and not cpu_native.set_int8_activations(True):
        raise SystemExit("8-bit activations are not available here (AVX512-VNNI)")
    ids = eng.tokenizer.encode(" ".join(topics.values()), add_special_tokens=False)[:context]

    def runner(scalar: bool):
        def run(n: int) -> list[int]:
            with cpu_native.scalar_attention() if scalar else contextlib.nullcontext():
                sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                return eng.generate([ids], sp)[0].token_ids
        return run

    runs, names = [runner(False), runner(True)], ["vector attention", "scalar attention"]
    for kw in ({}, {"flash_attn": True}):
        lcpp = llama_cpp_runner(ids, model, n_ctx=context + tokens + 64, **kw)
        if lcpp is not None:
            runs.append(lcpp[0])
            names.append(f"llama.cpp {lcpp[1]} (llama-cpp-python, same GGUF file{', flash_attn' if kw else ''})")
    rates = decode_rates(runs, tokens, repeats)
    print(", ".join(f"{n} {r:.1f} tok/s" for n, r in zip(names, rates)), flush=True)
    what = f"{os.path.basename(model)} (blocks as stored{', 8-bit activations' if a8 else ''})" if model else \
        "smollm2-135m Q4_1 (the package's file, blocks as stored)"
    return case(f"{what} decode bs1 after a {len(ids)}-token prompt, "
                f"{tokens} tokens", metric="decode throughput", unit="tok/s", ours=rates[0],
                peers={"ours, " + n if n.startswith("scalar") else n: r for n, r in zip(names[1:], rates[1:])},
                floor=None, threads=torch.get_num_threads())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--context", type=int, default=2000, help="the end-to-end prompt's tokens (0: no end-to-end row)")
    ap.add_argument("--kv-codes", action="store_true", help="also int8 / fp8 caches (kv_cases)")
    ap.add_argument("--model", default=None, help="the end-to-end row's GGUF file (default: the package's SmolLM2)")
    ap.add_argument("--int8-activations", action="store_true", help="the end-to-end row on 8-bit activations")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_attention.json")
    args = ap.parse_args()
    if not cpu_native.available():
        raise SystemExit(f"the native kernels do not run here: {cpu_native.status()}")
    contexts = [int(c) for c in args.contexts.split(",") if c]  # --contexts '': none
    cases = op_cases(contexts, args.rounds)
    if args.kv_codes:
        cases += kv_cases(contexts, args.rounds)
    if args.context:
        cases.append(e2e_case(args.context, args.tokens, args.repeats, args.model, args.int8_activations))
    write_results(args.out, "probe_cpu_attention", "cpu", cases)


if __name__ == "__main__":
    main()
