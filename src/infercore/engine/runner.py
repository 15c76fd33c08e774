"""Turns a scheduled batch into tensors, runs the model and samples.

The runner owns the KV cache tensors and builds the per-step metadata explicitly (no global
context): tokens-first ragged ``input_ids``/``positions``, int32 ``cu_seqlens_q``, ``seq_lens``,
a padded int32 block table and the slot mapping where new K/V are written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv import BlockManager
from ..ops import AttentionMetadata, SamplingTensors, sample
from .request import Request
from .scheduler import ScheduledBatch


@dataclass
class StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    cu_seqlens: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    max_q: int = 0


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        block_manager: BlockManager,
        *,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.bm = block_manager
        self.device = device

    def _tensor(self, data, dtype=torch.int32) -> torch.Tensor:
        # Build on the host, copy once; pinned + non_blocking would help on CUDA for large batches.
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def host_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs as host lists (one pass over the batch)."""
        x = StepInputs()
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = req.num_computed_tokens
            end = start + n
            x.input_ids += req.all_token_ids[start:end]
            x.positions += range(start, end)
            x.slots += self.bm.slot_mapping(req.request_id, start, end)
            x.cu_seqlens.append(x.cu_seqlens[-1] + n)
            x.seq_lens.append(end)
            x.tables.append(self.bm.block_table(req.request_id))
            if end == req.num_tokens:
                x.sample_rows.append(i)
        x.max_q = max(batch.num_new_tokens)
        return x

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        x = self.host_inputs(batch)
        width = max(len(t) for t in x.tables)
        table = [t + [0] * (width - len(t)) for t in x.tables]
        meta = AttentionMetadata(
            cu_seqlens_q=self._tensor(x.cu_seqlens),
            seq_lens=self._tensor(x.seq_lens),
            block_table=self._tensor(table),
            slot_mapping=self._tensor(x.slots),
            max_seqlen_q=x.max_q,
            max_seqlen_k=max(x.seq_lens),
            decode_only=x.max_q == 1,
        )
        return self._tensor(x.input_ids, torch.long), self._tensor(x.positions, torch.long), meta, x.sample_rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[Request, int]:
        """Run one forward over ``batch``; returns the token sampled for each request that has
        now consumed all of its known tokens (partial prefill chunks sample nothing)."""
        input_ids, positions, meta, rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not rows:
            return {}
        last = meta.cu_seqlens_q[1:][torch.tensor(rows, device=self.device)] - 1
        logits = self.model.compute_logits(hidden[last.long()])
        return self.sample([batch.requests[i] for i in rows], logits)

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> dict[Request, int]:
        """Sample one token per request from ``logits`` ``[len(reqs), V]`` (the step's only host sync)."""
        tokens = sample(logits, sampling_tensors(reqs, self.device), prev_tokens=_prev_tokens(reqs, self.device),
                        check_values=False)
        return dict(zip(reqs, tokens.tolist()))


def sampling_tensors(reqs: list[Request], device: torch.device) -> SamplingTensors:
    """Per-row sampling parameters, moved to ``device`` in two copies (one float, one int block)."""
    ps = [r.params for r in reqs]
    f = torch.tensor([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps],
                      [p.repetition_penalty for p in ps]], dtype=torch.float32)
    i = torch.tensor([[p.top_k for p in ps], [r.seed for r in reqs], [len(r.output_token_ids) for r in reqs]],
                     dtype=torch.int64)
    f, i = f.to(device, non_blocking=True), i.to(device, non_blocking=True)
    return SamplingTensors(
        temperature=f[0],
        top_p=f[1],
        min_p=f[2],
        repetition_penalty=f[3],
        top_k=i[0].to(torch.int32),
        seeds=i[1],
        offsets=i[2],
    )


def _prev_tokens(reqs: list[Request], device: torch.device) -> torch.Tensor | None:
    if all(r.params.repetition_penalty == 1.0 for r in reqs):
        return None
    seqs = [r.all_token_ids if r.params.repetition_penalty != 1.0 else [] for r in reqs]
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([s + [-1] * (width - len(s)) for s in seqs], dtype=torch.int32, device=device)
