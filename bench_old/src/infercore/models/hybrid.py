"""Per-layer batch metadata and cache helpers shared by the hybrid models (Gemma 3, Qwen3-Next, Mamba2).

A dense model gets one :class:`~infercore.ops.AttentionMetadata` for every layer: all layers share
page ids. A hybrid model's layers do not share them -- each layer *group* of the
:class:`infercore.kv.hybrid.HybridKVLayout` has its own block table and slot mapping, and recurrent
layers address a state slot instead of pages -- so the engine hands it a :class:`HybridMetadata`
holding one entry per layer, and each layer asks :func:`layer_metadata` for its own.

Cache entries (``kv_caches[i]``) follow the same split: ``(k_cache, v_cache)`` pairs
``[num_pages, page_size, Hk, D]`` for attention layers (possibly page-strided views of the shared
pool), ``(conv_state, recurrent_state)`` pools ``[num_slots, ...]`` for recurrent layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ops import AttentionMetadata

__all__ = [
    "HFConfigReader",
    "HybridMetadata",
    "LinearStateMetadata",
    "layer_metadata",
    "linear_metadata",
    "load_hf_weights",
]


@dataclass
class LinearStateMetadata:
    """Where each sequence's recurrent state lives for one step (Mamba2 / gated DeltaNet layers).

    Attributes:
        cu_seqlens: int32 ``[B + 1]``, the step's tokens per sequence (same as attention's
            ``cu_seqlens_q``).
        state_slots: int32 ``[B]``, each sequence's live state slot in this layer group's pools.
        has_initial_state: bool ``[B]``, False for a sequence's first chunk (start from zeros).
        decode_only: every sequence has exactly one token (the recurrent-update kernels apply).
    """

    cu_seqlens: torch.Tensor
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    decode_only: bool


@dataclass
class HybridMetadata:
    """One entry per model layer: an :class:`AttentionMetadata` (its group's block table and slot
    mapping) or a :class:`LinearStateMetadata`. Layers of one group share the same object.
    ``cu_seqlens_q`` (int32 ``[B + 1]``) is the step's ragged token layout, shared by all layers."""

    layers: Sequence[AttentionMetadata | LinearStateMetadata]
    cu_seqlens_q: torch.Tensor

    @property
    def decode_only(self) -> bool:
        return all(m.decode_only for m in self.layers)


def layer_metadata(meta: AttentionMetadata | HybridMetadata, layer: int) -> AttentionMetadata:
    """The attention metadata of ``layer``: ``meta`` itself for a dense step (all layers share page ids)."""
    if isinstance(meta, AttentionMetadata):
        return meta
    if not isinstance(meta, HybridMetadata):
        raise TypeError(f"meta must be an AttentionMetadata or HybridMetadata, got {type(meta).__name__}")
    m = meta.layers[layer]
    if not isinstance(m, AttentionMetadata):
        raise TypeError(f"meta.layers[{layer}] must be an AttentionMetadata, got {type(m).__name__}")
    return m


def linear_metadata(meta: AttentionMetadata | HybridMetadata, layer: int) -> LinearStateMetadata:
    """The recurrent-state metadata of ``layer`` (only a :class:`HybridMetadata` carries state slots)."""
    if not isinstance(meta, HybridMetadata):
        raise TypeError(
            f"layer {layer} is recurrent: meta must be a HybridMetadata with state slots, got "
            f"{type(meta).__name__} (run the model through the hybrid KV manager)"
        )
    m = meta.layers[layer]
    if not isinstance(m, LinearStateMetadata):
        raise TypeError(f"meta.layers[{layer}] must be a LinearStateMetadata, got {type(m).__name__}")
    return m


def check_step(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, num_layers: int) -> None:
    """The arguments of a model's ragged ``forward``: ``input_ids``/``positions`` 1-D ``[T]`` of equal
    length and one cache entry per layer; ``ValueError`` naming the argument otherwise."""
    if input_ids.ndim != 1 or positions.shape != input_ids.shape:
        raise ValueError(f"input_ids and positions must be 1-D of equal length, got {tuple(input_ids.shape)} "
                         f"and {tuple(positions.shape)}")  # fmt: skip
    if len(kv_caches) != num_layers:
        raise ValueError(f"kv_caches has {len(kv_caches)} entries, expected one per layer ({num_layers})")


