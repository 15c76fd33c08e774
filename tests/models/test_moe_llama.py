"""Mixtral / Qwen2-MoE / Qwen3-MoE vs Hugging Face transformers on tiny random configs (fp32, paged KV),
through ``save_pretrained`` (per-expert tensors) and ``load_model``, and through the Engine."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, hf_greedy, hf_logits, ours_from_hf

from infercore.engine import Engine, EngineConfig, SamplingParams
from infercore.models import MoeLlamaForCausalLM, MoeModelConfig, config_from_hf
from infercore.models.llama import LlamaMLP
from infercore.models.moe import SparseMoeBlock

PROMPTS = [
    [1, 17, 42, 99, 5, 230, 7, 64, 12, 150, 33, 8, 71, 200, 3, 91, 45, 18, 260],
    [1, 250, 4, 4, 19],
    [1, 88, 120, 7, 56, 290, 14, 3, 77, 101, 9, 66, 240, 31, 2, 180, 55, 123],
]

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1,
              eos_token_id=None, pad_token_id=0)  # fmt: skip


def tiny_moe(kind: str, *, seed: int = 0, **overrides):
    import transformers as tf

    if kind == "mixtral":
        cfg = tf.MixtralConfig(**{**COMMON, "intermediate_size": 48, "num_local_experts": 6, "num_experts_per_tok": 2,
                                  "sliding_window": 8, **overrides})  # fmt: skip
        cls = tf.MixtralForCausalLM
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**{**COMMON, "intermediate_size": 80, "moe_intermediate_size": 24, "num_experts": 8,
                                   "num_experts_per_tok": 3, "shared_expert_intermediate_size": 40,
                                   "mlp_only_layers": [1], "rope_theta": 1e6, **overrides})  # fmt: skip
        cls = tf.Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**COMMON, "intermediate_size": 80, "moe_intermediate_size": 24, "num_experts": 8,
                                   "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 2,
                                   **overrides})  # fmt: skip
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF zero-initialises biases and sets norms to 1: randomise them so they are tested
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item(), f"max abs error {err} vs max |logit| {ref.abs().max().item()}"


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_logits_match_hf(kind, tmp_path):
    hf = tiny_moe(kind)
    model, config = ours_from_hf(hf, tmp_path)
    assert isinstance(model, MoeLlamaForCausalLM) and config.model_type == kind
    runner = PagedRunner(model)
    logits = runner.step(list(enumerate(PROMPTS)))
    _close(logits, torch.cat([hf_logits(hf, p) for p in PROMPTS]))
    # one decode step per sequence, after the prefill
    nxt = [7, 11, 13]
    logits = runner.step([(i, [t]) for i, t in enumerate(nxt)])
    ref = torch.stack([hf_logits(hf, p + [t])[-1] for p, t in zip(PROMPTS, nxt)])
    _close(logits, ref)


def test_layer_kinds_follow_the_hf_rules(tmp_path):
    """Qwen2-MoE's mlp_only_layers and Qwen3-MoE's decoder_sparse_step pick the dense layers; Qwen2-MoE has a
    gated shared expert, the others none; the routing renormalizes as configured."""
    kinds = {}
    for kind in KINDS:
        hf = tiny_moe(kind)
        model, config = ours_from_hf(hf, tmp_path / kind)
        kinds[kind] = [type(layer.mlp) for layer in model.model.layers]
        hf_kinds = ["Experts" in type(getattr(layer.mlp, "experts", None)).__name__ for layer in hf.model.layers]
        assert config.sparse_layers == hf_kinds
        for layer in model.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                assert (layer.mlp.shared_expert is not None) == (kind == "qwen2_moe")
                assert layer.mlp.renormalize == (kind != "qwen2_moe")
    assert kinds["mixtral"] == [SparseMoeBlock] * 3
    assert kinds["qwen2_moe"] == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]
    assert kinds["qwen3_moe"] == [LlamaMLP, SparseMoeBlock, LlamaMLP]


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_matches_hf_generate(kind, tmp_path):
    hf = tiny_moe(kind)
    model, _ = ours_from_hf(hf, tmp_path)
    engine = Engine(model, config=EngineConfig(page_size=4, num_pages=64, max_num_seqs=4))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)


def test_tied_embeddings_and_qwen2_moe_without_qkv_bias(tmp_path):
    hf = tiny_moe("qwen2_moe", tie_word_embeddings=True, qkv_bias=False)
    model, config = ours_from_hf(hf, tmp_path)
    assert config.tie_word_embeddings and not config.attention_bias
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    _close(PagedRunner(model).step([(0, PROMPTS[0])]), hf_logits(hf, PROMPTS[0]))


def test_bad_configs_and_checkpoints(tmp_path):
    hf = tiny_moe("qwen3_moe").config.to_dict()
    for key, value, needle in [("num_local_experts", 0, "num_local_experts"), ("num_experts", 0, "num_experts"),
                               ("num_experts_per_tok", 9, "num_experts_per_tok"),
                               ("mlp_only_layers", "1", "mlp_only_layers"), ("norm_topk_prob", 1, "norm_topk_prob"),
                               ("architectures", ["Qwen3MoeForTokenClassification"], "architectures")]:  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            config_from_hf({**hf, key: value})
    with pytest.raises(TypeError, match="MoeModelConfig"):
        MoeLlamaForCausalLM(config_from_hf(tiny_moe("qwen3_moe").config.to_dict() | {"model_type": "qwen3",
                                                                                      "architectures": None}))
    # a checkpoint missing one expert's tensor is refused, naming the stacked parameter
    model = MoeLlamaForCausalLM(config_from_hf(hf))
    dropped = "model.layers.1.mlp.experts.3.up_proj.weight"
    sd = {k: v for k, v in _hf_tensors(tiny_moe("qwen3_moe")).items() if k != dropped}
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        model.load_weights(sd.items())
    with pytest.raises(ValueError, match="unexpected tensor"):
        model.load_weights([("model.layers.1.mlp.experts.9.up_proj.weight", torch.zeros(24, 64))])
    assert isinstance(config_from_hf(hf), MoeModelConfig)


def _hf_tensors(hf) -> dict[str, torch.Tensor]:
    """The tensors as save_pretrained writes them (per expert), read back with safetensors."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        import pathlib

        out = {}
        for f in pathlib.Path(d).glob("*.safetensors"):
            out.update(load_file(f))
        return out


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_greedy_matches_hf(kind, tmp_path):
    """On CUDA the experts run the routed Triton op (IEEE fp32 dots in fp32), inside the decode graphs: the
    tokens equal transformers' fp32 greedy ones on the CPU; in bf16 the graphs give the eager engine's tokens."""
    from infercore.models import load_model

    hf = tiny_moe(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    model, _, _ = load_model(tmp_path, dtype=torch.float32, device="cuda")
    eng = Engine(model, config=EngineConfig(page_size=4, num_pages=64, max_num_seqs=4))
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == [hf_greedy(hf, p, 12) for p in PROMPTS]
    model, _, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    eager = Engine(model, config=EngineConfig(page_size=4, num_pages=64, max_num_seqs=4, cuda_graph_max_batch=0))
    graphs = Engine(model, config=EngineConfig(page_size=4, num_pages=64, max_num_seqs=4))
    assert [o.token_ids for o in graphs.generate(PROMPTS, sp)] == [o.token_ids for o in eager.generate(PROMPTS, sp)]
