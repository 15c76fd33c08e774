"""Continuous batching with chunked prefill, prefix-cache reuse and preemption by recompute (or, with a
CPU tier under the prefix cache, by swap: the preempted request's full pages are copied out when reused
and copied back when it is readmitted).

Each step the scheduler hands out a token budget: running requests first (one token per decode,
or the next chunk of an unfinished prefill), in arrival order; then waiting requests, whose
prompts are admitted (and chunked) while budget, sequence slots and KV pages last. When pages
run out for a running request, the most recently admitted running request is preempted: its
pages are freed and it goes back to the front of the queue, to be recomputed later (its
prefix pages usually stay in the prefix cache). Nothing is dropped.

With ``chunk_boundary`` set (models with recurrent layers and prefix caching), a prefill chunk that
would cross a multiple of it is cut there: recurrent states can only be checkpointed for the prefix
cache when a step ends exactly on the boundary.

With ``share_prefills`` (the dense KV manager with prefix caching), a waiting request whose prompt shares
full pages with the prompt of a running request that has not yet computed them waits for those pages
instead of computing the same KV beside it: identical prompts submitted together (``n`` samples of one
prompt, a long system prompt) are prefilled once, and the others admitted with the pages as a cache hit.
It only waits where the pages it would take from the other request are at least half of what it has left
to compute; later requests are admitted past it meanwhile. The wait is short: a prefill computes its
prompt in order, so the shared pages are among the first it publishes.

With ``policy="priority"`` requests are served by ``(Request.priority, arrival)``, lower first (vLLM's priority
policy): the queue is kept in that order, running requests are scheduled in it and preempted from its far end, and
a waiting request that finds no pages or no sequence slot preempts the worst running request ranked below it
(taking it out of the step being built) until it fits or none is left.

With a LoRA manager (``lora``), an admitted request that names an adapter takes a slot for it (the adapter copied
into a free or idle slot when it is not in one); when every slot is held by running requests of other adapters it
stays queued, and later requests may be admitted past it. Finishing, aborting and preemption give the slot back.

With ``lazy_prefill_alloc`` (the hybrid KV manager), an admitted request gets pages for its first
chunk only; later chunks grow it. Sliding-window layers then never hold more than a window plus a
chunk, instead of the whole prompt until its pages leave the window.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv import BlockManager
from .request import Request, Status

# Scheduler policies: first come first served, or by (priority, arrival)
POLICIES = ("fcfs", "priority")


@dataclass
class ScheduledBatch:
    """The work of one step: ``num_new_tokens[i]`` tokens of ``requests[i]`` are fed, starting at
    its ``num_computed_tokens``."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        chunk_boundary: int | None = None,
        lazy_prefill_alloc: bool = False,
        share_prefills: bool = False,
        policy: str = "fcfs",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._arrivals = 0
        # multi-LoRA (lora.LoRAManager, set by the Engine): a request takes its adapter's slot when admitted
        self.lora = None
        if share_prefills and not hasattr(block_manager, "published_tokens"):
            raise ValueError("share_prefills needs a block manager with published_tokens (the dense BlockManager)")
        self.bm = block_manager
        self.share_prefills = share_prefills
        self.chunk_boundary = chunk_boundary
        self.lazy_prefill_alloc = lazy_prefill_alloc
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        if req._arrival < 0:
            req._arrival = self._arrivals
            self._arrivals += 1
        if self.policy == "fcfs":
            self.waiting.append(req)
        else:
            self._insert(req)

    @staticmethod
    def _key(req: Request) -> tuple[int, int]:
        return req.priority, req._arrival

    def _insert(self, req: Request) -> None:
        """Put ``req`` into the (priority-ordered) queue after every request that ranks before it."""
        key, w = self._key(req), self.waiting
        i = len(w)
        while i > 0 and self._key(w[i - 1]) > key:
            i -= 1
        w.insert(i, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                self.bm.free(req.request_id)
                self._release_lora(req)
                return req
        return None

    def _release_lora(self, req: Request) -> None:
        """``req`` (finished, aborted or preempted) gives its LoRA slot back."""
        if req._lora_slot >= 0:
            self.lora.release(req._lora_slot)
            req._lora_slot = -1

    def _cut(self, start: int, n: int) -> int:
        """``n`` tokens from ``start``, shortened to end on the next multiple of ``chunk_boundary``."""
        b = self.chunk_boundary
        if b is None or n <= 1:
            return n
        return min(n, (start // b + 1) * b - start)

    def _preempt(self, req: Request) -> None:
        self.bm.free(req.request_id)
        self._release_lora(req)
        req.spec_token_ids.clear()
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        if self.policy == "fcfs":
            self.waiting.appendleft(req)
        else:
            self._insert(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        # 1. Running requests, oldest (or best-ranked) first; preempt from the other end when pages run short.
        pending = deque(self.running if self.policy == "fcfs" else sorted(self.running, key=self._key))
        kept: list[Request] = []
        while pending:
            req = pending.popleft()
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = req.spec_token_ids
            if draft:  # speculative decoding: the draft rides along where budget and pages allow, else it goes
                del draft[max(budget - n, 0):]
                if draft and not self.bm.grow(req.request_id, req.num_computed_tokens + n + len(draft)):
                    draft.clear()
                n += len(draft)
            if n == 0:
                # No budget left, or (async scheduling) every known token is computed and the request
                # only awaits the read-back of its last sampled token, which ends it by length.
                kept.append(req)
                continue
            n = self._cut(req.num_computed_tokens, n)
            while not self.bm.grow(req.request_id, req.num_computed_tokens + n):
                victim = pending.pop() if pending else req
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
                kept.append(req)
        self.running = kept

        # 2. Admit waiting requests; none after a preemption this step (the pool is tight).
        sources: list[Request] | None = None  # share_prefills: running requests whose prompt pages are to come
        i = 0
        displaced = 0  # requests preempted below for better-ranked ones (policy "priority")
        while i < len(self.waiting) and budget > 0 and len(batch.preempted) == displaced:
            req = self.waiting[i]
            if len(self.running) >= self.max_num_seqs:
                freed = self._displace(req, batch)
                if freed is None:
                    break
                budget += freed
                displaced += 1
            tokens = req.all_token_ids
            # a request that reports its prompt's log-probabilities, or pools over all of it, computes every position
            most = 0 if req.params.prompt_logprobs is not None or req.pooling == "mean" else len(tokens) - 1
            if self.share_prefills and most:
                if sources is None:  # only in steps that admit: a decode-only step pays nothing
                    sources = [r for r in self.running if self._publishes_later(r)]
                if sources and self._wait_for_prefill(req, sources):
                    i += 1
                    continue
            room = len(tokens)
            if self.lazy_prefill_alloc:
                room = min(room, self.bm.match_prefix(tokens, max_cached_tokens=most, extra_key=req.cache_salt)
                           + budget)
            cached = self.bm.allocate(req.request_id, tokens, room, max_cached_tokens=most, extra_key=req.cache_salt)
            if cached is None:
                freed = self._displace(req, batch)
                if freed is None:
                    break
                budget += freed
                displaced += 1
                continue  # the same request again, with the victim's pages free
            remaining = len(tokens) - cached
            if remaining > budget and not self.enable_chunked_prefill and batch.requests:
                self.bm.free(req.request_id)
                break
            n = self._cut(cached, min(remaining, budget))
            if cached + n > room and not self.bm.grow(req.request_id, cached + n):
                self.bm.free(req.request_id)
                break
            if req.lora is not None:  # its adapter's slot (copied in if need be); none free: later requests may go
                slot = self.lora.acquire(req.lora)
                if slot is None:
                    self.bm.free(req.request_id)
                    i += 1
                    continue
                req._lora_slot = slot
            del self.waiting[i]
            if sources is not None and self._publishes_later(req):
                sources.append(req)
            req.num_computed_tokens = cached
            req.status = Status.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
                req.metrics.num_cached_tokens = cached
                cpu_hit = getattr(self.bm, "cpu_hit_tokens", None)  # the dense manager's CPU tier
                cpu = cpu_hit(req.request_id) if cpu_hit is not None else 0
                req.metrics.num_cpu_cached_tokens = cpu
                req.metrics.num_gpu_cached_tokens = cached - cpu
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _displace(self, req: Request, batch: ScheduledBatch) -> int | None:
        """Policy "priority": preempt the worst-ranked running request if it ranks below ``req`` (out of ``batch``
        too, if it is in it); returns the budget its tokens in the batch held, or None (no such request, or FCFS)."""
        if self.policy == "fcfs" or not self.running:
            return None
        victim = max(self.running, key=self._key)
        if self._key(victim) <= self._key(req):
            return None
        self.running.remove(victim)
        freed = 0
        for j, r in enumerate(batch.requests):
            if r is victim:
                freed = batch.num_new_tokens[j]
                del batch.requests[j], batch.num_new_tokens[j]
                break
        self._preempt(victim)
        batch.preempted.append(victim)
        return freed

    def _publishes_later(self, req: Request) -> bool:
        """Whether running ``req`` has full prompt pages that the prefix cache does not show yet."""
        ps = self.bm.page_size
        return self.bm.published_tokens(req.request_id) < len(req.prompt_token_ids) // ps * ps

    def _wait_for_prefill(self, req: Request, sources: list[Request]) -> bool:
        """``share_prefills``: whether ``req`` should wait for pages ``sources`` will publish (those of the same
        prefix-cache salt: the same LoRA adapter or none)."""
        tokens = req.all_token_ids
        ps = self.bm.page_size
        cap = (len(tokens) - 1) // ps  # pages a cache hit may cover (one token is always computed)
        shared = 0
        for src in sources:
            if src.cache_salt != req.cache_salt:
                continue
            shared = max(shared, _common_pages(tokens, src.prompt_token_ids, min(cap, len(src.prompt_token_ids) // ps),
                                               ps))
        if shared == 0:
            return False
        cached = self.bm.match_prefix(tokens, max_cached_tokens=len(tokens) - 1, extra_key=req.cache_salt) // ps
        gain = (shared - cached) * ps
        return gain > 0 and 2 * gain >= len(tokens) - cached * ps

    def finish(self, req: Request, reason: str) -> None:
        """End ``req`` and release its pages. With async scheduling a request can end while back in
        the queue: it was preempted after the step that sampled its last token was launched."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.bm.free(req.request_id)
            self._release_lora(req)
        else:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()


def _common_pages(a: list[int], b: list[int], n: int, ps: int) -> int:
    """How many of the first ``n`` pages of ``ps`` tokens ``a`` and ``b`` have equal (a binary search over
    list-slice comparisons, which run in C)."""
    if n <= 0 or a[:ps] != b[:ps]:
        return 0
    if a[: n * ps] == b[: n * ps]:
        return n
    lo, hi = 1, n - 1  # the first lo pages are equal; the first hi + 1 are not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * ps] == b[: mid * ps]:
            lo = mid
        else:
            hi = mid - 1
    return lo
