"""DeepSeek-V2-Lite / V2 / V3 (multi-head latent attention over a paged latent cache, DeepSeekMoE) against
transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM on tiny random fp32 configs, through ``save_pretrained``
and ``load_model`` / ``Engine.from_pretrained``: prefill and decode logits, the routers' choices, the Engine's greedy
tokens (chunked prefill, a prefix-cache hit) against ``generate``, the one-tensor latent cache, and bad configs."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, hf_greedy, hf_logits

from infercore.engine import Engine, SamplingParams
from infercore.kv import CPUKVTier, FullAttentionSpec, allocate_kv_caches, bytes_per_page
from infercore.models import DeepseekConfig, DeepseekForCausalLM, config_from_hf, load_model
from infercore.models.deepseek import DeepseekMoE
from infercore.models.moe import GatedMLP

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=None, pad_token_id=0)  # fmt: skip
# mscale != mscale_all_dim: YaRN's attention factor (in the cos/sin table) and the softmax scale's mscale ** 2 both
# differ from 1
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.8}  # fmt: skip
KINDS = {
    # no q compression, softmax + greedy routing, every layer routed
    "v2_lite": ("v2", dict(q_lora_rank=None, topk_method="greedy", first_k_dense_replace=0)),
    # q_lora, softmax + group-limited greedy (3 experts from 2 of 4 groups: the limit is no-op when top_k <=
    # topk_group), a scaling factor, biases on q_a / kv_a / o
    "v2": ("v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                      num_experts_per_tok=3, routed_scaling_factor=1.5, first_k_dense_replace=1, attention_bias=True)),
    # sigmoid + correction bias (noaux_tc), renormalised, YaRN, one dense layer; interleaved rope (the default)
    "v3": ("v3", dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1, rope_parameters=dict(YARN))),
    # the same with rope over the halves (rope_interleave false)
    "v3_halves": ("v3", dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1, rope_interleave=False,
                             rope_parameters=dict(YARN))),
}
PROMPTS = [
    [1, 17, 42, 99, 5, 230, 7, 64, 12, 150, 33, 8, 71, 200, 3, 91, 45, 18, 260],
    [1, 250, 4, 4, 19],
    [1, 88, 120, 7, 56, 290, 14, 3, 77, 101, 9, 66, 240, 31, 2, 180, 55, 123, 19, 6, 44, 210],
]


def tiny(kind: str, *, seed: int = 0):
    """A tiny random transformers DeepSeek model with randomised norms, biases and V3 correction biases."""
    import transformers as tf

    version, extra = KINDS[kind]
    cfg_cls, cls = ((tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM) if version == "v2"
                    else (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM))
    cfg = cfg_cls(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros in a fresh model: would test nothing
                b.copy_(torch.randn_like(b) * 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for kind in KINDS:
        hf = tiny(kind)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path, safe_serialization=True)
        out[kind] = hf, path
    return out


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    err = (ours - ref).abs().max().item()
    assert err < rel * ref.abs().max().item(), f"max abs error {err} vs max |logit| {ref.abs().max().item()}"


# ------------------------------------------------------------------------------------------ logits
@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_and_decode_logits_match_hf(kind, checkpoints):
    hf, path = checkpoints[kind]
    model, _, config = load_model(path, dtype=torch.float32, device="cpu")
    assert type(model) is DeepseekForCausalLM and isinstance(config, DeepseekConfig)
    assert config.model_type == ("deepseek_v2" if kind.startswith("v2") else "deepseek_v3")
    assert (config.q_lora_rank is None) == (kind == "v2_lite")
    assert [isinstance(la.mlp, DeepseekMoE) for la in model.model.layers] == [
        hasattr(la.mlp, "experts") for la in hf.model.layers]
    runner = PagedRunner(model)
    _close(runner.step(list(enumerate(PROMPTS))), torch.cat([hf_logits(hf, p) for p in PROMPTS]))
    nxt = [7, 11, 13]  # two decode steps per sequence after the prefill
    for step in range(2):
        logits = runner.step([(i, [t + step]) for i, t in enumerate(nxt)])
        ref = torch.stack([hf_logits(hf, p + [t + s for s in range(step + 1)])[-1] for p, t in zip(PROMPTS, nxt)])
        _close(logits, ref)


def test_real_latent_dims(tmp_path):
    """V2-Lite's attention dims (16 heads, kv_lora_rank 512, qk_nope / qk_rope / v 128 / 64 / 128: a 576-wide latent
    cache) and its YaRN (factor 40, mscale 0.707) on a narrow model: logits and the Engine's greedy tokens (16-token
    pages, chunked prefill) are transformers'."""
    import transformers as tf

    cfg = tf.DeepseekV2Config(**{**COMMON, "hidden_size": 128, "num_attention_heads": 16, "num_key_value_heads": 16,
                                 "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
                                 "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts_per_tok": 6,
                                 "first_k_dense_replace": 1, "num_hidden_layers": 2, "max_position_embeddings": 4096,
                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40,
                                                     "original_max_position_embeddings": 4096, "mscale": 0.707,
                                                     "mscale_all_dim": 0.707}})  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.DeepseekV2ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, dtype=torch.float32, device="cpu")[0]
    assert model.kv_specs()[0].head_dim == 576
    _close(PagedRunner(model, page_size=16).step(list(enumerate(PROMPTS))),
           torch.cat([hf_logits(hf, p) for p in PROMPTS]))
    engine = Engine(model, page_size=16, num_pages=16, max_num_batched_tokens=24)
    outs = engine.generate(PROMPTS[1:], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 3) for p in PROMPTS[1:]]


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16-g128"])
def test_quantized_kv_b_proj(scheme, checkpoints):
    """``quantize`` swaps kv_b_proj for a QuantLinear too: prefill runs it as a layer, the absorbed decode takes its
    matrix as the layer computes it. Logits equal those of the model whose kv_b_proj is an nn.Linear holding the
    dequantized weight (the other linears quantized alike), through prefill and two decode steps."""
    from infercore.quant import quantize
    from infercore.quant.linear import QuantLinear

    _, path = checkpoints["v3"]
    model = load_model(path, dtype=torch.float32, device="cpu")[0]
    quantize(model, scheme)
    ref = load_model(path, dtype=torch.float32, device="cpu")[0]
    quantize(ref, scheme, skip=("lm_head", "kv_b_proj"))
    for a, b in zip(model.model.layers, ref.model.layers):
        qa = a.self_attn.kv_b_proj
        assert isinstance(qa, QuantLinear) and isinstance(b.self_attn.kv_b_proj, torch.nn.Linear)
        with torch.no_grad():
            b.self_attn.kv_b_proj.weight.copy_(qa(torch.eye(qa.in_features)).t())
    runs = [PagedRunner(m) for m in (model, ref)]
    outs = [r.step(list(enumerate(PROMPTS))) for r in runs]
    _close(outs[0], outs[1], 1e-4)
    for step in range(2):
        outs = [r.step([(i, [5 + i + step]) for i in range(len(PROMPTS))]) for r in runs]
        _close(outs[0], outs[1], 1e-4)


