"""GGUF -> Hugging Face view: an HF-style config dict and HF-named, HF-layout weights.

llama.cpp's converter (``convert_hf_to_gguf.py``) renames tensors (``blk.{i}.attn_q.weight`` for
``model.layers.{i}.self_attn.q_proj.weight``) and changes some of them; everything is undone here, so the weights load
into the HF-layout model exactly as an HF checkpoint's would:

* Llama family (``llama``, ``mistral``, Mixtral): the rows of q_proj/k_proj (weights and biases) are permuted from HF's
  rotate-half RoPE layout to ggml's interleaved pairs (``LlamaModel.permute``); :func:`unpermute_qk` restores them.
  Every other architecture here runs NEOX-style RoPE in llama.cpp and is stored unpermuted.
* Gemma 2 / 3: the RMSNorm weights are stored as ``1 + w`` (the converter adds 1 to every ``*norm.weight``: the four
  per-layer norms, the final norm and Gemma 3's q/k norms); 1 is subtracted again.
* Phi-3: ``attn_qkv`` and ``ffn_up`` hold the fused q/k/v and gate/up projections in HF's row order; they map to
  ``qkv_proj`` / ``gate_up_proj`` unchanged. LongRoPE's ``rope_factors_long`` / ``rope_factors_short`` become
  ``rope_scaling``.
* Mixture of experts (Mixtral as ``llama`` with ``expert_count``, ``qwen2moe``, ``qwen3moe``): the experts of a layer
  are stacked into ``ffn_{gate,up,down}_exps`` ``[E, I, H]`` / ``[E, H, I]``; they are yielded one HF tensor per
  expert (``mlp.experts.{e}.gate_proj`` / Mixtral's ``block_sparse_moe.experts.{e}.w1``), the router
  ``ffn_gate_inp`` as ``mlp.gate`` / ``block_sparse_moe.gate``, Qwen2-MoE's shared expert ``ffn_*_shexp`` and its gate
  ``ffn_gate_inp_shexp`` (stored 1-D) as ``mlp.shared_expert.*`` / ``mlp.shared_expert_gate`` ``[1, H]``.

Hyperparameters the file does not store are derived the way llama.cpp's loader derives them (``llama-model.cpp``):
Gemma's attention scale (``query_pre_attn_scalar`` = head size, hidden size / heads for the 62-layer Gemma 3 27B and
the 46-layer Gemma 2 27B), its sliding-window layer pattern (every 2nd / 6th layer full) and the local RoPE base of
Gemma 3 (10000), Gemma 2's softcaps (50 / 30) when absent, and the routing weights' renormalisation (Qwen3-MoE and
Mixtral yes, Qwen2-MoE no).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .gguf_quants import DEQUANTIZABLE, GGMLType

if TYPE_CHECKING:
    from .gguf import GGUFFile

_ARCHS: dict[str, dict[str, Any]] = {
    # permute_qk: llama.cpp permuted q/k rows for this family.
    "llama": {"model_type": "llama", "hf_class": "LlamaForCausalLM", "permute_qk": True},
    "mistral": {"model_type": "mistral", "hf_class": "MistralForCausalLM", "permute_qk": True},
    "qwen2": {"model_type": "qwen2", "hf_class": "Qwen2ForCausalLM", "permute_qk": False},
    "qwen3": {"model_type": "qwen3", "hf_class": "Qwen3ForCausalLM", "permute_qk": False},
    "gemma2": {"model_type": "gemma2", "hf_class": "Gemma2ForCausalLM", "permute_qk": False},
    "gemma3": {"model_type": "gemma3_text", "hf_class": "Gemma3ForCausalLM", "permute_qk": False},
    "phi3": {"model_type": "phi3", "hf_class": "Phi3ForCausalLM", "permute_qk": False},
    "qwen2moe": {"model_type": "qwen2_moe", "hf_class": "Qwen2MoeForCausalLM", "permute_qk": False},
    "qwen3moe": {"model_type": "qwen3_moe", "hf_class": "Qwen3MoeForCausalLM", "permute_qk": False},
}
# llama.cpp writes Mixtral as architecture "llama" with an expert count.
_MIXTRAL = {"model_type": "mixtral", "hf_class": "MixtralForCausalLM", "permute_qk": True}
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP, as in Llama, but HF names it differently.
_GEMMA_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate rows, then up rows: HF's order
}
_QWEN_MOE_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k not in ("ffn_gate", "ffn_up", "ffn_down")},  # no dense FFN
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_NAMES = {
    "llama": {**_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"},  # Mixtral's router
    "mistral": _LAYER_NAMES,
    "qwen2": _LAYER_NAMES,
    "qwen3": _LAYER_NAMES,
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": _PHI3_NAMES,
    "qwen2moe": _QWEN_MOE_NAMES,
    "qwen3moe": _QWEN_MOE_NAMES,
}
# Stacked experts: GGUF kind -> projection; per architecture the HF per-expert name of each projection.
_EXPERT_KINDS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_QWEN_EXPERT = {p: f"mlp.experts.{{e}}.{p}_proj" for p in ("gate", "up", "down")}
_EXPERT_NAMES = {
    "llama": {"gate": "block_sparse_moe.experts.{e}.w1", "up": "block_sparse_moe.experts.{e}.w3",
              "down": "block_sparse_moe.experts.{e}.w2"},
    "qwen2moe": _QWEN_EXPERT,
    "qwen3moe": _QWEN_EXPERT,
}  # fmt: skip
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# Tensor types that hold float weights: those with a dequantizer (floats included) and F64.
WEIGHT_TYPES = DEQUANTIZABLE | {GGMLType.F64}
# Tensors llama.cpp adds that have no HF weight: RoPE frequency factors (folded into the config).
_NON_WEIGHTS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# llama.cpp's attention scale for Gemma is 1/sqrt(hidden / heads) for the 27B models, which it recognises by their
# layer count; 1/sqrt(head size) otherwise.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_SOFTMAX_GATING = (0, 1)  # llama_expert_gating_func_type: NONE (the architecture's default, softmax here), SOFTMAX


def _arch(gf: GGUFFile) -> tuple[str, dict[str, Any]]:
    arch = gf.architecture
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)}): {gf.path}"
        )
    if arch == "llama" and _int(gf, "llama.expert_count", 0, minimum=0):
        return arch, _MIXTRAL
    return arch, _ARCHS[arch]


def _scalar(gf: GGUFFile, key: str, default: Any = None, *, required: bool = False) -> Any:
    value = gf.get(key, default)
    if value is None and required:
        raise ValueError(f"GGUF metadata key {key!r} is missing: {gf.path}")
    if isinstance(value, list):
        raise ValueError(f"GGUF metadata {key!r} is per-layer ({value[:4]}...), not supported: {gf.path}")
    return value


def _int(gf: GGUFFile, key: str, default: Any = None, *, required: bool = False, minimum: int = 1) -> Any:
    """An integer metadata value (None when absent and not required); int() would truncate a float."""
    value = _scalar(gf, key, default, required=required)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise ValueError(f"GGUF metadata {key!r} must be an integer >= {minimum}, got {value!r}: {gf.path}")
    return value


def _float(gf: GGUFFile, key: str, default: float | None) -> float | None:
    """A positive number (``default`` when absent, which may be None)."""
    value = _scalar(gf, key, default)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"GGUF metadata {key!r} must be a positive number, got {value!r}: {gf.path}")
    return float(value)


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The HF name of a GGUF tensor of architecture ``arch`` (default ``"llama"``), or None where it has no single HF
    counterpart: RoPE factor tensors (folded into the config) and stacked experts ``blk.{i}.ffn_*_exps`` (one HF tensor
    per expert: :func:`gguf_hf_weights` splits them). Raises ValueError for an unknown name."""
    names = _NAMES.get(arch or "llama")
    if names is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_NAMES)})")
    if gguf_name in _NON_WEIGHTS:
        return None
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _EXPERT_KINDS and (arch or "llama") in _EXPERT_NAMES:
        return None
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")


