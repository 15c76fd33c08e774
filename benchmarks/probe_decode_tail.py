"""Decode attention at lengths that are not a multiple of the key tile (diagnostic).

A batch-256 decode step of the 8B shape reads every sequence's keys in 64-key tiles; past the last whole
tile the remainder (1-63 keys) is one masked tile. This probe asks what that tile costs and whether
narrower tail tiles (``triton_decode.TUNING["tail_n"]``) or narrower tiles overall recover it:

* ``--part kernel``: the kernel alone, batch 256, 32 q / 8 kv heads, d128, page 16, at each length of
  ``--lens`` (a 768-key block table; the floor counts the keys of each length), every variant beside
  SDPA on contiguous KV of that length;
* ``--part step``: graph replays of the whole decode step (the bench_e2e Engine, random bf16 weights)
  at the contexts of ``--step-ctx``, each variant's graph captured again, variants alternating over
  ``--rounds``, with the decode kernel's own time from the profiler.

    python benchmarks/probe_decode_tail.py --out $OUT/probe_decode_tail.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import bench_ms, case, copy_bandwidth, write_results  # noqa: E402

from infercore.ops.attention import triton_decode  # noqa: E402

# name -> TUNING overrides (block_n, num_warps, num_stages, tail_n)
VARIANTS = {
    "default": {},
    "tail16": {"tail_n": 16},
    "tail32": {"tail_n": 32},
    "bn32_s3": {"block_n": 32, "num_stages": 3},
    "bn32_s4": {"block_n": 32, "num_stages": 4},
}


def set_variant(name: str, base: dict) -> None:
    triton_decode.TUNING.clear()
    triton_decode.TUNING.update(base)
    triton_decode.TUNING.update(VARIANTS[name])


def kernel_part(args, bw: float, base: dict) -> list[dict]:
    B, Hq, Hk, D, page, alloc = 256, 32, 8, 128, 16, args.alloc
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
    n_pages = B * alloc // page
    kc = torch.randn(n_pages, page, Hk, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(n_pages, device=dev).view(B, alloc // page).to(torch.int32)
    scale = D**-0.5
    rows = []
    for L in args.lens:
        seq = torch.full((B,), L, device=dev, dtype=torch.int32)
        pages = table[:, : -(-L // page)].long()
        k = kc[pages].flatten(1, 2)[:, :L].permute(0, 2, 1, 3).contiguous()  # [B, Hk, L, D]
        v = vc[pages].flatten(1, 2)[:, :L].permute(0, 2, 1, 3).contiguous()
        sdpa = lambda k=k, v=v: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale,  # noqa: E731
                                                               enable_gqa=True)  # fmt: skip
        ref = sdpa().squeeze(2).float()
        t_sdpa = bench_ms(sdpa)
        nbytes = 2 * B * Hk * L * D * 2
        times = {}
        for name in VARIANTS:
            set_variant(name, base)
            call = lambda seq=seq: triton_decode.paged_attention_decode(  # noqa: E731
                q, kc, vc, seq_lens=seq, block_table=table, scale=scale, num_splits=1)
            err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
            times[name] = bench_ms(call) * 1e3
            rows.append({"L": L, "variant": name, "us": times[name], "rel_err": err,
                         "TBps": nbytes / (times[name] * 1e-6) / 1e12})
        set_variant("default", base)
        floor_us = nbytes / bw * 1e6
        best = min(times, key=times.get)
        line = " ".join(f"{n} {t:.1f}" for n, t in times.items())
        print(f"L {L}: {line} | sdpa {t_sdpa * 1e3:.1f} floor {floor_us:.1f} us", flush=True)
        rows.append({"L": L, "variant": "sdpa", "us": t_sdpa * 1e3, "floor_us": floor_us})
        del k, v
        yield case(f"paged decode attention b{B} ctx{L} 32/8 heads d128 page16 bf16 (768-key table)", metric="time",
                   unit="us", ours=times["default"], peers={"sdpa (contiguous KV)": t_sdpa * 1e3,
                                                           **{f"variant {n}": t for n, t in times.items()}},
                   floor=floor_us, best_variant=best, rows=[r for r in rows if r["L"] == L])  # fmt: skip


def step_part(args, bw: float, base: dict) -> list[dict]:
    from bench_decode_step import kernel_breakdown, replay_ms
    from bench_e2e import LLAMA_8B

    from infercore import Engine, SamplingParams
    from infercore.models import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(dict(LLAMA_8B)), dtype=torch.bfloat16, device=torch.device("cuda"),
                        init="normal")  # fmt: skip
    page, B, prompt = 16, 256, args.prompt
    max_len = max(args.step_ctx) + 64
    eng = Engine(model, num_pages=B * (-(-max_len // page)) + 64, page_size=page, max_num_seqs=B,
                 max_num_batched_tokens=16384, max_model_len=max_len, enable_prefix_caching=False,
                 cuda_graph_max_batch=B)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    sp = SamplingParams(temperature=0, max_tokens=max_len - prompt - 8, ignore_eos=True)
    for _ in range(B):
        eng.add_request(torch.randint(0, 128000, (prompt,), generator=gen).tolist(), sp)
    reqs = list(eng.requests.values())
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    gr = eng.graph_runner
    mc = model.config
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    out = []
    for target in sorted(args.step_ctx):
        while prompt + min(len(r.output_token_ids) for r in reqs) < target:
            eng.step()
        torch.cuda.synchronize()
        ctx = prompt + min(len(r.output_token_ids) for r in reqs)
        # the graph's inputs hold the last step's metadata: sequences of ctx - 1 keys plus the new one
        kv = B * ctx * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2
        floor_ms = (weights + kv) / bw * 1e3
        res: dict[str, list[float]] = {}
        attn: dict[str, list[float]] = {}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name in VARIANTS:
                    set_variant(name, base)
                    for _ in range(2):
                        gr._forward(B)
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        gr._forward(B)
                    res.setdefault(name, []).append(replay_ms(g))
                    prof = kernel_breakdown(g, 3, 40)
                    attn.setdefault(name, []).append(sum(r["us_per_step"] for r in prof["top"]
                                                         if "_decode_kernel" in r["kernel"]))  # fmt: skip
                    del g
            set_variant("default", base)
        line = " ".join(f"{n} {min(v):.3f} ms (attn {min(attn[n]):.0f} us)" for n, v in res.items())
        print(f"step ctx {ctx}: {line} | floor {floor_ms:.3f}", flush=True)
        best = {n: min(v) for n, v in res.items()}
        out.append(case(f"llama3.1-8b-shape decode graph replay bs{B} ctx{ctx}", metric="decode step time", unit="ms",
                        ours=best["default"], peers={f"variant {n}": t for n, t in best.items()}, floor=floor_ms,
                        rounds=res, attention_us=attn, weight_bytes=weights, kv_bytes=kv, copy_bw_TBps=bw / 1e12))
    del eng, gr, model
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", default="kernel,step")
    ap.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[513, 529, 545, 561, 576, 577, 593, 609, 625, 640, 704, 768])
    ap.add_argument("--alloc", type=int, default=768, help="keys per sequence in the block table (a page multiple)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--step-ctx", type=lambda s: [int(x) for x in s.split(",")], default=[529, 577, 608])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if max(args.lens) > args.alloc or args.alloc % 16:
        ap.error("--alloc must be a multiple of 16 holding every length")
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    base = dict(triton_decode.TUNING)
    cases = []
    if "kernel" in args.part:
        cases += list(kernel_part(args, bw, base))
    if "step" in args.part:
        cases += step_part(args, bw, base)
    write_results(args.out, "probe_decode_tail", torch.cuda.get_device_name(), cases,
                  extra={"wall_s": time.perf_counter() - t0, "variants": VARIANTS})  # fmt: skip


if __name__ == "__main__":
    main()
