"""Registers the fast (Triton) implementations of the ops with the device registry.

Importing this module is a side effect of ``import infercore.ops``; it must not fail where Triton
or a GPU is missing (the references then serve every op). Each kernel module registers itself with
``available=lambda cap: cap.is_cuda and cap.triton``, so on the CPU the references keep serving
unless ``INFERCORE_BACKEND`` forces ``triton`` (the interpreter tests do this per call instead).
"""

from __future__ import annotations

from ..devices import triton_available
from .activation import cpu as _activation_cpu  # noqa: F401  (CPU fast paths: plain ATen, always there)
from .attention import cpu as _attention_cpu  # noqa: F401
from .norm import cpu as _norm_cpu  # noqa: F401
from .rope import cpu as _rope_cpu  # noqa: F401
from .rope import fused as _rope_fused  # noqa: F401  (reference of "rope_and_write_kv"; needs no Triton)

if triton_available():
    from .activation import triton as _activation_triton  # noqa: F401
    from .attention import triton_decode as _attention_decode_triton  # noqa: F401
    from .attention import triton_mla as _attention_mla_triton  # noqa: F401
    from .attention import triton_prefill as _attention_prefill_triton  # noqa: F401
    from .attention import triton_scores as _attention_scores_triton  # noqa: F401
    from .conv1d import triton as _conv1d_triton  # noqa: F401
    from .gated_delta import triton as _gated_delta_triton  # noqa: F401
    from .gated_norm import triton as _gated_norm_triton  # noqa: F401
    from .kv_cache import triton as _kv_cache_triton  # noqa: F401
    from .linear import triton as _linear_triton  # noqa: F401
    from .lora import triton as _lora_triton  # noqa: F401
    from .mamba import triton as _mamba_triton  # noqa: F401
    from .moe import routing_triton as _moe_routing_triton  # noqa: F401
    from .moe import triton as _moe_triton  # noqa: F401
    from .norm import triton as _norm_triton  # noqa: F401
    from .rope import triton as _rope_triton  # noqa: F401
    from .sampling import triton as _sampling_triton  # noqa: F401
