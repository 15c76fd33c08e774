"""AI2 OLMo 2: the Llama decoder with its norms moved after the sublayers.

Two differences from Llama, both in the decoder layer:

- no norm before attention or the MLP; an RMSNorm on each sublayer's output before its residual add
  (``h = h + post_attention_layernorm(attn(h))``, ``h = h + post_feedforward_layernorm(mlp(h))``);
- ``q_norm`` / ``k_norm`` are RMSNorms over the whole q and k projections (``num_heads * head_dim`` and
  ``num_kv_heads * head_dim`` channels, all heads at once), before RoPE; Qwen3's norm each head instead.

The fused CPU decode layer (``cpu_native.llama_decode_layer``) computes the pre-norm layer, so these layers run op
by op (``LlamaForCausalLM._native_stack`` takes ``LlamaDecoderLayer`` s alone). Inside the attention the Llama
paths run, fused ones included (RoPE + KV write + decode attention on CUDA), after the norms.

``tensor_parallel_``: a rank holding its heads' rows of q and k takes the norms' mean squares over every head from
the group's partial sums of squares (one all-reduce of ``[T, 2]`` floats per layer, ``Olmo2Attention.norm_reduce``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..devices import dispatch
from ..ops import AttentionMetadata
from .config import ModelConfig
from .llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaForSequenceClassification, LlamaMLP, RMSNorm


class Olmo2Attention(LlamaAttention):
    """Llama attention with ``q_norm`` ``[num_heads * head_dim]`` / ``k_norm`` ``[num_kv_heads * head_dim]`` over
    the whole projections."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, layer, dtype=dtype)
        self.q_norm = RMSNorm(self.q_size, eps=config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(self.kv_size, eps=config.rms_norm_eps, dtype=dtype)

    # tensor_parallel_: sums [T, 2] partial sums of squares over the group, and the unsharded q / k widths
    norm_reduce = None
    norm_widths: tuple[int, int] = (0, 0)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norm_reduce is None:
            norm = dispatch("rms_norm", x.device)
            q = norm(q.contiguous(), self.q_norm.weight, eps=self.q_norm.eps)
            k = norm(k.contiguous(), self.k_norm.weight, eps=self.k_norm.eps)
        else:  # this rank's heads: the mean squares over every head's columns, from the group's partial sums
            qf, kf = q.float(), k.float()
            ss = self.norm_reduce(torch.stack([qf.square().sum(-1), kf.square().sum(-1)], dim=-1).contiguous())
            q = (qf * torch.rsqrt(ss[:, :1] / self.norm_widths[0] + self.q_norm.eps)).to(x.dtype) * self.q_norm.weight
            k = (kf * torch.rsqrt(ss[:, 1:] / self.norm_widths[1] + self.k_norm.eps)).to(x.dtype) * self.k_norm.weight
        return (q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
                v.view(T, self.num_kv_heads, self.head_dim))


class Olmo2DecoderLayer(nn.Module):
    """Post-norm decoder layer. Takes and returns the residual stream split as ``(x, residual)`` like
    ``LlamaDecoderLayer`` (the stream is ``x + residual``; ``residual`` None in the first layer), so the model's
    final ``fused_add_rms_norm`` adds the last MLP output."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer, dtype=dtype)
        self.mlp = LlamaMLP(config, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = dispatch("rms_norm", x.device)
        h = x if residual is None else x + residual
        n = self.post_attention_layernorm
        h = h + norm(self.self_attn(h, positions, cos_sin, kv_cache, meta), n.weight, eps=n.eps)
        n = self.post_feedforward_layernorm
        return norm(self.mlp(h), n.weight, eps=n.eps), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 causal LM over paged KV (HF tensor names; q/k/v and gate/up merged on load as for Llama)."""

    decoder_layer = Olmo2DecoderLayer


class Olmo2ForSequenceClassification(Olmo2ForCausalLM, LlamaForSequenceClassification):
    """OLMo 2 with HF's sequence-classification head (``score`` at the last token's final-normed hidden state)."""


__all__ = ["Olmo2Attention", "Olmo2DecoderLayer", "Olmo2ForCausalLM", "Olmo2ForSequenceClassification"]