def test_fp8_block_checkpoint_in_the_v3_release_layout(tmp_path):
    """A ``quant_method: fp8`` directory laid out as DeepSeek-V3's release: every projection of the attention (q_a /
    q_b / kv_a / kv_b / o), the dense and shared MLPs and each routed expert (per-expert tensors) stored e4m3 with
    128 x 128 ``weight_scale_inv`` blocks, a multi-token-prediction layer's too; router, norms, embeddings and lm_head
    in full precision. It loads (the MTP layer skipped) with the
    projections as FP8 QuantLinears (kv_b_proj included, which the absorbed decode reads through the identity) and
    the routed experts dequantized; the tokens equal those of transformers' model holding the dequantized weights."""
    import json
    import warnings

    from safetensors.torch import save_file
    from test_prequantized_fp8 import per_block

    from infercore.quant import QuantLinear

    wide = dict(intermediate_size=128, moe_intermediate_size=128, hidden_size=128)  # whole 128-row blocks to merge
    old = dict(COMMON)
    COMMON.update(wide)
    try:
        hf = tiny("v3")
    finally:
        COMMON.clear()
        COMMON.update(old)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}  # views of hf's parameters
    for name in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
        pre = name[: -len("gate_up_proj")]
        gate_up, down = state.pop(name), state.pop(pre + "down_proj")
        i = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            for proj, w in (("gate_proj", gate_up[e, :i]), ("up_proj", gate_up[e, i:]), ("down_proj", down[e])):
                q, scale, deq = per_block(w.float())
                state.update({f"{pre}{e}.{proj}.weight": q, f"{pre}{e}.{proj}.weight_scale_inv": scale})
                w.copy_(deq)
    for name in [k for k in state if k.endswith(("proj.weight", "proj_with_mqa.weight")) and ".experts." not in k]:
        q, scale, deq = per_block(state.pop(name).float())
        state.update({name: q, name[: -len("weight")] + "weight_scale_inv": scale})
        hf.get_submodule(name[: -len(".weight")]).weight.data.copy_(deq)
    for name in ("eh_proj", "self_attn.o_proj", "mlp.experts.0.down_proj"):  # a multi-token-prediction layer: skipped
        q, scale, _ = per_block(torch.randn(128, 128))
        state.update({f"model.layers.3.{name}.weight": q, f"model.layers.3.{name}.weight_scale_inv": scale})
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(tmp_path, dtype=torch.float32, device="cpu")[0]
    assert any("routed-expert linears stored FP8-quantized were dequantized" in str(w.message) for w in caught)
    attn = model.model.layers[0].self_attn
    for mod in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.o_proj):
        assert isinstance(mod, QuantLinear) and mod.qweight_format.kind == "fp8"
    assert isinstance(model.model.layers[1].mlp.shared_experts.gate_up_proj, QuantLinear)
    engine = Engine(model, page_size=4, num_pages=64, max_num_batched_tokens=12)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in PROMPTS]
    # quantize_experts=True: the dequantized experts back to FP8 codes with 128 x 128 block scales -- the stored ones
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8 = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, quantize_experts=True,
                                     page_size=4, num_pages=64, max_num_batched_tokens=12)  # fmt: skip
    ex = fp8.model.model.layers[1].mlp.experts
    assert ex.gate_up_proj.dtype == torch.float8_e4m3fn and ex.gate_up_scale.shape[1:] == (2, 1)
    stored = per_block(hf.model.layers[1].mlp.experts.gate_up_proj[3, :128].float())[0]
    assert torch.equal(ex.gate_up_proj[3, :128].float(), stored.float())
    outs = fp8.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in PROMPTS]