def load_hf_weights(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    resolve: Callable[[str], tuple[str, Any] | None],
    *,
    arch: str,
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy HF-named tensors into ``model`` (cast to each parameter's dtype/device).

    ``resolve(hf_name)`` returns ``(parameter_name, index)`` -- the tensor lands in
    ``param.data[index]`` (``index`` None = the whole parameter; a slice or tuple for a shard of a
    merged projection or one expert of a stacked expert tensor) -- or None for a name the model
    does not know. Names for which ``ignore`` is true are skipped. Raises ``ValueError`` naming the
    tensor for an unknown name, a duplicate or a shape mismatch, and (after the iterable ends)
    naming every parameter that was not completely written.
    """
    params = dict(model.named_parameters())
    written = dict.fromkeys(params, 0)
    seen: set[str] = set()
    for hf_name, tensor in weights:
        if ignore(hf_name):
            continue
        r = resolve(hf_name)
        if r is None or r[0] not in params:
            raise ValueError(f"load_weights: unexpected tensor {hf_name!r} for {arch}")
        if hf_name in seen:
            raise ValueError(f"load_weights: tensor {hf_name!r} given twice")
        seen.add(hf_name)
        name, index = r
        try:
            target = params[name].data if index is None else params[name].data[index]
        except IndexError:  # e.g. an expert id past the model's expert count
            raise ValueError(f"load_weights: unexpected tensor {hf_name!r} for {arch} (index {index} out of range "
                             f"for {name} {tuple(params[name].shape)})") from None
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"load_weights: tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        written[name] += target.numel()
    missing = sorted(n for n, w in written.items() if w < params[n].numel())
    if missing:
        listed = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"load_weights: {len(missing)} parameters not (fully) in the checkpoint: {listed}")


_REQUIRED = object()


class HFConfigReader:
    """Typed reads of one HF ``config.json`` dict for the hybrid families' ``from_hf``.

    Same rules as :meth:`infercore.models.ModelConfig.from_hf`: a missing key (absent or null) is
    either required or takes the HF default; a present value is type-checked before any arithmetic,
    so errors are ``ValueError`` naming the key and what was expected -- not a KeyError, a
    ZeroDivisionError, a float count truncated or a string ``"false"`` read as True.
    """

    def __init__(self, hf: Mapping[str, Any], family: str) -> None:
        self.hf, self.family = hf, family

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.hf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"HF {self.family} config is missing {key!r}")
            return default
        return value

    def check(self, key: str, value: Any, kind: type | tuple[type, ...], what: str, ok=lambda v: True) -> Any:
        """``value`` (None passes) if it is a ``kind`` (never a bool unless ``kind`` is bool) with ``ok``."""
        is_bool = isinstance(value, bool) and kind is not bool
        if value is not None and (not isinstance(value, kind) or is_bool or not ok(value)):
            raise ValueError(f"HF {self.family} config key {key!r} must be {what}, got {value!r}")
        return value

    def positive_int(self, key: str, default: Any = _REQUIRED) -> int:
        return self.check(key, self.get(key, default), int, "a positive int", lambda v: v > 0)

    def number(self, key: str, default: Any = _REQUIRED, *, optional: bool = False) -> float | None:
        """A positive number as float; ``optional`` allows null / absent (-> None)."""
        value = self.get(key, None if optional and default is _REQUIRED else default)
        value = self.check(key, value, (int, float), "a positive number" + (" or null" if optional else ""),
                           lambda v: v > 0)  # fmt: skip
        return None if value is None else float(value)

    def flag(self, key: str, default: bool) -> bool:
        return self.check(key, self.get(key, default), bool, "true or false")

    def mapping(self, key: str) -> dict[str, Any]:
        """An object-valued key (e.g. ``rope_parameters``) as a fresh dict; absent / null -> {}."""
        return dict(self.check(key, self.hf.get(key), Mapping, "an object (or null)") or {})

    def int_list(self, key: str, bound: int) -> list[int]:
        """A list of layer indices in ``[0, bound)``; absent / null -> []."""
        value = self.check(key, self.hf.get(key), list | tuple, f"a list of layer indices in [0, {bound})")
        for v in value or ():
            self.check(key, v, int, f"a list of layer indices in [0, {bound})", lambda i: 0 <= i < bound)
        return list(value or ())

    def str_list(self, key: str) -> list[str] | None:
        """A list of strings (e.g. ``layer_types``); absent / null -> None (entries are checked later)."""
        value = self.check(key, self.hf.get(key), list | tuple, "a list of layer type names")
        for v in value or ():
            self.check(key, v, str, "a list of layer type names")
        return None if value is None else list(value)

    def token_ids(self) -> tuple[tuple[int, ...], int | None]:
        """``(eos_token_ids, bos_token_id)``."""
        eos = self.hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)
        for e in eos_ids:
            self.check("eos_token_id", e, int, "a token id or a list of token ids", lambda v: v >= 0)
        bos = self.check("bos_token_id", self.hf.get("bos_token_id"), int, "a token id", lambda v: v >= 0)
        return eos_ids, bos
