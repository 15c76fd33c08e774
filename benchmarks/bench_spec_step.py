"""What a speculative step costs on the GPU, bounded from both sides: decode throughput of the Engine with drafts
that are all right and drafts that are all wrong, against the same Engine without drafts (CUDA graphs, async
scheduling), on random bf16 weights of the SmolLM2-135M and Llama-3.1-8B shapes.

Random weights give no text to look up, so the drafts come from an oracle: the greedy tokens of the engine with
drafts itself ("right": every draft is kept; found by re-running on the last run's output, starting from the engine
without drafts, since a verification's rounding can part from a one-token step's at a near tie; the kept fraction
and whether the tokens equal the plain run's are recorded), or the plain run's tokens plus one modulo the
vocabulary ("wrong": nothing is kept, the cost of verifying k wasted tokens). The lm_head is scaled by
``--logit-scale`` to make near ties rarer. Real drafts fall between the bounds; their acceptance
on real weights is in ``bench_spec.py``'s results.

Rate = B (N - 1) / (t(N) - t(1)): generated tokens past the first, over the time they took.

    python benchmarks/bench_spec_step.py --out benchmarks/results/h200/spec_step.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

import infercore.engine.engine as engine_mod  # noqa: E402
from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402

SMOLLM2 = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    hidden_act="silu",
)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="smollm2-135m,llama3.1-8b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--logit-scale", type=float, default=64.0)
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0: the shape's; smoke tests)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    shapes = {"smollm2-135m": SMOLLM2, "llama3.1-8b": LLAMA_8B}
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    dev = torch.device(args.device)
    cases = []
    for shape in args.shapes.split(","):
        cfg = ModelConfig.from_hf(dict(shapes[shape], **({"num_hidden_layers": args.layers} if args.layers else {})))
        torch.manual_seed(0)
        model = build_model(cfg, dtype=torch.bfloat16, device=dev, init="normal")
        with torch.no_grad():
            model.lm_head.weight.mul_(args.logit_scale)
        max_b = max(batches)
        page = 16
        common = dict(page_size=page, num_pages=max_b * -(-(args.prompt + args.new + page) // page) + 64,
                      max_num_seqs=max_b, max_num_batched_tokens=8192, max_model_len=args.prompt + args.new + page,
                      enable_prefix_caching=False)
        # cuda_graph_max_batch counts rows: a verification step has B x (1 + k) of them
        engines = {0: Engine(model, cuda_graph_max_batch=max_b, **common),
                   **{k: Engine(model, num_speculative_tokens=k, cuda_graph_max_batch=max_b * (1 + k), **common)
                      for k in ks}}
        gen = torch.Generator().manual_seed(1)
        for B in batches:
            prompts = [p.tolist() for p in torch.randint(0, cfg.vocab_size, (B, args.prompt), generator=gen)]
            sp1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            spn = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
            ref = {tuple(p): o.token_ids for p, o in zip(prompts, engines[0].generate(prompts, spn))}
            P = args.prompt

            def oracle(wrong: bool, ref=ref, P=P, V=cfg.vocab_size):
                def propose(tokens, n_draft, *, min_n, max_n):
                    done = len(tokens) - P
                    draft = ref[tuple(tokens[:P])][done : done + n_draft]
                    return [(t + 1) % V for t in draft] if wrong else draft
                return propose

            def settle(eng, ref=ref, prompts=prompts, spn=spn):
                """The "right" oracle's tokens for ``eng``: its own greedy tokens under them. The plain run's may
                part from a verification's rounding at a near tie; re-run on the last output until every draft
                is kept (at most 4 times)."""
                src = dict(ref)
                for _ in range(4):
                    engine_mod.propose_ngram = oracle(False, ref=src)
                    outs = eng.generate(prompts, spn)
                    if all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens for o in outs):
                        break
                    src = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
                return src

            def rate(eng, prompts=prompts, B=B, sp1=sp1, spn=spn):
                eng.generate(prompts, spn)  # warm-up: compiles the step shapes this run meets
                t1 = min(timed(lambda: eng.generate(prompts, sp1)) for _ in range(2))
                best, outs = float("inf"), None
                for _ in range(2):
                    t = time.perf_counter()
                    outs = eng.generate(prompts, spn)
                    sync()
                    best = min(best, time.perf_counter() - t)
                return B * (args.new - 1) / (best - t1), outs

            plain, _ = rate(engines[0])
            saved = engine_mod.propose_ngram
            try:
                for k in ks:
                    got = {}
                    right = settle(engines[k])
                    for kind in ("right", "wrong"):
                        engine_mod.propose_ngram = oracle(kind == "wrong", ref=right if kind == "right" else ref)
                        r, outs = rate(engines[k])
                        kept = sum(o.metrics.num_accepted_tokens for o in outs)
                        drafted = sum(o.metrics.num_draft_tokens for o in outs)
                        same = all(o.token_ids == ref[tuple(p)] for p, o in zip(prompts, outs))
                        got[kind] = (r, kept, drafted, same)
                    (r_right, kept, drafted, same), (r_wrong, _, _, same_w) = got["right"], got["wrong"]
                    cases.append(case(
                        f"{shape} decode bs{B} prompt{P} new{args.new} bf16 k={k}, every draft right",
                        metric="decode throughput", unit="tok/s", ours=r_right,
                        peers={"engine without drafts (CUDA graphs, async)": plain}, floor=None,
                        speedup_over_no_drafts=r_right / plain, kept_fraction=kept / max(drafted, 1),
                        draft_tokens=drafted, tokens_identical_to_no_drafts=same,
                        wrong_drafts_tok_s=r_wrong, wrong_drafts_over_no_drafts=r_wrong / plain,
                        wrong_drafts_tokens_identical=same_w, logit_scale=args.logit_scale))
                    print(f"{shape} B={B} k={k}: right drafts {r_right:.0f} tok/s ({r_right / plain:.2f}x, kept "
                          f"{kept}/{drafted}, same {same}), wrong drafts {r_wrong:.0f} ({r_wrong / plain:.2f}x, "
                          f"same {same_w}), no drafts {plain:.0f}", flush=True)
            finally:
                engine_mod.propose_ngram = saved
        del engines, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    label = torch.cuda.get_device_name() if dev.type == "cuda" else args.device
    write_results(args.out, "spec_step", label, cases)


if __name__ == "__main__":
    main()
