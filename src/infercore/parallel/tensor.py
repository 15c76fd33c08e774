"""Tensor parallelism (Megatron layout) over ``torch.distributed`` for the Llama family, Gemma 3, Qwen3-Next,
Mamba2 and Bamba.

Each rank of a process group keeps a slice of every layer and the same replicated rest:

- ``qkv_proj`` (column-parallel): the rank's query heads, then its KV heads (``num_heads / tp`` and
  ``num_kv_heads / tp``), so attention and the paged KV cache of each rank hold only its heads;
- ``o_proj`` and ``down_proj`` (row-parallel): the matching input columns, wrapped in :class:`RowParallel`,
  which sums the outputs over the group (``all_reduce``); a bias is added by rank 0 only;
- ``gate_up_proj`` (column-parallel): the rank's slice of the gate rows and the same slice of the up rows;
- ``lm_head`` (vocabulary-parallel): a slice of the vocabulary, wrapped in :class:`VocabParallel`, which gathers
  the logits over the group (``all_gather``), so every rank samples from the whole distribution;
- gated DeltaNet layers (Qwen3-Next): the rank's key heads with their value heads, i.e. a contiguous block of
  ``in_proj_qkvz`` / ``in_proj_ba`` rows (HF groups them per key head), the matching conv channels, ``dt_bias`` and
  ``A_log`` entries, so each rank's conv and recurrent states hold only its heads; ``out_proj`` row-parallel;
- Mamba2 mixers (Mamba2, Bamba): the rank's heads (``in_proj``'s gate, x and dt rows, the conv's x channels,
  ``dt_bias`` / ``A_log`` / ``D``, the gated norm's channels), B and C by groups where ``n_groups`` splits, else
  whole on every rank, with the gated norm's mean square summed over the group; ``out_proj`` row-parallel;
- embeddings and norms (the per-head q / k norms and DeltaNet's gated norm included): replicated;
- LoRA slots (:func:`~infercore.lora.enable_lora_` after sharding): B by the rank's rows of a column-parallel
  projection, A by the input columns of a row-parallel one, inside its :class:`RowParallel` (``infercore.lora.layers``);
- routed experts (Mixtral / Qwen-MoE): every expert keeps the rank's slice of its intermediate width, or (expert
  parallelism, ``experts="ep"``) each rank keeps whole experts and skips the pairs routed to the others; the shared
  expert is split by width; the router is replicated, so every rank routes every token alike, and the whole block's
  output is summed over the group (one ``all_reduce`` per block, :class:`RowParallel` around the block).

The shards stay ``nn.Linear`` modules inside the wrappers, so the device layouts' class swaps and
:func:`~infercore.quant.quantize` (per shard) apply to them as to an unsharded model.

Every rank then runs the same :class:`~infercore.Engine` loop on the same requests (SPMD): the scheduler is
deterministic, the collectives give every rank the same activations, and the engine draws the seeds of unseeded
requests from a stream that rank 0 seeds (:func:`shared_seed`), so the ranks sample the same tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..models.moe import SparseMoeBlock
from .shm import ShmGroup, shm_group


def _group_size_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("tensor_parallel_: torch.distributed is not initialized (call init_process_group first)")
    return dist.get_world_size(group), dist.get_rank(group)


def _slice_rows(w: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    """Rows ``[a, b)`` of ``w`` for each ``(a, b)`` of ``parts``, concatenated (a new contiguous tensor)."""
    return torch.cat([w[a:b] for a, b in parts]).contiguous()


def _set(mod: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    mod.weight = nn.Parameter(weight, requires_grad=False)
    mod.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
    mod.out_features, mod.in_features = weight.shape


class RowParallel(nn.Module):
    """This rank's input columns of a row-parallel projection. ``linear`` maps ``[..., K / tp]`` to ``[..., N]``
    (an ``nn.Linear`` or what a layout or quantization made of it); the output ``[..., N]`` is summed over
    ``group`` in place. Also wraps a whole routed-expert block, whose output is this rank's partial sum."""

    def __init__(self, linear: nn.Module, group, shm: ShmGroup | None = None) -> None:
        super().__init__()
        self.linear, self.group, self.shm = linear, group, shm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce_(self.linear(x), self.group, self.shm)


