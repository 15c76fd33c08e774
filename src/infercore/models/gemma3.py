"""Gemma 3 (text) and Gemma 2 decoders: interleaved local (sliding-window) and global attention layers.

Differences from Llama, all resolved here: RMSNorms scale by ``1 + w``; four norms per layer
(before and after attention, before and after the MLP); per-head q/k norms; the embedding is
multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype, as HF does); attention scale
``query_pre_attn_scalar ** -0.5``; local and global layers use different RoPE bases (and only global
layers take ``rope_scaling``); optional tanh softcaps on attention scores and final logits; GeLU-tanh
MLP.

Gemma 2 is the same decoder without the q/k norms, with one RoPE base for both layer kinds, every other layer
sliding (the first one included) and the softcaps on (attention 50, final logits 30 in its configs):
:class:`Gemma3Config` reads its ``gemma2`` configs and :class:`Gemma2ForCausalLM` runs them.

KV: each layer declares a :class:`~infercore.kv.FullAttentionSpec` with its window, so the engine
can give sliding layers the multi-granularity manager (pages leave the window and are freed). The
model reads either one dense :class:`~infercore.ops.AttentionMetadata` (all layers share page ids)
or a :class:`~infercore.models.hybrid.HybridMetadata` with one entry per layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..kv.spec import FullAttentionSpec
from ..ops import (
    AttentionMetadata,
    apply_rope,
    fused_add_rms_norm,
    gelu_and_mul,
    paged_attention,
    write_kv_cache_,
)
from .config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, _parse_labels
from .hybrid import HFConfigReader, HybridMetadata, check_step, layer_metadata, load_hf_weights
from .llama import LlamaForSequenceClassification, RMSNorm, tie_and_rope_table

__all__ = ["Gemma2ForCausalLM", "Gemma2ForSequenceClassification", "Gemma3Config", "Gemma3ForCausalLM",
           "Gemma3TextForSequenceClassification"]

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Gemma3Config(ModelConfig):
    """:class:`ModelConfig` plus Gemma 3's extras.

    ``rope_theta``/``rope_scaling`` are the global (full-attention) layers' RoPE;
    ``rope_local_theta``/``rope_local_scaling`` the local (sliding) layers'.
    """

    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rope_local_theta: float = 10000.0
    rope_local_scaling: dict[str, Any] | None = None
    model_type: str = "gemma3_text"
    architecture: str = "Gemma3ForCausalLM"

    def validate(self) -> None:
        super().validate()
        for name in ("query_pre_attn_scalar", "rope_local_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Gemma3Config.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"Gemma3Config.{name} must be > 0 or None, got {v!r}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Gemma3Config:
        """From an HF ``gemma3_text`` config dict (or a ``gemma3`` one, whose ``text_config`` is
        used); accepts the transformers 5 ``rope_parameters`` per layer type and the 4.x keys
        (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``, ``sliding_window_pattern``)."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        if hf.get("model_type") == "gemma2":
            return cls._from_hf_gemma2(hf)
        if hf.get("model_type") == "gemma3" and "text_config" in hf:
            if not isinstance(hf["text_config"], Mapping):
                raise ValueError(f"HF gemma3 config key 'text_config' must be an object, got {hf['text_config']!r}")
            hf = {**hf["text_config"], "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
        if hf.get("model_type") != "gemma3_text":
            raise ValueError(f"model_type must be 'gemma3_text' or 'gemma3', got {hf.get('model_type')!r}")
        r = HFConfigReader(hf, "gemma3")

        num_layers = r.positive_int("num_hidden_layers")
        num_heads = r.positive_int("num_attention_heads")
        layer_types = r.str_list("layer_types")
        if layer_types is None:
            pattern = r.positive_int("sliding_window_pattern", 6)
            layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
        rope = r.mapping("rope_parameters")
        for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
            r.check(f"rope_parameters.{kind}", rope.get(kind), Mapping, "an object (or null)")
        glob = dict(rope.get(FULL_ATTENTION) or {})
        local = dict(rope.get(SLIDING_ATTENTION) or {})
        # Per-type rope_theta (transformers 5) wins over the 4.x top-level keys.
        glob_theta, local_theta = glob.pop("rope_theta", None), local.pop("rope_theta", None)
        if glob_theta is None:
            glob_theta = r.number("rope_theta", 1_000_000.0)
        if local_theta is None:
            local_theta = r.number("rope_local_base_freq", 10_000.0)
        for kind, theta in ((FULL_ATTENTION, glob_theta), (SLIDING_ATTENTION, local_theta)):
            r.check(f"rope_parameters.{kind}.rope_theta", theta, (int, float), "a positive number", lambda v: v > 0)
        if not glob:
            glob = r.mapping("rope_scaling")

        def scaling(d: dict[str, Any]) -> dict[str, Any] | None:
            return None if d.get("rope_type", d.get("type", "default")) == "default" else d

        return cls._build(r, hf, num_layers=num_layers, num_heads=num_heads, layer_types=layer_types,
                          rope_theta=float(glob_theta), rope_scaling=scaling(glob), rope_local_theta=float(local_theta),
                          rope_local_scaling=scaling(local), max_position_embeddings=r.positive_int(
                              "max_position_embeddings", 131072), qk_norm=True)

    @classmethod
    def _build(cls, r: HFConfigReader, hf: Mapping[str, Any], **kw) -> Gemma3Config:
        """The fields Gemma 2 and 3 read alike, plus ``kw`` (layers, heads, RoPE, q/k norms, names). A sequence
        classifier's checkpoint (``architectures``: Gemma2ForSequenceClassification /
        Gemma3TextForSequenceClassification) gets its labels and a tied output head (it has none)."""
        eos_ids, bos = r.token_ids()
        bias = r.flag("attention_bias", False)  # Gemma's one q/k/v/o bias flag
        archs = hf.get("architectures")
        classifier = _CLASSIFIERS[kw.get("model_type", "gemma3_text")]
        if isinstance(archs, list) and archs and archs[0] == classifier:
            kw.update(architecture=classifier, labels=_parse_labels(hf))
        return cls(
            vocab_size=r.positive_int("vocab_size"),
            hidden_size=r.positive_int("hidden_size"),
            intermediate_size=r.positive_int("intermediate_size"),
            num_kv_heads=r.positive_int("num_key_value_heads", kw["num_heads"]),
            head_dim=r.positive_int("head_dim", 256),
            rms_norm_eps=r.number("rms_norm_eps", 1e-6),
            tie_word_embeddings=True if "labels" in kw else r.flag("tie_word_embeddings", True),
            attention_bias=bias,
            o_bias=bias,
            sliding_window=r.check(
                "sliding_window", hf.get("sliding_window"), int, "a positive int or null", lambda v: v > 0
            ),  # fmt: skip
            hidden_act=r.check(
                "hidden_activation",
                hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
                str,
                "an activation name",
            ),  # fmt: skip
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            query_pre_attn_scalar=r.number("query_pre_attn_scalar", 256),
            final_logit_softcapping=r.number("final_logit_softcapping", optional=True),
            attn_logit_softcapping=r.number("attn_logit_softcapping", optional=True),
            **kw,
        )

    @classmethod
    def _from_hf_gemma2(cls, hf: Mapping[str, Any]) -> Gemma3Config:
        """An HF ``gemma2`` config: one RoPE (``rope_parameters`` or 4.x ``rope_theta`` / ``rope_scaling``) for both
        layer kinds, ``layer_types`` or every other layer sliding from the first, no q/k norms."""
        r = HFConfigReader(hf, "gemma2")
        num_layers = r.positive_int("num_hidden_layers")
        num_heads = r.positive_int("num_attention_heads")
        layer_types = r.str_list("layer_types")
        if layer_types is None:
            layer_types = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)]
        rope = dict(r.mapping("rope_parameters") or r.mapping("rope_scaling") or {})
        theta = rope.pop("rope_theta", None)
        if theta is None:
            theta = r.number("rope_theta", 10_000.0)
        r.check("rope_parameters.rope_theta", theta, (int, float), "a positive number", lambda v: v > 0)
        scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" else rope
        return cls._build(r, hf, num_layers=num_layers, num_heads=num_heads, layer_types=layer_types,
                          rope_theta=float(theta), rope_scaling=scaling, rope_local_theta=float(theta),
                          rope_local_scaling=scaling, max_position_embeddings=r.positive_int(
                              "max_position_embeddings", 8192), qk_norm=False, model_type="gemma2",
                          architecture="Gemma2ForCausalLM")


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3Config, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.layer_sliding_window(layer)
        self.is_local = self.sliding_window is not None
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias, dtype=dtype)
        if config.model_type != "gemma2":  # Gemma 3's per-head q/k norms (Gemma 2 has none)
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype, offset=1.0)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype, offset=1.0)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, k, positions, cos_sin)
        k_cache, v_cache = kv_cache
        write_kv_cache_(k, v, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(
            q, k_cache, v_cache, meta, scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap
        )
        return self.o_proj(o.reshape(T, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, config: Gemma3Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_and_mul(self.gate_up_proj(x), approximate=self.approximate))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        eps, h = config.rms_norm_eps, config.hidden_size
        self.self_attn = Gemma3Attention(config, layer, dtype=dtype)
        self.mlp = Gemma3MLP(config, dtype=dtype)
        self.input_layernorm = RMSNorm(h, eps=eps, dtype=dtype, offset=1.0)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, dtype=dtype, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps=eps, dtype=dtype, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(h, eps=eps, dtype=dtype, offset=1.0)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, cos_sin: torch.Tensor,
        kv_cache: KVCache, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # The residual stream is carried separately: each pre-norm fuses the preceding residual add.
        norm = self.input_layernorm
        if residual is None:
            residual, x = x, norm(x)
        else:
            x, residual = fused_add_rms_norm(x, residual, norm.weight, eps=norm.eps, offset=1.0)
        x = self.post_attention_layernorm(self.self_attn(x, positions, cos_sin, kv_cache, meta))
        norm = self.pre_feedforward_layernorm
        x, residual = fused_add_rms_norm(x, residual, norm.weight, eps=norm.eps, offset=1.0)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Gemma3Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, dtype=dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, offset=1.0)


_CLASSIFIERS = {"gemma3_text": "Gemma3TextForSequenceClassification", "gemma2": "Gemma2ForSequenceClassification"}


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text causal LM over paged KV (dense or hybrid metadata).

    Module names follow HF except merged ``qkv_proj`` / ``gate_up_proj``. Two fp32 RoPE tables
    (non-persistent buffers): ``cos_sin_global`` for full-attention layers, ``cos_sin_local`` for
    sliding layers.
    """

    supports_hybrid_kv = True

    def __init__(self, config: Gemma3Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, Gemma3Config):
            raise TypeError(f"config must be a Gemma3Config, got {type(config).__name__}")
        self.config = config
        self.model = Gemma3Model(config, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_global", torch.empty(0), persistent=False)
        self.register_buffer("cos_sin_local", torch.empty(0), persistent=False)
        self.finish_init()

    def finish_init(self) -> None:
        """(Re)build the embedding tie and the RoPE tables (after materialising from ``meta``)."""
        cfg = self.config
        self.cos_sin_global = tie_and_rope_table(self, base=cfg.rope_theta, scaling=cfg.rope_scaling)
        self.cos_sin_local = tie_and_rope_table(self, base=cfg.rope_local_theta, scaling=cfg.rope_local_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata | HybridMetadata,
    ) -> torch.Tensor:
        """One ragged step: ``input_ids``/``positions`` ``[T]``; ``kv_caches[i]`` is layer ``i``'s
        ``(k_cache, v_cache)`` ``[num_pages, page_size, Hk, D]``; ``meta`` dense or per layer.
        Returns final-normed hidden states ``[T, hidden_size]`` in the model dtype."""
        layers = self.model.layers
        check_step(input_ids, positions, kv_caches, len(layers))
        emb = self.model.embed_tokens
        # HF multiplies by sqrt(hidden) cast to the weight dtype (55.4256 -> 55.5 in bf16).
        x = emb(input_ids) * torch.tensor(self.config.hidden_size**0.5, dtype=emb.weight.dtype)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
            cos_sin = self.cos_sin_local if layer.self_attn.is_local else self.cos_sin_global
            x, residual = layer(x, residual, positions, cos_sin, kv_cache, layer_metadata(meta, i))
        norm = self.model.norm
        x, _ = fused_add_rms_norm(x, residual, norm.weight, eps=norm.eps, offset=1.0)
        return x

    def compute_logits(self, hidden: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
        """``hidden [N, H]`` -> fp32 logits ``[N, vocab]``, tanh-softcapped when configured (then always
        fp32); ``fp32=False`` without a softcap: the lm_head's dtype."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = logits.float()
            return cap * torch.tanh(logits / cap)
        return logits.float() if fp32 else logits

    def kv_specs(self) -> list[FullAttentionSpec]:
        """One spec per layer; sliding layers carry their window."""
        dtype = self.model.embed_tokens.weight.dtype
        return [
            FullAttentionSpec(
                num_kv_heads=layer.self_attn.num_kv_heads, head_dim=layer.self_attn.head_dim, dtype=dtype,
                sliding_window=layer.self_attn.sliding_window,
            )
            for layer in self.model.layers
        ]  # fmt: skip

    # ------------------------------------------------------------------ weights
    _MERGED = re.compile(r"^(model\.layers\.\d+\.)(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)$")
    # Multimodal checkpoints nest the text model; everything but the language model is skipped.
    _PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))  # fmt: skip
    _SKIP = re.compile(r"(^|\.)(vision_tower|multi_modal_projector)\.|rotary_emb\.inv_freq$")

    def _resolve(self, name: str) -> tuple[str, Any] | None:
        for old, new in self._PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
        m = self._MERGED.match(name)
        if m is None:
            return name, None
        prefix, block, proj, kind = m.groups()
        cfg = self.config
        q, kv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, i), "up": (i, 2 * i)}[proj]
        merged = "qkv_proj" if block == "self_attn" else "gate_up_proj"
        return f"{prefix}{block}.{merged}.{kind}", slice(*rows)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (``Gemma3ForCausalLM`` or the text part of a multimodal checkpoint)."""
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return bool(self._SKIP.search(name)) or (tied and name.endswith("lm_head.weight"))

        load_hf_weights(self, weights, self._resolve, arch=self.config.architecture, ignore=ignore)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 causal LM: :class:`Gemma3ForCausalLM` over a ``gemma2`` :class:`Gemma3Config` (no q/k norms, one
    RoPE base, softcapped attention scores and logits)."""


