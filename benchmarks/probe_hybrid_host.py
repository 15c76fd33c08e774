"""Where a hybrid model's eager decode step spends its host time (diagnostic).

Builds the bench_hybrid_e2e shapes, runs a short workload through the Engine and profiles the
decode-only launches with cProfile (host Python) while timing each launch synchronized; prints the
top functions by own time and writes the step times and the top rows as JSON.

    python benchmarks/probe_hybrid_host.py --out /tmp/probe_hybrid_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from bench_hybrid_e2e import gemma3_27b, qwen3_next_80b, sync, tiny_gemma3, tiny_qwen3_next  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import build_model  # noqa: E402


def probe(model, layout: str, prompt: int, new: int, requests: int, gib: float, device) -> dict:
    eng = Engine(model, page_size=16, kv_cache_bytes=int(gib * (1 << 30)), kv_layout=layout, max_num_seqs=512,
                 max_num_batched_tokens=2048, enable_prefix_caching=False)  # fmt: skip
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    eng.generate([torch.randint(0, vocab, (32 + i,), generator=gen).tolist() for i in range(17)],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # fmt: skip
    prof = cProfile.Profile()
    steps = []
    orig = eng.runner.launch

    def launch(batch, gather=None):
        decode = max(batch.num_new_tokens) == 1
        sync(device)
        t = time.perf_counter()
        if decode:
            prof.enable()
        out = orig(batch, gather)
        t_host = time.perf_counter() - t
        sync(device)
        if decode:
            prof.disable()
            steps.append((len(batch), t_host, time.perf_counter() - t))
        return out

    eng.runner.launch = launch
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen).tolist() for _ in range(requests)]
    eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    text = s.getvalue()
    s2 = io.StringIO()
    pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(35)
    n = len(steps)
    return {"layout": layout, "decode_steps": n, "mean_batch": sum(b for b, _, _ in steps) / n,
            "host_ms_per_step": 1e3 * sum(h for _, h, _ in steps) / n,
            "wall_ms_per_step": 1e3 * sum(w for _, _, w in steps) / n,
            "tottime": text, "cumulative": s2.getvalue()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/probe_hybrid_host.json")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--models", default="gemma3_27b,qwen3_next_80b")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.tiny:
        work = {"gemma3_27b": (tiny_gemma3(), 96, 16, 8, 1 / 1024),
                "qwen3_next_80b": (tiny_qwen3_next(), 24, 16, 8, 1 / 1024)}  # fmt: skip
    else:
        work = {"gemma3_27b": (gemma3_27b(12), 4096, 32, 40, 6.0),
                "qwen3_next_80b": (qwen3_next_80b(8), 512, 32, 64, 1.0)}  # fmt: skip
    res = []
    for name in args.models.split(","):
        cfg, prompt, new, requests, gib = work[name]
        torch.manual_seed(0)
        model = build_model(cfg, dtype=dtype, device=device)
        for layout in ("multi", "uniform"):
            r = probe(model, layout, prompt, new, requests, gib, device)
            r["model"] = name
            print(f"== {name} {layout}: batch {r['mean_batch']:.1f} host {r['host_ms_per_step']:.1f} ms "
                  f"wall {r['wall_ms_per_step']:.1f} ms per decode step")
            print(r["tottime"])
            print(r["cumulative"])
            res.append(r)
        del model
        torch.cuda.empty_cache() if device.type == "cuda" else None
    with open(args.out, "w") as f:
        json.dump({"name": "probe_hybrid_host", "device": str(device), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
