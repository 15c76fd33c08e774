"""GGUF files of Gemma 2 / 3, Phi-3, Mixtral, Qwen2-MoE and Qwen3-MoE against Hugging Face transformers.

Each file is written from a tiny random transformers model the way llama.cpp's ``convert_hf_to_gguf.py`` writes it:
tensor names from llama.cpp's own ``gguf`` package (``get_tensor_name_map``), Gemma's norms stored as ``1 + w``,
Mixtral's q/k rows permuted (``LlamaModel.permute``), experts stacked ``[E, I, H]`` with gate and up split apart,
Qwen2-MoE's shared-expert gate as a vector, Phi-3's LongRoPE factors as tensors, and each family's metadata keys;
F32, F16 or Q8_0 tensors (routers and vectors stay F32, as the converter keeps them). The file is then loaded through
``load_model`` / ``Engine.from_pretrained``: logits (fp32, prefill and decode over paged KV) and greedy tokens must
equal the transformers model's. Where transformers reads GGUF itself (all but Mixtral, which it takes for Llama), it
reads each file back into the original weights, so the layout written here is checked by an implementation of the
format that is not this project's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from paged_harness import PagedRunner, hf_greedy, hf_logits

from infercore.engine import Engine, EngineConfig, SamplingParams
from infercore.loading import GGUFFile, load_checkpoint
from infercore.models import load_model

PROMPTS = [[1, 17, 42, 99, 5, 120, 7, 64, 12, 50, 33, 8, 71, 100, 3, 91, 45, 18, 26], [1, 125, 4, 4, 19],
           [1, 88, 120, 7, 56, 29, 14, 3, 77, 101, 9, 66, 24, 31, 2, 18, 55, 123]]  # fmt: skip
# past Phi-3's original context (16) below: transformers takes the long LongRoPE factors, as the model's table does
LONG_PROMPTS = [[(7 * i + 3 * j) % 125 + 2 for i in range(n)] for j, n in enumerate((21, 17, 26))]
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1,
              eos_token_id=None, pad_token_id=0)  # fmt: skip
MOE = dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2)


def tiny(kind: str, **overrides):
    """A tiny random transformers model of ``kind`` (fp32, eager attention) with randomised norms and biases."""
    import transformers as tf

    c = {**COMMON, **overrides}
    if kind == "gemma2":
        cfg = tf.Gemma2Config(**{**c, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 16,
                                 "sliding_window": 6, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                                 **overrides})  # fmt: skip
        cls = tf.Gemma2ForCausalLM
    elif kind == "gemma3":  # seven layers: the sixth is the first full-attention one
        cfg = tf.Gemma3TextConfig(**{**c, "num_hidden_layers": 7, "head_dim": 16, "query_pre_attn_scalar": 16,
                                     "sliding_window": 6, "final_logit_softcapping": 5.0, **overrides})  # fmt: skip
        cls = tf.Gemma3ForCausalLM
    elif kind == "phi3":
        cfg = tf.Phi3Config(**{**c, "num_hidden_layers": 2, "sliding_window": 8, **overrides})
        cls = tf.Phi3ForCausalLM
    elif kind == "mixtral":  # no window, as Mixtral's configs: llama.cpp's "llama" files have none
        cfg = tf.MixtralConfig(**{**c, "num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 6,
                                  "num_experts_per_tok": 2, "sliding_window": None, **overrides})  # fmt: skip
        cls = tf.MixtralForCausalLM
    elif kind == "qwen2moe":
        cfg = tf.Qwen2MoeConfig(**{**c, **MOE, "num_hidden_layers": 2, "shared_expert_intermediate_size": 64,
                                   "rope_theta": 1e6, **overrides})  # fmt: skip
        cls = tf.Qwen2MoeForCausalLM
    elif kind == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(**{**c, **MOE, "num_hidden_layers": 2, "head_dim": 32, "norm_topk_prob": True,
                                   **overrides})  # fmt: skip
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # transformers sets norms to 1 (Gemma's to 0) and biases to 0: randomise them
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


# ------------------------------------------------------------------------- the file, as llama.cpp writes it
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of convert_hf_to_gguf.py (HF rotate-half rows -> ggml's interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _storage(name: str, shape: tuple[int, ...], mode: str) -> str:
    """The type the converter gives an HF tensor for ``--outtype mode``: vectors, norms and routers stay F32 (its
    ``tensor_force_quant`` / ``n_dims <= 1`` rules); Q8_0 needs rows of whole 32-value blocks (else F16)."""
    if mode == "f32" or len(shape) < 2 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        return "f32"
    return "q8_0" if mode == "q8_0" and shape[-1] % 32 == 0 else "f16"


def round_like_file(hf, mode: str) -> None:
    """Round the transformers model's weights, in place, to the values the file will hold. Rounding is per element
    (F16) or per 32 values of a row (Q8_0), and the converter only moves rows, so the file's tensors are the rounded
    weights moved; the model then is the reference the file must reproduce."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    with torch.no_grad():
        for name, p in hf.state_dict().items():
            kind = _storage(name, tuple(p.shape), mode)
            if kind == "f16":
                p.copy_(p.half().float())
            elif kind == "q8_0":
                r = dequantize(quantize(p.numpy(), Q.Q8_0), Q.Q8_0)
                assert np.array_equal(dequantize(quantize(r, Q.Q8_0), Q.Q8_0), r)  # storing it again is exact
                p.copy_(torch.from_numpy(r).reshape(p.shape))


