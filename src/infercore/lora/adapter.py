"""LoRA adapters as PEFT saves them: ``adapter_config.json`` beside ``adapter_model.safetensors`` (or ``.bin``).

An adapter adds ``scaling * B @ A`` to a linear's weight (``A [r, in]``, ``B [out, r]``, ``scaling = lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with rsLoRA). :class:`LoRAAdapter` keeps each targeted projection's pair by the Hugging
Face module name (``q_proj`` ... ``down_proj``) and layer, ``B`` already multiplied by its scaling; the engine's
:class:`~infercore.lora.LoRAManager` copies them into its slots.

Sparse-MoE layers (Mixtral, Qwen2-MoE, Qwen3-MoE) take adapters on their routed experts, in either of PEFT's forms:
per-expert modules (``mlp.experts.<e>.gate_proj`` ..., Mixtral's ``block_sparse_moe.experts.<e>.w1 / w3 / w2``, as
transformers 4 models name them) or ``target_parameters`` on the stacked expert tensors (``mlp.experts.gate_up_proj``
/ ``down_proj`` of transformers 5: one ``ParamWrapper`` per tensor, ``lora_A [r E, in]`` and ``lora_B [out, r E]``,
expert ``e``'s pair ``A.view(E, r, in)[e]`` and ``B.view(out, r, E)[..., e]``); and on Qwen2-MoE's shared expert
(``mlp.shared_expert.gate_proj`` ...). Expert pairs are kept stacked, ``(A [E, r, in], B [E, out, r])``, under
``experts.gate_proj`` / ``experts.up_proj`` / ``experts.down_proj`` (zeros for experts an adapter leaves alone).
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
# a sparse-MoE layer's routed experts (pairs stacked over the experts) and shared expert
EXPERT_TARGETS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
SHARED_TARGETS = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
# projections some checkpoints store merged (Phi-3): one pair, B's rows cut by slice when placed
MERGED_TARGETS = ("qkv_proj", "gate_up_proj")
ALL_TARGETS = TARGETS + MERGED_TARGETS + EXPERT_TARGETS + SHARED_TARGETS

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.((?:shared_expert\.)?\w+)\.lora_([AB])(?:\.[\w-]+)?"
                  r"\.weight$")
# one expert's module (transformers 4 names; Mixtral's w1 / w3 / w2 = gate / up / down)
_EXPERT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# PEFT's target_parameters on the stacked experts: ParamWrappers nested in the tensors' registration order
# (gate_up_proj innermost, so its keys carry one more ``base_layer``)
_PARAM_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])(?:\.[\w-]+)?\.weight$")


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
            if module not in ALL_TARGETS:
                raise ValueError(f"LoRA adapter {self.name!r}: module {module!r} is not one of {ALL_TARGETS}")
            if module in EXPERT_TARGETS:
                if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
                    raise ValueError(f"LoRA adapter {self.name!r}: layer {layer} {module} has A {tuple(a.shape)} and "
                                     f"B {tuple(b.shape)}; expected A [E, r, in] and B [E, out, r]")
            elif a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise ValueError(f"LoRA adapter {self.name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}; expected A [r, in] and B [out, r]")
        self.rank = max(a.shape[-2] for a, _ in self.weights.values())

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
    among ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``, or Phi-3's merged ``qkv_proj`` /
    ``gate_up_proj``, whose B is cut by slice when placed), a sparse-MoE layer's routed experts
    (per-expert modules, or ``target_parameters`` on the stacked tensors) and shared expert, any rank per
    projection (``rank_pattern``), ``alpha_pattern``, rsLoRA. Refused with a ValueError naming the setting: DoRA,
    bias training, ``fan_in_fan_out``, ``modules_to_save``, embeddings and ``lm_head`` as targets, other PEFT methods.
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
    experts: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}  # per-expert modules
    params: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # target_parameters wrappers by nesting depth
    for key, t in state.items():
        if "lora_embedding" in key or "lm_head" in key or "embed_tokens" in key:
            raise ValueError(f"load_lora_adapter: {key!r}: adapters of the embeddings or lm_head are not supported")
        m = _EXPERT_KEY.search(key)
        if m is not None:
            proj = _MIXTRAL.get(m.group(3), m.group(3))
            experts.setdefault((int(m.group(1)), proj), {}).setdefault(int(m.group(2)), {})[m.group(4)] = t
            continue
        m = _PARAM_KEY.search(key)
        if m is not None:
            params.setdefault(int(m.group(1)), {}).setdefault(m.group(2).count("base_layer"), {})[m.group(3)] = t
            continue
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"load_lora_adapter: unexpected weight {key!r} (expected "
                             "...layers.<i>.(self_attn|mlp).<proj>.lora_(A|B).weight)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS and module not in SHARED_TARGETS and module not in MERGED_TARGETS:
            raise ValueError(f"load_lora_adapter: {key!r}: target module {module!r} is not supported "
                             f"(supported: {', '.join(TARGETS + MERGED_TARGETS + SHARED_TARGETS)}, and the routed "
                             "experts)")
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
    for (layer, proj), by_expert in sorted(experts.items()):
        stacked = []
        for e, ab in sorted(by_expert.items()):
            if set(ab) != {"A", "B"}:
                raise ValueError(f"load_lora_adapter: layer {layer} expert {e} {proj} has lora_{''.join(ab)} but not "
                                 "both A and B")
            r = ab["A"].shape[0]
            full = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
            alpha = _pattern(alpha_pattern, layer, proj, alpha_default, full=full)
            stacked.append((e, ab["A"].float(), ab["B"].float() * (alpha / (math.sqrt(r) if rslora else r))))
        weights[(layer, f"experts.{proj}")] = _stack_experts(stacked, f"layer {layer} experts {proj}")
    for layer, wrappers in sorted(params.items()):
        for module, (a, b) in _expert_params(layer, wrappers, cfg, rslora, alpha_default, alpha_pattern).items():
            if (layer, module) in weights:
                raise ValueError(f"load_lora_adapter: layer {layer} {module} appears both per expert and as a "
                                 "target parameter")
            weights[(layer, module)] = (a, b)
    return LoRAAdapter(name, weights, path=path, config=dict(cfg))


def _stack_experts(pairs: list[tuple[int, torch.Tensor, torch.Tensor]], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert ``(e, A [r_e, in], B [out, r_e])`` (B scaled) -> ``(A [E, r, in], B [E, out, r])``, ``E`` = the
    largest expert index + 1, ``r`` the largest rank, zeros elsewhere."""
    E = 1 + max(e for e, _, _ in pairs)
    r = max(a.shape[0] for _, a, _ in pairs)
    k, n = pairs[0][1].shape[1], pairs[0][2].shape[0]
    A, B = torch.zeros(E, r, k), torch.zeros(E, n, r)
    for e, a, b in pairs:
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != k or b.shape[0] != n or a.shape[0] != b.shape[1]:
            raise ValueError(f"load_lora_adapter: {what}: expert {e} has A {tuple(a.shape)} / B {tuple(b.shape)}, "
                             f"expected A [r, {k}] and B [{n}, r] like the others")
        A[e, : a.shape[0]] = a
        B[e, :, : a.shape[0]] = b
    return A, B


