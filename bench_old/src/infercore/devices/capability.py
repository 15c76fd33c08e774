"""What a device can do, probed once per device.

Backends ask for capabilities (device type, compute capability, dtype support) instead of matching
device names, so a new vendor only has to describe itself here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceCapability:
    """Static facts about one device.

    ``compute_capability`` is ``(major, minor)`` for CUDA devices and ``None`` elsewhere.
    ``native_fp8`` means the hardware has FP8 tensor-core instructions (sm89 and newer).
    """

    device_type: str
    index: int | None
    name: str
    compute_capability: tuple[int, int] | None
    total_memory: int
    multiprocessors: int
    bf16: bool
    native_fp8: bool
    triton: bool

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def at_least(self, major: int, minor: int = 0) -> bool:
        cc = self.compute_capability
        return cc is not None and cc >= (major, minor)


def triton_available() -> bool:
    """Triton is importable (on CPU only useful under ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _probe(device_type: str, index: int | None) -> DeviceCapability:
    if device_type == "cuda":
        idx = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(idx)
        cc = (props.major, props.minor)
        return DeviceCapability(
            device_type="cuda",
            index=idx,
            name=props.name,
            compute_capability=cc,
            total_memory=props.total_memory,
            multiprocessors=props.multi_processor_count,
            bf16=cc >= (8, 0),
            native_fp8=cc >= (8, 9),
            triton=triton_available(),
        )
    if device_type == "cpu":
        import platform

        return DeviceCapability(
            device_type="cpu",
            index=None,
            name=platform.processor() or platform.machine(),
            compute_capability=None,
            total_memory=_host_memory(),
            multiprocessors=os.cpu_count() or 1,
            bf16=True,
            native_fp8=False,
            triton=triton_available() and triton_interpreter(),
        )
    # Other vendors: described by plug-ins that register a probe (see ``register_probe``).
    probe = _EXTRA_PROBES.get(device_type)
    if probe is None:
        raise ValueError(f"device: no capability probe for device type {device_type!r}")
    return probe(index)


_EXTRA_PROBES: dict = {}


def register_probe(device_type: str, probe) -> None:
    """Let a plug-in backend describe a new device type: ``probe(index) -> DeviceCapability``."""
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"device_type must be a non-empty str, got {device_type!r}")
    if not callable(probe):
        raise TypeError(f"probe must be callable (index -> DeviceCapability), got {type(probe).__name__}")
    _EXTRA_PROBES[device_type] = probe
    _probe.cache_clear()


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _as_device(device: object) -> torch.device:
    """``device`` as a ``torch.device``; ``TypeError``/``ValueError`` naming the argument otherwise.

    ``torch.device`` itself takes an int as a CUDA index and raises RuntimeError for a bad name;
    neither says which argument was wrong.
    """
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a torch.device or str (e.g. 'cpu', 'cuda:0'), got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r} is not a device name (e.g. 'cpu', 'cuda:0'): {e}") from None


def check_device(device: object) -> torch.device:
    """``device`` (a ``torch.device`` or a name such as ``"cpu"``, ``"cuda:0"``) as a ``torch.device`` that
    can hold tensors on this machine. A bad one raises ``TypeError`` / ``ValueError`` naming it, not a torch
    RuntimeError / AssertionError from deep inside the first allocation or probe."""
    device = _as_device(device)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={str(device)!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device={str(device)!r}: index out of range, this machine has {count} CUDA device(s)")
    elif device.type not in ("cpu", "meta"):
        try:  # another backend (mps, xpu, a plug-in): ask torch once whether it can allocate there
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(f"device={str(device)!r} cannot be used here: {e}") from None
    return device


def capability(device: torch.device | str | None = None) -> DeviceCapability:
    """Capabilities of ``device`` (default: CUDA if available, else CPU)."""
    device = default_device() if device is None else check_device(device)
    return _probe(device.type, device.index)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def list_devices() -> list[DeviceCapability]:
    devs = [capability("cpu")]
    if torch.cuda.is_available():
        devs += [capability(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return devs
