"""Model definitions: thin compositions of ``infercore.ops`` plus per-layer KV specs.

``build_model(config, dtype=, device=)`` picks the class registered for ``config.model_type`` (or its
HF architecture name); ``load_model(path, dtype=, device=)`` reads a safetensors directory or a GGUF
file through :mod:`infercore.loading` and returns ``(model, tokenizer_or_None, config)``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..devices import check_device
from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .deepseek import DEEPSEEK_ARCHITECTURES, DeepseekConfig, DeepseekForCausalLM
from .falcon_h1 import FalconH1Config, FalconH1ForCausalLM
from .gemma3 import (
    Gemma2ForCausalLM,
    Gemma2ForSequenceClassification,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3TextForSequenceClassification,
)
from .gpt_oss import GptOssConfig, GptOssForCausalLM
from .granite import GraniteForCausalLM
from .granite_hybrid import GRANITE_MOE_ARCHITECTURES, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
from .llama import (
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralForCausalLM,
    MistralForSequenceClassification,
    Phi3ForCausalLM,
    Phi3ForSequenceClassification,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
    RMSNorm,
)
from .mamba2 import BambaForCausalLM, Mamba2Config, Mamba2ForCausalLM
from .moe_llama import (
    MOE_CLASSIFIERS,
    MOE_FAMILIES,
    MoeLlamaForCausalLM,
    MoeLlamaForSequenceClassification,
    MoeModelConfig,
)
from .nemotron_h import NemotronHConfig, NemotronHForCausalLM
from .olmo2 import Olmo2ForCausalLM, Olmo2ForSequenceClassification
from .qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

__all__ = [
    "config_from_hf",
    "SUPPORTED_MODEL_TYPES",
    "BambaForCausalLM",
    "DeepseekConfig",
    "DeepseekForCausalLM",
    "FalconH1Config",
    "FalconH1ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "Gemma2ForSequenceClassification",
    "Gemma3TextForSequenceClassification",
    "GptOssConfig",
    "GptOssForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo2ForSequenceClassification",
    "Phi3ForCausalLM",
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "MistralForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
    "Phi3ForSequenceClassification",
    "Mamba2Config",
    "Mamba2ForCausalLM",
    "MistralForCausalLM",
    "ModelConfig",
    "MoeLlamaForCausalLM",
    "MoeModelConfig",
    "NemotronHConfig",
    "NemotronHForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "build_model",
    "load_model",
    "model_class",
    "register_model",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_BY_MODEL_TYPE: dict[str, type[nn.Module]] = {}
_BY_ARCHITECTURE: dict[str, type[nn.Module]] = {}
_CONFIGS: dict[str, Any] = {}  # HF model_type -> config class with ``from_hf``


def register_model(model_type: str, cls: type[nn.Module], *, architectures: tuple[str, ...] = (),
                   config_class: Any = ModelConfig, hf_model_types: tuple[str, ...] = ()) -> None:
    """Make ``build_model`` construct ``cls(config, dtype=)`` for ``model_type`` / HF ``architectures``."""
    _BY_MODEL_TYPE[model_type] = cls
    for mt in (model_type, *hf_model_types):
        _CONFIGS[mt] = config_class
    for arch in architectures:
        _BY_ARCHITECTURE[arch] = cls


register_model("llama", LlamaForCausalLM, architectures=("LlamaForCausalLM",))
register_model("mistral", MistralForCausalLM, architectures=("MistralForCausalLM",))
register_model("qwen2", Qwen2ForCausalLM, architectures=("Qwen2ForCausalLM",))
register_model("qwen3", Qwen3ForCausalLM, architectures=("Qwen3ForCausalLM",))
register_model("phi3", Phi3ForCausalLM, architectures=("Phi3ForCausalLM",))
register_model("granite", GraniteForCausalLM, architectures=("GraniteForCausalLM",))
register_model("olmo2", Olmo2ForCausalLM, architectures=("Olmo2ForCausalLM",))
for _cls in (LlamaForSequenceClassification, MistralForSequenceClassification, Qwen2ForSequenceClassification,
             Qwen3ForSequenceClassification, Phi3ForSequenceClassification, Olmo2ForSequenceClassification):
    _BY_ARCHITECTURE[_cls.__name__] = _cls
register_model("gemma3_text", Gemma3ForCausalLM, architectures=("Gemma3ForCausalLM",), config_class=Gemma3Config,
               hf_model_types=("gemma3",))
register_model("gemma2", Gemma2ForCausalLM, architectures=("Gemma2ForCausalLM",), config_class=Gemma3Config)
for _cls in (Gemma2ForSequenceClassification, Gemma3TextForSequenceClassification):
    _BY_ARCHITECTURE[_cls.__name__] = _cls
register_model("qwen3_next", Qwen3NextForCausalLM, architectures=("Qwen3NextForCausalLM",),
               config_class=Qwen3NextConfig)
for _mt, (_, _arch) in MOE_FAMILIES.items():
    register_model(_mt, MoeLlamaForCausalLM, architectures=(_arch,), config_class=MoeModelConfig)
    _BY_ARCHITECTURE[MOE_CLASSIFIERS[_mt]] = MoeLlamaForSequenceClassification
register_model("mamba2", Mamba2ForCausalLM, architectures=("Mamba2ForCausalLM",), config_class=Mamba2Config)
register_model("bamba", BambaForCausalLM, architectures=("BambaForCausalLM",), config_class=Mamba2Config)
for _mt, _arch in GRANITE_MOE_ARCHITECTURES.items():
    register_model(_mt, GraniteMoeHybridForCausalLM, architectures=(_arch,), config_class=GraniteMoeHybridConfig)
register_model("nemotron_h", NemotronHForCausalLM, architectures=("NemotronHForCausalLM",),
               config_class=NemotronHConfig)
register_model("falcon_h1", FalconH1ForCausalLM, architectures=("FalconH1ForCausalLM",), config_class=FalconH1Config)
for _mt, _arch in DEEPSEEK_ARCHITECTURES.items():
    register_model(_mt, DeepseekForCausalLM, architectures=(_arch,), config_class=DeepseekConfig)
register_model("gpt_oss", GptOssForCausalLM, architectures=("GptOssForCausalLM",), config_class=GptOssConfig)


def config_from_hf(hf: dict) -> Any:
    """The family config for an HF ``config.json`` dict, chosen by its ``model_type``."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"config: expected an HF config.json dict, got {type(hf).__name__}")
    mt = hf.get("model_type")
    if mt not in _CONFIGS:
        raise ValueError(f"config: model_type {mt!r} is not supported; supported: {sorted(_CONFIGS)}")
    return _CONFIGS[mt].from_hf(hf)


