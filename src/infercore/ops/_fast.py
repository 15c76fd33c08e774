"""Registers the fast (Triton) implementations of the ops with the device registry.

Importing this module is a side effect of ``import infercore.ops``; it must not fail where Triton
or a GPU is missing (the references then serve every op).
"""
