"""TII Falcon-H1 (HF ``FalconH1ForCausalLM``): attention and a Mamba2 mixer side by side in every layer, with muP
multipliers.

Each layer: ``h = rms_norm(x)``; ``x += ssm_out * mixer(h) + attn_out * attention(attn_in * h)``; then
``x += mlp(rms_norm(x))``. The multipliers, all read from the config and applied to activations (the weights stay
as stored):

* embeddings ``* embedding_multiplier``, logits ``* lm_head_multiplier``;
* attention: keys ``* key_multiplier`` (before RoPE), input ``* attention_in_multiplier``, output
  ``* attention_out_multiplier``; softmax scale ``head_dim ** -0.5``, RoPE over the whole head;
* mixer: input ``* ssm_in_multiplier``, ``in_proj``'s output by segment ``* ssm_multipliers`` (gate z, x, B, C, dt),
  output ``* ssm_out_multiplier``; inner width ``mamba_d_ssm`` (else ``mamba_expand * hidden_size``); the gated norm
  is optional (``mamba_rms_norm``; without it ``y * silu(z)``) and may normalise before the gate
  (``mamba_norm_before_gate``); ``out_proj``'s bias follows ``projectors_bias``;
* MLP: ``down_proj(up * silu(gate * g)) * d`` with ``mlp_multipliers = [g, d]``.

Every layer holds both paged KV and Mamba2 states, so the model declares ``2 * num_layers`` KV specs: attention
layer ``i``'s at index ``i``, its mixer's at ``num_layers + i`` (``kv_caches`` and the
:class:`~infercore.models.hybrid.HybridMetadata` entries follow). ``tensor_parallel_`` shards the attention and
the mixer by heads (``segment_scale`` rebuilt for the rank's rows; with one group the gated norm's mean square is
summed over the ranks) and the MLP by width.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kv.hybrid import FullAttentionSpec, LinearStateSpec
from ..ops import apply_rope, fused_add_rms_norm, paged_attention, rms_norm, write_kv_cache_
from ..ops.gated_norm import gated_rms_norm
from .hybrid import HFConfigReader, HybridMetadata, check_step, layer_metadata, linear_metadata, load_hf_weights
from .llama import tie_and_rope_table
from .mamba2 import BambaAttention, BambaForCausalLM, BambaMLP, Mamba2Mixer, _Weight

__all__ = ["FalconH1Config", "FalconH1ForCausalLM"]


@dataclass
class FalconH1Config:
    """Falcon-H1 sizes and multipliers; the Mamba2 fields are named as
    :class:`~infercore.models.mamba2.Mamba2Config`'s (the mixer reads them)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mamba_heads: int
    mamba_head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    projectors_bias: bool = False
    mamba_rms_norm: bool = False
    mamba_norm_before_gate: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "falcon_h1"
    architecture: str = "FalconH1ForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "mamba_heads", "mamba_head_dim", "state_size", "n_groups", "conv_kernel",
                     "max_position_embeddings"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"FalconH1Config.{name} must be a positive int, got {v!r}")
        if self.mamba_heads % self.n_groups:
            raise ValueError(f"FalconH1Config.n_groups={self.n_groups} must divide mamba_heads={self.mamba_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"FalconH1Config.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"FalconH1Config.head_dim={self.head_dim} must be even (RoPE over the whole head)")
        for name, n in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
            v = getattr(self, name)
            if not isinstance(v, list | tuple) or len(v) != n or not all(_finite(x) for x in v):
                raise ValueError(f"FalconH1Config.{name} must be {n} finite numbers, got {v!r}")
        for name in ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
                     "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier"):  # fmt: skip
            if not _finite(getattr(self, name)):
                raise ValueError(f"FalconH1Config.{name} must be a finite number, got {getattr(self, name)!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"FalconH1Config.norm_eps must be > 0, got {self.norm_eps!r}")

    @property
    def intermediate_mamba(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> FalconH1Config:
        """From an HF ``falcon_h1`` config dict (HF's defaults for absent keys)."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        mt = hf.get("model_type")
        if mt != "falcon_h1":
            raise ValueError(f"model_type must be 'falcon_h1', got {mt!r}")
        r = HFConfigReader(hf, mt)
        eos_ids, _ = r.token_ids()
        r.check("hidden_act", r.get("hidden_act", "silu"), str, "'silu'", lambda v: v == "silu")
        hidden, heads = r.positive_int("hidden_size", 4096), r.positive_int("num_attention_heads", 32)
        if "head_dim" not in hf and hidden % heads:
            raise ValueError(f"HF {mt} config: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                             f"(and no head_dim is given)")  # fmt: skip
        d_ssm = r.get("mamba_d_ssm", 1024)
        r.check("mamba_d_ssm", d_ssm, int, "a positive int or null", lambda v: v > 0)
        if d_ssm is None or "mamba_d_ssm" in hf and hf["mamba_d_ssm"] is None:
            d_ssm = r.positive_int("mamba_expand", 2) * hidden
        m_heads = r.positive_int("mamba_n_heads", 128)
        m_head_dim = r.get("mamba_d_head", "auto")
        if m_head_dim == "auto":
            m_head_dim = d_ssm // m_heads
        r.check("mamba_d_head", m_head_dim, int, "a positive int or 'auto'", lambda v: v > 0)
        if m_heads * m_head_dim != d_ssm:
            raise ValueError(f"HF {mt} config: mamba_n_heads * mamba_d_head ({m_heads * m_head_dim}) must equal the "
                             f"mixer width (mamba_d_ssm, else mamba_expand * hidden_size: {d_ssm})")  # fmt: skip
        rope = r.mapping("rope_parameters")
        kind = rope.get("rope_type", rope.get("type", "default"))
        r.check("rope_parameters", kind, str, "default RoPE (rope_type 'default')", lambda v: v == "default")
        r.check("rope_scaling", r.hf.get("rope_scaling"), Mapping, "null or default RoPE",
                lambda v: v.get("rope_type", v.get("type", "default")) == "default")  # fmt: skip
        theta = rope.get("rope_theta")
        theta = r.number("rope_theta", 10000.0) if theta is None else theta
        r.check("rope_theta", theta, (int, float), "a positive number", lambda v: v > 0)
        limit = r.get("time_step_limit", (0.0, math.inf))
        r.check("time_step_limit", limit, list | tuple, "a [min, max] pair of numbers with 0 <= min <= max",
                lambda v: len(v) == 2 and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
                and 0 <= v[0] <= v[1])  # fmt: skip

        def mult(key: str) -> float:
            return float(r.check(key, r.get(key, 1.0), (int, float), "a finite number", _finite))

        def mults(key: str, n: int) -> tuple[float, ...]:
            v = r.check(key, r.get(key, [1.0] * n), list | tuple, f"a list of {n} finite numbers",
                        lambda v: len(v) == n and all(_finite(x) for x in v))  # fmt: skip
            return tuple(float(x) for x in v)

        return cls(
            vocab_size=r.positive_int("vocab_size", 128000), hidden_size=hidden,
            num_layers=r.positive_int("num_hidden_layers", 32),
            intermediate_size=r.positive_int("intermediate_size", 14336), num_heads=heads,
            num_kv_heads=r.positive_int("num_key_value_heads", heads),
            head_dim=r.positive_int("head_dim", hidden // heads), mamba_heads=m_heads, mamba_head_dim=m_head_dim,
            state_size=r.positive_int("mamba_d_state", 256), n_groups=r.positive_int("mamba_n_groups", 1),
            conv_kernel=r.positive_int("mamba_d_conv", 4), use_bias=r.flag("mamba_proj_bias", False),
            use_conv_bias=r.flag("mamba_conv_bias", True), projectors_bias=r.flag("projectors_bias", False),
            mamba_rms_norm=r.flag("mamba_rms_norm", False),
            mamba_norm_before_gate=r.flag("mamba_norm_before_gate", True),
            time_step_limit=(float(limit[0]), float(limit[1])), norm_eps=r.number("rms_norm_eps", 1e-5),
            rope_theta=float(theta), max_position_embeddings=r.positive_int("max_position_embeddings", 8192),
            attention_bias=r.flag("attention_bias", False), mlp_bias=r.flag("mlp_bias", False),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            embedding_multiplier=mult("embedding_multiplier"), lm_head_multiplier=mult("lm_head_multiplier"),
            key_multiplier=mult("key_multiplier"), attention_in_multiplier=mult("attention_in_multiplier"),
            attention_out_multiplier=mult("attention_out_multiplier"), ssm_in_multiplier=mult("ssm_in_multiplier"),
            ssm_out_multiplier=mult("ssm_out_multiplier"), ssm_multipliers=mults("ssm_multipliers", 5),
            mlp_multipliers=mults("mlp_multipliers", 2), eos_token_ids=eos_ids,
        )  # fmt: skip


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba2 mixer with Falcon-H1's input / per-segment multipliers, optional gated norm (before or after the
    gate) and ``projectors_bias`` on ``out_proj``."""

    def __init__(self, cfg: FalconH1Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, dtype=dtype)
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.projectors_bias, dtype=dtype)
        if not cfg.mamba_rms_norm:
            del self.norm
            self.norm = None
        self.norm_before_gate = cfg.mamba_norm_before_gate
        self.in_multiplier = cfg.ssm_in_multiplier
        self.ssm_multipliers = tuple(cfg.ssm_multipliers)
        # in_proj's output rows [gate | x | B | C | dt] times their multipliers; None when all are 1
        scaled = set(self.ssm_multipliers) != {1.0}
        self.register_buffer("segment_scale", torch.ones(self.in_proj.out_features, dtype=dtype) if scaled else None,
                             persistent=False)  # fmt: skip

    @torch.no_grad()
    def fill_segment_scale_(self) -> None:
        """Write ``segment_scale`` (after the model is materialised: buffers built on ``meta`` hold nothing)."""
        s = self.segment_scale
        if s is None or s.device.type == "meta":
            return
        GN = self.G * self.N
        sizes = [self.inner, self.inner, GN, GN, self.H]
        for part, m in zip(s.split(sizes), self.ssm_multipliers):
            part.fill_(m)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        proj = self.in_proj(x * self.in_multiplier if self.in_multiplier != 1.0 else x)
        if self.segment_scale is not None:
            proj = proj * self.segment_scale
        gate, y = self._conv_scan(proj, state, meta)
        if self.norm is None:
            y = (y.float() * F.silu(gate.float())).to(x.dtype)
        elif self.norm_reduce is not None:  # tensor_parallel_, one group: mean squares over every rank's channels
            g = F.silu(gate.float())
            z = y.float() if self.norm_before_gate else y.float() * g
            ss = z.pow(2).sum(-1, keepdim=True)
            self.norm_reduce(ss)
            z = z * torch.rsqrt(ss / self.norm_width + self.eps) * self.norm.weight.float()
            y = (z * g if self.norm_before_gate else z).to(x.dtype)
        else:
            y = gated_rms_norm(y, gate, self.norm.weight, eps=self.eps, group_size=self.inner // self.G,
                               norm_before_gate=self.norm_before_gate)  # fmt: skip
        return self.out_proj(y)


class FalconH1Attention(BambaAttention):
    """GQA over paged KV with keys scaled by ``key_multiplier`` before RoPE."""

    def __init__(self, cfg: FalconH1Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, dtype=dtype)
        self.key_multiplier = cfg.key_multiplier

    def forward(self, x, positions, cos_sin, kv_cache, meta) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = k * self.key_multiplier if self.key_multiplier != 1.0 else k
        q, k = apply_rope(q.reshape(T, self.num_heads, D), k.reshape(T, self.num_kv_heads, D), positions, cos_sin)
        v = v.reshape(T, self.num_kv_heads, D)
        write_kv_cache_(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, scale=D**-0.5)
        return self.o_proj(o.reshape(T, self.q_size))


class FalconH1MLP(BambaMLP):
    """``down_proj(up * silu(gate * g)) * d`` (merged ``gate_up_proj``)."""

    def __init__(self, cfg: FalconH1Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, dtype=dtype)
        self.gate_multiplier, self.down_multiplier = cfg.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate * self.gate_multiplier) * up) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: FalconH1Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.mamba = FalconH1Mixer(cfg, dtype=dtype)
        self.self_attn = FalconH1Attention(cfg, dtype=dtype)
        self.feed_forward = FalconH1MLP(cfg, dtype=dtype)
        self.input_layernorm = _Weight(cfg.hidden_size, dtype=dtype)
        self.pre_ff_layernorm = _Weight(cfg.hidden_size, dtype=dtype)


