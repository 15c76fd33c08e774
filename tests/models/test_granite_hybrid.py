"""IBM Granite 4.0 hybrid (Mamba2 mixers + attention, MoE + shared MLP, Granite's multipliers) against transformers'
GraniteMoeHybridForCausalLM on tiny random fp32 configs, through ``save_pretrained`` and ``Engine.from_pretrained``
(the hybrid KV pool: conv / SSM state slots and paged KV): prefill logits, the Engine's batched greedy tokens through
chunked prefill and a prefix-cache hit against ``generate``, and bad configs."""

from __future__ import annotations

import pytest
import torch
from family_harness import check_batched_greedy_and_prefix_hit, random_prompts, save_checkpoints
from hybrid_harness import engine_prefill_logits, hf_greedy, hf_logits

from infercore import Engine, SamplingParams
from infercore.models import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, config_from_hf, load_model
from infercore.models.moe import SparseMoeBlock

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=24, shared_intermediate_size=40, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=256, rms_norm_eps=1e-5,
              embedding_multiplier=1.2, residual_multiplier=0.8, attention_multiplier=0.6, logits_scaling=0.5,
              bos_token_id=1, eos_token_id=None, pad_token_id=0)  # fmt: skip
KINDS = {
    # 4 experts top-2 plus the shared MLP, RoPE, two mixer groups; Granite 4.0's layer names
    "moe_rope": dict(layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4,
                     num_experts_per_tok=2, position_embedding_type="rope", mamba_n_groups=2),
    # Granite 4.0's dense form (no experts: the shared MLP alone), NoPE attention, tied embeddings
    "dense_nope": dict(layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0,
                       position_embedding_type="nope", tie_word_embeddings=True),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KV = dict(device="cpu", dtype=torch.float32, page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)



def tiny(kind: str):
    import transformers

    cfg = transformers.GraniteMoeHybridConfig(**COMMON, **KINDS[kind])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name or name.endswith(".D"):
                p.normal_(1.0, 0.3)
            elif "router" in name:
                p.normal_(0.0, 0.5)  # routing that differs from token to token
            elif any(k in name for k in ("self_attn", "out_proj", "experts", "shared_mlp")):
                p.mul_(3.0)  # sublayers that move the residual stream: varied continuations, not one repeated token
                if cfg.tie_word_embeddings and any(k in name for k in ("o_proj", "out_proj", "output_linear")):
                    p.mul_(4.0)  # tied: else the logits echo the embedding of the last token
        if not cfg.tie_word_embeddings:
            hf.lm_head.weight.mul_(4.0)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_checkpoints(tmp_path_factory, KINDS, tiny)


def test_config_and_load(checkpoints):
    hf, path = checkpoints["moe_rope"]
    model, _, cfg = load_model(path, dtype=torch.float32, device="cpu")
    assert isinstance(model, GraniteMoeHybridForCausalLM) and cfg.model_type == "granitemoehybrid"
    assert [type(s).__name__ for s in model.kv_specs()] == ["LinearStateSpec", "FullAttentionSpec",
                                                             "LinearStateSpec", "LinearStateSpec"]  # fmt: skip
    layer = model.model.layers[0]
    assert isinstance(layer.block_sparse_moe, SparseMoeBlock) and layer.shared_mlp is not None
    # Granite's fused [E, 2I, H] expert tensor landed as saved (gate rows first)
    saved = hf.model.layers[0].block_sparse_moe.experts.gate_up_proj
    assert torch.equal(layer.block_sparse_moe.experts.gate_up_proj, saved)
    dense = load_model(checkpoints["dense_nope"][1], dtype=torch.float32, device="cpu")[0]
    assert all(layer.block_sparse_moe is None for layer in dense.model.layers)
    assert dense.lm_head.weight is dense.model.embed_tokens.weight and not dense.config.use_rope
    # Granite 4.0 checkpoints' own layer names map as transformers' do
    hf_cfg = {**hf.config.to_dict(), "layer_types": ["mamba", "attention", "mamba", "mamba"]}
    assert config_from_hf(hf_cfg).layer_types == cfg.layer_types
    # a dense checkpoint's expert keys are not read (Granite 4.0 dense configs carry zeros there)
    dense_cfg = {**hf_cfg, "num_local_experts": 0, "num_experts_per_tok": 0, "intermediate_size": 0}
    assert config_from_hf(dense_cfg).num_experts == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_logits_match(kind, checkpoints):
    hf, path = checkpoints[kind]
    eng = Engine.from_pretrained(path, enable_prefix_caching=False, **KV)
    assert eng.kv_layout == "multi"
    ps = random_prompts(3, seed=1)
    for p, got in zip(ps, engine_prefill_logits(eng, ps)):
        torch.testing.assert_close(got, hf_logits(hf, p), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_batched_chunked_greedy_and_prefix_hit(kind, checkpoints):
    """Three prompts of different lengths in one batch, prefilled in 11-token chunks beside the others' decodes;
    then the first again, resumed from the prefix cache's state checkpoint after 16 tokens."""
    hf, path = checkpoints[kind]
    check_batched_greedy_and_prefix_hit(hf, path, KV, cached=16, varied=False)


def test_host_experts_give_the_same_tokens(checkpoints):
    """``host_experts=True``: the routed experts found and run by the expert offload (the shared MLP stays)."""
    hf, path = checkpoints["moe_rope"]
    eng = Engine.from_pretrained(path, host_experts=True, **KV)
    assert sorted(eng.model.host_experts) == [0, 1, 2, 3]
    ps = random_prompts(2, seed=4, lo=6, hi=20)
    for p, o in zip(ps, eng.generate(ps, GREEDY)):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)


def _hf_dict(**changes):
    d = {"model_type": "granitemoehybrid", **COMMON, **KINDS["moe_rope"], **changes}
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(layer_types=["mamba", "attention", "mamba"]), "layer_types"),
        (dict(layer_types=["mamba", "attention", "mlp", "mamba"]), "layer_types"),
        (dict(num_local_experts=-1), "num_local_experts"),
        (dict(num_local_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
        (dict(shared_intermediate_size=0), "shared_intermediate_size"),
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters"),
        (dict(embedding_multiplier="2"), "embedding_multiplier"),
        (dict(logits_scaling=0), "logits_scaling"),
        (dict(mamba_n_heads=5, mamba_d_head="auto"), "mamba_n_heads"),
        (dict(mamba_d_head=4), "mamba_d_head"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(num_attention_heads=5), "num_attention_heads"),
        (dict(time_step_limit=[1.0, 0.5]), "time_step_limit"),
        (dict(vocab_size=None), "vocab_size"),
    ],
)
def test_bad_configs_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key):
        GraniteMoeHybridConfig.from_hf(_hf_dict(**changes))


def test_bad_direct_configs():
    cfg = GraniteMoeHybridConfig.from_hf(_hf_dict())
    kw = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    for field, value in (("top_k", 5), ("residual_multiplier", float("nan")), ("num_experts", -2)):
        with pytest.raises(ValueError, match=field):
            GraniteMoeHybridConfig(**{**kw, field: value})
    with pytest.raises(ValueError, match="no MLP"):
        GraniteMoeHybridConfig(**{**kw, "num_experts": 0, "shared_intermediate_size": 0})
    with pytest.raises(ValueError, match="model_type"):
        GraniteMoeHybridConfig.from_hf({"model_type": "granite"})
