"""Run Triton kernel modules under the interpreter on a CPU-only machine.

Kernels pick interpreter or compiled mode when their module is imported (``@triton.jit`` reads
``TRITON_INTERPRET`` at decoration). Test modules set the variable before importing triton, but an
earlier test module may already have imported ``infercore`` without it; then the kernel module is
re-imported here, which also re-registers its (now interpreted) implementations.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreted(module: ModuleType) -> ModuleType:
    if torch.cuda.is_available():
        return module
    kernels = [v for v in vars(module).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")]
    if any(type(k).__name__ == "JITFunction" for k in kernels):
        module = importlib.reload(module)
    return module
