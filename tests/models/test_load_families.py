"""load_model reads every registered family from an HF safetensors directory."""

import pytest
import torch

from infercore import Engine, SamplingParams
from infercore.models import load_model


def _tiny(kind):
    import transformers

    torch.manual_seed(0)
    if kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                            sliding_window=4, layer_types=["sliding_attention", "full_attention"])
        return transformers.Gemma3ForCausalLM(cfg)
    if kind == "mamba2":
        cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                        state_size=8, n_groups=1, expand=2, chunk_size=8)
        return transformers.Mamba2ForCausalLM(cfg)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["gemma3", "mamba2"])
def test_load_model_from_safetensors_dir(tmp_path, kind):
    hf = _tiny(kind).eval()
    hf.save_pretrained(tmp_path)
    model, _, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert type(model).__name__.lower().startswith(kind[:5])
    prompt = [3, 17, 5, 42, 8, 8, 1, 30, 9]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = Engine(model, kv_cache_bytes=64 << 20).generate([prompt], sp)
    x = torch.tensor([prompt])
    with torch.inference_mode():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    assert out[0].token_ids == ref[0, len(prompt):].tolist()
