"""CPU greedy decode of SmolLM2-135M-Instruct through LoRA adapters: infercore Engine vs PEFT over transformers.

Random rank-16 PEFT adapters over all seven projections of every layer (saved and loaded as PEFT writes them).
Batch 1: one adapter; batch 4: four requests, each its own adapter (PEFT's mixed-batch ``adapter_names``). Ours
also runs the base model (an engine without LoRA slots) so the adapters' cost reads directly. Same dequantized
weights, dtype, prompt and threads for all; decode rate = B * (N - 1) / (t(N tokens) - t(1 token)). Floor: the
read bandwidth over the bytes a step reads (base weights plus the adapters in use).

    python benchmarks/bench_cpu_lora.py [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402
from bench_cpu_decode import PROMPT, decode_rates, read_bandwidth  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.loading import default_model_path, load_checkpoint  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/cpu/lora.json")
    args = ap.parse_args()
    import peft
    import transformers

    path = default_model_path()
    bw = read_bandwidth()
    ckpt = load_checkpoint(path)
    names = ["a0", "a1", "a2", "a3"]
    tmp = tempfile.mkdtemp()
    cases = []
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        hcfg = transformers.AutoConfig.for_model(**ckpt.config)
        hf = transformers.LlamaForCausalLM(hcfg).to(dtype).eval()
        hf.load_state_dict({k: v.to(dtype) for k, v in ckpt.weights()}, strict=False)
        hf.tie_weights()
        lcfg = dict(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0,
                    init_lora_weights=False)
        pm = peft.get_peft_model(hf, peft.LoraConfig(**lcfg), adapter_name=names[0])
        for n in names[1:]:
            pm.add_adapter(n, peft.LoraConfig(**lcfg))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        pm.eval()
        pm.save_pretrained(tmp, selected_adapters=names)  # each in tmp/<name> (no "default" adapter)
        dirs = {n: os.path.join(tmp, n) for n in names}
        base = Engine.from_pretrained(path, device="cpu", dtype=dtype, enable_prefix_caching=False)
        eng = Engine.from_pretrained(path, device="cpu", dtype=dtype, enable_prefix_caching=False,
                                     max_loras=len(names), max_lora_rank=args.rank)
        for n in names:
            eng.add_lora(n, dirs[n])
        adapter_bytes = sum(a.num_params for a in eng.lora.adapters.values()) // len(names) * dtype.itemsize
        weight_bytes = sum(p.numel() * p.element_size() for p in base.model.parameters())
        ids = eng.tokenizer.encode(
            eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True),
            add_special_tokens=False)
        for B in (1, 4):
            loras = names[:B]
            prompts = [ids] * B

            def ours(n: int, loras=loras, prompts=prompts, eng=eng) -> list[list[int]]:
                sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                return [o.token_ids for o in eng.generate(prompts, sp, lora=loras)]

            def ours_base(n: int, prompts=prompts, base=base) -> list[list[int]]:
                sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                return [o.token_ids for o in base.generate(prompts, sp)]

            x = torch.tensor(prompts)

            @torch.inference_mode()
            def theirs(n: int, x=x, loras=loras, pm=pm, ids=ids) -> list[list[int]]:
                out = pm.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=2, adapter_names=loras)
                return out[:, len(ids):].tolist()

            same = ours(args.tokens) == theirs(args.tokens)
            r_ours, r_hf, r_base = (B * r for r in decode_rates([ours, theirs, ours_base], args.tokens,
                                                                args.repeats))
            floor = B * bw / (weight_bytes + B * adapter_bytes)
            print(f"{dname} B={B}: infercore LoRA {r_ours:.1f} tok/s (base model {r_base:.1f}, "
                  f"{r_ours / r_base:.2f}), PEFT {r_hf:.1f} ({r_ours / r_hf:.2f}x), floor {floor:.1f}, "
                  f"same tokens: {same}", flush=True)
            cases.append(case(
                f"smollm2-135m LoRA decode bs{B} ({B} adapter{'s' if B > 1 else ''} of rank {args.rank}, 7 "
                f"projections) {dname} {args.tokens} tokens", metric="decode throughput", unit="tok/s", ours=r_ours,
                peers={"peft + transformers generate": r_hf}, floor=floor, greedy_tokens_identical=same,
                base_model_tok_s=r_base, ours_over_base_model=r_ours / r_base, adapter_bytes=adapter_bytes,
                weight_bytes=weight_bytes, read_bandwidth_GBps=bw / 1e9, threads=torch.get_num_threads()))
    write_results(args.out, "cpu_lora", "cpu", cases)


if __name__ == "__main__":
    main()
