"""Run Triton kernel modules under the interpreter on a CPU-only machine.

``@triton.jit`` picks interpreter or compiled mode when a function is decorated, and that includes
triton's own standard library (``tl.sum``, ``tl.sigmoid``, ``tl.philox`` ...), decorated when triton is
first imported. Test modules set ``TRITON_INTERPRET=1`` before importing anything, but in a full
pytest run an earlier test module may already have imported ``infercore`` (and triton) without it.
Then :func:`interpreted` re-decorates triton's standard library and the given kernel modules under
the interpreter (re-importing a kernel module also re-registers its implementations). On a CUDA
machine it does nothing.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")


def _compiled(obj: object) -> bool:
    return type(obj).__name__ == "JITFunction"


def interpreted(module: ModuleType) -> ModuleType:
    if torch.cuda.is_available():
        return module
    import triton.language as tl

    if _compiled(tl.sum):  # triton itself was imported before TRITON_INTERPRET was set
        os.environ["TRITON_INTERPRET"] = "1"
        for name in ("triton.language.standard", "triton.language.random", "triton.language"):
            importlib.reload(sys.modules[name])
    if any(_compiled(v) for v in vars(module).values()):
        module = importlib.reload(module)
    return module
