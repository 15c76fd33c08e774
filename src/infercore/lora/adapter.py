"""LoRA adapters as PEFT saves them: ``adapter_config.json`` beside ``adapter_model.safetensors`` (or ``.bin``).

An adapter adds ``scaling * B @ A`` to a linear's weight (``A [r, in]``, ``B [out, r]``, ``scaling = lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with rsLoRA). :class:`LoRAAdapter` keeps each targeted projection's pair by the Hugging
Face module name (``q_proj`` ... ``down_proj``) and layer, ``B`` already multiplied by its scaling; the engine's
:class:`~infercore.lora.LoRAManager` copies them into its slots.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

# the projections an adapter may target: the attention's and the gated MLP's
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter: ``weights[(layer, module)] = (A [r, in], B [out, r])`` (fp32 on the CPU, ``B`` scaled), the
    largest rank over its projections (``rank``), and where it came from (``path``, or None when built in memory)."""

    name: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int = 0
    path: str | None = None
    config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LoRAAdapter.name must be a non-empty str, got {self.name!r}")
        if not self.weights:
            raise ValueError(f"LoRA adapter {self.name!r} has no weights")
        for (layer, module), (a, b) in self.weights.items():
            if module not in TARGETS:
                raise ValueError(f"LoRA adapter {self.name!r}: module {module!r} is not one of {TARGETS}")
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise ValueError(f"LoRA adapter {self.name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}; expected A [r, in] and B [out, r]")
        self.rank = max(a.shape[0] for a, _ in self.weights.values())

    def fingerprint(self) -> bytes:
        """A SHA-256 digest of the weights (computed once): the prefix-cache salt of the adapter's requests, equal
        across engines and names for the same weights."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            h = hashlib.sha256()
            for (layer, module), (a, b) in sorted(self.weights.items()):
                h.update(f"{layer}.{module}:{tuple(a.shape)}:{tuple(b.shape)}".encode())
                for t in (a, b):
                    h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
            fp = self.__dict__["_fingerprint"] = h.digest()
        return fp

    @property
    def num_params(self) -> int:
        return sum(a.numel() + b.numel() for a, b in self.weights.values())


def load_lora_adapter(path: str | os.PathLike, name: str | None = None) -> LoRAAdapter:
    """Read a PEFT LoRA adapter directory.

    Supported: ``lora`` adapters over the attention and MLP projections of the decoder layers (``target_modules``
    among ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``), any rank per projection (``rank_pattern``),
    ``alpha_pattern``, rsLoRA. Refused with a ValueError naming the setting: DoRA, bias training, ``fan_in_fan_out``,
    ``modules_to_save``, embeddings and ``lm_head`` as targets, other PEFT methods.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"load_lora_adapter: {cfg_path} not found (expected a PEFT adapter directory)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    name = name or os.path.basename(os.path.normpath(path))
    ptype = str(cfg.get("peft_type", "LORA")).upper()
    if ptype != "LORA":
        raise ValueError(f"load_lora_adapter: peft_type {ptype!r} is not supported (LoRA only)")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise ValueError(f"load_lora_adapter: {key}={bad} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"load_lora_adapter: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise ValueError(f"load_lora_adapter: modules_to_save={cfg['modules_to_save']!r} is not supported")
    return adapter_from_state_dict(name, _read_weights(path), cfg, path=path)


def adapter_from_state_dict(name: str, state: dict[str, torch.Tensor], cfg: dict, *,
                            path: str | None = None) -> LoRAAdapter:
    """An adapter from PEFT's state dict (``get_peft_model_state_dict``: keys ``...layers.<i>.(self_attn|mlp).
    <proj>.lora_(A|B).weight``) and its ``adapter_config.json`` fields (``r``, ``lora_alpha``, ``use_rslora``,
    ``alpha_pattern``)."""
    r_default = int(cfg.get("r", 8))
    alpha_default = float(cfg.get("lora_alpha", r_default))
    rslora = bool(cfg.get("use_rslora", False))
    alpha_pattern = cfg.get("alpha_pattern") or {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        if "lora_embedding" in key or "lm_head" in key or "embed_tokens" in key:
            raise ValueError(f"load_lora_adapter: {key!r}: adapters of the embeddings or lm_head are not supported")
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"load_lora_adapter: unexpected weight {key!r} (expected "
                             "...layers.<i>.(self_attn|mlp).<proj>.lora_(A|B).weight)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise ValueError(f"load_lora_adapter: {key!r}: target module {module!r} is not supported "
                             f"(supported: {', '.join(TARGETS)})")
        pairs.setdefault((layer, module), {})[ab] = t
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"load_lora_adapter: layer {layer} {module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        alpha = _pattern(alpha_pattern, layer, module, alpha_default)
        scaling = alpha / (math.sqrt(r) if rslora else r)
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    return LoRAAdapter(name, weights, path=path, config=dict(cfg))


def _pattern(pattern: dict, layer: int, module: str, default: float) -> float:
    """PEFT's per-module override: the value of the first key whose regex matches the end of the module's name."""
    full = f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", full):
            return float(value)
    return default


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st, device="cpu")
    bin_path = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"load_lora_adapter: neither adapter_model.safetensors nor adapter_model.bin in {path}")
