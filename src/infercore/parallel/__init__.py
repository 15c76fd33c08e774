"""Parallel layouts over ``torch.distributed``: tensor parallelism for the dense Llama family
(:func:`tensor_parallel_`), rank 0 driving the group's engines when serving (:class:`MirroredEngine`,
:func:`follow`), and a group that switches between tensor- and data-parallel layouts with the load
(:class:`AdaptiveEngine`, :func:`build_adaptive`, :class:`LoadPolicy`)."""

from .adaptive import AdaptiveEngine, LoadPolicy, build_adaptive
from .spmd import MirroredEngine, follow
from .tensor import RowParallel, VocabParallel, group_min, shared_seed, tensor_parallel_

__all__ = ["AdaptiveEngine", "LoadPolicy", "MirroredEngine", "RowParallel", "VocabParallel", "build_adaptive",
           "follow", "group_min", "shared_seed", "tensor_parallel_"]
