"""The Engine with a quantized KV cache (EngineConfig.kv_cache_dtype)."""

import pytest
import torch

from infercore import Engine, SamplingParams
from infercore.kv import QuantizedKVCache

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (int(L),), generator=g).tolist() for L in torch.randint(5, 30, (n,), generator=g)]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_engine_runs_and_stays_close(llama_pair, kv_dtype):
    _, model = llama_pair
    ps = _prompts()
    ref = Engine(model, page_size=4, num_pages=256).generate(ps, GREEDY)
    eng = Engine(model, page_size=4, num_pages=256, kv_cache_dtype=kv_dtype)
    assert all(isinstance(c, QuantizedKVCache) for c in eng.runner.kv_caches)
    out = eng.generate(ps, GREEDY)
    assert [len(o.token_ids) for o in out] == [24] * len(ps)
    # A random tiny model has near-tied logits, so late flips happen; most tokens must agree
    # (int8 with per-token scales flips few; e4m3's 3-bit mantissa more).
    agree = sum(a == b for o, r in zip(out, ref) for a, b in zip(o.token_ids, r.token_ids))
    assert agree >= (0.75 if kv_dtype == "int8" else 0.5) * 24 * len(ps)
    assert eng.block_manager.num_free_pages == eng.block_manager.num_pages


def test_quantized_kv_budget_holds_more_pages(llama_pair):
    _, model = llama_pair
    budget = 1 << 20
    dense = Engine(model, page_size=4, kv_cache_bytes=budget)
    q8 = Engine(model, page_size=4, kv_cache_bytes=budget, kv_cache_dtype="int8")
    # fp32 model: 4 bytes per element vs 1 byte + a 4-byte scale per (token, head) of D=8 elements.
    assert q8.block_manager.num_pages > 2 * dense.block_manager.num_pages


def test_kv_cache_dtype_bad_value():
    from infercore.engine import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8", kv_layout="multi").validate()
