"""Sparse-MoE decoders on the Llama attention: Mixtral, Qwen2-MoE and Qwen3-MoE.

The attention, norms, RoPE and KV layout are :mod:`infercore.models.llama`'s; the MLP of each sparse
layer is a :class:`~infercore.models.moe.SparseMoeBlock` (top-k routed experts, stacked ``[E, 2I, H]`` /
``[E, H, I]``, plus Qwen2-MoE's sigmoid-gated shared expert), dense layers keep a
:class:`~infercore.models.llama.LlamaMLP`. Which layers are sparse follows each family's HF modeling
code: every layer for Mixtral; for the Qwen families layer ``i`` unless ``i`` is in ``mlp_only_layers``,
and only when ``(i + 1) % decoder_sparse_step == 0``.

Checkpoints keep their HF names (per-expert tensors, as ``save_pretrained`` writes them: Qwen's
``mlp.experts.{e}.{gate,up,down}_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2`` and
``block_sparse_moe.gate``); :meth:`MoeLlamaForCausalLM.load_weights` stacks them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from .config import ModelConfig, _parse_labels
from .hybrid import load_hf_weights
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaForSequenceClassification
from .moe import SparseMoeBlock

# HF model_type -> (the dense family whose attention / RoPE / window rules it shares, its architecture name)
MOE_FAMILIES = {
    "mixtral": ("mistral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen2", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen3", "Qwen3MoeForCausalLM"),
}
# Their sequence classifiers: the decoder plus ``score`` [num_labels, hidden], no lm_head (tied in the module).
MOE_CLASSIFIERS = {
    "mixtral": "MixtralForSequenceClassification",
    "qwen2_moe": "Qwen2MoeForSequenceClassification",
    "qwen3_moe": "Qwen3MoeForSequenceClassification",
}


@dataclass
class MoeModelConfig(ModelConfig):
    """:class:`ModelConfig` plus the experts. ``intermediate_size`` is the dense layers' MLP width (for
    Mixtral, which has none, the expert width); ``sparse_layers[i]`` says whether layer ``i`` is routed."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 1
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.sparse_layers:
            self.sparse_layers = [True] * self.num_layers
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"MoeModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoeModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be <= "
                             f"num_experts={self.num_experts}")  # fmt: skip
        s = self.shared_expert_intermediate_size
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"MoeModelConfig.shared_expert_intermediate_size must be an int >= 0, got {s!r}")
        if len(self.sparse_layers) != self.num_layers or not all(isinstance(b, bool) for b in self.sparse_layers):
            raise ValueError(f"MoeModelConfig.sparse_layers must be {self.num_layers} bools, "
                             f"got {self.sparse_layers!r}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> MoeModelConfig:
        """Build from an HF ``config.json`` dict of a Mixtral / Qwen2-MoE / Qwen3-MoE checkpoint.

        The attention side is parsed by :meth:`ModelConfig.from_hf` under the dense family's rules (so Qwen2-MoE
        keeps its q/k/v bias, Qwen3-MoE its q/k norms, Mixtral its window); ``ValueError`` names a missing or
        malformed expert key."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in MOE_FAMILIES:
            raise ValueError(f"model_type={model_type!r} is not a sparse-MoE family; supported: {sorted(MOE_FAMILIES)}")
        base, arch = MOE_FAMILIES[model_type]
        archs = hf.get("architectures") or [arch]
        classifier = archs == [MOE_CLASSIFIERS[model_type]]
        if archs != [arch] and not classifier:
            raise ValueError(f"HF config architectures={archs!r} is not supported for model_type={model_type!r}; "
                             f"expected [{arch!r}] or [{MOE_CLASSIFIERS[model_type]!r}]")  # fmt: skip

        def positive_int(key: str, default: Any = None) -> int:
            v = hf.get(key, default)
            if v is None:
                v = default
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"HF config key {key!r} must be a positive int, got {v!r}")
            return v

        num_layers = positive_int("num_hidden_layers")
        if model_type == "mixtral":
            num_experts = positive_int("num_local_experts")
            expert_width = positive_int("intermediate_size")
            shared, norm_topk, sparse = 0, True, [True] * num_layers
        else:
            # transformers 5 writes num_local_experts for every family; hub checkpoints of the Qwen ones num_experts
            num_experts = positive_int("num_experts" if hf.get("num_experts") is not None else "num_local_experts")
            expert_width = positive_int("moe_intermediate_size")
            shared = (hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
            if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
                raise ValueError(f"HF config key 'shared_expert_intermediate_size' must be an int >= 0, got {shared!r}")
            norm_topk = hf.get("norm_topk_prob", False)
            if not isinstance(norm_topk, bool):
                raise ValueError(f"HF config key 'norm_topk_prob' must be true or false, got {norm_topk!r}")
            step = positive_int("decoder_sparse_step", 1)
            only = hf.get("mlp_only_layers") or []
            if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
                raise ValueError(f"HF config key 'mlp_only_layers' must be a list of layer indices, got {only!r}")
            sparse = [i not in only and (i + 1) % step == 0 for i in range(num_layers)]
        dense = dict(hf)
        dense.update(model_type=base, architectures=None)
        if model_type == "qwen3_moe" and hf.get("head_dim") is None:
            # Qwen3's own default head_dim (128) is not Qwen3-MoE's, which derives it from the hidden size.
            dense["head_dim"] = positive_int("hidden_size") // positive_int("num_attention_heads")
        if dense.get("intermediate_size") is None:
            dense["intermediate_size"] = expert_width  # no dense layer reads it then
        base_cfg = ModelConfig.from_hf(dense)
        values = {f.name: getattr(base_cfg, f.name) for f in fields(ModelConfig)}
        values.update(model_type=model_type, architecture=arch)
        if classifier:
            values.update(architecture=archs[0], labels=_parse_labels(hf), tie_word_embeddings=True)
        if model_type == "qwen2_moe":  # its q/k/v bias is a config key (Qwen2 hard-codes it)
            qkv_bias = hf.get("qkv_bias", True)
            if not isinstance(qkv_bias, bool):
                raise ValueError(f"HF config key 'qkv_bias' must be true or false, got {qkv_bias!r}")
            values["attention_bias"] = qkv_bias
        return cls(**values, num_experts=num_experts, num_experts_per_tok=positive_int("num_experts_per_tok"),
                   moe_intermediate_size=expert_width, shared_expert_intermediate_size=shared,
                   norm_topk_prob=norm_topk, sparse_layers=sparse)  # fmt: skip


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose MLP is routed experts when ``config.sparse_layers[layer]``."""

    def __init__(self, config: MoeModelConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, layer, dtype=dtype)
        if config.sparse_layers[layer]:
            self.mlp = SparseMoeBlock(
                config.hidden_size, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                intermediate=config.moe_intermediate_size, shared_intermediate=config.shared_expert_intermediate_size,
                renormalize=config.norm_topk_prob, dtype=dtype)  # fmt: skip


class MoeLlamaForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE over paged KV: :class:`LlamaForCausalLM` with routed MLPs."""

    def __init__(self, config: MoeModelConfig, *, dtype: torch.dtype | None = None) -> None:
        if not isinstance(config, MoeModelConfig):
            raise TypeError(f"config: expected a MoeModelConfig, got {type(config).__name__}")
        super().__init__(config, dtype=dtype)
        self.model.layers = nn.ModuleList(MoeDecoderLayer(config, i, dtype=dtype) for i in range(config.num_layers))

    _ATTN = re.compile(r"^(model\.layers\.\d+\.self_attn\.)(q|k|v)_proj\.(weight|bias)$")
    _DENSE = re.compile(r"^(model\.layers\.\d+\.mlp\.(?:shared_expert\.)?)(gate|up)_proj\.weight$")
    _QWEN_EXPERT = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
    _MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(?:experts\.(\d+)\.(w1|w2|w3)|(gate))\.weight$")
    _IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

    def _resolve(self, name: str) -> tuple[str, Any]:
        cfg = self.config
        if m := self._ATTN.match(name):
            prefix, proj, kind = m.groups()
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[proj]
            return f"{prefix}qkv_proj.{kind}", slice(*rows)
        if m := self._DENSE.match(name):
            prefix, proj = m.groups()
            i = cfg.shared_expert_intermediate_size if "shared_expert" in prefix else cfg.intermediate_size
            return f"{prefix}gate_up_proj.weight", slice(0, i) if proj == "gate" else slice(i, 2 * i)
        expert = None
        if m := self._QWEN_EXPERT.match(name):
            prefix, e, proj = m.groups()
            expert = prefix, int(e), proj
        elif m := self._MIXTRAL.match(name):
            prefix, e, w, gate = m.groups()
            if gate:
                return f"{prefix}mlp.gate.weight", None
            expert = prefix, int(e), {"w1": "gate", "w3": "up", "w2": "down"}[w]
        if expert is not None:
            prefix, e, proj = expert
            i = cfg.moe_intermediate_size
            if proj == "down":
                return f"{prefix}mlp.experts.down_proj", e
            return f"{prefix}mlp.experts.gate_up_proj", (e, slice(0, i) if proj == "gate" else slice(i, 2 * i))
        return name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, stacking per-expert ones (``ValueError`` naming an unknown, duplicate,
        misshapen or missing tensor)."""
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return bool(self._IGNORED.search(name)) or (tied and name == "lm_head.weight")

        load_hf_weights(self, weights, self._resolve, arch=self.config.architecture, ignore=ignore)
        if tied:  # load_hf_weights wrote the embedding; the head shares it
            self.lm_head.weight = self.model.embed_tokens.weight


class MoeLlamaForSequenceClassification(MoeLlamaForCausalLM, LlamaForSequenceClassification):
    """Mixtral / Qwen2-MoE / Qwen3-MoE with HF's sequence-classification head (``score`` at the last token)."""


__all__ = ["MOE_CLASSIFIERS", "MOE_FAMILIES", "MoeDecoderLayer", "MoeLlamaForCausalLM",
           "MoeLlamaForSequenceClassification", "MoeModelConfig"]
