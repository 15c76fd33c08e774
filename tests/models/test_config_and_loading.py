"""ModelConfig parsing, build_model validation and load_weights error handling."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, tiny_hf_config, tiny_hf_model

from infercore.kv import FullAttentionSpec
from infercore.models import (
    LlamaForCausalLM,
    MistralForCausalLM,
    ModelConfig,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    build_model,
    load_model,
)


def _hf_dict(kind: str, **overrides) -> dict:
    return tiny_hf_config(kind, **overrides).to_dict()


# ----------------------------------------------------------------------------------- from_hf
def test_from_hf_llama_fields():
    cfg = ModelConfig.from_hf(
        _hf_dict("llama", tie_word_embeddings=True, rope_theta=123.0, eos_token_id=[2, 7])
    )
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (300, 64, 128)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 123.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1
    assert not (cfg.attention_bias or cfg.o_bias or cfg.qk_norm)
    assert cfg.layer_types == ["full_attention"] * 2 and cfg.architecture == "LlamaForCausalLM"


def test_from_hf_family_quirks():
    qwen2 = ModelConfig.from_hf(_hf_dict("qwen2"))
    assert qwen2.attention_bias and not qwen2.o_bias and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_hf(_hf_dict("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.num_heads * qwen3.head_dim != qwen3.hidden_size
    mistral = ModelConfig.from_hf(_hf_dict("mistral", sliding_window=8))
    assert mistral.layer_types == ["sliding_attention"] * 2 and mistral.sliding_window == 8
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [8, 8]
    # Mistral v0.2+ ships "sliding_window": null -> no window at all.
    assert ModelConfig.from_hf(_hf_dict("mistral", sliding_window=None)).sliding_window is None


def test_from_hf_qwen2_window_layers():
    d = _hf_dict(
        "qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    cfg = ModelConfig.from_hf(d)
    assert [cfg.layer_sliding_window(i) for i in range(4)] == [None, None, 16, 16]
    d = _hf_dict("qwen2", use_sliding_window=False, sliding_window=16)
    assert ModelConfig.from_hf(d).sliding_window is None


def test_from_hf_legacy_rope_keys():
    """transformers 4.x layout: top-level rope_theta and rope_scaling with legacy "type"."""
    d = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 5e5,
        "max_position_embeddings": 64,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4
    d["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    assert ModelConfig.from_hf(d).rope_scaling["original_max_position_embeddings"] == 64


def test_from_hf_errors():
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf({**_hf_dict("llama"), "model_type": "gpt2"})
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig.from_hf({**_hf_dict("llama"), "hidden_size": 66, "head_dim": None})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf({**_hf_dict("llama"), "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_hf({k: v for k, v in _hf_dict("llama").items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf({**_hf_dict("llama"), "hidden_act": "relu"})
    with pytest.raises(TypeError):
        ModelConfig.from_hf("llama")


# ----------------------------------------------------------------------------------- build_model
@pytest.mark.parametrize(
    "kind,cls",
    [
        ("llama", LlamaForCausalLM),
        ("mistral", MistralForCausalLM),
        ("qwen2", Qwen2ForCausalLM),
        ("qwen3", Qwen3ForCausalLM),
    ],
)
def test_build_model_registry_and_kv_specs(kind, cls):
    cfg = ModelConfig.from_hf(_hf_dict(kind))
    model = build_model(cfg, dtype=torch.bfloat16, device="cpu")
    assert type(model) is cls and not model.training
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.cos_sin_cache.dtype == torch.float32
    window = 8 if kind == "mistral" else None
    assert (
        model.kv_specs()
        == [
            FullAttentionSpec(
                num_kv_heads=2, head_dim=cfg.head_dim, dtype=torch.bfloat16, sliding_window=window
            )
        ]
        * 2
    )
    # "normal" init gives finite, non-trivial weights usable for speed runs.
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.isfinite(w).all() and w.float().std() > 0.01


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "float32", None])
def test_build_model_rejects_dtype(dtype):
    cfg = ModelConfig.from_hf(_hf_dict("llama"))
    with pytest.raises(TypeError, match="dtype"):
        build_model(cfg, dtype=dtype, device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        load_model("/nonexistent", dtype=dtype, device="cpu")


def test_tied_embedding_shares_storage():
    cfg = ModelConfig.from_hf(_hf_dict("llama", tie_word_embeddings=True))
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bf16_model_tracks_fp32():
    """Low precision runs end to end through the same ops and stays close to fp32."""
    hf = tiny_hf_model("qwen3")
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(cfg, dtype=dtype, device="cpu", init="empty")
        model.load_weights(hf.state_dict().items())
        logits[dtype] = PagedRunner(model).step([(0, list(range(1, 20)))])
    assert logits[torch.bfloat16].dtype == torch.float32
    err = (logits[torch.bfloat16] - logits[torch.float32]).abs().max()
    assert err < 0.05 * logits[torch.float32].abs().max()


# ----------------------------------------------------------------------------------- load_weights
def _fresh(kind="qwen2"):
    hf = tiny_hf_model(kind)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    return hf, build_model(cfg, dtype=torch.float32, device="cpu", init="empty")


def test_load_weights_stacks_projections():
    hf, model = _fresh("qwen2")
    model.load_weights(hf.state_dict().items())
    attn, hf_attn = model.model.layers[1].self_attn, hf.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(q, hf_attn.q_proj.weight) and torch.equal(v, hf_attn.v_proj.weight)
    assert torch.equal(attn.qkv_proj.bias[attn.q_size : attn.q_size + attn.kv_size], hf_attn.k_proj.bias)
    up = model.model.layers[1].mlp.gate_up_proj.weight[hf.config.intermediate_size :]
    assert torch.equal(up, hf.model.layers[1].mlp.up_proj.weight)


def test_load_weights_errors():
    hf, model = _fresh("qwen2")
    sd = dict(hf.state_dict())
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.bias"):
        model.load_weights([*sd.items(), ("model.layers.0.self_attn.o_proj.bias", torch.zeros(64))])
    bad = dict(sd)
    bad["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj.weight.*\(64, 64\).*\(32, 64\)"):
        model.load_weights(bad.items())
    missing = {k: v for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        model.load_weights(missing.items())
    with pytest.raises(ValueError, match="given twice"):
        model.load_weights([*sd.items(), ("model.norm.weight", sd["model.norm.weight"])])


def test_load_weights_tied_ignores_lm_head_and_inv_freq():
    hf = tiny_hf_model("llama", tie_word_embeddings=True)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = build_model(cfg, dtype=torch.float32, device="cpu", init="empty")
    items = [*hf.state_dict().items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))]
    model.load_weights(items)
    assert torch.equal(model.lm_head.weight, hf.model.embed_tokens.weight)
