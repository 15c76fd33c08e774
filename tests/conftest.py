import torch

# GPU tests carry the `gpu` marker and are deselected by default (pyproject addopts);
# run them on a CUDA machine with `pytest -m gpu`.
torch.manual_seed(0)
