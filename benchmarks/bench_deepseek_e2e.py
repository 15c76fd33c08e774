"""End-to-end DeepSeek-V2-Lite shape (random bf16 weights, 15.7B parameters) on one GPU: decode and prefill.

infercore's Engine (MLA decode kernel over the latent cache, plain-form prefill, routed Triton expert op, CUDA-graph
decode) vs transformers ``generate`` on the *same tensors* (the transformers model is built on ``meta`` and its
parameters are views of ours), in the same process. Decode rate = B * (N - 1) / (t(N tokens) - t(1 token)) as in
bench_e2e.py, plus the steady rate once every request decodes. Floor: bytes read per step / measured copy bandwidth:
the dense weights (attention, routers, shared experts, dense first layer, lm_head), the experts the step's B tokens
route to (expected distinct experts per layer under uniform top-k, ``E (1 - (1 - k/E)^B)``) and the latent KV
(576 x 2 bytes a token and layer) at the mean context. Prefill: time to the first token of one prompt.

    python benchmarks/bench_deepseek_e2e.py --out benchmarks/results/h200/deepseek_e2e.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, write_results  # noqa: E402
from bench_moe_e2e import decode_rates, hf_sharing, prefill_case  # noqa: E402

from infercore import Engine  # noqa: E402
from infercore.models import build_model, config_from_hf  # noqa: E402

DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    topk_method="greedy", n_group=1, topk_group=1, scoring_func="softmax", norm_topk_prob=False,
    first_k_dense_replace=1, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001, hidden_act="silu", attention_bias=False,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/deepseek_e2e.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--hf-new", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=4096, help="prompt length of the prefill case")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the prefill's top CUDA kernels (torch.profiler)")
    args = ap.parse_args()
    import transformers

    cfg = dict(DEEPSEEK_V2_LITE)
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    torch.manual_seed(0)
    config = config_from_hf(cfg)
    model = build_model(config, dtype=torch.bfloat16, device=dev, init="normal")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    expert_bytes = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2
    dense_read = weight_bytes - moe_layers * E * expert_bytes - model.model.embed_tokens.weight.numel() * 2
    kv_per_token = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    hf, impl = None, "default"
    if not args.no_hf:
        hcfg = transformers.DeepseekV2Config(**{k_: v for k_, v in cfg.items() if k_ != "model_type"})
        hcfg._attn_implementation = "sdpa"
        try:
            hcfg._experts_implementation = "grouped_mm"
            impl = "grouped_mm"
        except Exception:  # noqa: BLE001 - older transformers: the per-expert loop
            pass
        try:
            hf = hf_sharing(model, hcfg, dev, transformers.DeepseekV2ForCausalLM)
        except Exception as e:  # noqa: BLE001 - report the peer's failure, keep our figures
            print(f"transformers peer not built: {type(e).__name__}: {e}", flush=True)
    batches = [int(b) for b in args.batches.split(",") if b]
    max_b, page = max(batches, default=1), 16
    max_len = max(args.prompt + args.new, args.prefill + 8) + page
    pages = max_b * -(-(args.prompt + args.new + page) // page) + -(-max_len // page) + 64
    eng = Engine(model, num_pages=pages, page_size=page, max_num_seqs=max_b, max_num_batched_tokens=8192,
                 max_model_len=max_len, enable_prefix_caching=False, cuda_graph_max_batch=max_b)
    gen = torch.Generator().manual_seed(1)
    cases = []
    for B in batches:
        prompts = torch.randint(0, 100000, (B, args.prompt), generator=gen)

        r_ours, steady, peers, same = decode_rates(eng, hf, prompts, args.new, args.hf_new,
                                                   f"transformers generate (sdpa, experts {impl})")  # fmt: skip
        distinct = E * (1 - (1 - k / E) ** B)
        step_bytes = (dense_read + moe_layers * distinct * expert_bytes
                      + B * (args.prompt + args.new / 2) * kv_per_token)  # fmt: skip
        floor = B * bw / step_bytes
        print(f"decode B={B}: ours {r_ours:.1f} tok/s (steady {steady:.1f} = {steady / floor:.3f} of floor, "
              f"{1e3 * B / steady:.2f} ms/step), peers {peers}, floor {floor:.1f}, greedy agree {same}", flush=True)
        cases.append(case(f"deepseek-v2-lite-shape decode bs{B} prompt{args.prompt} new{args.new} bf16",
                          metric="decode throughput", unit="tok/s", ours=r_ours, peers=peers, floor=floor,
                          greedy_first16_agree=same, weight_bytes=weight_bytes, step_bytes_floor=step_bytes,
                          expected_distinct_experts_per_layer=distinct, copy_bw_TBps=bw / 1e12,
                          steady_decode_tok_s=steady, steady_over_floor=steady / floor,
                          steady_step_ms=1e3 * B / steady))  # fmt: skip
    # prefill: one long prompt, time to its first token
    prompt = torch.randint(0, 100000, (1, args.prefill), generator=gen)
    cases.append(prefill_case(eng, hf, prompt, f"transformers forward (sdpa, experts {impl})",
                              f"deepseek-v2-lite-shape prefill {args.prefill} tokens bf16", profile=args.profile))
    write_results(args.out, "deepseek_e2e", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