class _GemmaClassifier:
    """HF's sequence-classification head on a Gemma decoder: ``score`` ``[num_labels, hidden]`` (no bias) at the last
    token's final-normed hidden state (:meth:`compute_scores`, fp32; no logit softcap, as in HF). The checkpoint has
    no ``lm_head``: the inherited one is tied to the embedding and the engine refuses to generate from the model."""

    def _add_score(self, config: Gemma3Config, dtype: torch.dtype | None) -> None:
        if config.num_labels < 1 or not config.tie_word_embeddings:
            raise ValueError(f"{type(self).__name__}: the config needs labels and a tied lm_head (got "
                             f"num_labels={config.num_labels}, tie_word_embeddings={config.tie_word_embeddings})")
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False, dtype=dtype)

    compute_scores = LlamaForSequenceClassification.compute_scores


class Gemma3TextForSequenceClassification(_GemmaClassifier, Gemma3ForCausalLM):
    """Gemma 3 (text) with the sequence-classification head."""

    def __init__(self, config: Gemma3Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype=dtype)
        self._add_score(config, dtype)


class Gemma2ForSequenceClassification(_GemmaClassifier, Gemma2ForCausalLM):
    """Gemma 2 with the sequence-classification head (reward models such as Skywork-Reward-Gemma-2 are this)."""

    def __init__(self, config: Gemma3Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype=dtype)
        self._add_score(config, dtype)
