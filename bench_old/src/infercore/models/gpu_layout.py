"""CUDA decode layout: ``nn.Linear`` modules that run a Triton skinny GEMV for few-row inputs, and
gated MLPs whose activation runs in the ``gate_up_proj`` GEMV's epilogue.

At decode batch 1-16 every linear is a weight stream; ``ops.linear``'s Triton GEMV reads it closer
to the HBM bandwidth than cuBLAS on the shapes its tuning table covers. The swap keeps the plain
``weight``/``bias`` parameters (state dicts, quantization and ``load_weights`` see an ordinary
``nn.Linear``), mirroring :class:`infercore.models.layout.CPUPackedLinear`. The MLP swap likewise
only changes the module's class (same parameters, no copies), from outside the model code.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class TritonGemvLinear(nn.Linear):
    """``nn.Linear`` whose forward takes the Triton GEMV when x has at most ``gemv_max_m`` rows
    (leading dims flattened), x is on CUDA, and the tuning table measured it faster than cuBLAS for
    ``(N, K, M-bucket)``; otherwise ``F.linear``. The choice depends only on shapes, so it is made
    on the host without a sync and is CUDA-graph capturable (the GEMV allocates only its output,
    plus a split-K workspace from the same caching allocator). ``gemv_force`` (tests: the Triton
    interpreter on CPU tensors) skips the device and tuning-table conditions."""

    gemv_max_m: int = 16
    gemv_force: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if _gemv_ok(self, x, w, None):
            return _triton().skinny_linear(x, w, self.bias)
        return F.linear(x, w, self.bias)


def _rows(x: torch.Tensor) -> int:
    k = x.shape[-1]
    return x.numel() // k if k else 0


def _gemv_ok(owner: nn.Module, x: torch.Tensor, w: torch.Tensor, act: str | None) -> bool:
    """Whether ``owner`` (a TritonGemvLinear or a fused MLP) should run the GEMV for ``x``: few rows,
    plain weights of x's dtype, on CUDA, and a measured win (memoised per M, host-only)."""
    m = _rows(x)
    if not (0 < m <= owner.gemv_max_m and x.dtype == w.dtype):
        return False
    if owner.gemv_force:
        return True
    if not x.is_cuda:
        return False
    cache = owner.__dict__.setdefault("_gemv_choice", {})
    hit = cache.get(m)
    if hit is None:
        n, k = w.shape
        hit = cache[m] = _triton().beats_cublas(n, k, m, act)
    return hit


def _triton():
    from ..ops.linear import triton as gemv  # CUDA-only module: imported on first use

    return gemv


class _GemvFusedMLP:
    """Mixin put in front of a gated MLP's class (``gate_up_proj`` -> ``*_and_mul`` -> ``down_proj``).

    For few rows ``gate_up_proj`` and the activation run as one GEMV with the gated epilogue
    (``ops.linear.skinny_linear(..., act=)``), then ``down_proj`` as usual (itself a
    :class:`TritonGemvLinear` or not); otherwise, or when ``gate_up_proj`` is no longer a plain
    linear (quantized after the swap), the original forward runs."""

    gemv_act: str = "silu"
    gemv_max_m: int = 16
    gemv_force: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj
        if type(gu) in (nn.Linear, TritonGemvLinear) and _gemv_ok(self, x, gu.weight, self.gemv_act):
            h = _triton().skinny_linear(x, gu.weight, gu.bias, act=self.gemv_act)
            return self.down_proj(h)
        if _quant_act_ok(gu, x):
            return self.down_proj(gu.forward_act(x, self.gemv_act))
        return super().forward(x)


def _quant_act_ok(gu: nn.Module, x: torch.Tensor) -> bool:
    """A weight-only quantized ``gate_up_proj`` (INT or FP8) on CUDA: ``QuantLinear.forward_act``
    runs it with the activation in its GEMV's epilogue where the row count allows, else unfused."""
    from ..quant.linear import QuantLinear

    return isinstance(gu, QuantLinear) and gu.kind in ("int", "fp8") and x.is_cuda


@functools.cache
def _fused_class(cls: type) -> type:
    # One subclass per MLP class, so isinstance checks and the parameters are unchanged.
    return type(f"GemvFused{cls.__name__}", (_GemvFusedMLP, cls), {"__module__": __name__})


