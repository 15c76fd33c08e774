"""GGUF -> Hugging Face view: an HF-style config dict and HF-named, HF-layout weights.

llama.cpp's converter renames tensors (``blk.{i}.attn_q.weight`` for
``model.layers.{i}.self_attn.q_proj.weight``) and, for the Llama family only, permutes the rows
of q_proj/k_proj from HF's rotate-half RoPE layout to ggml's interleaved-pair layout
(``LlamaModel.permute`` in convert_hf_to_gguf.py). Both are undone here, so the weights load into
an HF-layout model (neox-style RoPE) unchanged.
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
    # permute_qk: llama.cpp permuted q/k rows for this family; qk_norm: per-head q/k RMSNorm.
    "llama": {"model_type": "llama", "hf_class": "LlamaForCausalLM", "permute_qk": True},
    "mistral": {"model_type": "mistral", "hf_class": "MistralForCausalLM", "permute_qk": True},
    "qwen2": {"model_type": "qwen2", "hf_class": "Qwen2ForCausalLM", "permute_qk": False},
    "qwen3": {"model_type": "qwen3", "hf_class": "Qwen3ForCausalLM", "permute_qk": False},
}

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
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# Tensor types that hold float weights: those with a dequantizer (floats included) and F64.
WEIGHT_TYPES = DEQUANTIZABLE | {GGMLType.F64}
# Tensors llama.cpp adds that have no HF weight: RoPE frequency factors (folded into the config).
_NON_WEIGHTS = {"rope_freqs.weight"}


def _arch(gf: GGUFFile) -> tuple[str, dict[str, Any]]:
    arch = gf.architecture
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)}): {gf.path}"
        )
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


def _float(gf: GGUFFile, key: str, default: float) -> float:
    value = _scalar(gf, key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"GGUF metadata {key!r} must be a positive number, got {value!r}: {gf.path}")
    return float(value)


def hf_name(gguf_name: str) -> str | None:
    """The HF name for a llama-family GGUF tensor name, or None if it has no HF counterpart."""
    if gguf_name in _NON_WEIGHTS:
        return None
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
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
    declares scaling (``{arch}.rope.scaling.*`` or a llama3 ``rope_freqs`` tensor).
    """
    arch, spec = _arch(gf)
    k = lambda name: f"{arch}.{name}"
    hidden = _int(gf, k("embedding_length"), required=True)
    n_heads = _int(gf, k("attention.head_count"), required=True)
    n_kv = _int(gf, k("attention.head_count_kv"), n_heads)
    head_dim = _int(gf, k("attention.key_length"), hidden // n_heads)
    theta = _float(gf, k("rope.freq_base"), 10000.0)
    # The dense models here have one head size for q/k/v and rotate all of it; a file that differs
    # (partial RoPE, MLA-style value heads, experts) would load into a silently wrong model.
    for key, expected in (("attention.value_length", head_dim), ("rope.dimension_count", head_dim)):
        value = _int(gf, k(key), expected)
        if value != expected:
            raise ValueError(
                f"GGUF metadata {k(key)!r}={value} differs from the head size {head_dim}, not supported: {gf.path}"
            )
    if _int(gf, k("expert_count"), 0, minimum=0):
        raise ValueError(f"GGUF mixture-of-experts models ({k('expert_count')!r}) are not supported: {gf.path}")
    if "token_embd.weight" not in gf.tensors:
        raise ValueError(f"GGUF file has no token_embd.weight: {gf.path}")
    vocab = gf.tensors["token_embd.weight"].shape[0]

    config: dict[str, Any] = {
        "architectures": [spec["hf_class"]],
        "model_type": spec["model_type"],
        "hidden_size": hidden,
        "intermediate_size": _int(gf, k("feed_forward_length"), required=True),
        "num_hidden_layers": _int(gf, k("block_count"), required=True),
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
    if scaling_type and scaling_type != "none":
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
    return config


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

    Raises ValueError, when called, if any tensor has no HF counterpart (rather than dropping
    it). The q/k rows of Llama-family files are un-permuted (``unpermute_qk``).
    """
    arch, spec = _arch(gf)
    heads = {"self_attn.q_proj": _int(gf, f"{arch}.attention.head_count", required=True)}
    heads["self_attn.k_proj"] = _int(gf, f"{arch}.attention.head_count_kv", heads["self_attn.q_proj"])
    # Map and type-check every tensor before yielding anything, so an unsupported file fails before
    # any loading.
    targets: list[tuple[str, str]] = []
    for name, info in gf.tensors.items():
        try:
            target = hf_name(name)
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
    return _hf_weights(gf, targets, heads if spec["permute_qk"] else {}, dtype)


def _hf_weights(
    gf: GGUFFile, targets: list[tuple[str, str]], heads: dict[str, int], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, target in targets:
        t = gf.tensor(name, dtype=torch.float32)
        module = target.split(".", 3)[-1].rsplit(".", 1)[0]  # e.g. "self_attn.q_proj"
        if module in heads:
            t = unpermute_qk(t, heads[module])
        yield target, t if dtype is None else t.to(dtype)
