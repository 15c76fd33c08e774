"""CPU greedy decode of a routed-expert model: the Engine (dense linears and experts packed: the native host
kernels, keys ``onednn_packed_tok_s`` / ``aten_int4_tok_s`` with them off; or the experts quantized to INT4 g128 on
the host) vs transformers ``generate`` on the same weights, timed interleaved with each packed phase.

A Qwen3-MoE-shaped model narrowed to fit a small host: ``--layers`` layers of hidden 1024, 64 experts of width 512
(top-8), 16/4 heads, vocab 32000, random bf16 weights; one prompt of ``--prompt`` tokens. Decode rate =
(N - 1) / (t(N) - t(1)) for both (prefill excluded alike), interleaved timings, best of ``--repeats``. Floor: the
bytes a decode token reads (the non-expert weights + the 8 routed experts of every layer) / the measured host
read bandwidth.

    python benchmarks/bench_cpu_moe_e2e.py --out benchmarks/results/cpu/cpu_moe_e2e.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, host_read_bandwidth, write_results  # noqa: E402
from bench_cpu_decode import decode_rates  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import build_model, config_from_hf  # noqa: E402
from infercore.offload import offload_experts_  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/cpu/cpu_moe_e2e.json")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import transformers

    cfg = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=32000, hidden_size=1024,
               intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=args.layers,
               num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
               rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, hidden_act="silu")  # fmt: skip
    dtype = torch.bfloat16
    bw = host_read_bandwidth()
    torch.manual_seed(0)
    config = config_from_hf(cfg)
    model = build_model(config, dtype=dtype, device="cpu", init="normal")
    hcfg = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    hcfg._attn_implementation = "sdpa"
    from bench_moe_e2e import hf_sharing

    hf = hf_sharing(model, hcfg, torch.device("cpu"))  # views of our tensors, before any packing
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    L, E, k = args.layers, cfg["num_experts"], cfg["num_experts_per_tok"]
    one_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2
    embed = model.model.embed_tokens.weight.numel() * 2
    read_per_token = weight_bytes - L * E * one_expert - embed + L * k * one_expert
    prompt = torch.randint(3, 32000, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    common = dict(page_size=16, num_pages=64, max_num_seqs=1, enable_prefix_caching=False)

    def engine_run(eng):
        def run(n: int) -> list[int]:
            return eng.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids

        return run

    x = torch.tensor([prompt])

    @torch.inference_mode()
    def theirs(n: int) -> list[int]:
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
        return out[0, len(prompt):].tolist()

    plain = Engine(model, cpu_packed_linears=False, **common)  # plain F.linear / matmul everywhere (the baseline)
    run_plain = engine_run(plain)
    same_plain = run_plain(args.tokens) == theirs(args.tokens)
    r_plain, r_hf = decode_rates([run_plain, theirs], args.tokens, args.repeats)
    del plain

    def packed_rate(native: bool):
        """The Engine with packed linears and experts (models.layout), native kernels on or off, timed interleaved
        with transformers (the host's speed drifts between phases)."""
        for m in model.modules():  # repack for this phase
            if getattr(m, "cpu_packed_experts", None) is not None:
                m.cpu_packed_experts = None
        ctx = contextlib.nullcontext() if native else cpu_native.disabled()
        with ctx:
            eng = Engine(model, **common)
            run = engine_run(eng)
            toks = run(args.tokens)
            rate, hf_rate = decode_rates([run, theirs], args.tokens, args.repeats)
        return rate, hf_rate, toks

    r_dnn, r_hf_dnn, _ = packed_rate(False)
    r_packed, r_hf_packed, toks_packed = packed_rate(True) if cpu_native.available() else (r_dnn, r_hf_dnn, None)
    hf = None  # free the peer (its tensors are ours)

    def quant_rate(native: bool):
        torch.manual_seed(0)
        m = build_model(config, dtype=dtype, device="cpu", init="normal")  # the same weights again
        ctx = contextlib.nullcontext() if native else cpu_native.disabled()
        with ctx:
            info = offload_experts_(m, quantization="w4a16-g128")
            eng = Engine(m, **common)
            run = engine_run(eng)
            toks = run(args.tokens)
            (rate,) = decode_rates([run], args.tokens, args.repeats)
        return rate, info, toks

    r_quant_aten, _, _ = quant_rate(False)
    r_quant, info, toks_quant = quant_rate(True) if cpu_native.available() else (r_quant_aten, None, None)
    q_read = read_per_token - L * k * one_expert + L * k * (info["host_bytes"] / (L * E))
    agree = sum(int(a == b) for a, b in zip(toks_quant, toks_packed))
    print(f"plain {r_plain:.2f} tok/s (same tokens as transformers: {same_plain}; transformers {r_hf:.2f}); "
          f"packed, oneDNN {r_dnn:.2f} (transformers {r_hf_dnn:.2f}); packed, native {r_packed:.2f} (transformers "
          f"{r_hf_packed:.2f}); INT4 host experts ATen {r_quant_aten:.2f}, native {r_quant:.2f}; floors "
          f"{bw / read_per_token:.1f} (bf16) / {bw / q_read:.1f} (INT4 experts) tok/s", flush=True)
    name = f"qwen3-moe-shape {L} layers (hidden 1024, 64 experts x 512, top-8) decode bs1, prompt {args.prompt}"
    # the host's speed drifts between phases: the peer is the fastest transformers measured in any of them
    peers = {"transformers generate (sdpa)": max(r_hf, r_hf_dnn, r_hf_packed),
             "Engine, plain linears and experts": r_plain}
    cases = [
        case(f"{name}, bf16, packed linears and experts (native host kernels)", metric="decode throughput",
             unit="tok/s", ours=r_packed, peers=peers, floor=bw / read_per_token, weight_bytes=weight_bytes,
             bytes_per_token=read_per_token, host_read_GBps=bw / 1e9, threads=torch.get_num_threads(),
             plain_engine_same_tokens_as_transformers=same_plain, native=cpu_native.status(),
             onednn_packed_tok_s=r_dnn, transformers_tok_s_in_onednn_phase=r_hf_dnn,
             transformers_tok_s_in_plain_phase=r_hf, transformers_tok_s_in_native_phase=r_hf_packed),
        case(f"{name}, bf16, experts INT4 g128 on the host (offload_experts_)", metric="decode throughput",
             unit="tok/s", ours=r_quant, peers=peers, floor=bw / q_read, bytes_per_token=q_read,
             host_expert_bytes=info["host_bytes"], host_read_GBps=bw / 1e9, threads=torch.get_num_threads(),
             greedy_tokens_agree_with_bf16=agree / max(1, len(toks_packed)), aten_int4_tok_s=r_quant_aten),
    ]  # fmt: skip
    write_results(args.out, "cpu_moe_e2e", "cpu", cases)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
