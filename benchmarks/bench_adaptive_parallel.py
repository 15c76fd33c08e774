"""Adaptive parallelism: one group of ranks serving a tidal load as tensor-parallel only, data-parallel only, and
switching between the two with the load (:class:`infercore.parallel.AdaptiveEngine`).

Two measurements, every layout on the same ranks and engines (``build_adaptive``: each rank holds the whole model
for DP and its TP shard):

0. (CPU) TP batch-1 decode tokens/s with the collectives through gloo and through shared memory
   (``parallel.shm``).
1. step rate against batch: ``B`` greedy requests of ``--prompt`` tokens decoding ``--new`` tokens at once, in TP
   and in DP; output tokens/s of the whole ``generate`` (prefill included), best of ``--rounds``. Where DP passes
   TP is where a load policy should switch.
2. a tidal trace: a burst of ``--burst`` requests submitted together, then ``--trickle`` requests one after the
   other (each submitted when the previous one finished). Seconds of each phase for TP only, DP only and the
   adaptive engine, alternating over ``--rounds`` rounds, best kept; and whether the three gave the same tokens.
   The adaptive engine's policy is ``LoadPolicy.from_rates`` of measurement 1 (``--high-at N``: TP below N
   unfinished requests, DP from N).

Default: random fp32 weights of SmolLM2-135M's widths with 8 query / 4 KV heads (SmolLM2's own 9 / 3 do not split
over two ranks; ``--model`` takes a checkpoint) on ``--world`` CPU processes over gloo, one thread each.
``--device cuda``: one GPU a rank over NCCL (``--shape llama8b --dtype bfloat16``: the 8B shape).

    python benchmarks/bench_adaptive_parallel.py --out benchmarks/results/cpu/adaptive_parallel.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from _common import case, write_results  # noqa: E402

from infercore import SamplingParams  # noqa: E402
from infercore.parallel import LoadPolicy, build_adaptive  # noqa: E402

# SmolLM2-135M's widths with 8 query / 4 KV heads of 64 (its own 9 / 3 heads do not split over two ranks)
SMALL = dict(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192, rope_scaling=None,
             rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def _fixed(layout: str) -> LoadPolicy:
    return LoadPolicy(low=layout, high=layout)


def _timed_generate(eng, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    return time.perf_counter() - t, [o.token_ids for o in outs]


def _trace(eng, burst, trickle, params) -> tuple[float, float, list, int]:
    """Seconds of the burst and of the trickle, every request's tokens, and the layout switches made."""
    before = len(eng.switches)
    t_burst, toks = _timed_generate(eng, burst, params)
    t = time.perf_counter()
    for p in trickle:
        toks += [o.token_ids for o in eng.generate([p], params)]
    return t_burst, time.perf_counter() - t, toks, len(eng.switches) - before


def _collectives(model, kw, args) -> dict[str, float]:
    """TP batch-1 decode tokens/s with the collectives through gloo and through shared memory (every rank runs
    the same calls), best of ``args.rounds`` alternating rounds."""
    import copy

    from _common import engine_decode_rate

    from infercore import Engine
    from infercore.parallel import tensor_parallel_

    engines = {}
    for name, flag in (("gloo", "0"), ("shm", "1")):
        os.environ["INFERCORE_SHM_COLLECTIVES"] = flag
        engines[name] = Engine(tensor_parallel_(copy.deepcopy(model)), None, **kw)
    os.environ.pop("INFERCORE_SHM_COLLECTIVES")
    assert engines["gloo"].model.tp_shm is None and engines["shm"].model.tp_shm is not None
    prompt = list(range(10, 10 + args.prompt))
    best = dict.fromkeys(engines, 0.0)
    for _ in range(args.rounds):
        for name, e in engines.items():
            best[name] = max(best[name], engine_decode_rate(e, prompt, args.new)[0])
    return best