def _hf_tensors(hf, kind: str, mode: str) -> list[tuple[str, str, np.ndarray, str]]:
    """``(hf_module, suffix, array, storage)`` after the converter's ``modify_tensors`` for ``kind``; ``storage`` is
    the type :func:`round_like_file` rounded the source tensor to."""
    cfg = hf.config
    out = []
    for name, t in hf.state_dict().items():
        a, store = t.float().numpy(), _storage(name, tuple(t.shape), mode)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the checkpoint has no lm_head (and the Gemma converters skip it anyway)
        module, suffix = name.rsplit(".", 1) if name.endswith((".weight", ".bias")) else (name, "weight")
        if module.endswith("mlp.experts.gate_up_proj"):  # transformers 5 stacks [E, 2I, H], gate rows first
            i = a.shape[1] // 2
            out += [(module.replace("gate_up_proj", "gate_proj"), suffix, a[:, :i], store),
                    (module.replace("gate_up_proj", "up_proj"), suffix, a[:, i:], store)]  # fmt: skip
            continue
        if kind == "mixtral" and module.endswith(("q_proj", "k_proj")):
            a = _permute(a, cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads)
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1  # Gemma's RMSNorm scales by (1 + w): the converter stores 1 + w
        if module.endswith("shared_expert_gate"):
            a = a.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is a vector
        out.append((module, suffix, a, store))
    return out


def _metadata(w, hf, kind: str, *, swa_base: bool) -> None:
    """The metadata keys llama.cpp's converter writes for ``kind`` (``set_gguf_parameters``)."""
    cfg = hf.config
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if kind == "gemma2":  # Gemma2Model writes no RoPE base (llama.cpp's default, 10000, is Gemma 2's)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    elif kind == "gemma3":
        full = rope["full_attention"]
        if full.get("rope_type", "default") == "linear":
            w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full["rope_theta"])
        if swa_base:  # the current converter writes the local base; older files lack it (llama.cpp: 10000)
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    elif kind == "phi3":
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                                 cfg.original_max_position_embeddings))  # fmt: skip
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)  # 0: no window (Phi-4)
        if rope.get("long_factor"):
            orig = cfg.original_max_position_embeddings
            scale = cfg.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
    else:
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_expert_count(cfg.num_local_experts if kind == "mixtral" else cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if kind == "mixtral":  # LlamaModel
            w.add_vocab_size(cfg.vocab_size)
            w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        else:  # Qwen2MoeModel
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if kind == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        if kind == "qwen3moe":
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])  # transformers reads the vocabulary size here