def _llama3_rope_scaling(factors: torch.Tensor, *, head_dim: int, theta: float, path: Any) -> dict[str, Any]:
    """Recover HF's ``llama3`` rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp bakes Llama-3.1 scaling into per-frequency divisors; HF describes the same curve by
    (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings). Every released
    Llama 3.x uses low=1, high=4, original=8192 with factor = the largest divisor; the curve
    is recomputed from those and must match, so a file that used other values fails loudly instead
    of loading with a silently wrong RoPE.
    """
    factor = float(factors.max())
    low, high, orig = 1.0, 4.0, 8192
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    expected = torch.where(
        wavelen < orig / high,
        torch.ones_like(wavelen),
        torch.where(
            wavelen > orig / low, torch.full_like(wavelen, factor), 1 / ((1 - smooth) / factor + smooth)
        ),
    )
    if expected.shape != factors.shape or not torch.allclose(factors.double(), expected, rtol=1e-4):
        raise ValueError(f"rope_freqs.weight does not match any known llama3 RoPE scaling: {path}")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


def gguf_to_hf_config(gf: GGUFFile) -> dict[str, Any]:
    """An HF ``config.json``-style dict (transformers 4.x keys: ``rope_theta``, ``rope_scaling``).

    ``tie_word_embeddings`` is true when the file has no ``output.weight`` (llama.cpp omits the
    output projection when it is the embedding). ``rope_scaling`` is present only when the file
    declares scaling (``{arch}.rope.scaling.*``, a llama3 ``rope_freqs`` tensor or Phi-3's LongRoPE factor tensors).
    Gemma and mixture-of-experts files get their family's keys too (``layer_types``, ``query_pre_attn_scalar``,
    the softcaps; ``num_experts`` / ``num_local_experts``, ``moe_intermediate_size``, ``mlp_only_layers`` ...).
    Raises ValueError naming the metadata key or tensor for a missing or malformed value.
    """
    arch, spec = _arch(gf)
    k = lambda name: f"{arch}.{name}"
    model_type = spec["model_type"]
    hidden = _int(gf, k("embedding_length"), required=True)
    n_heads = _int(gf, k("attention.head_count"), required=True)
    n_kv = _int(gf, k("attention.head_count_kv"), n_heads)
    n_layers = _int(gf, k("block_count"), required=True)
    head_dim = _int(gf, k("attention.key_length"), hidden // n_heads)
    theta = _float(gf, k("rope.freq_base"), 10000.0)
    # One head size for q/k/v, all of it rotated (Phi-3 rotates a leading part of it): a file that differs (MLA-style
    # value heads, partial RoPE elsewhere) would load into a silently wrong model.
    value_dim = _int(gf, k("attention.value_length"), head_dim)
    if value_dim != head_dim:
        raise ValueError(f"GGUF metadata {k('attention.value_length')!r}={value_dim} differs from the head size "
                         f"{head_dim}, not supported: {gf.path}")  # fmt: skip
    rope_dim = _int(gf, k("rope.dimension_count"), head_dim)
    if rope_dim != head_dim and not (model_type == "phi3" and rope_dim < head_dim and rope_dim % 2 == 0):
        raise ValueError(f"GGUF metadata {k('rope.dimension_count')!r}={rope_dim} differs from the head size "
                         f"{head_dim}, not supported: {gf.path}")  # fmt: skip
    if model_type not in _MOE_TYPES and _int(gf, k("expert_count"), 0, minimum=0):
        raise ValueError(f"GGUF mixture-of-experts models ({k('expert_count')!r}) are not supported for architecture "
                         f"{arch!r}: {gf.path}")  # fmt: skip
    if "token_embd.weight" not in gf.tensors:
        raise ValueError(f"GGUF file has no token_embd.weight: {gf.path}")
    vocab = gf.tensors["token_embd.weight"].shape[0]

    config: dict[str, Any] = {
        "architectures": [spec["hf_class"]],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _int(gf, k("feed_forward_length"), required=True),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _float(gf, k("attention.layer_norm_rms_epsilon"), 1e-5),
        "rope_theta": theta,
        "max_position_embeddings": _int(gf, k("context_length"), 2048),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gf.tensors,
        "tie_word_embeddings": "output.weight" not in gf.tensors,
    }
    if rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
        if int(head_dim * config["partial_rotary_factor"]) != rope_dim:  # HF's rotary size: int(head_dim * factor)
            raise ValueError(f"GGUF metadata {k('rope.dimension_count')!r}={rope_dim} is not a fraction of the head "
                             f"size {head_dim} that HF reproduces: {gf.path}")  # fmt: skip
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = _int(gf, f"tokenizer.ggml.{gguf_key}", minimum=0)
        if value is not None:
            config[hf_key] = value
    window = _int(gf, k("attention.sliding_window"), minimum=0)
    if window:
        config["sliding_window"] = window

    scaling_type = _scalar(gf, k("rope.scaling.type"))
    if scaling_type is not None and not isinstance(scaling_type, str):
        raise ValueError(f"GGUF metadata {k('rope.scaling.type')!r} must be a string, got {scaling_type!r}: {gf.path}")
    if scaling_type and scaling_type not in ("none", "longrope"):
        scaling: dict[str, Any] = {
            "rope_type": scaling_type,
            "factor": _float(gf, k("rope.scaling.factor"), 1.0),
        }
        orig = _int(gf, k("rope.scaling.original_context_length"), minimum=0)
        if orig:
            scaling["original_max_position_embeddings"] = orig
        config["rope_scaling"] = scaling
    elif "rope_freqs.weight" in gf.tensors:
        factors = gf.tensor("rope_freqs.weight", dtype=torch.float32)
        config["rope_scaling"] = _llama3_rope_scaling(factors, head_dim=head_dim, theta=theta, path=gf.path)

    if arch in ("gemma2", "gemma3"):
        _gemma_config(gf, arch, config, window)
    elif model_type == "phi3":
        _phi3_config(gf, config, rope_dim)
    elif model_type in _MOE_TYPES:
        _moe_config(gf, arch, config, window)
    if scaling_type == "longrope" and "rope_scaling" not in config:
        raise ValueError(f"GGUF metadata {k('rope.scaling.type')!r} is 'longrope' but the file has no "
                         f"rope_factors_long.weight / rope_factors_short.weight: {gf.path}")  # fmt: skip
    return config


def _swa_layers(gf: GGUFFile, key: str, num_layers: int, period: int) -> list[str]:
    """HF ``layer_types`` from ``{arch}.attention.sliding_window_pattern`` as llama.cpp reads it: a period p (layer i
    slides when ``i % p < p - 1``: the last layer of each period is full; p = 0 every layer slides, 1 none), or one
    flag per layer (true: sliding); ``period`` when absent."""
    value = gf.get(key, period)
    if isinstance(value, list):
        if len(value) != num_layers or not all(isinstance(v, (bool, int)) for v in value):
            raise ValueError(f"GGUF metadata {key!r} must be a period or {num_layers} per-layer flags, got "
                             f"{value[:8]}...: {gf.path}")  # fmt: skip
        return ["sliding_attention" if v else "full_attention" for v in value]
    p = _int(gf, key, period, minimum=0)
    return ["sliding_attention" if p == 0 or i % p < p - 1 else "full_attention" for i in range(num_layers)]


def _gemma_config(gf: GGUFFile, arch: str, config: dict[str, Any], window: int | None) -> None:
    k = lambda name: f"{arch}.{name}"
    n = config["num_hidden_layers"]
    gemma2 = arch == "gemma2"
    if gemma2 and window is None:
        window = 4096  # llama.cpp's Gemma 2 always slides; this is its default window
    layer_types = ["full_attention"] * n
    if window:  # Gemma 3 without a window: every layer attends to everything (llama.cpp's LLAMA_SWA_TYPE_NONE)
        layer_types = _swa_layers(gf, k("attention.sliding_window_pattern"), n, 2 if gemma2 else 6)
    large = n == _GEMMA_27B_LAYERS[arch]
    local_theta = _float(gf, k("rope.freq_base_swa"), config["rope_theta"] if gemma2 else 10000.0)
    if gemma2 and local_theta != config["rope_theta"]:
        raise ValueError(f"GGUF metadata {k('rope.freq_base_swa')!r}={local_theta} differs from "
                         f"{k('rope.freq_base')!r}={config['rope_theta']}: one RoPE base for every layer is "
                         f"supported for Gemma 2: {gf.path}")  # fmt: skip
    config.update(
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=window or None,
        layer_types=layer_types,
        query_pre_attn_scalar=config["hidden_size"] // config["num_attention_heads"] if large else config["head_dim"],
        final_logit_softcapping=_float(gf, k("final_logit_softcapping"), 30.0 if gemma2 else None),
        # Gemma 3 has no attention softcap (llama.cpp ignores the key for it)
        attn_logit_softcapping=_float(gf, k("attn_logit_softcapping"), 50.0) if gemma2 else None,
    )
    if not gemma2:
        config["rope_local_base_freq"] = local_theta


def _phi3_config(gf: GGUFFile, config: dict[str, Any], rope_dim: int) -> None:
    orig = _int(gf, "phi3.rope.scaling.original_context_length")
    if orig is not None:
        config["original_max_position_embeddings"] = orig
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    present = [n in gf.tensors for n in names]
    if not any(present):
        return
    if not all(present):
        raise ValueError(f"GGUF file has only one of {names[0]} / {names[1]} (LongRoPE needs both): {gf.path}")
    if orig is None:
        raise ValueError(f"GGUF metadata key 'phi3.rope.scaling.original_context_length' is missing (LongRoPE): "
                         f"{gf.path}")  # fmt: skip
    long, short = (gf.tensor(n, dtype=torch.float32).reshape(-1) for n in names)
    for name, f in zip(names, (long, short)):
        if f.numel() != rope_dim // 2:
            raise ValueError(f"GGUF tensor {name!r} has {f.numel()} factors, expected rope.dimension_count / 2 = "
                             f"{rope_dim // 2}: {gf.path}")  # fmt: skip
    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}
    # The converter writes LongRoPE's attention factor, which HF derives from the context extension; a file whose
    # factor is another (Phi-3's "yarn" variant) keeps it.
    attn = _float(gf, "phi3.rope.scaling.attn_factor", None)
    factor = config["max_position_embeddings"] / orig
    derived = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    if attn is not None and not math.isclose(attn, derived, rel_tol=1e-6):
        scaling["attention_factor"] = attn
    config["rope_scaling"] = scaling


