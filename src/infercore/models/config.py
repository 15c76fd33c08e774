"""Model configuration: one flat dataclass read from a Hugging Face ``config.json`` dict.

Only the dense Llama family is described here (``llama`` — which includes SmolLM2 —,
``mistral``, ``qwen2``, ``qwen3``, ``phi3``, ``granite``, ``olmo2``). The per-family quirks that HF encodes in
code rather than in the config file (Qwen2's always-on q/k/v bias, Mistral's and Phi-3's window on every layer,
Qwen2/3's ``use_sliding_window`` + ``max_window_layers``, Phi-3's ``original_max_position_embeddings`` default
and legacy ``su`` RoPE type, Granite's multipliers, OLMo 2's norm placement) are resolved once in
:meth:`ModelConfig.from_hf`, so the model code only reads plain per-layer facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# HF defaults for keys a minimal config dict (e.g. one synthesised from GGUF metadata) may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
    # Phi3Config's original_max_position_embeddings is a field of its own (4096), which HF's RoPE setup prefers
    # over the rope dict's.
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
             "bos_token_id": 1, "eos_token_id": 32000},
    "granite": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
                "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                "logits_scaling": 1.0},
    "olmo2": {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "eos_token_id": 50279},
}

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}
# Bare decoders (embedding models such as Qwen3-Embedding, e5-mistral, gte-Qwen2): the causal LM without its head.
# They load as the causal LM with the output head tied to the embedding matrix (their weights have no other), so
# Engine.embed serves them; text generated from one is not meaningful.
_BASE_ARCHITECTURES = {
    "llama": "LlamaModel",
    "mistral": "MistralModel",
    "qwen2": "Qwen2Model",
    "qwen3": "Qwen3Model",
    "phi3": "Phi3Model",
    "granite": "GraniteModel",
    "olmo2": "Olmo2Model",
}
# Sequence classifiers (reward models, classifiers fine-tuned from a decoder): the bare decoder plus ``score.weight``
# [num_labels, hidden] (no bias) read at the last token. They load like a bare decoder (the output head tied to the
# embedding matrix) with the score head beside it; Engine.classify serves them and Engine.generate refuses them.
_CLASSIFIER_ARCHITECTURES = {
    "llama": "LlamaForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "phi3": "Phi3ForSequenceClassification",
    "olmo2": "Olmo2ForSequenceClassification",
}


@dataclass
class ModelConfig:
    """Everything a dense decoder needs, with HF quirks already resolved.

    ``layer_types[i]`` is ``"full_attention"`` or ``"sliding_attention"``; a sliding layer sees the
    last ``sliding_window`` keys including its own token (HF semantics). ``rope_scaling`` is the HF
    ``rope_scaling``/``rope_parameters`` dict without ``rope_theta`` (``None`` for plain RoPE).
    ``attention_bias`` is the q/k/v projection bias; ``o_bias`` and ``mlp_bias`` are separate because
    Qwen2 has the first without the second.

    ``rope_scaling`` ``longrope`` (Phi-3 128k): one RoPE table serves every position, so the model takes the
    factor set transformers picks for a sequence of ``max_position_embeddings`` tokens (``long_factor`` when that
    exceeds ``original_max_position_embeddings``, as vLLM does for its ``max_model_len``). transformers picks by
    the current length instead and recomputes the whole cache when a sequence crosses the original length, which
    a paged engine does not do; lower ``max_position_embeddings`` to the original length (then call
    ``model.finish_init()``) for the short factors and transformers' results on sequences up to that length.

    Granite: ``embedding_multiplier`` scales the embeddings, ``residual_multiplier`` each sublayer's output before
    its residual add, ``attention_multiplier`` is the softmax scale (None: ``head_dim ** -0.5``) and the logits
    are divided by ``logits_scaling``. OLMo 2 (``post_norm``): no norm before a sublayer, an RMSNorm on its output
    before the residual add; ``qk_proj_norm``: RMSNorms over the whole q and k projections (all heads at once),
    where Qwen3's ``qk_norm`` normalises each head.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_proj_norm: bool = False
    post_norm: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    architecture: str = "LlamaForCausalLM"
    # A sequence classifier's labels (``id2label`` by id, ``num_labels`` of them); empty for a causal LM.
    labels: tuple[str, ...] = ()

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.labels))

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_layers
        self.validate()

    # ------------------------------------------------------------------ derived facts
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer ``layer`` (``None`` = full causal attention)."""
        if self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                f"ModelConfig.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}"
            )
        if self.rotary_dim % 2 != 0:
            raise ValueError(
                f"ModelConfig.partial_rotary_factor={self.partial_rotary_factor} gives an odd rotary_dim "
                f"{self.rotary_dim} for head_dim={self.head_dim}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.hidden_act={self.hidden_act!r} is not supported; expected one of "
                f"{SUPPORTED_ACTIVATIONS}"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"ModelConfig.layer_types has {len(self.layer_types)} entries, expected num_layers="
                f"{self.num_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ValueError(f"ModelConfig.layer_types[{i}]={kind!r} is not full/sliding attention")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}"
            )
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ValueError("ModelConfig.sliding_window is None but layer_types has sliding layers")
        for name in ("qk_norm", "qk_proj_norm", "post_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.qk_norm and self.qk_proj_norm:
            raise ValueError("ModelConfig.qk_norm (per head) and qk_proj_norm (whole projection) exclude each other")
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is None and name == "attention_multiplier":
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")

    # ------------------------------------------------------------------ HF parsing
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build from an HF ``config.json`` dict (transformers 4.x or 5.x key layout).

        Raises ``ValueError`` for an unsupported ``model_type`` (listing the supported ones), a
        missing required key, or inconsistent sizes (naming the field).
        """
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        defaults = _DEFAULTS[model_type]

        def get(key: str, default: Any = None) -> Any:
            value = hf.get(key)
            return defaults.get(key, default) if value is None else value

        def require(key: str) -> Any:
            value = hf.get(key)
            if value is None:
                raise ValueError(f"HF config for model_type={model_type!r} is missing {key!r}")
            return value

        # Type-check raw values before any arithmetic on them, so the error names the config key
        # (not a ZeroDivisionError or a str % int) and nothing is silently coerced.
        def check(key: str, value: Any, kind: type | tuple[type, ...], what: str, ok=lambda v: True) -> Any:
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool) or not ok(value)):
                raise ValueError(f"HF config key {key!r} must be {what}, got {value!r}")
            return value

        def positive_int(key: str, value: Any) -> Any:
            return check(key, value, int, "a positive int", lambda v: v > 0)

        def number(key: str) -> float:
            value = get(key)
            return float(check(key, value, (int, float), "a positive number", lambda v: v > 0))

        def flag(key: str, default: bool = False) -> bool:
            value = get(key, default)
            if not isinstance(value, bool):
                raise ValueError(f"HF config key {key!r} must be true or false, got {value!r}")
            return value

        archs = hf.get("architectures") or [_ARCHITECTURES[model_type]]
        first = archs[0] if isinstance(archs, list) and archs else None
        bare = first == _BASE_ARCHITECTURES.get(model_type)
        classifier_arch = _CLASSIFIER_ARCHITECTURES.get(model_type)  # (transformers has none for Granite)
        classifier = classifier_arch is not None and first == classifier_arch
        if bare:
            archs = [_ARCHITECTURES[model_type]]
        accepted = (*_ARCHITECTURES.values(), *([classifier_arch] if classifier_arch else []))
        if not isinstance(archs, list) or not archs or archs[0] not in accepted:
            # Another head (token classification, a VLM, another family's) has other weights
            # and outputs: refuse it here rather than build a causal LM from it.
            raise ValueError(
                f"HF config architectures={archs!r} is not supported for model_type={model_type!r}; "
                f"expected one of {sorted(_ARCHITECTURES.values())} (or the bare {_BASE_ARCHITECTURES[model_type]}"
                + (f", or {classifier_arch})" if classifier_arch else ")")
            )
        labels = _parse_labels(hf) if classifier else ()

        hidden = positive_int("hidden_size", require("hidden_size"))
        num_heads = positive_int("num_attention_heads", require("num_attention_heads"))
        num_layers = positive_int("num_hidden_layers", require("num_hidden_layers"))
        num_kv_heads = positive_int("num_key_value_heads", get("num_key_value_heads", num_heads))
        head_dim = positive_int("head_dim", get("head_dim"))
        for key in ("vocab_size", "intermediate_size", "max_position_embeddings"):
            positive_int(key, get(key))
        for key in ("rope_parameters", "rope_scaling"):
            check(key, hf.get(key), dict, "an object (or null)")
        check("max_window_layers", hf.get("max_window_layers"), int, "an int >= 0", lambda v: v >= 0)
        check("bos_token_id", get("bos_token_id"), int, "a token id", lambda v: v >= 0)
        if head_dim is None:
            # Only a derived head_dim needs hidden % heads == 0 (Qwen3 sets head_dim * heads != hidden).
            if hidden % num_heads != 0:
                raise ValueError(
                    f"hidden_size={hidden} is not divisible by num_attention_heads={num_heads} "
                    "(and head_dim is not given)"
                )
            head_dim = hidden // num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_key_value_heads={num_kv_heads} must divide num_attention_heads={num_heads}"
            )

        rope_theta, rope_scaling, partial = _parse_rope(
            hf, model_type, get("max_position_embeddings"), positive_int(
                "original_max_position_embeddings", get("original_max_position_embeddings")))
        if model_type == "olmo2":
            partial = 1.0  # OLMo 2's modeling code rotates the whole head whatever the config says
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            half = int(head_dim * partial) // 2  # one divisor per rotated frequency
            for key in ("short_factor", "long_factor"):
                if len(rope_scaling[key]) != half:
                    raise ValueError(f"HF config rope_scaling key {key!r} has {len(rope_scaling[key])} entries, "
                                     f"expected rotary_dim // 2 = {half}")
        sliding_window, layer_types = _parse_sliding(hf, model_type, num_layers, get)

        granite = {}
        if model_type == "granite":
            granite = {key: number(key) for key in ("embedding_multiplier", "residual_multiplier",
                                                    "attention_multiplier", "logits_scaling")}

        eos = get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)
        for e in eos_ids:
            check("eos_token_id", e, int, "a token id or a list of token ids", lambda v: v >= 0)

        return cls(
            vocab_size=require("vocab_size"),
            hidden_size=hidden,
            intermediate_size=require("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=True if bare or classifier else flag("tie_word_embeddings"),
            # Qwen2 hard-codes q/k/v bias (and no o_proj bias) in its modeling code, Phi-3 no bias at all.
            attention_bias=True if model_type == "qwen2" else False if model_type == "phi3" else flag("attention_bias"),
            o_bias=False if model_type in ("qwen2", "mistral", "phi3") else flag("attention_bias"),
            mlp_bias=flag("mlp_bias") if model_type in ("llama", "granite") else False,
            qk_norm=model_type == "qwen3",
            qk_proj_norm=model_type == "olmo2",
            post_norm=model_type == "olmo2",
            **granite,
            sliding_window=sliding_window,
            layer_types=layer_types,
            hidden_act=get("hidden_act", "silu"),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
            architecture=archs[0],
            labels=labels,
        )


def _parse_labels(hf: Mapping[str, Any]) -> tuple[str, ...]:
    """A classifier's label names by id from ``id2label`` (JSON keys are strings), else ``num_labels`` of HF's
    default ``LABEL_i`` names (HF's default num_labels is 2)."""
    id2label = hf.get("id2label")
    if id2label:
        if not isinstance(id2label, Mapping):
            raise ValueError(f"HF config key 'id2label' must be an object, got {id2label!r}")
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ValueError(f"HF config key 'id2label' must map label ids to names, got {id2label!r}") from None
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"HF config key 'id2label' must name ids 0 .. n-1, got ids {sorted(by_id)}")
        return tuple(by_id[i] for i in range(len(by_id)))
    n = hf.get("num_labels", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"HF config key 'num_labels' must be a positive int, got {n!r}")
    return tuple(f"LABEL_{i}" for i in range(n))


