"""Op registry: one reference implementation per op plus any number of fast ones.

Each fast implementation registers with a priority and an availability predicate over the
device's :class:`DeviceCapability`; dispatch picks the highest-priority available one for the
device of the op's tensors. A missing fast path falls back to the reference, never to an error.

``INFERCORE_BACKEND`` forces an implementation for debugging and tests:
``INFERCORE_BACKEND=reference`` (every op), or ``INFERCORE_BACKEND=rms_norm:triton,sample:reference``.
A forced implementation is used even where its predicate says no (e.g. Triton kernels on the CPU
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .capability import DeviceCapability, capability

REFERENCE = "reference"


@dataclass
class Impl:
    name: str
    fn: Callable
    priority: int
    available: Callable[[DeviceCapability], bool]


@dataclass
class OpEntry:
    name: str
    impls: dict[str, Impl] = field(default_factory=dict)
    # device string -> name of the implementation that last served it
    served: dict[str, str] = field(default_factory=dict)


_OPS: dict[str, OpEntry] = {}
_CACHE: dict[tuple[str, str, str], Impl] = {}


def register(
    op: str,
    name: str,
    fn: Callable,
    *,
    priority: int = 0,
    available: Callable[[DeviceCapability], bool] | None = None,
) -> None:
    """Register implementation ``name`` of ``op``. The reference must be named ``"reference"``."""
    entry = _OPS.setdefault(op, OpEntry(op))
    if name == REFERENCE:
        priority, available = -(10**9), (lambda cap: True)
    entry.impls[name] = Impl(name, fn, priority, available or (lambda cap: True))
    _CACHE.clear()


def implementation(op: str, name: str) -> Callable:
    """The function of one named implementation (tests call kernels directly through this)."""
    try:
        return _OPS[op].impls[name].fn
    except KeyError:
        raise ValueError(f"op {op!r} has no implementation {name!r}; known: {implementations(op)}") from None


def implementations(op: str) -> list[str]:
    entry = _OPS.get(op)
    return sorted(entry.impls) if entry else []


def _forced(op: str) -> str | None:
    spec = os.environ.get("INFERCORE_BACKEND", "").strip()
    if not spec:
        return None
    if ":" not in spec:
        return spec
    for part in spec.split(","):
        key, _, val = part.partition(":")
        if key.strip() == op:
            return val.strip()
    return None


def resolve(op: str, device: torch.device | str) -> Impl:
    """The implementation that serves ``op`` on ``device``."""
    # Called once per op call: the cache key is built from cheap values only.
    key = (op, device, os.environ.get("INFERCORE_BACKEND", ""))
    impl = _CACHE.get(key)
    if impl is None:
        device = torch.device(device)
        forced = _forced(op)
        entry = _OPS.get(op)
        if entry is None or REFERENCE not in entry.impls:
            raise ValueError(f"unknown op {op!r}")
        if forced and forced in entry.impls:
            impl = entry.impls[forced]
        else:
            cap = capability(device)
            ok = [i for i in entry.impls.values() if i.available(cap)]
            impl = max(ok, key=lambda i: i.priority)
        _CACHE[key] = impl
    return impl


def dispatch(op: str, device: torch.device | str) -> Callable:
    impl = resolve(op, device)
    _OPS[op].served[device] = impl.name
    return impl.fn


@functools.cache
def accepts(fn: Callable, keyword: str) -> bool:
    """Whether ``fn`` (an implementation, a model method) takes the parameter ``keyword``: how callers
    pass optional inputs (``k_scale``, ``k``/``v``, ``only_seqs``, ``fp32``) only to implementations
    written to take them. False when the signature cannot be read."""
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def report(device: torch.device | str | None = None) -> dict[str, dict]:
    """Per op: the registered implementations, which one would serve ``device``, and which served last."""
    out = {}
    for op, entry in sorted(_OPS.items()):
        row = {"implementations": sorted(entry.impls), "served": {str(d): n for d, n in entry.served.items()}}
        if device is not None:
            row["selected"] = resolve(op, device).name
        out[op] = row
    return out


def ops() -> list[str]:
    return sorted(_OPS)
