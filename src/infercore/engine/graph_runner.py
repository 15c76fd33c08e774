"""CUDA-graph decode: persistent input buffers and one captured graph per batch-size bucket.

Decode steps (one new token per request) of up to ``max(buckets)`` requests replay a graph captured
for the smallest bucket that holds them; padded rows have ``seq_len = 0`` and ``slot = -1`` so they
read and write nothing. Everything else (prefill, mixed steps, larger batches) runs eagerly through
:class:`ModelRunner`. The host only copies the step's small int tensors in and reads the sampled
tokens back: no other sync inside a decode step.
"""

from __future__ import annotations

import torch

from ..ops import AttentionMetadata
from .request import Request
from .runner import ModelRunner
from .scheduler import ScheduledBatch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CUDAGraphRunner:
    def __init__(self, runner: ModelRunner, *, max_batch: int, max_model_len: int, page_size: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.runner = runner
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        dev = runner.device
        B = self.buckets[-1]
        self.max_pages = -(-max_model_len // page_size)
        self.max_seqlen_k = self.max_pages * page_size
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(B, self.max_pages, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(B + 1, dtype=torch.int32, device=dev)
        # one pinned host staging row per step: ids, positions, slots, seq_lens, then the block table
        self.staging = torch.zeros(4 * B + B * self.max_pages, dtype=torch.long).pin_memory()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:b],
            max_seqlen_q=1,
            max_seqlen_k=self.max_seqlen_k,
            decode_only=True,
        )

    def _forward(self, b: int) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.input_ids[:b], self.positions[:b], self.runner.kv_caches, self._meta(b))
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool."""
        pool = None
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                for _ in range(2):  # compile Triton kernels, settle the allocator
                    self._forward(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[b] = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (
            bool(self.graphs)
            and len(batch) <= self.buckets[-1]
            and all(n == 1 for n in batch.num_new_tokens)
            and all(r.num_computed_tokens + 1 == r.num_tokens for r in batch.requests)
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[Request, int]:
        x = self.runner.host_inputs(batch)
        n = len(x.input_ids)
        b = next(s for s in self.buckets if s >= n)
        B = self.buckets[-1]
        P = self.max_pages
        st = self.staging
        st[:n] = torch.tensor(x.input_ids)
        st[B : B + n] = torch.tensor(x.positions)
        st[2 * B : 2 * B + b] = -1
        st[2 * B : 2 * B + n] = torch.tensor(x.slots)
        st[3 * B : 3 * B + b] = 0
        st[3 * B : 3 * B + n] = torch.tensor(x.seq_lens)
        width = max(len(t) for t in x.tables)
        table = torch.zeros(n, width, dtype=torch.long)
        for i, t in enumerate(x.tables):
            table[i, : len(t)] = torch.tensor(t)
        st[4 * B : 4 * B + n * P].view(n, P)[:, :width] = table
        dev = st[: 4 * B + n * P].to(self.runner.device, non_blocking=True)
        self.input_ids[:n] = dev[:n]
        self.positions[:n] = dev[B : B + n]
        self.slot_mapping[:b] = dev[2 * B : 2 * B + b]
        self.seq_lens[:b] = dev[3 * B : 3 * B + b]
        self.block_table[:n, :width] = dev[4 * B :].view(n, P)[:, :width]
        self.graphs[b].replay()
        return self.runner.sample(batch.requests, self.logits[b][:n])
