import os

import torch

# The quant kernel tests run Triton under the CPU interpreter where there is no GPU; the flag must
# be set before any kernel module is imported (``triton.jit`` reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
