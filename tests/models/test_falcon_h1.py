"""TII Falcon-H1 (attention and a Mamba2 mixer side by side in each layer, muP multipliers) against transformers'
FalconH1ForCausalLM on tiny random fp32 configs, through ``save_pretrained`` and ``Engine.from_pretrained`` (the hybrid
KV pool, two KV specs per layer): prefill logits, the Engine's batched greedy tokens through chunked prefill and a
prefix-cache hit against ``generate``, and bad configs."""

from __future__ import annotations

import pytest
import torch
from family_harness import check_batched_greedy_and_prefix_hit, random_prompts, save_checkpoints
from hybrid_harness import engine_prefill_logits, hf_logits

from infercore import Engine, SamplingParams
from infercore.models import FalconH1Config, FalconH1ForCausalLM, load_model

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, mamba_n_heads=8, mamba_d_head=8, mamba_d_ssm=64, mamba_d_state=16,
              mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, max_position_embeddings=256, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, bos_token_id=1, eos_token_id=None,
              pad_token_id=0)  # fmt: skip
MUP = dict(embedding_multiplier=1.5, lm_head_multiplier=0.7, key_multiplier=0.8, attention_in_multiplier=1.3,
           attention_out_multiplier=0.9, ssm_in_multiplier=1.2, ssm_out_multiplier=0.6,
           ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7], mlp_multipliers=[1.4, 0.8])  # fmt: skip
KINDS = {
    # every multiplier off 1, the gated norm after the gate; mamba_d_ssm wider than expand * hidden_size
    "mup_norm": dict(MUP, mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_d_ssm=96, mamba_n_heads=12),
    # the defaults (no gated norm: y * silu(z)), projector and mixer biases, one group
    "plain": dict(projectors_bias=True, mamba_proj_bias=True, mamba_n_groups=1),
    # the gated norm before the gate, tied embeddings
    "norm_before_gate": dict(MUP, mamba_rms_norm=True, mamba_norm_before_gate=True, tie_word_embeddings=True),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KV = dict(device="cpu", dtype=torch.float32, page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)



def tiny(kind: str):
    import transformers

    cfg = transformers.FalconH1Config(**{**COMMON, **KINDS[kind]})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.FalconH1ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name or name.endswith(".D"):
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.01)
            elif any(k in name for k in ("o_proj", "out_proj", "down_proj")):
                p.mul_(3.0)  # sublayers that move the residual stream: varied continuations
        if not cfg.tie_word_embeddings:
            hf.lm_head.weight.mul_(4.0)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_checkpoints(tmp_path_factory, KINDS, tiny)


def test_config_and_load(checkpoints):
    model, _, cfg = load_model(checkpoints["mup_norm"][1], dtype=torch.float32, device="cpu")
    assert isinstance(model, FalconH1ForCausalLM) and cfg.ssm_multipliers == (0.9, 1.1, 0.8, 1.2, 0.7)
    assert [type(s).__name__[0] for s in model.kv_specs()] == ["F", "F", "L", "L"]
    mixer = model.model.layers[0].mamba
    assert mixer.inner == 96 and mixer.norm is not None
    assert mixer.segment_scale[0] == 0.9 and mixer.segment_scale[-1] == 0.7
    plain = load_model(checkpoints["plain"][1], dtype=torch.float32, device="cpu")[0]
    assert plain.model.layers[0].mamba.norm is None and plain.model.layers[0].mamba.segment_scale is None
    tied = load_model(checkpoints["norm_before_gate"][1], dtype=torch.float32, device="cpu")[0]
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_logits_match(kind, checkpoints):
    hf, path = checkpoints[kind]
    eng = Engine.from_pretrained(path, enable_prefix_caching=False, **KV)
    assert eng.kv_layout == "multi"
    ps = random_prompts(3, seed=1)
    for p, got in zip(ps, engine_prefill_logits(eng, ps)):
        torch.testing.assert_close(got, hf_logits(hf, p), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mup_norm", "plain"])
def test_batched_chunked_greedy_and_prefix_hit(kind, checkpoints):
    """Three prompts of different lengths in one batch, prefilled in 11-token chunks beside the others' decodes;
    then the first again, resumed from the prefix cache's state checkpoint after 16 tokens."""
    hf, path = checkpoints[kind]
    check_batched_greedy_and_prefix_hit(hf, path, KV, cached=16)


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(ssm_multipliers=[1.0, 1.0]), "ssm_multipliers"),
        (dict(mlp_multipliers=[1.0, float("nan")]), "mlp_multipliers"),
        (dict(key_multiplier="1"), "key_multiplier"),
        (dict(mamba_n_heads=5), "mamba_n_heads"),
        (dict(mamba_d_head=4), "mamba_d_head"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(mamba_n_groups=3), "n_groups"),
        (dict(num_key_value_heads=3), "num_kv_heads"),
        (dict(mamba_rms_norm="yes"), "mamba_rms_norm"),
    ],
)
def test_bad_configs_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key):
        FalconH1Config.from_hf({"model_type": "falcon_h1", **COMMON} | changes)