def _expert_params(layer: int, wrappers: dict[int, dict[str, torch.Tensor]], cfg: dict, rslora: bool,
                   alpha_default: float, alpha_pattern: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT ``target_parameters`` adapters of one layer's stacked experts (``{nesting depth: {"A": .., "B": ..}}``)
    -> the ``experts.*`` pairs. The innermost wrapper is ``gate_up_proj`` (registered first); a layer with one
    wrapper is whichever tensor ``target_parameters`` names."""
    names = sorted({str(t).rsplit(".", 1)[-1] for t in (cfg.get("target_parameters") or [])}
                   & {"gate_up_proj", "down_proj"})
    depths = sorted(wrappers, reverse=True)  # innermost (most base_layer) first
    if len(depths) == 2:
        which = dict(zip(depths, ("gate_up_proj", "down_proj")))
    elif len(depths) == 1 and len(names) == 1:
        which = {depths[0]: names[0]}
    else:
        raise ValueError(f"load_lora_adapter: layer {layer}: cannot tell which stacked expert tensor each of "
                         f"{len(depths)} target-parameter adapter(s) belongs to (target_parameters={names})")
    out = {}
    r_default = int(cfg.get("r", 8))
    rank_pattern = cfg.get("rank_pattern") or {}
    for depth, param in which.items():
        ab = wrappers[depth]
        if set(ab) != {"A", "B"}:
            raise ValueError(f"load_lora_adapter: layer {layer} experts {param} has lora_{''.join(ab)} but not both")
        full = f"model.layers.{layer}.mlp.experts.{param}"
        r = int(_pattern(rank_pattern, layer, param, r_default, full=full))
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] % r:
            raise ValueError(f"load_lora_adapter: layer {layer} experts {param}: lora_A {tuple(a.shape)} / lora_B "
                             f"{tuple(b.shape)} are not [r * E, in] / [out, r * E] with r = {r}")
        E = a.shape[0] // r
        alpha = _pattern(alpha_pattern, layer, param, alpha_default, full=full)
        A = a.reshape(E, r, a.shape[1]).contiguous()
        B = (b.reshape(b.shape[0], r, E).permute(2, 0, 1) * (alpha / (math.sqrt(r) if rslora else r))).contiguous()
        if param == "down_proj":
            out["experts.down_proj"] = (A, B)
        else:
            if B.shape[1] % 2:
                raise ValueError(f"load_lora_adapter: layer {layer} experts gate_up_proj: lora_B has {B.shape[1]} "
                                 "output rows, expected 2 * intermediate")
            i = B.shape[1] // 2
            out["experts.gate_proj"] = (A, B[:, :i].contiguous())
            out["experts.up_proj"] = (A.clone(), B[:, i:].contiguous())
    return out


def _pattern(pattern: dict, layer: int, module: str, default: float, *, full: str | None = None) -> float:
    """PEFT's per-module override: the value of the first key whose regex matches the end of the module's name
    (``full``, or the name of ``module`` of ``layer``)."""
    mlp = module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") or module.startswith("shared_expert.")
    full = full or f"model.layers.{layer}.{'mlp' if mlp else 'self_attn'}.{module}"
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
