"""One continuous-batching step that mixes a prefill chunk with running decodes, Llama-3.1-8B shape.

B requests are decoding at about ``--ctx`` tokens of context when a request with a ``--prefill``-token
prompt arrives; the next step carries both (B decode rows + the prompt). Measured through the Engine
(synchronous scheduling, so each step is timed alone), alternating:

* ours: the decodes' attention through the decode kernel, the prefill kernel's grid over the other
  sequences only (``AttentionMetadata.num_split_decodes``, ``prefill_seqs``; the engine does this from
  ``SPLIT_DECODES_MIN`` decodes on, here forced below that too: ``engine_default_splits`` says which rows);
* peer "decodes in the prefill kernel": the same step with the split off (every sequence through the
  prefill kernel, each decode row a whole query tile per query head);
* peer "separate steps": the prompt alone plus a decode-only step of the B requests, i.e. what running
  the two kinds of work in different steps would cost.

Floor: (B + P) tokens over max(linear + attention FLOPs / measured matmul rate, weight + KV bytes /
measured copy bandwidth).

    python benchmarks/bench_mixed_step.py --out benchmarks/results/h200/mixed_step.json   # H200, ~2 min
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, matmul_flops, write_results  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.engine import runner  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402


def timed_step(eng: Engine) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="4,16,64,256")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw, flops = copy_bandwidth(), matmul_flops()
    cfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device=dev, init="normal")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - 128256 * 4096 * 2
    linear_params = weight_bytes // 2
    kv_per_token = args.layers * 2 * 8 * 128 * 2
    batches = [int(b) for b in args.batches.split(",")]
    bmax, page, P, C = max(batches), 16, args.prefill, args.ctx
    # long enough that the first requests, decoding while the others still prefill, are still running
    new = bmax * C // (bmax + P) + 8 * args.reps + 32
    pages = bmax * -(-(C + new + page) // page) + (args.reps + 2) * -(-P // page) + 64
    eng = Engine(model, num_pages=pages, page_size=page, max_num_seqs=bmax + 1, max_num_batched_tokens=bmax + P,
                 max_model_len=max(C + new, P) + page, enable_prefix_caching=False, cuda_graph_max_batch=bmax,
                 async_scheduling=False)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    default_min = runner.SPLIT_DECODES_MIN
    long_sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    one_sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 128000, (n,), generator=gen).tolist()

    # the prompt alone (no decodes running)
    eng.generate([prompt(P)], one_sp)
    alone = []
    for _ in range(args.reps):
        eng.add_request(prompt(P), one_sp)
        alone.append(timed_step(eng))
    t_prefill = median(alone)
    cases = []
    for B in batches:
        ids = [eng.add_request(prompt(C), long_sp) for _ in range(B)]
        while any(not eng.requests[i].output_token_ids for i in ids):
            eng.step()
        t_decode = median([timed_step(eng) for _ in range(args.reps)])
        ctx = sum(eng.requests[i].num_tokens for i in ids) / B + args.reps  # mean context at the mixed steps
        split, whole = [], []
        for _ in range(args.reps):
            for mode, out in ((min(default_min, B), split), (10**9, whole)):
                runner.SPLIT_DECODES_MIN = mode
                eng.add_request(prompt(P), one_sp)
                out.append(timed_step(eng))
        runner.SPLIT_DECODES_MIN = default_min
        for i in ids:
            eng.abort(i)
        while eng.has_unfinished():
            eng.step()
        fl = 2 * (B + P) * linear_params + args.layers * 4 * 32 * 128 * (B * ctx + P * P / 2)
        by = weight_bytes + (B * ctx + P) * kv_per_token
        floor_s = max(fl / flops, by / bw)
        ours = (B + P) / median(split)
        peers = {"decodes in the prefill kernel": (B + P) / median(whole),
                 "separate steps (prompt alone + decode-only step)": (B + P) / (t_prefill + t_decode)}  # fmt: skip
        print(f"B={B} ctx~{ctx:.0f} + prompt {P}: split {1e3 * median(split):.2f} ms, "
              f"whole {1e3 * median(whole):.2f} ms, prompt alone {1e3 * t_prefill:.2f} ms, "
              f"decode-only step {1e3 * t_decode:.2f} ms, floor {1e3 * floor_s:.2f} ms", flush=True)  # fmt: skip
        cases.append(case(f"llama3.1-8b-shape mixed step: {B} decodes at ctx ~{ctx:.0f} + a {P}-token prompt, bf16",
                          metric="tokens per second of the step", unit="tok/s", ours=ours, peers=peers,
                          floor=(B + P) / floor_s, step_ms_split=[1e3 * t for t in split],
                          step_ms_whole=[1e3 * t for t in whole], prompt_alone_ms=1e3 * t_prefill,
                          decode_only_step_ms=1e3 * t_decode, copy_bw_TBps=bw / 1e12,
                          engine_default_splits=B >= default_min,
                          matmul_TFLOPs=flops / 1e12))  # fmt: skip
    write_results(args.out, "mixed_step", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
