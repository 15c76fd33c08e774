"""IBM Granite MoE families: Granite 4.0 hybrid (HF ``GraniteMoeHybridForCausalLM``) and the attention-only
GraniteMoe / GraniteMoeShared (``GraniteMoeForCausalLM``, ``GraniteMoeSharedForCausalLM``).

One decoder for the three: each layer is a Mamba2 mixer (:class:`~infercore.models.mamba2.Mamba2Mixer`, HF Bamba's
math) or GQA attention, then a MoE block and / or a shared SiLU MLP, pre-norm residual blocks, with Granite's four
scalars:

* ``embedding_multiplier`` scales the embeddings;
* ``residual_multiplier`` scales each sublayer's output before its residual add;
* ``attention_multiplier`` is the softmax scale (not ``head_dim ** -0.5``);
* ``logits_scaling`` divides the logits.

The MoE routes softmax over the top-k router logits, which equals softmax-then-top-k renormalised, so it is a
:class:`~infercore.models.moe.SparseMoeBlock` (``renormalize=True``) without its gated shared expert; Granite's
shared MLP is ungated and added as it is (``moe(x) + shared_mlp(x)``, or the shared MLP alone when
``num_local_experts`` is 0, as Granite 4.0's dense checkpoints). The hybrid's attention has RoPE over the whole head
or none (``position_embedding_type`` other than ``"rope"``); GraniteMoe(Shared) always rotate.

Checkpoint names: Granite's own (``block_sparse_moe.input_linear`` ``[E, 2I, H]`` gate rows first,
``block_sparse_moe.output_linear`` ``[E, H, I]``, ``block_sparse_moe.router.layer``, ``shared_mlp.input_linear`` /
``output_linear``) and transformers 5's renamed ones (``experts.gate_up_proj`` / ``experts.down_proj`` /
``router.weight``) both load; q/k/v merge into ``qkv_proj``.

``tensor_parallel_`` shards the Mamba2 mixers and the attention by heads, the experts by width or whole
(``experts="ep"``) and the shared MLP by width, with one sum over the group for the experts and the shared MLP
together (``ffn_reduce``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..ops import apply_rope, fused_add_rms_norm, paged_attention, rms_norm, write_kv_cache_
from .hybrid import HFConfigReader, HybridMetadata, check_step, layer_metadata, linear_metadata, load_hf_weights
from .llama import tie_and_rope_table
from .mamba2 import ATTENTION, MAMBA, BambaAttention, BambaForCausalLM, Mamba2Config, Mamba2Mixer, _Weight
from .moe import GatedMLP, SparseMoeBlock

__all__ = ["GRANITE_MOE_ARCHITECTURES", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"]

# HF model_type -> architecture
GRANITE_MOE_ARCHITECTURES = {
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
}
# Granite 4.0 checkpoints name their layers "mamba" / "attention"; transformers 5 remaps them to these.
_LAYER_TYPES = {"mamba": MAMBA, "attention": ATTENTION, MAMBA: MAMBA, ATTENTION: ATTENTION}


@dataclass
class GraniteMoeHybridConfig(Mamba2Config):
    """:class:`Mamba2Config` plus Granite's MoE, shared MLP and multipliers.

    ``intermediate_size`` is each routed expert's width (the shared MLP's when ``num_experts`` is 0);
    ``num_experts`` 0 means no MoE block (the shared MLP alone); ``shared_intermediate_size`` 0 means no shared MLP
    (GraniteMoe), allowed only with experts. ``use_rope`` False: attention without positions (NoPE).
    """

    num_experts: int = 0
    top_k: int = 1
    shared_intermediate_size: int = 0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    use_rope: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "shared_intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"GraniteMoeHybridConfig.{name} must be an int >= 0, got {v!r}")
        if self.num_experts == 0 and self.shared_intermediate_size == 0:
            raise ValueError("GraniteMoeHybridConfig: num_experts and shared_intermediate_size are both 0 (no MLP)")
        if self.num_experts and not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.num_experts):
            raise ValueError(f"GraniteMoeHybridConfig.top_k must be an int in [1, num_experts={self.num_experts}], "
                             f"got {self.top_k!r}")  # fmt: skip
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or not math.isfinite(v):
                raise ValueError(f"GraniteMoeHybridConfig.{name} must be a positive number, got {v!r}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> GraniteMoeHybridConfig:
        """From an HF ``granitemoehybrid``, ``granitemoe`` or ``granitemoeshared`` config dict (HF's defaults for
        absent keys)."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        mt = hf.get("model_type")
        if mt not in GRANITE_MOE_ARCHITECTURES:
            raise ValueError(f"model_type must be one of {sorted(GRANITE_MOE_ARCHITECTURES)}, got {mt!r}")
        r = HFConfigReader(hf, mt)
        eos_ids, _ = r.token_ids()
        act = r.get("hidden_act", "silu")
        r.check("hidden_act", act, str, "'silu' (the only activation of these families' MLPs)", lambda v: v == "silu")
        n = r.positive_int("num_hidden_layers")
        hidden, heads = r.positive_int("hidden_size"), r.positive_int("num_attention_heads")
        head_dim = r.get("head_dim", None)
        if head_dim is None and hidden % heads:
            raise ValueError(f"HF {mt} config: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                             f"(and no head_dim is given)")  # fmt: skip
        head_dim = r.positive_int("head_dim", hidden // heads)
        hybrid = mt == "granitemoehybrid"
        experts = r.get("num_local_experts", 8)
        r.check("num_local_experts", experts, int, "an int >= 0 (a positive int for GraniteMoe)",
                lambda v: v > 0 or (hybrid and v == 0))  # fmt: skip
        top_k = r.positive_int("num_experts_per_tok", 2) if experts else 1  # unread without experts (may be 0)
        if experts and top_k > experts:
            raise ValueError(f"HF {mt} config key 'num_experts_per_tok' must be <= num_local_experts={experts}, "
                             f"got {top_k}")  # fmt: skip
        shared = 0
        if mt != "granitemoe":
            shared = r.get("shared_intermediate_size", 1024 if hybrid else 0)
            r.check("shared_intermediate_size", shared, int, "a positive int" if hybrid else "an int >= 0",
                    lambda v: v > 0 or (not hybrid and v == 0))  # fmt: skip
        inter = r.positive_int("intermediate_size", 11008) if experts else shared
        pos = r.get("position_embedding_type", None) if hybrid else "rope"
        r.check("position_embedding_type", pos, str, "null, 'nope' or 'rope'", lambda v: v in ("nope", "rope"))
        use_rope = pos == "rope"
        rope = r.mapping("rope_parameters")
        theta = rope.get("rope_theta")
        theta = r.number("rope_theta", 10000.0) if theta is None else theta
        r.check("rope_theta", theta, (int, float), "a positive number", lambda v: v > 0)
        if use_rope:
            kind = rope.get("rope_type", rope.get("type", "default"))
            r.check("rope_parameters", kind, str, "default RoPE (rope_type 'default')", lambda v: v == "default")
            r.check("rope_scaling", r.hf.get("rope_scaling"), Mapping, "null or default RoPE",
                    lambda v: v.get("rope_type", v.get("type", "default")) == "default")  # fmt: skip
        if hybrid:
            names = r.str_list("layer_types") or ["mamba"] * n
            if len(names) != n or any(t not in _LAYER_TYPES for t in names):
                raise ValueError(f"HF {mt} config key 'layer_types' must be {n} of 'mamba' / 'attention' (or "
                                 f"'linear_attention' / 'full_attention'), got {names!r}")  # fmt: skip
            layer_types = [_LAYER_TYPES[t] for t in names]
            expand = r.positive_int("mamba_expand", 2)
            m_heads = r.positive_int("mamba_n_heads", 128)
            m_head_dim = r.get("mamba_d_head", "auto")
            if m_head_dim == "auto":
                if expand * hidden % m_heads:
                    raise ValueError(f"HF {mt} config key 'mamba_n_heads' ({m_heads}) must divide mamba_expand * "
                                     f"hidden_size ({expand * hidden})")  # fmt: skip
                m_head_dim = expand * hidden // m_heads
            r.check("mamba_d_head", m_head_dim, int, "a positive int or 'auto'", lambda v: v > 0)
            if m_heads * m_head_dim != expand * hidden:
                raise ValueError(f"HF {mt} config: mamba_n_heads * mamba_d_head ({m_heads * m_head_dim}) must equal "
                                 f"mamba_expand * hidden_size ({expand * hidden})")  # fmt: skip
            limit = r.get("time_step_limit", (0.0, math.inf))
            r.check("time_step_limit", limit, list | tuple, "a [min, max] pair of numbers with 0 <= min <= max",
                    lambda v: len(v) == 2 and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
                    and 0 <= v[0] <= v[1])  # fmt: skip
            mamba = dict(
                mamba_heads=m_heads, mamba_head_dim=m_head_dim, state_size=r.positive_int("mamba_d_state", 256),
                n_groups=r.positive_int("mamba_n_groups", 1), expand=expand,
                conv_kernel=r.positive_int("mamba_d_conv", 4), use_bias=r.flag("mamba_proj_bias", False),
                use_conv_bias=r.flag("mamba_conv_bias", True), time_step_limit=(float(limit[0]), float(limit[1])),
            )  # fmt: skip
        else:  # attention only: placeholder mixer sizes that no layer uses
            layer_types = [ATTENTION] * n
            mamba = dict(mamba_heads=1, mamba_head_dim=hidden, state_size=1, expand=1)
        return cls(
            vocab_size=r.positive_int("vocab_size"), hidden_size=hidden, num_layers=n, **mamba,
            norm_eps=r.number("rms_norm_eps", 1e-6), residual_in_fp32=False,
            tie_word_embeddings=r.flag("tie_word_embeddings", False), layer_types=layer_types,
            intermediate_size=inter, num_heads=heads, num_kv_heads=r.positive_int("num_key_value_heads", heads),
            head_dim=head_dim, rope_theta=float(theta), partial_rotary_factor=1.0,
            max_position_embeddings=r.positive_int("max_position_embeddings", 2048),
            attention_bias=r.flag("attention_bias", False), eos_token_ids=eos_ids, model_type=mt,
            architecture=GRANITE_MOE_ARCHITECTURES[mt], num_experts=experts, top_k=top_k,
            shared_intermediate_size=shared, embedding_multiplier=float(r.number("embedding_multiplier", 1.0)),
            residual_multiplier=float(r.number("residual_multiplier", 1.0)),
            attention_multiplier=float(r.number("attention_multiplier", 1.0)),
            logits_scaling=float(r.number("logits_scaling", 1.0)), use_rope=use_rope,
        )  # fmt: skip


class GraniteMoeHybridAttention(BambaAttention):
    """GQA over paged KV with ``attention_multiplier`` as the softmax scale and RoPE optional."""

    def __init__(self, cfg: GraniteMoeHybridConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, dtype=dtype)
        self.scale, self.use_rope = cfg.attention_multiplier, cfg.use_rope

    def forward(self, x, positions, cos_sin, kv_cache, meta) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (q.reshape(T, self.num_heads, D), k.reshape(T, self.num_kv_heads, D),
                   v.reshape(T, self.num_kv_heads, D))  # fmt: skip
        if self.use_rope:
            q, k = apply_rope(q, k, positions, cos_sin)
        else:
            q, k = q.contiguous(), k.contiguous()
        write_kv_cache_(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, scale=self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.is_mamba = cfg.layer_types[layer] == MAMBA
        if self.is_mamba:
            self.mamba = Mamba2Mixer(cfg, dtype=dtype)
        else:
            self.self_attn = GraniteMoeHybridAttention(cfg, dtype=dtype)
        self.input_layernorm = _Weight(cfg.hidden_size, dtype=dtype)
        self.post_attention_layernorm = _Weight(cfg.hidden_size, dtype=dtype)
        self.block_sparse_moe = (
            SparseMoeBlock(cfg.hidden_size, num_experts=cfg.num_experts, top_k=cfg.top_k,
                           intermediate=cfg.intermediate_size, renormalize=True, dtype=dtype)
            if cfg.num_experts else None
        )  # fmt: skip
        shared = cfg.shared_intermediate_size
        self.shared_mlp = GatedMLP(cfg.hidden_size, shared, dtype=dtype) if shared else None

    @property
    def mlp(self) -> SparseMoeBlock | None:
        """The routed experts under the name the expert offload looks for (``offload.offload_experts_``)."""
        return self.block_sparse_moe

    ffn_reduce = None  # tensor_parallel_: sums this rank's partial MoE + shared MLP output over the group

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_sparse_moe is None:
            out = self.shared_mlp(x)
        else:
            out = self.block_sparse_moe(x)
            out = out if self.shared_mlp is None else out + self.shared_mlp(x)
        return out if self.ffn_reduce is None else self.ffn_reduce(out)


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(GraniteMoeHybridDecoderLayer(cfg, i, dtype=dtype) for i in range(cfg.num_layers))
        self.norm = _Weight(cfg.hidden_size, dtype=dtype)


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    """Granite 4.0 hybrid / GraniteMoe / GraniteMoeShared causal LM over the hybrid KV pool (conv / SSM state slots
    for mixer layers, paged KV for attention layers; an attention-only model runs on the dense pool).

    Module names follow HF except merged ``qkv_proj``, ``block_sparse_moe.gate`` / ``experts`` (SparseMoeBlock's)
    and ``shared_mlp.gate_up_proj`` / ``down_proj``.
    """


    def __init__(self, config: GraniteMoeHybridConfig, *, dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, GraniteMoeHybridConfig):
            raise TypeError(f"config must be a GraniteMoeHybridConfig, got {type(config).__name__}")
        self.config = config
        self.model = GraniteMoeHybridModel(config, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.finish_init()

    def finish_init(self) -> None:
        if self.config.use_rope:
            self.cos_sin_cache = tie_and_rope_table(self, base=self.config.rope_theta, scaling=None)
        elif self.config.tie_word_embeddings:  # NoPE: no table to build
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: HybridMetadata
    ) -> torch.Tensor:
        """One ragged step over mixer and attention layers. Returns ``[T, hidden]`` (final-normed)."""
        layers, cfg = self.model.layers, self.config
        eps, m = cfg.norm_eps, cfg.residual_multiplier
        check_step(input_ids, positions, kv_caches, len(layers))
        x = self.model.embed_tokens(input_ids) * cfg.embedding_multiplier
        residual = None
        for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
            w = layer.input_layernorm.weight
            if residual is None:
                residual, x = x, rms_norm(x, w, eps=eps)
            else:
                x, residual = fused_add_rms_norm(x, residual, w, eps=eps)
            if layer.is_mamba:
                x = layer.mamba(x, cache, linear_metadata(meta, i))
            else:
                x = layer.self_attn(x, positions, self.cos_sin_cache, cache, layer_metadata(meta, i))
            x, residual = fused_add_rms_norm(x * m, residual, layer.post_attention_layernorm.weight, eps=eps)
            x = layer.feed_forward(x) * m
        x, _ = fused_add_rms_norm(x, residual, self.model.norm.weight, eps=eps)
        return x

    def compute_logits(self, hidden: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
        """``hidden [N, H]`` -> fp32 logits ``[N, vocab]`` divided by ``logits_scaling`` (``fp32=False``: the
        lm_head's dtype)."""
        logits = self.lm_head(hidden) / self.config.logits_scaling
        return logits.float() if fp32 else logits

    _NAMES = re.compile(
        r"^(model\.layers\.\d+\.)(?:self_attn\.(q|k|v)_proj\.(weight|bias)|block_sparse_moe\.(input_linear\.weight|"
        r"experts\.gate_up_proj|output_linear\.weight|experts\.down_proj|router\.layer\.weight|router\.weight)|"
        r"shared_mlp\.(input|output)_linear\.weight)$"
    )
    _MOE = {"input_linear.weight": "experts.gate_up_proj", "experts.gate_up_proj": "experts.gate_up_proj",
            "output_linear.weight": "experts.down_proj", "experts.down_proj": "experts.down_proj",
            "router.layer.weight": "gate.weight", "router.weight": "gate.weight"}  # fmt: skip

    def _resolve(self, name: str) -> tuple[str, Any]:
        m = self._NAMES.match(name)
        if m is None:
            return name, None
        prefix, attn, kind, moe, shared = m.groups()
        if attn:
            cfg = self.config
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[attn]
            return f"{prefix}self_attn.qkv_proj.{kind}", slice(*rows)
        if moe:
            return f"{prefix}block_sparse_moe.{self._MOE[moe]}", None
        return f"{prefix}shared_mlp.{'gate_up_proj' if shared == 'input' else 'down_proj'}.weight", None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")

        load_hf_weights(self, weights, self._resolve, arch=self.config.architecture, ignore=ignore)
