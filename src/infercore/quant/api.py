"""Model-level quantization: named schemes, calibration, ``quantize(model, scheme)``, checkpoints.

``quantize`` swaps every eligible ``nn.Linear`` for a :class:`QuantLinear` in place. Schemes that
need activation statistics (SmoothQuant factors, the initial MixQ outlier set) take them from
``calibration``: either precomputed :class:`CalibrationStats`, or a callable that runs the model
over sample text (see :func:`collect_calibration`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .formats import (
    FP4_BLOCK,
    FP8_BLOCK,
    FP4Weight,
    FP8Weight,
    GGUFWeight,
    Int8Weight,
    IntWeight,
    NF4Weight,
    QuantizedWeight,
    _check_int,
    _check_real,
    _check_vector,
    _check_weight,
)
from .gptq import gptq_quantize
from .linear import QuantLinear


@dataclass(frozen=True)
class QuantScheme:
    """A named recipe. ``weight``: ``int4``/``int8`` (weight-only), ``fp8`` (weight-only,
    emulated), ``mxfp4``/``nvfp4`` (FP4 weight-only, emulated), ``nf4`` (4-bit NormalFloat codebook, weight-only),
    ``w8a8`` (``act`` = ``int8`` or ``fp8``), or a GGUF
    block type ``q4_0``/``q4_1``/``q8_0``."""

    name: str
    weight: str
    description: str
    group_size: int | None = None
    symmetric: bool = False
    fp8_block: int | None = None
    act: str | None = None
    smooth_alpha: float | None = None
    outlier_threshold: float | None = None
    max_outliers: int = 256
    method: str = "rtn"  # "rtn" (round to nearest, clip search) or "gptq" (int4/int8 only)
    act_order: bool = False  # GPTQ: columns in decreasing diag(H) order
    damp: float = 0.01  # GPTQ: fraction of mean diag(H) added to the diagonal
    scale_search: bool = False  # fp8 per-channel: least activation-weighted MSE scale

    def __post_init__(self) -> None:
        # Every field is checked here rather than where it is used: otherwise a bad field surfaces
        # as an error about another one (an unknown weight type falls through to W8A8 and blames
        # act) or is silently ignored (a group size on an fp8 scheme).
        for f in ("name", "description"):
            if not isinstance(getattr(self, f), str):
                raise TypeError(f"{f}: expected a str, got {type(getattr(self, f)).__name__}")
        if self.weight not in _WEIGHTS:
            raise ValueError(f"weight: expected one of {_WEIGHTS}, got {self.weight!r}")
        for f in ("symmetric", "act_order", "scale_search"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"{f}: expected a bool, got {getattr(self, f)!r}")
        int_weight = self.weight in ("int4", "int8")
        if self.group_size is not None:
            _check_int("group_size", self.group_size, "a positive even int or None", lambda g: g > 0 and g % 2 == 0)
            if not int_weight:
                raise ValueError(f"group_size: only int4/int8 weights are grouped, not {self.weight!r}")
        if self.fp8_block is not None:
            _check_int("fp8_block", self.fp8_block, "a positive int or None", lambda b: b > 0)
            if self.weight != "fp8":
                raise ValueError(f"fp8_block: applies to fp8 weights only, not {self.weight!r}")
        if self.scale_search and (self.weight != "fp8" or self.fp8_block is not None):
            raise ValueError("scale_search: applies to per-channel fp8 weights only (weight 'fp8', fp8_block None)")
        if self.weight == "w8a8":
            if self.act not in ("int8", "fp8"):
                raise ValueError(f"act: expected 'int8' or 'fp8' for w8a8 weights, got {self.act!r}")
        elif self.act is not None:
            raise ValueError(f"act: only w8a8 schemes quantize activations; expected None for {self.weight!r}, "
                             f"got {self.act!r}")
        if self.smooth_alpha is not None:
            _check_real("smooth_alpha", self.smooth_alpha, "a number in [0, 1] or None", lambda a: 0 <= a <= 1)
            if self.weight != "w8a8":
                raise ValueError(f"smooth_alpha: SmoothQuant applies to w8a8 weights only, not {self.weight!r}")
        if self.outlier_threshold is not None:
            _check_real("outlier_threshold", self.outlier_threshold, "a positive number or None", lambda t: t > 0)
            if self.act != "int8":
                raise ValueError("outlier_threshold: only INT8 W8A8 weights carry an outlier set")
        _check_int("max_outliers", self.max_outliers, "a non-negative int", lambda m: m >= 0)
        if self.method not in ("rtn", "gptq"):
            raise ValueError(f"method: expected 'rtn' or 'gptq', got {self.method!r}")
        if self.method == "gptq" and not int_weight:
            raise ValueError(f"method: GPTQ applies to int4/int8 weight-only schemes, not {self.name!r}")
        _check_real("damp", self.damp, "a fraction in [0, 1)", lambda d: 0 <= d < 1)

    @property
    def needs_calibration(self) -> bool:
        """Whether :func:`quantize` needs ``calibration`` for this scheme: GPTQ (Hessians) and SmoothQuant
        (per-channel activation maxima)."""
        return self.method == "gptq" or self.smooth_alpha is not None


_WEIGHTS = ("int4", "int8", "fp8", "mxfp4", "nvfp4", "nf4", "w8a8", "q4_0", "q4_1", "q8_0")
NF4_BLOCKSIZE = 64  # the w4a16-nf4 scheme's absmax block (bitsandbytes' default)


SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in [
        QuantScheme("w4a16-g128", "int4", "INT4 weights, asymmetric, groups of 128 along K; bf16 activations "
                    "(AWQ/GPTQ-compatible packing)", group_size=128),
        QuantScheme("w4a16-g128-sym", "int4", "INT4 weights, symmetric (zero point 8), groups of 128",
                    group_size=128, symmetric=True),
        # 0.1% damping: on SmolLM2-135M it measured +4.4% perplexity against +6.0% with 1%.
        QuantScheme("w4a16-g128-gptq", "int4", "INT4 weights as `w4a16-g128`, codes chosen by GPTQ (act-order, "
                    "0.1% damping; needs calibration)", group_size=128, method="gptq", act_order=True,
                    damp=0.001),
        QuantScheme("w8a16", "int8", "INT8 weights, symmetric per output channel; bf16 activations",
                    group_size=None, symmetric=True),
        QuantScheme("fp8-wo", "fp8", "FP8 e4m3 weights, per-channel scales, emulated decode (any GPU)"),
        QuantScheme("fp8-wo-search", "fp8", "FP8 e4m3 weights, per-channel scales from a least-MSE search "
                    "weighted by calibration mean x^2", scale_search=True),
        QuantScheme("fp8-wo-block", "fp8", "FP8 e4m3 weights, 128x128 block scales, emulated decode",
                    fp8_block=FP8_BLOCK),
        QuantScheme("fp8-w8a8", "w8a8", "FP8 e4m3 per-channel weights x per-token FP8 activations "
                    "(native FP8 tensor cores, sm89+)", act="fp8"),
        QuantScheme("w8a8", "w8a8", "INT8 per-channel weights x per-token INT8 activations", act="int8"),
        QuantScheme("w8a8-smooth", "w8a8",
                    "INT8 W8A8 with SmoothQuant factors (alpha 0.5; needs calibration)",
                    act="int8", smooth_alpha=0.5),
        QuantScheme("w8a8-mixed", "w8a8", "MixQ: INT8 W8A8 with outlier input channels (abs(x) > 6) kept in "
                    "bf16; set seeded by calibration and grown online", act="int8", outlier_threshold=6.0),
        QuantScheme("w8a8-mixed-smooth", "w8a8", "MixQ on SmoothQuant-ed activations (alpha 0.5): outliers are "
                    "channels with abs(x / smooth) > 6, seeded by calibration and grown online; needs calibration",
                    act="int8", smooth_alpha=0.5, outlier_threshold=6.0),
        QuantScheme("w4a16-mxfp4", "mxfp4", "FP4 e2m1 weights, OCP MXFP4 (blocks of 32 along K, power-of-two e8m0 "
                    "scales, rounded up so no value clips); emulated decode (any GPU)"),
        QuantScheme("w4a16-nvfp4", "nvfp4", "FP4 e2m1 weights, NVFP4 (blocks of 16, e4m3 scales times one fp32 scale "
                    "per tensor); emulated decode (any GPU)"),
        QuantScheme("w4a16-nf4", "nf4", "4-bit NormalFloat codes (bitsandbytes / QLoRA NF4 codebook), one fp32 absmax "
                    "per block of 64 along K"),
        QuantScheme("gguf-q4_0", "q4_0", "GGUF Q4_0 blocks (32 values, fp16 scale), run as stored"),
        QuantScheme("gguf-q4_1", "q4_1", "GGUF Q4_1 blocks (32 values, fp16 scale and min), run as stored"),
        QuantScheme("gguf-q8_0", "q8_0", "GGUF Q8_0 blocks (32 values, fp16 scale), run as stored"),
    ]
}


class CalibrationStats(dict):
    """``{linear module name: fp32 [K] per-input-channel max |x|}`` over the calibration text.

    Attributes:
        mean_sq: ``{name: fp32 [K]}`` per-input-channel mean ``x^2`` (always collected).
        hessians: ``{name: fp32 [K, K]}`` mean ``x^T x`` over calibration tokens (GPTQ's
            Hessian up to the factor 2); only when collected with ``hessian=True``.
        tokens: ``{name: int}`` rows of ``x`` seen.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mean_sq: dict[str, torch.Tensor] = {}
        self.hessians: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}