def _worker(rank: int, init: str, args) -> None:
    from infercore.models import load_model

    torch.set_num_threads(args.threads)
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=args.world)
    dtype = getattr(torch, args.dtype)
    if args.model:
        model, tok, _ = load_model(args.model, dtype=dtype, device=device)
    else:  # the same random weights on every rank
        from bench_e2e import LLAMA_8B

        from infercore.models import ModelConfig, build_model

        torch.manual_seed(0)
        cfg = dict(LLAMA_8B, **(SMALL if args.shape == "small" else {}))
        model = build_model(ModelConfig.from_hf(cfg), dtype=dtype, device=device, init="normal")
        tok = None
    kw = dict(page_size=16, max_num_batched_tokens=args.budget, kv_cache_bytes=args.kv_mb << 20)
    comm = _collectives(model, kw, args) if args.device == "cpu" else None
    eng = build_adaptive(model, tok, tp_engine_kwargs=kw, dp_engine_kwargs=kw)
    if rank != 0:
        eng.follow()
        dist.barrier()
        dist.destroy_process_group()
        return
    if tok is not None:
        from pydoc_data.topics import topics

        ids = tok.encode(" ".join(topics.values()), add_special_tokens=False)
    else:
        ids = torch.randint(0, model.config.vocab_size, (1 << 16,), generator=torch.Generator().manual_seed(0)).tolist()
    P = args.prompt
    prompt = [ids[i * P : (i + 1) * P] for i in range(max(args.batches + [args.burst + args.trickle]))]
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    cases, raw = [], {"rate": {}, "trace": {}}
    if comm is not None:
        print(f"TP batch-1 decode: {comm['gloo']:.1f} tok/s through gloo, {comm['shm']:.1f} through shared memory",
              flush=True)
        cases.append(case("TP batch-1 decode, collectives through shared memory vs gloo", metric="tokens/s",
                          unit="tok/s", ours=comm["shm"], peers={"gloo": comm["gloo"]}, floor=None))
    for B in args.batches:
        best = {"tp": float("inf"), "dp": float("inf")}
        for _ in range(args.rounds):  # alternating: a drift of the machine hits both alike
            for layout in best:
                eng.policy = _fixed(layout)
                best[layout] = min(best[layout], _timed_generate(eng, prompt[:B], params)[0])
        rates = {layout: B * args.new / t for layout, t in best.items()}
        raw["rate"][B] = rates
        print(f"batch {B}: TP {rates['tp']:.1f} tok/s, DP {rates['dp']:.1f} tok/s", flush=True)
        cases.append(case(f"{B} requests at once ({P}-token prompts, {args.new} new tokens)",
                          metric="output tokens/s of generate(), DP over TP", unit="x",
                          ours=rates["dp"] / rates["tp"], peers={}, floor=None,
                          tokens_per_s={"tp": rates["tp"], "dp": rates["dp"]}))
    # the adaptive engine's policy, from the rates just measured (or --high-at: TP low, DP high)
    policy = (LoadPolicy(high_at=args.high_at, low_at=1, min_steps=8) if args.high_at
              else LoadPolicy.from_rates(raw["rate"], min_steps=8))
    print(f"adaptive policy: {policy}", flush=True)
    burst = prompt[: args.burst]
    trickle = prompt[args.burst : args.burst + args.trickle]
    best = {lay: [float("inf"), float("inf")] for lay in ("tp", "dp", "adaptive")}
    tokens, switches = {}, {}
    for _ in range(args.rounds):
        for layout in best:
            eng.policy = policy if layout == "adaptive" else _fixed(layout)
            tb, tt, tokens[layout], switches[layout] = _trace(eng, burst, trickle, params)
            best[layout] = [min(best[layout][0], tb), min(best[layout][1], tt)]
    eng.close()
    same = tokens["tp"] == tokens["dp"] == tokens["adaptive"]
    raw["trace"] = {lay: {"burst_s": b, "trickle_s": t, "switches": switches[lay]} for lay, (b, t) in best.items()}
    for lay, (b, t) in best.items():
        print(f"trace {lay}: burst {b:.2f} s, trickle {t:.2f} s, total {b + t:.2f} s, switches {switches[lay]}",
              flush=True)
    print(f"same tokens in all three: {same}", flush=True)
    total = {lay: b + t for lay, (b, t) in best.items()}
    cases.append(case(
        f"tidal trace: {args.burst} requests at once, then {args.trickle} one after another",
        metric="time-based speedup of the adaptive engine over the better fixed layout", unit="x",
        ours=min(total["tp"], total["dp"]) / total["adaptive"],
        peers={"tp only": min(total["tp"], total["dp"]) / total["tp"],
               "dp only": min(total["tp"], total["dp"]) / total["dp"]},
        floor=None, seconds={lay: {"burst": b, "trickle": t} for lay, (b, t) in best.items()},
        switches_per_trace=switches, same_tokens=same, policy=vars(policy)))
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    write_results(args.out, "adaptive_parallel", dev, cases,
                  extra={"note": args.note, "model": args.model or f"random, {args.shape} shape", "dtype": args.dtype,
                         "world": args.world,
                         "threads_per_rank": args.threads, "prompt_tokens": P, "new_tokens": args.new,
                         "raw": raw})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="", help="HF directory or GGUF file (default: random weights of --shape)")
    ap.add_argument("--shape", default="small", choices=["small", "llama8b"],
                    help="random model: SmolLM2-135M's widths with 8 / 4 heads (small), or the Llama-3.1-8B shape")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--trickle", type=int, default=6)
    ap.add_argument("--high-at", type=int, default=0,
                    help="the adaptive policy: TP below this many requests, DP from it (0: from the measured rates)")
    ap.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens of each engine")
    ap.add_argument("--kv-mb", type=int, default=256, help="KV memory of each engine, MiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--note", default="", help="a remark stored with the results (shown in docs/benchmarks.md)")
    ap.add_argument("--out", default="benchmarks/results/cpu/adaptive_parallel.json")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    init = f"file:///tmp/adaptive_rdzv_{os.getpid()}"
    mp.spawn(_worker, args=(init, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
