"""Qwen3-Next: gated DeltaNet layers interleaved with gated full attention, sparse MoE MLPs.

* Linear-attention layers (``"linear_attention"``): gated DeltaNet. ``in_proj_qkvz`` / ``in_proj_ba``
  (HF's per-key-head interleaved layout, split here with views), a causal depthwise conv over
  ``[q | k | v]``, the gated delta rule with L2-normalized q/k, and a gated RMSNorm with ``z``.
  Per request they hold a conv state ``[conv_dim, kernel - 1]`` and a recurrent state
  ``[Hv, Dk, Dv]`` (fp32) in state slots of the hybrid KV manager.
* Full-attention layers: q/k RMSNorm, partial RoPE, and an output gate ``o * sigmoid(gate)``
  (``q_proj`` emits ``[q, gate]`` per head).
* MLPs: :class:`~infercore.models.moe.SparseMoeBlock` (top-k experts + sigmoid-gated shared
  expert) every ``decoder_sparse_step`` layers, dense SiLU MLPs elsewhere.
* Every RMSNorm outside the DeltaNet output scales by ``1 + w``.

Steps take a :class:`~infercore.models.hybrid.HybridMetadata`; ``kv_caches[i]`` is
``(conv_state, recurrent_state)`` for linear layers and ``(k_cache, v_cache)`` for attention.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kv.hybrid import FullAttentionSpec, LinearStateSpec
from ..ops import apply_rope, fused_add_rms_norm, paged_attention, write_kv_cache_
from ..ops.conv1d import causal_conv1d_prefill_, causal_conv1d_update_
from ..ops.gated_delta import chunk_gated_delta_rule_, fused_recurrent_gated_delta_rule_
from ..ops.gated_norm import gated_rms_norm
from .hybrid import HFConfigReader, HybridMetadata, check_step, layer_metadata, linear_metadata, load_hf_weights
from .llama import RMSNorm, tie_and_rope_table
from .moe import GatedMLP, SparseMoeBlock

__all__ = ["Qwen3NextConfig", "Qwen3NextForCausalLM"]

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclass
class Qwen3NextConfig:
    """Qwen3-Next hyper-parameters (HF names, ``num_hidden_layers`` -> ``num_layers`` etc.)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: list[str]
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen3_next"
    architecture: str = "Qwen3NextForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "max_position_embeddings"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Qwen3NextConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Qwen3NextConfig.num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")  # fmt: skip
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"Qwen3NextConfig.linear_num_key_heads={self.linear_num_key_heads} must divide "
                             f"linear_num_value_heads={self.linear_num_value_heads}")  # fmt: skip
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}:
            raise ValueError(f"Qwen3NextConfig.layer_types must be {self.num_layers} of linear/full_attention, "
                             f"got {self.layer_types!r}")  # fmt: skip
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"Qwen3NextConfig.num_experts must be an int >= 0, got {self.num_experts!r}")
        # decoder_sparse_step is a modulus in is_moe_layer; the MoE sizes only matter with experts.
        moe = ("num_experts_per_tok", "moe_intermediate_size") if self.num_experts else ()
        for name in ("decoder_sparse_step", *moe):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Qwen3NextConfig.{name} must be a positive int, got {v!r}")
        shared = self.shared_expert_intermediate_size
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"Qwen3NextConfig.shared_expert_intermediate_size must be an int >= 0, got {shared!r}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"Qwen3NextConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")  # fmt: skip
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"Qwen3NextConfig.partial_rotary_factor gives rotary_dim {self.rotary_dim}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen3NextConfig:
        """From an HF ``qwen3_next`` config dict (transformers 4.x or 5.x rope keys)."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        if hf.get("model_type") != "qwen3_next":
            raise ValueError(f"model_type must be 'qwen3_next', got {hf.get('model_type')!r}")
        r = HFConfigReader(hf, "qwen3_next")
        rope = r.mapping("rope_parameters") or r.mapping("rope_scaling")
        theta = rope.pop("rope_theta", None)
        partial = rope.pop("partial_rotary_factor", None)
        theta = r.number("rope_theta", 10000.0) if theta is None else theta
        partial = r.number("partial_rotary_factor", 0.25) if partial is None else partial
        r.check("rope_theta", theta, (int, float), "a positive number", lambda v: v > 0)
        r.check("partial_rotary_factor", partial, (int, float), "a number in (0, 1]", lambda v: 0 < v <= 1)
        scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" else rope
        n = r.positive_int("num_hidden_layers")
        hidden, heads = r.positive_int("hidden_size"), r.positive_int("num_attention_heads")
        head_dim = r.positive_int("head_dim", None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"HF qwen3_next config: hidden_size={hidden} is not divisible by "
                                 f"num_attention_heads={heads} (and head_dim is not given)")  # fmt: skip
            head_dim = hidden // heads
        layer_types = r.str_list("layer_types")
        if layer_types is None:
            interval = r.positive_int("full_attention_interval", 4)
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
        eos_ids, bos = r.token_ids()
        # Keys with a dataclass default: only present ones are passed, each type-checked first.
        sizes = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                 "max_position_embeddings")  # fmt: skip
        extra: dict[str, Any] = {k: r.positive_int(k) for k in sizes if hf.get(k) is not None}
        # num_experts 0 = dense MLPs everywhere; shared_expert_intermediate_size 0 = no shared expert.
        for k in ("num_experts", "shared_expert_intermediate_size"):
            if hf.get(k) is not None:
                extra[k] = r.check(k, hf[k], int, "an int >= 0", lambda v: v >= 0)
        for k in ("norm_topk_prob", "tie_word_embeddings", "attention_bias"):
            if hf.get(k) is not None:
                extra[k] = r.flag(k, False)
        if hf.get("mlp_only_layers") is not None:
            extra["mlp_only_layers"] = r.int_list("mlp_only_layers", n)
        return cls(
            vocab_size=r.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size"),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=r.positive_int("num_key_value_heads", heads),
            head_dim=head_dim,
            layer_types=layer_types,
            rms_norm_eps=r.number("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            partial_rotary_factor=float(partial),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            **extra,
        )


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False, dtype=dtype)
        self.in_proj_ba = nn.Linear(h, 2 * self.hv, bias=False, dtype=dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.ones(self.hv, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.hv, dtype=dtype))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv, dtype=dtype))
        self.out_proj = nn.Linear(self.value_dim, h, bias=False, dtype=dtype)

    def state_spec(self, dtype: torch.dtype) -> LinearStateSpec:
        return LinearStateSpec(
            conv_state_shape=(self.conv_dim, self.kernel - 1), recurrent_state_shape=(self.hv, self.dk, self.dv),
            conv_dtype=dtype, recurrent_dtype=torch.float32,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        T, r = x.shape[0], self.hv // self.hk
        # HF groups the projections per key head: [q (dk), k (dk), v (r*dv), z (r*dv)] and [b (r), a (r)].
        qkvz = self.in_proj_qkvz(x).view(T, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(T, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        conv_state, rec_state = state
        w = self.conv1d.weight.squeeze(1)
        if meta.decode_only:
            mixed = causal_conv1d_update_(mixed, w, conv_state, state_slots=meta.state_slots, activation="silu")
        else:
            mixed = causal_conv1d_prefill_(
                mixed, w, conv_state, cu_seqlens=meta.cu_seqlens, state_slots=meta.state_slots,
                has_initial_state=meta.has_initial_state, activation="silu",
            )  # fmt: skip
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.view(T, self.hk, self.dk), k.view(T, self.hk, self.dk), v.view(T, self.hv, self.dv)
        beta = b.reshape(T, self.hv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(T, self.hv).float() + self.dt_bias.float())
        if meta.decode_only:
            o = fused_recurrent_gated_delta_rule_(
                q, k, v, g, beta, rec_state, state_slots=meta.state_slots, use_qk_l2norm=True
            )
        else:
            o = chunk_gated_delta_rule_(
                q, k, v, g, beta, rec_state, cu_seqlens=meta.cu_seqlens, state_slots=meta.state_slots,
                has_initial_state=meta.has_initial_state, use_qk_l2norm=True,
            )  # fmt: skip
        o = gated_rms_norm(o, z.reshape(T, self.hv, self.dv), self.norm.weight, eps=self.eps, norm_before_gate=True)
        return self.out_proj(o.reshape(T, self.value_dim))


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.scale = d**-0.5
        # q_proj emits [q, gate] per head (2 * Hq * D rows); k and v follow in the merged projection.
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                                  dtype=dtype)  # fmt: skip
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, offset=1.0)
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, offset=1.0)

    def forward(self, x, positions, cos_sin, kv_cache, meta) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(T, H, 2 * D).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.num_kv_heads, D))
        v = v.view(T, self.num_kv_heads, D)
        q, k = apply_rope(q, k, positions, cos_sin)
        k_cache, v_cache = kv_cache
        write_kv_cache_(k, v, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, scale=self.scale)
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(T, self.q_size))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype)
        else:
            self.self_attn = GatedAttention(cfg, dtype=dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(
                cfg.hidden_size, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                intermediate=cfg.moe_intermediate_size, shared_intermediate=cfg.shared_expert_intermediate_size,
                renormalize=cfg.norm_topk_prob, dtype=dtype,
            )  # fmt: skip
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, offset=1.0)

    def forward(self, x, residual, positions, cos_sin, cache, meta, layer: int):
        norm = self.input_layernorm
        if residual is None:
            residual, x = x, norm(x)
        else:
            x, residual = fused_add_rms_norm(x, residual, norm.weight, eps=norm.eps, offset=1.0)
        if self.is_linear:
            x = self.linear_attn(x, cache, linear_metadata(meta, layer))
        else:
            x = self.self_attn(x, positions, cos_sin, cache, layer_metadata(meta, layer))
        norm = self.post_attention_layernorm
        x, residual = fused_add_rms_norm(x, residual, norm.weight, eps=norm.eps, offset=1.0)
        return self.mlp(x), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(cfg, i, dtype=dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, offset=1.0)


class Qwen3NextForCausalLM(nn.Module):
    """Qwen3-Next causal LM over the hybrid KV manager (state slots + paged KV).

    Module names follow HF except merged ``self_attn.qkv_proj`` (``q_proj`` [q, gate] rows, then
    ``k_proj``, ``v_proj``) and ``gate_up_proj`` in dense MLPs and the shared expert. Expert weights
    load from either the stacked transformers-5 tensors or per-expert hub names.
    """

    supports_hybrid_kv = True

    def __init__(self, config: Qwen3NextConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, Qwen3NextConfig):
            raise TypeError(f"config must be a Qwen3NextConfig, got {type(config).__name__}")
        self.config = config
        self.model = Qwen3NextModel(config, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.finish_init()

    def finish_init(self) -> None:
        """(Re)build the embedding tie and the RoPE table (after materialising from ``meta``)."""
        self.cos_sin_cache = tie_and_rope_table(self, base=self.config.rope_theta, scaling=self.config.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: HybridMetadata
    ) -> torch.Tensor:
        """One ragged step (``[T]`` ids/positions, one cache entry per layer, per-layer metadata);
        returns final-normed hidden states ``[T, hidden_size]``."""
        layers = self.model.layers
        check_step(input_ids, positions, kv_caches, len(layers))
        x = self.model.embed_tokens(input_ids)
        residual = None
        for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
            x, residual = layer(x, residual, positions, self.cos_sin_cache, cache, meta, i)
        norm = self.model.norm
        x, _ = fused_add_rms_norm(x, residual, norm.weight, eps=norm.eps, offset=1.0)
        return x

    def compute_logits(self, hidden: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
        """``hidden [N, H]`` -> fp32 logits ``[N, vocab]`` (``fp32=False``: the lm_head's dtype)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits

    def kv_specs(self) -> list[FullAttentionSpec | LinearStateSpec]:
        """Per layer: a :class:`LinearStateSpec` (DeltaNet) or a :class:`FullAttentionSpec`."""
        dtype = self.model.embed_tokens.weight.dtype
        return [
            layer.linear_attn.state_spec(dtype)
            if layer.is_linear
            else FullAttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, dtype=dtype)
            for layer in self.model.layers
        ]

    # ------------------------------------------------------------------ weights
    _ATTN = re.compile(r"^(model\.layers\.\d+\.self_attn\.)(q|k|v)_proj\.(weight|bias)$")
    _MLP = re.compile(r"^(model\.layers\.\d+\.mlp\.(?:shared_expert\.)?)(gate|up)_proj\.weight$")
    _EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    _SKIP = re.compile(r"^mtp\.|rotary_emb\.inv_freq$")

    def _resolve(self, name: str) -> tuple[str, Any] | None:
        cfg = self.config
        if m := self._ATTN.match(name):
            prefix, proj, kind = m.groups()
            q, kv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[proj]
            return f"{prefix}qkv_proj.{kind}", slice(*rows)
        if m := self._MLP.match(name):
            prefix, proj = m.groups()
            i = cfg.shared_expert_intermediate_size if "shared_expert" in prefix else cfg.intermediate_size
            return f"{prefix}gate_up_proj.weight", slice(0, i) if proj == "gate" else slice(i, 2 * i)
        if m := self._EXPERT.match(name):
            prefix, e, proj = m.groups()
            i = cfg.moe_intermediate_size
            if proj == "down":
                return f"{prefix}down_proj", int(e)
            return f"{prefix}gate_up_proj", (int(e), slice(0, i) if proj == "gate" else slice(i, 2 * i))
        return name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (``mtp.*`` multi-token-prediction weights are skipped)."""
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return bool(self._SKIP.search(name)) or (tied and name == "lm_head.weight")

        load_hf_weights(self, weights, self._resolve, arch=self.config.architecture, ignore=ignore)
