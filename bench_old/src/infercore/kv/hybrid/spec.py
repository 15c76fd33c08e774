"""KV needs of the non-full-attention layer types, as plain data.

A hybrid model declares one spec per layer:

* :class:`infercore.kv.FullAttentionSpec` -- keys/values for every position (``sliding_window``
  None). A ``FullAttentionSpec`` *with* a ``sliding_window`` is read as a
  :class:`SlidingWindowSpec` by :func:`normalize_spec`, so models need not know about this module.
* :class:`SlidingWindowSpec` -- keys/values of the last ``window`` positions only.
* :class:`LinearStateSpec` -- one fixed-size state per request (Mamba2 / gated DeltaNet): a
  causal-conv state plus a recurrent state, whatever the sequence length.

Bytes are what the memory manager reasons about: ``bytes_per_token`` for the token kinds,
``bytes_per_state`` for linear state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..spec import FullAttentionSpec

__all__ = [
    "FullAttentionSpec",
    "LinearStateSpec",
    "SlidingWindowSpec",
    "LayerSpec",
    "bytes_per_state",
    "bytes_per_token",
    "normalize_spec",
    "spec_kind",
]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _dtype(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype{' or None' if optional else ''}, got {value!r}")


def _shape(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not value:
        raise TypeError(f"{name} must be a non-empty tuple of ints, got {value!r}")
    for i, d in enumerate(value):
        _positive_int(f"{name}[{i}]", d)
    return value


@dataclass(frozen=True)
class SlidingWindowSpec:
    """An attention layer that reads only the last ``window`` keys (HF ``sliding_window=w``:
    the query at position ``i`` sees keys ``j`` with ``i - w < j <= i``).

    Attributes:
        num_kv_heads, head_dim: ``Hk`` and ``D`` of the layer's keys and values.
        window: ``w`` in tokens.
        dtype: cache dtype; None means the allocator's default dtype.
    """

    num_kv_heads: int
    head_dim: int
    window: int
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        _positive_int("window", self.window)
        _dtype("dtype", self.dtype, optional=True)


@dataclass(frozen=True)
class LinearStateSpec:
    """A recurrent layer (Mamba2, gated DeltaNet): one state per request, whatever its length.

    Attributes:
        conv_state_shape: per-request causal-conv state, e.g. ``(conv_dim, kernel - 1)``, or
            None for a layer without a conv.
        recurrent_state_shape: per-request recurrent state, e.g. ``(Hv, Dk, Dv)`` for gated
            DeltaNet or ``(H, P, N)`` for Mamba2.
        conv_dtype, recurrent_dtype: element types (the recurrent state is usually fp32).
    """

    conv_state_shape: tuple[int, ...] | None
    recurrent_state_shape: tuple[int, ...]
    conv_dtype: torch.dtype = torch.bfloat16
    recurrent_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.conv_state_shape is not None:
            _shape("conv_state_shape", self.conv_state_shape)
        _shape("recurrent_state_shape", self.recurrent_state_shape)
        _dtype("conv_dtype", self.conv_dtype, optional=False)
        _dtype("recurrent_dtype", self.recurrent_dtype, optional=False)

    @property
    def conv_bytes(self) -> int:
        if self.conv_state_shape is None:
            return 0
        return math.prod(self.conv_state_shape) * self.conv_dtype.itemsize

    @property
    def recurrent_bytes(self) -> int:
        return math.prod(self.recurrent_state_shape) * self.recurrent_dtype.itemsize


LayerSpec = FullAttentionSpec | SlidingWindowSpec | LinearStateSpec

FULL, SLIDING, LINEAR = "full", "sliding", "linear"


def normalize_spec(spec: object, *, name: str = "spec") -> LayerSpec:
    """Return ``spec`` with a windowed ``FullAttentionSpec`` rewritten as a :class:`SlidingWindowSpec`."""
    if isinstance(spec, FullAttentionSpec):
        if spec.sliding_window is not None:
            return SlidingWindowSpec(spec.num_kv_heads, spec.head_dim, spec.sliding_window, spec.dtype)
        return spec
    if isinstance(spec, (SlidingWindowSpec, LinearStateSpec)):
        return spec
    raise TypeError(
        f"{name} must be a FullAttentionSpec, SlidingWindowSpec or LinearStateSpec, got {type(spec).__name__}"
    )


def spec_kind(spec: LayerSpec) -> str:
    """``"full"``, ``"sliding"`` or ``"linear"`` (after :func:`normalize_spec`)."""
    spec = normalize_spec(spec)
    if isinstance(spec, LinearStateSpec):
        return LINEAR
    return SLIDING if isinstance(spec, SlidingWindowSpec) else FULL


def bytes_per_token(spec: LayerSpec, *, default_dtype: torch.dtype) -> int:
    """Key + value bytes one token occupies in one attention layer."""
    spec = normalize_spec(spec)
    if isinstance(spec, LinearStateSpec):
        raise ValueError("spec: a LinearStateSpec has no per-token bytes (use bytes_per_state)")
    dtype = spec.dtype or default_dtype
    return 2 * spec.num_kv_heads * spec.head_dim * dtype.itemsize


def bytes_per_state(spec: LinearStateSpec) -> int:
    """Conv + recurrent state bytes of one request in one layer."""
    if not isinstance(spec, LinearStateSpec):
        raise TypeError(f"spec must be a LinearStateSpec, got {type(spec).__name__}")
    return spec.conv_bytes + spec.recurrent_bytes