def model_class(config: Any) -> type[nn.Module]:
    """The registered class for ``config`` (by HF architecture name first, then model_type)."""
    cls = _BY_ARCHITECTURE.get(getattr(config, "architecture", None))
    if cls is None:
        cls = _BY_MODEL_TYPE.get(getattr(config, "model_type", None))
    if cls is None:
        raise ValueError(
            f"config: no model registered for model_type={getattr(config, 'model_type', None)!r} / "
            f"architecture={getattr(config, 'architecture', None)!r}; registered model types: "
            f"{sorted(_BY_MODEL_TYPE)}"
        )
    return cls


def _check_dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of torch.float32/float16/bfloat16, got {dtype!r}")
    return dtype


# torch.nn.init's fills, as the constructors of nn.Linear / nn.Embedding call them (reset_parameters)
_INIT_FILLS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
               "xavier_normal_", "constant_", "zeros_", "ones_")


@contextlib.contextmanager
def _skip_module_init():
    """The default initialisation of torch modules, skipped while a model is built on the meta device: it writes
    nothing there, and a meta ``normal_`` (nn.Embedding's) runs through torch's Python references, whose first use
    imports torch._dynamo: 2.7 of the 6.2 s a one-shot ``infercore generate`` took on the 2-vCPU Xeon."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FILLS}
    try:
        for name in _INIT_FILLS:
            setattr(torch.nn.init, name, _unchanged)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def _materialize(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)`` by plain factory calls: ``to_empty``'s ``empty_like`` of a meta tensor runs
    through torch's Python references, whose first use imports sympy (~0.7 s)."""
    done: dict[int, torch.Tensor] = {}  # a tensor shared by several modules (tied weights) stays shared
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in done:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    done[id(t)] = new
                table[name] = done[id(t)]


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    init: str = "normal",
) -> nn.Module:
    """Construct the model for ``config`` directly on ``device`` in ``dtype``, in eval mode.

    Args:
        config: a :class:`ModelConfig` (or another family's config whose class was registered).
        dtype: parameter dtype, one of fp32/fp16/bf16 (``TypeError`` otherwise).
        device: where parameters, buffers and the RoPE table live.
        init: ``"normal"`` fills linear/embedding weights with N(0, 0.02) (norm weights 1, biases 0),
            fine for speed measurements; ``"empty"`` leaves them uninitialised for a following
            ``load_weights`` (which checks that every tensor is provided).
    """
    dtype = _check_dtype(dtype)
    if init not in ("normal", "empty"):
        raise ValueError(f"init must be 'normal' or 'empty', got {init!r}")
    device = check_device(device)
    cls = model_class(config)
    # Build on the meta device so no memory is touched twice and no default init runs, then
    # materialise on the target device.
    with torch.device("meta"), _skip_module_init():
        model = cls(config, dtype=dtype)
    _materialize(model, device)
    model.finish_init()
    if init == "normal":
        with torch.no_grad():
            offsets = {f"{n}.weight": m.offset for n, m in model.named_modules() if isinstance(m, RMSNorm)}
            for name, p in model.named_parameters():
                if name in offsets:
                    p.fill_(1.0 - offsets[name])  # an identity norm, also for the ``1 + w`` form
                elif name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)
    return model.eval().requires_grad_(False)


