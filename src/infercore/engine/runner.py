"""Turns a scheduled batch into tensors, runs the model and samples.

The runner owns the KV cache tensors and builds the per-step metadata explicitly (no global
context): tokens-first ragged ``input_ids``/``positions``, int32 ``cu_seqlens_q``, ``seq_lens``,
a padded int32 block table and the slot mapping where new K/V are written.

Host cost matters at large batches (it is paid every decode step), so the per-request state the
step needs lives in persistent numpy rows (:class:`RowTable`): each running request owns a row
holding its block table (extended by the new page ids only when it crosses a page boundary) and
its sampling parameters; a step gathers those rows with one numpy indexing op instead of walking
Python lists of every request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..devices import accepts
from ..kv import BlockManager
from ..ops import (
    AttentionMetadata,
    SamplingTensors,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    sample,
    token_logprobs,
)
from ..ops.attention import SPLIT_DECODES_MIN
from .request import Request
from .scheduler import ScheduledBatch


def sampling_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden [N, H]`` -> the logits ``[N, vocab]`` the sampler reads: the lm_head's own dtype where
    the model's ``compute_logits`` offers it (``fp32=False``). The sampler computes in fp32 either way,
    so the tokens are the same; skipped is a widening ``[B, vocab]`` copy per step (98 us of a 13 ms
    batch-256 step of the 8B shape, results/h200/probe_bs256.json). Models without the keyword return
    fp32 as before."""
    if accepts(type(model).compute_logits, "fp32"):
        return model.compute_logits(hidden, fp32=False)
    return model.compute_logits(hidden)


def expand_drafts(reqs: list[Request]) -> tuple[list[Request], np.ndarray]:
    """Each request once per position it samples at (``1 + len(spec_token_ids)``, in order), and those counts
    (int64 ``[len(reqs)]``)."""
    counts = np.array([1 + len(r.spec_token_ids) for r in reqs], dtype=np.int64)
    return [r for r, c in zip(reqs, counts.tolist()) for _ in range(c)], counts