def collect_calibration(
    model: nn.Module, run: Callable[[nn.Module], object], *, hessian: bool = False,
    names: Iterable[str] | None = None,
) -> CalibrationStats:
    """Record input statistics of every ``nn.Linear`` while ``run(model)`` executes.

    ``run`` drives the model over sample text (e.g. a few hundred tokens of prose) however the
    model's forward wants to be called. Always records per-input-channel ``max |x|`` and mean
    ``x^2``; with ``hessian=True`` also the mean ``x^T x`` ``[K, K]`` (fp32, on the layer's
    device) that GPTQ needs. ``names`` restricts recording to those modules.
    """
    stats = CalibrationStats()
    hooks = []
    wanted = None if names is None else set(names)

    def make_hook(name: str):
        def hook(_mod, inputs, _out):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            amax = x.abs().amax(0).cpu()
            n_old = stats.tokens.get(name, 0)
            n_new = n_old + x.shape[0]
            # Running means (not sums) keep magnitudes independent of the amount of text.
            sq = (x * x).sum(0).cpu()
            if name not in stats:
                stats[name], stats.mean_sq[name] = amax, sq / n_new
            else:
                stats[name] = torch.maximum(stats[name], amax)
                stats.mean_sq[name] = stats.mean_sq[name] * (n_old / n_new) + sq / n_new
            if hessian:
                h = x.T @ x
                old = stats.hessians.get(name)
                stats.hessians[name] = h / n_new if old is None else old * (n_old / n_new) + h / n_new
            stats.tokens[name] = n_new

        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (wanted is None or name in wanted):
            hooks.append(mod.register_forward_hook(make_hook(name)))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _resolve(scheme: str | QuantScheme) -> QuantScheme:
    if isinstance(scheme, QuantScheme):
        return scheme
    if not isinstance(scheme, str):
        raise TypeError(f"scheme: expected a scheme name or a QuantScheme, got {type(scheme).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: unknown {scheme!r}; known: {sorted(SCHEMES)}")
    return SCHEMES[scheme]