class FalconH1Model(nn.Module):
    def __init__(self, cfg: FalconH1Config, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(cfg, dtype=dtype) for _ in range(cfg.num_layers))
        self.final_layernorm = _Weight(cfg.hidden_size, dtype=dtype)


class FalconH1ForCausalLM(BambaForCausalLM):
    """Falcon-H1 causal LM over the hybrid KV pool (module names as HF except merged ``qkv_proj`` and
    ``feed_forward.gate_up_proj``). ``kv_caches`` / metadata: ``num_layers`` attention entries, then
    ``num_layers`` mixer entries."""


    def __init__(self, config: FalconH1Config, *, dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, FalconH1Config):
            raise TypeError(f"config must be a FalconH1Config, got {type(config).__name__}")
        self.config = config
        self.model = FalconH1Model(config, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.finish_init()

    def finish_init(self) -> None:
        self.cos_sin_cache = tie_and_rope_table(self, base=self.config.rope_theta, scaling=None)
        for layer in self.model.layers:
            layer.mamba.fill_segment_scale_()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: HybridMetadata
    ) -> torch.Tensor:
        """One ragged step. ``kv_caches[i]`` is layer ``i``'s ``(k_cache, v_cache)``, ``kv_caches[n + i]`` its
        ``(conv_state, ssm_state)``. Returns ``[T, hidden]`` (final-normed)."""
        layers, cfg = self.model.layers, self.config
        n, eps = len(layers), cfg.norm_eps
        check_step(input_ids, positions, kv_caches, 2 * n)
        x = self.model.embed_tokens(input_ids)
        if cfg.embedding_multiplier != 1.0:
            x = x * cfg.embedding_multiplier
        residual = None
        for i, layer in enumerate(layers):
            w = layer.input_layernorm.weight
            if residual is None:
                residual, x = x, rms_norm(x, w, eps=eps)
            else:
                x, residual = fused_add_rms_norm(x, residual, w, eps=eps)
            m = layer.mamba(x, kv_caches[n + i], linear_metadata(meta, n + i)) * cfg.ssm_out_multiplier
            a = layer.self_attn(x * cfg.attention_in_multiplier, positions, self.cos_sin_cache, kv_caches[i],
                                layer_metadata(meta, i))  # fmt: skip
            x, residual = fused_add_rms_norm(m + a * cfg.attention_out_multiplier, residual,
                                             layer.pre_ff_layernorm.weight, eps=eps)  # fmt: skip
            x = layer.feed_forward(x)
        x, _ = fused_add_rms_norm(x, residual, self.model.final_layernorm.weight, eps=eps)
        return x

    def compute_logits(self, hidden: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
        """``hidden [N, H]`` -> fp32 logits ``[N, vocab]`` times ``lm_head_multiplier`` (``fp32=False``: the lm_head's
        dtype)."""
        logits = self.lm_head(hidden) * self.config.lm_head_multiplier
        return logits.float() if fp32 else logits

    def kv_specs(self) -> list[FullAttentionSpec | LinearStateSpec]:
        dtype = self.model.embed_tokens.weight.dtype
        layers = self.model.layers
        return ([FullAttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, dtype=dtype)
                 for layer in layers] + [layer.mamba.state_spec(dtype) for layer in layers])  # fmt: skip

    _MERGED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.(q|k|v)|feed_forward\.(gate|up))_proj\.(weight|bias)$")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return (tied and name == "lm_head.weight") or name.endswith(("rotary_emb.inv_freq", "mup_vector"))

        load_hf_weights(self, weights, self._resolve, arch=self.config.architecture, ignore=ignore)
