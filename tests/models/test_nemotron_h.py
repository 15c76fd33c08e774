"""NVIDIA Nemotron-H (Mamba2 mixers, NoPE attention, squared-ReLU MLP and MoE layers from ``hybrid_override_pattern``)
against transformers' NemotronHForCausalLM on tiny random fp32 configs, through ``save_pretrained`` and
``Engine.from_pretrained`` (the hybrid KV pool): prefill logits, the Engine's batched greedy tokens through chunked
prefill and a prefix-cache hit against ``generate``, and bad configs."""

from __future__ import annotations

import pytest
import torch
from family_harness import check_batched_greedy_and_prefix_hit, random_prompts, save_checkpoints
from hybrid_harness import engine_prefill_logits, hf_logits

from infercore import Engine, SamplingParams
from infercore.models import NemotronHConfig, NemotronHForCausalLM, load_model

COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
              chunk_size=8, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=None, pad_token_id=0)  # fmt: skip
KINDS = {
    # the checkpoints' pattern form; 2 mixer groups, MLP layers between
    "pattern": dict(hybrid_override_pattern="M-M*-M"),
    # mamba_num_heads * mamba_head_dim != expand * hidden_size (as Nemotron-H-4B), one group; tie_word_embeddings,
    # which transformers ignores
    # Nemotron 3's MoE layers: 8 squared-ReLU experts top-2 in a latent space, 2 groups of which 1 is kept, a scaling
    # factor, the shared MLP
    "moe": dict(hybrid_override_pattern="ME*EM", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=24, moe_latent_size=16, n_group=2, topk_group=1,
                routed_scaling_factor=2.0),
    "wide": dict(hybrid_override_pattern="M*M-", mamba_num_heads=12, n_groups=1, tie_word_embeddings=True),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KV = dict(device="cpu", dtype=torch.float32, page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)



def tiny(kind: str):
    import transformers

    cfg = transformers.NemotronHConfig(**{**COMMON, **KINDS[kind]})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name or name.endswith(".D"):
                p.normal_(1.0, 0.3)
            elif name.endswith("gate.weight"):  # transformers zero-initialises the router
                p.normal_(0.0, 0.5)
            elif ".experts." in name or "latent_proj" in name:
                p.mul_(6.0)  # routed experts whose choice shows in the logits (squared ReLU of small inputs is tiny)
            elif any(k in name for k in ("o_proj", "out_proj", "down_proj")):
                p.mul_(3.0)  # sublayers that move the residual stream: varied continuations
        hf.lm_head.weight.mul_(4.0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_checkpoints(tmp_path_factory, KINDS, tiny)


def test_config_and_load(checkpoints):
    model, _, cfg = load_model(checkpoints["pattern"][1], dtype=torch.float32, device="cpu")
    assert isinstance(model, NemotronHForCausalLM)
    assert cfg.layer_types == ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
                               "linear_attention"]  # fmt: skip
    specs = model.kv_specs()  # none for the MLP layers
    assert [type(s).__name__[0] for s in specs] == ["L", "L", "F", "L"]
    assert model.cache_index == [0, None, 1, 2, None, 3]
    assert (specs[2].num_kv_heads, specs[2].head_dim) == (2, 8)
    hf, path = checkpoints["moe"]
    moe = load_model(path, dtype=torch.float32, device="cpu")[0].backbone.layers[1].mixer
    ref = hf.model.layers[1].mixer
    # one tensor per expert in the checkpoint, stacked here; the router's correction bias came along
    assert torch.equal(moe.experts.up_proj, ref.experts.up_proj) and moe.experts.up_proj.shape == (8, 16, 16)
    assert torch.equal(moe.gate.e_score_correction_bias, ref.gate.e_score_correction_bias)
    # the routed experts (ops.moe_experts_routed, activation "relu2") equal a pair-by-pair computation
    x = torch.randn(5, 16)
    weights, ids = moe.gate(torch.randn(5, 32))
    ex = moe.experts
    want = torch.stack([sum(weights[t, j] * (torch.relu(ex.up_proj[e] @ x[t]).square() @ ex.down_proj[e].t())
                            for j, e in enumerate(ids[t].tolist())) for t in range(5)])  # fmt: skip
    torch.testing.assert_close(ex(x, weights, ids), want, atol=1e-5, rtol=1e-5)
    wide = load_model(checkpoints["wide"][1], dtype=torch.float32, device="cpu")[0]
    assert wide.backbone.layers[0].mixer.inner == 96 and wide.lm_head.weight is not wide.backbone.embeddings.weight
    # the checkpoints' own config form (hybrid_override_pattern + num_hidden_layers, mamba_* aliases)
    own = dict(model_type="nemotron_h", **COMMON, hybrid_override_pattern="M-*", num_hidden_layers=3,
               mamba_d_conv=3)  # fmt: skip
    cfg = NemotronHConfig.from_hf(own)
    assert cfg.layer_types == ["linear_attention", "mlp", "full_attention"] and cfg.conv_kernel == 3


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
    check_batched_greedy_and_prefix_hit(hf, path, KV, cached=16)


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(hybrid_override_pattern="M*E-", n_routed_experts=6, n_group=4), "n_group"),
        (dict(hybrid_override_pattern="M*E-", num_experts_per_tok=9), "top_k"),
        (dict(hybrid_override_pattern="M*E-", moe_latent_size=0), "moe_latent_size"),
        (dict(hybrid_override_pattern="M*x"), "hybrid_override_pattern"),
        (dict(hybrid_override_pattern="M*-", num_hidden_layers=4), "num_hidden_layers"),
        (dict(layers_block_type=["linear_attention", "conv"]), "layers_block_type"),
        (dict(mlp_hidden_act="gelu"), "mlp_hidden_act"),
        (dict(sliding_window=16), "sliding_window"),
        (dict(n_groups=3), "n_groups"),
        (dict(num_key_value_heads=3), "num_kv_heads"),
        (dict(time_step_limit=[0.0]), "time_step_limit"),
        (dict(ssm_state_size=0), "ssm_state_size"),
    ],
)
def test_bad_configs_name_the_key(changes, key):
    hf = {"model_type": "nemotron_h", **COMMON, "hybrid_override_pattern": "M*-"} | changes
    with pytest.raises(ValueError, match=key):
        NemotronHConfig.from_hf(hf)