def quantize_weight(
    w: torch.Tensor, scheme: str | QuantScheme, *, act_absmax: torch.Tensor | None = None,
    act_mean_sq: torch.Tensor | None = None, hessian: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize one ``[N, K]`` weight by ``scheme``.

    ``act_absmax`` ``[K]`` feeds SmoothQuant/MixQ; ``act_mean_sq`` ``[K]`` weights the FP8 scale
    search; ``hessian`` ``[K, K]`` (mean ``x^T x``) is required by GPTQ schemes.
    """
    s = _resolve(scheme)  # a QuantScheme is validated on construction
    _check_weight(w)
    k = w.shape[1]
    if s.weight in ("int4", "int8"):
        bits = 4 if s.weight == "int4" else 8
        if s.method == "gptq":
            if hessian is None:
                raise ValueError(f"scheme {s.name!r}: GPTQ needs calibration Hessians "
                                 "(collect_calibration(..., hessian=True) or a calibration callable)")
            return gptq_quantize(w, hessian, bits=bits, group_size=s.group_size, symmetric=s.symmetric,
                                 act_order=s.act_order, damp=s.damp)
        return IntWeight.quantize(w, bits=bits, group_size=s.group_size, symmetric=s.symmetric)
    if s.weight == "fp8":
        if s.scale_search and act_mean_sq is not None:
            _check_vector("act_mean_sq", act_mean_sq, k)
        return FP8Weight.quantize(w, block_size=s.fp8_block, scale_search=s.scale_search,
                                  importance=act_mean_sq if s.scale_search else None)
    if s.weight in ("q4_0", "q4_1", "q8_0"):
        return GGUFWeight.quantize(w, qtype=s.weight)
    if s.weight in FP4_BLOCK:
        return FP4Weight.quantize(w, fmt=s.weight)
    if s.weight == "nf4":
        return NF4Weight.quantize(w, blocksize=NF4_BLOCKSIZE)
    smooth = outliers = None
    if act_absmax is not None:
        _check_vector("act_absmax", act_absmax, k)
        if not bool((torch.isfinite(act_absmax) & (act_absmax >= 0)).all()):
            raise ValueError("act_absmax: expected finite non-negative per-channel max |x|")
        a = act_absmax.float().to(w.device)
        if s.smooth_alpha is not None:
            # SmoothQuant: s_j = max|x_j|^a / max|W_j|^(1-a), moving range from x to W.
            wmax = w.float().abs().amax(0).clamp_min(1e-5)
            smooth = (a.clamp_min(1e-5) ** s.smooth_alpha / wmax ** (1 - s.smooth_alpha)).clamp_min(1e-5)
        if s.outlier_threshold is not None:
            # The threshold applies to what the quantizer sees: x / smooth when smoothing.
            seen = a if smooth is None else a / smooth
            outliers = (seen > s.outlier_threshold).nonzero().flatten()[: s.max_outliers].to(torch.int32)
    elif s.smooth_alpha is not None:
        raise ValueError(f"scheme {s.name!r}: SmoothQuant needs calibration statistics")
    return Int8Weight.quantize(w, act=s.act, smooth=smooth, outlier_idx=outliers,
                               outlier_dtype=torch.bfloat16 if w.dtype == torch.float32 else w.dtype)


def _skipped(name: str, skip: Iterable[str]) -> bool:
    """Whether module ``name`` is named by ``skip`` (the whole name, a trailing component or a parent)."""
    return any(name == p or name.endswith("." + p) or name.startswith(p + ".") for p in skip)


def _eligible(name: str, mod: nn.Module, s: QuantScheme, skip: Iterable[str]) -> bool:
    if not isinstance(mod, nn.Linear) or _skipped(name, skip):
        return False
    k = mod.in_features
    return not ((s.weight.startswith("q") and k % 32) or (s.weight in FP4_BLOCK and k % FP4_BLOCK[s.weight])
                or (s.weight == "nf4" and k % NF4_BLOCKSIZE))


def quantize(
    model: nn.Module, scheme: str | QuantScheme, *,
    calibration: CalibrationStats | Callable[[nn.Module], object] | None = None,
    skip: Iterable[str] = ("lm_head", "score"), method: str | None = None, experts: bool = False,
) -> nn.Module:
    """Replace every eligible ``nn.Linear`` of ``model`` by a :class:`QuantLinear`, in place.

    Args:
        model: any module tree (weights in any float dtype, on any device).
        scheme: a name from :data:`SCHEMES` or a :class:`QuantScheme`.
        calibration: :class:`CalibrationStats`, or a callable ``run(model)`` over sample text from
            which they are collected first. Required by ``w8a8-smooth`` and GPTQ (which needs
            Hessians: a callable, or stats from ``collect_calibration(..., hessian=True)``);
            seeds ``w8a8-mixed``; weights the ``fp8-wo-search`` scale search.
        skip: module names (or trailing name components) left unquantized; GGUF schemes also
            skip layers whose K is not a multiple of 32, FP4 schemes those whose K is not one of their block, NF4 those
            whose K is not a multiple of 64.
        method: ``"rtn"`` or ``"gptq"`` to override the scheme's method (e.g.
            ``quantize(model, "w4a16-g128", calibration=run, method="gptq")``).
        experts: also quantize the stacked routed experts (``models.moe.StackedExperts``: Mixtral, Qwen2 / Qwen3-MoE,
            Qwen3-Next, DeepSeek) with the scheme's weight format, which must be weight-only int8 per channel
            (``w8a16``) or fp8 (``fp8-wo``, ``fp8-wo-block``): the routed op reads their codes (half of bf16's
            bytes) and scales them in registers. After ``tensor_parallel_``, not before.

    Returns:
        ``model`` (modified in place).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    s = _resolve(scheme)
    if method is not None:
        s = dataclasses.replace(s, method=method)  # QuantScheme validates the override
    # A bare str would be split into one-letter names.
    if isinstance(skip, str) or not isinstance(skip, Iterable):
        raise TypeError(f"skip: expected an iterable of module names, got {skip!r}")
    skip = tuple(skip)
    if not all(isinstance(p, str) for p in skip):
        raise TypeError(f"skip: expected module names (str), got {skip!r}")
    targets = [(n, m) for n, m in model.named_modules() if _eligible(n, m, s, skip)]
    expert_kind = _expert_kind(s) if experts else None
    if experts and not _stacked_experts(model, skip):
        raise ValueError("experts: the model has no stacked routed experts (models.moe.StackedExperts: Mixtral, "
                         "Qwen2 / Qwen3-MoE, Qwen3-Next, DeepSeek) to quantize")
    if calibration is not None and not isinstance(calibration, CalibrationStats):
        if not callable(calibration):
            raise TypeError("calibration: expected CalibrationStats (see collect_calibration) or a callable "
                            f"run(model), got {type(calibration).__name__}")
        calibration = collect_calibration(model, calibration, hessian=s.method == "gptq",
                                          names=[n for n, _ in targets])
    if s.needs_calibration and calibration is None:
        raise ValueError(f"calibration: scheme {s.name!r} needs calibration (CalibrationStats or a callable "
                         "run(model))")
    if s.method == "gptq" and not calibration.hessians:
        raise ValueError(f"calibration: scheme {s.name!r} with GPTQ needs calibration Hessians")
    if calibration is not None:
        # Before any layer is replaced, so bad statistics leave the model as it was.
        for name, mod in targets:
            _check_stats(calibration, name, mod.in_features)
    for name, mod in targets:
        stats = calibration if calibration is not None else CalibrationStats()
        with torch.no_grad():
            qw = quantize_weight(mod.weight.detach(), s, act_absmax=stats.get(name),
                                 act_mean_sq=stats.mean_sq.get(name), hessian=stats.hessians.get(name))
        new = QuantLinear(qw, mod.bias, outlier_threshold=s.outlier_threshold, max_outliers=s.max_outliers)
        _set_submodule(model, name, new)
    if expert_kind is not None:
        quantize_experts_(model, *expert_kind, skip=skip)
    return model


