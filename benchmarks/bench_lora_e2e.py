"""Multi-LoRA decode of the Llama-3.1-8B shape (random bf16 weights) on one GPU.

Four rank-16 adapters over all seven projections (q k v o gate up down), the batch's requests spread over them
round-robin. Ours: the Engine with LoRA slots (CUDA-graph decode, the batched shrink / expand kernels); the same
engine's base model without slots (the overhead LoRA costs); peer: PEFT over transformers (eager, sdpa) with its
mixed-batch inference (``generate(..., adapter_names=...)``, each row its own adapter), same weights and adapters.
Decode rate = B * (N - 1) / (t(N tokens) - t(1 token)), the prefill excluded alike. Floor: (base weights + the
adapters' bytes + KV read per step at the decode's mean context) / measured copy bandwidth.

    python benchmarks/bench_lora_e2e.py --out benchmarks/results/h200/lora_e2e.json
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
from bench_e2e import LLAMA_8B, timed  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.lora import adapter_from_state_dict  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@torch.inference_mode()
def first_token_check(eng: Engine, pm, prompt: torch.Tensor, lora: str, k: int = 20) -> dict:
    """The first generated position's log-probabilities, ours against PEFT's, with the adapter and without it (the
    base model's own bf16 disagreement is the noise level; random 8B-shape weights leave the top logits so close that
    greedy tokens of two correct bf16 implementations part early). ``lora_shift``: how far the adapter moves PEFT's
    log-probabilities, so an adapter that was not applied would show as an error of that size."""
    x = prompt.to(pm.device)[None]

    def theirs() -> torch.Tensor:
        return pm(input_ids=x).logits[0, -1].float().log_softmax(-1).cpu()

    def ours(name) -> dict:
        out = eng.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=1, logprobs=k), lora=[name])
        return out[0].logprobs[0]

    pm.set_adapter(lora)
    with_lora = theirs()
    with pm.disable_adapter():
        base = theirs()
    res = {}
    for tag, name, ref in (("lora", lora, with_lora), ("base", None, base)):
        got = ours(name)
        top = set(ref.topk(k).indices.tolist())
        res[f"{tag}_max_abs_logprob_err"] = max(abs(v - ref[t].item()) for t, v in got.items())
        res[f"{tag}_top{k}_overlap"] = len(top & set(got)) / k
    res["lora_shift_max_abs_logprob"] = (with_lora - base).abs().max().item()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/lora_e2e.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--hf-new", type=int, default=32, help="new tokens for the (slow) PEFT peer")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--grouped-min", type=int, default=None,
                    help="run the grouped (SGMV) LoRA kernels from this many tokens (ops.lora.triton."
                         "GROUPED_MIN_TOKENS; default: the library's)")
    ap.add_argument("--smoke", action="store_true", help="a tiny config on the CPU (checks the script, times nothing)")
    args = ap.parse_args()
    if args.grouped_min is not None:
        from infercore.ops.lora import triton as lora_triton

        lora_triton.GROUPED_MIN_TOKENS = args.grouped_min
    import peft
    import transformers
    from peft.utils import get_peft_model_state_dict

    cfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
    dev = torch.device("cuda")
    if args.smoke:
        cfg.update(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=1000, head_dim=32)
        dev = torch.device("cpu")
        torch.cuda.synchronize = lambda *a: None
    bw = 1e11 if args.smoke else copy_bandwidth()
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device=dev, init="normal")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_bytes = weight_bytes - model.model.embed_tokens.weight.numel() * 2
    kv_per_token = args.layers * 2 * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
    hcfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    hcfg._attn_implementation = "sdpa"
    with torch.device(dev):
        hf = transformers.LlamaForCausalLM(hcfg).to(torch.bfloat16).eval()
    hf.generation_config.pad_token_id = 0
    model.load_weights(hf.state_dict().items())  # the same base weights for both
    names = [f"a{i}" for i in range(args.adapters)]
    lcfg = dict(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0)
    pm = peft.get_peft_model(hf, peft.LoraConfig(**lcfg, init_lora_weights=False), adapter_name=names[0])
    for n in names[1:]:
        pm.add_adapter(n, peft.LoraConfig(**lcfg, init_lora_weights=False))
    gen = torch.Generator(device="cpu").manual_seed(2)
    with torch.no_grad():  # small random A and B (PEFT's init would leave B at zero)
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    pm.eval()
    adapters = [adapter_from_state_dict(n, get_peft_model_state_dict(pm, adapter_name=n), lcfg) for n in names]
    adapter_bytes = sum(a.num_params for a in adapters) * 2 // len(adapters)  # one adapter's bf16 bytes
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

    base_rates = {}
    eng = Engine(model, **kw)  # no LoRA slots: the model's projections are not wrapped yet
    for B in batches:
        base_rates[B] = rate(eng, B, None)
        print(f"base B={B}: {base_rates[B]:.1f} tok/s", flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    eng = Engine(model, max_loras=args.adapters, max_lora_rank=args.rank, **kw)
    for a in adapters:
        eng.add_lora(a.name, a)
    cases = []
    for B in batches:
        loras = [names[i % len(names)] for i in range(B)]
        ours = rate(eng, B, loras)
        peers, same = {}, None
        if not args.no_hf:
            x = prompts[B].to(dev)

            @torch.inference_mode()
            def theirs(n: int, x=x, loras=loras):
                return pm.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, adapter_names=loras)

            theirs(2)
            h1 = timed(lambda: theirs(1))
            hn = timed(lambda: theirs(args.hf_new))
            peers["peft + transformers generate (eager, sdpa, mixed adapters)"] = B * (args.hf_new - 1) / (hn - h1)
            if B == 1:
                a = eng.generate([prompts[1][0].tolist()], SamplingParams(temperature=0, max_tokens=16,
                                                                          ignore_eos=True), lora=loras)[0].token_ids
                b = theirs(16)[0, args.prompt:].tolist()
                same = sum(int(u == v) for u, v in zip(a, b))
                check = first_token_check(eng, pm, prompts[1][0], loras[0])
                print(f"first-token log-probabilities vs PEFT: {check}", flush=True)
        distinct = min(B, len(names))
        mean_ctx = args.prompt + args.new / 2
        floor = B * bw / (read_bytes + distinct * adapter_bytes + B * mean_ctx * kv_per_token)
        print(f"LoRA B={B}: ours {ours:.1f} tok/s ({ours / base_rates[B]:.3f} of the base model's "
              f"{base_rates[B]:.1f}), peers {peers}, floor {floor:.1f}, ours/floor {ours / floor:.3f}, "
              f"greedy agree {same}", flush=True)
        cases.append(case(f"llama3.1-8b-shape multi-LoRA decode bs{B} ({distinct} adapters of rank {args.rank}, "
                          f"7 projections) prompt{args.prompt} new{args.new} bf16", metric="decode throughput",
                          unit="tok/s", ours=ours, peers=peers, floor=floor, base_model_tok_s=base_rates[B],
                          ours_over_base_model=ours / base_rates[B], adapter_bytes=adapter_bytes,
                          greedy_first16_agree=same, copy_bw_TBps=bw / 1e12, grouped_min_tokens=args.grouped_min,
                          **({"first_token_vs_peft": check} if B == 1 and not args.no_hf else {})))
    write_results(args.out, "lora_e2e", "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
