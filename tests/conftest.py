import os

import torch

# Triton kernels are tested on the CPU through the interpreter; it must be chosen before triton is
# first imported (by any test module). On a CUDA machine the compiled kernels run instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# GPU tests carry the `gpu` marker and are deselected by default (pyproject addopts);
# run them on a CUDA machine with `pytest -m gpu`.
torch.manual_seed(0)
