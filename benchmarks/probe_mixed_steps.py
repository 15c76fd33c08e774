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

from _common import case, log_triton_compiles, write_results  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402

COMPILED: list[dict] = []
GC: list[dict] = []


def log_gc() -> None:
    """Record every collection of the cyclic GC (generation, duration) with the step it happened in."""
    import gc

    start = {}

    def cb(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            t = time.perf_counter()
            GC.append({"at": t, "gen": info["generation"], "ms": 1e3 * (t - start.get("t", t))})

    gc.callbacks.append(cb)


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
    first, first_gc = len(COMPILED), len(GC)
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
        rec["compiled"] = [c["repr"][:400] for c in COMPILED[first:] if a <= c["at"] <= b]
        rec["gc_ms"] = [round(g["ms"], 2) for g in GC[first_gc:] if a <= g["at"] <= b and g["gen"] == 2]
        steps.append(rec)
    sync_dev()
    total = time.perf_counter() - t0
    eng._launch = launch
    while eng.has_unfinished():
        eng.step()
    gcs = GC[first_gc:]
    return {
        "total_s": total,
        "steps": steps,
        "compiles": len(COMPILED) - first,
        "gc_full": sum(1 for g in gcs if g["gen"] == 2),
        "gc_full_ms": sum(g["ms"] for g in gcs if g["gen"] == 2),
        "gc_all_ms": sum(g["ms"] for g in gcs),
    }


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
    ap.add_argument("--gc-freeze", type=int, choices=(0, 1), default=None, help="EngineConfig.gc_freeze")
    ap.add_argument("--hf", action="store_true", help="also load the transformers model, as bench_e2e does")
    args = ap.parse_args()
    log_triton_compiles(COMPILED)
    log_gc()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(
        ModelConfig.from_hf(dict(LLAMA_8B, num_hidden_layers=args.layers)),
        dtype=torch.bfloat16,
        device=dev,
        init="normal",
    )
    hf = None
    if args.hf:  # bench_e2e's process also holds the transformers model: a larger heap for the GC to walk
        import transformers

        hcfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
        hcfg = transformers.LlamaConfig(**{k: v for k, v in hcfg.items() if k != "model_type"})
        with torch.device(dev):
            hf = transformers.LlamaForCausalLM(hcfg).to(torch.bfloat16).eval()
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
        gc_freeze=None if args.gc_freeze is None else bool(args.gc_freeze),
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
        print(
            f"{name}: {run['total_s']:.3f} s, {len(run['steps'])} steps, {run['compiles']} JIT compiles, "
            f"{run['gc_full']} full GC passes ({run['gc_full_ms']:.1f} ms; all passes {run['gc_all_ms']:.1f} ms)",
            flush=True,
        )
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
                gc_full_passes=run["gc_full"],
                gc_full_ms=run["gc_full_ms"],
                gc_all_ms=run["gc_all_ms"],
                summary=run["summary"],
                steps=run["steps"],
                **extra,
            )
        )
    del hf
    write_results(args.out, "probe_mixed_steps", torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", cases)


if __name__ == "__main__":
    main()
