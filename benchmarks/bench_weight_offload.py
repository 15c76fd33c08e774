"""Weight streaming under a GPU memory budget: decode of the Llama-3.1-8B shape (random bf16 weights) when only a
fraction of the weights may live on the GPU.

For each budget (a fraction of the weight bytes) and batch: infercore's Engine on a model offloaded with
``infercore.offload.offload_weights_`` (the model is loaded on the CPU; its resident part goes to the GPU, the
streamed layers to page-locked host memory; CUDA-graph decode) against transformers with accelerate's offload at
the same budget (``infer_auto_device_map(max_memory={0: budget, "cpu": ...})`` + ``dispatch_model``, what
``from_pretrained(device_map="auto", max_memory=...)`` does) on the same weights, in the same process.

Floor: max(streamed bytes per step / measured pinned host-to-device bandwidth, weight bytes read per step / measured
device copy bandwidth). Also reported: the cost model's estimate (``plan_offload`` given the measured all-resident
step time) next to the measured rate, and whether the greedy tokens equal the all-resident run's.

    python benchmarks/bench_weight_offload.py --out benchmarks/results/h200/weight_offload.json
    python benchmarks/bench_weight_offload.py --device cpu --tiny --out /tmp/wo.json   # a smoke run of the script
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402
from infercore.offload import offload_weights_, plan_offload  # noqa: E402

LLAMA_8B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
)
TINY = dict(LLAMA_8B, vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_scaling=None)
PEER = "transformers + accelerate offload (device_map auto)"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def h2d_bandwidth(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """Pinned host -> device copy bandwidth (bytes/s, median of 7), the streaming ceiling."""
    if dev.type != "cuda":
        src, dst = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        t = time.perf_counter()
        dst.copy_(src)
        return nbytes / (time.perf_counter() - t)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    times = sorted(times[1:])
    return nbytes / times[len(times) // 2]


def device_bandwidth(dev: torch.device) -> float:
    if dev.type != "cuda":
        return 50e9
    from _common import copy_bandwidth

    return copy_bandwidth()


def random_hf_weights(cfg: dict, dev: torch.device) -> dict[str, torch.Tensor]:
    """HF-named random bf16 weights (N(0, 0.02); norms 1) on the CPU, made on ``dev`` (fast) then copied over."""
    import transformers

    hcfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in transformers.LlamaForCausalLM(hcfg).named_parameters()}
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        out[name] = t
    return out


def ours_on_cpu(cfg: dict, weights: dict[str, torch.Tensor]):
    model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device=torch.device("cpu"), init="empty")
    model.load_weights(weights.items())
    return model


def steady_decode(eng: Engine, prompts: list[list[int]], new: int, dev: torch.device) -> tuple[float, list]:
    """Decode tokens/s once every request is past its prefill, and each request's greedy tokens."""
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    reqs = list(eng.requests.values())
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    steps = max(1, min(new - 1 - len(r.output_token_ids) for r in reqs) - 1)
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(dev)
    rate = len(reqs) * steps / (time.perf_counter() - t)
    while eng.has_unfinished():
        eng.step()
    return rate, [list(r.output_token_ids) for r in reqs]


