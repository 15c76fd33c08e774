"""The CPU decode stack's per-step Python checks (``LlamaForCausalLM._native_stack``), kept table vs every layer
re-checked each step (the kept entry dropped before each call, as before the thirty-seventh session): time in the
checks per token and decode throughput, SmolLM2 bf16 with its GGUF Q4_1 blocks as stored, interleaved rounds.

    python benchmarks/probe_stack_checks.py --out benchmarks/results/cpu/sweeps/cpu_stack_checks.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402
from bench_cpu_decode import PROMPT, decode_rates  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402
from infercore.models.llama import LlamaForCausalLM  # noqa: E402
from infercore.quant.gguf_native import use_gguf_blocks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_stack_checks.json")
    args = ap.parse_args()
    eng = Engine.from_pretrained(device="cpu", dtype=torch.bfloat16, enable_prefix_caching=False)
    use_gguf_blocks(eng.model, default_model_path())
    tok = eng.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True),
                     add_special_tokens=False)
    real = LlamaForCausalLM._native_stack
    spent = {"kept": [0.0, 0], "rechecked": [0.0, 0]}
    mode = ["kept"]

    def timed(self, *a):
        if mode[0] == "rechecked":
            self.__dict__.pop("_native_stack_fast", None)
        t = time.perf_counter()
        out = real(self, *a)
        s = spent[mode[0]]
        s[0] += time.perf_counter() - t
        s[1] += 1
        return out

    LlamaForCausalLM._native_stack = timed

    def runner(name):
        def run(n: int) -> list[int]:
            mode[0] = name
            return eng.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
        return run

    same = runner("kept")(args.tokens) == runner("rechecked")(args.tokens)
    for s in spent.values():
        s[:] = [0.0, 0]
    r_kept, r_re = decode_rates([runner("kept"), runner("rechecked")], args.tokens, args.repeats)
    us = {k: v[0] / v[1] * 1e6 for k, v in spent.items()}
    print(f"checks a step: kept {us['kept']:.0f} us, rechecked {us['rechecked']:.0f} us; decode {r_kept:.1f} vs "
          f"{r_re:.1f} tok/s; same tokens: {same}", flush=True)
    cases = [case("smollm2-135m gguf-native-q4_1 decode bs1 bf16, stack table kept vs every layer re-checked",
                  metric="decode throughput", unit="tok/s", ours=r_kept, peers={"every layer re-checked": r_re},
                  floor=None, checks_us_per_step_kept=us["kept"], checks_us_per_step_rechecked=us["rechecked"],
                  same_tokens=same, threads=torch.get_num_threads())]
    write_results(args.out, "probe_stack_checks", "cpu", cases)


if __name__ == "__main__":
    main()
