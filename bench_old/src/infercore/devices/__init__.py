"""Devices: capability probing and the op registry (dispatch by capability, not by name)."""

from .capability import (
    DeviceCapability,
    capability,
    check_device,
    default_device,
    list_devices,
    register_probe,
    triton_available,
    triton_interpreter,
)
from .registry import accepts, dispatch, implementation, implementations, ops, register, report, resolve

__all__ = [
    "DeviceCapability",
    "accepts",
    "capability",
    "check_device",
    "default_device",
    "dispatch",
    "implementation",
    "implementations",
    "list_devices",
    "ops",
    "register",
    "register_probe",
    "report",
    "resolve",
    "triton_available",
    "triton_interpreter",
]
