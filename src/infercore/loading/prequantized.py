"""Pre-quantized Hugging Face checkpoints: GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ ``GEMM``) directories.

Such a directory's ``config.json`` carries a ``quantization_config`` (``quant_method`` ``"gptq"`` or ``"awq"``,
``bits``, ``group_size``, ...) and each quantized linear ``<name>`` is stored as ``<name>.qweight``,
``<name>.qzeros``, ``<name>.scales`` (and, for GPTQ, ``<name>.g_idx``) instead of ``<name>.weight``; the
packings are described in :mod:`infercore.quant.packing`. :func:`load_prequantized` builds the model with
those linears as :class:`~infercore.quant.QuantLinear` s over :class:`~infercore.quant.IntWeight` (q / k / v
and gate / up merged as the dense loader merges them), so no dense copy of a quantized weight is ever made,
and loads every other tensor through the model's own ``load_weights``.

Supported: GPTQ 4 / 8 bits, symmetric or not, ``checkpoint_format`` ``gptq`` (zeros stored minus one) or
``gptq_v2``, group sizes dividing K or -1 (one group per output channel), with or without act-order
(``desc_act``: the input channels are sorted by group once at load and the activations gathered in that order,
``QuantLinear.in_perm``);
AWQ 4 bits, ``GEMM`` packing, with zero points. Llama-family models (Llama, Mistral, Qwen2, Qwen3).

NVFP4 checkpoints (NVIDIA ModelOpt exports, compressed-tensors ``nvfp4-pack-quantized``) load through
:mod:`infercore.loading.prequantized_fp4`.
FP8 checkpoints (``quant_method`` ``"fp8"`` / ``"fbgemm_fp8"``, ModelOpt FP8, compressed-tensors ``float-quantized`` /
``naive-quantized`` FP8) load through :mod:`infercore.loading.prequantized_fp8`, compressed-tensors integer
checkpoints (``pack-quantized`` W4A16 / W8A16, ``int-quantized`` W8A8) through
:mod:`infercore.loading.prequantized_int`, bitsandbytes 4-bit ones (NF4 / FP4) through
:mod:`infercore.loading.prequantized_bnb`.
All five build the model through :func:`build_prequantized` here (model on meta, quantized linears collected,
checked, merged and swapped in, the rest loaded), each handing it its format's parts, weight and merge rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def prequantized_config(hf_config: dict[str, Any], hf_quant_config: dict[str, Any] | None = None
                        ) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` checked and normalised (``method``, ``bits``, ``group_size``
    (None = one group over K), ``zero_offset``), or None for a checkpoint without one. ``ValueError`` for a
    method or setting this loader does not run.

    ``quant_method`` ``"modelopt"`` and ``"compressed-tensors"`` (NVFP4) normalise through
    :func:`infercore.loading.prequantized_fp4.nvfp4_config` (``method`` ``"nvfp4"``), ``"fp8"`` and FP8 ModelOpt /
    compressed-tensors configs through :func:`infercore.loading.prequantized_fp8.fp8_config` (``method``
    ``"fp8"``), compressed-tensors integer weights (``pack-quantized``, ``int-quantized``) through
    :func:`infercore.loading.prequantized_int.int_config` (``method`` ``"ct-int"``), bitsandbytes 4-bit and 8-bit
    through :func:`infercore.loading.prequantized_bnb.bnb_config` (``method`` ``"bnb4"`` / ``"bnb8"``);
    ``hf_quant_config`` is a ModelOpt directory's ``hf_quant_config.json``
    (:func:`~infercore.loading.prequantized_fp4.read_hf_quant_config`), read when ``config.json`` has no
    ``quantization_config``."""
    from .prequantized_bnb import bnb_config, is_bnb_config
    from .prequantized_fp4 import HF_QUANT_CONFIG, nvfp4_config
    from .prequantized_fp8 import fp8_config, is_fp8_config
    from .prequantized_int import int_config, is_int_config

    q = hf_config.get("quantization_config")
    if q is None:
        if hf_quant_config is None:
            return None
        q = hf_quant_config
        return fp8_config(q, HF_QUANT_CONFIG) if is_fp8_config(q) else nvfp4_config(q, HF_QUANT_CONFIG)
    if not isinstance(q, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":
        # GPT-OSS's released checkpoints: only the routed experts are MXFP4 (``*_blocks`` / ``*_scales``), which the
        # model's own load_weights decodes; everything else is dense, so the dense path loads the directory.
        if hf_config.get("model_type") != "gpt_oss":
            raise ValueError(f"config.json: quantization_config.quant_method 'mxfp4' is supported for gpt_oss "
                             f"checkpoints (their MXFP4 experts), not model_type {hf_config.get('model_type')!r}")
        return None
    if is_int_config(q):
        return int_config(q)
    if is_bnb_config(q):
        return bnb_config(q)
    if method.startswith("modelopt") or method in ("compressed-tensors", "fp8", "fbgemm_fp8"):
        return fp8_config(q) if is_fp8_config(q) else nvfp4_config(q)
    if method not in ("gptq", "awq"):
        raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported; infercore "
                         "loads 'gptq', 'awq', 'fp8', 'fbgemm_fp8', 'bitsandbytes' (4-bit, 8-bit), FP8 / NVFP4 "
                         "'modelopt' and FP8 / NVFP4 / integer 'compressed-tensors' checkpoints (or quantizes dense "
                         "ones: from_pretrained(quantization=))")
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group > 0):
        raise ValueError(f"config.json: quantization_config.group_size must be a positive int or -1, got {group!r}")
    out = {"method": method, "bits": bits, "group_size": None if group == -1 else group, "zero_offset": 0}
    if method == "gptq":
        if bits not in (4, 8):
            raise ValueError(f"config.json: GPTQ bits must be 4 or 8, got {bits!r}")
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"config.json: GPTQ checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2')")
        out["zero_offset"] = 1 if fmt == "gptq" else 0
    else:
        if bits != 4:
            raise ValueError(f"config.json: AWQ bits must be 4, got {bits!r}")
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"config.json: AWQ version {version!r} is not supported (the GEMM packing only)")
        if not q.get("zero_point", True):
            raise ValueError("config.json: AWQ without zero points is not supported")
        if group == -1:
            raise ValueError("config.json: AWQ group_size must be positive")
    return out


