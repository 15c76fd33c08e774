"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention (MLA) over a paged latent cache, and DeepSeekMoE.

The math is transformers' ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``; the cache holds the compressed
latent instead of per-head keys and values:

- per token the cache keeps ``[c_kv, k_pe]``: ``c_kv`` ``[kv_lora_rank]`` (after ``kv_a_layernorm``) and the
  rotated ``k_pe`` ``[qk_rope_head_dim]``, one KV head of ``kv_lora_rank + qk_rope_head_dim`` (576 for V3). The
  layer's spec is ``FullAttentionSpec(num_kv_heads=1, shared_kv=True)``: one tensor per layer, handed out as
  ``(cache, cache)``;
- decode runs the "absorbed" form: each head's ``q_nope`` goes through its ``W_UK`` slice of ``kv_b_proj`` (a
  latent query), so ``q = [q_nope W_UK, q_pe]`` attends over keys ``[c_kv, k_pe]`` as multi-query attention (every
  query head on the one latent head) and reads back ``softmax . c_kv``, which goes through each head's ``W_UV``
  slice, then ``o_proj``: :func:`~infercore.ops.paged_mla_decode` (a Triton kernel on CUDA that reads each latent
  tile once for both products). A quantized ``kv_b_proj`` (``quantize``) gives its matrix by running the layer on
  the identity, once per weight version;
