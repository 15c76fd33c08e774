"""Argument checks shared by the public op wrappers.

Every check raises ``TypeError`` (wrong kind / dtype) or ``ValueError`` (wrong shape / value) whose
message starts with ``"<op>: <argument> ..."`` so the caller sees which argument was wrong. The checks
only look at metadata (shape, dtype, device), never at values, so they never synchronize a GPU and
stay legal inside CUDA-graph capture.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def floating(op: str, name: str, t: object, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> torch.Tensor:
    t = tensor(op, name, t)
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating tensor, got {t.dtype}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in {_names(dtypes)}, got {t.dtype}")
    return t


def integer(op: str, name: str, t: object, dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES) -> torch.Tensor:
    t = tensor(op, name, t)
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in {_names(dtypes)}, got {t.dtype}")
    return t


def ndim(op: str, name: str, t: torch.Tensor, n: int, layout: str) -> None:
    if t.dim() != n:
        raise ValueError(f"{op}: {name} must be {n}-D {layout}, got shape {tuple(t.shape)}")


def min_ndim(op: str, name: str, t: torch.Tensor, n: int, layout: str) -> None:
    if t.dim() < n:
        raise ValueError(f"{op}: {name} must be at least {n}-D {layout}, got shape {tuple(t.shape)}")


def same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")


def same_device(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def dim_at_least_one(op: str, name: str, t: torch.Tensor, dim: int, what: str) -> None:
    """``t.shape[dim] >= 1``: a zero-sized pool, page, head or vocab axis would divide by zero or index nothing."""
    if t.shape[dim] < 1:
        raise ValueError(f"{op}: {name} must have {what} >= 1, got shape {tuple(t.shape)}")


def number(op: str, name: str, x: object, *, positive: bool = False, nonneg: bool = False) -> float:
    """A finite Python int / float (NaN and +-inf rejected), optionally ``> 0`` or ``>= 0``; returns it as float."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{op}: {name} must be a number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or (positive and not x > 0) or (nonneg and not x >= 0):
        need = "a finite number" + (" > 0" if positive else " >= 0" if nonneg else "")
        raise ValueError(f"{op}: {name} must be {need}, got {x}")
    return x


def flag(op: str, name: str, x: object) -> bool:
    # A string such as "no" would be truthy, so only a real bool is taken.
    if not isinstance(x, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(x).__name__}")
    return x


def ragged_batch(op: str, cu_seqlens: object, has_initial_state: object) -> int:
    """``cu_seqlens`` int32 ``[B + 1]`` and ``has_initial_state`` bool ``[B]`` of a ragged prefill; returns B."""
    integer(op, "cu_seqlens", cu_seqlens, (torch.int32,))
    ndim(op, "cu_seqlens", cu_seqlens, 1, "[batch + 1]")
    B = cu_seqlens.shape[0] - 1
    if B < 0:
        raise ValueError(f"{op}: cu_seqlens must have at least one element")
    tensor(op, "has_initial_state", has_initial_state)
    if has_initial_state.dtype != torch.bool or has_initial_state.shape != (B,):
        raise ValueError(f"{op}: has_initial_state must be bool [{B}], got {has_initial_state.dtype} "
                         f"{tuple(has_initial_state.shape)}")  # fmt: skip
    same_device(op, "cu_seqlens", cu_seqlens, has_initial_state=has_initial_state)
    return B


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "(" + ", ".join(str(d).removeprefix("torch.") for d in dtypes) + ")"