def _moe_config(gf: GGUFFile, arch: str, config: dict[str, Any], window: int | None) -> None:
    k = lambda name: f"{arch}.{name}"
    model_type = config["model_type"]
    n_experts = _int(gf, k("expert_count"), required=True)
    # llama.cpp's tensor lists for these architectures have no dense FFN: every layer is routed.
    unrouted = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in gf.tensors]
    if unrouted:
        raise ValueError(f"GGUF mixture-of-experts file ({k('expert_count')!r}={n_experts}) has no router "
                         f"blk.{unrouted[0]}.ffn_gate_inp.weight (every layer of {arch!r} is routed): {gf.path}")
    top_k = _int(gf, k("expert_used_count"), required=True)
    if top_k > n_experts:
        raise ValueError(f"GGUF metadata {k('expert_used_count')!r}={top_k} exceeds {k('expert_count')!r}="
                         f"{n_experts}: {gf.path}")  # fmt: skip
    gating = _int(gf, k("expert_gating_func"), minimum=0)
    if gating not in (None, *_SOFTMAX_GATING):
        raise ValueError(f"GGUF metadata {k('expert_gating_func')!r}={gating}: only softmax routing is supported: "
                         f"{gf.path}")  # fmt: skip
    scale = _scalar(gf, k("expert_weights_scale"))
    if scale not in (None, 0, 1):
        raise ValueError(f"GGUF metadata {k('expert_weights_scale')!r}={scale!r}: scaled routing weights are not "
                         f"supported: {gf.path}")  # fmt: skip
    # llama.cpp renormalises the top-k weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE, unless the file says.
    norm = gf.get(k("expert_weights_norm"), model_type != "qwen2_moe")
    if not isinstance(norm, bool) or (model_type == "mixtral" and not norm):
        raise ValueError(f"GGUF metadata {k('expert_weights_norm')!r} must be true or false (true for Mixtral, "
                         f"which always renormalises), got {norm!r}: {gf.path}")  # fmt: skip
    width = _expert_width(gf, "blk.0.ffn_gate_exps.weight", n_experts, k("expert_count"))
    declared = _int(gf, k("expert_feed_forward_length"))
    if declared is not None and declared != width:
        raise ValueError(f"GGUF metadata {k('expert_feed_forward_length')!r}={declared} differs from the experts' "
                         f"width {width} in blk.0.ffn_gate_exps.weight: {gf.path}")  # fmt: skip
    config["num_experts_per_tok"] = top_k
    if model_type == "mixtral":
        # intermediate_size is the experts' width for Mixtral; an explicit null window (no key: HF's default is none)
        config.update(num_local_experts=n_experts, intermediate_size=width, sliding_window=window or None)
        return
    config.update(num_experts=n_experts, moe_intermediate_size=width, norm_topk_prob=norm, decoder_sparse_step=1,
                  mlp_only_layers=[])  # fmt: skip
    if model_type == "qwen2_moe":
        shexp = gf.tensors.get("blk.0.ffn_gate_shexp.weight")
        shared = shexp.shape[0] if shexp is not None else 0
        declared = _int(gf, k("expert_shared_feed_forward_length"), minimum=0)
        if declared is not None and declared != shared:
            raise ValueError(f"GGUF metadata {k('expert_shared_feed_forward_length')!r}={declared} differs from the "
                             f"shared expert's width {shared} in blk.0.ffn_gate_shexp.weight: {gf.path}")
        config.update(shared_expert_intermediate_size=shared, qkv_bias=config["attention_bias"])


