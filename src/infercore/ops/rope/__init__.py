"""Rotary position embedding (neox / GPT-J styles, partial rotary, HF rope_scaling)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import _SUPPORTED, apply_rope_ref, rope_cos_sin_cache_ref
from .naive import rope_inv_freq as rope_inv_freq_ref

__all__ = ["apply_rope", "rope_cos_sin_cache", "rope_inv_freq"]

# The scaling keys each rope_type reads (optional ones have defaults). All are divisors or logarithm
# arguments, so a value <= 0 gives NaN / inf tables or a math domain error instead of a clear error.
_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    # and ``factor`` unless ``attention_factor`` is given (checked below with the factor lists)
    "longrope": ("original_max_position_embeddings",),
}
assert set(_REQUIRED_KEYS) == set(_SUPPORTED)


def _positive_int(op: str, name: str, x: object) -> None:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(x).__name__}")
    if x <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {x}")


def _check_rope_args(op: str, rotary_dim: object, base: object, scaling: object, seq_len: object = None) -> None:
    _positive_int(op, "rotary_dim", rotary_dim)
    if seq_len is not None:
        _positive_int(op, "seq_len", seq_len)
    if rotary_dim % 2:
        raise ValueError(f"{op}: rotary_dim must be a positive even int, got {rotary_dim}")
    V.number(op, "base", base, positive=True)
    if scaling is None:
        return
    if not isinstance(scaling, Mapping):
        raise TypeError(f"{op}: scaling must be a dict or None, got {type(scaling).__name__}")
    # Old HF configs spell the key "type"; "rope_type" wins when both are present (as in .naive).
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _REQUIRED_KEYS:
        raise ValueError(f"{op}: scaling rope_type {rope_type!r} is not supported; use one of {_SUPPORTED}")
    for key in _REQUIRED_KEYS[rope_type]:
        if key not in scaling:
            raise ValueError(f"{op}: scaling is missing key {key!r} needed by rope_type {rope_type!r}")
        V.number(op, f"scaling[{key!r}]", scaling[key], positive=True)
    if rope_type == "longrope":
        _check_longrope(op, rotary_dim, scaling)


def _check_longrope(op: str, rotary_dim: int, scaling: Mapping) -> None:
    """``short_factor`` / ``long_factor``: ``rotary_dim // 2`` positive numbers each; ``factor`` (which sets the
    attention factor) unless ``attention_factor`` is given; both positive numbers where present."""
    for key in ("short_factor", "long_factor"):
        f = scaling.get(key)
        if f is None:
            raise ValueError(f"{op}: scaling is missing key {key!r} needed by rope_type 'longrope'")
        if (not isinstance(f, list | tuple) or len(f) != rotary_dim // 2
                or not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in f)):
            raise ValueError(f"{op}: scaling[{key!r}] must be a list of {rotary_dim // 2} positive numbers "
                             f"(rotary_dim // 2), got {f!r}")
    if scaling.get("attention_factor") is None and "factor" not in scaling:
        raise ValueError(f"{op}: scaling is missing key 'factor' (or 'attention_factor') needed by rope_type "
                         "'longrope'")
    for key in ("factor", "attention_factor"):
        if scaling.get(key) is not None:
            V.number(op, f"scaling[{key!r}]", scaling[key], positive=True)


def rope_inv_freq(
    *, rotary_dim: int, base: float, scaling: Mapping[str, Any] | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` fp32 and the attention factor that scales cos/sin
    (arguments as in :func:`rope_cos_sin_cache`). Mirrors HF ``ROPE_INIT_FUNCTIONS`` bit for bit."""
    _check_rope_args("rope_inv_freq", rotary_dim, base, scaling, seq_len)
    return rope_inv_freq_ref(rotary_dim=rotary_dim, base=float(base), scaling=scaling, seq_len=seq_len)


