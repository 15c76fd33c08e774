"""OpenAI GPT-OSS (``model_type: gpt_oss``, HF ``GptOssForCausalLM``): a pre-norm MoE decoder with attention sinks.

Differences from Llama, all resolved here:

- attention sinks: each query head has a learned logit ``sinks [Hq]`` that joins its softmax's denominator (no
  value); the paged attention ops take it as ``sinks`` (fp32);
- q / k / v / o biases; layers alternate sliding-window and full attention (``layer_types``, ``sliding_window``);
  RoPE with YaRN scaling (``rope_parameters`` / ``rope_scaling``, ``truncate`` as transformers reads it), neox
  rotation over the whole head;
- every MLP is routed experts: a router with a bias, softmax over the top-k logits; experts with biases, their
  ``gate_up_proj [E, H, 2I]`` interleaving gate and up columns (gate = ``[..., ::2]``, up = ``[..., 1::2]``) and a
  clamped SwiGLU: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)`` (``alpha`` 1.702, ``limit`` 7.0 in the released configs).

The experts run in torch (:class:`GptOssExperts`), in transformers' layout (``x @ W``), so checkpoints load as
they are stored; ``ops.moe_experts_routed`` takes neither biases nor this activation. On the CPU (and CUDA outside
graph capture without bf16) one pair of matmuls per routed expert over its tokens, reading only routed experts; CUDA
bf16 sorts the (token, expert) pairs through ``torch._grouped_mm`` (no host wait, so decode steps can be CUDA
graphs); other CUDA dtypes under graph capture run every expert densely (``experts_path``).

KV: each layer declares a :class:`~infercore.kv.FullAttentionSpec` with its window (``kv_specs``; sliding layers get
the multi-granularity manager's freed pages); the model reads a dense :class:`~infercore.ops.AttentionMetadata` or a
:class:`~infercore.models.hybrid.HybridMetadata` with one entry per layer.

Checkpoints: HF safetensors with bf16 / fp32 tensors, or the released MXFP4 ones (the experts' ``*_blocks`` /
``*_scales``), dequantized on load (:func:`dequantize_mxfp4`). ``tensor_parallel_`` shards the attention by heads
(the sinks with their heads) and every expert by width, or whole experts per rank (``experts="ep"``:
``GptOssExperts.expert_offset``; pairs routed elsewhere skipped).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..ops import AttentionMetadata, apply_rope, fused_add_rms_norm, paged_attention, write_kv_cache_
from .config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, _parse_rope
from .hybrid import HFConfigReader, HybridMetadata, check_step, layer_metadata, load_hf_weights
from .llama import LlamaForCausalLM, RMSNorm, prenorm_block

__all__ = ["GptOssConfig", "GptOssExperts", "GptOssForCausalLM", "dequantize_mxfp4"]

KVCache = tuple[torch.Tensor, torch.Tensor]

# GptOssConfig's RoPE when a config.json names none (transformers' defaults)
_DEFAULT_THETA = 150000.0
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


@dataclass
class GptOssConfig(ModelConfig):
    """:class:`ModelConfig` plus GPT-OSS's experts: ``num_experts`` (``num_local_experts``) of width
    ``intermediate_size``, ``num_experts_per_tok`` routed per token, the clamped SwiGLU's ``swiglu_alpha`` /
    ``swiglu_limit``."""

    num_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    model_type: str = "gpt_oss"
    architecture: str = "GptOssForCausalLM"

    def validate(self) -> None:
        super().validate()
        for name in ("num_experts", "num_experts_per_tok"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"GptOssConfig.{name} must be a positive int, got {v!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"GptOssConfig.num_experts_per_tok={self.num_experts_per_tok} must be <= "
                             f"num_experts={self.num_experts}")  # fmt: skip
        for name in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"GptOssConfig.{name} must be a positive number, got {v!r}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> GptOssConfig:
        """From an HF ``gpt_oss`` config dict (transformers 5's ``rope_parameters`` or 4.x's ``rope_theta`` +
        ``rope_scaling``); absent keys take ``GptOssConfig``'s defaults (alternating layers from a sliding one,
        window 128, YaRN factor 32 over 4096 positions, theta 150000). ``ValueError`` names a malformed key."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        if hf.get("model_type") != "gpt_oss":
            raise ValueError(f"model_type must be 'gpt_oss', got {hf.get('model_type')!r}")
        archs = hf.get("architectures") or ["GptOssForCausalLM"]
        if archs != ["GptOssForCausalLM"]:
            raise ValueError(f"HF config architectures={archs!r} is not supported for model_type='gpt_oss'; "
                             "expected ['GptOssForCausalLM']")
        r = HFConfigReader(hf, "gpt_oss")
        hidden = r.positive_int("hidden_size", 2880)
        num_layers = r.positive_int("num_hidden_layers", 36)
        num_heads = r.positive_int("num_attention_heads", 64)
        layer_types = r.str_list("layer_types")
        if layer_types is None:
            layer_types = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)]
        max_pos = r.positive_int("max_position_embeddings", 131072)
        rope_src = dict(hf)
        params = r.mapping("rope_parameters") or r.mapping("rope_scaling")
        if not params:
            params = dict(_DEFAULT_ROPE)
        params.setdefault("rope_theta", r.number("rope_theta", _DEFAULT_THETA))
        rope_src.update(rope_parameters=params, rope_scaling=None)
        theta, scaling, partial = _parse_rope(rope_src, "gpt_oss", max_pos, r.positive_int(
            "original_max_position_embeddings", None))  # fmt: skip
        eos_ids, bos = r.token_ids()
        bias = r.flag("attention_bias", True)
        return cls(
            vocab_size=r.positive_int("vocab_size", 201088),
            hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size", 2880),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=r.positive_int("num_key_value_heads", num_heads),
            head_dim=r.positive_int("head_dim", 64),
            rms_norm_eps=r.number("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=max_pos,
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            attention_bias=bias,
            o_bias=bias,
            sliding_window=r.check("sliding_window", hf.get("sliding_window", 128), int, "a positive int or null",
                                   lambda v: v > 0),  # fmt: skip
            layer_types=layer_types,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            num_experts=r.positive_int("num_local_experts", 128),
            num_experts_per_tok=r.positive_int("num_experts_per_tok", 4),
            swiglu_alpha=r.number("swiglu_alpha", 1.702),
            swiglu_limit=r.number("swiglu_limit", 7.0),
        )


class GptOssAttention(nn.Module):
    """Biased q / k / v (merged ``qkv_proj``) and o projections, RoPE, paged attention with per-head ``sinks``."""

    def __init__(self, config: GptOssConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        self.scale = d**-0.5
        self.sliding_window = config.layer_sliding_window(layer)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias,
                                  dtype=dtype)  # fmt: skip
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads, dtype=dtype))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, k, positions, cos_sin)
        k_cache, v_cache = kv_cache
        # int8 / fp8 caches (kv.cache.QuantizedKVCache) carry their per-(token, head) scales
        scales = {"k_scale": kv_cache.k_scale, "v_scale": kv_cache.v_scale} if hasattr(kv_cache, "k_scale") else {}
        write_kv_cache_(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        # A prefill implementation that takes this step's K/V contiguously reads them from k / v (else the cache).
        new_kv = {} if meta.decode_only else {"k": k, "v": v.contiguous()}
        o = paged_attention(q, k_cache, v_cache, meta, scale=self.scale, sliding_window=self.sliding_window,
                            sinks=self.sinks.float(), **scales, **new_kv)  # fmt: skip
        return self.o_proj(o.reshape(T, self.q_size))


class GptOssExperts(nn.Module):
    """``num_experts`` experts in transformers' layout: ``gate_up_proj [E, H, 2I]`` (gate and up columns
    interleaved), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``; the clamped
    SwiGLU between them."""

    def __init__(self, config: GptOssConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i, dtype=dtype))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, i, h, dtype=dtype))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h, dtype=dtype))
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)
        # expert parallelism (tensor_parallel_(experts="ep")): these are experts [offset, offset + E) of a larger set
        self.expert_offset: int | None = None

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[N, 2I]`` interleaved gate / up -> ``[N, I]``: ``(clamp(up) + 1) * g * sigmoid(alpha * g)``,
        ``g = min(gate, limit)``."""
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, expert ids ``[T, k]`` and their weights ``[T, k]`` -> ``[T, H]`` in x's dtype, the routed
        experts' outputs summed with their weights (the path :func:`experts_path` picks)."""
        if self.expert_offset is not None:  # pairs routed to experts held elsewhere: the sentinel id E, weight 0
            E = self.gate_up_proj.shape[0]
            local = ids - self.expert_offset
            held = (local >= 0) & (local < E)
            ids, weights = torch.where(held, local, E), torch.where(held, weights, 0)
        path = experts_path(x)
        if path == "grouped":
            return self.forward_grouped(x, ids, weights)
        if path == "dense":
            return self.forward_dense(x, ids, weights)
        return self.forward_loop(x, ids, weights)

    def forward_loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One pair of matmuls per expert some token chose, over its tokens (reads only those experts; the
        per-expert counts come to the host)."""
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        E = self.gate_up_proj.shape[0]
        counts = torch.bincount(flat, minlength=E).tolist()
        k = ids.shape[1]
        start = 0
        for e, n in enumerate(counts[:E]):  # the sentinel id E (experts held elsewhere) sorts last: never run
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tok = sel // k
            h = x[tok] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            y = self.activation(h) @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, tok, (y * weights.reshape(-1)[sel, None]).to(x.dtype))
        return out

    def forward_grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The (token, expert) pairs sorted by expert through two grouped GEMMs (``torch._grouped_mm``, offsets on
        the device): only routed experts are read and nothing waits for the host (CUDA-graph safe)."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        eid = flat[order]
        tok = order // k
        # end of each expert's rows: searchsorted on the sorted ids (bincount would read its size on the host)
        E = self.gate_up_proj.shape[0]
        experts = torch.arange(E, device=x.device, dtype=eid.dtype)
        offs = torch.searchsorted(eid, experts, right=True).to(torch.int32)
        bias = eid.clamp(max=E - 1)  # the sentinel id E (experts held elsewhere) sorts last, past every group
        h = torch._grouped_mm(x[tok], self.gate_up_proj, offs=offs) + self.gate_up_proj_bias[bias]
        y = torch._grouped_mm(self.activation(h).contiguous(), self.down_proj, offs=offs) + self.down_proj_bias[bias]
        y = y * weights.reshape(-1)[order, None]
        if self.expert_offset is not None:  # rows past the last group are not written by the grouped GEMMs
            y = torch.where((eid < E)[:, None], y, 0)
        return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))

    def forward_dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, weighted by the routing weights (0 for experts a token did not choose):
        fixed shapes and no host wait, at ``num_experts / k`` times the routed work (CUDA graphs without
        ``torch._grouped_mm``)."""
        E = self.gate_up_proj.shape[0]
        w = torch.zeros(x.shape[0], E + 1, dtype=weights.dtype, device=x.device)  # column E: the sentinel id
        w.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e in range(E):
            h = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            y = self.activation(h) @ self.down_proj[e] + self.down_proj_bias[e]
            out += (y * w[:, e, None]).to(x.dtype)
        return out


