"""Run a GGUF checkpoint's Q4_0/Q4_1/Q8_0 linears as stored (no dequantized copy).

``use_gguf_blocks(model, path)`` takes a model loaded from the same GGUF file (dense weights,
HF layout with merged ``qkv_proj`` / ``gate_up_proj``) and swaps each linear whose GGUF tensors
are block-quantized for a :class:`QuantLinear` over the raw blocks. Rows are independent in
these formats (blocks run along K), so llama.cpp's q/k row permutation is undone on the block
rows and merged projections are plain row concatenations of the blocks.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .formats import GGUFWeight
from .linear import QuantLinear

_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}


def use_gguf_blocks(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Swap block-quantized linears of ``model`` for native GGUF :class:`QuantLinear` s, in place.

    Returns the names of the swapped modules. Tied embeddings / ``lm_head`` stay dense.
    """
    from ..loading.gguf import GGUFFile
    from ..loading.gguf_hf import _ARCHS, hf_name, unpermute_qk

    gf = GGUFFile(path)
    arch = gf.architecture
    permute = _ARCHS.get(arch, {}).get("permute_qk", False)
    heads = {"q_proj": int(gf.get(f"{arch}.attention.head_count"))}
    heads["k_proj"] = int(gf.get(f"{arch}.attention.head_count_kv", heads["q_proj"]))
    stacked = getattr(model, "_STACKED", {})
    parts: dict[str, dict[int, tuple[torch.Tensor, str]]] = {}
    for name in gf.tensors:
        target = hf_name(name)
        if target is None or not target.endswith(".weight"):
            continue
        blocks, ggml_type, _ = gf.raw(name)
        qtype = _TYPES.get(ggml_type.name)
        if qtype is None:
            continue
        module = target[: -len(".weight")]
        parent, _, leaf = module.rpartition(".")
        t = torch.from_numpy(np.array(blocks))  # [rows, nb, block_bytes]
        if permute and leaf in heads:
            t = unpermute_qk(t, heads[leaf])
        merged, shard = stacked.get(leaf, (leaf, 0))
        parts.setdefault(f"{parent}.{merged}", {})[shard] = (t, qtype)
    swapped = []
    for mod_name, shards in parts.items():
        try:
            old = model.get_submodule(mod_name)
        except AttributeError:
            continue
        qtypes = {q for _, q in shards.values()}
        if not isinstance(old, nn.Linear) or len(qtypes) != 1:
            continue
        raw = torch.cat([shards[i][0] for i in sorted(shards)], 0)
        w = GGUFWeight.from_blocks(raw, qtypes.pop()).to(old.weight.device)
        if w.shape != tuple(old.weight.shape):
            raise ValueError(f"path: {mod_name} has shape {w.shape} in the GGUF file, model has "
                             f"{tuple(old.weight.shape)}")
        parent, _, child = mod_name.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantLinear(w, old.bias))
        swapped.append(mod_name)
    return swapped