def rope_cos_sin_cache(
    *,
    rotary_dim: int,
    max_positions: int,
    base: float,
    scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Precomputed rotation table for :func:`apply_rope`.

    Args:
        rotary_dim: number of rotated channels per head (even; ``< head_dim`` for partial rotary).
        max_positions: number of positions (rows) in the table.
        base: ``rope_theta``.
        scaling: the HF ``rope_scaling`` / ``rope_parameters`` dict or None. ``rope_type`` (or legacy
            ``type``) ``default``, ``linear`` (``factor``), ``llama3`` (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``) or ``yarn`` (``factor``,
            ``original_max_position_embeddings``, optional ``beta_fast``, ``beta_slow``, ``mscale``,
            ``mscale_all_dim``, ``attention_factor``, ``truncate``) or ``longrope`` (``short_factor`` and
            ``long_factor``: ``rotary_dim // 2`` divisors of the frequencies each,
            ``original_max_position_embeddings``, and ``factor`` -- HF's default is ``max_position_embeddings /
            original_max_position_embeddings``, which :meth:`~infercore.models.ModelConfig.from_hf` fills in -- or
            ``attention_factor``). Other keys are ignored.
        seq_len: longrope only, as HF's rope init takes it: the table holds ``long_factor`` 's frequencies when
            ``seq_len > original_max_position_embeddings``, else (and for None) ``short_factor`` 's. One table
            serves every position, so a caller picks the set once for the sequence lengths it runs.

    Returns:
        ``[max_positions, rotary_dim]`` in ``dtype``: columns ``[:rotary_dim//2]`` hold cos, the rest sin,
        both already multiplied by YaRN's / LongRoPE's attention factor.
    """
    op = "rope_cos_sin_cache"
    _check_rope_args(op, rotary_dim, base, scaling, seq_len)
    _positive_int(op, "max_positions", max_positions)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{op}: dtype must be a floating torch.dtype, got {dtype!r}")
    return rope_cos_sin_cache_ref(
        rotary_dim=rotary_dim, max_positions=max_positions, base=float(base), scaling=scaling,
        dtype=dtype, device=device, seq_len=seq_len,
    )


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim = cos_sin_cache.shape[-1]`` channels of every head of q and k.

    Args:
        q: ``[T, Hq, D]`` fp32/fp16/bf16, tokens first.
        k: ``[T, Hk, D]`` same dtype.
        positions: ``[T]`` int32/int64 absolute positions (rows of the cache).
        cos_sin_cache: ``[max_positions, rotary_dim]`` from :func:`rope_cos_sin_cache`.
        is_neox: True rotates the two halves of the rotary channels against each other (HF Llama
            ``rotate_half``); False rotates adjacent pairs ``(2i, 2i+1)`` (GPT-J / interleaved).

    Returns:
        New ``(q, k)`` in the input dtype; channels ``[rotary_dim:]`` pass through unchanged.
        The rotation is computed in fp32.
    """
    op = "apply_rope"
    V.floating(op, "q", q)
    V.ndim(op, "q", q, 3, "[tokens, q_heads, head_dim]")
    V.floating(op, "k", k)
    V.ndim(op, "k", k, 3, "[tokens, kv_heads, head_dim]")
    V.same_dtype(op, "k", k, "q", q)
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"{op}: k has shape {tuple(k.shape)}, incompatible with q {tuple(q.shape)}")
    V.integer(op, "positions", positions)
    V.ndim(op, "positions", positions, 1, "[tokens]")
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: positions has {positions.shape[0]} entries but q has {q.shape[0]} tokens")
    V.floating(op, "cos_sin_cache", cos_sin_cache)
    V.ndim(op, "cos_sin_cache", cos_sin_cache, 2, "[max_positions, rotary_dim]")
    rd = cos_sin_cache.shape[-1]
    if rd % 2 or rd > q.shape[-1] or rd == 0:
        raise ValueError(f"{op}: cos_sin_cache rotary_dim {rd} must be even and <= head_dim {q.shape[-1]}")
    V.same_device(op, "q", q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    return dispatch(op, q.device)(q, k, positions, cos_sin_cache, is_neox=V.flag(op, "is_neox", is_neox))


register("apply_rope", "reference", apply_rope_ref)