def write_like_llama_cpp(hf, path, kind: str, *, mode: str = "f32", swa_base: bool = True, edit=None):
    """Write ``hf`` (already :func:`round_like_file` 'd for ``mode``) as a GGUF file of llama.cpp's layout.
    ``edit(tensors, kv_writer)``: a hook that corrupts the file for the error tests."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    arch = "llama" if kind == "mixtral" else kind
    enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(enum, hf.config.num_hidden_layers)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for module, suffix, a, store in _hf_tensors(hf, kind, mode):
        gguf_name = name_map.get_name(module)
        assert gguf_name is not None, f"llama.cpp has no name for {module}"
        tensors[f"{gguf_name}.{suffix}"] = (a, store)
    rope = hf.config.rope_parameters
    if kind == "phi3" and rope.get("long_factor"):
        tensors["rope_factors_long.weight"] = (np.array(rope["long_factor"], np.float32), "f32")
        tensors["rope_factors_short.weight"] = (np.array(rope["short_factor"], np.float32), "f32")
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, hf, kind, swa_base=swa_base)
    if edit is not None:
        edit(tensors, w)
    for name, (a, store) in tensors.items():
        if store == "q8_0":
            w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(a, np.float16 if store == "f16" else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------------------- cases
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 5.0, 11.0, 23.0]}  # fmt: skip
CASES = {  # id: (kind, model overrides, tensor types, write rope.freq_base_swa)
    "gemma2": ("gemma2", {}, "f32", True),
    "gemma2-q8_0": ("gemma2", {}, "q8_0", True),
    # a local RoPE base other than llama.cpp's fixed 10000: read from rope.freq_base_swa
    "gemma3": ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}},
               "f32", True),
    # a file of an older converter (no rope.freq_base_swa: 10000), linear scaling on the global layers, F16
    "gemma3-linear-f16": ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "f16", False),
    "phi3-partial": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.75}}, "f32", True),
    "phi3-longrope-q8_0": ("phi3", {"max_position_embeddings": 64, "original_max_position_embeddings": 16,
                                    "sliding_window": None, "rope_parameters": dict(LONGROPE)}, "q8_0", True),
    "mixtral": ("mixtral", {}, "f32", True),
    "mixtral-q8_0": ("mixtral", {}, "q8_0", True),
    "qwen2moe": ("qwen2moe", {}, "f32", True),
    "qwen2moe-q8_0": ("qwen2moe", {}, "q8_0", True),
    "qwen3moe": ("qwen3moe", {}, "f16", True),
}  # fmt: skip


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item() + 1e-5, f"max abs error {err} vs max |logit| {ref.abs().max().item()}"


def _transformers_reads(path, hf) -> dict[str, torch.Tensor]:
    """transformers' own GGUF reader (``load_gguf_checkpoint``: names, dequantization, Gemma's ``- 1``, expert
    stacking), mapped onto the original model's parameter names."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = type(hf)(hf.config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)[
        "tensors"]


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_family_matches_transformers(case, tmp_path):
    kind, overrides, mode, swa_base = CASES[case]
    hf = tiny(kind, **overrides)
    round_like_file(hf, mode)
    path = write_like_llama_cpp(hf, tmp_path / f"{case}.gguf", kind, mode=mode, swa_base=swa_base)
    prompts = LONG_PROMPTS if "longrope" in case else PROMPTS
    types = {info.ggml_type.name for info in GGUFFile(path).tensors.values()}
    assert types == {"f32": {"F32"}, "f16": {"F32", "F16"}, "q8_0": {"F32", "Q8_0"}}[mode], types

    if kind != "mixtral":  # transformers reads "llama" files as Llama, so not Mixtral's
        ref = hf.state_dict()
        got = _transformers_reads(path, hf)
        assert set(got) == {n for n in ref if not (n == "lm_head.weight" and hf.config.tie_word_embeddings)}
        for name, t in got.items():  # Gemma's (1 + w) - 1 is w to within an fp32 rounding
            torch.testing.assert_close(t, ref[name].float(), atol=1e-6, rtol=0, msg=name)

    model, _, config = load_model(path, dtype=torch.float32, device="cpu")
    assert type(model).__name__ == {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                    "phi3": "Phi3ForCausalLM"}.get(kind, "MoeLlamaForCausalLM")  # fmt: skip
    runner = PagedRunner(model)
    _close(runner.step(list(enumerate(prompts))), torch.cat([hf_logits(hf, p) for p in prompts]))
    nxt = [7, 11, 13]
    _close(runner.step([(i, [t]) for i, t in enumerate(nxt)]),
           torch.stack([hf_logits(hf, p + [t])[-1] for p, t in zip(prompts, nxt)]))  # fmt: skip

    engine = Engine.from_pretrained(str(path), device="cpu", dtype=torch.float32,
                                    config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4))  # fmt: skip
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 6)
    if mode == "q8_0":  # the Q8_0 linears run as stored (quantization="gguf"): the same tokens
        from infercore.quant import QuantLinear

        engine = Engine.from_pretrained(str(path), device="cpu", dtype=torch.float32, quantization="gguf",
                                        config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4))  # fmt: skip
        native = [n for n, m in engine.model.named_modules() if isinstance(m, QuantLinear)]
        # (routed experts are stacked tensors, not linears: they stay dense)
        assert any("self_attn" in n for n in native), native
        assert kind in ("mixtral", "qwen2moe", "qwen3moe") or any("mlp" in n for n in native), native
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(hf, prompt, 6)


