"""The engine's hybrid-KV path: multi-granularity (or uniform) pages for models that mix full
attention, sliding-window attention and recurrent (Mamba2 / gated DeltaNet) layers.

* :func:`choose_kv_layout` decides between the dense :class:`~infercore.kv.BlockManager` and the
  :class:`~infercore.kv.hybrid.HybridBlockManager`.
* :func:`allocate_hybrid_kv_caches` turns a :class:`~infercore.kv.hybrid.HybridKVLayout` into one
  byte buffer and per-layer tensor views into it: ``(k_cache, v_cache)`` ``[num_small_pages,
  page_tokens, Hk, D]`` for attention layers, ``(conv_state, recurrent_state)`` ``[num_slots, ...]``
  for recurrent layers. Small page ``p`` of group ``g`` is row ``p`` of the group's
  ``[num_large * smalls_per_large(g), small_bytes]`` view; inside it, layer ``j`` of the group
  starts at ``j * layer_stride`` (keys then values; or recurrent state then conv state).
* :class:`HybridModelRunner` builds the per-layer :class:`~infercore.models.hybrid.HybridMetadata`
  and runs the manager's queued state copies (prefix-cache checkpoints) before each forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..kv.hybrid import HybridBlockManager, HybridKVLayout, LinearStateSpec, normalize_spec
from ..kv.hybrid.spec import LINEAR, SlidingWindowSpec
from ..models.hybrid import HybridMetadata, LinearStateMetadata
from ..ops import AttentionMetadata
from . import runner as runner_module
from .runner import ModelRunner
from .scheduler import ScheduledBatch

KV_LAYOUTS = (None, "dense", "multi", "uniform")


def choose_kv_layout(model: torch.nn.Module, specs: Sequence[object], requested: str | None) -> str:
    """``"dense"``, ``"multi"`` or ``"uniform"`` for ``model``.

    ``requested=None`` picks ``"multi"`` when the model supports hybrid metadata
    (``model.supports_hybrid_kv``) and declares sliding-window or recurrent layers, else ``"dense"``
    (so dense models keep their path unchanged).
    """
    if requested not in KV_LAYOUTS:
        raise ValueError(f"EngineConfig.kv_layout must be one of {KV_LAYOUTS}, got {requested!r}")
    norm = [normalize_spec(s, name=f"kv_specs()[{i}]") for i, s in enumerate(specs)]
    has_linear = any(isinstance(s, LinearStateSpec) for s in norm)
    supports = bool(getattr(model, "supports_hybrid_kv", False))
    if requested is None:
        mixed = has_linear or any(isinstance(s, SlidingWindowSpec) for s in norm)
        return "multi" if (supports and mixed) else "dense"
    if requested == "dense" and has_linear:
        raise ValueError("EngineConfig.kv_layout='dense' cannot hold the model's recurrent-state layers")
    if requested != "dense" and not supports:
        raise ValueError(
            f"EngineConfig.kv_layout={requested!r} needs a model that reads per-layer HybridMetadata; "
            f"{type(model).__name__} does not (supports_hybrid_kv is not set)"
        )
    return requested


def _typed_view(rows: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]):
    """Columns ``[start, start + nbytes)`` of a uint8 ``[rows, row_bytes]`` view, as ``dtype`` ``[rows, *shape]``."""
    cols = rows[:, start : start + nbytes]
    try:
        return cols.view(dtype).view(rows.shape[0], *shape)
    except RuntimeError as e:
        raise ValueError(
            f"hybrid KV layout: a {dtype} tensor at byte offset {start} of a {rows.shape[1]}-byte small "
            f"page is misaligned for its element size ({e})"
        ) from None


def allocate_hybrid_kv_caches(
    layout: HybridKVLayout, num_large_pages: int, *, device: torch.device | str
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """One zero-filled byte buffer of ``num_large_pages * layout.large_bytes`` and its views.

    Returns:
        ``(kv_caches, group_rows)``: ``kv_caches[i]`` is layer ``i``'s ``(k_cache, v_cache)`` or
        ``(conv_state, recurrent_state)``; ``group_rows[g]`` is group ``g``'s uint8
        ``[num_small_pages, small_bytes]`` view (whole small pages, for state copies).
    """
    # Zero-filled: attention may load (then mask) never-written slots, which must not hold NaN bits.
    buf = torch.zeros(num_large_pages * layout.large_bytes, dtype=torch.uint8, device=device)
    kv: list = [None] * layout.num_layers
    rows_of: list[torch.Tensor] = []
    for g, grp in enumerate(layout.groups):
        rows = buf.view(num_large_pages * layout.smalls_per_large(g), grp.small_bytes)
        rows_of.append(rows)
        spec = grp.spec
        for j, layer in enumerate(grp.layers):
            base = j * grp.layer_stride
            if grp.kind == LINEAR:
                rec_bytes = spec.recurrent_bytes
                rec = _typed_view(rows, base, rec_bytes, spec.recurrent_dtype, spec.recurrent_state_shape)
                conv = None
                if spec.conv_state_shape is not None:
                    conv = _typed_view(rows, base + rec_bytes, spec.conv_bytes, spec.conv_dtype, spec.conv_state_shape)
                kv[layer] = (conv, rec)
            else:
                shape = (layout.page_tokens, spec.num_kv_heads, spec.head_dim)
                half = grp.useful_bytes_per_layer // 2
                k = _typed_view(rows, base, half, grp.dtype, shape)
                v = _typed_view(rows, base + half, half, grp.dtype, shape)
                kv[layer] = (k, v)
    return kv, rows_of


def build_hybrid_kv(
    specs: Sequence[object],
    *,
    mode: str,
    page_tokens: int,
    budget_bytes: int,
    dtype: torch.dtype,
    device: torch.device,
    enable_prefix_caching: bool,
    checkpoint_interval: int | None = None,
) -> tuple[HybridBlockManager, list, list[torch.Tensor]]:
    """Layout, manager and cache tensors for ``budget_bytes`` of KV memory.

    The layout is sized for the budget (a large page that is coarse relative to the pool is
    replaced by a finer granule, see :meth:`HybridKVLayout.build`). ``checkpoint_interval`` is
    rounded up to a multiple of the layout's page size (uniform mode enlarges pages to hold a
    recurrent state)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    kw = dict(page_tokens=page_tokens, mode=mode, dtype=dtype, budget_bytes=budget_bytes)
    layout = HybridKVLayout.build(list(specs), **kw)
    if checkpoint_interval is not None:
        P = layout.page_tokens
        layout = HybridKVLayout.build(list(specs), **kw, checkpoint_interval=-(-checkpoint_interval // P) * P)
    num_large = layout.num_large_pages(budget_bytes)
    if num_large < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds no large page of {layout.large_bytes} bytes")
    manager = HybridBlockManager(layout, num_large, enable_prefix_caching=enable_prefix_caching)
    kv, rows = allocate_hybrid_kv_caches(layout, num_large, device=device)
    return manager, kv, rows


def fits(manager: HybridBlockManager, num_tokens: int, *, chunk_tokens: int) -> bool:
    """Whether one request of ``num_tokens`` tokens fits in the empty pool (an upper bound on what
    it ever holds: every page of full groups, a window plus one prefill chunk of sliding pages, one
    state per recurrent group)."""
    lay = manager.layout
    P = manager.page_tokens
    large = 0
    for g, grp in enumerate(lay.groups):
        kind = lay.effective_kind(g)
        if kind == LINEAR:
            n = 1
        elif kind == "sliding":
            n = min(-(-num_tokens // P), -(-(grp.window - 1 + chunk_tokens) // P) + 2)
        else:
            n = -(-num_tokens // P)
        large += math.ceil(n / manager.per_large[g])
    return large <= manager.pool.num_large


class HybridModelRunner(ModelRunner):
    """:class:`ModelRunner` over a :class:`HybridBlockManager`: per-group block tables and slot
    mappings, per-request state slots, and checkpoint copies before the forward."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        block_manager: HybridBlockManager,
        group_rows: list[torch.Tensor],
        *,
        device: torch.device,
    ) -> None:
        super().__init__(model, kv_caches, block_manager, device=device)
        self.group_rows = group_rows
        lay = block_manager.layout
        self.token_groups = [g.index for g in lay.groups if g.kind != LINEAR]
        self.linear_groups = [g.index for g in lay.groups if g.kind == LINEAR]
        self.layer_group = [lay.group_of_layer(i).index for i in range(lay.num_layers)]

    def apply_state_copies(self) -> None:
        """Run the manager's queued checkpoint copies (whole small pages: every layer of the group), in order."""
        for c in self.bm.take_state_copies():
            rows = self.group_rows[c.group]
            rows[c.dst].copy_(rows[c.src])

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, HybridMetadata, list[int]]:
        bm = self.bm
        input_ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        starts: list[int] = []
        sample_rows: list[int] = []
        slots = {g: [] for g in self.token_groups}
        tables = {g: [] for g in self.token_groups}
        states = {g: [] for g in self.linear_groups}
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            rid, start = req.request_id, req.num_computed_tokens
            end = start + n
            input_ids += req.all_token_ids[start:end]
            positions += range(start, end)
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            starts.append(start)
            for g in self.token_groups:
                slots[g] += bm.slot_mapping(rid, g, start, end)
                # Released (out-of-window) pages read PAD_PAGE = -1; page 0 is a valid id the window
                # mask never reads.
                tables[g].append([max(p, 0) for p in bm.block_table(rid, g)])
            for g in self.linear_groups:
                states[g].append(bm.state_slot(rid, g))
            if end == req.num_tokens:
                sample_rows.append(i)
        max_q = max(batch.num_new_tokens)
        decode_only = max_q == 1
        cu_t, lens_t = self._tensor(cu), self._tensor(seq_lens)
        per_group: dict[int, AttentionMetadata | LinearStateMetadata] = {}
        first: AttentionMetadata | None = None
        for g in self.token_groups:
            width = max(len(t) for t in tables[g])
            m = per_group[g] = AttentionMetadata(
                cu_seqlens_q=cu_t,
                seq_lens=lens_t,
                block_table=self._tensor([t + [0] * (width - len(t)) for t in tables[g]]),
                slot_mapping=self._tensor(slots[g]),
                max_seqlen_q=max_q,
                max_seqlen_k=max(seq_lens),
                decode_only=decode_only,
            )
            if decode_only:
                continue
            # A mixed step's one-query sequences go through the decode kernel, as in ModelRunner.prepare
            # (the same rows for every group).
            if first is None:
                first = m
                m.mark_split_decodes(batch.num_new_tokens, min_rows=runner_module.SPLIT_DECODES_MIN)
            else:
                m.num_split_decodes, m.decode_seqs, m.decode_tokens, m.prefill_seqs = (
                    first.num_split_decodes, first.decode_seqs, first.decode_tokens, first.prefill_seqs)
        if self.linear_groups:
            has_init = self._tensor([s > 0 for s in starts], torch.bool)
            for g in self.linear_groups:
                per_group[g] = LinearStateMetadata(
                    cu_seqlens=cu_t,
                    state_slots=self._tensor(states[g]),
                    has_initial_state=has_init,
                    decode_only=decode_only,
                )
        meta = HybridMetadata([per_group[g] for g in self.layer_group], cu_t)
        return self._tensor(input_ids, torch.long), self._tensor(positions, torch.long), meta, sample_rows

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, gather=None) -> tuple:
        # Checkpoint copies queued by the last mark_computed (live -> checkpoint) and by this step's
        # admissions (checkpoint -> live) must land before the forward touches the live states.
        self.apply_state_copies()
        return super().launch(batch, gather)