def _int_weight(name: str, parts: dict[str, torch.Tensor], q: dict[str, Any]):
    """``(IntWeight, input permutation or None)`` of one quantized linear's tensors."""
    from ..quant.packing import from_awq, from_gptq, from_gptq_act_order

    need = ("qweight", "qzeros", "scales")
    missing = [p for p in need if p not in parts]
    if missing:
        raise ValueError(f"checkpoint: {name} has {sorted(parts)} but misses {missing}")
    qweight, qzeros, scales = (parts[p] for p in need)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"checkpoint: {name}.qweight / .qzeros must be int32, got {qweight.dtype} / {qzeros.dtype}")
    if not scales.is_floating_point():
        raise ValueError(f"checkpoint: {name}.scales must be floating-point, got {scales.dtype}")
    try:
        if q["method"] == "gptq":
            k = qweight.shape[0] * (32 // q["bits"])
            g = q["group_size"] or k
            g_idx = parts.get("g_idx")
            kw = dict(bits=q["bits"], group_size=g, zero_offset=q["zero_offset"])
            if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // g):
                return from_gptq_act_order(qweight, qzeros, scales, g_idx, **kw)
            return from_gptq(qweight, qzeros, scales, **kw), None
        if "g_idx" in parts:
            raise ValueError("AWQ tensors carry no g_idx")
        return from_awq(qweight, qzeros, scales, group_size=q["group_size"]), None
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"checkpoint: {name}: {e}") from None


