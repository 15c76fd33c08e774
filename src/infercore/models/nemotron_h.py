"""NVIDIA Nemotron-H (HF ``NemotronHForCausalLM``): Mamba2 mixers, attention, MLP-only and MoE
layers in one stack.

Each layer is ``x += mixer(rms_norm(x))`` with one of four mixers, from ``hybrid_override_pattern`` (``M`` / ``*`` /
``-`` / ``E``) or transformers' ``layers_block_type`` (``linear_attention`` / ``full_attention`` / ``mlp`` / ``moe``):

* ``M``: the Mamba2 mixer (:class:`~infercore.models.mamba2.Mamba2Mixer`, HF Bamba's math) with
  ``mamba_num_heads * mamba_head_dim`` inner channels (not necessarily ``expand * hidden_size``);
* ``*``: GQA attention without positional encoding (no RoPE), softmax scale ``head_dim ** -0.5``;
* ``-``: an ungated MLP ``down_proj(relu(up_proj(x)) ** 2)``;
* ``E`` (``moe``, Nemotron 3): routed squared-ReLU experts under DeepSeek-V3's router (sigmoid scores, the
  ``e_score_correction_bias`` for the choice only, ``n_group`` / ``topk_group`` groups ranked by their two best,
  renormalised, times ``routed_scaling_factor``), optionally in a latent space (``fc1_latent_proj`` in,
  ``fc2_latent_proj`` out, ``moe_latent_size``), plus a shared squared-ReLU MLP on every token.

Then ``norm_f`` and ``lm_head``. Mixer layers hold conv / SSM state slots in the hybrid KV pool, attention layers paged
KV; MLP and MoE layers hold nothing and declare no KV spec (the specs, ``kv_caches`` and the metadata's entries are
those of the mixer and attention layers in order: see :meth:`NemotronHForCausalLM.kv_specs`). The routed experts run
through ``moe_experts_routed`` with its ungated squared-ReLU activation (``activation="relu2"``: on CUDA the Triton
kernels, no host wait; the reference loop on the CPU). Tensor names are HF's (``backbone.*``, one tensor per expert;
transformers' renamed ``model.*`` and stacked experts also load), q/k/v merged into ``qkv_proj``.
``tensor_parallel_`` shards each block by its kind: Mamba2 mixers and attention by heads, MLPs and the shared MLP by
width, the experts by width or whole (``experts="ep"``: ``NemotronHExperts.expert_offset``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..kv.hybrid import FullAttentionSpec, LinearStateSpec
from ..ops import fused_add_rms_norm, paged_attention, rms_norm, write_kv_cache_
from .deepseek import DeepseekRouter
from .hybrid import HFConfigReader, HybridMetadata, check_step, layer_metadata, linear_metadata, load_hf_weights
from .mamba2 import BambaAttention, Mamba2ForCausalLM, Mamba2Mixer, _Weight
from .moe import moe_experts

__all__ = ["NemotronHConfig", "NemotronHForCausalLM"]

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": "moe"}


@dataclass
class NemotronHConfig:
    """Nemotron-H sizes. ``layer_types[i]`` is ``"linear_attention"`` (Mamba2 mixer), ``"full_attention"`` or
    ``"mlp"`` or ``"moe"`` (``num_experts`` routed experts of width ``moe_intermediate_size``, ``top_k`` per token,
    over ``moe_latent_size`` channels when non-zero, plus a shared MLP of ``moe_shared_intermediate_size``). The Mamba2
    fields are named as :class:`~infercore.models.mamba2.Mamba2Config`'s (the mixer reads
    them)."""

    vocab_size: int
    hidden_size: int
    layer_types: list[str]
    mamba_heads: int
    mamba_head_dim: int
    state_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    top_k: int = 1
    moe_intermediate_size: int = 0
    moe_shared_intermediate_size: int = 0
    moe_latent_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    model_type: str = "nemotron_h"
    architecture: str = "NemotronHForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "mamba_heads", "mamba_head_dim", "state_size", "num_heads",
                     "num_kv_heads", "head_dim", "intermediate_size", "n_groups", "conv_kernel"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"NemotronHConfig.{name} must be a positive int, got {v!r}")
        if not self.layer_types or set(self.layer_types) - {MAMBA, ATTENTION, MLP, MOE}:
            raise ValueError(f"NemotronHConfig.layer_types must be a non-empty list of {MAMBA!r} / {ATTENTION!r} / "
                             f"{MLP!r} / {MOE!r}, got {self.layer_types!r}")  # fmt: skip
        if MOE in self.layer_types:
            self._check_moe()
        if self.mamba_heads % self.n_groups:
            raise ValueError(f"NemotronHConfig.n_groups={self.n_groups} must divide mamba_heads={self.mamba_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"NemotronHConfig.num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")  # fmt: skip
        if not self.norm_eps > 0:
            raise ValueError(f"NemotronHConfig.norm_eps must be > 0, got {self.norm_eps!r}")

    def _check_moe(self) -> None:
        for name in ("num_experts", "top_k", "moe_intermediate_size", "moe_shared_intermediate_size", "n_group",
                     "topk_group"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"NemotronHConfig.{name} must be a positive int for MoE layers, got {v!r}")
        E, G = self.num_experts, self.n_group
        if self.top_k > E:
            raise ValueError(f"NemotronHConfig.top_k={self.top_k} must be <= num_experts={E}")
        if E % G or E // G < 2 or self.topk_group > G:
            raise ValueError(f"NemotronHConfig.n_group={G} must divide num_experts={E} into groups of >= 2 experts, "
                             f"and topk_group={self.topk_group} be <= n_group")  # fmt: skip
        v = self.moe_latent_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"NemotronHConfig.moe_latent_size must be an int >= 0, got {v!r}")
        v = self.routed_scaling_factor
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"NemotronHConfig.routed_scaling_factor must be a positive number, got {v!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def intermediate_mamba(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> NemotronHConfig:
        """From an HF ``nemotron_h`` config dict: ``layers_block_type`` (transformers 5) or
        ``hybrid_override_pattern`` (the checkpoints' own), the ``mamba_*`` aliases HF accepts included."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        mt = hf.get("model_type")
        if mt != "nemotron_h":
            raise ValueError(f"model_type must be 'nemotron_h', got {mt!r}")
        r = HFConfigReader(hf, mt)
        eos_ids, _ = r.token_ids()
        types = r.str_list("layers_block_type") or r.str_list("layer_types")
        if types is None:
            pattern = r.get("hybrid_override_pattern")
            r.check("hybrid_override_pattern", pattern, str, "a string of 'M' / '*' / '-'",
                    lambda v: v and set(v) <= set(_PATTERN))  # fmt: skip
            types = [_PATTERN[c] for c in pattern]
            n = r.get("num_hidden_layers", len(types))
            r.check("num_hidden_layers", n, int, f"the length of hybrid_override_pattern ({len(types)})",
                    lambda v: v == len(types))  # fmt: skip
        types = [{"mamba": MAMBA, "attention": ATTENTION}.get(t, t) for t in types]
        if not types or set(types) - {MAMBA, ATTENTION, MLP, MOE}:
            raise ValueError(f"HF {mt} config key 'layers_block_type' must list 'linear_attention' / "
                             f"'full_attention' / 'mlp' / 'moe' layers, got {types!r}")  # fmt: skip
        moe = {}
        if MOE in types:
            latent = r.check("moe_latent_size", r.hf.get("moe_latent_size"), int, "a positive int or null",
                             lambda v: v > 0) or 0  # fmt: skip
            moe = dict(
                num_experts=r.positive_int("n_routed_experts", 8), top_k=r.positive_int("num_experts_per_tok", 2),
                moe_intermediate_size=r.positive_int("moe_intermediate_size", 7688),
                moe_shared_intermediate_size=r.positive_int("moe_shared_expert_intermediate_size", 7688),
                moe_latent_size=latent, n_group=r.positive_int("n_group", 1),
                topk_group=r.positive_int("topk_group", 1), norm_topk_prob=r.flag("norm_topk_prob", True),
                routed_scaling_factor=float(r.number("routed_scaling_factor", 1.0)),
            )  # fmt: skip
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            r.check(key, r.get(key, want), str, repr(want), lambda v, w=want: v == w)
        r.check("sliding_window", r.hf.get("sliding_window"), int, "null (attention over every key)",
                lambda v: False)  # fmt: skip
        if r.hf.get("rope_parameters") or r.hf.get("rope_scaling"):
            raise ValueError(f"HF {mt} config key 'rope_parameters': Nemotron-H attention has no RoPE")

        def alias(key: str, old: str, default: Any) -> Any:  # HF's constructor takes the older mamba_* names too
            return r.get(key, r.get(old, default)) if key in hf or old in hf else default

        limit = alias("time_step_limit", "mamba_dt_limit", (0.0, math.inf))
        r.check("time_step_limit", limit, list | tuple, "a [min, max] pair of numbers with 0 <= min <= max",
                lambda v: len(v) == 2 and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
                and 0 <= v[0] <= v[1])  # fmt: skip
        n_groups = r.check("n_groups", alias("n_groups", "mamba_n_groups", 8), int, "a positive int", lambda v: v > 0)
        kernel = r.check("conv_kernel", alias("conv_kernel", "mamba_d_conv", 4), int, "a positive int",
                         lambda v: v > 0)  # fmt: skip
        conv_bias = r.check("use_conv_bias", alias("use_conv_bias", "mamba_conv_bias", True), bool, "true or false")
        heads = r.positive_int("num_attention_heads", 32)
        return cls(
            vocab_size=r.positive_int("vocab_size", 131072), hidden_size=r.positive_int("hidden_size", 4096),
            layer_types=types, mamba_heads=r.positive_int("mamba_num_heads", 128),
            mamba_head_dim=r.positive_int("mamba_head_dim", 64), state_size=r.positive_int("ssm_state_size", 128),
            num_heads=heads, num_kv_heads=r.positive_int("num_key_value_heads", heads),
            head_dim=r.positive_int("head_dim", 128), intermediate_size=r.positive_int("intermediate_size", 21504),
            n_groups=n_groups, conv_kernel=kernel, use_bias=r.flag("use_bias", False), use_conv_bias=conv_bias,
            time_step_limit=(float(limit[0]), float(limit[1])), norm_eps=r.number("layer_norm_epsilon", 1e-5),
            attention_bias=r.flag("attention_bias", False), mlp_bias=r.flag("mlp_bias", False),
            # HF's NemotronHForCausalLM ties nothing (no _tied_weights_keys), whatever tie_word_embeddings says
            max_position_embeddings=r.positive_int("max_position_embeddings", 4096), eos_token_ids=eos_ids, **moe,
        )  # fmt: skip


class NemotronHAttention(BambaAttention):
    """Bamba's GQA over paged KV (HF names ``q/k/v_proj`` merged into ``qkv_proj``) without positional encoding."""

    def forward(self, x: torch.Tensor, kv_cache, meta) -> torch.Tensor:  # type: ignore[override]
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, D).contiguous()
        k, v = k.reshape(T, self.num_kv_heads, D).contiguous(), v.reshape(T, self.num_kv_heads, D)
        write_kv_cache_(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, scale=D**-0.5)
        return self.o_proj(o.reshape(T, self.q_size))


class NemotronHMLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)`` (squared ReLU, no gate)."""

    def __init__(self, cfg: NemotronHConfig, *, intermediate: int | None = None,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        width = intermediate or cfg.intermediate_size
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHExperts(nn.Module):
    """Stacked squared-ReLU experts: ``up_proj [E, I, L]``, ``down_proj [E, L, I]`` (transformers 5's names)."""

    def __init__(self, num_experts: int, width: int, intermediate: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, width, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, intermediate, dtype=dtype))
        self.expert_offset: int | None = None  # expert parallelism: these are experts [offset, offset + E)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``; ``x [T, L]``, ``weights`` fp32 / ``ids [T, k]``, through
        the routed experts op with the ungated squared ReLU (:func:`~infercore.models.moe.moe_experts`: the reference
        loop on the CPU; on CUDA the Triton kernels over the pairs sorted on the device, only the chosen experts
        read and no host wait, so decode steps capture into CUDA graphs)."""
        return moe_experts(x, self.up_proj, self.down_proj, weights, ids, self.expert_offset, activation="relu2")


class NemotronHMoE(nn.Module):
    """Routed experts (DeepSeek-V3 routing, optionally in a latent space) plus the shared MLP."""

    def __init__(self, cfg: NemotronHConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # DeepseekRouter reads these names: sigmoid scores with the correction bias, groups by their two best
        self.gate = DeepseekRouter(SimpleNamespace(
            num_experts=cfg.num_experts, hidden_size=cfg.hidden_size, scoring_func="sigmoid",
            num_experts_per_tok=cfg.top_k, topk_method="noaux_tc", n_group=cfg.n_group, topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor))  # fmt: skip
        L = cfg.moe_latent_size or cfg.hidden_size
        self.experts = NemotronHExperts(cfg.num_experts, L, cfg.moe_intermediate_size, dtype=dtype)
        self.shared_experts = NemotronHMLP(cfg, intermediate=cfg.moe_shared_intermediate_size, dtype=dtype)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if cfg.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, L, bias=cfg.mlp_bias, dtype=dtype)
            self.fc2_latent_proj = nn.Linear(L, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        h = self.experts(h, weights, ids)
        h = h if self.fc2_latent_proj is None else self.fc2_latent_proj(h)
        return h + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    _MIXERS = {MAMBA: Mamba2Mixer, ATTENTION: NemotronHAttention, MLP: NemotronHMLP, MOE: NemotronHMoE}

    def __init__(self, cfg: NemotronHConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.kind = cfg.layer_types[layer]
        self.norm = _Weight(cfg.hidden_size, dtype=dtype)
        self.mixer = self._MIXERS[self.kind](cfg, dtype=dtype)


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, dtype=dtype) for i in range(cfg.num_layers))
        self.norm_f = _Weight(cfg.hidden_size, dtype=dtype)


class NemotronHForCausalLM(Mamba2ForCausalLM):
    """Nemotron-H causal LM (HF names ``backbone.*``, ``lm_head``) over the hybrid KV pool.

    Only mixer and attention layers hold a cache: ``kv_caches[j]`` (and the :class:`HybridMetadata` entry ``j``) is
    that of the ``j``-th of them, ``(conv_state, ssm_state)`` for a mixer, ``(k_cache, v_cache)`` for attention;
    ``cache_index[i]`` maps layer ``i`` to its ``j`` (None for MLP / MoE layers).
    """

    supports_hybrid_kv = True

    def __init__(self, config: NemotronHConfig, *, dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, NemotronHConfig):
            raise TypeError(f"config must be a NemotronHConfig, got {type(config).__name__}")
        self.config = config
        self.backbone = NemotronHBackbone(config, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        cached = [i for i, t in enumerate(config.layer_types) if t in (MAMBA, ATTENTION)]
        self.cache_index = [cached.index(i) if i in cached else None for i in range(config.num_layers)]
        self.num_caches = len(cached)
        self.finish_init()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: HybridMetadata
    ) -> torch.Tensor:
        """One ragged step. Returns ``[T, hidden]`` (final-normed, model dtype)."""
        layers, eps = self.backbone.layers, self.config.norm_eps
        check_step(input_ids, positions, kv_caches, self.num_caches)
        x = self.backbone.embeddings(input_ids)
        residual = None
        for block, j in zip(layers, self.cache_index):
            if residual is None:
                residual, x = x, rms_norm(x, block.norm.weight, eps=eps)
            else:
                x, residual = fused_add_rms_norm(x, residual, block.norm.weight, eps=eps)
            if block.kind == MAMBA:
                x = block.mixer(x, kv_caches[j], linear_metadata(meta, j))
            elif block.kind == ATTENTION:
                x = block.mixer(x, kv_caches[j], layer_metadata(meta, j))
            else:
                x = block.mixer(x)
        x, _ = fused_add_rms_norm(x, residual, self.backbone.norm_f.weight, eps=eps)
        return x

    def kv_specs(self) -> list[FullAttentionSpec | LinearStateSpec]:
        """One spec per mixer or attention layer, in layer order (MLP / MoE layers have none)."""
        dtype = self.backbone.embeddings.weight.dtype
        specs = []
        for block in self.backbone.layers:
            if block.kind == MAMBA:
                specs.append(block.mixer.state_spec(dtype))
            elif block.kind == ATTENTION:
                specs.append(FullAttentionSpec(block.mixer.num_kv_heads, block.mixer.head_dim, dtype=dtype))
        return specs

    _QKV = re.compile(r"^(backbone\.layers\.\d+\.)mixer\.(q|k|v)_proj\.(weight|bias)$")
    _EXPERT = re.compile(r"^(backbone\.layers\.\d+\.mixer\.experts\.)(\d+)\.(up|down)_proj\.weight$")

    def _resolve(self, name: str) -> tuple[str, Any]:
        if name.startswith("model."):  # transformers' renamed prefix
            name = "backbone." + name[len("model."):]
        m = self._EXPERT.match(name)
        if m is not None:  # the checkpoints' one tensor per expert into the stacked ones
            prefix, e, which = m.groups()
            return f"{prefix}{which}_proj", int(e)
        m = self._QKV.match(name)
        if m is None:
            return name, None
        prefix, which, kind = m.groups()
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[which]
        return f"{prefix}mixer.qkv_proj.{kind}", slice(*rows)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings

        def ignore(name: str) -> bool:
            return tied and name == "lm_head.weight"

        load_hf_weights(self, weights, self._resolve, arch=self.config.architecture, ignore=ignore)
