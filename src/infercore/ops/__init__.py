"""Tensor-level operators: a pure-PyTorch reference beside every fast kernel.

Each public function validates its arguments (dtype, shape, device; errors name the argument),
then calls ``infercore.devices.dispatch("<function name>", device)``. Implementations are
registered under the public function's name (``"rms_norm"``, ``"write_kv_cache_"``, ...) and receive
the validated arguments with the public signature; the reference is named ``"reference"``.
"""

from .activation import gelu_and_mul, silu_and_mul
from .attention import (
    AttentionMetadata,
    paged_attention,
    paged_attention_decode,
    paged_attention_prefill,
    rope_write_decode_attention,
)
from .attention.mla import paged_mla_decode
from .attention.scores import attention_with_key_scores, select_kv_tokens
from .conv1d import causal_conv1d_prefill_, causal_conv1d_update_
from .gated_delta import chunk_gated_delta_rule_, fused_recurrent_gated_delta_rule_
from .gated_norm import gated_rms_norm
from .kv_cache import write_kv_cache_
from .linear import skinny_linear
from .lora import lora_expand_, lora_shrink
from .mamba import mamba_chunk_scan_, selective_state_update_
from .moe import moe_experts_routed
from .moe.routing import moe_route_topk
from .norm import fused_add_rms_norm, rms_norm
from .rope import apply_rope, rope_cos_sin_cache, rope_inv_freq
from .rope.fused import rope_and_write_kv_cache_
from .sampling import (
    SamplingTensors,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_top_k_top_p_min_p,
    sample,
    token_logprobs,
)

__all__ = [
    "causal_conv1d_prefill_",
    "causal_conv1d_update_",
    "chunk_gated_delta_rule_",
    "fused_recurrent_gated_delta_rule_",
    "gated_rms_norm",
    "mamba_chunk_scan_",
    "moe_experts_routed",
    "moe_route_topk",
    "selective_state_update_",
    "AttentionMetadata",
    "SamplingTensors",
    "apply_presence_frequency_penalty",
    "apply_repetition_penalty",
    "apply_rope",
    "apply_top_k_top_p_min_p",
    "attention_with_key_scores",
    "fused_add_rms_norm",
    "gelu_and_mul",
    "lora_expand_",
    "lora_shrink",
    "paged_attention",
    "paged_attention_decode",
    "rope_write_decode_attention",
    "paged_attention_prefill",
    "paged_mla_decode",
    "rms_norm",
    "rope_and_write_kv_cache_",
    "rope_cos_sin_cache",
    "rope_inv_freq",
    "sample",
    "select_kv_tokens",
    "token_logprobs",
    "silu_and_mul",
    "skinny_linear",
    "write_kv_cache_",
]

from . import _fast  # noqa: F401,E402  (registers fast implementations)
