"""Dense Llama-family decoder (Llama 2/3.x, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) built from infercore ops.

Layout: tokens-first ragged batches. ``input_ids`` and ``positions`` are ``[T]`` for all sequences of
the step concatenated; the per-step :class:`~infercore.ops.AttentionMetadata` says where each sequence's
tokens and KV pages are. Every layer owns a ``(k_cache, v_cache)`` pair of shape
``[num_pages, page_size, num_kv_heads, head_dim]`` supplied by the caller (see :meth:`kv_specs`).

Projections are merged (one ``qkv_proj`` and one ``gate_up_proj`` GEMM per layer); :meth:`load_weights`
stacks the separate HF tensors into them, so checkpoints keep their HF names (Phi-3 checkpoints store them
merged already). All linear layers are plain ``torch.nn.Linear`` so quantization can swap them. Granite and
OLMo 2 (``granite.py``, ``olmo2.py``) are this model with other decoder layers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from ..devices import accepts, dispatch, resolve
from ..kv.spec import FullAttentionSpec
from ..ops import (
    AttentionMetadata,
    fused_add_rms_norm,
    gelu_and_mul,
    rms_norm,
    rope_cos_sin_cache,
    silu_and_mul,
)
from ..ops.attention import attend_split_decodes, decode_impl, split_decodes, takes_new_kv
from ..ops.kv_cache import dequantize_paged_kv, scale_aware
from ..ops.moe import cpu_native
from ..ops.pdl import PDL_MAX_ROWS
from .config import ModelConfig
from .hybrid import check_step
from .layout import NATIVE_MAX_ROWS

KVCache = tuple[torch.Tensor, torch.Tensor]

# Module, parameter and buffer registrations anywhere in the process (torch's global registration hooks: an
# assignment of a module / parameter / buffer attribute, register_buffer): LlamaForCausalLM._native_stack keeps its
# table while the count stands instead of re-reading every layer's modules each decode step.
_registrations = [0]


def _count_registration(*_args) -> None:
    _registrations[0] += 1


for _register in (nn.modules.module.register_module_module_registration_hook,
                  nn.modules.module.register_module_parameter_registration_hook,
                  nn.modules.module.register_module_buffer_registration_hook):
    _register(_count_registration)


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, t.shape, t.stride()


def _stack_step_key(version: int, x: torch.Tensor, layers, cos_sin: torch.Tensor, kv_caches) -> tuple:
    """What LlamaForCausalLM._native_stack's kept table rests on besides the weights' pointers: the registration
    count, x's dtype and width, the layers, the RoPE table's and every cache's address and layout (not the tensors
    themselves: a freed KV pool must not be kept alive)."""
    return (version, x.dtype, x.shape[1], layers, len(layers), _layout(cos_sin), tuple(map(type, kv_caches)),
            [_layout(t) for kv in kv_caches for t in (*kv, *_scales(kv)) if t is not None])


def _scales(kv_cache) -> tuple:
    """A quantized cache's ``(k_scale, v_scale)`` (``kv.cache.QuantizedKVCache``), else ``(None, None)``."""
    return getattr(kv_cache, "k_scale", None), getattr(kv_cache, "v_scale", None)


def _codes_readable(attn, kv_cache) -> bool:
    """A cache of the layer's dtype, or 1-byte codes the native decode attention reads now (its vector path at this
    head dim and group; checked every step: ``cpu_native.scalar_attention`` turns that path off)."""
    return not hasattr(kv_cache, "k_scale") or cpu_native.attention_reads_codes(
        attn.head_dim, attn.num_heads // attn.num_kv_heads)


def tie_and_rope_table(model: nn.Module, *, base: float, scaling: dict | None) -> torch.Tensor:
    """Re-tie ``lm_head`` to the embedding when the config says so, and build the fp32 RoPE table
    ``[max_position_embeddings, rotary_dim]`` on the model's device (an uninitialised placeholder on
    ``meta``). Shared by every family's ``finish_init``."""
    cfg = model.config
    if cfg.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):  # not once run from quantized blocks
        model.lm_head.weight = model.model.embed_tokens.weight
    device = model.model.embed_tokens.weight.device
    if device.type == "meta":
        return torch.empty(cfg.max_position_embeddings, cfg.rotary_dim, device=device)
    # seq_len: longrope's factor set for the longest sequence the table serves (see ModelConfig)
    return rope_cos_sin_cache(rotary_dim=cfg.rotary_dim, max_positions=cfg.max_position_embeddings, base=base,
                              scaling=scaling, dtype=torch.float32, device=device,
                              seq_len=cfg.max_position_embeddings)