def _expert_width(gf: GGUFFile, name: str, n_experts: int, count_key: str) -> int:
    info = gf.tensors.get(name)
    if info is None:
        raise ValueError(f"GGUF file has a router but no {name}: {gf.path}")
    if len(info.shape) != 3 or info.shape[0] != n_experts:
        raise ValueError(f"GGUF tensor {name!r} has shape {info.shape}, expected [{count_key}={n_experts}, "
                         f"width, hidden]: {gf.path}")  # fmt: skip
    return info.shape[1]


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> HF rotate-half).

    ``w``: ``[n_head * head_dim, ...]`` (weight ``[rows, hidden]`` or bias ``[rows]``). Within each
    head, llama.cpp stores row ``2*i + j`` where HF has row ``j*head_dim/2 + i``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"w: {rows} rows do not split into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_hf_weights(
    gf: GGUFFile, *, dtype: torch.dtype | None = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every weight, dequantized to ``dtype`` (fp32 first), in file order.

    Raises ValueError, when called, if any tensor has no HF counterpart (rather than dropping it). The q/k rows of
    Llama-family files are un-permuted (``unpermute_qk``), Gemma's ``1 + w`` norms are stored back as ``w``, and each
    stacked expert tensor ``[E, ...]`` gives E per-expert HF tensors (views of one dequantized tensor).
    """
    arch, spec = _arch(gf)
    heads = {"self_attn.q_proj": _int(gf, f"{arch}.attention.head_count", required=True)}
    heads["self_attn.k_proj"] = _int(gf, f"{arch}.attention.head_count_kv", heads["self_attn.q_proj"])
    moe = spec["model_type"] in _MOE_TYPES
    n_experts = _int(gf, f"{arch}.expert_count", required=True) if moe else 0
    # Map and type-check every tensor before yielding anything, so an unsupported file fails before
    # any loading.
    targets: list[tuple[str, str]] = []
    for name, info in gf.tensors.items():
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _EXPERT_KINDS:
            if not moe:
                raise ValueError(f"GGUF tensor {name!r} holds stacked experts, but {arch}.expert_count is not set "
                                 f"(architecture {arch!r}): {gf.path}")  # fmt: skip
            if m.group(3) != "weight" or len(info.shape) != 3 or info.shape[0] != n_experts:
                raise ValueError(f"GGUF tensor {name!r} has shape {info.shape}, expected [{arch}.expert_count="
                                 f"{n_experts}, rows, cols] weights: {gf.path}")  # fmt: skip
            expert = _EXPERT_NAMES[arch][_EXPERT_KINDS[m.group(2)]]
            target = f"model.layers.{m.group(1)}.{expert}.weight"  # "{e}" filled per expert
        else:
            try:
                target = hf_name(name, arch)
            except ValueError as e:
                raise ValueError(f"{e} (architecture {arch!r}): {gf.path}") from None
            if target is None:
                continue
        # Integer tensors would be cast to float without complaint: a weight is never stored so.
        if info.ggml_type not in WEIGHT_TYPES:
            raise ValueError(
                f"GGUF tensor {name!r} has type {info.ggml_type.name}, which cannot be loaded as a weight "
                f"(supported: {sorted(t.name for t in WEIGHT_TYPES)}): {gf.path}"
            )
        targets.append((name, target))
    norm_offset = arch in ("gemma2", "gemma3")
    return _hf_weights(gf, targets, heads if spec["permute_qk"] else {}, dtype, norm_offset)


def _hf_weights(
    gf: GGUFFile, targets: list[tuple[str, str]], heads: dict[str, int], dtype: torch.dtype | None,
    norm_offset: bool,
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    for name, target in targets:
        t = gf.tensor(name, dtype=torch.float32)
        if "{e}" in target:
            for e in range(t.shape[0]):
                yield target.format(e=e), t[e] if dtype is None else t[e].to(dtype)
            continue
        module = target.split(".", 3)[-1].rsplit(".", 1)[0]  # e.g. "self_attn.q_proj"
        if module in heads:
            t = unpermute_qk(t, heads[module])
        elif norm_offset and target.endswith("norm.weight"):
            t = t - 1.0  # the converter stored Gemma's (1 + w)
        elif target.endswith(".shared_expert_gate.weight") and t.ndim == 1:
            t = t.unsqueeze(0)  # llama.cpp keeps the [1, H] gate as a vector
        yield target, t if dtype is None else t.to(dtype)