def _concat(ws: list) -> Any:
    """One :class:`IntWeight` ``[sum N_i, K]`` from the shards ``ws`` (``[N_i, K]`` each, alike in bits, group size,
    K and zero points), stacked along N in order, as the dense loader stacks q / k / v and gate / up."""
    from ..quant.formats import IntWeight

    first = ws[0]
    for w in ws[1:]:
        if (w.bits, w.group_size, w.in_features, w.symmetric) != (first.bits, first.group_size, first.in_features,
                                                                  first.symmetric):
            raise ValueError("checkpoint: the merged projections (q/k/v or gate/up) differ in bits, group size, "
                             "input size or zero points")
    zeros = None if first.zeros is None else torch.cat([w.zeros for w in ws])
    return IntWeight(torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]), zeros, first.bits,
                     first.group_size, first.in_features)


def load_prequantized(ckpt, config, q: dict[str, Any], *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model of ``config`` on ``device`` with the quantized linears of ``ckpt`` (a
    :class:`~infercore.loading.Checkpoint` of an HF directory) as ``QuantLinear`` s, and load the rest.

    ``q`` is :func:`prequantized_config` of the checkpoint (``method`` ``"nvfp4"``: handed to
    :func:`~infercore.loading.prequantized_fp4.load_nvfp4`; ``"fp8"``: to
    :func:`~infercore.loading.prequantized_fp8.load_fp8`; ``"ct-int"``: to
    :func:`~infercore.loading.prequantized_int.load_ct_int`; ``"bnb4"`` / ``"bnb8"``: to
    :func:`~infercore.loading.prequantized_bnb.load_bnb4` / :func:`~infercore.loading.prequantized_bnb.load_bnb8`).
    Raises ``ValueError`` naming the tensor or module
    for a model family without merged-projection loading, a quantized linear the model lacks, a shape
    mismatch, a merged projection quantized only in part, or a tensor missing (by ``load_weights``)."""
    if q["method"] == "nvfp4":
        from .prequantized_fp4 import load_nvfp4

        return load_nvfp4(ckpt, config, q, dtype=dtype, device=device)
    if q["method"] == "fp8":
        from .prequantized_fp8 import load_fp8

        return load_fp8(ckpt, config, q, dtype=dtype, device=device)
    if q["method"] == "bnb4":
        from .prequantized_bnb import load_bnb4

        return load_bnb4(ckpt, config, q, dtype=dtype, device=device)
    if q["method"] == "bnb8":
        from .prequantized_bnb import load_bnb8

        return load_bnb8(ckpt, config, q, dtype=dtype, device=device)
    if q["method"] == "ct-int":
        from .prequantized_int import load_ct_int

        return load_ct_int(ckpt, config, q, dtype=dtype, device=device)
    return build_prequantized(ckpt, config, dtype=dtype, device=device, label="GPTQ / AWQ",
                              is_part=lambda leaf, t: leaf in _PARTS, select=list,
                              weight=lambda base, parts: _int_weight(base, parts, q),
                              concat=lambda target, ws, names: _concat(ws), codes="qweight",
                              none_converted="checkpoint: quantization_config is set but no tensor ends in .qweight")


def _linear_target(model: nn.Module, base: str) -> tuple[str, tuple[int, int] | None | tuple[()]]:
    """``(module name, rows or None)`` of the checkpoint linear ``base`` in ``model``: the model's own module (rows
    None) or the rows ``(start, end)`` of a merged projection it is a shard of (q / k / v in ``qkv_proj``, gate / up
    in ``gate_up_proj``), by the model's ``_resolve`` (checkpoint name -> parameter and index) or its ``_STACKED``
    table; rows ``()`` for a stacked expert's weight (an index into an ``[E, ...]`` parameter)."""
    resolve = getattr(model, "_resolve", None)
    if resolve is not None:
        r = resolve(f"{base}.weight")
        if r is None:
            return base, None
        name, index = r
        target = name[: -len(".weight")] if name.endswith(".weight") else name
        if index is None:
            return target, None
        if isinstance(index, slice) and index.step is None:
            return target, (index.start, index.stop)
        return target, ()
    prefix, _, proj = base.rpartition(".")
    if proj not in model._STACKED:
        return base, None
    merged, shard = model._STACKED[proj]
    return f"{prefix}.{merged}", model._shard_rows(merged, shard)


