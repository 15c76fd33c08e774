"""A MoE model whose routed experts stay in host memory: decode with the experts computed on the host.

Qwen3-30B-A3B shape (48 layers, 128 experts of 3 x 2048 x 768, top-8), random bf16 weights, one GPU. The routed
experts (57 GB) go to page-locked host memory (``infercore.offload.offload_experts_``); attention, routers and
the rest (4 GB) stay on the GPU. Without ``--device-min-tokens`` the host keeps only the oneDNN-packed copies and
prefills run there too. Decode tokens/s at ``--batches`` after a ``--prompt``-token prefill, steady state
(every request decoding):

* ours: the Engine over the model with host experts (decode graphs captured in segments: one host break per layer);
* peer: transformers ``generate``-style decode (sdpa) with accelerate's placement of the same modules (each
  layer's ``mlp.experts`` on "cpu": accelerate copies them to the GPU at every forward), same weights;
* extra keys: the same Engine with every weight resident (the GPU-rich bound), and the layers streamed over PCIe
  (``offload_weights_``) at the host-expert run's GPU budget (the other offload policy);
* floor: B / (routed expert bytes read per step / host read bandwidth + resident bytes / device bandwidth), both
  bandwidths measured in the same run; expected distinct experts per layer ``E (1 - (1 - k/E)^B)``.

Also the prefill of one ``--prompt``-token request with host experts (the staging path: a forward of at least
``device_min_tokens`` tokens copies the layer's experts to the GPU), as time-to-first-token.

    python benchmarks/bench_host_experts.py --out benchmarks/results/h200/host_experts.json
    python benchmarks/bench_host_experts.py --smoke --out /tmp/host_experts.json   # the script on the CPU
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, host_read_bandwidth, write_results  # noqa: E402
from bench_moe_e2e import QWEN3_30B_A3B, hf_sharing  # noqa: E402
from bench_weight_offload import hf_decode_rate, steady_decode, sync  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import build_model, config_from_hf  # noqa: E402
from infercore.offload import offload_experts_, offload_weights_  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402

PEER = "transformers + accelerate (experts on cpu)"


def engine(model, args, max_b: int, dev: torch.device) -> Engine:
    page = 16
    pages = max_b * -(-(args.prompt + args.new + page) // page) + 64
    return Engine(model, num_pages=pages, page_size=page, max_num_seqs=max_b, max_num_batched_tokens=16384,
                  max_model_len=args.prompt + args.new + page, enable_prefix_caching=False,
                  cuda_graph_max_batch=max_b if dev.type == "cuda" else 0)  # fmt: skip


def run_engine(eng: Engine, batches: dict[int, list[list[int]]], args, dev: torch.device, label: str) -> dict:
    out = {}
    for B, prompts in batches.items():
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        eng.generate(prompts, sp)  # warm-up: compile and settle
        out[B] = steady_decode(eng, prompts, args.new, dev)[0]
        print(f"{label} B={B}: {out[B]:.2f} tok/s", flush=True)
    return out


def device_map(hf) -> dict:
    """accelerate's placement: each layer's ``mlp.experts`` on "cpu", every other leaf module on GPU 0."""
    dm = {}
    for name, m in hf.named_modules():
        if name.endswith(".mlp.experts"):
            dm[name] = "cpu"
        elif name and not any(name.startswith(e + ".") for e in dm) and not list(m.children()):
            dm[name] = 0
    if any(True for _ in hf.parameters(recurse=False)) or any(True for _ in hf.model.parameters(recurse=False)):
        raise RuntimeError("device_map: parameters outside any leaf module")
    return dm


def hf_peer(model, cfg: dict, batches: dict[int, list[list[int]]], steps: int, dev: torch.device) -> dict:
    import transformers

    hcfg = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    hcfg._attn_implementation = "sdpa"
    hf = hf_sharing(model, hcfg, dev)  # views of our tensors: the experts are the host ones
    if dev.type == "cuda":
        from accelerate import dispatch_model
        from accelerate.hooks import remove_hook_from_submodules

        dm = device_map(hf)
        hf = dispatch_model(hf, device_map=dm, main_device=0)
    rates = {}
    for B, prompts in batches.items():
        rates[B] = hf_decode_rate(hf, prompts, steps, dev)
        print(f"peer B={B}: {rates[B]:.3f} tok/s", flush=True)
    if dev.type == "cuda":
        remove_hook_from_submodules(hf)
    del hf
    return rates


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/host_experts.json")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--device-min-tokens", type=int, default=0,
                    help="offload_experts_'s staging threshold; 0 (default): none, the packed copies only (one host "
                         "copy of the experts: the 128 GiB host holds no second one)")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--peer-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="host threads (default: torch's)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--quantization", default="w4a16-g128",
                    help="also run host experts quantized by this scheme ('' : skip)")
    ap.add_argument("--no-streaming", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="check the script on the CPU: a narrow model")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    if args.smoke:
        dev = torch.device("cpu")
        cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, vocab_size=512)
        args.prompt, args.new, args.peer_steps = 32, 6, 2
        cfg.update(moe_intermediate_size=128)  # INT4 g128 groups along K = I
    else:
        dev = torch.device("cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    host_bw = host_read_bandwidth(1 << 26 if args.smoke else 1 << 31)
    dev_bw = host_bw if args.smoke else copy_bandwidth("cuda")
    print(f"host read {host_bw / 1e9:.1f} GB/s ({torch.get_num_threads()} threads), device copy "
          f"{dev_bw / 1e12:.2f} TB/s", flush=True)
    config = config_from_hf(cfg)
    batches_n = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(1)
    vocab = min(150000, cfg["vocab_size"])
    batches = {B: torch.randint(0, vocab, (B, args.prompt), generator=gen).tolist() for B in batches_n}
    max_b = max(batches_n)

    def build():
        torch.manual_seed(0)
        return build_model(config, dtype=torch.bfloat16, device=dev, init="normal")

    model = build()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    E, k, L = config.num_experts, config.num_experts_per_tok, config.num_layers
    one_expert = 3 * config.hidden_size * config.moe_intermediate_size * 2
    experts_total = L * E * one_expert
    embed = model.model.embed_tokens.weight.numel() * 2
    resident_read = weight_bytes - experts_total - embed
    kv_per_token = L * 2 * config.num_kv_heads * config.head_dim * 2
    print(f"weights {weight_bytes / 1e9:.1f} GB, experts {experts_total / 1e9:.1f} GB "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    eng = engine(model, args, max_b, dev)
    resident = run_engine(eng, batches, args, dev, "resident")
    del eng
    free(dev)

    # The peer first, over plain host copies of the experts (ours then packs from them, one copy at a time: the
    # host never holds two copies of every expert).
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                setattr(ex, name, torch.nn.Parameter(getattr(ex, name).detach().to("cpu"), requires_grad=False))
    free(dev)
    peer = {}
    if not args.no_peer:
        try:
            peer = hf_peer(model, cfg, batches, args.peer_steps, dev)
        except Exception as e:  # noqa: BLE001 - report the peer's failure, keep our figures
            print(f"peer failed: {type(e).__name__}: {e}", flush=True)
        free(dev)

    dmt = None if args.device_min_tokens <= 0 else args.device_min_tokens
    info = offload_experts_(model, device=dev, num_threads=args.threads, device_min_tokens=dmt)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    gpu_bytes = weight_bytes - experts_total + info["staging_bytes"] + buffers
    print(f"host experts: {info['host_bytes'] / 1e9:.1f} GB on the host (packed: {info['packed']}), staging "
          f"{info['staging_bytes'] / 1e9:.2f} GB; GPU weights + staging {gpu_bytes / 1e9:.1f} GB", flush=True)
    eng = engine(model, args, max_b, dev)
    ours = run_engine(eng, batches, args, dev, "host experts")
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.generate([batches[batches_n[0]][0]], sp)
    sync(dev)
    t = time.perf_counter()
    eng.generate([batches[batches_n[0]][0]], sp)
    sync(dev)
    ttft_ms = (time.perf_counter() - t) * 1e3
    print(f"host experts: {args.prompt}-token prefill {ttft_ms:.1f} ms", flush=True)
    del eng
    free(dev)
    del model
    free(dev)

    streamed, stream_budget, quantized, qinfo = {}, None, {}, None

    def emit() -> None:
        """Write what has been measured so far (a later phase may run past the device's limit)."""
        cases = []
        for B in (b for b in batches_n if b in ours):
            distinct = E * (1 - (1 - k / E) ** B)
            host_bytes = L * distinct * one_expert
            dev_bytes = resident_read + B * (args.prompt + args.new / 2) * kv_per_token
            floor = B / (host_bytes / host_bw + dev_bytes / dev_bw)
            peers = {PEER: peer[B]} if B in peer else {}
            cases.append(case(
                f"qwen3-30b-a3b-shape decode bs{B}, routed experts in host memory, prompt {args.prompt}, bf16",
                metric="decode throughput", unit="tok/s", ours=ours[B], peers=peers, floor=floor,
                resident_all_on_gpu_tok_s=resident[B], weight_streaming_tok_s=streamed.get(B),
                weight_streaming_budget_bytes=stream_budget if streamed else None,
                gpu_weight_bytes=gpu_bytes, host_expert_bytes=info["host_bytes"], host_packed=info["packed"],
                device_min_tokens=dmt, quantized_host_experts_tok_s=quantized.get(B),
                quantized_scheme=args.quantization or None, quantized_host_bytes=qinfo["host_bytes"] if qinfo else None,
                expected_distinct_experts=distinct,
                host_bytes_per_step=host_bytes, host_read_GBps=host_bw / 1e9, device_copy_TBps=dev_bw / 1e12,
                host_threads=torch.get_num_threads(), native=cpu_native.status(),
                prefill_ms_host_experts=ttft_ms if B == batches_n[0] else None,
                layers=L,
            ))  # fmt: skip
        device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
        write_results(args.out, "host_experts", device, cases)

    emit()

    if not args.no_streaming:
        model = build()
        stream_budget = int(gpu_bytes)
        try:
            plan = offload_weights_(model, gpu_budget_bytes=stream_budget, device=dev)
        except ValueError as e:  # two staging slots of a whole layer may not fit where one layer's experts do
            stream_budget = int(re.search(r"at least (\d+) bytes", str(e)).group(1))
            print(f"weight streaming: {e}; at its minimum instead", flush=True)
            plan = offload_weights_(model, gpu_budget_bytes=stream_budget, device=dev)
        print(f"weight streaming at {stream_budget / 1e9:.1f} GB: {len(plan.streamed_layers)} of {L} layers streamed",
              flush=True)
        eng = engine(model, args, max_b, dev)
        streamed = run_engine(eng, batches, args, dev, "weight streaming")
        del eng, model
        free(dev)
        emit()

    if args.quantization:
        model = build()
        t = time.perf_counter()
        qinfo = offload_experts_(model, device=dev, num_threads=args.threads, quantization=args.quantization)
        print(f"{args.quantization} host experts: {qinfo['host_bytes'] / 1e9:.1f} GB on the host "
              f"({time.perf_counter() - t:.0f} s to quantize and pack)", flush=True)
        eng = engine(model, args, max_b, dev)
        quantized = run_engine(eng, batches, args, dev, f"{args.quantization} host experts")
        del eng, model
        free(dev)
        emit()

    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
