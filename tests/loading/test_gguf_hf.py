"""GGUF -> HF config and weights (names, q/k un-permutation) against transformers and llama.cpp."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from infercore.loading import GGUFFile, gguf_hf_weights, unpermute_qk


def test_real_weights_match_transformers(smollm, hf_gguf_state_dict):
    """Every tensor, exactly (fp32), against transformers' own GGUF loader."""
    ours = dict(smollm.weights(torch.float32))
    assert set(ours) == set(hf_gguf_state_dict)
    assert "lm_head.weight" not in ours  # tied: the file has no output.weight
    for name, ref in hf_gguf_state_dict.items():
        assert ours[name].dtype == torch.float32 and ours[name].shape == ref.shape, name
        assert torch.equal(ours[name], ref), name


def test_real_config_matches_transformers(smollm, smollm_path):
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)
    cfg = smollm.to_hf_config()
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "rms_norm_eps",
    ):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert cfg["model_type"] == "llama" and cfg["head_dim"] == 64 and "rope_scaling" not in cfg


# --- synthetic llama written the way llama.cpp's converter writes it --------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py (HF rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_llama(tmp_path, write_gguf, *, tied: bool, extra_kv=None, extra_tensors=None):
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, head_dim, inter, layers, vocab = 32, 4, 2, 8, 48, 2, 50
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
        "model.norm.weight": rng.random(hidden),
    }
    if not tied:
        hf["lm_head.weight"] = rng.standard_normal((vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = rng.random(hidden)
        hf[p + "post_attention_layernorm.weight"] = rng.random(hidden)
        hf[p + "self_attn.q_proj.weight"] = rng.standard_normal((heads * head_dim, hidden))
        hf[p + "self_attn.k_proj.weight"] = rng.standard_normal((kv_heads * head_dim, hidden))
        hf[p + "self_attn.v_proj.weight"] = rng.standard_normal((kv_heads * head_dim, hidden))
        hf[p + "self_attn.o_proj.weight"] = rng.standard_normal((hidden, heads * head_dim))
        hf[p + "mlp.gate_proj.weight"] = rng.standard_normal((inter, hidden))
        hf[p + "mlp.up_proj.weight"] = rng.standard_normal((inter, hidden))
        hf[p + "mlp.down_proj.weight"] = rng.standard_normal((hidden, inter))
    hf = {k: v.astype(np.float32) for k, v in hf.items()}

    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    tensors = {}
    for k, v in hf.items():
        if k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            if module == "self_attn.q_proj":
                v = llama_cpp_permute(v, heads)
            elif module == "self_attn.k_proj":
                v = llama_cpp_permute(v, kv_heads)
            name = f"blk.{i}.{names[module]}.weight"
        else:
            name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[k]
        # Store the FFN in F16 so a non-F32 path goes through the permutation-free branch too.
        tensors[name] = (v.astype(np.float16) if "ffn_up" in name else v, None)
        if "ffn_up" in name:
            hf[k] = v.astype(np.float16).astype(np.float32)
    tensors.update(extra_tensors or {})

    def kv(w):
        w.add_uint32("llama.embedding_length", hidden)
        w.add_uint32("llama.feed_forward_length", inter)
        w.add_uint32("llama.block_count", layers)
        w.add_uint32("llama.attention.head_count", heads)
        w.add_uint32("llama.attention.head_count_kv", kv_heads)
        w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_float32("llama.rope.freq_base", 500000.0)
        w.add_uint32("llama.context_length", 4096)
        w.add_uint32("tokenizer.ggml.bos_token_id", 1)
        w.add_uint32("tokenizer.ggml.eos_token_id", 2)
        if extra_kv:
            extra_kv(w)

    return write_gguf(tmp_path / "tiny.gguf", tensors=tensors, kv=kv), hf


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_llama_roundtrip(tmp_path, write_gguf, tied):
    path, hf = _tiny_llama(tmp_path, write_gguf, tied=tied)
    gf = GGUFFile(path)
    ours = dict(gf.weights(torch.float32))
    assert set(ours) == set(hf)
    for k, v in hf.items():
        assert torch.equal(ours[k], torch.from_numpy(v)), k
    cfg = gf.to_hf_config()
    assert cfg["tie_word_embeddings"] is tied
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        32,
        4,
        2,
        8,
    )
    assert (cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (48, 2, 50)
    assert (cfg["rope_theta"], cfg["max_position_embeddings"], cfg["bos_token_id"], cfg["eos_token_id"]) == (
        500000.0,
        4096,
        1,
        2,
    )
    assert cfg["rms_norm_eps"] == pytest.approx(1e-6)
    bf16 = dict(gguf_hf_weights(gf, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


def test_unpermute_inverts_llama_cpp():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(w, 6)), 6), torch.from_numpy(w))
    b = np.arange(16, dtype=np.float32)  # biases are permuted the same way
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(b, 2)), 2), torch.from_numpy(b))
    with pytest.raises(ValueError, match="w"):
        unpermute_qk(torch.zeros(10, 3), 3)


def test_linear_rope_scaling(tmp_path, write_gguf):
    def kv(w):
        w.add_string("llama.rope.scaling.type", "linear")
        w.add_float32("llama.rope.scaling.factor", 4.0)

    path, _ = _tiny_llama(tmp_path, write_gguf, tied=True, extra_kv=kv)
    assert GGUFFile(path).to_hf_config()["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def _llama_cpp_rope_freqs(head_dim: int, base: float, factor: float) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.generate_extra_tensors) for Llama 3.1 rope scaling."""
    low_freq_factor, high_freq_factor, old_context_len = 1.0, 4.0, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_freqs(tmp_path, write_gguf):
    freqs = _llama_cpp_rope_freqs(8, 500000.0, 8.0)
    assert ((freqs > 1) & (freqs < 8)).any()  # head_dim 8 at this base reaches the smoothed band
    path, hf = _tiny_llama(
        tmp_path, write_gguf, tied=True, extra_tensors={"rope_freqs.weight": (freqs, None)}
    )
    gf = GGUFFile(path)
    assert gf.to_hf_config()["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert set(dict(gf.weights())) == set(hf)  # rope_freqs is config, not a weight


def test_llama3_rope_freqs_unknown_curve(tmp_path, write_gguf):
    freqs = _llama_cpp_rope_freqs(8, 500000.0, 8.0) * 1.5
    path, _ = _tiny_llama(tmp_path, write_gguf, tied=True, extra_tensors={"rope_freqs.weight": (freqs, None)})
    with pytest.raises(ValueError, match="rope_freqs"):
        GGUFFile(path).to_hf_config()


def test_unknown_tensor_and_arch(tmp_path, write_gguf):
    extra = {"blk.0.ffn_gate_exps.weight": (np.zeros((2, 4, 32), np.float32), None)}
    path, _ = _tiny_llama(tmp_path, write_gguf, tied=True, extra_tensors=extra)
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        GGUFFile(path).weights()  # raised when asked, before any tensor is read
    other = write_gguf(
        tmp_path / "g.gguf",
        arch="gemma3",
        tensors={"token_embd.weight": (np.zeros((4, 32), np.float32), None)},
    )
    with pytest.raises(ValueError, match="gemma3"):
        GGUFFile(other).to_hf_config()
