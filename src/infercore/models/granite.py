"""IBM Granite (3.x dense): the Llama decoder with four scalars from the config.

``embedding_multiplier`` scales the embeddings, ``attention_multiplier`` is the softmax scale (both read by
:class:`~infercore.models.llama.LlamaForCausalLM` and its attention), ``logits_scaling`` divides the logits
(``compute_logits``), and ``residual_multiplier`` scales each sublayer's output before its residual add: the one
difference in the decoder layer, below.

The fused CPU decode layer (``cpu_native.llama_decode_layer``) has no residual multiplier, so these layers always
run op by op (``LlamaDecoderLayer._native_linears`` takes that class alone). On CUDA everything inside the
sublayers (the fused RoPE + KV write + decode attention, the gated-MLP GEMV) is the Llama one.
"""

from __future__ import annotations

import torch

from ..devices import dispatch
from ..ops import AttentionMetadata
from .llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose attention and MLP outputs are multiplied by ``residual_multiplier`` before
    they join the residual stream (HF: ``residual + out * residual_multiplier``)."""

    def __init__(self, config, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, layer, dtype=dtype)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward``: the residual stream is carried apart, so the MLP output returned here
        is already scaled and the next norm (or the final one) adds it."""
        m = self.residual_multiplier
        norm = self.input_layernorm
        if residual is None:
            residual, x = x, dispatch("rms_norm", x.device)(x, norm.weight, eps=norm.eps)
        else:
            x, residual = dispatch("fused_add_rms_norm", x.device)(x, residual, norm.weight, eps=norm.eps)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta) * m
        norm = self.post_attention_layernorm
        x, residual = dispatch("fused_add_rms_norm", x.device)(x, residual, norm.weight, eps=norm.eps)
        return self.mlp(x) * m, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite causal LM over paged KV (module and tensor names as :class:`LlamaForCausalLM`)."""

    decoder_layer = GraniteDecoderLayer


__all__ = ["GraniteDecoderLayer", "GraniteForCausalLM"]
