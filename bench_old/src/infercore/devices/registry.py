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

from .capability import DeviceCapability, _as_device, capability

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
    for arg, value in (("op", op), ("name", name)):
        # ":" and "," would make the name impossible to force through INFERCORE_BACKEND.
        if not isinstance(value, str) or not value or set(value) & set(":,"):
            raise ValueError(f"register: {arg} must be a non-empty str without ':' or ',', got {value!r}")
    if not callable(fn):
        raise TypeError(f"register({op!r}, {name!r}): fn must be callable, got {type(fn).__name__}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"register({op!r}, {name!r}): priority must be an int, got {priority!r}")
    if available is not None and not callable(available):
        raise TypeError(f"register({op!r}, {name!r}): available must be callable or None, got {available!r}")
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


@functools.cache
def _parse_backend(spec: str) -> tuple[str | None, dict[str, str]]:
    """``INFERCORE_BACKEND`` -> (implementation for every op or None, {op: implementation}).

    Syntax errors raise here, naming the variable: a typo must not silently leave the
    default dispatch in place while the user believes an implementation is forced.
    """
    spec = spec.strip()
    if not spec:
        return None, {}
    if ":" not in spec:
        if "," in spec:
            raise ValueError(
                f"INFERCORE_BACKEND={spec!r}: expected one implementation name (e.g. 'reference') "
                "or a comma-separated list of op:implementation"
            )
        return spec, {}
    per_op: dict[str, str] = {}
    for part in spec.split(","):
        if not part.strip():
            continue  # tolerate a trailing comma
        key, val = (p.strip() for p in part.partition(":")[::2])
        if part.count(":") != 1 or not key or not val:
            raise ValueError(f"INFERCORE_BACKEND entry {part.strip()!r} must be op:implementation, in {spec!r}")
        if per_op.get(key, val) != val:
            raise ValueError(f"INFERCORE_BACKEND names op {key!r} twice ({per_op[key]!r} and {val!r})")
        per_op[key] = val
    return None, per_op


def _forced(op: str) -> str | None:
    """The implementation ``INFERCORE_BACKEND`` forces for ``op`` (None: normal dispatch).

    An implementation ``op`` does not have raises ``ValueError`` naming the variable. The every-op form
    (``reference``, ``triton``) only has to exist for some op: ops without that implementation keep normal
    dispatch.
    """
    spec = os.environ.get("INFERCORE_BACKEND", "")
    every, per_op = _parse_backend(spec)
    if every is not None:
        if not any(every in e.impls for e in _OPS.values()):
            known = sorted({n for e in _OPS.values() for n in e.impls})
            raise ValueError(f"INFERCORE_BACKEND={spec.strip()!r} is not an implementation of any op; known: {known}")
        return every if every in _OPS[op].impls else None
    # Only this op's entry is checked: other packages register their ops when first imported
    # (infercore.quant, say), so a name unknown now may be a valid op a moment later.
    val = per_op.get(op)
    if val is not None and val not in _OPS[op].impls:
        raise ValueError(
            f"INFERCORE_BACKEND forces {op}:{val}, but op {op!r} has no implementation {val!r}; "
            f"known: {implementations(op)}"
        )
    return val


def resolve(op: str, device: torch.device | str) -> Impl:
    """The implementation that serves ``op`` on ``device``."""
    # Called once per op call: the cache key is built from cheap values only.
    key = (op, device, os.environ.get("INFERCORE_BACKEND", ""))
    try:
        impl = _CACHE.get(key)
    except TypeError:  # an unhashable device (a list, a tensor): say which argument is wrong
        raise TypeError(f"device must be a torch.device or str, got {type(device).__name__}") from None
    if impl is None:
        device = _as_device(device)
        entry = _OPS.get(op)
        if entry is None or REFERENCE not in entry.impls:
            raise ValueError(f"unknown op {op!r}; known ops: {ops()}")
        forced = _forced(op)
        if forced:
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
