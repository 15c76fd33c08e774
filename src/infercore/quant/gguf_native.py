"""Run a GGUF checkpoint's block-quantized linears as stored (no dequantized copy).

``use_gguf_blocks(model, path)`` takes a model loaded from the same GGUF file (dense weights,
HF layout with merged ``qkv_proj`` / ``gate_up_proj``) and swaps each linear whose GGUF tensors
are block-quantized for a :class:`QuantLinear` over the raw blocks. Rows are independent in
these formats (blocks run along K), so llama.cpp's q/k row permutation is undone on the block
rows and merged projections are plain row concatenations of the blocks.

Q4_0, Q4_1 and Q8_0 are swapped on any device (the GPU has kernels for them). Q5_0, Q5_1 and the K-quants Q4_K,
Q5_K and Q6_K (the bulk of the common ``Q4_K_M`` / ``Q5_K_M`` / ``Q6_K`` files) are swapped where the model is on the
CPU, whose native kernels run them (``quant.cpu``); on other devices those linears stay dense (the GPU would
dequantize them at every call). A merged projection whose parts are stored in different formats (a ``Q4_K_M`` file's
``attn_v`` in Q6_K beside Q4_K ``attn_q`` / ``attn_k`` in some layers) becomes one "mixed" ``GGUFWeight`` on the CPU
(its rows in the native INT8 GEMV's layout, each part's values exact; ``GGUFWeight.concat``) and stays dense
elsewhere.

With tied embeddings (no ``output.weight`` in the file) and ``tied_lm_head=True``, the logits are
computed from the embedding's own blocks, as llama.cpp does: ``lm_head`` becomes a
:class:`QuantLinear` over ``token_embd.weight`` and the embedding lookup keeps the dense table.
Off by default: SmolLM2's Q8_0 head reads 30 MB a token instead of 57 MB of dense bf16, but on the
2-core CPU the native INT8 GEMV is bound by its instructions there, not the bytes: the head alone
took 1224 vs 729 us and decode ran at 158.2 vs 163.2 tok/s with it
(``benchmarks/results/cpu/sweeps/cpu_gguf_tied_head.json``, ``benchmarks/probe_gguf_tied_head.py``; it moves with
this VM's memory bandwidth: 189.8 vs 181.0 in one later run, 163.4 vs 167.8 and 159.9 vs 167.4 in the next two).
Evicted from the cache before each call, as in a decode step, the Q8_0 head was no faster than dense bf16 on the
H200 machine's 16-core host either, at 1-16 threads (0.67-1.08x,
``benchmarks/results/h200/sweeps/head_threads_h200_host.json``, ``benchmarks/probe_head_threads.py``).
With 8-bit activations (``cpu_native.set_int8_activations``) the INT8 GEMV takes 64 products an instruction and the
Q8_0 head wins: on the 2-vCPU Xeon decode ran at 93.8 vs 82.0 tok/s with it (head alone 1209 vs 1405 us;
``cpu/sweeps/cpu_gguf_tied_head_a8_xeon.json``; without them 81.1 vs 78.4, ``cpu_gguf_tied_head_xeon.json``), so
the default (``tied_lm_head=None``) turns it on where those are on when the blocks are swapped in.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .formats import GGUFWeight
from .gguf import QUANTIZABLE
from .linear import QuantLinear

_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q4_K": "q4_k",
          "Q5_K": "q5_k", "Q6_K": "q6_k"}


def _runs_here(qtype: str, device: torch.device) -> bool:
    """Whether a ``qtype`` weight on ``device`` has kernels there (the formats only loaded from files: the CPU's)."""
    return qtype in QUANTIZABLE or device.type == "cpu"


def use_gguf_blocks(model: nn.Module, path: str | os.PathLike, *, tied_lm_head: bool | None = None) -> list[str]:
    """Swap block-quantized linears of ``model`` for native GGUF :class:`QuantLinear` s, in place.

    Returns the names of the swapped modules. ``tied_lm_head=True``: a tied ``lm_head`` runs the embedding's blocks
    when they are in one of the formats above that runs on the model's device (``"lm_head"`` in the list; on the CPU
    the native kernels take them for bf16 activations, other dtypes dequantize them at every call); ``False`` keeps it
    dense; None (default): True on the CPU where the native GEMVs take 8-bit activations at the swap
    (``cpu_native.int8_activations_on``, the CLI's ``--int8-activations``), False otherwise (module docstring).
    """
    if tied_lm_head is None:
        from ..ops.moe import cpu_native

        head = getattr(model, "lm_head", None)
        on_cpu = head is not None and getattr(head, "weight", None) is not None and head.weight.device.type == "cpu"
        tied_lm_head = on_cpu and cpu_native.int8_activations_on()
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
        target = hf_name(name, arch)
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
        parts.setdefault(f"{parent}.{merged}" if parent else merged, {})[shard] = (t, qtype)  # lm_head: top level
    swapped = []
    for mod_name, shards in parts.items():
        try:
            old = model.get_submodule(mod_name)
        except AttributeError:
            continue
        qtypes = {q for _, q in shards.values()}
        dev = old.weight.device if isinstance(old, nn.Linear) else None
        if dev is None or not all(_runs_here(q, dev) for q in qtypes) or (len(qtypes) > 1 and dev.type != "cpu"):
            continue  # the parts of a merged projection in several formats: one "mixed" weight, on the CPU
        w = GGUFWeight.concat([GGUFWeight.from_blocks(*shards[i]) for i in sorted(shards)]).to(dev)
        if w.shape != tuple(old.weight.shape):
            raise ValueError(f"path: {mod_name} has shape {w.shape} in the GGUF file, model has "
                             f"{tuple(old.weight.shape)}")
        parent, _, child = mod_name.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantLinear(w, old.bias))
        swapped.append(mod_name)
    if tied_lm_head and _tied_head(model, gf):
        blocks, ggml_type, _ = gf.raw("token_embd.weight")
        qtype = _TYPES.get(ggml_type.name)
        head = model.lm_head
        if qtype is not None and _runs_here(qtype, head.weight.device):
            w = GGUFWeight.from_blocks(torch.from_numpy(np.array(blocks)), qtype).to(head.weight.device)
            if w.shape != tuple(head.weight.shape):
                raise ValueError(f"path: token_embd.weight has shape {w.shape} in the GGUF file, lm_head has "
                                 f"{tuple(head.weight.shape)}")
            model.lm_head = QuantLinear(w, None)
            swapped.append("lm_head")
    return swapped


def _tied_head(model: nn.Module, gf) -> bool:
    """``model.lm_head`` is a dense bias-free linear tied to the embedding, and the file has no ``output.weight``."""
    head = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    return ("output.weight" not in gf.tensors and "token_embd.weight" in gf.tensors
            and isinstance(head, nn.Linear) and head.bias is None and emb is not None
            and head.weight is getattr(emb, "weight", None))
