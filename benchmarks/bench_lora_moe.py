"""Multi-LoRA decode of a Qwen3-30B-A3B-shape MoE (random bf16 weights, ``--layers`` of its 48) on one GPU, with
adapters on the routed experts.

Four rank-16 adapters, each over the attention (q k v o) and every expert's gate / up / down projections, the batch's
requests spread over them round-robin. Three runs of the same engine and prompts: the base model without LoRA slots,
the engine with slots running attention-only adapters (what LoRA costs without the experts' share), and with the
expert adapters. Decode rate = B * (N - 1) / (t(N tokens) - t(1 token)), the prefill excluded. Floor: (dense weights
+ the expected distinct routed experts' bytes + the adapters' bytes those tokens read + KV at the decode's mean
context) / measured copy bandwidth.

    python benchmarks/bench_lora_moe.py --out benchmarks/results/h200/lora_moe.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, write_results  # noqa: E402
from bench_e2e import timed  # noqa: E402
from bench_moe_e2e import QWEN3_30B_A3B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.lora import LoRAAdapter  # noqa: E402
from infercore.models import build_model, config_from_hf  # noqa: E402


def adapters(config, n: int, r: int, experts: bool, seed: int = 0) -> list[LoRAAdapter]:
    """``n`` random adapters of rank ``r`` on every layer's q / k / v / o, and with ``experts`` on every routed
    expert's gate / up / down (small values, B already scaled)."""
    g = torch.Generator().manual_seed(seed)
    H, hd, E, inter = config.hidden_size, config.head_dim, config.num_experts, config.moe_intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    out = []
    for i in range(n):
        w = {}
        for layer in range(config.num_layers):
            for m, (k, o) in {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H)}.items():
                w[(layer, m)] = (rnd(r, k), rnd(o, r))
            if experts:
                for m, (k, o) in {"experts.gate_proj": (H, inter), "experts.up_proj": (H, inter),
                                  "experts.down_proj": (inter, H)}.items():
                    w[(layer, m)] = (rnd(E, r, k), rnd(E, o, r))
        out.append(LoRAAdapter(f"{'e' if experts else 'a'}{i}", w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/lora_moe.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--moe-grouped-min", default=None,
                    help="ops.moe.triton.LORA_GROUPED_MIN_PAIRS for this run: pairs from which the experts' LoRA "
                         "takes the grouped kernels ('lora': the lora ops' own threshold)")
    ap.add_argument("--smoke", action="store_true", help="a tiny config on the CPU (checks the script, times nothing)")
    args = ap.parse_args()
    if args.moe_grouped_min is not None:
        from infercore.ops.moe import triton as moe_triton

        moe_triton.LORA_GROUPED_MIN_PAIRS = None if args.moe_grouped_min == "lora" else int(args.moe_grouped_min)
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    dev = torch.device("cuda")
    if args.smoke:
        cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=1000)
        dev = torch.device("cpu")
        torch.cuda.synchronize = lambda *a: None
    bw = 1e11 if args.smoke else copy_bandwidth()
    torch.manual_seed(0)
    config = config_from_hf(cfg)
    model = build_model(config, dtype=torch.bfloat16, device=dev, init="normal")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    E, k, L, H = config.num_experts, config.num_experts_per_tok, args.layers, config.hidden_size
    inter, r = config.moe_intermediate_size, args.rank
    expert_bytes = 3 * H * inter * 2
    dense_read = weight_bytes - L * E * expert_bytes - model.model.embed_tokens.weight.numel() * 2
    kv_per_token = L * 2 * config.num_kv_heads * config.head_dim * 2
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attn_lora_bytes = L * r * (H + q + 3 * (H + kv) + q + H) * 2  # one adapter's q / k / v / o
    expert_lora_bytes = r * (4 * H + 3 * inter) * 2  # one adapter's pairs of one expert
    batches = [int(b) for b in args.batches.split(",")]
    max_b, page = max(batches), 16
    pages = max_b * -(-(args.prompt + args.new + page) // page) + 64
    kw = dict(num_pages=pages, page_size=page, max_num_seqs=max_b, max_num_batched_tokens=16384,
              max_model_len=args.prompt + args.new + page, enable_prefix_caching=False, cuda_graph_max_batch=max_b)
    gen = torch.Generator().manual_seed(1)
    prompts = {B: torch.randint(0, cfg["vocab_size"] - 256, (B, args.prompt), generator=gen) for B in batches}

    def rate(eng: Engine, B: int, loras) -> float:
        def run(n: int):
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            return eng.generate([p.tolist() for p in prompts[B]], sp, lora=loras)

        run(2)
        t1 = min(timed(lambda: run(1)) for _ in range(2))
        tn = min(timed(lambda: run(args.new)) for _ in range(2))
        return B * (args.new - 1) / (tn - t1)

    base = {}
    eng = Engine(model, **kw)
    for B in batches:
        base[B] = rate(eng, B, None)
        print(f"base B={B}: {base[B]:.1f} tok/s", flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    eng = Engine(model, max_loras=args.adapters, max_lora_rank=r, **kw)
    for a in adapters(config, args.adapters, r, experts=False) + adapters(config, args.adapters, r, experts=True):
        eng.add_lora(a.name, a)
    cases = []
    for B in batches:
        row = {}
        for tag in ("a", "e"):
            loras = [f"{tag}{i % args.adapters}" for i in range(B)]
            row[tag] = rate(eng, B, loras)
        n_ad = min(B, args.adapters)
        distinct = E * (1 - (1 - k / E) ** B)  # experts a step reads, per layer
        pairs_per_adapter = E * (1 - (1 - k / E) ** max(1, B // n_ad))  # (adapter, expert) pairs per adapter
        step = (dense_read + L * distinct * expert_bytes + n_ad * attn_lora_bytes
                + L * n_ad * pairs_per_adapter * expert_lora_bytes + B * (args.prompt + args.new / 2) * kv_per_token)
        floor = B * bw / step
        print(f"B={B}: base {base[B]:.1f}, attention LoRA {row['a']:.1f} ({row['a'] / base[B]:.3f}), experts + "
              f"attention LoRA {row['e']:.1f} ({row['e'] / base[B]:.3f} of base, {row['e'] / floor:.3f} of floor "
              f"{floor:.1f})", flush=True)
        cases.append(case(f"qwen3-30b-a3b-shape ({L} layers) multi-LoRA decode bs{B} ({n_ad} adapters of rank {r} "
                          f"on attention + every routed expert) prompt{args.prompt} new{args.new} bf16",
                          metric="decode throughput", unit="tok/s", ours=row["e"],
                          peers={}, floor=floor, base_model_tok_s=base[B], ours_over_base_model=row["e"] / base[B],
                          attention_only_lora_tok_s=row["a"], attention_only_over_base=row["a"] / base[B],
                          step_bytes_floor=step, copy_bw_TBps=bw / 1e12, layers=L,
                          slot_bytes=sum(b.numel() * b.element_size() for b in eng.model.buffers()
                                         if b.dim() == 3 and b.shape[0] == args.adapters * E)))
    from infercore.ops.moe import triton as moe_triton

    write_results(args.out, "lora_moe", "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(), cases,
                  extra={"moe_lora_grouped_min_pairs": moe_triton.LORA_GROUPED_MIN_PAIRS})  # fmt: skip


if __name__ == "__main__":
    main()