def _attention(q, k_cache, v_cache, meta: AttentionMetadata, *, scale, sliding_window, k_scale=None, v_scale=None,
               k=None, v=None):  # fmt: skip
    """:func:`infercore.ops.paged_attention` without re-checking the step's metadata every layer.

    With a quantized cache (``k_scale``/``v_scale`` given, see :class:`~infercore.kv.cache.QuantizedKVCache`)
    decode reads the 1-byte codes directly; prefill dequantizes the pages it reads into a temporary
    cache in q's dtype first (the prefill kernels read float caches only). ``k``/``v`` ``[T, Hk, D]``:
    this step's rotated keys and values, passed to a prefill implementation that takes them (see
    :func:`prefill_takes_new_kv`) so it reads the new tokens contiguously instead of through the pages.
    """
    if meta.decode_only:
        fn, extra = decode_impl(q.device, quantized=k_scale is not None, shared_seqs=meta.shared_seqs)
        if k_scale is not None:
            extra.update(k_scale=k_scale, v_scale=v_scale)
        return fn(q, k_cache, v_cache, seq_lens=meta.seq_lens, block_table=meta.block_table, scale=scale,
                  sliding_window=sliding_window, softcap=None, **extra)  # fmt: skip
    block_table = meta.block_table
    caches = k_cache, v_cache
    if k_scale is not None:
        k_cache, v_cache, block_table = dequantize_paged_kv(
            k_cache, v_cache, k_scale, v_scale, block_table=block_table, seq_lens=meta.seq_lens, dtype=q.dtype)
    fn = dispatch("paged_attention_prefill", q.device)
    new_kv = {"k": k, "v": v} if k is not None and takes_new_kv(fn) else {}
    split = split_decodes(meta, fn)
    if split:
        new_kv["only_seqs"] = meta.prefill_seqs
    o = fn(
        q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens, block_table=block_table,
        scale=scale, sliding_window=sliding_window, softcap=None, max_seqlen_q=meta.max_seqlen_q, **new_kv)  # fmt: skip
    if split:  # the one-query sequences of this mixed step, through the decode kernel (on the stored cache)
        quant = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        decode = (scale_aware if quant else dispatch)("paged_attention_decode", q.device)
        attend_split_decodes(o, q, *caches, meta, decode, scale=scale, sliding_window=sliding_window, softcap=None,
                             **quant)  # fmt: skip
    return o


# Decode-only steps of at most FUSED_ROPE_MAX_ROWS sequences rotate q / k and write the new K/V inside the
# decode attention kernel (``rope_write_decode_attention``) instead of a separate RoPE / KV-write launch.
# Batch-1 step of the 8B shape (graph replay, off -> on): bf16 4.091 -> 4.033 ms, FP8 weight-only 2.526 ->
# 2.477 (results/h200/sweeps/probe_fused_rope_attention.json). Not at large batches: the fused kernel needs
# more registers (~165 against 128; capped at 128 it spills) and so keeps fewer programs resident, and the
# batch-256 step took 12.258 -> 12.874 ms with it.
# INFERCORE_FUSED_ROPE_ATTENTION: "auto" (default) as above, "1" every decode-only step, "0" never.
FUSED_ROPE_ATTENTION = os.environ.get("INFERCORE_FUSED_ROPE_ATTENTION", "auto")
if FUSED_ROPE_ATTENTION not in ("0", "1", "auto"):
    raise ValueError(f"INFERCORE_FUSED_ROPE_ATTENTION: expected 0, 1 or auto, got {FUSED_ROPE_ATTENTION!r}")
