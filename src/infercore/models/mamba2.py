"""Mamba2, pure (HF ``Mamba2ForCausalLM``) and hybrid with attention layers (HF ``BambaForCausalLM``).

The Mamba2 mixer: ``in_proj`` -> ``[gate z | xBC | dt]``; a causal depthwise conv (SiLU) over
``xBC``; the SSD scan with per-head ``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)`` and skip
``D``; a grouped gated RMSNorm ``rms_norm(y * silu(z)) * w``; ``out_proj``. Per request it holds a
conv state ``[conv_dim, kernel - 1]`` and an SSM state ``[H, P, N]`` (fp32) in state slots.

* Pure Mamba2: ``x += mixer(rms_norm(x))`` per layer (residual stream in fp32 when
  ``residual_in_fp32``, as HF), then ``norm_f``.
* Hybrid (Bamba): each layer is a Mamba2 mixer or Llama-style attention (partial RoPE, GQA), then
  a SiLU MLP, pre-norm residual blocks.

Steps take a :class:`~infercore.models.hybrid.HybridMetadata`; ``kv_caches[i]`` is
``(conv_state, ssm_state)`` for mixer layers and ``(k_cache, v_cache)`` for attention layers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kv.hybrid import FullAttentionSpec, LinearStateSpec
from ..ops import apply_rope, fused_add_rms_norm, paged_attention, rms_norm, silu_and_mul, write_kv_cache_
from ..ops.conv1d import causal_conv1d_prefill_, causal_conv1d_update_
from ..ops.gated_norm import gated_rms_norm
from ..ops.mamba import mamba_chunk_scan_, selective_state_update_
from .hybrid import HFConfigReader, HybridMetadata, check_step, layer_metadata, linear_metadata, load_hf_weights
from .llama import tie_and_rope_table

__all__ = ["BambaForCausalLM", "Mamba2Config", "Mamba2ForCausalLM"]

MAMBA, ATTENTION = "linear_attention", "full_attention"


@dataclass
class Mamba2Config:
    """Mamba2 mixer sizes plus, for hybrids, the attention / MLP sizes and per-layer types.

    ``layer_types[i]`` is ``"linear_attention"`` (Mamba2 mixer) or ``"full_attention"``.
    ``mamba_heads * mamba_head_dim == expand * hidden_size``.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    mamba_heads: int
    mamba_head_dim: int
    state_size: int
    n_groups: int = 1
    expand: int = 2
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = False
    layer_types: list[str] = field(default_factory=list)
    # hybrid only
    intermediate_size: int = 0
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "mamba2"
    architecture: str = "Mamba2ForCausalLM"

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [MAMBA] * self.num_layers
        for name in ("vocab_size", "hidden_size", "num_layers", "mamba_heads", "mamba_head_dim", "state_size",
                     "n_groups", "expand", "conv_kernel", "num_heads", "num_kv_heads", "head_dim"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Mamba2Config.{name} must be a positive int, got {v!r}")
        if self.mamba_heads * self.mamba_head_dim != self.intermediate_mamba:
            raise ValueError(f"Mamba2Config: mamba_heads * mamba_head_dim must equal expand * hidden_size "
                             f"({self.intermediate_mamba})")  # fmt: skip
        if self.mamba_heads % self.n_groups:
            raise ValueError(f"Mamba2Config.n_groups={self.n_groups} must divide mamba_heads={self.mamba_heads}")
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {MAMBA, ATTENTION}:
            raise ValueError(f"Mamba2Config.layer_types must be {self.num_layers} of {MAMBA!r}/{ATTENTION!r}")
        if ATTENTION in self.layer_types and (self.num_heads % self.num_kv_heads or self.intermediate_size <= 0):
            raise ValueError(
                f"Mamba2Config: hybrid configs need num_kv_heads={self.num_kv_heads} to divide "
                f"num_heads={self.num_heads} and intermediate_size > 0, got {self.intermediate_size}"
            )
        if ATTENTION in self.layer_types and (self.rotary_dim <= 0 or self.rotary_dim % 2):
            raise ValueError(f"Mamba2Config.partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim "
                             f"{self.rotary_dim} for head_dim={self.head_dim}, expected even and > 0")  # fmt: skip
        if not self.norm_eps > 0:
            raise ValueError(f"Mamba2Config.norm_eps must be > 0, got {self.norm_eps!r}")

    @property
    def intermediate_mamba(self) -> int:
        return int(self.expand * self.hidden_size)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Mamba2Config:
        """From an HF ``mamba2`` or ``bamba`` config dict."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        mt = hf.get("model_type")
        if mt not in ("mamba2", "bamba"):
            raise ValueError(f"model_type must be 'mamba2' or 'bamba', got {mt!r}")
        r = HFConfigReader(hf, mt)
        eos_ids, _ = r.token_ids()
        limit = r.get("time_step_limit", (0.0, math.inf))
        r.check("time_step_limit", limit, list | tuple, "a [min, max] pair of numbers with 0 <= min <= max",
                lambda v: len(v) == 2 and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
                and 0 <= v[0] <= v[1])  # fmt: skip
        limit = (float(limit[0]), float(limit[1]))
        if mt == "mamba2":
            return cls(
                vocab_size=r.positive_int("vocab_size"), hidden_size=r.positive_int("hidden_size"),
                num_layers=r.positive_int("num_hidden_layers"), mamba_heads=r.positive_int("num_heads"),
                mamba_head_dim=r.positive_int("head_dim"), state_size=r.positive_int("state_size"),
                n_groups=r.positive_int("n_groups", 1), expand=r.positive_int("expand", 2),
                conv_kernel=r.positive_int("conv_kernel", 4), use_bias=r.flag("use_bias", False),
                use_conv_bias=r.flag("use_conv_bias", True), time_step_limit=limit,
                norm_eps=r.number("layer_norm_epsilon", 1e-5), residual_in_fp32=r.flag("residual_in_fp32", True),
                tie_word_embeddings=r.flag("tie_word_embeddings", False), eos_token_ids=eos_ids,
            )  # fmt: skip
        n = r.positive_int("num_hidden_layers")
        attn = set(r.int_list("attn_layer_indices", n))
        rope = r.mapping("rope_parameters")
        theta, partial = rope.get("rope_theta"), rope.get("partial_rotary_factor")
        theta = r.number("rope_theta", 10000.0) if theta is None else theta
        partial = r.number("partial_rotary_factor", 0.5) if partial is None else partial
        r.check("rope_theta", theta, (int, float), "a positive number", lambda v: v > 0)
        r.check("partial_rotary_factor", partial, (int, float), "a number in (0, 1]", lambda v: 0 < v <= 1)
        hidden, heads = r.positive_int("hidden_size"), r.positive_int("num_attention_heads")
        if hidden % heads:
            # HF Bamba derives head_dim = hidden_size // num_attention_heads: a remainder is a broken config.
            raise ValueError(f"HF bamba config: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        return cls(
            vocab_size=r.positive_int("vocab_size"), hidden_size=hidden, num_layers=n,
            mamba_heads=r.positive_int("mamba_n_heads"), mamba_head_dim=r.positive_int("mamba_d_head"),
            state_size=r.positive_int("mamba_d_state"), n_groups=r.positive_int("mamba_n_groups", 1),
            expand=r.positive_int("mamba_expand", 2), conv_kernel=r.positive_int("mamba_d_conv", 4),
            use_bias=r.flag("mamba_proj_bias", False), use_conv_bias=r.flag("mamba_conv_bias", True),
            time_step_limit=limit, norm_eps=r.number("rms_norm_eps", 1e-5), residual_in_fp32=False,
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            layer_types=[ATTENTION if i in attn else MAMBA for i in range(n)],
            intermediate_size=r.positive_int("intermediate_size"), num_heads=heads,
            num_kv_heads=r.positive_int("num_key_value_heads", heads), head_dim=hidden // heads,
            rope_theta=float(theta), partial_rotary_factor=float(partial),
            max_position_embeddings=r.positive_int("max_position_embeddings", 4096),
            attention_bias=r.flag("attention_bias", False), mlp_bias=r.flag("mlp_bias", False),
            eos_token_ids=eos_ids, model_type="bamba", architecture="BambaForCausalLM",
        )  # fmt: skip


class _Weight(nn.Module):
    """A bare parameter holder (HF names ``norm.weight``, ``conv1d.weight``/``bias``)."""

    def __init__(self, *shape: int, bias: int = 0, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(*shape, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(bias, dtype=dtype)) if bias else None


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: Mamba2Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.H, self.P, self.N, self.G = cfg.mamba_heads, cfg.mamba_head_dim, cfg.state_size, cfg.n_groups
        self.inner = cfg.intermediate_mamba
        self.conv_dim = self.inner + 2 * self.G * self.N
        self.kernel = cfg.conv_kernel
        self.eps, self.dt_limit = cfg.norm_eps, tuple(cfg.time_step_limit)
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.H, bias=cfg.use_bias, dtype=dtype)
        self.conv1d = _Weight(self.conv_dim, 1, self.kernel, bias=self.conv_dim if cfg.use_conv_bias else 0,
                              dtype=dtype)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.H, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.H, dtype=dtype))
        self.D = nn.Parameter(torch.ones(self.H, dtype=dtype))
        self.norm = _Weight(self.inner, dtype=dtype)
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.use_bias, dtype=dtype)
        # Tensor parallelism with one group over every rank's heads (parallel.tensor_parallel_): sums a fp32 tensor
        # over the ranks in place, so that the gated norm's mean square spans the whole group of norm_width channels.
        self.norm_reduce, self.norm_width = None, self.inner

    def state_spec(self, dtype: torch.dtype) -> LinearStateSpec:
        return LinearStateSpec(
            conv_state_shape=(self.conv_dim, self.kernel - 1), recurrent_state_shape=(self.H, self.P, self.N),
            conv_dtype=dtype, recurrent_dtype=torch.float32,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        gate, y = self._conv_scan(self.in_proj(x), state, meta)
        if self.norm_reduce is None:
            y = gated_rms_norm(y, gate, self.norm.weight, eps=self.eps, group_size=self.inner // self.G,
                               norm_before_gate=False)  # fmt: skip
        else:  # this rank's channels of the one group: rms_norm(y * silu(gate)) with the sum of squares of all ranks
            z = y.float() * F.silu(gate.float())
            ss = z.pow(2).sum(-1, keepdim=True)
            self.norm_reduce(ss)
            y = (z * torch.rsqrt(ss / self.norm_width + self.eps) * self.norm.weight.float()).to(x.dtype)
        return self.out_proj(y)

    def _conv_scan(self, proj: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``in_proj``'s output ``[T, inner + conv_dim + H]`` -> ``(gate [T, inner], y [T, inner])``: the causal conv
        (SiLU) over ``xBC`` and the SSD scan (decode: one step per sequence; else chunked over ``cu_seqlens``), each
        reading and updating this layer's conv / SSM state slots."""
        T = proj.shape[0]
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.H], dim=-1)
        conv_state, ssm_state = state
        w, b = self.conv1d.weight.squeeze(1), self.conv1d.bias
        if meta.decode_only:
            xbc = causal_conv1d_update_(xbc, w, conv_state, state_slots=meta.state_slots, bias=b, activation="silu")
        else:
            xbc = causal_conv1d_prefill_(
                xbc, w, conv_state, cu_seqlens=meta.cu_seqlens, state_slots=meta.state_slots,
                has_initial_state=meta.has_initial_state, bias=b, activation="silu",
            )  # fmt: skip
        xs, B, C = xbc.split([self.inner, self.G * self.N, self.G * self.N], dim=-1)
        xs, B, C = xs.reshape(T, self.H, self.P), B.reshape(T, self.G, self.N), C.reshape(T, self.G, self.N)
        A = -torch.exp(self.A_log.float())
        common = dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit)
        if meta.decode_only:
            y = selective_state_update_(xs, dt, A, B, C, ssm_state, state_slots=meta.state_slots, **common)
        else:
            y = mamba_chunk_scan_(
                xs, dt, A, B, C, ssm_state, cu_seqlens=meta.cu_seqlens, state_slots=meta.state_slots,
                has_initial_state=meta.has_initial_state, **common,
            )  # fmt: skip
        return gate, y.reshape(T, self.inner)