def test_original_release_config_layout(tmp_path):
    """A config.json laid out as DeepSeek released V2-Lite's (top-level rope_theta, rope_scaling with the legacy
    'type' key and equal mscales, routing keys transformers' class does not declare, auto_map): the model equals the
    one transformers builds from that dict."""
    import json

    import transformers as tf

    legacy = {**COMMON, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None,
              "topk_method": "greedy", "n_group": 1, "topk_group": 1, "scoring_func": "softmax",
              "norm_topk_prob": False, "moe_layer_freq": 1, "first_k_dense_replace": 1, "ep_size": 1,
              "aux_loss_alpha": 0.001, "seq_aux": True, "rope_theta": 10000,
              "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32, "mscale": 0.707,
                               "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
              "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config"}}  # fmt: skip
    cfg = tf.DeepseekV2Config.from_dict(legacy)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.DeepseekV2ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    model, _, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert config.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert config.softmax_scale != (16 + 8) ** -0.5
    _close(PagedRunner(model).step(list(enumerate(PROMPTS))), torch.cat([hf_logits(hf, p) for p in PROMPTS]))


def test_config_facts(checkpoints):
    cfg = load_model(checkpoints["v3"][1], dtype=torch.float32, device="cpu")[2]
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob, cfg.rope_interleave) == (
        "sigmoid", "noaux_tc", True, True)
    assert cfg.latent_dim == 32 + 8 and cfg.head_dim == 8 and cfg.rope_scaling["rope_type"] == "yarn"
    mscale = 0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert cfg.softmax_scale == pytest.approx((16 + 8) ** -0.5 * mscale**2)
    cfg = load_model(checkpoints["v2"][1], dtype=torch.float32, device="cpu")[2]
    assert (cfg.scoring_func, cfg.topk_method, cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group) == (
        "softmax", "group_limited_greedy", 1.5, 4, 2)
    assert cfg.attention_bias and cfg.softmax_scale == (16 + 8) ** -0.5 and cfg.rope_interleave
    layers = DeepseekForCausalLM(cfg).model.layers
    assert isinstance(layers[0].mlp, GatedMLP) and all(isinstance(la.mlp, DeepseekMoE) for la in layers[1:])


