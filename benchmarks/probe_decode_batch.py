"""Where a large-batch decode step of the Llama-3.1-8B shape spends its time (H200 diagnostics).

Builds the bench_e2e Engine (random bf16 weights, CUDA graphs up to the batch), brings ``--batch``
requests of ``--prompt`` tokens past their prefill, decodes ``--warm`` steps, then times replays of
the batch's decode graph and lists its kernels (torch.profiler over graph replays). The floor is
the same as bench_e2e's: (weights except the embedding + KV bytes at the current context) / copy
bandwidth.

    python benchmarks/probe_decode_batch.py --out $OUT/probe_bs256.json          # H200, ~2 min
    INFERCORE_PDL=0 python benchmarks/probe_decode_batch.py --batch 1 --scheme fp8-wo --out $OUT/p.json

``--drop norm,rope,attn`` replaces those ops by no-ops (no kernel; wrong numbers, right shapes) to
bound what fusing them away could save: the step time without them is a floor for any fusion.

``--scheme`` quantizes the linears first (``quantize(model, scheme)``, lm_head kept in bf16 as the
schemes' default); ``INFERCORE_PDL=0`` gives kernel durations without the overlap of programmatic
dependent launch (with it, a kernel's time includes its wait for the previous one).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, write_results  # noqa: E402
from bench_decode_step import kernel_breakdown, replay_ms  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402

NOOPS = {
    "norm": {"rms_norm": lambda x, w, **kw: x, "fused_add_rms_norm": lambda x, r, w, **kw: (x, r)},
    "rope": {"rope_and_write_kv": lambda q, *a, **kw: q},
    "attn": {"paged_attention_decode": lambda q, *a, **kw: q},
}


def drop(spec: str) -> None:
    """Register no-op implementations (above every other priority) of the named op groups."""
    from infercore.devices import register

    for group in filter(None, spec.split(",")):
        if group not in NOOPS:
            raise SystemExit(f"--drop: unknown group {group!r}; expected a comma list of {', '.join(NOOPS)}")
        for op, fn in NOOPS[group].items():
            register(op, "noop", fn, priority=10**6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--warm", type=int, default=64, help="decode steps before the measurement")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--scheme", default=None, help="quantization scheme for the linears (lm_head stays bf16)")
    ap.add_argument("--drop", default="", help="comma list of norm, rope, attn: run as no-ops (diagnostic)")
    ap.add_argument("--attn-min-split", type=int, default=None,
                    help="decode attention: fewest keys per split-K chunk (triton_decode.TUNING min_split_tokens)")
    args = ap.parse_args()
    drop(args.drop)
    if args.attn_min_split is not None:
        if args.attn_min_split < 1:
            ap.error(f"--attn-min-split must be >= 1, got {args.attn_min_split}")
        from infercore.ops.attention import triton_decode

        triton_decode.TUNING["min_split_tokens"] = args.attn_min_split
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    torch.manual_seed(0)
    cfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
    model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device=torch.device("cuda"), init="normal")
    if args.scheme:
        from infercore.quant import quantize

        quantize(model, args.scheme, skip=("lm_head",))
    page, B = 16, args.batch
    max_len = args.prompt + args.warm + 64
    eng = Engine(model, num_pages=B * (-(-max_len // page)) + 64, page_size=page, max_num_seqs=B,
                 max_num_batched_tokens=16384, max_model_len=max_len, enable_prefix_caching=False,
                 cuda_graph_max_batch=B)
    gen = torch.Generator().manual_seed(1)
    sp = SamplingParams(temperature=0, max_tokens=args.warm + 32, ignore_eos=True)
    for _ in range(B):
        eng.add_request(torch.randint(0, 128000, (args.prompt,), generator=gen).tolist(), sp)
    reqs = list(eng.requests.values())
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    for _ in range(args.warm):
        eng.step()
    torch.cuda.synchronize()
    ctx = args.prompt + min(len(r.output_token_ids) for r in reqs)
    g = eng.graph_runner.graphs[B]
    ms = replay_ms(g)
    prof = kernel_breakdown(g, 5, args.top)
    mc = model.config
    # Quantized linears keep their codes and scales in buffers.
    tensors = [*model.parameters(), *(model.buffers() if args.scheme else ())]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    kv = B * ctx * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2
    floor_ms = (weights + kv) / bw * 1e3
    print(f"batch {B} ctx ~{ctx}: graph replay {ms:.3f} ms, floor {floor_ms:.3f} ms -> {floor_ms / ms:.3f}", flush=True)
    for r in prof["top"]:
        print(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:5.0f}  {r['kernel']}", flush=True)
    while eng.has_unfinished():
        eng.step()
    label = (f" {args.scheme}" if args.scheme else "") + (f" without {args.drop}" if args.drop else "")
    label += f" attn-min-split {args.attn_min_split}" if args.attn_min_split is not None else ""
    cases = [case(f"llama3.1-8b-shape{label} decode graph replay bs{B} ctx{ctx}", metric="decode step time", unit="ms",
                  ours=ms, peers={}, floor=floor_ms, weight_bytes=weights, kv_bytes=kv, copy_bw_TBps=bw / 1e12,
                  profile=prof)]
    cases[0]["wall_s"] = time.perf_counter() - t0
    write_results(args.out, "probe_decode_batch", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
