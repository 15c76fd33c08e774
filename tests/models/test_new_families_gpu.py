"""The families added in the fifty-fifth session on CUDA: each tiny fp32 test checkpoint of tests/models (DeepSeek
V2 / V3, GPT-OSS, Granite 4.0 hybrid, GraniteMoe, Nemotron-H, Falcon-H1) through ``Engine.from_pretrained`` on the GPU
(Triton kernels, CUDA graphs for the decode steps), a batch of prompts of different lengths: greedy tokens equal
transformers' ``generate`` on the CPU."""

from __future__ import annotations

import importlib

import pytest
import torch
from paged_harness import hf_greedy

from infercore import Engine, SamplingParams

pytestmark = pytest.mark.gpu

# (test module, its tiny-model builder, kinds, Engine sizing)
FAMILIES = [
    ("test_deepseek", "tiny", None, dict(page_size=16, num_pages=64)),
    ("test_gpt_oss", "tiny_gpt_oss", [None], dict(page_size=16, num_pages=64)),
    ("test_granite_hybrid", "tiny", None, dict(page_size=16, kv_cache_bytes=1 << 24)),
    ("test_granitemoe", "tiny", None, dict(page_size=16, num_pages=64)),
    ("test_nemotron_h", "tiny", None, dict(page_size=16, kv_cache_bytes=1 << 24)),
    ("test_falcon_h1", "tiny", None, dict(page_size=16, kv_cache_bytes=1 << 24)),
]
CASES = []
for _mod, _fn, _kinds, _kw in FAMILIES:
    _m = importlib.import_module(_mod)
    for _kind in _kinds if _kinds is not None else list(_m.KINDS):
        CASES.append(pytest.param(_mod, _fn, _kind, _kw, id=f"{_mod[5:]}-{_kind}"))


@pytest.mark.parametrize("mod,fn,kind,kw", CASES)
def test_cuda_greedy_matches_transformers(mod, fn, kind, kw, tmp_path):
    build = getattr(importlib.import_module(mod), fn)
    hf = build() if kind is None else build(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    vocab = hf.config.vocab_size
    prompts = [[(7 * i + 3 * j + 1) % vocab for j in range(n)] for i, n in enumerate((5, 19, 33))]
    eng = Engine.from_pretrained(str(tmp_path), device="cuda", dtype=torch.float32, **kw)
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 8)