def experts_path(x: torch.Tensor) -> str:
    """How :class:`GptOssExperts` runs for activations ``x``: ``"grouped"`` (CUDA bf16 with ``torch._grouped_mm``),
    ``"dense"`` (other CUDA dtypes while a CUDA graph is being captured: the loop's host wait cannot be captured),
    else ``"loop"``. ``INFERCORE_GPT_OSS_EXPERTS`` (loop / grouped / dense) forces one."""
    forced = os.environ.get("INFERCORE_GPT_OSS_EXPERTS")
    if forced:
        if forced not in ("loop", "grouped", "dense"):
            raise ValueError(f"INFERCORE_GPT_OSS_EXPERTS: expected loop, grouped or dense, got {forced!r}")
        return forced
    if x.device.type == "cuda":
        if x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            return "grouped"
        if torch.cuda.is_current_stream_capturing():
            return "dense"
    return "loop"


class GptOssMLP(nn.Module):
    """The router (``router.weight [E, H]``, ``router.bias [E]``; softmax over each token's top-k logits) and
    the experts."""

    def __init__(self, config: GptOssConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True, dtype=dtype)
        self.experts = GptOssExperts(config, dtype=dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (weights ``[T, k]`` in x's dtype, expert ids ``[T, k]``)."""
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: GptOssConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer, dtype=dtype)
        self.mlp = GptOssMLP(config, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return prenorm_block(self, x, residual, positions, cos_sin, kv_cache, meta)


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS causal LM over paged KV (dense or hybrid metadata). Module names follow HF except the merged
    ``qkv_proj``; one fp32 RoPE table (non-persistent buffer ``cos_sin_cache``, YaRN's attention factor in it).
    The embedding, final norm, head, RoPE table and KV specs are :class:`LlamaForCausalLM` 's; the decoder layers,
    the step (per-layer metadata, no fused CPU decode stack) and the weights' names are GPT-OSS's."""

    decoder_layer = GptOssDecoderLayer
    supports_hybrid_kv = True

    def __init__(self, config: GptOssConfig, *, dtype: torch.dtype | None = None) -> None:
        if not isinstance(config, GptOssConfig):
            raise TypeError(f"config must be a GptOssConfig, got {type(config).__name__}")
        super().__init__(config, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | HybridMetadata) -> torch.Tensor:  # fmt: skip
        """One ragged step: ``input_ids``/``positions`` ``[T]``; ``kv_caches[i]`` is layer ``i``'s
        ``(k_cache, v_cache)`` ``[num_pages, page_size, Hk, D]``; ``meta`` dense or per layer.
        Returns final-normed hidden states ``[T, hidden_size]`` in the model dtype."""
        layers = self.model.layers
        check_step(input_ids, positions, kv_caches, len(layers))
        x = self.model.embed_tokens(input_ids)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
            x, residual = layer(x, residual, positions, self.cos_sin_cache, kv_cache, layer_metadata(meta, i))
        norm = self.model.norm
        x, _ = fused_add_rms_norm(x, residual, norm.weight, eps=norm.eps)
        return x

    # ------------------------------------------------------------------ weights
    _QKV = re.compile(r"^(model\.layers\.\d+\.self_attn\.)(q|k|v)_proj\.(weight|bias)$")
    _IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

    def _resolve(self, name: str) -> tuple[str, Any]:
        m = self._QKV.match(name)
        if m is None:
            return name, None
        prefix, proj, kind = m.groups()
        q, kv = self.config.num_heads * self.config.head_dim, self.config.num_kv_heads * self.config.head_dim
        rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[proj]
        return f"{prefix}qkv_proj.{kind}", slice(*rows)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (``ValueError`` naming an unknown, duplicate, misshapen or missing one); MXFP4
        experts (``*_blocks`` with their ``*_scales``) are dequantized first."""
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return bool(self._IGNORED.search(name)) or (tied and name == "lm_head.weight")

        load_hf_weights(self, _dequantized(weights), self._resolve, arch=self.config.architecture, ignore=ignore)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


# ---------------------------------------------------------------------------------------------------- MXFP4
# The e2m1 code points (4-bit: sign, 2 exponent bits, 1 mantissa bit), as transformers' integrations/mxfp4.py
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4 = re.compile(r"^(.*\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:  # fmt: skip
    """An MXFP4 expert tensor as the released GPT-OSS checkpoints store it -> the dense tensor in transformers'
    layout.

    ``blocks``: uint8 ``[E, R, G, 16]``, 32 e2m1 values per group of ``G`` along the last (input) axis, two a byte
    (low nibble first); ``scales``: uint8 ``[E, R, G]``, one power of two per group (exponent biased by 127).
    Returns ``[E, G * 32, R]`` in ``dtype`` (``R`` rows become the last axis: ``x @ W``, as the model holds them).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"dequantize_mxfp4: blocks and scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"dequantize_mxfp4: blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)}: expected "
                         "[E, R, G, 16] and [E, R, G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    vals = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)  # [E, R, G, 32], low nibble first
    exp = scales.to(torch.int32) - 127
    vals = torch.ldexp(vals, exp.unsqueeze(-1).to(torch.float32))
    e, r = blocks.shape[:2]
    return vals.reshape(e, r, -1).transpose(1, 2).contiguous().to(dtype)


def _dequantized(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each MXFP4 pair (``X_blocks`` + ``X_scales``, in any order) replaced by ``X`` dense."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        m = _MXFP4.match(name)
        if m is None:
            yield name, t
            continue
        base, part = m.groups()
        got = pending.setdefault(base, {})
        if part in got:
            raise ValueError(f"load_weights: tensor {name!r} given twice")
        got[part] = t
        if len(got) == 2:
            del pending[base]
            yield base, dequantize_mxfp4(got["blocks"], got["scales"])
    if pending:
        base, got = next(iter(pending.items()))
        missing = "scales" if "blocks" in got else "blocks"
        raise ValueError(f"load_weights: {base}_{missing} is missing (MXFP4 needs both _blocks and _scales)")