def _parse_rope(hf: Mapping[str, Any], model_type: str, max_positions: int, original_max: int | None
                ) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from either key layout.

    transformers 5 writes ``rope_parameters`` (with ``rope_theta`` inside); 4.x writes ``rope_theta``
    and ``rope_scaling`` (legacy ``type`` instead of ``rope_type``) at the top level. ``original_max``: the
    top-level ``original_max_position_embeddings`` (or the family's default), which HF prefers to the rope dict's.
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = hf.get("rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = hf.get("partial_rotary_factor", 1.0)
    for key, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"HF config key {key!r} must be a number, got {value!r}")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config renames the types early Phi-3 checkpoints wrote
    if rope_type == "default":
        return float(theta), None, float(partial)
    scaling = {"rope_type": rope_type, **params}
    if rope_type in ("llama3", "yarn", "longrope"):
        # HF falls back to the model's max_position_embeddings for the pretraining length.
        if original_max is not None:
            scaling["original_max_position_embeddings"] = original_max
        scaling.setdefault("original_max_position_embeddings", max_positions)
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            f = scaling.get(key)
            if not isinstance(f, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in f):
                raise ValueError(f"HF config rope_scaling key {key!r} must be a list of numbers for rope_type "
                                 f"'longrope', got {f!r}")
        original = scaling["original_max_position_embeddings"]
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ValueError(f"HF config key 'original_max_position_embeddings' must be a positive int, got "
                             f"{original!r}")
        if scaling.get("factor") is None:  # HF's default: the context extension itself
            scaling["factor"] = max_positions / original
    return float(theta), scaling, float(partial)


def _parse_sliding(
    hf: Mapping[str, Any], model_type: str, num_layers: int, get
) -> tuple[int | None, list[str]]:
    """(sliding_window, layer_types) following each family's HF modeling code."""
    if model_type in ("llama", "granite", "olmo2"):
        return None, [FULL_ATTENTION] * num_layers
    # An explicit null means "no window" (Mistral v0.2+), so only a missing key takes the default.
    window = hf["sliding_window"] if "sliding_window" in hf else get("sliding_window")
    if model_type in ("mistral", "phi3"):
        # MistralModel / Phi3Model build one sliding mask for every layer when sliding_window is set.
        kind = SLIDING_ATTENTION if window is not None else FULL_ATTENTION
        return window, [kind] * num_layers
    # qwen2 / qwen3: the window only exists with use_sliding_window; layers >= max_window_layers slide
    # unless layer_types is given explicitly.
    if not hf.get("use_sliding_window", False) or window is None:
        return None, [FULL_ATTENTION] * num_layers
    layer_types = hf.get("layer_types")
    if layer_types is None:
        max_window_layers = get("max_window_layers", 28)
        layer_types = [
            SLIDING_ATTENTION if i >= max_window_layers else FULL_ATTENTION for i in range(num_layers)
        ]
    return window, list(layer_types)