def load_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[nn.Module, Any, ModelConfig]:
    """Load an HF safetensors directory or a ``.gguf`` file. A GPTQ / AWQ / NVFP4 / FP8 directory
    (``quantization_config`` in its ``config.json``, or ModelOpt's ``hf_quant_config.json``) loads with its quantized
    linears as ``QuantLinear`` s (:mod:`infercore.loading.prequantized`, :mod:`infercore.loading.prequantized_fp4`,
    :mod:`infercore.loading.prequantized_fp8`).

    Returns ``(model, tokenizer or None, config)``; the model is in eval mode with every weight from
    the checkpoint (``ValueError`` naming the tensor if one is missing, unexpected or misshapen).
    """
    from ..loading import load_checkpoint
    from ..loading.prequantized import load_prequantized, prequantized_config

    dtype = _check_dtype(dtype)
    # Checked before reading anything; a meta model would drop every weight it is given.
    if check_device(device).type == "meta":
        raise ValueError("device: 'meta' holds no data, so loaded weights would be lost; use cpu or cuda")
    from ..loading.prequantized_fp4 import read_hf_quant_config

    ckpt = load_checkpoint(path)
    config = config_from_hf(ckpt.config)
    q = prequantized_config(ckpt.config, read_hf_quant_config(ckpt.path) if ckpt.format == "safetensors" else None)
    # GPTQ / AWQ / NVFP4 / FP8: the quantized linears are built from their packed tensors, never densely
    if q is not None:
        return load_prequantized(ckpt, config, q, dtype=dtype, device=check_device(device)), ckpt.tokenizer(), config
    model = build_model(config, dtype=dtype, device=device, init="empty")
    model.load_weights(ckpt.weights(dtype))
    return model, ckpt.tokenizer(), config