FUSED_ROPE_MAX_ROWS = PDL_MAX_ROWS


def _fused_rope_attention(device: torch.device, rows: int) -> bool:
    """Whether a decode-only step over ``rows`` sequences takes the fused RoPE + attention kernel."""
    if FUSED_ROPE_ATTENTION == "0" or (FUSED_ROPE_ATTENTION == "auto" and rows > FUSED_ROPE_MAX_ROWS):
        return False
    return resolve("rope_write_decode_attention", device).name != "reference"


def prefill_takes_new_kv(meta: AttentionMetadata, device: torch.device) -> bool:
    """Whether this step's prefill attention reads the new tokens' K/V from contiguous tensors (the GPU
    kernel does; the CPU fast path reads everything from the cache). Then the caller keeps the rotated k
    instead of fusing RoPE into the cache write."""
    return not meta.decode_only and takes_new_kv(dispatch("paged_attention_prefill", device))


class RMSNorm(nn.Module):
    """Holds the weight ``[hidden]``; the math is :func:`infercore.ops.rms_norm` (called by the owner).

    ``offset=1.0`` is the ``1 + w`` form (Gemma, Qwen3-Next), whose stored weight is zero-centred.
    """

    def __init__(self, hidden: int, *, eps: float, dtype: torch.dtype | None = None, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden,), 1.0 - offset, dtype=dtype))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, eps=self.eps, offset=self.offset)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        # Granite's attention_multiplier is its softmax scale
        self.scale = d**-0.5 if config.attention_multiplier is None else float(config.attention_multiplier)
        self.sliding_window = config.layer_sliding_window(layer)
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias, dtype=dtype)
        # Qwen3 normalises each head of q and k (over head_dim) before RoPE.
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self._qkv(x)
        k_cache, v_cache = kv_cache
        # Quantized caches (kv.QuantizedKVCache) carry their per-(token, head) scales.
        k_scale, v_scale = _scales(kv_cache)
        # one kernel: rotate q and k, write the rotated k and v into the paged cache
        # Model-internal calls go straight to the registered implementation: the shapes are the
        # model's own, so the public wrappers' argument checks would only repeat per layer.
        if prefill_takes_new_kv(meta, x.device):
            # Prefill reads this step's K/V straight from k/v (contiguous rows, as FlashAttention varlen
            # does), so keep the rotated k; the cache write is still needed for later steps.
            fused = dispatch("rope_and_write_kv", x.device)
            if k_scale is None and accepts(fused, "return_k"):  # one kernel: the rotated k kept, k / v cached
                q, k = fused(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, return_k=True)
            else:
                q, k = dispatch("apply_rope", x.device)(q, k, positions, cos_sin)
                if k_scale is None:
                    dispatch("write_kv_cache_", x.device)(k, v, k_cache, v_cache, meta.slot_mapping)
                else:
                    scale_aware("write_kv_cache_", x.device)(k, v, k_cache, v_cache, meta.slot_mapping,
                                                             k_scale=k_scale, v_scale=v_scale)  # fmt: skip
            new_kv = {"k": k, "v": v}
        else:
            new_kv = {}
            if k_scale is None and meta.decode_only and not meta.shared_seqs and _fused_rope_attention(x.device, T):
                o = dispatch("rope_write_decode_attention", x.device)(
                    q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, seq_lens=meta.seq_lens,
                    block_table=meta.block_table, scale=self.scale, sliding_window=self.sliding_window)  # fmt: skip
                return self.o_proj(o.reshape(T, self.q_size))
            if k_scale is None:
                q = dispatch("rope_and_write_kv", x.device)(q, k, v, positions, cos_sin, k_cache, v_cache,
                                                            meta.slot_mapping)  # fmt: skip
            else:
                rope_write = scale_aware("rope_and_write_kv", x.device)
                q = rope_write(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping,
                               k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        o = _attention(q, k_cache, v_cache, meta, scale=self.scale, sliding_window=self.sliding_window,
                       k_scale=k_scale, v_scale=v_scale, **new_kv)  # fmt: skip
        return self.o_proj(o.reshape(T, self.q_size))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> un-rotated q ``[T, Hq, D]``, k and v ``[T, Hk, D]`` (q and k normed where the
        family norms them)."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias, dtype=dtype)
        if config.hidden_act == "silu":
            self.act = silu_and_mul
        else:
            approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
            self.act = partial(gelu_and_mul, approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.act is silu_and_mul:
            return self.down_proj(dispatch("silu_and_mul", h.device)(h))
        return self.down_proj(self.act(h))


def prenorm_block(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                  cos_sin: torch.Tensor, kv_cache: KVCache, meta) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm decoder layer ``x += attn(norm(x)); x += mlp(norm(x))`` over ``layer.input_layernorm``,
    ``self_attn``, ``post_attention_layernorm`` and ``mlp``, the residual stream carried separately so each norm fuses
    the preceding residual add: ``x [T, H]`` (with ``residual`` None at the first layer) -> ``(mlp out, residual)``,
    both ``[T, H]`` in x's dtype."""
    norm = layer.input_layernorm
    if residual is None:
        residual, x = x, dispatch("rms_norm", x.device)(x, norm.weight, eps=norm.eps)
    else:
        x, residual = dispatch("fused_add_rms_norm", x.device)(x, residual, norm.weight, eps=norm.eps)
    x = layer.self_attn(x, positions, cos_sin, kv_cache, meta)
    norm = layer.post_attention_layernorm
    x, residual = dispatch("fused_add_rms_norm", x.device)(x, residual, norm.weight, eps=norm.eps)
    return layer.mlp(x), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, dtype=dtype)
        self.mlp = LlamaMLP(config, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        linears = self._native_decode(x, residual, cos_sin, kv_cache, meta)
        lora = _lora_operands(self) if linears is not None else None
        if linears is not None and lora is not False:  # CPU decode: the whole layer in one call
            kw = {} if lora is None else {"lora": lora}
            return cpu_native.llama_decode_layer(x, residual, self, positions, cos_sin, kv_cache[0], kv_cache[1],
                                                 meta, linears, *_scales(kv_cache), **kw)  # fmt: skip
        return prenorm_block(self, x, residual, positions, cos_sin, kv_cache, meta)


    def _native_decode(self, x, residual, cos_sin, kv_cache, meta) -> list | None:
        """The linears as ``cpu_native.llama_decode_layer`` takes them where this step runs through it, else None:
        decode rows on the CPU (up to ``NATIVE_MAX_ROWS``, where the linears take the native GEMVs anyway), the
        layer exactly this class's (plain norms, SiLU MLP, Qwen3's per-head q / k norms or none; linears that the
        native GEMVs take, ``cpu_native.layer_linear``: dense of x's dtype, or INT4 / GGUF Q4 / INT8 with bf16 x,
        without bias but for qkv's, Qwen2's), a
        plain cache of x's dtype, full neox RoPE, no backend override (``INFERCORE_BACKEND``): what the op-by-op
        path would run, in one call. A quantized cache (int8 / float8_e4m3fn codes with their scales,
        ``kv.cache.QuantizedKVCache``) takes it too where the native attention reads its codes."""
        if not _native_step(x, meta) or (residual is not None and (residual.shape != x.shape
                                                                   or residual.dtype != x.dtype)):
            return None
        if len(kv_cache) != 2 or not _codes_readable(self.self_attn, kv_cache):
            return None
        return self._native_linears(x.dtype, x.shape[1], kv_cache[0], kv_cache[1], cos_sin,
                                    *_scales(kv_cache))

    def _native_linears(self, dt, hidden: int, k_cache, v_cache, cos_sin, k_scale=None, v_scale=None) -> list | None:
        """:meth:`_native_decode`'s checks of what stays fixed from step to step (the layer's modules and weights,
        the caches, the RoPE table), and the linears' descriptors: looked up once per such set (kept on the layer,
        keyed by the modules' and weights' identity, the tensors' data pointers and the caches' layouts)."""
        mods = self._modules
        attn, mlp, n1, n2 = mods["self_attn"], mods["mlp"], mods["input_layernorm"], mods["post_attention_layernorm"]
        if type(self) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return None
        am, mm = attn._modules, mlp._modules
        # a LoRA-wrapped linear (lora.LoRALinear): its base, the adapters added by the native layer itself
        lins = tuple(getattr(m, "native_base", m) for m in (am["qkv_proj"], am["o_proj"], mm["gate_up_proj"],
                                                            mm["down_proj"]))
        w1, w2 = n1._parameters["weight"], n2._parameters["weight"]
        qk = (attn.q_norm, attn.k_norm)  # Qwen3's per-head norms, or None
        # their weights and qkv's bias (Qwen2), or None
        qkw = (*(None if n is None else n._parameters["weight"] for n in qk), lins[0]._parameters.get("bias"))
        stores = tuple(map(cpu_native.layer_linear_store, lins))
        objs = (dt, attn, mlp, n1, n2, mlp.__dict__.get("act"), *lins, *stores,
                *[lin._parameters.get("bias") for lin in lins], w1, w2, *qk, *qkw)
        ids = tuple(map(id, objs))  # compared as ints; the entry holds objs, so none of these ids is reused meanwhile
        # the caches and the RoPE table by address and layout only: the cache must not keep a freed KV pool alive
        ptrs = (hidden, k_cache.data_ptr(), k_cache.dtype, k_cache.shape, k_cache.stride(), v_cache.data_ptr(),
                v_cache.dtype, v_cache.shape, v_cache.stride(), cos_sin.data_ptr(), cos_sin.dtype, cos_sin.shape,
                cos_sin.stride(), w1.data_ptr(), w2.data_ptr(), *[0 if t is None else t.data_ptr() for t in stores],
                *[None if t is None else _layout(t) for t in (k_scale, v_scale, *qkw)])
        cached = self.__dict__.get("_native_linears_cache")
        if cached is not None and cached[1] == ids and cached[2] == ptrs:
            return cached[3]
        linears = None
        if k_scale is None:
            cache_ok = k_cache.dtype == dt and v_cache.dtype == dt
        else:  # 1-byte codes with fp32 scales [pages, page_size, Hk], at a shape the native attention reads
            cache_ok = (v_scale is not None and k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
                        and v_cache.dtype == k_cache.dtype and k_scale.dtype == v_scale.dtype == torch.float32
                        and k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.is_contiguous()
                        and v_scale.is_contiguous())
        qk_ok = qk == (None, None) or (
            all(type(n) is RMSNorm and n.offset == 0.0 and n.weight.dtype == dt and n.weight.shape == (attn.head_dim,)
                for n in qk) and qk[0].eps == qk[1].eps)
        if (cache_ok and qk_ok and mlp.act is silu_and_mul
                and all(n.offset == 0.0 and n.weight.dtype == dt and n.weight.shape == (hidden,) for n in (n1, n2))
                and k_cache.is_contiguous()
                and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                and k_cache.shape[2:] == (attn.num_kv_heads, attn.head_dim) and cos_sin.dtype == torch.float32
                and cos_sin.shape[-1] == attn.head_dim and cos_sin.is_contiguous()):
            linears = [cpu_native.layer_linear(lin, dt, bias_ok=i == 0) for i, lin in enumerate(lins)]  # qkv's
            linears = None if None in linears else linears
        # last: the tensors whose data pointers the answer rests on, for LlamaForCausalLM._native_stack
        weights = [w1, w2, *(t for t in (*stores, *qkw) if t is not None)]
        self.__dict__["_native_linears_cache"] = (objs, ids, ptrs, linears, weights)
        return linears


def _lora_operands(layer: nn.Module):
    """The fused native layer's LoRA operands for ``layer`` this step (``LoRAManager.native_operands``): None without
    adapters in the step (or without LoRA), False where the layer must run op by op."""
    qkv = layer.self_attn._modules["qkv_proj"]
    mgr = qkv.__dict__.get("manager")  # a lora.LoRALinear keeps its manager there
    return None if mgr is None else mgr.native_operands(qkv.layer_index)


def _native_step(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """The per-step half of ``LlamaDecoderLayer._native_decode``: decode rows on the CPU, up to ``NATIVE_MAX_ROWS``
    of them, one per sequence, the native layer ops and fused layers on, no backend override."""
    return (x.device.type == "cpu" and meta.decode_only and x.dim() == 2 and x.shape[0] <= NATIVE_MAX_ROWS
            and not meta.shared_seqs and cpu_native.fused_layers_on() and cpu_native.layer_ops_apply(x)
            and meta.seq_lens.shape == (x.shape[0],) and meta.block_table.shape[0] == x.shape[0]
            and not os.environ.get("INFERCORE_BACKEND"))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None,
                 layer_class: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        layer_class = layer_class or LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_class(config, i, dtype=dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over paged KV.

    Module names follow HF (``model.layers.{i}.self_attn.qkv_proj`` ...) except that q/k/v and gate/up
    are merged. The RoPE cos/sin table (fp32, ``[max_position_embeddings, rotary_dim]``) is a
    non-persistent buffer built once.

    ``decoder_layer``: the layer class a family builds its stack from (``LlamaDecoderLayer`` here; Granite's and
    OLMo 2's subclasses of this model name theirs). ``tensor_parallel_unsupported``: why
    :func:`~infercore.parallel.tensor_parallel_` refuses the family (None: it shards like Llama).
    """

    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    tensor_parallel_unsupported: str | None = None
    # Phi-3 checkpoints store qkv_proj / gate_up_proj merged, as this model holds them
    _MERGED_CHECKPOINT = False

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if self.decoder_layer is LlamaDecoderLayer and (config.post_norm or config.qk_proj_norm
                                                        or config.residual_multiplier != 1.0):
            # those decoder layers live in other classes; this one would drop them silently
            raise ValueError(f"{type(self).__name__}: config of model_type={config.model_type!r} needs its "
                             "family's class (post_norm / qk_proj_norm: Olmo2ForCausalLM, residual_multiplier: "
                             "GraniteForCausalLM; build_model picks it)")
        self.config = config
        self.model = LlamaModel(config, dtype=dtype, layer_class=self.decoder_layer)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.finish_init()

    def finish_init(self) -> None:
        """(Re)build what is not a checkpoint weight: the embedding tie and the RoPE table.

        Call again after materialising a model built on the ``meta`` device (``to_empty`` replaces
        parameters one by one, which unties shared ones, and leaves buffers uninitialised).
        """
        self.cos_sin_cache = tie_and_rope_table(self, base=self.config.rope_theta, scaling=self.config.rope_scaling)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the decoder over one ragged step.

        Args:
            input_ids: ``[T]`` int32/int64 token ids, all sequences of the step concatenated.
            positions: ``[T]`` int32/int64 absolute position of each token.
            kv_caches: one ``(k_cache, v_cache)`` per layer, each ``[num_pages, page_size, Hk, D]``;
                this step's keys/values are written at ``meta.slot_mapping``.
            meta: the step's :class:`~infercore.ops.AttentionMetadata`.

        Returns:
            ``[T, hidden_size]`` final-normed hidden states in the model dtype (pass the rows you need
            to :meth:`compute_logits`).
        """
        layers = self.model.layers
        check_step(input_ids, positions, kv_caches, len(layers))
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite
            x = x * self.config.embedding_multiplier
        residual = None
        cos_sin = self.cos_sin_cache
        table = self._native_stack(x, cos_sin, kv_caches, meta)
        if table is not None:  # CPU decode: every layer in one native call
            mgr = self.__dict__.get("lora_manager")
            lora = None if mgr is None else mgr.native_operands()
            kw = {} if lora is None else {"lora": lora}  # (a step without adapters passes none)
            x, residual = cpu_native.llama_decode_layers(x, layers, positions, cos_sin, kv_caches, meta, table, **kw)
        else:
            for layer, kv_cache in zip(layers, kv_caches):
                x, residual = layer(x, residual, positions, cos_sin, kv_cache, meta)
        norm = self.model.norm
        x, _ = fused_add_rms_norm(x, residual, norm.weight, eps=norm.eps)
        return x

    def _native_stack(self, x, cos_sin, kv_caches, meta):
        """``cpu_native.llama_decode_layers``' table where every layer takes its fused decode step
        (``LlamaDecoderLayer._native_decode``) and all are alike (heads, head_dim, intermediate size, cache shape),
        else None. The table is kept while the layers' descriptors stay the same (their weights and caches)."""
        layers = self.model.layers
        lora = self.__dict__.get("lora_manager")
        if lora is not None and lora.native_operands() is False:  # LoRA this step, not through the native kernel
            return None
        if not (len(layers) and cpu_native.layer_stack_on() and _native_step(x, meta)
                and _codes_readable(layers[0].self_attn, next((kv for kv in kv_caches if hasattr(kv, "k_scale")),
                                                               kv_caches[0]))):  # the layers' shapes alike (below)
            return None
        dt, hidden = x.dtype, x.shape[1]
        # Checked each step: no module / parameter / buffer was assigned anywhere since the table was built, the same
        # layers, caches (by address and layout: a freed KV pool is not kept alive) and RoPE table, and the weights'
        # data pointers (a ``.data`` swap registers nothing). Else every layer's checks run again.
        fast = self.__dict__.get("_native_stack_fast")
        if fast is not None and _stack_step_key(_registrations[0], x, layers, cos_sin, kv_caches) == fast[0] \
                and list(map(torch.Tensor.data_ptr, fast[1])) == fast[2]:
            return fast[3]
        version = _registrations[0]
        linears = []
        for layer, kv_cache in zip(layers, kv_caches):
            ok = isinstance(layer, LlamaDecoderLayer) and len(kv_cache) == 2
            lin = layer._native_linears(dt, hidden, kv_cache[0], kv_cache[1], cos_sin,
                                        *_scales(kv_cache)) if ok else None
            if lin is None:
                return None
            linears.append(lin)
        key = tuple(linears)  # each layer's list is the same object while its weights and caches are
        cached = self.__dict__.get("_native_stack_cache")
        if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key)):
            table = cached[1]
        else:
            a0, m0, k0 = layers[0].self_attn, layers[0].mlp, kv_caches[0][0]
            alike = all((l.self_attn.num_heads, l.self_attn.num_kv_heads, l.self_attn.head_dim, l.self_attn.scale,
                         l.mlp.down_proj.in_features, kv[0].shape) == (a0.num_heads, a0.num_kv_heads, a0.head_dim,
                                                                        a0.scale, m0.down_proj.in_features, k0.shape)
                        for l, kv in zip(layers, kv_caches))  # fmt: skip
            table = cpu_native.decode_layers_table(layers, kv_caches, linears) if alike else None
            self.__dict__["_native_stack_cache"] = (key, table)
        weights = [t for layer in layers for t in layer.__dict__["_native_linears_cache"][4]]
        self.__dict__["_native_stack_fast"] = (_stack_step_key(version, x, layers, cos_sin, kv_caches), weights,
                                               list(map(torch.Tensor.data_ptr, weights)), table)
        return table

    def compute_logits(self, hidden: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
        """``hidden [N, H]`` -> logits ``[N, vocab_size]`` (tied to the embedding when configured; divided by
        Granite's ``logits_scaling``): fp32, or with ``fp32=False`` the lm_head's own dtype (what the sampler
        reads, skipping a widening copy)."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # in the head's dtype, as HF divides
            logits = logits / self.config.logits_scaling
        return logits.float() if fp32 else logits

    def kv_specs(self) -> list[FullAttentionSpec]:
        """One KV spec per layer (the paged cache each layer expects)."""
        dtype = self.model.embed_tokens.weight.dtype
        return [
            FullAttentionSpec(
                num_kv_heads=layer.self_attn.num_kv_heads,
                head_dim=layer.self_attn.head_dim,
                dtype=dtype,
                sliding_window=layer.self_attn.sliding_window,
            )
            for layer in self.model.layers
        ]

    # ------------------------------------------------------------------ weights
    _STACKED = {  # HF projection name -> (merged module name, shard index)
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    _STACKED_RE = re.compile(r"^(.*\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
    # Saved by some older exports; recomputed here.
    _IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

    def _shard_rows(self, merged: str, shard: int) -> tuple[int, int]:
        cfg = self.config
        if merged == "qkv_proj":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        i = cfg.intermediate_size
        return (shard * i, (shard + 1) * i)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (casting to each parameter's dtype/device).

        q/k/v and gate/up are stacked into the merged projections. With tied embeddings an
        ``lm_head.weight`` in the checkpoint is ignored. Raises ``ValueError`` naming the tensor for an
        unknown name, a shape mismatch, a duplicate, or (after the iterable ends) any missing tensor.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        tied = self.config.tie_word_embeddings
        # Everything we expect to receive: plain parameters and each shard of the merged ones.
        expected: set[str] = set()
        for name in params:
            if tied and name == "lm_head.weight":
                continue
            if not self._MERGED_CHECKPOINT and (".qkv_proj." in name or ".gate_up_proj." in name):
                merged = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
                for hf, (m, _) in self._STACKED.items():
                    if m == merged:
                        expected.add(name.replace(merged, hf))
            else:
                expected.add(name)
        seen: set[str] = set()
        for hf_name, tensor in weights:
            if self._IGNORED_RE.search(hf_name) or (tied and hf_name == "lm_head.weight"):
                continue
            if hf_name not in expected and f"model.{hf_name}" in expected:  # a bare decoder's (LlamaModel's) names
                hf_name = f"model.{hf_name}"
            if hf_name not in expected:
                raise ValueError(
                    f"load_weights: unexpected tensor {hf_name!r} for {self.config.architecture}"
                )
            if hf_name in seen:
                raise ValueError(f"load_weights: tensor {hf_name!r} given twice")
            seen.add(hf_name)
            m = None if self._MERGED_CHECKPOINT else self._STACKED_RE.match(hf_name)
            if m is not None:
                prefix, proj, kind = m.groups()
                merged, shard = self._STACKED[proj]
                param = params[f"{prefix}{merged}.{kind}"]
                start, end = self._shard_rows(merged, shard)
                target = param.data[start:end]
            else:
                target = params[hf_name].data
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_weights: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
        missing = expected - seen
        if missing:
            listed = ", ".join(sorted(missing)[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"load_weights: {len(missing)} tensors missing from the checkpoint: {listed}")


# Mistral, Qwen2 and Qwen3 differ from Llama only in what ModelConfig.from_hf resolves (window,
# biases, qk-norm); the names exist so registries and reprs read naturally.
class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder (partial rotary and LongRoPE come from the config) whose
    checkpoints store ``qkv_proj`` and ``gate_up_proj`` merged, in this model's row order (q, k, v; gate, up)."""

    _MERGED_CHECKPOINT = True


class LlamaForSequenceClassification(LlamaForCausalLM):
    """A decoder with HF's sequence-classification head: ``score`` ``[num_labels, hidden]`` (no bias) applied to the
    final-normed hidden state of the last token (:meth:`compute_scores`). The checkpoint has no ``lm_head``; the
    inherited one is tied to the embedding matrix so the module stays a causal LM in shape, and the engine refuses to
    generate from it."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None) -> None:
        if config.num_labels < 1 or not config.tie_word_embeddings:
            raise ValueError(f"{type(self).__name__}: the config needs labels and a tied lm_head (got "
                             f"num_labels={config.num_labels}, tie_word_embeddings={config.tie_word_embeddings})")
        super().__init__(config, dtype=dtype)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False, dtype=dtype)

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` (final-normed, any float dtype) -> fp32 label logits ``[N, num_labels]``, computed in
        fp32 from the score weight."""
        w = self.score.weight
        return hidden.to(w.device, torch.float32) @ w.float().t()


class MistralForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    pass


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    pass


class Phi3ForSequenceClassification(LlamaForSequenceClassification):
    """Phi-3 with the sequence-classification head (merged ``qkv_proj`` / ``gate_up_proj`` in the checkpoint)."""

    _MERGED_CHECKPOINT = True


__all__ = [
    "LlamaForSequenceClassification",
    "MistralForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
    "Phi3ForSequenceClassification",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
]
