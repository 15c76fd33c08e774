"""Parallel layouts over ``torch.distributed``: tensor parallelism for the dense Llama family
(:func:`tensor_parallel_`), and rank 0 driving the group's engines when serving (:class:`MirroredEngine`,
:func:`follow`)."""

from .spmd import MirroredEngine, follow
from .tensor import RowParallel, VocabParallel, group_min, shared_seed, tensor_parallel_

__all__ = ["MirroredEngine", "RowParallel", "VocabParallel", "follow", "group_min", "shared_seed", "tensor_parallel_"]