@pytest.mark.parametrize("kind", ["v2_lite", "v2", "v3"])
def test_router_matches_hf(kind, checkpoints):
    """The experts chosen and their weights, token by token, against transformers' TopkRouter; the group limit
    really changes choices on these inputs (a router that ignored it would fail)."""
    hf, path = checkpoints[kind]
    model = load_model(path, dtype=torch.float32, device="cpu")[0]
    ours, ref = model.model.layers[1].mlp.gate, hf.model.layers[1].mlp.gate
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ref_w, ref_ids = ref(x)
        w, ids = ours(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    if kind != "v2_lite":
        ours.method = "greedy"
        assert not torch.equal(ours(x)[1].sort(-1).values, ids.sort(-1).values)


def test_bf16_cpu_paths(checkpoints):
    """bf16 on the CPU through the layouts the Engine picks (oneDNN-packed linears, the packed routed experts,
    the native decode attention at the latent head dim): logits near transformers' fp32 ones."""
    from infercore.models.layout import pack_linears_for_cpu_

    hf, path = checkpoints["v3"]
    model = load_model(path, dtype=torch.bfloat16, device="cpu")[0]
    assert pack_linears_for_cpu_(model) > 0 and model.model.layers[1].mlp.cpu_packed_experts is not None
    runner = PagedRunner(model)
    _close(runner.step(list(enumerate(PROMPTS))), torch.cat([hf_logits(hf, p) for p in PROMPTS]), rel=5e-2)
    ref = torch.stack([hf_logits(hf, p + [7])[-1] for p in PROMPTS])
    _close(runner.step([(i, [7]) for i in range(len(PROMPTS))]), ref, rel=5e-2)


def test_host_experts(checkpoints):
    """offload.offload_experts_ takes DeepSeekMoE's routed experts (a SparseMoeBlock's storage) to the host path; the
    dense first layer keeps its MLP; the logits are transformers'."""
    from infercore.offload import offload_experts_

    hf, path = checkpoints["v3"]
    model = load_model(path, dtype=torch.float32, device="cpu")[0]
    offload_experts_(model)
    assert [getattr(la.mlp, "host_experts", None) is not None for la in model.model.layers] == [False, True, True]
    _close(PagedRunner(model).step(list(enumerate(PROMPTS))), torch.cat([hf_logits(hf, p) for p in PROMPTS]))


# ------------------------------------------------------------------------------------------ engine
@pytest.mark.parametrize("kind", ["v2_lite", "v2", "v3"])
def test_engine_greedy_matches_hf_generate(kind, checkpoints):
    """A batch of prompts of different lengths, chunked (16-token budget, 4-token pages) and mixed with decodes, then
    a prompt sharing a prefix: the prefix-cache hit reads the latent pages the first run wrote."""
    hf, path = checkpoints[kind]
    engine = Engine.from_pretrained(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=96,
                                    max_num_seqs=4, max_num_batched_tokens=16)
    caches = engine.runner.kv_caches
    assert all(k is v and k.shape == (96, 4, 1, 40) for k, v in caches)  # one latent tensor per layer
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)
    shared = PROMPTS[2][:17] + [5, 9, 250]
    out = engine.generate([shared], sp)[0]
    assert out.metrics.num_cached_tokens == 16 and out.token_ids == hf_greedy(hf, shared, 8)


