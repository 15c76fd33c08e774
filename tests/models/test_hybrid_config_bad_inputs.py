"""Bad HF config dicts for the hybrid families (Gemma 3, Qwen3-Next, Mamba2, Bamba): each must raise
a ValueError / TypeError naming the key and what was expected -- not a KeyError, a ZeroDivisionError,
a string "false" read as True, or a silently wrong model."""

import pytest

from infercore.models.gemma3 import Gemma3Config
from infercore.models.mamba2 import Mamba2Config
from infercore.models.qwen3_next import Qwen3NextConfig

DROP = object()  # an override that removes the key

# Tiny configs shaped like tests/models/test_gemma3.py, test_qwen3_next.py and test_mamba2.py build.
BASE = {
    "gemma3": (Gemma3Config, {
        "model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 256, "sliding_window": 4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    }),
    "qwen3_next": (Qwen3NextConfig, {
        "model_type": "qwen3_next", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "partial_rotary_factor": 0.5,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    }),
    "mamba2": (Mamba2Config, {
        "model_type": "mamba2", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 3, "num_heads": 8,
        "head_dim": 8, "state_size": 16, "n_groups": 2, "expand": 2, "conv_kernel": 4,
    }),
    "bamba": (Mamba2Config, {
        "model_type": "bamba", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [2],
        "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "max_position_embeddings": 256,
    }),
}  # fmt: skip


def _build(family, **overrides):
    cls, base = BASE[family]
    hf = {**base, **overrides}
    return cls.from_hf({k: v for k, v in hf.items() if v is not DROP})


@pytest.mark.parametrize("family", sorted(BASE))
def test_base_configs_parse(family):
    _build(family)


CASES = [
    # Gemma 3
    ("gemma3", {"hidden_size": DROP}, "missing 'hidden_size'"),
    ("gemma3", {"num_hidden_layers": "4"}, "'num_hidden_layers' must be a positive int"),
    ("gemma3", {"num_hidden_layers": 4.0}, "'num_hidden_layers' must be a positive int"),
    ("gemma3", {"num_attention_heads": -4}, "'num_attention_heads' must be a positive int"),
    ("gemma3", {"layer_types": DROP, "sliding_window_pattern": 0}, "'sliding_window_pattern' must be a positive"),
    ("gemma3", {"head_dim": 0}, "'head_dim' must be a positive int"),  # was silently 256
    ("gemma3", {"num_key_value_heads": 0}, "'num_key_value_heads' must be a positive int"),
    ("gemma3", {"num_key_value_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
    ("gemma3", {"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),
    ("gemma3", {"attention_bias": "false"}, "'attention_bias' must be true or false"),
    ("gemma3", {"rms_norm_eps": "tiny"}, "'rms_norm_eps' must be a positive number"),
    ("gemma3", {"query_pre_attn_scalar": 0}, "'query_pre_attn_scalar' must be a positive number"),
    ("gemma3", {"final_logit_softcapping": "5"}, "'final_logit_softcapping' must be a positive number or null"),
    ("gemma3", {"sliding_window": 0}, "'sliding_window' must be a positive int or null"),
    ("gemma3", {"sliding_window": True}, "'sliding_window' must be a positive int or null"),
    ("gemma3", {"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries, expected num_layers=4"),
    ("gemma3", {"layer_types": ["sliding_attention"] * 3 + ["global"]}, r"layer_types\[3\]='global'"),
    ("gemma3", {"layer_types": "full_attention"}, "'layer_types' must be a list"),
    ("gemma3", {"rope_parameters": "linear"}, "'rope_parameters' must be an object"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_theta": "1e6"}}}, "full_attention.rope_theta"),
    ("gemma3", {"eos_token_id": "1"}, "'eos_token_id' must be a token id"),
    # Qwen3-Next
    ("qwen3_next", {"num_hidden_layers": DROP}, "missing 'num_hidden_layers'"),
    ("qwen3_next", {"vocab_size": DROP}, "missing 'vocab_size'"),
    ("qwen3_next", {"num_hidden_layers": 4.0}, "'num_hidden_layers' must be a positive int"),
    ("qwen3_next", {"layer_types": DROP, "full_attention_interval": 0}, "'full_attention_interval' must be a posi"),
    ("qwen3_next", {"layer_types": ["linear_attention"] * 3}, "layer_types must be 4 of linear/full_attention"),
    ("qwen3_next", {"layer_types": ["linear_attention"] * 3 + ["mamba"]}, "layer_types must be 4 of"),
    ("qwen3_next", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    ("qwen3_next", {"num_experts_per_tok": 0}, "'num_experts_per_tok' must be a positive int"),
    ("qwen3_next", {"num_experts": -1}, "'num_experts' must be an int >= 0"),
    ("qwen3_next", {"num_experts": "8"}, "'num_experts' must be an int >= 0"),
    ("qwen3_next", {"decoder_sparse_step": 0}, "'decoder_sparse_step' must be a positive int"),
    ("qwen3_next", {"moe_intermediate_size": 0}, "'moe_intermediate_size' must be a positive int"),
    ("qwen3_next", {"linear_conv_kernel_dim": 2.0}, "'linear_conv_kernel_dim' must be a positive int"),
    ("qwen3_next", {"linear_num_key_heads": 3}, "linear_num_key_heads=3 must divide linear_num_value_heads=4"),
    ("qwen3_next", {"norm_topk_prob": "false"}, "'norm_topk_prob' must be true or false"),
    ("qwen3_next", {"tie_word_embeddings": "no"}, "'tie_word_embeddings' must be true or false"),
    ("qwen3_next", {"head_dim": DROP, "num_attention_heads": 3, "num_key_value_heads": 1}, "not divisible"),
    ("qwen3_next", {"mlp_only_layers": [7]}, r"'mlp_only_layers' must be a list of layer indices in \[0, 4\)"),
    ("qwen3_next", {"mlp_only_layers": "1"}, "'mlp_only_layers' must be a list"),
    ("qwen3_next", {"partial_rotary_factor": 2.0}, r"'partial_rotary_factor' must be a number in \(0, 1\]"),
    ("qwen3_next", {"rope_parameters": "default"}, "'rope_parameters' must be an object"),
    ("qwen3_next", {"rms_norm_eps": 0}, "'rms_norm_eps' must be a positive number"),
    # Mamba2
    ("mamba2", {"state_size": DROP}, "missing 'state_size'"),
    ("mamba2", {"num_heads": "8"}, "'num_heads' must be a positive int"),
    ("mamba2", {"expand": 2.0}, "'expand' must be a positive int"),  # was silently int(2.0 * hidden)
    ("mamba2", {"conv_kernel": 0}, "'conv_kernel' must be a positive int"),
    ("mamba2", {"state_size": -16}, "'state_size' must be a positive int"),
    ("mamba2", {"n_groups": 3}, "n_groups=3 must divide mamba_heads=8"),
    ("mamba2", {"head_dim": 4}, "mamba_heads \\* mamba_head_dim must equal expand \\* hidden_size"),
    ("mamba2", {"use_conv_bias": "false"}, "'use_conv_bias' must be true or false"),
    ("mamba2", {"residual_in_fp32": 1}, "'residual_in_fp32' must be true or false"),
    ("mamba2", {"time_step_limit": "0,inf"}, "'time_step_limit' must be a \\[min, max\\] pair"),
    ("mamba2", {"time_step_limit": [0.0]}, "'time_step_limit' must be a \\[min, max\\] pair"),
    ("mamba2", {"time_step_limit": [1.0, 0.5]}, "'time_step_limit' must be a \\[min, max\\] pair"),
    ("mamba2", {"layer_norm_epsilon": "1e-5"}, "'layer_norm_epsilon' must be a positive number"),
    # Bamba
    ("bamba", {"intermediate_size": DROP}, "missing 'intermediate_size'"),
    ("bamba", {"num_hidden_layers": 4.5}, "'num_hidden_layers' must be a positive int"),
    ("bamba", {"attn_layer_indices": [7]}, r"'attn_layer_indices' must be a list of layer indices in \[0, 4\)"),
    ("bamba", {"attn_layer_indices": "2"}, "'attn_layer_indices' must be a list"),
    ("bamba", {"num_attention_heads": 3, "num_key_value_heads": 1}, "hidden_size=32 is not divisible"),
    ("bamba", {"num_key_value_heads": 0}, "'num_key_value_heads' must be a positive int"),
    ("bamba", {"num_key_value_heads": 3}, "num_kv_heads=3 to divide num_heads=4"),
    ("bamba", {"mamba_expand": 2.0}, "'mamba_expand' must be a positive int"),
    ("bamba", {"mamba_d_conv": 0}, "'mamba_d_conv' must be a positive int"),
    ("bamba", {"mamba_conv_bias": "true"}, "'mamba_conv_bias' must be true or false"),
    ("bamba", {"partial_rotary_factor": 0}, "'partial_rotary_factor' must be a positive number"),
    ("bamba", {"partial_rotary_factor": 1.5}, r"'partial_rotary_factor' must be a number in \(0, 1\]"),
    ("bamba", {"partial_rotary_factor": 0.125}, "partial_rotary_factor=0.125 gives rotary_dim 1 for head_dim=8"),
    ("bamba", {"rope_parameters": {"rope_theta": "1e4"}}, "'rope_theta' must be a positive number"),
]


@pytest.mark.parametrize(("family", "overrides", "match"), CASES, ids=[f"{c[0]}-{next(iter(c[1]))}" for c in CASES])
def test_bad_hf_config_names_the_key(family, overrides, match):
    with pytest.raises(ValueError, match=match):
        _build(family, **overrides)


@pytest.mark.parametrize("family", sorted(BASE))
def test_not_a_mapping(family):
    with pytest.raises(TypeError, match="hf config must be a mapping"):
        BASE[family][0].from_hf([("model_type", family)])


def test_gemma3_text_config_must_be_an_object():
    with pytest.raises(ValueError, match="'text_config' must be an object"):
        Gemma3Config.from_hf({"model_type": "gemma3", "text_config": "x"})


def test_bools_and_defaults_still_read():
    # Real booleans and absent optional keys keep their HF meaning.
    assert _build("gemma3", tie_word_embeddings=False).tie_word_embeddings is False
    assert _build("gemma3", tie_word_embeddings=DROP).tie_word_embeddings is True
    assert _build("qwen3_next", norm_topk_prob=False).norm_topk_prob is False
    assert _build("qwen3_next", num_experts=0).is_moe_layer(0) is False
    assert _build("qwen3_next", shared_expert_intermediate_size=0).shared_expert_intermediate_size == 0
    assert _build("mamba2", use_conv_bias=False, time_step_limit=[0.0, float("inf")]).use_conv_bias is False
    assert _build("bamba").layer_types[2] == "full_attention"
    assert _build("gemma3", layer_types=DROP, sliding_window_pattern=2).layer_types[:2] == [
        "sliding_attention",
        "full_attention",
    ]
