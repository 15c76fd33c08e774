"""Mamba2 (pure, vs transformers' Mamba2ForCausalLM) and the Mamba2 + attention hybrid (vs
BambaForCausalLM), through the engine's hybrid KV manager."""

import random

import pytest
import torch
from hybrid_harness import engine_prefill_logits, hf_greedy, hf_logits

from infercore import Engine, SamplingParams
from infercore.models import Mamba2Config, build_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
KV = dict(page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)


def _prompts(n, seed, lo=5, hi=30, vocab=96):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf(kind):
    import transformers

    if kind == "mamba2":
        cfg = transformers.Mamba2Config(
            vocab_size=96, hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8, state_size=16,
            n_groups=2, expand=2, conv_kernel=4, chunk_size=8, tie_word_embeddings=False,
        )  # fmt: skip
        cls = transformers.Mamba2ForCausalLM
    else:
        cfg = transformers.BambaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=256,
        )  # fmt: skip
        cls = transformers.BambaForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name or name.endswith(".D"):
                p.normal_(1.0, 0.3)
        hf.lm_head.weight.mul_(4.0)
    return hf


@pytest.fixture(scope="module", params=["mamba2", "bamba"])
def pair(request):
    hf = _hf(request.param)
    ours = build_model(Mamba2Config.from_hf(hf.config.to_dict()), dtype=torch.float32, device="cpu", init="empty")
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def test_config_kinds(pair):
    _, ours = pair
    specs = ours.kv_specs()
    kinds = [type(s).__name__ for s in specs]
    if ours.config.model_type == "bamba":
        assert kinds == ["LinearStateSpec", "LinearStateSpec", "FullAttentionSpec", "LinearStateSpec"]
    else:
        assert set(kinds) == {"LinearStateSpec"}
    with pytest.raises(ValueError, match="model_type"):
        Mamba2Config.from_hf({"model_type": "mamba"})


def test_prefill_logits_match(pair):
    hf, ours = pair
    ps = _prompts(3, seed=1)
    eng = Engine(ours, enable_prefix_caching=False, **KV)
    for p, got in zip(ps, engine_prefill_logits(eng, ps)):
        torch.testing.assert_close(got, hf_logits(hf, p), atol=2e-4, rtol=1e-4)


def test_batched_chunked_greedy_and_prefix_hit(pair):
    hf, ours = pair
    ps = _prompts(3, seed=2, lo=18, hi=28)
    eng = Engine(ours, max_num_batched_tokens=11, **KV)
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 32)
    # The same prompt again: served from the checkpoint after 16 tokens, identical continuation.
    again = eng.generate([ps[0]], GREEDY)[0]
    assert again.metrics.num_cached_tokens == 16
    assert again.token_ids == outs[0].token_ids
    eng.block_manager.check_invariants()