def build_prequantized(ckpt, config, *, dtype: torch.dtype, device: torch.device, label: str,
                       is_part: Callable[[str, torch.Tensor], bool],
                       select: Callable[[dict[str, dict[str, torch.Tensor]]], Iterable[str]],
                       weight: Callable[[str, dict[str, torch.Tensor]], tuple[Any, torch.Tensor | None]],
                       concat: Callable[[str, list, list[str]], Any], codes: str, none_converted: str,
                       excluded: Callable[[str], bool] | None = None, drop: tuple[str, ...] = ()) -> nn.Module:
    """The model of ``config`` built on ``device`` with the quantized linears of ``ckpt`` as ``QuantLinear`` s
    (q / k / v and gate / up merged as the dense loader merges them) and everything else loaded through the
    model's ``load_weights``: the skeleton of :func:`load_prequantized`,
    :func:`~infercore.loading.prequantized_fp4.load_nvfp4` and :func:`~infercore.loading.prequantized_fp8.load_fp8`.

    The format comes in as:

    * ``label``: its name in messages (``"GPTQ / AWQ"``, ``"NVFP4"``, ``"FP8"``);
    * ``is_part(leaf, tensor)``: whether a checkpoint tensor ``<base>.<leaf>`` is a part of a quantized linear
      ``<base>`` (collected per base, and never handed to ``load_weights``: every part is converted, dropped, or
      the load fails);
    * ``select(parts)``: the bases of ``parts`` (``{base: {leaf: tensor}}``) that are quantized linears, in the
      order they are converted (may raise for parts that make no linear);
    * ``weight(base, parts[base])``: ``(quantized weight [N, K], input permutation or None)``, checked;
    * ``concat(target, weights, bases)``: one weight of the shards of the merged projection ``target``, stacked
      along N in shard order (their input permutations, if any, must be equal);
    * ``codes``: the leaf named when a quantized tensor has no linear (``<base>.<codes>``);
    * ``none_converted``: the message when no linear is quantized;
    * ``excluded(base)``: whether the config excludes ``base`` from quantization (refused if stored quantized);
    * ``drop``: leaves dropped wherever they stand (KV-cache scales).

    A model without a bias in a quantized linear drops an all-zero ``<base>.bias`` (GPTQ exporters may store one for
    every quantized linear). A routed expert's linear stored quantized (the model stacks its experts into ``[E, ...]``
    tensors, which its kernels take dense) is dequantized to ``dtype`` and loaded as a dense weight, with a warning.
    ``ValueError`` names the tensor or module for a model family without merged-projection loading, an excluded or
    missing linear, a quantized lm_head with tied embeddings, a shape mismatch, a merged projection quantized only in
    part, no quantized linear, or a tensor missing (by ``load_weights``)."""
    from ..models import model_class
    from ..quant import QuantLinear
    from ..quant.api import _set_submodule

    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, dtype=dtype)
    if not hasattr(model, "_resolve") and not (hasattr(model, "_STACKED") and hasattr(model, "_shard_rows")):
        raise ValueError(f"checkpoint: pre-quantized ({label}) loading does not cover {config.architecture} (no "
                         "mapping of checkpoint names to its merged projections)")
    modules = dict(model.named_modules())
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in ckpt.weights(None):
        base, _, leaf = name.rpartition(".")
        if is_part(leaf, t):
            parts.setdefault(base, {})[leaf] = t
    merged: dict[str, dict[tuple[int, int], tuple[Any, str, torch.Tensor | None]]] = {}
    biasless: set[str] = set()  # quantized linears without a bias in the model
    expert_weights: dict[str, torch.Tensor] = {}  # routed experts' linears, dequantized
    converted = 0
    skips = getattr(model, "skips_checkpoint_tensor", None)  # layers a family does not run (DeepSeek's MTP layers)
    for base in select(parts):
        if skips is not None and skips(f"{base}.weight"):
            continue
        if excluded is not None and excluded(base):
            raise ValueError(f"checkpoint: {base} is excluded from quantization by the config but stored as {label}")
        w, perm = weight(base, parts[base])
        target, rows = _linear_target(model, base)
        if rows == ():  # a routed expert's linear: the stacked experts take dense weights (dequantized here)
            dense = w.dequantize(dtype)
            expert_weights[f"{base}.weight"] = dense if perm is None else dense[:, torch.argsort(perm.cpu())]
            continue
        lin = modules.get(target)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"checkpoint: quantized tensor {base}.{codes} has no linear layer in "
                             f"{config.architecture}")
        if target == "lm_head" and config.tie_word_embeddings:
            raise ValueError("checkpoint: a quantized lm_head with tied word embeddings is not supported")
        if lin.bias is None:
            biasless.add(base)
        n_rows = lin.out_features if rows is None else rows[1] - rows[0]
        if w.shape != (n_rows, lin.in_features):
            raise ValueError(f"checkpoint: {base} holds a [{w.shape[0]}, {w.shape[1]}] weight, expected "
                             f"[{n_rows}, {lin.in_features}]")
        if rows is not None:  # a shard of a merged projection: merged once every row of it has come
            shards = merged.setdefault(target, {})
            if rows in shards:
                raise ValueError(f"checkpoint: {base} and {shards[rows][1]} fill the same rows of {target}")
            shards[rows] = (w, base, perm)
            if sum(r1 - r0 for r0, r1 in shards) < lin.out_features:
                continue
            del merged[target]
            ws, bases, perms = zip(*(shards[r] for r in sorted(shards)))
            if any((a is None) != (perms[0] is None) or (a is not None and not torch.equal(a, perms[0]))
                   for a in perms):
                raise ValueError(f"checkpoint: the shards of {target} have different act-order channel orders "
                                 "(g_idx); a merged projection needs one")
            w, perm = concat(target, list(ws), list(bases)), perms[0]
        new = QuantLinear(w, in_perm=perm).to(device)
        if lin.bias is not None:  # filled by load_weights below, like a dense bias
            new.bias = nn.Parameter(torch.empty(lin.out_features, dtype=dtype, device=device), requires_grad=False)
        _set_submodule(model, target, new)
        converted += 1
    if merged:
        raise ValueError(f"checkpoint: {sorted(merged)} quantized only in part (every q/k/v and gate/up shard of a "
                         "merged projection must be quantized alike)")
    if not converted and not expert_weights:
        raise ValueError(none_converted)
    if expert_weights:
        import warnings

        warnings.warn(f"{len(expert_weights)} routed-expert linears stored {label}-quantized were dequantized to "
                      f"{dtype} at load (the stacked expert kernels take dense weights); the rest stay quantized",
                      stacklevel=3)
    for mod in model.modules():  # everything still on meta gets real (uninitialised) memory
        for key, t in list(mod._parameters.items()):
            if t is not None and t.is_meta:
                mod._parameters[key] = nn.Parameter(torch.empty_like(t, device=device), requires_grad=False)
        for key, t in list(mod._buffers.items()):
            if t is not None and t.is_meta:
                mod._buffers[key] = torch.empty_like(t, device=device)
    model.finish_init()

    def rest():
        for n, t in ckpt.weights(None):
            base, _, leaf = n.rpartition(".")
            if is_part(leaf, t) or leaf in drop:  # converted above, or read and dropped
                continue
            # GPTQ exporters may store an all-zero bias for every quantized linear; a model without one drops it
            if leaf == "bias" and base in biasless and not t.any():
                continue
            yield n, t.to(dtype) if t.is_floating_point() else t
        yield from expert_weights.items()

    model.load_weights(rest())
    return model.eval()