def quantize_experts_(model: nn.Module, kind: str, block: int = 128, *, skip: Iterable[str] = ()) -> int:
    """Quantize every stacked routed-experts module of ``model`` not quantized yet (``StackedExperts.quantize_``:
    ``"int8"``, ``"fp8"`` or ``"fp8-block"``), except those named in ``skip``; drops the oneDNN-packed CPU copies of
    those experts (stale). Returns how many were quantized."""
    n = 0
    for mod in _stacked_experts(model, skip):
        if mod.gate_up_scale is None:
            mod.quantize_(kind, block)
            n += 1
    for mod in model.modules():
        ex = getattr(mod, "experts", None)
        if getattr(mod, "cpu_packed_experts", None) is not None and getattr(ex, "gate_up_scale", None) is not None:
            mod.cpu_packed_experts = None
    return n


def _stacked_experts(model: nn.Module, skip: Iterable[str]) -> list[nn.Module]:
    """The ``models.moe.StackedExperts`` modules of ``model`` not named by ``skip``."""
    from ..models.moe import StackedExperts

    return [m for n, m in model.named_modules() if isinstance(m, StackedExperts) and not _skipped(n, skip)]


def _expert_kind(s: QuantScheme) -> tuple[str, int]:
    """``StackedExperts.quantize_``'s arguments for scheme ``s``, or ValueError naming the schemes that have some."""
    if s.weight == "int8" and s.group_size is None and s.method == "rtn":
        return "int8", 128
    if s.weight == "fp8" and not s.scale_search:
        return ("fp8", 128) if s.fp8_block is None else ("fp8-block", s.fp8_block)
    raise ValueError(f"experts: the routed experts take weight-only int8 per channel or fp8 schemes (w8a16, fp8-wo, "
                     f"fp8-wo-block), not {s.name!r}")


