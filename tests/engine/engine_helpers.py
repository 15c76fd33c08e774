import torch

from infercore.models import ModelConfig, build_model


def tiny_hf(kind: str = "llama", **overrides):
    """A tiny random transformers model (the reference) and its config dict."""
    import transformers

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(overrides)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**base)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**base, head_dim=8)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**base, sliding_window=6)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    # Spread logits so greedy choices are far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def ours_from_hf(hf_model):
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"))
    model.load_weights(hf_model.state_dict().items())
    return model


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
