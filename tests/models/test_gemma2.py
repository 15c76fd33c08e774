"""Gemma 2 vs Hugging Face transformers on tiny random configs (fp32): prefill and decode logits through
``save_pretrained`` + ``load_model`` (softcapped attention scores and logits, alternating sliding layers, sandwich
norms), greedy generation through the Engine in both KV layouts, and the config's errors."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, hf_greedy, hf_logits, ours_from_hf

from infercore.engine import Engine, EngineConfig, SamplingParams
from infercore.models import Gemma2ForCausalLM, Gemma3Config, config_from_hf

PROMPTS = [[2, 17, 42, 90, 5, 23, 7, 64, 12, 15, 33, 8, 71, 20, 3, 91, 45, 18, 26], [2, 25, 4, 4, 19],
           [2, 88, 12, 7, 56, 29, 14, 3, 77, 10, 9, 66, 24, 31, 2, 18, 55, 12]]


def tiny_gemma2(seed: int = 0, **overrides):
    import transformers as tf

    cfg = tf.Gemma2Config(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                                    query_pre_attn_scalar=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    max_position_embeddings=256, bos_token_id=2, eos_token_id=None, pad_token_id=0),
                             **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF sets the (1 + w) norms to w = 0: randomise them; spread the embedding
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        model.model.embed_tokens.weight.mul_(4.0)
    return model


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item() + 1e-5, f"max abs error {err}"


def test_config_reads_gemma2():
    hf = tiny_gemma2()
    cfg = config_from_hf(hf.config.to_dict())
    assert isinstance(cfg, Gemma3Config) and cfg.model_type == "gemma2" and not cfg.qk_norm
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.sliding_window == 6
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (2.0, 3.0)
    assert cfg.rope_theta == cfg.rope_local_theta == 10000.0
    legacy = {k: v for k, v in hf.config.to_dict().items() if k not in ("layer_types", "rope_parameters")}
    legacy["rope_theta"] = 5000.0  # transformers 4.x keys: alternating layers, a top-level rope_theta
    cfg = config_from_hf(legacy)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.rope_theta == 5000.0
    with pytest.raises(ValueError, match="sliding_window"):
        config_from_hf({**hf.config.to_dict(), "sliding_window": -1})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        config_from_hf({k: v for k, v in hf.config.to_dict().items() if k != "num_hidden_layers"})


def test_prefill_and_decode_logits_match_hf(tmp_path):
    hf = tiny_gemma2()
    model, config = ours_from_hf(hf, tmp_path)
    assert isinstance(model, Gemma2ForCausalLM) and model.model.layers[0].self_attn.q_norm is None
    runner = PagedRunner(model)
    logits = runner.step(list(enumerate(PROMPTS)))
    _close(logits, torch.cat([hf_logits(hf, p) for p in PROMPTS]))
    nxt = [7, 11, 13]
    logits = runner.step([(i, [t]) for i, t in enumerate(nxt)])
    _close(logits, torch.stack([hf_logits(hf, p + [t])[-1] for p, t in zip(PROMPTS, nxt)]))


@pytest.mark.parametrize("kv_layout", ["dense", "multi"])
def test_engine_greedy_matches_hf_generate(tmp_path, kv_layout):
    """Past the window (prompts of up to 19 tokens, window 6), in the dense pool and in the multi-granularity one
    (sliding layers' pages freed as they leave the window)."""
    hf = tiny_gemma2(seed=1)
    model, _ = ours_from_hf(hf, tmp_path)
    engine = Engine(model, config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4, kv_layout=kv_layout))
    assert engine.kv_layout == kv_layout
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