def _check_stats(stats: CalibrationStats, name: str, k: int) -> None:
    for label, table, shape in (("calibration", stats, (k,)), ("calibration.mean_sq", stats.mean_sq, (k,)),
                                ("calibration.hessians", stats.hessians, (k, k))):
        t = table.get(name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label}[{name!r}]: expected a tensor of shape {shape}, got {type(t).__name__}")
        if t.shape != shape:
            raise ValueError(f"{label}[{name!r}]: expected shape {shape} (the layer's in_features {k}), "
                             f"got {tuple(t.shape)}")
        if shape == (k,) and not bool((torch.isfinite(t) & (t >= 0)).all()):
            raise ValueError(f"{label}[{name!r}]: expected finite non-negative values")


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def outlier_hit_rate(model: nn.Module) -> dict[str, float]:
    """Fraction of (layer, token) pairs whose outliers were all in the predicted set, and growths."""
    tokens = covered = grown = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.outlier_threshold is not None:
            tokens += m.outlier_stats["tokens"]
            covered += m.outlier_stats["covered"]
            grown += m.outlier_stats["grown"]
    return {"hit_rate": covered / tokens if tokens else float("nan"), "tokens": tokens, "grown": grown}


# ----------------------------------------------------------------------------------------------
# Checkpoints (safetensors): module state plus a JSON header describing each QuantLinear
# ----------------------------------------------------------------------------------------------