- prefill chunks (and the prefill part of mixed steps) run the plain form, as vLLM's MLA prefill does: the
  sequences' latent contexts are expanded through ``kv_b_proj`` into per-head keys ``[k_nope, k_pe]`` (192 wide for
  V3) and values (128, zero-padded to the key width) in a temporary paged layout read by
  :func:`~infercore.ops.paged_attention_prefill`: 192 + 192 multiply-adds per (query, head, key) against the
  absorbed form's 576 + 512. The temporary holds ``context x heads x 2 x 192`` elements of each expanded sequence
  (~98 KB a token for V3's 128 heads), so long contexts cost that much transient memory. A mixed step's one-query
  sequences (``AttentionMetadata.num_split_decodes``) take the absorbed decode;
- softmax scale ``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` where
  ``rope_scaling`` has ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``); YaRN's attention factor itself is
  in the cos/sin table, as for every family;
- RoPE on ``q_pe`` / ``k_pe`` only: interleaved pairs ``(2i, 2i+1)`` for V2 (its complex rotation) and for V3 with
  ``rope_interleave`` (the default), the halves otherwise. Only dot products of rotated vectors are taken, so the
  layout the rotation leaves them in does not matter;
- q: ``q_proj`` (V2-Lite, ``q_lora_rank`` null) or ``q_a_proj -> q_a_layernorm -> q_b_proj``. ``q_a_layernorm``
  and ``kv_a_layernorm`` use eps 1e-6 whatever ``rms_norm_eps`` says (transformers builds them so).

MLPs: layers below ``first_k_dense_replace`` are dense SiLU MLPs; the others route to ``n_routed_experts`` experts
(stacked ``[E, 2I, H]`` / ``[E, H, I]``, :class:`~infercore.models.moe.SparseMoeBlock`'s storage and expert paths)
plus ``n_shared_experts`` always-on experts as one MLP. Routing (fp32, from an fp32 router as transformers keeps
it): V2 ``softmax`` scores with ``greedy`` or ``group_limited_greedy`` top-k (the best ``topk_group`` of ``n_group``
groups by their best expert); V3 ``sigmoid`` scores plus ``e_score_correction_bias`` for the choice only
(``noaux_tc``: groups ranked by the sum of their two best), weights from the uncorrected scores, renormalised with
``norm_topk_prob``; both scaled by ``routed_scaling_factor``.

Checkpoints keep their HF names (per-expert ``mlp.experts.{e}.{gate,up,down}_proj`` as ``save_pretrained`` writes
them, or transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj``); V3's multi-token-prediction layers
(``model.layers.{num_hidden_layers}...``) are skipped as transformers skips them. ``tensor_parallel_`` shards
the query heads (each rank keeps the whole latent cache) and the experts by width or whole (``experts="ep"``).
FP8 checkpoints in V3's release layout (``quant_method: fp8``, 128 x 128 ``weight_scale_inv`` blocks) load through
the pre-quantized FP8 loader: the projections as FP8 ``QuantLinear`` s, the routed experts dequantized to the model
dtype (the stacked expert kernels take dense weights; the full V3 would then need its bf16 size). ``quantize`` of a
loaded model works too. Not supported: int8 / fp8 KV, LoRA.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ..devices import dispatch
from ..kv.spec import FullAttentionSpec
from ..ops import AttentionMetadata
from ..ops.attention import attend_split_decodes, split_decodes
from .config import ModelConfig
from .hybrid import HFConfigReader, load_hf_weights
from .llama import KVCache, LlamaForCausalLM, RMSNorm, prenorm_block
from .moe import GatedMLP, SparseMoeBlock, moe_experts

# HF model_type -> architecture
DEEPSEEK_ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}

# The HF config classes' defaults, for keys a config.json leaves out (save_pretrained writes them all).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(vocab_size=102400, intermediate_size=11008, max_position_embeddings=2048, bos_token_id=1,
                        eos_token_id=2, first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
                        n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, routed_scaling_factor=1.0, topk_method="greedy", scoring_func="softmax",
                        norm_topk_prob=False, moe_intermediate_size=1407, n_group=1, topk_group=1),
    "deepseek_v3": dict(vocab_size=129280, intermediate_size=18432, max_position_embeddings=4096, bos_token_id=0,
                        eos_token_id=1, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                        n_routed_experts=256, n_shared_experts=1, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid",
                        norm_topk_prob=True, moe_intermediate_size=2048, n_group=8, topk_group=4,
                        num_experts_per_tok=8),
}
# (scoring_func, topk_method) each family's transformers code computes
_ROUTING = {"deepseek_v2": {("softmax", "greedy"), ("softmax", "group_limited_greedy")},
            "deepseek_v3": {("sigmoid", "noaux_tc")}}
_MLA_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the RMSNorm default


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class DeepseekConfig(ModelConfig):
    """:class:`ModelConfig` plus MLA and DeepSeekMoE. ``head_dim`` is ``qk_rope_head_dim`` (the rotated width, as
    transformers sets it), ``num_kv_heads`` is ``num_heads`` (unused: the latent cache has one head);
    ``intermediate_size`` is the dense layers' MLP width. ``q_lora_rank`` None: a plain ``q_proj``."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    num_experts: int = 64
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1407
    n_shared_experts: int = 2
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    rope_interleave: bool = True
    num_mtp_layers: int = 0  # checkpoint layers past num_layers (V3's multi-token prediction), skipped on load

    @property
    def qk_rope_head_dim(self) -> int:
        return self.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.head_dim

    @property
    def latent_dim(self) -> int:
        """Per-token cache width: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling or {}
        if rs.get("mscale_all_dim"):  # transformers' yarn_apply_mscale (any rope type but default)
            m = _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def validate(self) -> None:
        super().validate()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "n_shared_experts", "n_group", "topk_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"DeepseekConfig.{name} must be a positive int, got {v!r}")
        q = self.q_lora_rank
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q <= 0):
            raise ValueError(f"DeepseekConfig.q_lora_rank must be a positive int or None, got {q!r}")
        f = self.first_k_dense_replace
        if not isinstance(f, int) or isinstance(f, bool) or f < 0:
            raise ValueError(f"DeepseekConfig.first_k_dense_replace must be an int >= 0, got {f!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"DeepseekConfig.num_experts_per_tok={self.num_experts_per_tok} must be <= "
                             f"num_experts={self.num_experts}")
        r = self.routed_scaling_factor
        if not isinstance(r, int | float) or isinstance(r, bool) or not r > 0:
            raise ValueError(f"DeepseekConfig.routed_scaling_factor must be a positive number, got {r!r}")
        if (self.scoring_func, self.topk_method) not in {p for s in _ROUTING.values() for p in s}:
            raise ValueError(f"DeepseekConfig.scoring_func={self.scoring_func!r} / topk_method={self.topk_method!r}: "
                             "supported are softmax with greedy or group_limited_greedy, and sigmoid with noaux_tc")
        if self.topk_method != "greedy":
            per_group, rem = divmod(self.num_experts, self.n_group)
            if rem:
                raise ValueError(f"DeepseekConfig.n_group={self.n_group} must divide num_experts={self.num_experts}")
            if self.topk_group > self.n_group:
                raise ValueError(f"DeepseekConfig.topk_group={self.topk_group} must be <= n_group={self.n_group}")
            if self.topk_method == "noaux_tc" and per_group < 2:  # groups are ranked by their two best experts
                raise ValueError(f"DeepseekConfig.n_group={self.n_group}: noaux_tc needs >= 2 experts per group")
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ValueError(f"DeepseekConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                                 f"{self.topk_group * per_group} experts of topk_group={self.topk_group} groups")
        for name in ("norm_topk_prob", "rope_interleave"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DeepseekConfig.{name} must be a bool, got {getattr(self, name)!r}")
        rs = self.rope_scaling or {}
        if rs.get("mscale_all_dim") and (not isinstance(rs.get("factor"), int | float) or isinstance(rs["factor"], bool)
                                         or not rs["factor"] > 0):
            raise ValueError(f"DeepseekConfig.rope_scaling: mscale_all_dim scales the softmax by the YaRN 'factor', "
                             f"which must be a positive number, got {rs.get('factor')!r}")
        if self.partial_rotary_factor != 1.0:
            raise ValueError(f"DeepseekConfig.partial_rotary_factor must be 1 (q_pe / k_pe rotate whole), got "
                             f"{self.partial_rotary_factor!r}")
        if self.layer_types != ["full_attention"] * self.num_layers:
            raise ValueError("DeepseekConfig.layer_types: every MLA layer attends to its whole context")
        if self.hidden_act != "silu":
            raise ValueError(f"DeepseekConfig.hidden_act={self.hidden_act!r}: the experts and MLPs are SiLU-gated")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> DeepseekConfig:
        """Build from an HF ``config.json`` dict of a DeepSeek-V2 / V3 checkpoint (transformers 4 or 5 layout, or the
        original release's). ``ValueError`` names a missing or malformed key, and refuses what transformers does not
        compute the way the key says (a V3 ``topk_method`` other than ``noaux_tc``, V2's ``norm_topk_prob``, a
        ``moe_layer_freq`` other than 1, MLP biases, a non-SiLU activation)."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"hf config must be a mapping, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in DEEPSEEK_ARCHITECTURES:
            raise ValueError(f"model_type={model_type!r} is not a DeepSeek family; supported: "
                             f"{sorted(DEEPSEEK_ARCHITECTURES)}")
        arch = DEEPSEEK_ARCHITECTURES[model_type]
        archs = hf.get("architectures") or [arch]
        if archs != [arch]:
            raise ValueError(f"HF config architectures={archs!r} is not supported for model_type={model_type!r}; "
                             f"expected [{arch!r}]")
        defaults = _DEFAULTS[model_type]
        full = {**defaults, **{k: v for k, v in hf.items() if v is not None}}
        if "q_lora_rank" in hf:  # an explicit null: no q compression (V2-Lite)
            full["q_lora_rank"] = hf["q_lora_rank"]
        for key in ("norm_topk_prob", "rope_interleave"):  # transformers tests these for truth: null is off
            if key in hf and hf[key] is None:
                full[key] = False
        r = HFConfigReader(full, model_type)

        def choice(key: str, allowed: tuple[str, ...]) -> str:
            return r.check(key, r.get(key), str, f"one of {list(allowed)}", lambda v: v in allowed)

        scoring = choice("scoring_func", ("softmax", "sigmoid"))
        method = choice("topk_method", ("greedy", "group_limited_greedy", "noaux_tc"))
        if (scoring, method) not in _ROUTING[model_type]:
            key = "scoring_func" if scoring not in {s for s, _ in _ROUTING[model_type]} else "topk_method"
            raise ValueError(f"HF {model_type} config key {key!r}: scoring_func={scoring!r} with "
                             f"topk_method={method!r} is not what {arch} computes; it takes "
                             f"{sorted(_ROUTING[model_type])}")
        norm_topk = r.flag("norm_topk_prob", defaults["norm_topk_prob"])
        if model_type == "deepseek_v2" and norm_topk:
            raise ValueError("HF deepseek_v2 config key 'norm_topk_prob' is true: DeepseekV2ForCausalLM never "
                             "renormalises the routing weights (the original release does), so the checkpoint's "
                             "meaning is ambiguous")
        # transformers routes every layer from first_k_dense_replace on (the original code every moe_layer_freq-th)
        r.check("moe_layer_freq", full.get("moe_layer_freq", 1), int, "1", lambda v: v == 1)
        if r.flag("mlp_bias", False):
            raise ValueError(f"HF {model_type} config key 'mlp_bias' is true: MLP biases are not supported")
        if full.get("hidden_act", "silu") != "silu":
            raise ValueError(f"HF {model_type} config key 'hidden_act' must be 'silu', got {full['hidden_act']!r}")
        q_lora = full.get("q_lora_rank")
        if q_lora is not None:
            r.positive_int("q_lora_rank")
        rope_dim = r.positive_int("qk_rope_head_dim")
        interleave = True if model_type == "deepseek_v2" else r.flag("rope_interleave", True)
        mtp = r.check("num_nextn_predict_layers", full.get("num_nextn_predict_layers", 0), int, "an int >= 0",
                      lambda v: v >= 0)

        dense = dict(full)  # the Llama-rule parse of the shared keys (RoPE, norms, embeddings, token ids)
        for key in ("q_lora_rank", "num_key_value_heads", "mlp_bias"):
            dense.pop(key, None)
        dense.update(model_type="llama", architectures=None, head_dim=rope_dim, sliding_window=None)
        base = ModelConfig.from_hf(dense)
        values = {f.name: getattr(base, f.name) for f in fields(ModelConfig)}
        values.update(model_type=model_type, architecture=arch, mlp_bias=False)
        return cls(**values, q_lora_rank=q_lora, kv_lora_rank=r.positive_int("kv_lora_rank"),
                   qk_nope_head_dim=r.positive_int("qk_nope_head_dim"), v_head_dim=r.positive_int("v_head_dim"),
                   num_experts=r.positive_int("n_routed_experts"),
                   num_experts_per_tok=r.positive_int("num_experts_per_tok"),
                   moe_intermediate_size=r.positive_int("moe_intermediate_size"),
                   n_shared_experts=r.positive_int("n_shared_experts"),
                   first_k_dense_replace=r.check("first_k_dense_replace", r.get("first_k_dense_replace"), int,
                                                 "an int >= 0", lambda v: v >= 0),
                   routed_scaling_factor=r.number("routed_scaling_factor"), scoring_func=scoring, topk_method=method,
                   n_group=r.positive_int("n_group") if method != "greedy" else 1,
                   topk_group=r.positive_int("topk_group") if method != "greedy" else 1,
                   norm_topk_prob=norm_topk, rope_interleave=interleave, num_mtp_layers=mtp)


class MLAttention(nn.Module):
    """Multi-head latent attention over a paged latent cache ``[num_pages, page_size, 1, kv_lora_rank +
    qk_rope_head_dim]`` (see the module docstring). Module names are transformers' (``q_proj`` or ``q_a_proj`` /
    ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``)."""

    def __init__(self, config: DeepseekConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        c = config
        H = self.num_heads = c.num_heads
        self.num_kv_heads = 1
        self.nope, self.rope, self.v_dim, self.rank = c.qk_nope_head_dim, c.head_dim, c.v_head_dim, c.kv_lora_rank
        self.head_dim = c.latent_dim  # of the cache and the attention op
        self.scale = c.softmax_scale
        self.is_neox = not c.rope_interleave
        self.sliding_window = None
        bias = c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, H * c.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=_MLA_EPS, dtype=dtype)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.latent_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=_MLA_EPS, dtype=dtype)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(H * c.v_head_dim, c.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        if hasattr(kv_cache, "k_scale"):
            raise ValueError("kv_caches: the MLA latent cache takes no int8 / fp8 codes; allocate it in the model's "
                             "dtype (kv_cache_dtype='auto')")
        k_cache = kv_cache[0]  # the latent cache (shared_kv: the same tensor twice)
        norm = dispatch("rms_norm", x.device)
        mods = self._modules
        if "q_proj" in mods:
            q = mods["q_proj"](x)
        else:
            qa = self.q_a_layernorm
            q = mods["q_b_proj"](norm(mods["q_a_proj"](x), qa.weight, eps=qa.eps))
        q_nope, q_pe = q.view(T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        kva = self.kv_a_layernorm
        c_kv = norm(c_kv.contiguous(), kva.weight, eps=kva.eps)
        q_pe, k_pe = dispatch("apply_rope", x.device)(q_pe.contiguous(), k_pe.reshape(T, 1, self.rope).contiguous(),
                                                      positions, cos_sin, is_neox=self.is_neox)
        latent = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # [T, 1, rank + rope]
        dispatch("write_kv_cache_", x.device)(latent, latent, k_cache, k_cache, meta.slot_mapping)
        if meta.decode_only:
            o = self._absorbed_decode(q_nope, q_pe, k_cache, meta.seq_lens, meta.block_table)
        else:
            o = self._prefill(q_nope, q_pe, k_cache, meta)
        return self.o_proj(o.reshape(T, H * self.v_dim))

    def _w_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, nope, rank]`` and ``W_UV [H, v, rank]``: kv_b_proj's rows per head are (k_nope, v)."""
        proj = self.kv_b_proj
        if isinstance(proj, nn.Linear):
            w = proj.weight
        else:  # quantized (QuantLinear): the absorbed decode needs the matrix itself, as the layer computes it
            key = tuple((t.data_ptr(), t._version) for t in proj.buffers())
            if getattr(self, "_w_kv_key", None) != key:
                dtype = self.kv_a_layernorm.weight.dtype  # the activations' (norm weights are never quantized)
                eye = torch.eye(self.rank, dtype=dtype, device=next(proj.buffers()).device)
                self._w_kv_mat, self._w_kv_key = proj(eye).t().contiguous(), key  # no bias: W^T = kv_b_proj(I)
            w = self._w_kv_mat
        w = w.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _absorbed_decode(self, q_nope, q_pe, cache, seq_lens, block_table) -> torch.Tensor:
        """One query per sequence: ``[q_nope W_UK, q_pe]`` over the latent cache (``ops.paged_mla_decode``), the
        latent output through ``W_UV``. Returns ``[B, H, v_head_dim]``."""
        w_uk, w_uv = self._w_kv()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, B, rank]
        q = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)  # [B, H, rank + rope]
        o = dispatch("paged_mla_decode", q.device)(q, cache, seq_lens=seq_lens, block_table=block_table,
                                                   scale=self.scale, kv_lora_rank=self.rank)  # fmt: skip
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    def _prefill(self, q_nope, q_pe, cache, meta: AttentionMetadata) -> torch.Tensor:
        """Prefill / mixed steps in the plain (non-absorbed) form: each sequence's latent context is gathered page by
        page and expanded through ``kv_b_proj`` into per-head keys ``[k_nope, k_pe]`` and values (padded to the key
        width), which the paged prefill op reads through an identity block table. Scores then cost ``qk_head_dim``
        (192) multiply-adds a (query, head, key) instead of the absorbed form's 576, and values 128 instead of 512.
        A mixed step's one-query sequences (``meta.num_split_decodes``) take the absorbed decode instead, and only
        the other sequences' contexts are expanded. Returns ``[T, H, v_head_dim]``."""
        H, page = self.num_heads, cache.shape[1]
        fn = dispatch("paged_attention_prefill", q_nope.device)
        split = split_decodes(meta, fn)
        n_pages = -(-meta.max_seqlen_k // page)
        table = meta.block_table[:, :n_pages]
        if split:
            table = table.index_select(0, meta.prefill_seqs)
        # Entries past a sequence's own pages may hold anything: clamp to a real page (its rows are never read).
        pages = table.clamp(0, cache.shape[0] - 1).reshape(-1).long()
        latent = cache.index_select(0, pages).view(-1, self.rank + self.rope)  # [S * n_pages * page, rank + rope]
        kv = self.kv_b_proj(latent[:, : self.rank]).view(-1, H, self.nope + self.v_dim)
        d = self.nope + self.rope
        k = torch.cat([kv[..., : self.nope], latent[:, None, self.rank :].expand(-1, H, self.rope)], dim=-1)
        v = torch.nn.functional.pad(kv[..., self.nope :], (0, d - self.v_dim))
        k, v = k.view(-1, page, H, d), v.view(-1, page, H, d)
        ident = torch.arange(table.numel(), device=table.device, dtype=torch.int32).view(table.shape)
        if split:  # rows of the decodes point at page 0 (only_seqs leaves them out)
            ident = ident.new_zeros(meta.block_table.shape[0], n_pages).index_copy_(0, meta.prefill_seqs.long(), ident)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kw = {"only_seqs": meta.prefill_seqs} if split else {}
        o = fn(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens, block_table=ident, scale=self.scale,
               sliding_window=None, softcap=None, max_seqlen_q=meta.max_seqlen_q, **kw)[..., : self.v_dim]  # fmt: skip
        if split:  # the one-query sequences through the absorbed decode (ops.attention.attend_split_decodes)
            nope = self.nope

            def decode(rows, cache_, _, *, seq_lens, block_table):
                return self._absorbed_decode(rows[..., :nope], rows[..., nope:], cache_, seq_lens, block_table)

            o = attend_split_decodes(o.contiguous(), q, cache, cache, meta, decode)
        return o


class DeepseekRouter(nn.Module):
    """The fp32 router ``weight`` ``[E, H]`` and V3's ``e_score_correction_bias`` ``[E]`` (a parameter here so it
    loads like one; transformers keeps both in fp32 whatever the model's dtype)."""

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        E = config.num_experts
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size, dtype=torch.float32), requires_grad=False)
        if config.scoring_func == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        else:
            self.e_score_correction_bias = None
        self.top_k, self.method, self.scoring = config.num_experts_per_tok, config.topk_method, config.scoring_func
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.renormalize, self.scaling = config.norm_topk_prob, float(config.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(weights fp32 [T, top_k], expert ids int64 [T, top_k])``, as transformers'
        ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter`` choose them."""
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        bias = self.e_score_correction_bias
        choice = scores if bias is None else scores + bias.float()
        if self.method == "greedy":
            weights, ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)
        else:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            best = grouped.max(dim=-1).values if self.method == "group_limited_greedy" else (
                grouped.topk(2, dim=-1).values.sum(dim=-1))
            groups = torch.topk(best, self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
            if self.method == "group_limited_greedy":  # transformers zeroes the other groups' scores
                weights, ids = torch.topk(choice.masked_fill(~keep, 0.0), self.top_k, dim=-1, sorted=False)
            else:
                ids = torch.topk(choice.masked_fill(~keep, float("-inf")), self.top_k, dim=-1, sorted=False).indices
                weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekMoE(SparseMoeBlock):
    """DeepSeekMoE: routed experts (:class:`SparseMoeBlock`'s stacked storage and expert paths: the CPU-packed, host
    and plain ones) under :class:`DeepseekRouter`, plus ``shared_experts`` (``n_shared_experts`` experts as one
    SiLU MLP, ungated) on every token."""

    def __init__(self, config: DeepseekConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__(config.hidden_size, num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                         intermediate=config.moe_intermediate_size, renormalize=config.norm_topk_prob, dtype=dtype)
        self.gate = DeepseekRouter(config)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                       dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.host_experts is not None:
            out = self.host_experts(x, weights, ids, self.expert_offset)
        else:
            gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
            scales = self.experts.scales()  # int8 / fp8 experts (StackedExperts.quantize_)
            packed = self.cpu_packed_experts
            if packed is not None and not scales and x.device.type == "cpu" and x.dtype == packed.dtype:
                if not packed.current(gate_up, down):  # the weights were written since packing
                    packed = self.cpu_packed_experts = type(packed)(gate_up, down)
                out = packed(x, weights, ids, self.expert_offset)
            else:
                out = moe_experts(x, gate_up, down, weights, ids, self.expert_offset, **scales)
        return out + self.shared_experts(x)


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm decoder layer (MLA, then a dense MLP or DeepSeekMoE). Takes and returns the residual stream split
    as ``(x, residual)`` like ``LlamaDecoderLayer``."""

    def __init__(self, config: DeepseekConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer, dtype=dtype)
        if config.is_moe_layer(layer):
            self.mlp = DeepseekMoE(config, dtype=dtype)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return prenorm_block(self, x, residual, positions, cos_sin, kv_cache, meta)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V3 causal LM over a paged latent cache (one ``[num_pages, page_size, 1, kv_lora_rank +
    qk_rope_head_dim]`` tensor per layer, :meth:`kv_specs`). The embedding, the stack, the final norm, the RoPE table
    and the logits are :class:`LlamaForCausalLM` 's; the decoder layers and the weights' names are DeepSeek's."""

    decoder_layer = DeepseekDecoderLayer

    def __init__(self, config: DeepseekConfig, *, dtype: torch.dtype | None = None) -> None:
        if not isinstance(config, DeepseekConfig):
            raise TypeError(f"config: expected a DeepseekConfig, got {type(config).__name__}")
        super().__init__(config, dtype=dtype)

    # enable_lora_ (Engine(max_loras=...)) would wrap o_proj and the dense / routed MLPs but none of the latent
    # projections, and adapters for those would be dropped: refused before anything is wrapped.
    lora_unsupported = "it takes no LoRA adapters (its latent-attention projections have no adapter slots)"

    def kv_specs(self) -> list[FullAttentionSpec]:
        """One latent cache per layer: one KV head of ``kv_lora_rank + qk_rope_head_dim``, keys and values in one
        tensor (``shared_kv``)."""
        dtype = self.model.embed_tokens.weight.dtype
        return [FullAttentionSpec(num_kv_heads=1, head_dim=self.config.latent_dim, dtype=dtype, shared_kv=True)
                for _ in self.model.layers]

    _MERGED = re.compile(r"^(model\.layers\.\d+\.mlp\.(?:shared_experts\.)?)(gate|up)_proj\.weight$")
    _EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    _LAYER = re.compile(r"^model\.layers\.(\d+)\.")
    _IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

    def _resolve(self, name: str) -> tuple[str, Any]:
        cfg = self.config
        if m := self._MERGED.match(name):
            prefix, proj = m.groups()
            i = cfg.moe_intermediate_size * cfg.n_shared_experts if "shared" in prefix else cfg.intermediate_size
            return f"{prefix}gate_up_proj.weight", slice(0, i) if proj == "gate" else slice(i, 2 * i)
        if m := self._EXPERT.match(name):
            prefix, e, proj = m.groups()
            i, e = cfg.moe_intermediate_size, int(e)
            if proj == "down":
                return f"{prefix}down_proj", e
            return f"{prefix}gate_up_proj", (e, slice(0, i) if proj == "gate" else slice(i, 2 * i))
        return name, None

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to a multi-token-prediction layer (layer ids from ``num_hidden_layers``
        on, ``num_nextn_predict_layers`` of them), which is not run: skipped by every loader, the pre-quantized ones
        included."""
        cfg = self.config
        m = self._LAYER.match(name)
        return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_mtp_layers

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors: per-expert or stacked experts, dense / shared gate and up projections merged
        (``ValueError`` naming an unknown, duplicate, misshapen or missing tensor). The multi-token-prediction
        layers' tensors (layer ids from ``num_hidden_layers`` on, ``num_nextn_predict_layers`` of them) are
        skipped."""
        cfg = self.config
        tied = cfg.tie_word_embeddings

        def ignore(name: str) -> bool:
            return self.skips_checkpoint_tensor(name) or bool(self._IGNORED.search(name)) or (
                tied and name == "lm_head.weight")

        load_hf_weights(self, weights, self._resolve, arch=cfg.architecture, ignore=ignore)
        if tied:  # load_hf_weights wrote the embedding; the head shares it
            self.lm_head.weight = self.model.embed_tokens.weight


__all__ = ["DEEPSEEK_ARCHITECTURES", "DeepseekConfig", "DeepseekForCausalLM", "DeepseekMoE", "DeepseekRouter",
           "MLAttention"]
