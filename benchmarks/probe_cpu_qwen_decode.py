"""CPU decode of random-weight Qwen3-0.6B- and Qwen2.5-0.5B-shaped models (Qwen3: 28 layers, 1024 wide, 16 / 8
heads of 128, per-head q / k RMSNorms; Qwen2.5: 24 layers, 896 wide, 14 / 2 heads of 64, a qkv bias), bf16 and INT4
(w4a16-g128), batch 1: the fused decoder layers, which take Qwen3's q / k norms and Qwen2's qkv bias since the
forty-first session (every layer in one native call), against the op-by-op path these models took before
(``cpu_native.fused_layers_disabled``). A ``--prompt``-token prompt, ``--new`` greedy tokens, interleaved rounds, best
of ``--rounds``.

    python benchmarks/probe_cpu_qwen_decode.py [--out benchmarks/results/cpu/sweeps/cpu_qwen_decode.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, engine_decode_rate, write_results  # noqa: E402

from infercore import Engine  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402
from infercore.quant import quantize  # noqa: E402

QWEN3_0_6B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
QWEN2_5_0_5B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                    rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
MODELS = {"qwen3-0.6b-shape": QWEN3_0_6B, "qwen2.5-0.5b-shape": QWEN2_5_0_5B}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_qwen_decode.json")
    args = ap.parse_args()
    prompt = [(7 * i + 3) % 150000 for i in range(args.prompt)]
    cases = []
    for (name, cfg), scheme in itertools.product(MODELS.items(), (None, "w4a16-g128")):
        torch.manual_seed(0)
        model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device="cpu")
        if cfg["model_type"] == "qwen2":  # random qkv biases (build_model zeroes them)
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.qkv_proj.bias.normal_(0.0, 0.02)
        if scheme:
            quantize(model, scheme)
        eng = Engine(model, enable_prefix_caching=False)

        def rate(fused: bool, eng=eng) -> tuple[float, list[int]]:
            with contextlib.nullcontext() if fused else cpu_native.fused_layers_disabled():
                return engine_decode_rate(eng, prompt, args.new)

        rate(True)
        best = {True: 0.0, False: 0.0}
        toks = {}
        for _ in range(args.rounds):
            for fused in (True, False):
                r, toks[fused] = rate(fused)
                best[fused] = max(best[fused], r)
        agree = sum(a == b for a, b in zip(toks[True], toks[False]))
        label = f"{name} random {scheme or 'bf16'}"
        print(f"{label}: fused {best[True]:.1f} tok/s, op by op {best[False]:.1f}; tokens equal {agree}/{args.new}",
              flush=True)
        cases.append(case(f"{label} decode bs1, prompt {args.prompt}, {args.new} tokens",
                          metric="decode throughput", unit="tok/s", ours=best[True],
                          peers={"op by op (before: the q / k norms or the qkv bias kept it off the fused layers)":
                                 best[False]},
                          floor=None, greedy_tokens_equal=f"{agree}/{args.new}", threads=torch.get_num_threads()))
    write_results(args.out, "probe_cpu_qwen_decode", "cpu", cases,
                  {"note": "Decode rate = (new - 1) / (time of prompt + new tokens - time of prompt + 1 token)."})


if __name__ == "__main__":
    main()
