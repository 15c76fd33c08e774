"""Parallel layouts over ``torch.distributed``: tensor parallelism for the dense Llama family
(:func:`tensor_parallel_`)."""

from .tensor import group_min, shared_seed, tensor_parallel_

__all__ = ["group_min", "shared_seed", "tensor_parallel_"]