def _resolve_plain(name: str) -> tuple[str, Any]:
    return name, None


class Mamba2Block(nn.Module):
    def __init__(self, cfg: Mamba2Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.norm = _Weight(cfg.hidden_size, dtype=dtype)
        self.mixer = Mamba2Mixer(cfg, dtype=dtype)


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: Mamba2Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Mamba2Block(cfg, dtype=dtype) for _ in range(cfg.num_layers))
        self.norm_f = _Weight(cfg.hidden_size, dtype=dtype)


class Mamba2ForCausalLM(nn.Module):
    """Pure Mamba2 causal LM (HF names: ``backbone.*``, ``lm_head``); every layer is recurrent."""

    supports_hybrid_kv = True

    def __init__(self, config: Mamba2Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, Mamba2Config) or ATTENTION in config.layer_types:
            raise TypeError("config must be a pure (all-mixer) Mamba2Config; use BambaForCausalLM for hybrids")
        self.config = config
        self.backbone = Mamba2Backbone(config, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.finish_init()

    def finish_init(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: HybridMetadata
    ) -> torch.Tensor:
        """One ragged step; ``kv_caches[i] = (conv_state, ssm_state)``. Returns ``[T, hidden]`` (model dtype)."""
        layers = self.backbone.layers
        check_step(input_ids, positions, kv_caches, len(layers))
        x = self.backbone.embeddings(input_ids)
        dtype = x.dtype
        # HF keeps the residual stream in fp32 (residual_in_fp32) and adds each mixer's output to it.
        res = x.float() if self.config.residual_in_fp32 else x
        for i, (block, state) in enumerate(zip(layers, kv_caches)):
            h = rms_norm(res.to(dtype), block.norm.weight, eps=self.config.norm_eps)
            res = res + block.mixer(h, state, linear_metadata(meta, i))
        return rms_norm(res.to(dtype), self.backbone.norm_f.weight, eps=self.config.norm_eps)

    def compute_logits(self, hidden: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
        """``hidden [N, H]`` -> fp32 logits ``[N, vocab]`` (``fp32=False``: the lm_head's dtype)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits

    def kv_specs(self) -> list[LinearStateSpec]:
        dtype = self.backbone.embeddings.weight.dtype
        return [block.mixer.state_spec(dtype) for block in self.backbone.layers]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return tied and name == "lm_head.weight"

        load_hf_weights(self, weights, _resolve_plain, arch=self.config.architecture, ignore=ignore)


class BambaAttention(nn.Module):
    def __init__(self, cfg: Mamba2Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                                  dtype=dtype)  # fmt: skip
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype)

    def forward(self, x, positions, cos_sin, kv_cache, meta) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = apply_rope(q.view(T, self.num_heads, D), k.view(T, self.num_kv_heads, D), positions, cos_sin)
        v = v.view(T, self.num_kv_heads, D)
        write_kv_cache_(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, scale=D**-0.5)
        return self.o_proj(o.reshape(T, self.q_size))


class BambaMLP(nn.Module):
    def __init__(self, cfg: Mamba2Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg: Mamba2Config, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.is_mamba = cfg.layer_types[layer] == MAMBA
        if self.is_mamba:
            self.mamba = Mamba2Mixer(cfg, dtype=dtype)
        else:
            self.self_attn = BambaAttention(cfg, dtype=dtype)
        self.feed_forward = BambaMLP(cfg, dtype=dtype)
        self.input_layernorm = _Weight(cfg.hidden_size, dtype=dtype)
        self.pre_ff_layernorm = _Weight(cfg.hidden_size, dtype=dtype)


class BambaModel(nn.Module):
    def __init__(self, cfg: Mamba2Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(BambaDecoderLayer(cfg, i, dtype=dtype) for i in range(cfg.num_layers))
        self.final_layernorm = _Weight(cfg.hidden_size, dtype=dtype)


class BambaForCausalLM(nn.Module):
    """Mamba2 + attention hybrid (HF Bamba): mixer or attention, then a SiLU MLP, per layer.

    Module names follow HF except merged ``qkv_proj`` and ``feed_forward.gate_up_proj``.
    """

    supports_hybrid_kv = True

    def __init__(self, config: Mamba2Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, Mamba2Config):
            raise TypeError(f"config must be a Mamba2Config, got {type(config).__name__}")
        self.config = config
        self.model = BambaModel(config, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.finish_init()

    def finish_init(self) -> None:
        self.cos_sin_cache = tie_and_rope_table(self, base=self.config.rope_theta, scaling=None)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: HybridMetadata
    ) -> torch.Tensor:
        """One ragged step over mixer and attention layers. Returns ``[T, hidden]``."""
        layers, eps = self.model.layers, self.config.norm_eps
        check_step(input_ids, positions, kv_caches, len(layers))
        x = self.model.embed_tokens(input_ids)
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
            x, residual = fused_add_rms_norm(x, residual, layer.pre_ff_layernorm.weight, eps=eps)
            x = layer.feed_forward(x)
        x, _ = fused_add_rms_norm(x, residual, self.model.final_layernorm.weight, eps=eps)
        return x

    def compute_logits(self, hidden: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
        """``hidden [N, H]`` -> fp32 logits ``[N, vocab]`` (``fp32=False``: the lm_head's dtype)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits

    def kv_specs(self) -> list[FullAttentionSpec | LinearStateSpec]:
        dtype = self.model.embed_tokens.weight.dtype
        return [
            layer.mamba.state_spec(dtype)
            if layer.is_mamba
            else FullAttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, dtype=dtype)
            for layer in self.model.layers
        ]

    _MERGED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.(q|k|v)|feed_forward\.(gate|up))_proj\.(weight|bias)$")

    def _resolve(self, name: str) -> tuple[str, Any]:
        m = self._MERGED.match(name)
        if m is None:
            return name, None
        prefix, _, attn, mlp, kind = m.groups()
        cfg = self.config
        if attn:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[attn]
            return f"{prefix}self_attn.qkv_proj.{kind}", slice(*rows)
        i = cfg.intermediate_size
        return f"{prefix}feed_forward.gate_up_proj.{kind}", slice(0, i) if mlp == "gate" else slice(i, 2 * i)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")

        load_hf_weights(self, weights, self._resolve, arch=self.config.architecture, ignore=ignore)