# ------------------------------------------------------------------------------------------ the latent cache
def test_shared_kv_spec_allocates_one_tensor():
    specs = [FullAttentionSpec(num_kv_heads=1, head_dim=40, shared_kv=True), FullAttentionSpec(num_kv_heads=2,
                                                                                               head_dim=8)]
    k, v = allocate_kv_caches(specs, 3, 4, dtype=torch.float32, device="cpu")[0]
    assert k is v and k.shape == (3, 4, 1, 40)
    k, v = allocate_kv_caches(specs, 3, 4, dtype=torch.float32, device="cpu")[1]
    assert k is not v
    assert bytes_per_page(specs, 4, torch.float32) == 4 * 40 * 4 + 2 * 4 * 2 * 8 * 4
    # the CPU tier's host slots hold the shared tensor once too
    assert CPUKVTier(allocate_kv_caches(specs, 3, 4, dtype=torch.float32, device="cpu"), 2).page_bytes == (
        bytes_per_page(specs, 4, torch.float32))
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'.*shared_kv"):
        allocate_kv_caches(specs, 3, 4, dtype=torch.float32, device="cpu", kv_cache_dtype="int8")
    with pytest.raises(TypeError, match="shared_kv"):
        FullAttentionSpec(num_kv_heads=1, head_dim=8, shared_kv=1)


# ------------------------------------------------------------------------------------------ bad inputs
def test_bad_configs_name_the_field(checkpoints):
    v2 = checkpoints["v2"][0].config.to_dict()
    v3 = checkpoints["v3"][0].config.to_dict()
    for hf, key, value, needle in [
        (v3, "topk_method", "greedy", "topk_method"),
        (v3, "scoring_func", "softmax", "scoring_func"),
        (v2, "scoring_func", "sigmoid", "scoring_func"),
        (v2, "topk_method", "noaux_tc", "topk_method"),
        (v2, "topk_method", "random", "topk_method"),
        (v2, "norm_topk_prob", True, "norm_topk_prob"),
        (v2, "moe_layer_freq", 2, "moe_layer_freq"),
        (v2, "n_group", 3, "n_group"),
        (v2, "topk_group", 5, "topk_group"),
        (v3, "kv_lora_rank", 0, "kv_lora_rank"),
        (v3, "q_lora_rank", "24", "q_lora_rank"),
        (v3, "num_experts_per_tok", 9, "num_experts_per_tok"),
        (v3, "hidden_act", "gelu", "hidden_act"),
        (v2, "mlp_bias", True, "mlp_bias"),
        (v3, "architectures", ["DeepseekV2ForCausalLM"], "architectures"),
    ]:
        with pytest.raises(ValueError, match=needle):
            config_from_hf({**hf, key: value})
    with pytest.raises(ValueError, match="rope_scaling"):
        config_from_hf({**v3, "rope_parameters": {**YARN, "factor": None}})
    # transformers reads these flags for truth: an explicit null is off
    cfg = config_from_hf({**v3, "rope_interleave": None, "norm_topk_prob": None})
    assert not cfg.rope_interleave and not cfg.norm_topk_prob