# ------------------------------------------------------------------------------- hyperparameters and errors
def _config(tmp_path, arch: str, **kv) -> dict:
    """The HF config of a GGUF file holding only an embedding and ``kv`` (plus the keys every file has)."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    for key, value in {"embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
                       "attention.key_length": 32, "attention.layer_norm_rms_epsilon": 1e-6, **kv}.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return load_checkpoint(tmp_path / f"{arch}.gguf").config


def test_gemma_hyperparameters_follow_llama_cpp(tmp_path):
    """What the files leave out, as llama.cpp's loader derives it: the 27B models (46 / 62 layers) scale attention by
    hidden / heads, the others by the head size; Gemma 2 slides every other layer (window 4096, softcaps 50 / 30 by
    default), Gemma 3 five layers of six, or none without a window; ``sliding_window_pattern`` as a period or flags."""
    from infercore.models import config_from_hf

    g2 = _config(tmp_path, "gemma2", block_count=46)
    assert (g2["query_pre_attn_scalar"], g2["sliding_window"]) == (16, 4096)
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (50.0, 30.0)
    assert g2["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert _config(tmp_path, "gemma2", block_count=42)["query_pre_attn_scalar"] == 32
    g3 = _config(tmp_path, "gemma3", block_count=62, **{"attention.sliding_window": 512})
    assert g3["query_pre_attn_scalar"] == 16 and g3["final_logit_softcapping"] is None
    assert g3["layer_types"][4:7] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert g3["rope_local_base_freq"] == 10000.0 and g3["attn_logit_softcapping"] is None
    cfg = config_from_hf(g3)
    assert (cfg.query_pre_attn_scalar, cfg.sliding_window, cfg.layer_types) == (16.0, 512, g3["layer_types"])
    g3 = _config(tmp_path, "gemma3", block_count=4)
    assert g3["layer_types"] == ["full_attention"] * 4 and g3["sliding_window"] is None
    assert g3["query_pre_attn_scalar"] == 32
    period = _config(tmp_path, "gemma3", block_count=4,
                     **{"attention.sliding_window": 8, "attention.sliding_window_pattern": 3})  # fmt: skip
    assert period["layer_types"] == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    flags = _config(tmp_path, "gemma3", block_count=3,
                    **{"attention.sliding_window": 8, "attention.sliding_window_pattern": [False, True, True]})
    assert flags["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]


def _drop(key):
    return lambda tensors, w: w.kv_data[0].pop(key)


def _set(key, value, add="add_uint32"):
    return lambda tensors, w: getattr(w, add)(key, value)


def _tensor(name, array):
    return lambda tensors, w: tensors.__setitem__(name, (array, "f32"))


def _remove(name):
    return lambda tensors, w: tensors.pop(name)


BAD = {  # id: (case, edit of the written file, the error's text)
    "softcap": ("gemma2", _set("gemma2.attn_logit_softcapping", -1.0, "add_float32"),
                r"'gemma2\.attn_logit_softcapping' must be a positive number, got -1\.0"),
    "gemma2-swa-base": ("gemma2", _set("gemma2.rope.freq_base_swa", 5e4, "add_float32"),
                        r"'gemma2\.rope\.freq_base_swa'=50000\.0 differs from 'gemma2\.rope\.freq_base'"),
    "swa-pattern": ("gemma3", _set("gemma3.attention.sliding_window_pattern", [True, False], "add_array"),
                    r"'gemma3\.attention\.sliding_window_pattern' must be a period or 7 per-layer flags"),
    "experts-in-gemma": ("gemma2", _set("gemma2.expert_count", 4), r"'gemma2\.expert_count'"),
    "phi3-rope-dims": ("phi3-partial", _set("phi3.rope.dimension_count", 18),
                       r"'phi3\.rope\.dimension_count'=18 differs from the head size 16"),
    "phi3-factors": ("phi3-longrope-q8_0", _tensor("rope_factors_long.weight", np.ones(3, np.float32)),
                     r"'rope_factors_long\.weight' has 3 factors, expected rope\.dimension_count / 2 = 4"),
    "phi3-one-factor": ("phi3-longrope-q8_0", _remove("rope_factors_short.weight"),
                        r"only one of rope_factors_long\.weight / rope_factors_short\.weight"),
    "phi3-orig": ("phi3-longrope-q8_0", _drop("phi3.rope.scaling.original_context_length"),
                  r"'phi3\.rope\.scaling\.original_context_length' is missing"),
    "longrope-without-factors": ("phi3-partial", _set("phi3.rope.scaling.type", "longrope", "add_string"),
                                 r"'phi3\.rope\.scaling\.type' is 'longrope' but the file has no rope_factors"),
    "top-k": ("qwen3moe", _set("qwen3moe.expert_used_count", 7),
              r"'qwen3moe\.expert_used_count'=7 exceeds 'qwen3moe\.expert_count'=6"),
    "no-top-k": ("qwen3moe", _drop("qwen3moe.expert_used_count"), r"'qwen3moe\.expert_used_count' is missing"),
    "sigmoid": ("qwen2moe", _set("qwen2moe.expert_gating_func", 2),
                r"'qwen2moe\.expert_gating_func'=2: only softmax routing"),
    "expert-scale": ("qwen2moe", _set("qwen2moe.expert_weights_scale", 2.5, "add_float32"),
                     r"'qwen2moe\.expert_weights_scale'=2\.5"),
    "expert-width": ("qwen2moe", _set("qwen2moe.expert_feed_forward_length", 16),
                     r"'qwen2moe\.expert_feed_forward_length'=16 differs from the experts' width 32"),
    "shared-width": ("qwen2moe", _set("qwen2moe.expert_shared_feed_forward_length", 16),
                     r"'qwen2moe\.expert_shared_feed_forward_length'=16 differs from the shared expert's width 64"),
    "expert-count": ("qwen3moe", _set("qwen3moe.expert_count", 5),
                     r"'blk\.0\.ffn_gate_exps\.weight' has shape \(6, 32, 64\), expected \[qwen3moe\.expert_count=5"),
    "mixtral-norm": ("mixtral", _set("llama.expert_weights_norm", False, "add_bool"),
                     r"'llama\.expert_weights_norm' must be true or false \(true for Mixtral"),
    "mixtral-router": ("mixtral", _remove("blk.1.ffn_gate_inp.weight"),
                       r"mixture-of-experts file \('llama\.expert_count'=6\) has no router blk\.1\.ffn_gate_inp"),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_files_name_the_key(bad, tmp_path):
    case, edit, match = BAD[bad]
    kind, overrides, mode, swa_base = CASES[case]
    path = write_like_llama_cpp(tiny(kind, **overrides), tmp_path / "bad.gguf", kind, mode="f32", edit=edit)
    with pytest.raises(ValueError, match=rf"{match}.*bad\.gguf"):
        load_checkpoint(path)


def test_bad_expert_tensors_are_refused_before_loading(tmp_path):
    """A stacked-expert tensor of a later layer with another expert count, and experts in a file without any: the
    weights are refused when asked for, naming the tensor, before one is read."""
    path = write_like_llama_cpp(tiny("qwen3moe"), tmp_path / "e.gguf", "qwen3moe",
                                edit=_tensor("blk.1.ffn_up_exps.weight", np.zeros((5, 32, 64), np.float32)))
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up_exps\.weight' has shape \(5, 32, 64\), expected "
                                         r"\[qwen3moe\.expert_count=6.*e\.gguf"):  # fmt: skip
        load_checkpoint(path).weights()
    path = write_like_llama_cpp(tiny("gemma2"), tmp_path / "g.gguf", "gemma2",
                                edit=_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 96, 64), np.float32)))
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_exps\.weight' holds stacked experts, but "
                                         r"gemma2\.expert_count is not set.*g\.gguf"):  # fmt: skip
        load_checkpoint(path).weights()
