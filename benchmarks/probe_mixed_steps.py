"""Step-by-step timeline of bench_e2e's batch run, prefill included (H200 diagnostics).

bench_e2e's "decode throughput" is ``B (N - 1) / (t(N tokens) - t(1 token))``: the prefill is in both
runs and cancels, so the difference should be ~N decode steps. This probe runs the same two calls
on the same Engine and records every ``Engine.step``: the batch (requests, tokens, decode rows),
whether the CUDA graph ran it, and its wall time, so the difference can be attributed to step kinds.

    python benchmarks/probe_mixed_steps.py --batch 256 --out $OUT/probe_mixed_bs256.json   # ~2 min
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, write_results  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402

COMPILED: list[dict] = []


def log_compiles() -> None:
    """Record every Triton JIT compile (kernel and specialization) with the step it happened in."""
    import triton

    def hook(*, repr, **kw):
        COMPILED.append({"at": time.perf_counter(), "kernel": repr[:400]})
        return False

    triton.knobs.runtime.jit_cache_hook = hook


def sync_dev() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def traced_run(eng: Engine, prompts: list[list[int]], new: int, sync: bool) -> dict:
    """``eng.generate(prompts, max_tokens=new)`` by hand, one record per step. ``sync``: wait for the
    device after every step (per-step device time; async scheduling then overlaps nothing)."""
    kinds: list[dict] = []
    launch = eng._launch

    def spy(batch, prev):
        dec = sum(
            1
            for r, n in zip(batch.requests, batch.num_new_tokens)
            if n == 1 and r.num_computed_tokens >= len(r.prompt_token_ids)
        )
        graph = eng.graph_runner is not None and eng.graph_runner.can_run(batch)
        kinds.append({"reqs": len(batch), "tokens": batch.num_tokens, "decode_rows": dec, "graph": graph})
        return launch(batch, prev)

    eng._launch = spy
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    steps = []
    first = len(COMPILED)
    sync_dev()
    t0 = time.perf_counter()
    done = 0
    while done < len(ids) and eng.has_unfinished():
        n = len(kinds)
        a = time.perf_counter()
        outs = eng.step()
        if sync:
            sync_dev()
        b = time.perf_counter()
        done += sum(1 for o in outs if o.finished)
        rec = dict(kinds[n]) if len(kinds) > n else {"reqs": 0, "tokens": 0, "decode_rows": 0, "graph": False}
        rec["ms"] = 1e3 * (b - a)
        rec["compiled"] = [c["kernel"] for c in COMPILED[first:] if a <= c["at"] <= b]
        steps.append(rec)
    sync_dev()
    total = time.perf_counter() - t0
    eng._launch = launch
    while eng.has_unfinished():
        eng.step()
    return {"total_s": total, "steps": steps, "compiles": len(COMPILED) - first}


def summarize(run: dict) -> dict:
    groups: dict[str, list[float]] = {}
    for s in run["steps"]:
        if s["tokens"] == 0:
            key = "no launch"
        elif s["graph"]:
            key = f"graph decode {'256' if s['reqs'] == 256 else '<256'}"
        elif s["decode_rows"] == s["reqs"]:
            key = "eager decode"
        elif s["decode_rows"]:
            key = "mixed"
        else:
            key = "prefill only"
        groups.setdefault(key, []).append(s["ms"])
    return {
        k: {"steps": len(v), "sum_ms": sum(v), "median_ms": sorted(v)[len(v) // 2], "max_ms": max(v)}
        for k, v in groups.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script itself")
    args = ap.parse_args()
    log_compiles()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(
        ModelConfig.from_hf(dict(LLAMA_8B, num_hidden_layers=args.layers)),
        dtype=torch.bfloat16,
        device=dev,
        init="normal",
    )
    B, page = args.batch, 16
    pages = B * -(-(args.prompt + args.new + page) // page) + 64
    eng = Engine(
        model,
        num_pages=pages,
        page_size=page,
        max_num_seqs=B,
        max_num_batched_tokens=16384,
        max_model_len=args.prompt + args.new + page,
        enable_prefix_caching=False,
        cuda_graph_max_batch=B if dev.type == "cuda" else 0,
    )
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 128000, (B, args.prompt), generator=gen).tolist()
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    out = {"runs": {}}
    for name, new, sync in (
        ("t1", 1, False),
        ("t1_again", 1, False),
        ("tN", args.new, False),
        ("tN_again", args.new, False),
        ("tN_sync", args.new, True),
    ):
        run = traced_run(eng, prompts, new, sync)
        run["summary"] = summarize(run)
        out["runs"][name] = run
        print(f"{name}: {run['total_s']:.3f} s, {len(run['steps'])} steps, {run['compiles']} JIT compiles", flush=True)
        for i, st in enumerate(run["steps"]):
            for k in st["compiled"]:
                print(f"   step {i} ({st['reqs']} reqs, {st['tokens']} tokens, {st['decode_rows']} decode): {k}")
        for k, v in run["summary"].items():
            print(
                f"   {k:22s} {v['steps']:4d} steps  sum {v['sum_ms']:9.1f} ms  median {v['median_ms']:8.2f}  "
                f"max {v['max_ms']:8.2f}",
                flush=True,
            )
    r = out["runs"]
    t1 = min(r["t1"]["total_s"], r["t1_again"]["total_s"])
    cases = []
    for name, run in r.items():
        extra = {}
        if name.startswith("tN"):
            extra["bench_e2e_style_decode_tok_s"] = B * (args.new - 1) / (run["total_s"] - t1)
            print(f"{name}: bench_e2e-style decode rate {extra['bench_e2e_style_decode_tok_s']:.0f} tok/s", flush=True)
        cases.append(
            case(
                f"llama3.1-8b-shape bs{B} prompt{args.prompt} run {name} (max_tokens "
                f"{1 if name.startswith('t1') else args.new})",
                metric="wall time of the run",
                unit="s",
                ours=run["total_s"],
                peers={},
                floor=None,
                jit_compiles=run["compiles"],
                summary=run["summary"],
                steps=run["steps"],
                **extra,
            )
        )
    write_results(args.out, "probe_mixed_steps", torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", cases)


if __name__ == "__main__":
    main()