def test_refusals(checkpoints):
    hf, path = checkpoints["v3"]
    model = load_model(path, dtype=torch.float32, device="cpu")[0]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(model, page_size=4, num_pages=8, kv_cache_dtype="int8")
    fresh = load_model(path, dtype=torch.float32, device="cpu")[0]
    names = [n for n, _ in fresh.named_modules()]
    with pytest.raises(ValueError, match="takes no LoRA adapters"):
        Engine(fresh, page_size=4, num_pages=8, max_loras=1)
    assert [n for n, _ in fresh.named_modules()] == names  # refused before any projection was wrapped
    with pytest.raises(TypeError, match="DeepseekConfig"):
        DeepseekForCausalLM(config_from_hf(checkpoints["v2"][0].config.to_dict() | {"model_type": "llama",
                                                                                    "architectures": None,
                                                                                    "head_dim": 8}))
    # a checkpoint without one expert's tensor is refused, naming the stacked parameter; MTP layers are skipped
    sd = {k: v for k, v in hf.state_dict().items()}
    fresh = DeepseekForCausalLM(model.config)
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        fresh.load_weights((k, v) for k, v in sd.items() if k != "model.layers.2.mlp.experts.gate_up_proj")
    mtp = {"model.layers.3.embed_tokens.weight": torch.zeros(300, 64), "model.layers.3.eh_proj.weight": torch.zeros(1)}
    fresh.load_weights([*sd.items(), *mtp.items()])
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.4"):
        fresh.load_weights([("model.layers.4.eh_proj.weight", torch.zeros(1))])


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v2_lite", "v2", "v3"])
def test_cuda_graph_greedy_matches_hf(kind, checkpoints):
    """On CUDA (Triton paged attention at the latent head dim, the routed-experts op, decode CUDA graphs): fp32
    tokens equal transformers' greedy ones on the CPU; in bf16 the graphs give the eager engine's tokens."""
    hf, path = checkpoints[kind]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng = Engine.from_pretrained(str(path), device="cuda", dtype=torch.float32, page_size=4, num_pages=96,
                                 max_num_seqs=4, max_num_batched_tokens=16)
    assert eng.graph_runner is not None
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == [hf_greedy(hf, p, 12) for p in PROMPTS]
    model = load_model(path, dtype=torch.bfloat16, device="cuda")[0]
    eager = Engine(model, page_size=4, num_pages=96, max_num_seqs=4, cuda_graph_max_batch=0)
    graphs = Engine(model, page_size=4, num_pages=96, max_num_seqs=4)
    assert [o.token_ids for o in graphs.generate(PROMPTS, sp)] == [o.token_ids for o in eager.generate(PROMPTS, sp)]


def test_triton_attention_kernels_mla(checkpoints, monkeypatch):
    """The GPU attention kernels (Triton, interpreted on the CPU): decode through the MLA kernel over the latent
    cache (``kv_lora_rank + qk_rope_head_dim`` = 40 wide, not a power of two), prefill chunks in the plain form
    through the paged prefill kernel over the expanded per-head keys / values, and mixed steps' one-query sequences
    split off to the MLA kernel. The tokens are transformers'."""
    from infercore.devices import implementation
    from infercore.engine import runner
    from infercore.models import deepseek

    kernels = {op: implementation(op, "triton") for op in ("paged_attention_prefill", "paged_mla_decode")}
    real_dispatch, used, split = deepseek.dispatch, [], []

    def routed(op, device):
        if op in kernels:
            used.append(op)
            return kernels[op]
        return real_dispatch(op, device)

    real_prefill = deepseek.MLAttention._prefill

    def prefill(self, q_nope, q_pe, cache, meta):
        split.append(meta.num_split_decodes)
        return real_prefill(self, q_nope, q_pe, cache, meta)

    monkeypatch.setattr(deepseek, "dispatch", routed)
    monkeypatch.setattr(deepseek.MLAttention, "_prefill", prefill)
    monkeypatch.setattr(runner, "SPLIT_DECODES_MIN", 2)
    hf, path = checkpoints["v3"]
    engine = Engine.from_pretrained(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64,
                                    max_num_seqs=4, max_num_batched_tokens=12)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in PROMPTS]
    assert set(used) == set(kernels)
    assert max(split) >= 2  # a mixed step split its decodes off


def test_speculative_decoding_keeps_the_tokens(checkpoints):
    """n-gram drafts verified as decode rows of one sequence (shared_seqs: each row reads latents the step writes
    for the rows before it): the tokens are transformers' greedy ones, with drafts proposed and accepted."""
    hf, path = checkpoints["v2"]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10]]
    engine = Engine.from_pretrained(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64,
                                    num_speculative_tokens=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
