"""End-to-end decode of a routed-expert model, the Qwen3-30B-A3B shape (random bf16 weights), on one GPU.

infercore's Engine (routed Triton expert op, CUDA-graph decode) vs transformers ``generate`` on the *same tensors*
(the transformers model is built on ``meta`` and its parameters are views of ours, so the 61 GB are held once), in
the same process. Decode rate = B * (N - 1) / (t(N tokens) - t(1 token)), as in bench_e2e.py. Floor: bytes read
per step / measured copy bandwidth, where a step reads the dense weights (attention, routers, lm_head), the experts
that the step's B tokens route to (expected distinct experts per layer under uniform top-k routing,
``E (1 - (1 - k/E)^B)``; random weights route near-uniformly) and the KV at the mean context.

    python benchmarks/bench_moe_e2e.py --out benchmarks/results/h200/moe_e2e.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, write_results  # noqa: E402
from bench_e2e import steady_decode, timed  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import build_model, config_from_hf  # noqa: E402

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
)


def hf_sharing(model, hcfg, dev, cls=None):
    """A transformers model (``cls``, default Qwen3MoeForCausalLM) whose parameters are views of ``model``'s (names
    mapped by ``model._resolve``: q/k/v row slices of qkv_proj, per-expert slices of the stacked experts)."""
    import transformers

    with torch.device("meta"):
        hf = (cls or transformers.Qwen3MoeForCausalLM)(hcfg)
    ours = dict(model.named_parameters())
    for name, _ in list(hf.named_parameters()):
        mapped, index = model._resolve(name)
        t = ours[mapped].data
        t = t if index is None else t[index]
        owner, attr = hf.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        owner._parameters[attr] = nn.Parameter(t, requires_grad=False)
    rot = hf.model.rotary_emb  # its inverse frequencies were computed on meta: build it again, then move it
    try:
        hf.model.rotary_emb = type(rot)(config=hcfg, device=dev)
    except TypeError:  # transformers versions whose rotary module takes no device
        with torch.device("cpu"):
            hf.model.rotary_emb = type(rot)(config=hcfg).to(dev)
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def decode_rates(eng, hf, prompts: torch.Tensor, new: int, hf_new: int, label: str) -> tuple[float, float, dict, int]:
    """Decode tok/s of the Engine on ``prompts`` ``[B, P]`` (``B (new - 1) / (t(new) - t(1))``, best of two), its
    steady rate (every request decoding), transformers ``generate``'s rate as ``{label: rate}`` (``hf_new`` tokens;
    empty if ``hf`` is None or fails) and, at batch 1, how many of the first 16 greedy tokens agree."""
    B, P = prompts.shape

    def ours(n: int):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return eng.generate([p.tolist() for p in prompts], sp)

    ours(2)
    t1 = min(timed(lambda: ours(1)) for _ in range(2))
    tn = min(timed(lambda: ours(new)) for _ in range(2))
    rate = B * (new - 1) / (tn - t1)
    steady = steady_decode(eng, prompts, new, async_scheduling=True)
    peers, same = {}, None
    if hf is not None:
        x = prompts.to(next(hf.parameters()).device)

        @torch.inference_mode()
        def theirs(n: int):
            return hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False)

        try:
            theirs(2)
            h1 = timed(lambda: theirs(1))
            hn = timed(lambda: theirs(hf_new))
            peers[label] = B * (hf_new - 1) / (hn - h1)
            if B == 1:
                a = ours(16)[0].token_ids
                b = theirs(16)[0, P:].tolist()
                same = sum(int(u == v) for u, v in zip(a, b))
        except Exception as e:  # noqa: BLE001 - report the peer's failure, keep our figures
            print(f"transformers peer failed at B={B}: {type(e).__name__}: {e}", flush=True)
            peers = {}
    return rate, steady, peers, same


def prefill_case(eng, hf, prompt: torch.Tensor, peer: str, name: str, *, profile: bool = False) -> dict:
    """Time to the first token of one prompt (``[1, L]``) through the Engine, against a transformers forward of the
    same tokens (best of 3 each, after a warm-up); ``profile``: the Engine prefill's top CUDA kernels
    (torch.profiler), printed and kept in the row."""
    L = prompt.shape[1]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = prompt[0].tolist()
    eng.generate([ids], sp)
    t_ours = min(timed(lambda: eng.generate([ids], sp)) for _ in range(3))
    extra = {}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as p:
            eng.generate([ids], sp)
        extra["profile"] = p.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(extra["profile"], flush=True)
    peers = {}
    if hf is not None:
        x = prompt.to(next(hf.parameters()).device)
        try:
            with torch.inference_mode():
                hf(x)
                peers[peer] = L / min(timed(lambda: hf(x)) for _ in range(3))
        except Exception as e:  # noqa: BLE001 - report the peer's failure, keep our figure
            print(f"transformers prefill failed: {type(e).__name__}: {e}", flush=True)
    print(f"prefill {L}: ours {L / t_ours:.0f} tok/s, peers {peers}", flush=True)
    return case(name, metric="prefill throughput", unit="tok/s", ours=L / t_ours, peers=peers, floor=None,
                ttft_s=t_ours, **extra)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200/moe_e2e.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--hf-new", type=int, default=16, help="new tokens for the (slow) transformers peer")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--prefill", type=int, default=4096, help="prompt length of the prefill case (0: none)")
    ap.add_argument("--profile", action="store_true", help="print the prefill's top CUDA kernels (torch.profiler)")
    args = ap.parse_args()
    import transformers

    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    torch.manual_seed(0)
    config = config_from_hf(cfg)
    model = build_model(config, dtype=torch.bfloat16, device=dev, init="normal")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    E, k, L = config.num_experts, config.num_experts_per_tok, args.layers
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * 2
    dense_read = weight_bytes - L * E * expert_bytes - model.model.embed_tokens.weight.numel() * 2
    kv_per_token = L * 2 * config.num_kv_heads * config.head_dim * 2
    hf, impl = None, "default"
    if not args.no_hf:
        hcfg = transformers.Qwen3MoeConfig(**{k_: v for k_, v in cfg.items() if k_ != "model_type"})
        hcfg._attn_implementation = "sdpa"
        try:  # transformers 5: batched expert GEMMs (torch grouped_mm) instead of the per-expert loop
            hcfg._experts_implementation = "grouped_mm"
            impl = "grouped_mm"
        except Exception:  # noqa: BLE001 - older transformers: the per-expert loop
            pass
        hf = hf_sharing(model, hcfg, dev)
    batches = [int(b) for b in args.batches.split(",") if b]
    max_b, page = max(batches, default=1), 16
    max_len = max(args.prompt + args.new, args.prefill + 8) + page
    pages = max_b * -(-(args.prompt + args.new + page) // page) + -(-max_len // page) + 64
    eng = Engine(model, num_pages=pages, page_size=page, max_num_seqs=max_b, max_num_batched_tokens=16384,
                 max_model_len=max_len, enable_prefix_caching=False, cuda_graph_max_batch=max_b)
    gen = torch.Generator().manual_seed(1)
    cases = []
    for B in batches:
        prompts = torch.randint(0, 150000, (B, args.prompt), generator=gen)

        r_ours, steady, peers, same = decode_rates(eng, hf, prompts, args.new, args.hf_new,
                                                   f"transformers generate (sdpa, experts {impl})")  # fmt: skip
        distinct = E * (1 - (1 - k / E) ** B)
        step_bytes = dense_read + L * distinct * expert_bytes + B * (args.prompt + args.new / 2) * kv_per_token
        floor = B * bw / step_bytes
        print(f"decode B={B}: ours {r_ours:.1f} tok/s (steady {steady:.1f} = {steady / floor:.3f} of floor, "
              f"{1e3 * B / steady:.2f} ms/step), peers {peers}, floor {floor:.1f} ({step_bytes / 1e9:.2f} GB/step, "
              f"{distinct:.1f} experts/layer), greedy agree {same}", flush=True)
        cases.append(case(f"qwen3-30b-a3b-shape decode bs{B} prompt{args.prompt} new{args.new} bf16",
                          metric="decode throughput", unit="tok/s", ours=r_ours, peers=peers, floor=floor,
                          greedy_first16_agree=same, weight_bytes=weight_bytes, step_bytes_floor=step_bytes,
                          expected_distinct_experts_per_layer=distinct, copy_bw_TBps=bw / 1e12,
                          steady_decode_tok_s=steady, steady_over_floor=steady / floor,
                          steady_step_ms=1e3 * B / steady, layers=L))
    if args.prefill:
        prompt = torch.randint(0, 150000, (1, args.prefill), generator=gen)
        cases.append(prefill_case(eng, hf, prompt, f"transformers forward (sdpa, experts {impl})",
                                  f"qwen3-30b-a3b-shape ({L} layers) prefill {args.prefill} tokens bf16",
                                  profile=args.profile))  # fmt: skip
    write_results(args.out, "moe_e2e", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
