"""Speculative decoding by prompt lookup on the real SmolLM2-135M-Instruct weights: the Engine with and without
n-gram drafts, next to transformers ``generate`` plain and with its own prompt lookup
(``prompt_lookup_num_tokens``), on the same dequantized GGUF weights in the same dtype and device.

Each prompt is run greedy to its end-of-sequence (or ``--max-tokens``); the rate is generated tokens / wall time of
the whole request (prefill included, the same for every runner), best of ``--repeats`` interleaved runs. The
Engine's tokens with drafts are checked against its tokens without. Prompts: code to annotate and a paragraph to
repeat (the output copies the prompt) and an open story (little to copy: the cost of drafts that miss).

    python benchmarks/bench_spec.py --device cpu --out benchmarks/results/cpu/spec_decode.json
    python benchmarks/bench_spec.py --device cuda --out benchmarks/results/h200/spec_decode.json
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

CODE = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''
PARAGRAPH = ("The lighthouse stood at the edge of the harbour for two hundred years. Every night its keeper climbed "
             "the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens, so that ships "
             "far out at sea could find their way past the rocks and into the calm water of the bay.")
PROMPTS = {
    "code": f"Add type hints and a docstring to this Python function. Reply with the whole function.\n\n{CODE}",
    "quote": f"{PARAGRAPH}\n\nRepeat the paragraph above word for word, then add one sentence about it.",
    "open": "Write a short story about a lighthouse keeper.",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="in fp32 every runner generates the same tokens, so the rates compare like for like")
    ap.add_argument("--k", default="3,5", help="draft lengths (num_speculative_tokens) to run")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cases = []
    for dtype_name in args.dtypes.split(","):
        cases += run_dtype(args, dtype_name)
    write_results(args.out, "spec_decode", args.device, cases)


def run_dtype(args, dtype_name: str) -> list:
    import transformers

    dtype = getattr(torch, dtype_name)
    path = default_model_path()
    ks = [int(k) for k in args.k.split(",")]
    common = dict(device=args.device, dtype=dtype, enable_prefix_caching=False, max_num_seqs=8)
    plain = Engine.from_pretrained(path, **common)
    specs = {k: Engine.from_pretrained(path, num_speculative_tokens=k, **common) for k in ks}
    tok = plain.tokenizer

    ckpt = load_checkpoint(path)
    hf = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**ckpt.config)).to(dtype).eval()
    missing, unexpected = hf.load_state_dict({k: v.to(dtype) for k, v in ckpt.weights()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    hf.to(args.device)
    eos = sorted(plain._eos)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    cases = []
    for name, text in PROMPTS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                         add_special_tokens=False)
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        x = torch.tensor([ids], device=args.device)

        def ours(eng, ids=ids, sp=sp):
            return lambda: eng.generate([ids], sp)[0]

        n_prompt = len(ids)

        def theirs(lookup: int | None, x=x, n_prompt=n_prompt):
            kw = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}

            @torch.inference_mode()
            def call():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_tokens,
                                  do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **kw)
                return out[0, n_prompt:].tolist()
            return call

        runs = {"infercore": ours(plain), **{f"infercore k={k}": ours(e) for k, e in specs.items()},
                "transformers": theirs(None), **{f"transformers prompt lookup k={k}": theirs(k) for k in ks}}
        results = {label: run() for label, run in runs.items()}  # warm-up, and the outputs compared below
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeats):
            for label, run in runs.items():
                sync()
                t = time.perf_counter()
                run()
                sync()
                best[label] = min(best[label], time.perf_counter() - t)
        base = results["infercore"].token_ids
        n_hf = len(results["transformers"])
        toks = {label: out if isinstance(out, list) else out.token_ids for label, out in results.items()}
        rates = {label: len(toks[label]) / best[label] for label in runs}  # each run's own tokens
        for k in ks:
            out = results[f"infercore k={k}"]
            m = out.metrics
            forwards = len(out.token_ids) - m.num_accepted_tokens  # the prefill's and each later step's
            row = case(
                f"smollm2-135m {name} greedy {dtype_name} k={k}", metric="generation throughput", unit="tok/s",
                ours=rates[f"infercore k={k}"],
                peers={"infercore without drafts": rates["infercore"], "transformers generate": rates["transformers"],
                       f"transformers prompt lookup k={k}": rates[f"transformers prompt lookup k={k}"]},
                floor=None, speedup_over_no_drafts=rates[f"infercore k={k}"] / rates["infercore"],
                tokens_identical_to_no_drafts=out.token_ids == base, generated_tokens=len(base),
                transformers_tokens=n_hf, transformers_tokens_identical=results["transformers"] == base,
                transformers_lookup_tokens_identical=toks[f"transformers prompt lookup k={k}"] == base,
                draft_tokens=m.num_draft_tokens, accepted_tokens=m.num_accepted_tokens,
                acceptance_rate=m.num_accepted_tokens / max(m.num_draft_tokens, 1),
                tokens_per_forward=len(out.token_ids) / forwards, best_seconds=best, threads=torch.get_num_threads())
            cases.append(row)
            print(f"{name} k={k}: {rates[f'infercore k={k}']:.1f} tok/s vs {rates['infercore']:.1f} without drafts "
                  f"({row['speedup_over_no_drafts']:.2f}x), transformers {rates['transformers']:.1f} / lookup "
                  f"{rates[f'transformers prompt lookup k={k}']:.1f}; accepted {m.num_accepted_tokens}/"
                  f"{m.num_draft_tokens}, {row['tokens_per_forward']:.2f} tokens/forward, "
                  f"identical: {row['tokens_identical_to_no_drafts']}", flush=True)
    return cases


if __name__ == "__main__":
    main()
