"""Per-step batch metadata for paged attention (built once per step, shared by every layer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys live for one forward step.

    Attributes:
        cu_seqlens_q: int32 ``[B+1]``, prefix sums of query lengths (rows of the ragged ``[T, H, D]`` q).
        seq_lens: int32 ``[B]``, total KV length of each sequence including this step's tokens.
        block_table: int32 ``[B, P]``, page ids of each sequence in order (entries past the
            sequence's last page are ignored).
        slot_mapping: int32 ``[T]``, flat cache slot of each new token (``-1`` = do not store).
        max_seqlen_q: largest query length in the batch (host int, no sync needed).
        max_seqlen_k: largest ``seq_lens`` entry (host int).
        decode_only: every sequence has exactly one query token.
        num_split_decodes: in a mixed step (not ``decode_only``), how many sequences with one query token
            attention runs through the decode kernel instead of the prefill kernel (0: none; see
            :func:`~infercore.ops.attention.split_decodes`). Set by the engine's runner.
        decode_seqs, decode_tokens: int64 ``[num_split_decodes]``, those sequences and their query rows;
            None when they are the batch's first ``num_split_decodes`` sequences (rows ``0 .. n - 1``).
        prefill_seqs: int32 ``[B - num_split_decodes]``, the other sequences (set with them), the only
            ones the prefill kernel then runs.
        shared_seqs: a decode-only step whose rows may be consecutive positions of one sequence (each with
            its own ``seq_lens`` entry and the sequence's block table: speculative verification run as
            decode rows). A row then reads keys this step writes for its other rows, so the model writes
            the step's K/V before attention reads any (no fused RoPE + write + attention, no reads ahead of
            the KV write).
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    decode_only: bool
    num_split_decodes: int = 0
    decode_seqs: torch.Tensor | None = None
    decode_tokens: torch.Tensor | None = None
    prefill_seqs: torch.Tensor | None = None
    shared_seqs: bool = False

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def mark_split_decodes(self, query_lens: Sequence[int], *, min_rows: int = 1) -> int:
        """Record this mixed step's one-query sequences for the decode kernel (``num_split_decodes``,
        ``decode_seqs``, ``decode_tokens``) when there are at least ``min_rows`` of them; ``query_lens``
        the host copy of the query lengths. Returns the number marked (0: none, or a decode-only step)."""
        lens = np.asarray(query_lens, dtype=np.int64)
        if lens.ndim != 1 or lens.size != self.num_seqs:
            raise ValueError(f"AttentionMetadata.mark_split_decodes: query_lens has {lens.size} entries for "
                             f"{self.num_seqs} sequences")
        single = np.flatnonzero(lens == 1)
        n = int(single.size)
        if self.decode_only or n < max(min_rows, 1) or n == lens.size:
            return 0
        self.num_split_decodes = n
        dev = self.seq_lens.device
        self.prefill_seqs = torch.from_numpy(np.flatnonzero(lens != 1).astype(np.int32)).to(dev, non_blocking=True)
        if single[-1] != n - 1:  # not the batch's first n sequences: index them
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            self.decode_seqs = torch.from_numpy(single).to(dev, non_blocking=True)
            self.decode_tokens = torch.from_numpy(starts[single]).to(dev, non_blocking=True)
        return n

    @classmethod
    def from_lists(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        device: torch.device | str | None = None,
        pad_pages_to: int | None = None,
    ) -> AttentionMetadata:
        """Build from host lists: ``block_tables[b]`` lists sequence b's pages; rows are padded with 0
        to ``pad_pages_to`` (default: the longest row) so the table is rectangular."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                "AttentionMetadata.from_lists: query_lens, seq_lens and block_tables must have one entry per "
                f"sequence, got {len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
            )
        if any(q < 0 or q > s for q, s in zip(query_lens, seq_lens)):
            raise ValueError("AttentionMetadata.from_lists: need 0 <= query_lens[b] <= seq_lens[b]")
        if len(slot_mapping) != sum(query_lens):
            raise ValueError(
                f"AttentionMetadata.from_lists: slot_mapping has {len(slot_mapping)} entries, "
                f"expected sum(query_lens) = {sum(query_lens)}"
            )
        width = max([len(r) for r in block_tables] + [pad_pages_to or 0, 1])
        table = [list(r) + [0] * (width - len(r)) for r in block_tables]
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            cu_seqlens_q=torch.tensor(cu, **i32),
            seq_lens=torch.tensor(list(seq_lens), **i32),
            block_table=torch.tensor(table, **i32).reshape(len(block_tables), width),
            slot_mapping=torch.tensor(list(slot_mapping), **i32),
            max_seqlen_q=max(query_lens, default=0),
            max_seqlen_k=max(seq_lens, default=0),
            decode_only=len(query_lens) > 0 and all(q == 1 for q in query_lens),
        )