def _mlp_activation(mod: nn.Module) -> str | None:
    """The gated activation of a known MLP module (``None``: not one, or not fusable)."""
    from ..ops import gelu_and_mul, silu_and_mul
    from .gemma3 import Gemma3MLP
    from .llama import LlamaMLP
    from .mamba2 import BambaMLP
    from .moe import GatedMLP

    cls = type(mod)
    if cls in (BambaMLP, GatedMLP):
        return "silu"
    if cls is Gemma3MLP:
        return "gelu_tanh" if mod.approximate == "tanh" else "gelu"
    if cls is LlamaMLP:
        act = mod.act
        if act is silu_and_mul:
            return "silu"
        if isinstance(act, functools.partial) and act.func is gelu_and_mul and not act.args:
            approximate = act.keywords.get("approximate", "tanh")
            return {"tanh": "gelu_tanh", "none": "gelu"}.get(approximate)
    return None


def _on_device(mod: nn.Linear, force: bool) -> bool:
    return force or mod.weight.device.type == "cuda"


def _fusable_gate_up(gu: nn.Module | None, force: bool) -> bool:
    """A plain linear on CUDA, or a weight-only quantized one (INT / FP8) on CUDA."""
    from ..quant.linear import QuantLinear

    if isinstance(gu, nn.Linear):
        return _on_device(gu, force)
    if isinstance(gu, QuantLinear) and gu.kind in ("int", "fp8"):
        return force or next(gu.buffers()).device.type == "cuda"
    return False


@torch.no_grad()
def use_triton_gemv_(model: nn.Module, *, max_m: int = 16, fuse_act: bool = True, force: bool = False) -> int:
    """Turn every CUDA ``nn.Linear`` of ``model`` into a :class:`TritonGemvLinear` (in place) that
    uses the GEMV for inputs of at most ``max_m`` rows, and, with ``fuse_act``, every known gated MLP
    (Llama/Mistral/Qwen, Gemma-3, Bamba, Qwen3-Next dense and shared-expert MLPs) into its fused
    subclass (activation in the ``gate_up_proj`` GEMV's epilogue). Returns how many linears were
    converted. Calling it again updates ``max_m`` and may add the MLP fusion; it never undoes it.

    Parameters keep their tensors (no copy, dtype, device or layout change: weight ``[N, K]``,
    bias ``[N]``). At run time a converted linear takes the GEMV for ``x [..., K]`` of the weight's
    dtype (fp32/fp16/bf16) with ``1 <= rows <= max_m`` (leading dims flattened) on CUDA where
    ``ops.linear.triton.beats_cublas`` says so, and ``F.linear`` otherwise.

    A gated MLP whose ``gate_up_proj`` is weight-only quantized (INT4/INT8/FP8 ``QuantLinear``) is
    swapped too: at <= 4 rows on CUDA its GEMV applies the activation in the epilogue
    (``QuantLinear.forward_act``).

    ``force`` converts modules on any device and takes the GEMV whenever the row count allows,
    ignoring the tuning table: for tests under the Triton interpreter and for benchmarks.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``. ValueError: ``max_m`` is not an int >= 0.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"use_triton_gemv_: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(max_m, int) or isinstance(max_m, bool) or max_m < 0:
        raise ValueError(f"use_triton_gemv_: max_m must be an int >= 0, got {max_m!r}")
    n = 0
    for mod in model.modules():
        if type(mod) in (nn.Linear, TritonGemvLinear) and _on_device(mod, force):
            n += type(mod) is nn.Linear
            mod.__class__ = TritonGemvLinear
            mod.gemv_max_m, mod.gemv_force = max_m, force
            mod.__dict__.pop("_gemv_choice", None)
        elif isinstance(mod, _GemvFusedMLP):
            mod.gemv_max_m, mod.gemv_force = max_m, force
            mod.__dict__.pop("_gemv_choice", None)
        elif fuse_act:
            gu = getattr(mod, "gate_up_proj", None)
            act = _mlp_activation(mod)
            if act is not None and _fusable_gate_up(gu, force):
                mod.__class__ = _fused_class(type(mod))
                mod.gemv_act, mod.gemv_max_m, mod.gemv_force = act, max_m, force
    return n