_EXPERTS_KEY = "infercore.quantized_experts"
_META_KEY = "infercore.quant"


def save_quantized(model: nn.Module, path: str | os.PathLike) -> None:
    """Write ``model``'s full state (quantized buffers included) to one safetensors file."""
    from safetensors.torch import save_file

    layers = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            layers[name] = {"format": m._meta, "outlier_threshold": m.outlier_threshold,
                            "max_outliers": m.max_outliers, "bias": m.bias is not None,
                            "in_perm": m.in_perm is not None}
    experts = [name for name, m in model.named_modules() if getattr(m, "gate_up_scale", None) is not None
               and hasattr(m, "quantize_")]  # int8 / fp8 stacked experts (quantize(..., experts=True))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # Tied weights (e.g. lm_head = embed_tokens) are one tensor; safetensors refuses shared storage.
    seen: dict[int, str] = {}
    for k in list(state):
        ptr = state[k].data_ptr()
        if ptr in seen and state[k].numel():
            state[k] = state[k].clone()
        seen[ptr] = k
    save_file(state, os.fspath(path), metadata={_META_KEY: json.dumps(layers), _EXPERTS_KEY: json.dumps(experts)})


def load_quantized(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Swap ``model``'s linears for the :class:`QuantLinear` s recorded in ``path`` and load its state.

    ``model`` is the unquantized architecture (weights may be uninitialised); returns it, in place.
    """
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        meta = f.metadata() or {}
        if _META_KEY not in meta:
            raise ValueError(f"path: {path} is not an infercore quantized checkpoint")
        layers = json.loads(meta[_META_KEY])
        experts = json.loads(meta.get(_EXPERTS_KEY, "[]"))
        state = {k: f.get_tensor(k) for k in f.keys()}
    device = next(iter(model.parameters())).device
    for name in experts:  # quantized stacked experts: codes and scales in the stored dtypes and shapes
        try:
            m = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"path: checkpoint has quantized experts {name!r}, which the model lacks") from None
        for proj, scale in (("gate_up_proj", "gate_up_scale"), ("down_proj", "down_scale")):
            codes = state.get(f"{name}.{proj}")
            if codes is None or f"{name}.{scale}" not in state:
                raise ValueError(f"path: quantized experts {name!r} lack {proj} or {scale}")
            setattr(m, proj, nn.Parameter(torch.empty_like(codes, device=device), requires_grad=False))
            setattr(m, scale, torch.empty_like(state[f"{name}.{scale}"], device=device))
    for name, info in layers.items():
        fmt_meta = info["format"]
        prefix = name + "."
        tensors = {k[len(prefix):]: v.to(device) for k, v in state.items()
                   if k.startswith(prefix) and "." not in k[len(prefix):]}
        bias = tensors.pop("bias", None)
        in_perm = tensors.pop("in_perm", None)
        qw = QuantizedWeight.from_parts(fmt_meta, tensors)
        new = QuantLinear(qw, bias, outlier_threshold=info["outlier_threshold"],
                          max_outliers=info["max_outliers"], in_perm=in_perm)
        _set_submodule(model, name, new)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or missing:
        raise ValueError(f"path: checkpoint does not match the model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    return model


def scheme_table() -> str:
    """The schemes as a markdown table (used in docs/quantization.md)."""
    rows = ["| scheme | weights | activations | description |", "|---|---|---|---|"]
    for s in SCHEMES.values():
        d = asdict(s)
        w = s.weight + (f" g{s.group_size}" if s.group_size else "") + (" sym" if s.symmetric else "")
        rows.append(f"| `{s.name}` | {w} | {d['act'] or 'bf16/fp16'} | {s.description} |")
    return "\n".join(rows)
