"""CUDA-graph decode: persistent input buffers and one captured graph per batch-size bucket.

Decode steps (one new token per request) of up to ``max(buckets)`` requests replay the graph of
the smallest bucket that holds them; padded rows have ``seq_len = 0`` and ``slot = -1`` so they
read and write nothing. The graph covers the forward, the logits and, when a graph-safe sampler
serves ``sample`` on this device, the sampling too; then a step is two host-to-device copies of a
pinned staging buffer, one replay and one read of the sampled tokens, the step's only sync.
Prefill, mixed steps and larger batches run eagerly through :class:`ModelRunner`.
"""

from __future__ import annotations

import torch

from ..devices import resolve
from ..ops import AttentionMetadata, SamplingTensors, sample
from .request import Request
from .runner import ModelRunner
from .scheduler import ScheduledBatch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# int64 staging rows (each B long), then the block table (B x max_pages)
_IDS, _POS, _SLOT, _LEN, _TOPK, _SEED, _OFF, _NI = range(8)
# float32 staging rows
_TEMP, _TOPP, _MINP, _NF = range(4)


class CUDAGraphRunner:
    def __init__(self, runner: ModelRunner, *, max_batch: int, max_model_len: int, page_size: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.runner = runner
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        dev = runner.device
        B = self.B = self.buckets[-1]
        P = self.max_pages = -(-max_model_len // page_size)
        self.max_seqlen_k = P * page_size
        self.ints = torch.zeros(_NI * B + B * P, dtype=torch.long, device=dev)
        self.floats = torch.zeros(_NF * B, dtype=torch.float32, device=dev)
        self.ints_host = torch.zeros_like(self.ints, device="cpu").pin_memory()
        self.floats_host = torch.zeros_like(self.floats, device="cpu").pin_memory()
        self.input_ids, self.positions = self._row(self.ints, _IDS, B), self._row(self.ints, _POS, B)
        # the kernels take int32 index tensors: separate buffers, filled from the staging copy
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self.top_k = torch.zeros(B, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(B, P, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.graph_samples = resolve("sample", dev).name != "reference"  # the reference syncs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor] = {}

    def _row(self, buf: torch.Tensor, k: int, b: int) -> torch.Tensor:
        return buf[k * self.B : k * self.B + b]

    def _params(self, b: int) -> SamplingTensors:
        f, i = self.floats, self.ints
        return SamplingTensors(
            temperature=self._row(f, _TEMP, b), top_k=self.top_k[:b], top_p=self._row(f, _TOPP, b),
            min_p=self._row(f, _MINP, b), repetition_penalty=torch.ones(b, device=f.device),
            seeds=self._row(i, _SEED, b), offsets=self._row(i, _OFF, b),
        )

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        model = self.runner.model
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: b + 1], seq_lens=self.seq_lens[:b], block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:b], max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k, decode_only=True,
        )
        logits = model.compute_logits(model(self.input_ids[:b], self.positions[:b], self.runner.kv_caches, meta))
        tokens = sample(logits, self._params(b), check_values=False) if self.graph_samples else None
        return logits, tokens

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool."""
        self._row(self.floats, _TOPP, self.B).fill_(1.0)
        pool = None
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                for _ in range(2):  # compile the Triton kernels, settle the allocator
                    self._forward(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[b], self.tokens[b] = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (
            bool(self.graphs)
            and len(batch) <= self.B
            and all(n == 1 for n in batch.num_new_tokens)
            and all(r.num_computed_tokens + 1 == r.num_tokens for r in batch.requests)
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[Request, int]:
        reqs = batch.requests
        x = self.runner.host_inputs(batch)
        n, B, P = len(reqs), self.B, self.max_pages
        b = next(s for s in self.buckets if s >= n)
        pad = b - n
        ps = [r.params for r in reqs]
        width = max(len(t) for t in x.tables)
        ih, fh = self.ints_host, self.floats_host
        rows = [x.input_ids, x.positions, x.slots + [-1] * pad, x.seq_lens + [0] * pad,
                [p.top_k for p in ps] + [0] * pad, [r.seed for r in reqs] + [0] * pad,
                [len(r.output_token_ids) for r in reqs] + [0] * pad]
        for k, row in enumerate(rows):
            ih[k * B : k * B + len(row)] = torch.tensor(row)
        ih[_NI * B : _NI * B + n * P].view(n, P)[:, :width] = torch.tensor(
            [t + [0] * (width - len(t)) for t in x.tables])
        frows = [[p.temperature for p in ps] + [0.0] * pad, [p.top_p for p in ps] + [1.0] * pad,
                 [p.min_p for p in ps] + [0.0] * pad]
        for k, row in enumerate(frows):
            fh[k * B : k * B + b] = torch.tensor(row)
        used = _NI * B + n * P
        self.ints[:used].copy_(ih[:used], non_blocking=True)
        self.floats.copy_(fh, non_blocking=True)
        self.slot_mapping[:b] = self._row(self.ints, _SLOT, b)
        self.seq_lens[:b] = self._row(self.ints, _LEN, b)
        self.top_k[:b] = self._row(self.ints, _TOPK, b)
        self.block_table[:n, :width] = self.ints[_NI * B : used].view(n, P)[:, :width]
        self.graphs[b].replay()
        if self.graph_samples and all(p.repetition_penalty == 1.0 for p in ps):
            return dict(zip(reqs, self.tokens[b][:n].tolist()))
        return self.runner.sample(reqs, self.logits[b][:n])
