"""IBM GraniteMoe and GraniteMoeShared (attention-only Granite with Granite's MoE layout, the latter with a shared MLP)
against transformers' GraniteMoeForCausalLM / GraniteMoeSharedForCausalLM on tiny random fp32 configs, through
``save_pretrained`` and ``Engine.from_pretrained`` (dense paged KV): prefill logits, the Engine's batched greedy tokens
through chunked prefill and a prefix-cache hit against ``generate``, and bad configs."""

from __future__ import annotations

import pytest
import torch
from family_harness import check_batched_greedy_and_prefix_hit, random_prompts, save_checkpoints
from hybrid_harness import engine_prefill_logits, hf_logits

from infercore import Engine, SamplingParams
from infercore.models import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, load_model

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, embedding_multiplier=1.2, residual_multiplier=0.8, attention_multiplier=0.6,
              logits_scaling=0.5, rope_parameters={"rope_type": "default", "rope_theta": 500.0}, bos_token_id=1,
              eos_token_id=None, pad_token_id=0)  # fmt: skip
KINDS = {"granitemoe": {}, "granitemoeshared": dict(shared_intermediate_size=40)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KV = dict(device="cpu", dtype=torch.float32, page_size=4, num_pages=64)



def tiny(kind: str):
    import transformers

    cfg_cls, cls = {
        "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
        "granitemoeshared": (transformers.GraniteMoeSharedConfig, transformers.GraniteMoeSharedForCausalLM),
    }[kind]
    cfg = cfg_cls(**COMMON, **KINDS[kind])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "router" in name:
                p.normal_(0.0, 0.5)  # routing that differs from token to token
        hf.lm_head.weight.mul_(4.0)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_checkpoints(tmp_path_factory, KINDS, tiny)


@pytest.mark.parametrize("kind", list(KINDS))
def test_load(kind, checkpoints):
    hf, path = checkpoints[kind]
    model, _, cfg = load_model(path, dtype=torch.float32, device="cpu")
    assert isinstance(model, GraniteMoeHybridForCausalLM) and cfg.model_type == kind and cfg.use_rope
    assert cfg.rope_theta == 500.0 and cfg.layer_types == ["full_attention"] * 2
    assert [type(s).__name__ for s in model.kv_specs()] == ["FullAttentionSpec"] * 2
    assert (model.model.layers[0].shared_mlp is None) == (kind == "granitemoe")


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_logits_match(kind, checkpoints):
    hf, path = checkpoints[kind]
    eng = Engine.from_pretrained(path, enable_prefix_caching=False, **KV)
    assert eng.kv_layout == "dense"
    ps = random_prompts(3, seed=1)
    for p, got in zip(ps, engine_prefill_logits(eng, ps)):
        torch.testing.assert_close(got, hf_logits(hf, p), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_batched_chunked_greedy_and_prefix_hit(kind, checkpoints):
    """Three prompts of different lengths in one batch, prefilled in 11-token chunks beside the others' decodes;
    then the first again, its full pages served from the prefix cache."""
    hf, path = checkpoints[kind]
    check_batched_greedy_and_prefix_hit(hf, path, KV, cached=20, invariants=False)


@pytest.mark.parametrize(
    "kind, changes, key",
    [
        ("granitemoe", dict(num_local_experts=0), "num_local_experts"),
        ("granitemoeshared", dict(shared_intermediate_size=-1), "shared_intermediate_size"),
        ("granitemoe", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
        ("granitemoeshared", dict(num_key_value_heads=0), "num_key_value_heads"),
    ],
)
def test_bad_configs_name_the_key(kind, changes, key):
    hf = {"model_type": kind, **COMMON, **KINDS[kind], **changes}
    with pytest.raises(ValueError, match=key):
        GraniteMoeHybridConfig.from_hf(hf)