@torch.inference_mode()
def hf_decode_rate(hf, batch: list[list[int]], steps: int, dev: torch.device) -> float:
    """A transformers model's greedy decode tokens/s over ``steps`` steps after the prefill of ``batch`` (equal-length
    prompts) and one untimed step, its KV cache grown in place."""
    x = torch.tensor(batch, device=dev)
    out = hf(input_ids=x, use_cache=True, logits_to_keep=1)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    out = hf(input_ids=nxt, past_key_values=past, use_cache=True)  # one untimed decode step
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        out = hf(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(dev)
    return len(batch) * steps / (time.perf_counter() - t)


def hf_peer(cfg: dict, weights: dict, budget: int, dev: torch.device, prompts: list[list[int]], steps: int):
    """transformers + accelerate at ``budget`` GPU bytes: decode tokens/s per batch of ``prompts`` (a list of
    prompt lists), and how many modules accelerate left on the CPU."""
    import transformers
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.hooks import remove_hook_from_submodules
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hcfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    hcfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hcfg)
    missing, unexpected = hf.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"HF weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf.model.rotary_emb = LlamaRotaryEmbedding(hcfg)  # its non-persistent buffer stayed on meta
    hf.eval()
    gpu = 0 if dev.type == "cuda" else "cpu"
    max_memory = {gpu: budget, "cpu": 1 << 40} if dev.type == "cuda" else {"cpu": 1 << 40}
    dm = infer_auto_device_map(hf, max_memory=max_memory, no_split_module_classes=["LlamaDecoderLayer"],
                               dtype=torch.bfloat16)
    on_cpu = sum(1 for v in dm.values() if v == "cpu") if dev.type == "cuda" else 0
    if dev.type == "cuda":
        hf = dispatch_model(hf, device_map=dm)
    rates = [hf_decode_rate(hf, batch, steps, dev) for batch in prompts]
    remove_hook_from_submodules(hf)
    del hf
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rates, on_cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/weight_offload.json")
    ap.add_argument("--budgets", default="1.0,0.5,0.25", help="GPU budgets as fractions of the weight bytes")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per case with streaming")
    ap.add_argument("--resident-steps", type=int, default=48, help="timed decode steps when nothing streams")
    ap.add_argument("--hf-steps", type=int, default=3, help="timed decode steps of the (slow) transformers peer")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=230, help="skip the peer once this much time has passed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (smoke run of the script)")
    args = ap.parse_args()
    start = time.perf_counter()
    dev = torch.device(args.device)
    cfg = TINY if args.tiny else LLAMA_8B
    shape = "tiny-llama" if args.tiny else "llama3.1-8b-shape"
    h2d, hbm = h2d_bandwidth(dev), device_bandwidth(dev)
    print(f"pinned host->device {h2d / 1e9:.1f} GB/s, device copy {hbm / 1e12:.2f} TB/s", flush=True)
    weights = random_hf_weights(cfg, dev)
    batches = [int(b) for b in args.batches.split(",")]
    max_b = max(batches)
    gen = torch.Generator().manual_seed(1)
    vocab = cfg["vocab_size"] - 256
    prompts = {B: torch.randint(0, vocab, (B, args.prompt), generator=gen).tolist() for B in batches}
    page = 16
    cases, resident_step, resident_tokens = [], {}, {}
    for frac in sorted((float(f) for f in args.budgets.split(",")), reverse=True):
        model = ours_on_cpu(cfg, weights)
        total = plan_offload(model, 1 << 60, h2d_bytes_per_s=h2d, hbm_bytes_per_s=hbm).plan.all_resident_bytes
        budget = int(frac * total)
        read = total - model.model.embed_tokens.weight.numel() * 2  # a step reads B rows of the embedding
        est = {}  # the cost model's estimate, from the all-resident step time measured at this batch
        for B, step_s in resident_step.items():
            try:
                est[B] = plan_offload(model, budget, h2d_bytes_per_s=h2d, prefetch=args.prefetch, tokens_per_step=B,
                                      step_s=step_s).tokens_per_s
            except ValueError:
                pass
        try:
            plan = offload_weights_(model, gpu_budget_bytes=budget, prefetch=args.prefetch, device=dev)
        except ValueError as e:
            print(f"budget {frac:.0%}: {e}", flush=True)
            continue
        print(f"budget {frac:.0%} = {budget / 1e9:.2f} GB: {plan}", flush=True)
        n = len(plan.streamed_layers)
        new = (args.steps if n else args.resident_steps) + 4
        eng = Engine(model, num_pages=max_b * -(-(args.prompt + new + page) // page) + 16, page_size=page,
                     max_num_seqs=max_b, max_num_batched_tokens=max(2048, max_b * args.prompt),
                     max_model_len=args.prompt + new + page, enable_prefix_caching=False,
                     cuda_graph_max_batch=max_b)  # fmt: skip
        ours, agree = {}, {}
        for B in batches:
            rate, toks = steady_decode(eng, prompts[B], new, dev)
            ours[B] = rate
            k = min(8, len(toks[0]))
            if n == 0:
                resident_step[B], resident_tokens[B] = B / rate, toks
            elif B in resident_tokens:
                agree[B] = sum(int(a[:k] == b[:k]) for a, b in zip(toks, resident_tokens[B])) / len(toks)
            print(f"  ours B={B}: {rate:.2f} tok/s, {1e3 * B / rate:.1f} ms/step", flush=True)
        del eng, model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        peer, on_cpu = None, None
        if not args.no_hf and time.perf_counter() - start < args.max_seconds:
            try:
                peer, on_cpu = hf_peer(cfg, weights, budget, dev, [prompts[B] for B in batches], args.hf_steps)
                print(f"  {PEER}: {[f'{r:.2f}' for r in peer]} tok/s, {on_cpu} modules on the CPU", flush=True)
            except Exception as e:  # noqa: BLE001 -- a failing peer must not lose our measurements
                print(f"  {PEER} FAILED: {e!r}"[:500], flush=True)
        elif not args.no_hf:
            print("  peer skipped: time budget reached", flush=True)
        for i, B in enumerate(batches):
            floor = B / max(plan.streamed_bytes_per_forward / h2d, read / hbm)
            peers = {PEER: peer[i]} if peer else {}
            cases.append(case(
                f"{shape} decode bs{B} gpu budget {frac:.0%} of weights bf16", metric="decode throughput",
                unit="tok/s", ours=ours[B], peers=peers, floor=floor, budget_bytes=budget,
                streamed_layers=n, num_layers=plan.num_layers,
                streamed_GB_per_step=plan.streamed_bytes_per_forward / 1e9,
                staging_GB=plan.staging_bytes / 1e9, device_weights_GB=plan.device_bytes / 1e9,
                step_ms=1e3 * B / ours[B], achieved_h2d_GBps=plan.streamed_bytes_per_forward * ours[B] / B / 1e9,
                cost_model_est_tok_s=est.get(B), greedy_first8_agree_with_resident=agree.get(B),
                accelerate_modules_on_cpu=on_cpu, h2d_GBps=h2d / 1e9, device_copy_TBps=hbm / 1e12))  # fmt: skip
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    write_results(args.out, "weight_offload", name, cases, extra={"h2d_GBps": h2d / 1e9, "device_copy_TBps": hbm / 1e12,
                                                                   "seconds": time.perf_counter() - start})
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
