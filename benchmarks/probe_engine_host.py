"""Offline generation of a small model at large batches, where the engine's host work per step, not the GPU, sets
the rate: a random-weight SmolLM2-135M-shaped model (bf16) with SmolLM2's tokenizer (``--tokenizer``, see
``probe_detok_serving.py --save-tokenizer``), ``--batch`` requests of random prompts, ``--new`` tokens each (EOS
ignored, greedy) through ``Engine.generate`` (``max_num_seqs`` the largest batch): output tokens/s, best of
``--rounds``, and a digest of the texts (two trees run alike must print the same one). ``--phases`` also times the
engine's host phases (wrapped methods, a separate run: the wrappers cost time themselves).

    python benchmarks/probe_engine_host.py --out $OUT/engine_host.json --label new
    PYTHONPATH=old/src python benchmarks/probe_engine_host.py --out $OUT/engine_host_old.json --label old
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True)


def _wrap(acc: collections.Counter, cnt: collections.Counter, cls: type, name: str) -> None:
    f = getattr(cls, name, None)
    if f is None:
        return
    label = f"{cls.__name__}.{name}"

    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
            cnt[label] += 1

    setattr(cls, name, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=".wheels/smollm2_tokenizer.json")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--label", default="")
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import tokenizers

    from infercore.loading.tokenizer import Tokenizer
    from infercore.models import ModelConfig, build_model

    tok = Tokenizer(tokenizers.Tokenizer.from_file(args.tokenizer), eos_token="<|im_end|>")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(SMOLLM2), dtype=torch.bfloat16, device=device)
    batches = [int(b) for b in args.batches.split(",")]
    eng = Engine(model, tok, enable_prefix_caching=False, max_num_seqs=max(batches))
    rng = random.Random(0)
    cases, extra = [], {}
    for batch in batches:
        prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt)] for _ in range(batch)]
        sp = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
        eng.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8))  # graphs, compiles
        eng.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        best, digest = 0.0, ""
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            outs = eng.generate(prompts, sp)
            dt = time.perf_counter() - t0
            best = max(best, sum(len(o.token_ids) for o in outs) / dt)
            digest = hashlib.sha256("\x00".join(o.text for o in outs).encode()).hexdigest()[:16]
        print(f"{args.label} batch {batch}: {best:.0f} tok/s ({batch / best * 1e3:.2f} ms a step), texts {digest}",
              flush=True)
        cases.append(case(f"smollm2-135m-shape random bf16, {batch} requests x prompt {args.prompt} + {args.new} new "
                          f"tokens, Engine.generate ({args.label})", metric="output throughput", unit="tok/s",
                          ours=best, peers={}, floor=None, ms_per_step=batch / best * 1e3, texts_sha256=digest))
    if args.phases:
        from infercore.engine import detok, engine, runner, scheduler

        acc, cnt = collections.Counter(), collections.Counter()
        for cls, names in ((engine.Engine, ("_launch", "_process", "_append", "_output")),
                           (runner.ModelRunner, ("launch", "prepare", "host_inputs", "sample_tokens")),
                           (scheduler.Scheduler, ("schedule",)), (detok.IncrementalDetokenizer, ("step",))):
            for n in names:
                _wrap(acc, cnt, cls, n)
        try:
            from infercore.engine import graph_runner

            for n in ("launch", "can_run"):
                _wrap(acc, cnt, graph_runner.CUDAGraphRunner, n)
        except (ImportError, AttributeError):
            pass
        steps0 = len(prompts)
        t0 = time.perf_counter()
        eng.generate(prompts, sp)
        dt = time.perf_counter() - t0
        extra["phases"] = {"batch": steps0, "wall_s": dt,
                           "ms": {k: v * 1e3 for k, v in acc.most_common()}, "calls": dict(cnt)}
        for k, v in acc.most_common():
            print(f"  {k:40s} {v * 1e3:9.1f} ms {cnt[k]:8d} calls {v / cnt[k] * 1e6:9.2f} us/call", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    write_results(args.out, "probe_engine_host", name, cases, extra=extra)


if __name__ == "__main__":
    main()