class VocabParallel(nn.Module):
    """This rank's slice of the vocabulary: ``linear`` maps ``[..., H]`` to ``[..., V / tp]``; the logits
    ``[..., V]`` are the group's slices gathered in rank order."""

    def __init__(self, linear: nn.Module, group, world: int, shm: ShmGroup | None = None) -> None:
        super().__init__()
        self.linear, self.group, self.world, self.shm = linear, group, world, shm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).contiguous()
        if self.shm is not None and self.shm.fits(y):
            return torch.cat(self.shm.all_gather(y), dim=-1)
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=-1)


@torch.no_grad()
def tensor_parallel_(model: nn.Module, group=None, *, experts: str = "tp") -> nn.Module:
    """Shard a loaded model in place over ``group`` (default: the world), as this rank's slice; see the module
    docstring for the layout. Call it on every rank with the same weights, before building the Engine.

    Families: the Llama family (:class:`~infercore.models.llama.LlamaForCausalLM`: Llama, Mistral, Qwen2 / Qwen3,
    SmolLM2, Phi-3, Granite 3, OLMo 2 (its whole-projection q / k norms from the group's partial sums of squares),
    the routed-expert Mixtral / Qwen2-MoE / Qwen3-MoE, DeepSeek-V2 / V3 (its latent attention by query heads, the
    latent cache whole on every rank) and GPT-OSS (the sinks by query heads, the biased experts by width or whole)),
    Gemma 2 / 3 (:class:`~infercore.models.gemma3.Gemma3ForCausalLM`: its sliding and global
    layers alike), Qwen3-Next (:class:`~infercore.models.qwen3_next.Qwen3NextForCausalLM`: the gated attention by
    heads, each gated DeltaNet layer by key heads, the routed experts as in the Llama family), Mamba2, Bamba and
    Granite 4.0 hybrid (:class:`~infercore.models.mamba2.Mamba2ForCausalLM` / ``BambaForCausalLM``: each mixer by
    heads; Granite's experts and ungated shared MLP summed once; Falcon-H1's attention and mixer side by side, its
    per-segment multipliers rebuilt for the rank's rows) and Nemotron-H (each block by its kind).

    ``experts`` (routed-expert models): ``"tp"`` gives every rank a slice of every expert's width; ``"ep"`` (expert
    parallelism) gives each rank whole experts, ``num_experts / tp`` of them, and the rank skips the (token, expert)
    pairs routed to the others. Either way the shared expert is split by width and the block's output summed.

    Returns the model, with ``model.tp_group`` (``group``), ``tp_size`` and ``tp_rank`` set, and ``tp_shm``: the
    :class:`~infercore.parallel.shm.ShmGroup` its CPU ranks exchange through (None on GPUs, across hosts, or
    with ``INFERCORE_SHM_COLLECTIVES=0``).

    Raises:
        TypeError: ``model`` is none of these families, or is quantized (quantize after sharding).
        ValueError: the model's family cannot be sharded (its class names why in ``tensor_parallel_unsupported``),
            the model has LoRA slots (shard first, then :func:`~infercore.lora.enable_lora_`),
            ``torch.distributed`` is not initialized, or the group size does not divide the number of
            query heads, KV heads, DeltaNet key heads, Mamba2 heads or groups (more than one), an MLP or expert
            width or the vocabulary (each named).
    """
    from ..models.deepseek import MLAttention
    from ..models.gemma3 import Gemma3ForCausalLM
    from ..models.gpt_oss import GptOssMLP
    from ..models.granite_hybrid import GraniteMoeHybridForCausalLM
    from ..models.llama import LlamaForCausalLM
    from ..models.mamba2 import BambaForCausalLM, Mamba2ForCausalLM
    from ..models.nemotron_h import NemotronHForCausalLM
    from ..models.olmo2 import Olmo2Attention
    from ..models.qwen3_next import Qwen3NextForCausalLM

    families = (LlamaForCausalLM, Gemma3ForCausalLM, Qwen3NextForCausalLM, Mamba2ForCausalLM, BambaForCausalLM)
    if not isinstance(model, families):
        raise TypeError(f"tensor_parallel_: model must be a Llama-family, Gemma 3, Qwen3-Next, Mamba2 or Bamba model, "
                        f"got {type(model).__name__}")
    if getattr(model, "tensor_parallel_unsupported", None):  # a family this layout would shard wrongly
        raise ValueError(f"tensor_parallel_: {type(model).__name__}: {model.tensor_parallel_unsupported}")
    if hasattr(model, "tp_size"):
        raise ValueError("tensor_parallel_: model is already sharded")
    if getattr(model, "lora_manager", None) is not None:
        raise ValueError("tensor_parallel_: LoRA is already enabled on this model; shard it first, then enable LoRA "
                         "(lora.enable_lora_ or Engine(max_loras=...)), which gives each rank its slice of the "
                         "adapters")
    tp, rank = _group_size_rank(group)
    cfg = model.config
    if experts not in ("tp", "ep"):
        raise ValueError(f"tensor_parallel_: experts must be 'tp' or 'ep', got {experts!r}")
    layers = model.backbone.layers if isinstance(model, Mamba2ForCausalLM) else model.model.layers
    mlps = [m for layer in layers if (m := getattr(layer, "mlp", getattr(layer, "feed_forward", None))) is not None]
    widths = [("vocab_size", cfg.vocab_size)]
    if any(hasattr(layer, "self_attn") for layer in layers):
        widths += [("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)]
    if any(hasattr(layer, "linear_attn") for layer in layers):  # the value heads are a multiple of the key heads
        widths.append(("linear_num_key_heads", cfg.linear_num_key_heads))
    if isinstance(model, (Mamba2ForCausalLM, BambaForCausalLM)) and any(_mixer(layer) for layer in layers):
        widths.append(("mamba_heads", cfg.mamba_heads))
        if cfg.n_groups > 1:  # one group is kept whole on every rank, more are split
            widths.append(("n_groups", cfg.n_groups))
    sparse = [isinstance(m, SparseMoeBlock) for m in mlps]
    if isinstance(model, NemotronHForCausalLM):
        widths = [("vocab_size", cfg.vocab_size), *_nemotron_h_widths(cfg, {layer.kind for layer in layers},
                                                                        by_expert=experts == "ep")]
    elif isinstance(model, GraniteMoeHybridForCausalLM):
        if cfg.num_experts:
            widths.append(("intermediate_size", cfg.intermediate_size) if experts == "tp"
                          else ("num_experts", cfg.num_experts))  # fmt: skip
        if cfg.shared_intermediate_size:
            widths.append(("shared_intermediate_size", cfg.shared_intermediate_size))
    elif not all(sparse):
        widths.append(("intermediate_size", cfg.intermediate_size))
    if any(sparse) and not isinstance(model, GraniteMoeHybridForCausalLM):
        widths.append(("moe_intermediate_size", cfg.moe_intermediate_size) if experts == "tp"
                      else ("num_experts", cfg.num_experts))
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            widths.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    for name, n in widths:
        if n % tp:
            raise ValueError(f"tensor_parallel_: the group size {tp} does not divide {name}={n}")
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and type(mod) is not nn.Linear:
            raise TypeError(f"tensor_parallel_: shard the model before any layout or quantization swap "
                            f"(found {type(mod).__name__})")
        if not isinstance(mod, nn.Linear) and hasattr(mod, "qweight_format"):
            raise TypeError("tensor_parallel_: quantized linears are not sharded; shard the dense model, then "
                            "quantize it")
    # CPU ranks on one host exchange through shared memory (gloo's loopback round trips cost ~1 ms each)
    shm = shm_group(group) if next(model.parameters()).device.type == "cpu" else None
    # Qwen3-Next's q_proj emits [q, gate] per head: 2 * head_dim rows a query head
    q_per_head = 2 if isinstance(model, Qwen3NextForCausalLM) else 1
    for layer in layers:
        if isinstance(model, NemotronHForCausalLM):
            _shard_nemotron_h_block_(layer, tp, rank, group, shm, by_expert=experts == "ep")
            continue
        if hasattr(layer, "linear_attn"):
            _shard_delta_net_(layer.linear_attn, tp, rank, group, shm)
        elif _mixer(layer) is not None:
            _shard_mamba2_mixer_(_mixer(layer), tp, rank, group, shm)
            if hasattr(layer, "self_attn"):  # Falcon-H1: attention beside the mixer in every layer
                _shard_attention_(layer.self_attn, tp, rank, group, shm, q_per_head=1)
        elif isinstance(layer.self_attn, MLAttention):
            _shard_mla_(layer.self_attn, tp, rank, group, shm)
        else:
            full = (layer.self_attn.q_size, layer.self_attn.kv_size)
            _shard_attention_(layer.self_attn, tp, rank, group, shm, q_per_head=q_per_head)
            if isinstance(layer.self_attn, Olmo2Attention):  # q / k norms over every head's columns
                _shard_whole_qk_norms_(layer.self_attn, full, rank, group, shm)
            if getattr(layer.self_attn, "sinks", None) is not None:  # GPT-OSS: one sink logit per query head
                sinks, h = layer.self_attn.sinks, layer.self_attn.num_heads
                layer.self_attn.sinks = nn.Parameter(sinks[rank * h : (rank + 1) * h].clone(), requires_grad=False)
        if isinstance(model, GraniteMoeHybridForCausalLM):  # routed experts and / or the ungated shared MLP
            if layer.block_sparse_moe is not None:
                _shard_moe_(layer.block_sparse_moe, tp, rank, by_expert=experts == "ep")
            if layer.shared_mlp is not None:
                _shard_gated_mlp_(layer.shared_mlp, tp, rank, None, reduce=False)
            layer.ffn_reduce = functools.partial(_all_reduce_, group=group, shm=shm)  # one sum for both
        elif isinstance(getattr(layer, "mlp", None), GptOssMLP):
            _shard_gpt_oss_experts_(layer.mlp.experts, tp, rank, by_expert=experts == "ep")
            layer.mlp = RowParallel(layer.mlp, group, shm)
        elif isinstance(getattr(layer, "mlp", None), SparseMoeBlock):
            _shard_moe_(layer.mlp, tp, rank, by_expert=experts == "ep")
            layer.mlp = RowParallel(layer.mlp, group, shm)  # experts and shared expert: partial sums, one all_reduce
        elif hasattr(layer, "mlp") or hasattr(layer, "feed_forward"):
            _shard_gated_mlp_(getattr(layer, "mlp", None) or layer.feed_forward, tp, rank, group, reduce=True, shm=shm)
    v = cfg.vocab_size // tp
    head = model.lm_head  # tied to the embedding or not, the slice is a new tensor: the embedding stays whole
    _set(head, head.weight[rank * v : (rank + 1) * v].clone(), None)
    model.lm_head = VocabParallel(head, group, tp, shm)
    model.tp_group, model.tp_shm = group, shm
    model.tp_size, model.tp_rank = tp, rank
    return model


def _shard_attention_(attn: nn.Module, tp: int, rank: int, group, shm: ShmGroup | None, *, q_per_head: int) -> None:
    """``qkv_proj`` column-parallel (the rank's query heads, each ``q_per_head * head_dim`` rows, then its KV
    heads), ``o_proj`` row-parallel over the matching columns; the module's head counts become the rank's."""
    d = attn.head_dim
    hq, hk = attn.num_heads // tp, attn.num_kv_heads // tp
    q_rows, kv_rows, qh = attn.num_heads * d * q_per_head, attn.num_kv_heads * d, d * q_per_head
    qkv = [(rank * hq * qh, (rank + 1) * hq * qh),
           (q_rows + rank * hk * d, q_rows + (rank + 1) * hk * d),
           (q_rows + kv_rows + rank * hk * d, q_rows + kv_rows + (rank + 1) * hk * d)]
    p = attn.qkv_proj
    _set(p, _slice_rows(p.weight, qkv), None if p.bias is None else _slice_rows(p.bias, qkv))
    attn.num_heads, attn.num_kv_heads = hq, hk
    attn.q_size, attn.kv_size = hq * d, hk * d
    p = attn.o_proj
    _set(p, p.weight[:, rank * hq * d : (rank + 1) * hq * d].contiguous(), p.bias if rank == 0 else None)
    attn.o_proj = RowParallel(p, group, shm)


def _shard_mla_(attn: nn.Module, tp: int, rank: int, group, shm: ShmGroup | None) -> None:
    """DeepSeek's latent attention by query heads: the rank's rows of ``q_proj`` / ``q_b_proj`` (``qk_head_dim`` a
    head) and of ``kv_b_proj`` (``qk_nope_head_dim + v_head_dim`` a head: its heads' ``W_UK`` / ``W_UV``), ``o_proj``
    row-parallel over its heads' value columns. The down projections (``q_a_proj``, ``kv_a_proj_with_mqa``), their
    norms and the latent cache (one head shared by all query heads) stay whole on every rank."""
    h = attn.num_heads // tp
    q = attn.q_proj if "q_proj" in attn._modules else attn.q_b_proj
    per = q.out_features // attn.num_heads
    _set(q, q.weight[rank * h * per : (rank + 1) * h * per].contiguous(),
         None if q.bias is None else q.bias[rank * h * per : (rank + 1) * h * per])  # fmt: skip
    kvb, per = attn.kv_b_proj, attn.nope + attn.v_dim
    _set(kvb, kvb.weight[rank * h * per : (rank + 1) * h * per].contiguous(), None)
    p = attn.o_proj
    _set(p, p.weight[:, rank * h * attn.v_dim : (rank + 1) * h * attn.v_dim].contiguous(),
         p.bias if rank == 0 else None)  # fmt: skip
    attn.o_proj = RowParallel(p, group, shm)
    attn.num_heads = h


def _shard_whole_qk_norms_(attn: nn.Module, full: tuple[int, int], rank: int, group, shm: ShmGroup | None) -> None:
    """OLMo 2's ``q_norm`` / ``k_norm`` span the whole projections: the rank keeps its heads' columns of their weights
    and sums the squares over the group (``norm_reduce``) against the unsharded widths ``full``."""
    for norm, n in ((attn.q_norm, attn.q_size), (attn.k_norm, attn.kv_size)):
        norm.weight = nn.Parameter(norm.weight[rank * n : (rank + 1) * n].clone(), requires_grad=False)
    attn.norm_reduce, attn.norm_widths = functools.partial(_all_reduce_, group=group, shm=shm), full


def _shard_gpt_oss_experts_(ex: nn.Module, tp: int, rank: int, *, by_expert: bool) -> None:
    """GPT-OSS's experts by width: ``gate_up_proj [E, H, 2I]`` holds (gate, up) column pairs interleaved, so the rank's
    ``I / tp`` pairs are one contiguous block of ``2I / tp`` columns (and of ``gate_up_proj_bias``); ``down_proj``
    ``[E, I, H]`` the matching rows; ``down_proj_bias`` on rank 0 only (the block's output is summed over the ranks).
    With ``by_expert`` the rank keeps whole experts ``[rank E / tp, (rank + 1) E / tp)`` with their biases
    (``expert_offset``). The router stays whole, so every rank routes alike."""
    if by_expert:
        n = ex.gate_up_proj.shape[0] // tp
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            t = getattr(ex, name)
            setattr(ex, name, nn.Parameter(t[rank * n : (rank + 1) * n].contiguous(), requires_grad=False))
        ex.expert_offset = rank * n
        return
    w = ex.gate_up_proj.shape[2] // tp
    ex.gate_up_proj = nn.Parameter(ex.gate_up_proj[:, :, rank * w : (rank + 1) * w].contiguous(), requires_grad=False)
    ex.gate_up_proj_bias = nn.Parameter(ex.gate_up_proj_bias[:, rank * w : (rank + 1) * w].contiguous(),
                                        requires_grad=False)  # fmt: skip
    i = ex.down_proj.shape[1] // tp
    ex.down_proj = nn.Parameter(ex.down_proj[:, rank * i : (rank + 1) * i].contiguous(), requires_grad=False)
    if rank:
        ex.down_proj_bias = nn.Parameter(torch.zeros_like(ex.down_proj_bias), requires_grad=False)


def _nemotron_h_widths(cfg, kinds: set[str], *, by_expert: bool) -> list[tuple[str, int]]:
    """The widths a Nemotron-H model's layer kinds shard (``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE)."""
    from ..models.nemotron_h import ATTENTION, MAMBA, MLP, MOE

    widths = []
    if MAMBA in kinds:
        widths.append(("mamba_heads", cfg.mamba_heads))
        if cfg.n_groups > 1:
            widths.append(("n_groups", cfg.n_groups))
    if ATTENTION in kinds:
        widths += [("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)]
    if MLP in kinds:
        widths.append(("intermediate_size", cfg.intermediate_size))
    if MOE in kinds:
        routed = ("num_experts", cfg.num_experts) if by_expert else ("moe_intermediate_size", cfg.moe_intermediate_size)
        widths += [routed, ("moe_shared_intermediate_size", cfg.moe_shared_intermediate_size)]
    return widths


def _shard_relu2_mlp_(mlp: nn.Module, tp: int, rank: int) -> None:
    """Nemotron-H's ungated MLP: ``up_proj`` column-parallel (its bias sliced), ``down_proj`` row-parallel (its bias on
    rank 0); the caller sums the partial outputs."""
    p, n = mlp.up_proj, mlp.up_proj.out_features // tp
    _set(p, p.weight[rank * n : (rank + 1) * n].contiguous(),
         None if p.bias is None else p.bias[rank * n : (rank + 1) * n])  # fmt: skip
    p = mlp.down_proj
    _set(p, p.weight[:, rank * n : (rank + 1) * n].contiguous(), p.bias if rank == 0 else None)


def _shard_nemotron_h_block_(block: nn.Module, tp: int, rank: int, group, shm: ShmGroup | None, *,
                             by_expert: bool) -> None:  # fmt: skip
    """One Nemotron-H block by its kind: a Mamba2 mixer by heads, attention by heads, the MLP by width, the MoE's
    experts by width (or whole, ``by_expert``) and its shared MLP by width; the latent projections whole, the output
    latent projection's bias on rank 0. MLP and MoE outputs are summed over the group (``RowParallel``)."""
    from ..models.nemotron_h import ATTENTION, MAMBA, MLP

    mix = block.mixer
    if block.kind == MAMBA:
        _shard_mamba2_mixer_(mix, tp, rank, group, shm)
    elif block.kind == ATTENTION:
        _shard_attention_(mix, tp, rank, group, shm, q_per_head=1)
    elif block.kind == MLP:
        _shard_relu2_mlp_(mix, tp, rank)
        block.mixer = RowParallel(mix, group, shm)
    else:
        ex = mix.experts
        if by_expert:  # whole experts: the rank's [rank E / tp, (rank + 1) E / tp), the others' pairs skipped
            n = ex.up_proj.shape[0] // tp
            ex.up_proj = nn.Parameter(ex.up_proj[rank * n : (rank + 1) * n].contiguous(), requires_grad=False)
            ex.down_proj = nn.Parameter(ex.down_proj[rank * n : (rank + 1) * n].contiguous(), requires_grad=False)
            ex.expert_offset = rank * n
        else:
            i = ex.up_proj.shape[1] // tp
            ex.up_proj = nn.Parameter(ex.up_proj[:, rank * i : (rank + 1) * i].contiguous(), requires_grad=False)
            ex.down_proj = nn.Parameter(ex.down_proj[:, :, rank * i : (rank + 1) * i].contiguous(),
                                        requires_grad=False)  # fmt: skip
        _shard_relu2_mlp_(mix.shared_experts, tp, rank)
        fc2 = mix.fc2_latent_proj
        if fc2 is not None and fc2.bias is not None and rank:
            fc2.bias = None
        block.mixer = RowParallel(mix, group, shm)


def _mixer(layer: nn.Module) -> nn.Module | None:
    """A Mamba2 layer's mixer (``mixer`` in a pure Mamba2 block, ``mamba`` in a Bamba layer), else None."""
    return getattr(layer, "mixer", None) or getattr(layer, "mamba", None)


def _all_reduce_(t: torch.Tensor, group, shm: ShmGroup | None) -> torch.Tensor:
    """``t`` summed over ``group`` in place (through ``shm`` where it fits)."""
    if shm is not None and shm.fits(t):
        shm.all_reduce_(t)
    else:
        dist.all_reduce(t, group=group)
    return t


def _shard_mamba2_mixer_(mix: nn.Module, tp: int, rank: int, group, shm: ShmGroup | None) -> None:
    """A Mamba2 mixer by heads: the rank's rows of ``in_proj``'s gate, x and dt parts and its channels of the conv,
    ``dt_bias`` / ``A_log`` / ``D`` and the gated norm; B and C by groups where ``n_groups`` splits, else (one group)
    whole on every rank, and then the norm's mean square is summed over the ranks (``norm_reduce``). ``out_proj``
    row-parallel. The conv and SSM states shrink alike."""
    H, P, N, G, inner = mix.H // tp, mix.P, mix.N, mix.G, mix.inner
    ir = H * P
    split = G > 1
    g0, g1 = (rank * G // tp * N, (rank + 1) * G // tp * N) if split else (0, G * N)
    xs = (rank * ir, (rank + 1) * ir)
    conv = [xs, (inner + g0, inner + g1), (inner + G * N + g0, inner + G * N + g1)]
    rows = [xs, *[(inner + a, inner + b) for a, b in conv],
            (inner + mix.conv_dim + rank * H, inner + mix.conv_dim + (rank + 1) * H)]
    p = mix.in_proj
    _set(p, _slice_rows(p.weight, rows), None if p.bias is None else _slice_rows(p.bias, rows))
    c = mix.conv1d
    c.weight = nn.Parameter(_slice_rows(c.weight, conv), requires_grad=False)
    if c.bias is not None:
        c.bias = nn.Parameter(_slice_rows(c.bias, conv), requires_grad=False)
    for name in ("dt_bias", "A_log", "D"):
        setattr(mix, name, nn.Parameter(getattr(mix, name)[rank * H : (rank + 1) * H].clone(), requires_grad=False))
    if mix.norm is not None:  # Falcon-H1's mixers may have no gated norm
        mix.norm.weight = nn.Parameter(mix.norm.weight[xs[0] : xs[1]].clone(), requires_grad=False)
    p = mix.out_proj
    _set(p, p.weight[:, xs[0] : xs[1]].contiguous(), p.bias if rank == 0 else None)
    mix.out_proj = RowParallel(p, group, shm)
    if not split and mix.norm is not None:
        mix.norm_reduce, mix.norm_width = functools.partial(_all_reduce_, group=group, shm=shm), inner
    mix.H, mix.inner, mix.G = H, ir, G // tp if split else G
    mix.conv_dim = ir + 2 * mix.G * N
    if getattr(mix, "segment_scale", None) is not None:  # Falcon-H1: per-segment multipliers of in_proj's rows
        mix.segment_scale = torch.ones(mix.in_proj.out_features, dtype=mix.segment_scale.dtype,
                                       device=mix.segment_scale.device)  # fmt: skip
        mix.fill_segment_scale_()


def _shard_delta_net_(net: nn.Module, tp: int, rank: int, group, shm: ShmGroup | None) -> None:
    """A gated DeltaNet layer by key heads (each with its ``hv / hk`` value heads): the rank's rows of
    ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head, so one contiguous block each), its channels of the
    causal conv (its q, k and v heads), its ``dt_bias`` / ``A_log`` entries; ``out_proj`` row-parallel over its value
    heads' columns. The per-request conv and recurrent states shrink alike (``state_spec``)."""
    hk, hv, dk, dv = net.hk // tp, net.hv // tp, net.dk, net.dv
    r = net.hv // net.hk
    per_key = 2 * dk + 2 * r * dv
    p = net.in_proj_qkvz
    _set(p, p.weight[rank * hk * per_key : (rank + 1) * hk * per_key].contiguous(), None)
    p = net.in_proj_ba
    _set(p, p.weight[rank * hk * 2 * r : (rank + 1) * hk * 2 * r].contiguous(), None)
    conv = [(rank * hk * dk, (rank + 1) * hk * dk),
            (net.key_dim + rank * hk * dk, net.key_dim + (rank + 1) * hk * dk),
            (2 * net.key_dim + rank * hv * dv, 2 * net.key_dim + (rank + 1) * hv * dv)]
    net.conv1d.weight = nn.Parameter(_slice_rows(net.conv1d.weight, conv), requires_grad=False)
    for name in ("dt_bias", "A_log"):
        setattr(net, name, nn.Parameter(getattr(net, name)[rank * hv : (rank + 1) * hv].clone(), requires_grad=False))
    p = net.out_proj
    _set(p, p.weight[:, rank * hv * dv : (rank + 1) * hv * dv].contiguous(), None)
    net.out_proj = RowParallel(p, group, shm)
    net.hk, net.hv = hk, hv
    net.key_dim, net.value_dim = hk * dk, hv * dv
    net.conv_dim = 2 * net.key_dim + net.value_dim


def _gate_up_rows(width: int, tp: int, rank: int) -> list[tuple[int, int]]:
    """This rank's rows of a merged ``[gate; up]`` projection of ``width`` rows each."""
    part = width // tp
    return [(rank * part, (rank + 1) * part), (width + rank * part, width + (rank + 1) * part)]


def _shard_gated_mlp_(mlp: nn.Module, tp: int, rank: int, group, *, reduce: bool,
                      shm: ShmGroup | None = None) -> None:
    """``gate_up_proj`` column-parallel; ``down_proj`` row-parallel, wrapped in :class:`RowParallel` with
    ``reduce`` (else its partial sum is left to its block's sum)."""
    p = mlp.gate_up_proj
    rows = _gate_up_rows(p.out_features // 2, tp, rank)
    _set(p, _slice_rows(p.weight, rows), None if p.bias is None else _slice_rows(p.bias, rows))
    p = mlp.down_proj
    part = p.in_features // tp
    _set(p, p.weight[:, rank * part : (rank + 1) * part].contiguous(), p.bias if rank == 0 else None)
    if reduce:
        mlp.down_proj = RowParallel(p, group, shm)


def _shard_moe_(block: SparseMoeBlock, tp: int, rank: int, *, by_expert: bool) -> None:
    """Every expert keeps its slice of the intermediate width (``[E, 2I/tp, H]`` / ``[E, H, I/tp]``), or with
    ``by_expert`` the rank keeps whole experts ``[rank E/tp, (rank + 1) E/tp)`` (``block.expert_offset``); the
    shared expert is split by width, the router and the shared expert's gate stay whole. The block's output is then
    this rank's partial sum (the sigmoid gate scales each rank's part alike)."""
    ex = block.experts
    if getattr(ex, "gate_up_scale", None) is not None:
        raise ValueError("tensor_parallel_: the routed experts are quantized already; shard first, then quantize "
                         "(quantize(model, scheme, experts=True) after tensor_parallel_)")
    if by_expert:
        n = ex.gate_up_proj.shape[0] // tp
        ex.gate_up_proj = nn.Parameter(ex.gate_up_proj[rank * n : (rank + 1) * n].contiguous(), requires_grad=False)
        ex.down_proj = nn.Parameter(ex.down_proj[rank * n : (rank + 1) * n].contiguous(), requires_grad=False)
        block.expert_offset = rank * n
    else:
        rows = _gate_up_rows(ex.gate_up_proj.shape[1] // 2, tp, rank)
        ex.gate_up_proj = nn.Parameter(torch.cat([ex.gate_up_proj[:, a:b] for a, b in rows], 1).contiguous(),
                                       requires_grad=False)
        part = ex.down_proj.shape[2] // tp
        ex.down_proj = nn.Parameter(ex.down_proj[:, :, rank * part : (rank + 1) * part].contiguous(),
                                    requires_grad=False)
    if block.shared_expert is not None:
        _shard_gated_mlp_(block.shared_expert, tp, rank, None, reduce=False)
    if isinstance(getattr(block, "shared_experts", None), nn.Module):  # DeepSeekMoE's (ungated) shared experts
        _shard_gated_mlp_(block.shared_experts, tp, rank, None, reduce=False)


def _int_tensor(value: int, group) -> torch.Tensor:
    t = torch.tensor([value], dtype=torch.int64)
    return t.cuda() if dist.get_backend(group) == "nccl" else t  # NCCL: on this rank's current CUDA device


def shared_seed(group=None) -> int:
    """A random 63-bit seed drawn on rank 0 of ``group`` and broadcast, the same on every rank."""
    import random

    t = _int_tensor(random.getrandbits(63), group)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(t.item())


def group_min(value: int, group=None) -> int:
    """The smallest of every rank's ``value`` (the KV pool's page count, so that every rank schedules alike)."""
    t = _int_tensor(value, group)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
