"""CUDA-graph decode: persistent input buffers and one captured graph per batch-size bucket.

Decode steps (one new token per request) of up to ``max(buckets)`` requests replay the graph of
the smallest bucket that holds them; padded rows have ``seq_len = 0`` and ``slot = -1`` so they
read and write nothing. The graph covers the forward, the logits and, when a graph-safe sampler
serves ``sample`` on this device, the sampling too; then a step is two host-to-device copies of a
pinned staging buffer, one replay and one read of the sampled tokens, the step's only sync.
Prefill, mixed steps and larger batches run eagerly through :class:`ModelRunner`.

With ``draft_rows`` (speculative decoding), a step whose requests each feed their last token and a draft
of ``k`` tokens replays the graphs too: each of a request's ``k + 1`` positions becomes a decode row of its
own (its position, ``seq_len = position + 1``, the request's block table), so the verification costs one
decode step of ``sum(k + 1)`` rows. Its graphs are captured with :attr:`AttentionMetadata.shared_seqs`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..devices import resolve
from ..devices.graphs import SegmentedGraph, capture_segmented
from ..models.hybrid import HybridMetadata, LinearStateMetadata
from ..ops import AttentionMetadata, SamplingTensors, sample
from .request import Request
from .runner import Gather, ModelRunner, expand_drafts, positions_within, sampling_logits
from .scheduler import ScheduledBatch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# int64 staging rows (each B long), then the block table (B x max_pages)
_IDS, _POS, _SLOT, _LEN, _TOPK, _SEED, _OFF, _GDST, _GSRC, _LORA, _LORD, _NI = range(12)
# float32 staging rows
_TEMP, _TOPP, _MINP, _NF = range(4)


class CUDAGraphRunner:
    """Captured decode graphs over ``runner``'s model and caches.

    The host half of a step (:meth:`stage`) writes the step's inputs into one of two pinned staging
    buffers with a few numpy ops; the device half copies them over and replays. Two buffers, so
    that with async scheduling the host can fill one while the copy out of the other is still
    queued behind the running step. On the CPU the runner can be built (no capture) so the host
    half can be measured.
    """

    def __init__(self, runner: ModelRunner, *, max_batch: int, max_model_len: int, page_size: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, draft_rows: bool = False) -> None:
        self.runner = runner
        self.draft_rows = draft_rows
        self._ahead: np.ndarray | None = None  # the staged step's offsets past each request's next token
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        dev = runner.device
        B = self.B = self.buckets[-1]
        P = self.max_pages = -(-max_model_len // page_size)
        self.max_seqlen_k = P * page_size
        self.ints = torch.zeros(_NI * B + self._table_ints(B, P), dtype=torch.long, device=dev)
        self.floats = torch.zeros(_NF * B, dtype=torch.float32, device=dev)
        pin = dev.type == "cuda"
        self.ints_host = [torch.zeros(self.ints.shape, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.floats_host = [torch.zeros(self.floats.shape, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._ints_np = [t.numpy() for t in self.ints_host]
        self._floats_np = [t.numpy() for t in self.floats_host]
        # the event after the last copy out of each staging buffer (None: no copy queued)
        self._copied: list = [None, None]
        self._flip = 0
        self.input_ids, self.positions = self._row(self.ints, _IDS, B), self._row(self.ints, _POS, B)
        # the kernels take int32 index tensors: separate buffers, filled from the staging copy
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self.top_k = torch.zeros(B, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(B, P, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.graph_samples = resolve("sample", dev).name != "reference"  # the reference syncs
        self.graphs: dict[int, torch.cuda.CUDAGraph | SegmentedGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor] = {}
        self.last_logits: torch.Tensor | None = None  # the last replay's logits rows (a view of its buffer)

    def _table_ints(self, B: int, P: int) -> int:
        """Staging ints after the per-row block: the slots and block table (a ``[B, P]`` region)."""
        return B * P

    def _row(self, buf: torch.Tensor, k: int, b: int) -> torch.Tensor:
        return buf[k * self.B : k * self.B + b]

    def _params(self, b: int) -> SamplingTensors:
        f, i = self.floats, self.ints
        return SamplingTensors(
            temperature=self._row(f, _TEMP, b), top_k=self.top_k[:b], top_p=self._row(f, _TOPP, b),
            min_p=self._row(f, _MINP, b), repetition_penalty=torch.ones(b, device=f.device),
            seeds=self._row(i, _SEED, b), offsets=self._row(i, _OFF, b),
        )

    def _meta(self, b: int):
        """The captured forward's attention metadata for bucket ``b`` (views of the persistent buffers)."""
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: b + 1], seq_lens=self.seq_lens[:b], block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:b], max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k, decode_only=True,
            shared_seqs=self.draft_rows,
        )

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        model = self.runner.model
        meta = self._meta(b)
        logits = sampling_logits(model, model(self.input_ids[:b], self.positions[:b], self.runner.kv_caches, meta))
        tokens = sample(logits, self._params(b), check_values=False) if self.graph_samples else None
        return logits, tokens

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool. A model that waits for
        the host inside its forward (``model.host_synchronizing``: host experts) is captured as a chain of graphs
        split where it does (``devices.graphs.capture_segmented``)."""
        model = self.runner.model
        lora = getattr(self.runner, "lora", None)
        if lora is not None:  # the graphs apply LoRA to every row, reading the slots from its persistent buffer
            lora.capturing()
        segmented = bool(getattr(model, "host_synchronizing", False))
        if segmented:
            for h in getattr(model, "host_experts", {}).values():
                h.reserve(self.B)
        self._row(self.floats, _TOPP, self.B).fill_(1.0)
        pool = None
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                for _ in range(2):  # compile the Triton kernels, settle the allocator
                    self._forward(b)
                if segmented:
                    graph = SegmentedGraph()
                    capture = capture_segmented(graph, pool=pool, stream=stream)
                else:
                    graph = torch.cuda.CUDAGraph()
                    capture = torch.cuda.graph(graph, pool=pool, stream=stream)
                with capture:
                    self.logits[b], self.tokens[b] = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, batch: ScheduledBatch) -> bool:
        if not self.graphs or batch.num_tokens > self.B:
            return False
        reqs = batch.requests
        if batch.num_tokens == len(batch):  # (a pooling request's one-token prompt needs its hidden state: eager)
            return all(r.num_computed_tokens + 1 == r.num_tokens and (r.num_computed_tokens or r.pooling is None)
                       for r in reqs)
        # speculative verification: each request feeds its last token and its draft
        return self.draft_rows and all(r.num_computed_tokens + 1 == r.num_tokens and n == 1 + len(r.spec_token_ids)
                                       for r, n in zip(reqs, batch.num_new_tokens))

    def stage(self, batch: ScheduledBatch, gather: Gather | None = None) -> tuple[int, int, int, int, int]:
        """The host half of a step: write ``batch`` (a decode batch every request of which samples, each
        request one row, or with drafts ``1 + len(draft)`` rows) into the next staging buffer. Returns
        ``(buffer, rows, bucket, width, num_gathered)``."""
        x = self.runner.host_inputs(batch)
        n, B, P = len(x.input_ids), self.B, self.max_pages
        rows, seq_lens, table, self._ahead = x.rows, x.seq_lens, x.table, None
        if n > len(batch):  # drafts: a decode row per position, seeing the keys up to its own
            counts = np.diff(x.cu_seqlens)
            rows, seq_lens, table = np.repeat(rows, counts), x.positions + 1, np.repeat(table, counts, axis=0)
            self._ahead = positions_within(counts)
        k, b = self._next_buffer(n)
        ih = self._ints_np[k]
        g = self._stage_rows(k, n, b, x.input_ids, x.positions, seq_lens, rows, gather)
        ih[_SLOT * B : _SLOT * B + b] = -1
        ih[_SLOT * B : _SLOT * B + n] = x.slots
        width = table.shape[1]
        ih[_NI * B : _NI * B + n * P].reshape(n, P)[:, :width] = table
        return k, n, b, width, g

    def _next_buffer(self, n: int) -> tuple[int, int]:
        """The staging buffer to fill (waiting for its last copy out) and the bucket for ``n`` rows."""
        b = next(s for s in self.buckets if s >= n)
        k = self._flip
        self._flip ^= 1
        if self._copied[k] is not None:
            self._copied[k].synchronize()  # normally long done: it was queued two steps ago
            self._copied[k] = None
        return k, b

    def _stage_rows(self, k: int, n: int, b: int, input_ids, positions, seq_lens, rows, gather) -> int:
        """Write the per-row inputs every decode graph takes (ids, positions, lengths, sampling
        parameters, the gather of on-device tokens) into staging buffer ``k``; rows ``n..b`` are
        padding. Returns the number of gathered tokens."""
        B = self.B
        ih, fh = self._ints_np[k], self._floats_np[k]
        rt = self.runner.rows
        # Padded rows must hold valid ids: a stale placeholder (-1) would index the embedding.
        ih[_IDS * B + n : _IDS * B + b] = 0
        ih[_POS * B + n : _POS * B + b] = 0
        ih[_IDS * B : _IDS * B + n] = input_ids
        ih[_POS * B : _POS * B + n] = positions
        ih[_LEN * B : _LEN * B + b] = 0
        ih[_LEN * B : _LEN * B + n] = seq_lens
        ih[_TOPK * B : _TOPK * B + b] = 0
        ih[_TOPK * B : _TOPK * B + n] = rt.iparams[rows, 0]
        ih[_SEED * B : _SEED * B + b] = 0
        ih[_SEED * B : _SEED * B + n] = rt.iparams[rows, 1]
        ih[_OFF * B : _OFF * B + b] = 0
        ih[_OFF * B : _OFF * B + n] = seq_lens - rt.prompt_lens[rows]  # decode: num_tokens == end
        if getattr(self.runner, "lora", None) is not None:  # each row's adapter slot (-1: the base model)
            slots = np.full(b, -1, dtype=np.int64)
            slots[:n] = rt.lora[rows]
            ih[_LORA * B : _LORA * B + b] = slots
            ih[_LORD * B : _LORD * B + b] = np.argsort(slots, kind="stable")  # the rows in slot order
        g = 0 if gather is None else len(gather.dst)
        if g:
            ih[_GDST * B : _GDST * B + g] = gather.dst
            ih[_GSRC * B : _GSRC * B + g] = gather.src
        fh[_TEMP * B : _TEMP * B + b] = 0.0
        fh[_TOPP * B : _TOPP * B + b] = 1.0
        fh[_MINP * B : _MINP * B + b] = 0.0
        fp = rt.fparams[rows]
        fh[_TEMP * B : _TEMP * B + n] = fp[:, 0]
        fh[_TOPP * B : _TOPP * B + n] = fp[:, 1]
        fh[_MINP * B : _MINP * B + n] = fp[:, 2]
        self._penalized = bool(rt.history[rows].any())
        return g

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, gather: Gather | None = None) -> tuple[list[Request], torch.Tensor]:
        """Stage, copy and replay; returns every request of ``batch`` and its sampled token, int64
        ``[n]`` on the device, without waiting for the device."""
        k, n, b, width, g = self.stage(batch, gather)
        self._upload(k, self._used(n, width))
        self.seq_lens[:b] = self._row(self.ints, _LEN, b)
        self.top_k[:b] = self._row(self.ints, _TOPK, b)
        lora = getattr(self.runner, "lora", None)
        if lora is not None:
            lora.indices[:b] = self._row(self.ints, _LORA, b)
            lora.order[:b] = self._row(self.ints, _LORD, b)
        self._scatter(n, b, width)
        if g:
            src = self._row(self.ints, _GSRC, g)
            self.input_ids[self._row(self.ints, _GDST, g)] = gather.prev[src]
        self.graphs[b].replay()
        reqs = batch.requests
        if self._ahead is not None:  # a request's rows in order, as ModelRunner.launch returns them
            reqs = expand_drafts(reqs)[0]
        self.last_logits = self.logits[b][:n]
        if self.graph_samples and not self._penalized:
            return reqs, self.tokens[b][:n]
        return reqs, self.runner.sample_tokens(reqs, self.logits[b][:n], ahead=self._ahead)

    def _used(self, n: int, width: int) -> int:
        """How much of the int staging buffer a step of ``n`` rows fills."""
        return _NI * self.B + n * self.max_pages

    def _upload(self, k: int, used: int) -> None:
        """Copy staging buffer ``k`` to the device (its first ``used`` ints) and mark when it is free."""
        self.ints[:used].copy_(self.ints_host[k][:used], non_blocking=True)
        self.floats.copy_(self.floats_host[k], non_blocking=True)
        if self.ints.is_cuda:  # elsewhere the copy is done when it returns
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.ints.device))  # named: see Engine._launch
            self._copied[k] = ev

    def _scatter(self, n: int, b: int, width: int) -> None:
        """Move the uploaded slots and block table into the buffers the graphs read."""
        B, P = self.B, self.max_pages
        self.slot_mapping[:b] = self._row(self.ints, _SLOT, b)
        self.block_table[:n, :width] = self.ints[_NI * B : _NI * B + n * P].view(n, P)[:, :width]

    def execute(self, batch: ScheduledBatch) -> dict[Request, int]:
        reqs, tokens = self.launch(batch)
        return dict(zip(reqs, tokens.tolist()))


class HybridCUDAGraphRunner(CUDAGraphRunner):
    """Captured decode graphs for a :class:`~infercore.engine.hybrid.HybridModelRunner`.

    The same staging and buckets as :class:`CUDAGraphRunner`, with the hybrid metadata: one block
    table and slot row per attention group (full or sliding window; released sliding pages read
    page 0, which the window mask never reads) and one state-slot row per linear group. Padding
    rows have ``seq_len = 0``, ``slot = -1`` and ``state slot = -1``, so they read and write no KV
    page and no recurrent state. The staging buffer holds, after the per-row block, one slot row
    per attention group and one state-slot row per linear group, then each attention group's table
    packed as ``[n, width]`` (only the rows and pages of this step cross to the device; the groups
    share the token page, so one width serves them all). Queued checkpoint copies run
    before the replay, as in the eager runner.
    """

    def __init__(self, runner, *, max_batch: int, max_model_len: int, page_size: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, draft_rows: bool = False) -> None:
        if draft_rows:  # the Engine refuses speculative decoding on hybrid layouts first
            raise ValueError("draft_rows: recurrent states cannot take back rejected draft tokens")
        self.token_groups = list(runner.token_groups)
        self.linear_groups = list(runner.linear_groups)
        # the layout's token page (uniform mode sizes it to a recurrent state: not the config's page)
        page_size = self.page_size = runner.bm.page_tokens
        super().__init__(runner, max_batch=max_batch, max_model_len=max_model_len, page_size=page_size,
                         buckets=buckets)  # fmt: skip
        dev, B, P = runner.device, self.B, self.max_pages
        self.group_slots = [torch.full((B,), -1, dtype=torch.int32, device=dev) for _ in self.token_groups]
        self.group_tables = [torch.zeros(B, P, dtype=torch.int32, device=dev) for _ in self.token_groups]
        self.state_slots = [torch.full((B,), -1, dtype=torch.int32, device=dev) for _ in self.linear_groups]
        self.has_initial_state = torch.ones(B, dtype=torch.bool, device=dev)
        # host block tables per token group and RowTable row (see _sync_tables)
        self._owner = np.zeros(64, dtype=np.int64)  # RowTable.serial of the row's cached tables
        self._counts = np.zeros((len(self.token_groups), 64), dtype=np.int64)
        self._tables = [np.zeros((64, 16), dtype=np.int32) for _ in self.token_groups]

    def _table_ints(self, B: int, P: int) -> int:
        return (len(self.token_groups) + len(self.linear_groups)) * B + len(self.token_groups) * B * P

    def _slot_row(self, j: int) -> int:
        """Offset of slot row ``j`` in the staging ints: attention groups first, then linear groups."""
        return (_NI + j) * self.B

    def _table(self, i: int, n: int, width: int) -> slice:
        """Where attention group ``i``'s ``[n, width]`` table sits in the staging ints."""
        start = self._slot_row(len(self.token_groups) + len(self.linear_groups)) + i * n * width
        return slice(start, start + n * width)

    def _meta(self, b: int) -> HybridMetadata:
        cu = self.cu_seqlens[: b + 1]
        per_group: dict[int, AttentionMetadata | LinearStateMetadata] = {}
        for i, g in enumerate(self.token_groups):
            per_group[g] = AttentionMetadata(
                cu_seqlens_q=cu, seq_lens=self.seq_lens[:b], block_table=self.group_tables[i][:b],
                slot_mapping=self.group_slots[i][:b], max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k,
                decode_only=True,
            )  # fmt: skip
        for j, g in enumerate(self.linear_groups):
            per_group[g] = LinearStateMetadata(
                cu_seqlens=cu, state_slots=self.state_slots[j][:b], has_initial_state=self.has_initial_state[:b],
                decode_only=True,
            )  # fmt: skip
        return HybridMetadata([per_group[g] for g in self.runner.layer_group], cu)

    def stage(self, batch: ScheduledBatch, gather: Gather | None = None) -> tuple[int, int, int, int, int]:
        runner, reqs = self.runner, batch.requests
        bm, rt = runner.bm, runner.rows
        for r in reqs:
            if r._row < 0:
                rt.assign(r)
        n, B, ps = len(reqs), self.B, self.page_size
        k, b = self._next_buffer(n)
        ih = self._ints_np[k]
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=n)
        rows = np.fromiter((r._row for r in reqs), dtype=np.int64, count=n)
        ids = np.fromiter((r._all[s] for r, s in zip(reqs, starts.tolist())), dtype=np.int64, count=n)
        g = self._stage_rows(k, n, b, ids, starts, starts + 1, rows, gather)
        need = starts // ps + 1  # pages up to the one this step writes
        w = int(need.max())
        self._sync_tables(reqs, rows, need, w)
        for i in range(len(self.token_groups)):
            table = ih[self._table(i, n, w)].reshape(n, w)
            table[:] = self._tables[i][rows, :w]
            slots = ih[self._slot_row(i) :][:B]
            slots[:b] = -1
            slots[:n] = table[np.arange(n), need - 1] * ps + starts % ps
        for j, grp in enumerate(self.linear_groups):
            states = ih[self._slot_row(len(self.token_groups) + j) :][:B]
            states[:b] = -1
            states[:n] = [bm.state_slot(r.request_id, grp) for r in reqs]
        return k, n, b, w, g

    def _sync_tables(self, reqs, rows: np.ndarray, need: np.ndarray, width: int) -> None:
        """Host copies of each token group's block table per RowTable row, ``need[i]`` pages long.

        Pages are only ever appended to a request's table, so only the new ones are read from the
        manager; a row assigned anew (another request, or this one re-admitted after preemption, with
        new pages) starts over. Entries a sliding window released after they were copied keep their
        old page id: the window mask never reads them. PAD entries (released before the copy) read
        page 0."""
        R = len(self._owner)
        if rows.size and int(rows.max()) >= R:
            grow = max(int(rows.max()) + 1, 2 * R)
            self._owner = np.pad(self._owner, (0, grow - R))
            self._counts = np.pad(self._counts, ((0, 0), (0, grow - R)))
            self._tables = [np.pad(t, ((0, grow - R), (0, 0))) for t in self._tables]
        if self._tables and width > self._tables[0].shape[1]:
            cols = max(width, 2 * self._tables[0].shape[1])
            self._tables = [np.pad(t, ((0, 0), (0, cols - t.shape[1]))) for t in self._tables]
        bm, serial = self.runner.bm, self.runner.rows.serial[rows]
        fresh = self._owner[rows] != serial
        if fresh.any():
            self._owner[rows[fresh]] = serial[fresh]
            self._counts[:, rows[fresh]] = 0
        for r, row, k in zip(reqs, rows.tolist(), need.tolist()):
            for i, grp in enumerate(self.token_groups):
                have = int(self._counts[i, row])
                if have < k:
                    pages = bm.block_table(r.request_id, grp, start=have)[: k - have]
                    self._tables[i][row, have : have + len(pages)] = np.maximum(pages, 0)
                    self._counts[i, row] = have + len(pages)

    def _used(self, n: int, width: int) -> int:
        return self._table(len(self.token_groups), n, width).start

    def _scatter(self, n: int, b: int, width: int) -> None:
        for i in range(len(self.token_groups)):
            self.group_slots[i][:b] = self.ints[self._slot_row(i) :][:b]
            self.group_tables[i][:n, :width] = self.ints[self._table(i, n, width)].view(n, width)
        for j in range(len(self.linear_groups)):
            self.state_slots[j][:b] = self.ints[self._slot_row(len(self.token_groups) + j) :][:b]

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, gather: Gather | None = None) -> tuple[list[Request], torch.Tensor]:
        # Checkpoint copies queued by the last mark_computed / this step's admissions land first.
        self.runner.apply_state_copies()
        return super().launch(batch, gather)