def positions_within(counts: np.ndarray) -> np.ndarray:
    """``[0, 1, .., counts[0] - 1, 0, 1, ..]``: each row's place in its request's run of ``counts`` rows (int64).
    With speculative decoding a request samples at its ``1 + len(draft)`` positions; row ``j`` of the run
    samples ``j`` tokens past the request's next one."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


class RowTable:
    """Host rows of the running requests: block tables and static sampling parameters.

    ``tables`` int32 ``[R, P]`` (page ids, valid up to ``num_pages[row]``), ``fparams`` fp32 ``[R, 4]``
    (temperature, top_p, min_p, repetition_penalty), ``pf`` fp32 ``[R, 2]`` (presence and frequency
    penalties), ``history`` bool ``[R]`` (``SamplingParams.reads_history``: sampling reads earlier tokens),
    ``iparams`` int64 ``[R, 2]`` (top_k, seed), ``lora`` int64 ``[R]`` (the request's LoRA slot, -1 = none),
    ``prompt_lens`` int64 ``[R]``, ``serial`` int64 ``[R]`` (a number no other assignment of the row
    had: lets a cache keyed by row tell a new request, or the same one re-admitted, from the last).
    Rows and columns grow on demand.
    """

    def __init__(self, rows: int = 64, pages: int = 16) -> None:
        self.tables = np.zeros((rows, pages), dtype=np.int32)
        self.num_pages = np.zeros(rows, dtype=np.int64)
        self.fparams = np.zeros((rows, 4), dtype=np.float32)
        self.pf = np.zeros((rows, 2), dtype=np.float32)
        self.history = np.zeros(rows, dtype=bool)
        self.iparams = np.zeros((rows, 2), dtype=np.int64)
        self.lora = np.full(rows, -1, dtype=np.int64)
        self.prompt_lens = np.zeros(rows, dtype=np.int64)
        self.serial = np.zeros(rows, dtype=np.int64)
        self._assigned = 0
        self.free = list(range(rows - 1, -1, -1))

    def _grow_rows(self) -> None:
        old = self.tables.shape[0]
        new = 2 * old
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self.num_pages = np.concatenate([self.num_pages, np.zeros_like(self.num_pages)])
        self.fparams = np.concatenate([self.fparams, np.zeros_like(self.fparams)])
        self.pf = np.concatenate([self.pf, np.zeros_like(self.pf)])
        self.history = np.concatenate([self.history, np.zeros_like(self.history)])
        self.iparams = np.concatenate([self.iparams, np.zeros_like(self.iparams)])
        self.lora = np.concatenate([self.lora, np.full_like(self.lora, -1)])
        self.prompt_lens = np.concatenate([self.prompt_lens, np.zeros_like(self.prompt_lens)])
        self.serial = np.concatenate([self.serial, np.zeros_like(self.serial)])
        self.free.extend(range(new - 1, old - 1, -1))

    def assign(self, req: Request) -> int:
        if not self.free:
            self._grow_rows()
        row = self.free.pop()
        p = req.params
        self.num_pages[row] = 0
        self.fparams[row] = (p.temperature, p.top_p, p.min_p, p.repetition_penalty)
        self.pf[row] = (p.presence_penalty, p.frequency_penalty)
        self.history[row] = p.reads_history
        self.iparams[row] = (p.top_k, req.seed)
        self.lora[row] = req._lora_slot
        self.prompt_lens[row] = len(req.prompt_token_ids)
        self._assigned += 1
        self.serial[row] = self._assigned
        req._row = row
        return row

    def release(self, req: Request) -> None:
        if req._row >= 0:
            self.free.append(req._row)
            req._row = -1

    def sync_pages(self, bm: BlockManager, reqs: list[Request], rows: np.ndarray, need: np.ndarray) -> None:
        """Make ``tables[rows[i], :need[i]]`` hold the request's pages; only rows that crossed a page
        boundary since the last step ask the block manager (pages are only ever appended). The block
        manager may hold more pages than this step needs (a chunked prompt's are all allocated at
        admission): only the first ``need[i]`` are copied, the rest when a later chunk reaches them."""
        stale = np.flatnonzero(need > self.num_pages[rows])
        if stale.size == 0:
            return
        width = int(need[stale].max())
        if width > self.tables.shape[1]:
            cols = max(width, 2 * self.tables.shape[1])
            self.tables = np.pad(self.tables, ((0, 0), (0, cols - self.tables.shape[1])))
        for i in stale.tolist():
            row, end = int(rows[i]), int(need[i])
            have = int(self.num_pages[row])
            self.tables[row, have:end] = bm.block_table(reqs[i].request_id)[have:end]
            self.num_pages[row] = end


@dataclass
class StepInputs:
    """One step's inputs on the host (numpy).

    ``input_ids``/``positions``/``slots`` int64 ``[T]`` (``input_ids`` holds ``PLACEHOLDER`` where the
    token is still on the device), ``cu_seqlens`` int64 ``[B+1]``, ``seq_lens`` int64 ``[B]``,
    ``rows`` int64 ``[B]`` (RowTable rows), ``table`` int32 ``[B, width]``, ``sample_rows`` int64
    (indices into the batch of the requests that sample this step), ``max_q`` largest query length.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    cu_seqlens: np.ndarray
    seq_lens: np.ndarray
    rows: np.ndarray
    table: np.ndarray
    sample_rows: np.ndarray
    max_q: int


@dataclass
class Gather:
    """Tokens of the previous step still on the device: ``input_ids[dst] = prev[src]`` before the
    forward. ``dst`` int64 indices into this step's flat input, ``src`` int64 rows of ``prev``."""

    dst: np.ndarray
    src: np.ndarray
    prev: torch.Tensor


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
        self.rows = RowTable()
        # logit biases, allowed sets and guided decoding (set by the Engine): (requests, logits [n, V]) -> a processed
        # copy of the logits
        self.guide = None
        # the logits [len(reqs), vocab] of the last launch's sampling requests (the engine's log-probabilities)
        self.last_logits: torch.Tensor | None = None
        # multi-LoRA (lora.LoRAManager, set by the Engine): told each token's adapter slot before a forward
        self.lora = None

    def _tensor(self, data, dtype=torch.int32) -> torch.Tensor:
        if isinstance(data, np.ndarray):
            return torch.from_numpy(data).to(device=self.device, dtype=dtype, non_blocking=True)
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def release(self, req: Request) -> None:
        """Forget ``req``'s host row (it finished, was aborted or preempted)."""
        self.rows.release(req)

    def host_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs as numpy arrays: one Python pass over the batch, the rest vectorized."""
        reqs = batch.requests
        rt = self.rows
        for r in reqs:
            if r._row < 0:
                rt.assign(r)
        B = len(reqs)
        state = np.array([(r.num_computed_tokens, r.num_tokens, r._row) for r in reqs], dtype=np.int64).reshape(B, 3)
        starts, totals, rows = state[:, 0], state[:, 1], state[:, 2]
        n = np.asarray(batch.num_new_tokens, dtype=np.int64)
        ends = starts + n
        ps = self.bm.page_size
        need = (ends + ps - 1) // ps
        rt.sync_pages(self.bm, reqs, rows, need)
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        max_q = int(n.max())
        if max_q == 1:
            positions = starts
            input_ids = np.array([r._all[s] for r, s in zip(reqs, starts.tolist())], dtype=np.int64)
            tok_rows = rows
        else:
            positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - starts, n)
            ids: list[int] = []
            for r, s, e in zip(reqs, starts.tolist(), ends.tolist()):
                ids += r._all[s:e]
                if e > len(r._all):  # speculative decoding: the draft follows the last token
                    ids += r.spec_token_ids[: e - len(r._all)]
            input_ids = np.array(ids, dtype=np.int64)
            tok_rows = np.repeat(rows, n)
        slots = rt.tables[tok_rows, positions // ps].astype(np.int64) * ps + positions % ps
        width = int(need.max())
        return StepInputs(
            input_ids=input_ids, positions=positions, slots=slots, cu_seqlens=cu, seq_lens=ends, rows=rows,
            table=rt.tables[rows, :width], sample_rows=np.flatnonzero(ends >= totals), max_q=max_q,
        )  # fmt: skip

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        x = self.host_inputs(batch)
        meta = AttentionMetadata(
            cu_seqlens_q=self._tensor(x.cu_seqlens),
            seq_lens=self._tensor(x.seq_lens),
            block_table=self._tensor(x.table),
            slot_mapping=self._tensor(x.slots),
            max_seqlen_q=x.max_q,
            max_seqlen_k=int(x.seq_lens.max()),
            decode_only=x.max_q == 1,
        )
        if x.max_q > 1:
            meta.mark_split_decodes(np.diff(x.cu_seqlens), min_rows=SPLIT_DECODES_MIN)
        return self._tensor(x.input_ids, torch.long), self._tensor(x.positions, torch.long), meta, x.sample_rows

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, gather: Gather | None = None) -> tuple[list[Request], torch.Tensor | None]:
        """Enqueue one forward over ``batch`` and the sampling, without waiting for the device.

        Returns the requests that sample (those that have now consumed all of their known tokens;
        partial prefill chunks sample nothing) and their tokens, int64 ``[len(reqs)]`` on the
        device (None when no request samples)."""
        input_ids, positions, meta, rows = self.prepare(batch)
        if gather is not None and len(gather.dst):
            input_ids[torch.from_numpy(gather.dst).to(self.device)] = gather.prev[
                torch.from_numpy(gather.src).to(gather.prev.device)]
        if self.lora is not None:
            slots = [r._lora_slot for r in batch.requests]
            self.lora.set_tokens(np.repeat(slots, batch.num_new_tokens) if max(slots) >= 0 else None)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if any(r.params.prompt_logprobs is not None or r.pooling is not None for r in batch.requests):
            self._prompt_logprobs(batch, hidden)
            self._pool(batch, hidden)
        rows = np.asarray(rows, dtype=np.int64)
        if not rows.size:
            return [], None
        reqs, counts = expand_drafts([batch.requests[i] for i in rows.tolist()])
        if counts.max() == 1:
            last = meta.cu_seqlens_q[1:][torch.from_numpy(rows).to(self.device)] - 1
            logits = sampling_logits(self.model, hidden[last.long()])
            self.last_logits = logits
            return reqs, self.sample_tokens(reqs, logits)
        # Speculative decoding: a request with a draft of k tokens samples at each of its k + 1 positions
        # (rows in order, the request repeated), position j one step further in its sampling stream.
        ends = np.cumsum(np.asarray(batch.num_new_tokens, dtype=np.int64))[rows]
        ahead = positions_within(counts)
        idx = np.repeat(ends - counts, counts) + ahead
        logits = sampling_logits(self.model, hidden[torch.from_numpy(idx).to(self.device)])
        self.last_logits = logits
        return reqs, self.sample_tokens(reqs, logits, ahead=ahead)

    def execute(self, batch: ScheduledBatch) -> dict[Request, int]:
        """Run one forward over ``batch`` and wait; returns the token sampled for each request that
        has now consumed all of its known tokens."""
        reqs, tokens = self.launch(batch)
        return {} if tokens is None else dict(zip(reqs, tokens.tolist()))

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Extend ``Request.prompt_logprobs`` of the batch's requests that ask for them with this chunk's prompt
        positions: row ``j`` of a chunk starting at position ``c`` gives the log-probability of prompt token
        ``c + j + 1`` (the chunk's last row of the last chunk predicts the first output token: none). Waits for the
        device (a prefill step of such a request is not overlapped)."""
        rows, targets, owners, places = [], [], [], []
        off = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            plen = len(req.prompt_token_ids)
            if req.params.prompt_logprobs is not None:
                c = req.num_computed_tokens  # before this step
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)  # position 0: nothing predicts it
                for j in range(n):
                    t = c + j + 1
                    if len(req.prompt_logprobs) == t and t < plen:  # recomputed positions are not reported twice
                        rows.append(off + j)
                        targets.append(req.prompt_token_ids[t])
                        owners.append(req)
                        places.append(t)
                        req.prompt_logprobs.append(None)  # filled below
            off += n
        if not rows:
            return
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        k = max(r.params.prompt_logprobs for r in owners)
        lp, top, ids = token_logprobs(logits, torch.tensor(targets, device=logits.device), min(k, logits.shape[1]))
        lp, top, ids = lp.tolist(), top.tolist(), ids.tolist()
        for i, (req, token, t) in enumerate(zip(owners, targets, places)):
            k = req.params.prompt_logprobs
            d = {token: lp[i]}
            for a, v in zip(ids[i][:k], top[i][:k]):
                d.setdefault(a, v)
            req.prompt_logprobs[t] = d  # prompt position t

    @staticmethod
    def _pool(batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Add this chunk's prompt rows of the batch's pooling requests to ``Request._pooled`` (fp32, on the device):
        "last" keeps the last prompt position's row, "mean" sums the rows of positions not added before."""
        off = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            mode = req.pooling
            if mode is not None:
                plen = len(req.prompt_token_ids)
                c = req.num_computed_tokens  # before this step
                if mode == "last":
                    if c < plen <= c + n:
                        req._pooled = hidden[off + plen - 1 - c].float()
                else:
                    lo, hi = max(c, req._pooled_upto), min(c + n, plen)
                    if lo < hi:
                        part = hidden[off + lo - c : off + hi - c].float().sum(0)
                        req._pooled = part if req._pooled is None else req._pooled + part
                        req._pooled_upto = hi
            off += n

    def sample_tokens(self, reqs: list[Request], logits: torch.Tensor, ahead: np.ndarray | None = None
                      ) -> torch.Tensor:
        """Sample one token per row from ``logits`` ``[len(reqs), V]`` (``reqs[i]``: the request of row i);
        int64 ``[len(reqs)]`` on the device, not synced. ``ahead`` int64 ``[len(reqs)]`` (speculative
        decoding): row i samples ``ahead[i]`` tokens past its request's next one (its offset in the
        request's sampling stream; penalties see the request's tokens and its draft's first ``ahead[i]``)."""
        if self.guide is not None and any(r.params.processes_logits for r in reqs):
            logits = self.guide(reqs, logits)
        rows = [r._row for r in reqs]
        if min(rows) >= 0:
            rows = np.asarray(rows, dtype=np.int64)
            num_tokens = np.array([r.num_tokens for r in reqs], dtype=np.int64)
            params = self.row_sampling_tensors(rows, num_tokens if ahead is None else num_tokens + ahead)
            pf = self.rows.pf[rows]
        else:
            params = sampling_tensors(reqs, self.device)
            pf = np.array([(r.params.presence_penalty, r.params.frequency_penalty) for r in reqs],
                          dtype=np.float32).reshape(len(reqs), 2)
        drafted = None if ahead is None else [r.spec_token_ids[:j] for r, j in zip(reqs, ahead.tolist())]
        prev = _prev_tokens(reqs, self.device, drafted)
        if pf.any():
            # vLLM's order: the repetition penalty (prompt and output), then presence / frequency (output).
            if prev is not None:
                logits = apply_repetition_penalty(logits, prev, params.repetition_penalty)
                params = replace(params, repetition_penalty=torch.ones_like(params.repetition_penalty))
                prev = None
            pf_t = torch.from_numpy(np.ascontiguousarray(pf.T)).to(self.device, non_blocking=True)
            logits = apply_presence_frequency_penalty(logits, _output_tokens(reqs, self.device, drafted), pf_t[0],
                                                      pf_t[1])  # fmt: skip
        return sample(logits, params, prev_tokens=prev, check_values=False)

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> dict[Request, int]:
        """Sample one token per request from ``logits`` ``[len(reqs), V]`` (syncs)."""
        return dict(zip(reqs, self.sample_tokens(reqs, logits).tolist()))

    def row_sampling_tensors(self, rows: np.ndarray, num_tokens: np.ndarray) -> SamplingTensors:
        """Sampling parameters of RowTable ``rows``; ``num_tokens`` (prompt + generated, placeholders
        included) gives the offsets. Two host-to-device copies."""
        rt = self.rows
        i = np.empty((3, len(rows)), dtype=np.int64)
        i[:2] = rt.iparams[rows].T
        i[2] = num_tokens - rt.prompt_lens[rows]
        return _sampling_tensors(rt.fparams[rows].T, i, self.device)


def _sampling_tensors(f: np.ndarray, i: np.ndarray, device: torch.device) -> SamplingTensors:
    """SamplingTensors from host blocks ``f`` fp32 ``[4, n]`` (temperature, top_p, min_p,
    repetition_penalty) and ``i`` int64 ``[3, n]`` (top_k, seed, offset), in two copies. Each block's
    rows are padded to a multiple of 4 elements so every row starts 16-byte aligned whatever ``n``:
    Triton specializes pointer arguments on 16-byte alignment, and unpadded a batch of 95 or 223 rows (a
    mixed prefill/decode step) compiled the sampling kernel again in the middle of serving, 0.9-1.3 s each
    time on the H200 host (results/h200/sweeps/probe_mixed_steps_before.json)."""
    n = f.shape[1]
    w = -(-n // 4) * 4
    blocks = []
    for src, dtype in ((f, np.float32), (i, np.int64)):
        b = np.zeros((src.shape[0], w), dtype=dtype)
        b[:, :n] = src
        blocks.append(torch.from_numpy(b).to(device, non_blocking=True)[:, :n])
    f, i = blocks
    return SamplingTensors(temperature=f[0], top_p=f[1], min_p=f[2], repetition_penalty=f[3],
                           top_k=i[0].to(torch.int32), seeds=i[1], offsets=i[2])


def sampling_tensors(reqs: list[Request], device: torch.device) -> SamplingTensors:
    """Per-row sampling parameters of ``reqs``, moved to ``device`` in two copies (one float, one int block)."""
    ps = [r.params for r in reqs]
    f = np.array([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps],
                  [p.repetition_penalty for p in ps]], dtype=np.float32).reshape(4, len(reqs))
    i = np.array([[p.top_k for p in ps], [r.seed for r in reqs],
                  [r.num_tokens - len(r.prompt_token_ids) for r in reqs]], dtype=np.int64).reshape(3, len(reqs))
    return _sampling_tensors(f, i, device)


def _padded(seqs: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([s + [-1] * (width - len(s)) for s in seqs], dtype=torch.int32, device=device)


def _output_tokens(reqs: list[Request], device: torch.device, drafted: list[list[int]] | None = None) -> torch.Tensor:
    """Each row's generated tokens known on the host (``drafted[i]``: draft tokens before row i's position),
    int32 ``[len(reqs), max]`` padded with -1."""
    if drafted is None:
        return _padded([r.output_token_ids for r in reqs], device)
    return _padded([r.output_token_ids + d for r, d in zip(reqs, drafted)], device)


def _prev_tokens(reqs: list[Request], device: torch.device, drafted: list[list[int]] | None = None
                 ) -> torch.Tensor | None:
    """Each row's prompt and output tokens (and ``drafted[i]``) for the repetition penalty; None without one."""
    if all(r.params.repetition_penalty == 1.0 for r in reqs):
        return None
    drafted = drafted or [[]] * len(reqs)
    return _padded([r.all_token_ids + d if r.params.repetition_penalty != 1.0 else [] for r, d in zip(reqs, drafted)],
                   device)
